import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

# NOTE [ Two paddlefleets ] in _paddlefleet_cudagraph_finder.py.
PTH = "paddlefleet_cudagraph.pth"


class BuildPyWithPth(build_py):
    """Puts paddlefleet_cudagraph.pth at the top of a regular install (site-packages); an editable
    install gets setuptools' own finder instead, which resolves paddlefleet.cudagraph the same way."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


setup(
    # Not "paddlefleet": that is the distribution name of Paddle's own PaddleFleet, and pip would
    # treat the two as one (installing one would uninstall the other).
    name="paddlefleet-cudagraph",
    version="0.1.0",
    description="Automatic CUDA graphs for PaddlePaddle training (autocudagraph)",
    # paddlefleet is a namespace package (PEP 420): there is no paddlefleet/__init__.py, so
    # importlib.util.find_spec("paddlefleet").has_location is False when only this project is
    # installed, as PaddleFormers' probe for Paddle's PaddleFleet expects.
    packages=find_namespace_packages(include=["paddlefleet.cudagraph", "paddlefleet.cudagraph.*"]),
    py_modules=["_paddlefleet_cudagraph_finder"],
    cmdclass={"build_py": BuildPyWithPth},
    python_requires=">=3.8",
    # paddlepaddle or paddlepaddle-gpu: the user's choice, so neither is forced here.
    install_requires=["numpy"],
    extras_require={
        "test": ["paddlepaddle>=2.6", "pytest", "parameterized"],
        "bench": ["matplotlib"],  # tools/bench.py's plot; the bench runs without it and says so
        # tests/test_real_models.py's LLaMA tests. PaddleFormers' full dependency set is large:
        # requirements-real-models.txt lists what importing its LLaMA needs (install with --no-deps).
        "real-models": ["paddleformers==1.2.0"],
    },
)
