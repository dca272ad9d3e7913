from setuptools import find_packages, setup

setup(
    name="paddlefleet",
    version="0.1.0",
    description="Automatic CUDA graphs for PaddlePaddle training (autocudagraph)",
    packages=find_packages(include=["paddlefleet", "paddlefleet.*"]),
    python_requires=">=3.8",
    # paddlepaddle or paddlepaddle-gpu: the user's choice, so neither is forced here.
    install_requires=["numpy"],
    extras_require={
        "test": ["paddlepaddle>=2.6", "pytest", "parameterized"],
        "bench": ["matplotlib"],  # tools/bench.py's plot; the bench runs without it and says so
    },
)
