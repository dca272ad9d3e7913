"""paddlefleet: PaddlePaddle-native training extensions."""

# NOTE [ numpy.random before paddle ]: with Paddle 2.6.2 and NumPy 2.4, importing numpy.random
# after paddle crashes the process (SIGSEGV in inflateReset2: two zlib builds; measured here).
# Importing it first is harmless and keeps `python -m paddlefleet.cudagraph demo` alive.
import numpy.random  # noqa: F401

__version__ = "0.1.0"
