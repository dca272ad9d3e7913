import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# The project's home page. It has no public repository yet (no git remote): set this when it has
# one; None leaves Home-page out of the metadata rather than pointing at a wrong page.
URL = None

# NOTE [ Two paddlefleets ] in _paddlefleet_cudagraph_finder.py.
PTH = "paddlefleet_cudagraph.pth"

# NOTE [ Uninstalling a namespace directory ]
# pip uninstall removes the files a wheel's RECORD lists, and a whole directory only when it is
# the parent of a listed file and every file under it is listed. No file of ours sits directly in
# the namespace directory paddlefleet/ (it has no __init__.py), so pip removed paddlefleet/cudagraph
# and left an empty paddlefleet/ behind, which Python still imports as a namespace package. This
# marker is a file of ours in paddlefleet/: pip then removes the directory with the rest when
# nothing else is in it, and leaves it (with its files) where Paddle's PaddleFleet lives there too.
MARKER = os.path.join("paddlefleet", "paddlefleet_cudagraph.txt")
MARKER_TEXT = ("Installed by paddlefleet-cudagraph so that `pip uninstall paddlefleet-cudagraph` removes this "
               "namespace directory when nothing else is in it (NOTE [ Uninstalling a namespace directory ] in "
               "its setup.py).\n")


class BuildPyWithPth(build_py):
    """Puts paddlefleet_cudagraph.pth at the top of a regular install (site-packages) and the
    marker in paddlefleet/; an editable install gets setuptools' own finder instead, which
    resolves paddlefleet.cudagraph the same way, and installs no directory to remove."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH, os.path.join(self.build_lib, PTH))
            with open(os.path.join(self.build_lib, MARKER), "w") as fh:
                fh.write(MARKER_TEXT)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs += [os.path.join(self.build_lib, PTH), os.path.join(self.build_lib, MARKER)]
        return outputs


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as fh:
    LONG_DESCRIPTION = fh.read()


setup(
    # Not "paddlefleet": that is the distribution name of Paddle's own PaddleFleet, and pip would
    # treat the two as one (installing one would uninstall the other).
    name="paddlefleet-cudagraph",
    version="0.1.0",
    description="Automatic CUDA graphs for PaddlePaddle training (autocudagraph)",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    license="Apache-2.0",  # as PaddlePaddle's; the text is in LICENSE
    license_files=["LICENSE"],
    url=URL,
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # paddlefleet is a namespace package (PEP 420): there is no paddlefleet/__init__.py, so
    # importlib.util.find_spec("paddlefleet").has_location is False when only this project is
    # installed, as PaddleFormers' probe for Paddle's PaddleFleet expects.
    packages=find_namespace_packages(include=["paddlefleet.cudagraph", "paddlefleet.cudagraph.*"]),
    # built on first use against the installed Paddle (NOTE [ Compiled tensor reads ] in native/__init__.py)
    package_data={"paddlefleet.cudagraph.native": ["tensor_reads.cc"]},
    py_modules=["_paddlefleet_cudagraph_finder"],
    cmdclass={"build_py": BuildPyWithPth},
    # The README's requirement. The sources parse as Python 3.10 (tests/integration/test_packaging.py checks it);
    # the suite runs on 3.11.
    python_requires=">=3.10",
    # paddlepaddle or paddlepaddle-gpu: the user's choice, so neither is forced here.
    install_requires=["numpy"],
    extras_require={
        "test": ["paddlepaddle>=2.6", "pytest", "parameterized"],
        "bench": ["matplotlib"],  # tools/bench.py's plot; the bench runs without it and says so
        # tests/integration/test_real_models.py's LLaMA tests. PaddleFormers' full dependency set is large:
        # requirements-real-models.txt lists what importing its LLaMA needs (install with --no-deps).
        "real-models": ["paddleformers==1.2.0"],
    },
)
