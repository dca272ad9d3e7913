"""Coexistence with Paddle's own PaddleFleet and with PaddleFormers' probe for it.

``paddlefleet`` here is a namespace package (no ``paddlefleet/__init__.py``); NOTE [ Two
paddlefleets ] in ``_paddlefleet_cudagraph_finder.py`` says how ``paddlefleet.cudagraph`` is still
found when Paddle's PaddleFleet (a regular ``paddlefleet`` package) is installed too. Every check
runs in a fresh interpreter (``sys.executable``) so that this process's imports do not decide it.

Stand-in PaddleFleet: a regular package ``paddlefleet/__init__.py`` + ``parallel_state.py`` in a
temporary directory, placed on ``sys.path`` before or after ours.
"""

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINDER = "_paddlefleet_cudagraph_finder.py"
PTH = "paddlefleet_cudagraph.pth"

# What the child interpreter reports, as JSON on its last line. PADDLEFORMERS_PROBE reproduces
# paddleformers/utils/import_utils.py of PaddleFormers 1.2.0: is_paddlefleet_available() is
# is_package_available("paddlefleet"), i.e. find_spec(name) is not None and spec.has_location.
PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys

    def paddleformers_probe():
        spec = importlib.util.find_spec("paddlefleet")
        return spec is not None and spec.has_location

    mode, theirs = sys.argv[1], sys.argv[2]
    if mode == "theirs_first":
        sys.path.insert(0, theirs)
    elif mode == "theirs_last":
        sys.path.append(theirs)
    out = {"probe": paddleformers_probe()}
    ours = importlib.util.find_spec("paddlefleet.cudagraph")
    out["cudagraph_origin"] = None if ours is None else ours.origin
    if mode != "alone":
        import paddlefleet, paddlefleet.parallel_state
        out["paddlefleet_file"] = paddlefleet.__file__
    import paddlefleet.cudagraph as cg
    out["version"] = getattr(cg, "__version__", None)
    out["has_autocudagraph"] = callable(getattr(cg, "autocudagraph", None))
    out["is_paddles"] = bool(getattr(cg, "PADDLES_OWN", False))
    print(json.dumps(out))
    """
)


def _child(mode, theirs, extra_path=(), cwd=None):
    """Runs PROBE in a fresh interpreter without PYTHONPATH; ``extra_path`` entries are processed
    like site-packages (their .pth files run), as a regular install's would be."""
    prelude = "import site\n" + "".join(f"site.addsitedir({p!r})\n" for p in extra_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", prelude + PROBE, mode, theirs],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({mode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def installed_version():
    """The version of paddlefleet-cudagraph installed in this interpreter, or None (source tree)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('paddlefleet-cudagraph'))"],
        cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=120,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def _stand_in(root, own_cudagraph=False):
    """A stand-in for Paddle's PaddleFleet: a regular package with parallel_state.py."""
    pkg = os.path.join(root, "paddlefleet")
    os.makedirs(pkg)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("STAND_IN = True\n")
    with open(os.path.join(pkg, "parallel_state.py"), "w") as f:
        f.write("def get_tensor_model_parallel_world_size():\n    return 1\n")
    if own_cudagraph:
        with open(os.path.join(pkg, "cudagraph.py"), "w") as f:
            f.write("PADDLES_OWN = True\n")
    return root


def _regular_install_layout(site_dir):
    """site-packages as ``pip install .`` leaves it (setup.py's BuildPyWithPth): the finder module,
    the .pth that imports it, and paddlefleet/cudagraph (a link to this source tree)."""
    os.makedirs(os.path.join(site_dir, "paddlefleet"))
    shutil.copy(os.path.join(REPO, FINDER), site_dir)
    shutil.copy(os.path.join(REPO, PTH), site_dir)
    os.symlink(os.path.join(REPO, "paddlefleet", "cudagraph"), os.path.join(site_dir, "paddlefleet", "cudagraph"))
    return site_dir


@functools.lru_cache(maxsize=None)
def _alone_in_the_source_tree():
    """PROBE's report in a fresh interpreter started in this source tree, with no PaddleFleet (one run, read by
    the tests of NamespacePackageTest)."""
    return _child("alone", "", cwd=REPO)


class NamespacePackageTest(unittest.TestCase):
    """The source tree: paddlefleet is a namespace package and the version lives in cudagraph."""

    def test_paddlefleet_has_no_init_and_the_version_moved_to_cudagraph(self):
        self.assertFalse(os.path.exists(os.path.join(REPO, "paddlefleet", "__init__.py")))
        out = _alone_in_the_source_tree()
        self.assertEqual(out["version"], "0.1.0")
        self.assertEqual(out["cudagraph_origin"], os.path.join(REPO, "paddlefleet", "cudagraph", "__init__.py"))

    def test_paddleformers_probe_is_false_with_only_us(self):
        out = _alone_in_the_source_tree()
        self.assertIs(out["probe"], False)
        self.assertTrue(out["has_autocudagraph"])

    def test_setup_names_a_distribution_of_its_own(self):
        with open(os.path.join(REPO, "setup.py")) as f:
            text = f.read()
        self.assertIn('name="paddlefleet-cudagraph"', text)
        self.assertIn("find_namespace_packages", text)


class StandInPaddleFleetTest(unittest.TestCase):
    """A regular install's layout next to a stand-in PaddleFleet, before and after ours."""

    def setUp(self):
        if installed_version() is not None:
            self.skipTest("paddlefleet-cudagraph is installed in this interpreter and answers first; "
                          "InstalledPackageTest checks the installed package instead")
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.site = _regular_install_layout(os.path.join(self.tmp, "site"))

    def _check_ours_imports(self, mode):
        theirs = _stand_in(os.path.join(self.tmp, "theirs"))
        out = _child(mode, theirs, extra_path=[self.site], cwd=self.tmp)
        # Paddle's PaddleFleet is there, so PaddleFormers' probe is True and its imports work.
        self.assertIs(out["probe"], True)
        self.assertEqual(out["paddlefleet_file"], os.path.join(theirs, "paddlefleet", "__init__.py"))
        # ... and paddlefleet.cudagraph is still ours.
        self.assertEqual(out["cudagraph_origin"], os.path.join(self.site, "paddlefleet", "cudagraph", "__init__.py"))
        self.assertEqual(out["version"], "0.1.0")
        self.assertTrue(out["has_autocudagraph"])

    def test_stand_in_before_ours(self):
        self._check_ours_imports("theirs_first")

    def test_stand_in_after_ours(self):
        self._check_ours_imports("theirs_last")

    def test_alone_the_probe_is_false(self):
        out = _child("alone", "", extra_path=[self.site], cwd=self.tmp)
        self.assertIs(out["probe"], False)
        self.assertEqual(out["cudagraph_origin"], os.path.join(self.site, "paddlefleet", "cudagraph", "__init__.py"))

    def test_a_paddlefleet_cudagraph_of_paddles_own_is_never_shadowed(self):
        # Paddle's PaddleFleet may ship a paddlefleet.cudagraph module of its own (recent sources do):
        # the finder answers only after Python's finders found nothing, so Paddle's module stays
        # Paddle's (documented in docs/guides/recipes.md).
        theirs = _stand_in(os.path.join(self.tmp, "theirs"), own_cudagraph=True)
        out = _child("theirs_last", theirs, extra_path=[self.site], cwd=self.tmp)
        self.assertTrue(out["is_paddles"])
        self.assertEqual(out["cudagraph_origin"], os.path.join(theirs, "paddlefleet", "cudagraph.py"))

    def test_without_the_finder_a_regular_paddlefleet_hides_ours(self):
        # The control: what the .pth's finder prevents (plain PEP 420 resolution).
        os.remove(os.path.join(self.site, PTH))
        theirs = _stand_in(os.path.join(self.tmp, "theirs"))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        code = (f"import site, sys; site.addsitedir({self.site!r}); sys.path.append({theirs!r}); "
                "import paddlefleet.cudagraph")
        proc = subprocess.run([sys.executable, "-c", code], cwd=self.tmp, env=env, capture_output=True, text=True,
                              timeout=300)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("No module named 'paddlefleet.cudagraph'", proc.stderr)


class InstalledPackageTest(unittest.TestCase):
    """The package as installed in this interpreter (CI's `pip install -e .`, or a regular install)."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        if installed_version() is None:
            self.skipTest("paddlefleet-cudagraph is not installed in this interpreter (tests run from the source "
                          "tree); CI's `pip install -e .` runs these")

    def test_installed_paddlefleet_is_a_namespace_package(self):
        out = _child("alone", "", cwd=self.tmp)
        self.assertIs(out["probe"], False)
        self.assertTrue(out["has_autocudagraph"])

    def test_installed_package_imports_next_to_a_stand_in(self):
        for mode in ("theirs_first", "theirs_last"):
            theirs = _stand_in(os.path.join(self.tmp, mode))
            out = _child(mode, theirs, cwd=self.tmp)
            self.assertIs(out["probe"], True, mode)
            self.assertEqual(out["paddlefleet_file"], os.path.join(theirs, "paddlefleet", "__init__.py"), mode)
            self.assertTrue(out["has_autocudagraph"], mode)
            self.assertNotEqual(out["cudagraph_origin"], None, mode)
            self.assertFalse(out["cudagraph_origin"].startswith(theirs), mode)


if __name__ == "__main__":
    unittest.main()
