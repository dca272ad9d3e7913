"""Lets ``import paddlefleet.cudagraph`` find this project when Paddle's own PaddleFleet is installed too.

NOTE [ Two paddlefleets ]
This project ships ``paddlefleet.cudagraph`` inside a namespace package ``paddlefleet`` (PEP 420,
no ``paddlefleet/__init__.py``). Paddle's PaddleFleet is a regular package of the same name, and a
regular package wins over namespace portions wherever each sits on ``sys.path``, so with both
installed ``paddlefleet`` is Paddle's, and Python looks for ``paddlefleet.cudagraph`` only in its
directory. This module adds one finder at the END of ``sys.meta_path`` (installed at start-up by
``paddlefleet_cudagraph.pth``, which a regular install puts in site-packages) that answers for the
single name ``paddlefleet.cudagraph`` with this project's directory, and only after Python's own
finders found nothing: a ``paddlefleet.cudagraph`` that Paddle's PaddleFleet ships itself is never
shadowed. setuptools' editable install (``pip install -e .``) appends a finder that does the same.
"""

import importlib.machinery
import os
import sys

NAME = "paddlefleet.cudagraph"
HOME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paddlefleet")


class CudagraphFinder:
    """A meta path finder for ``paddlefleet.cudagraph`` alone; its submodules are found through
    its ``__path__`` as usual."""

    home = HOME

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [cls.home])


def install():
    """Appends the finder to ``sys.meta_path`` once (by name: the module may be imported again)."""
    if not any(getattr(f, "__name__", None) == "CudagraphFinder" for f in sys.meta_path):
        sys.meta_path.append(CudagraphFinder)


install()
