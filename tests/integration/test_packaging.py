"""Packaging: setup.py's metadata (long description, license, Python version as the README
says), and a regular (non-editable) install into a fresh venv that `pip uninstall` removes
completely: no empty paddlefleet/ left behind for Python to import as a namespace package."""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ["setup.py", "README.md", "LICENSE", "_paddlefleet_cudagraph_finder.py", "paddlefleet_cudagraph.pth"]


def setup_text():
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as fh:
        return fh.read()


class MetadataTest(unittest.TestCase):
    def test_python_requires_is_what_the_readme_says_and_the_sources_parse_there(self):
        with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
            readme = fh.read()
        said = re.search(r"Python (3\.\d+)\+", readme)
        self.assertIsNotNone(said, "the README states the Python it needs")
        self.assertIn(f'python_requires=">={said.group(1)}"', setup_text())
        minimum = tuple(int(p) for p in said.group(1).split("."))
        files = glob.glob(os.path.join(REPO, "paddlefleet", "**", "*.py"), recursive=True)
        for path in files + [os.path.join(REPO, f) for f in SOURCES if f.endswith(".py")]:
            with open(path, encoding="utf-8") as fh:
                ast.parse(fh.read(), path, feature_version=minimum)

    def test_long_description_license_and_url(self):
        text = setup_text()
        for needle in ("long_description=LONG_DESCRIPTION", 'long_description_content_type="text/markdown"',
                       'license="Apache-2.0"', 'license_files=["LICENSE"]', "url=URL"):
            self.assertIn(needle, text)
        with open(os.path.join(REPO, "LICENSE"), encoding="utf-8") as fh:
            self.assertIn("Apache License", fh.read(300))


def _copy_sources(dest):
    for name in SOURCES:
        shutil.copy(os.path.join(REPO, name), dest)
    shutil.copytree(os.path.join(REPO, "paddlefleet"), os.path.join(dest, "paddlefleet"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


class InstallUninstallTest(unittest.TestCase):
    """Slow-ish (a venv, ~15 s); needs pip to fetch `wheel` (setuptools < 70 cannot build a wheel
    without it)."""

    #: The fresh venv's own view: a PYTHONPATH that names a checkout would find that checkout's package first.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def pip(self, *args, check=True):
        proc = subprocess.run([self.python, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                              text=True, timeout=300, cwd=self.tmp, env=self.env)
        if check:
            self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])
        return proc

    def probe(self):
        code = ("import importlib.util as u, json; s = u.find_spec('paddlefleet'); "
                "c = u.find_spec('paddlefleet.cudagraph') if s else None; "
                "print(json.dumps([s is not None, c.origin if c else None]))")
        proc = subprocess.run([self.python, "-c", code], capture_output=True, text=True, timeout=60, cwd=self.tmp,
                              env=self.env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        return proc.stdout.strip()

    def test_a_regular_install_is_removed_completely(self):
        self.tmp = tempfile.mkdtemp(prefix="pkg_test_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        venv, src = os.path.join(self.tmp, "venv"), os.path.join(self.tmp, "src")
        os.makedirs(src)
        _copy_sources(src)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
        self.python = os.path.join(venv, "bin", "python")
        has_wheel = subprocess.run([self.python, "-c", "import wheel"], capture_output=True).returncode == 0
        if not has_wheel and self.pip("install", "-q", "wheel", check=False).returncode != 0:
            self.skipTest("pip could not install 'wheel' into the fresh venv (no package index reachable), and "
                          "this setuptools cannot build a wheel without it")
        self.pip("install", "-q", "--no-deps", "--no-build-isolation", src)
        site = subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        installed = sorted(n for n in os.listdir(site) if "paddlefleet" in n)
        self.assertEqual(installed, ["_paddlefleet_cudagraph_finder.py", "paddlefleet",
                                     "paddlefleet_cudagraph-0.1.0.dist-info", "paddlefleet_cudagraph.pth"])
        self.assertEqual(self.probe(), f'[true, "{site}/paddlefleet/cudagraph/__init__.py"]')
        self.assertFalse(os.path.exists(os.path.join(site, "paddlefleet", "__init__.py")), "a namespace package")
        self.assertTrue(os.path.isfile(os.path.join(site, "paddlefleet", "cudagraph", "native", "tensor_reads.cc")),
                        "the compiled reads' source is installed (built on first use)")
        self.pip("uninstall", "-y", "-q", "paddlefleet-cudagraph")
        self.assertEqual(sorted(n for n in os.listdir(site) if "paddlefleet" in n), [])
        self.assertEqual(self.probe(), "[false, null]")


if __name__ == "__main__":
    unittest.main()
