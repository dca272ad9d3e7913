"""The few CUDA driver calls that end a capture Paddle could not end (NOTE [ Ending a broken
capture ] in backends/cuda.py), through ctypes: Paddle exposes none of them.

Every function returns None (or False) instead of raising when the driver cannot be reached, so
that a CPU build and a machine without libcuda import and run this module unharmed.
"""

import ctypes
import logging
import os

__all__ = ["NONE", "ACTIVE", "INVALIDATED", "capture_status", "end_stream_capture", "begin_stream_capture",
           "clear_last_error"]

logger = logging.getLogger(__name__)

#: CUstreamCaptureStatus (cuda.h), the same values as cudaStreamCaptureStatus.
NONE, ACTIVE, INVALIDATED = 0, 1, 2
#: CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: the mode autocudagraph captures in (mode="thread_local").
_THREAD_LOCAL = 1

_libs = {}


def _load(names):
    """The first of ``names`` already loaded in this process (RTLD_NOLOAD), else the first loadable."""
    for mode in (getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1), None):
        for name in names:
            try:
                return ctypes.CDLL(name) if mode is None else ctypes.CDLL(name, mode=mode)
            except OSError:
                continue
    return None


def _driver():
    if "driver" not in _libs:
        _libs["driver"] = _load(("libcuda.so.1", "libcuda.so"))
    return _libs["driver"]


def _runtime():
    """The CUDA runtime Paddle loaded (never a second copy: its error state would be another)."""
    if "runtime" not in _libs:
        lib = None
        flags = getattr(os, "RTLD_NOLOAD", None)
        if flags is not None:
            for name in ("libcudart.so.12", "libcudart.so.11.0", "libcudart.so.13", "libcudart.so"):
                try:
                    lib = ctypes.CDLL(name, mode=flags | getattr(os, "RTLD_LAZY", 1))
                    break
                except OSError:
                    continue
        _libs["runtime"] = lib
    return _libs["runtime"]


def capture_status(stream):
    """NONE, ACTIVE or INVALIDATED for the stream handle ``stream`` (an int), or None when unknown."""
    lib = _driver()
    if lib is None or not stream:
        return None
    status = ctypes.c_int(-1)
    try:
        rc = lib.cuStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(status))
    except AttributeError:
        return None
    return status.value if rc == 0 else None


def end_stream_capture(stream):
    """Ends the stream's capture (an invalidated one included) and destroys what it returned;
    True when the stream is no longer capturing."""
    lib = _driver()
    if lib is None:
        return False
    graph = ctypes.c_void_p()
    rc = lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph))
    if graph.value:
        lib.cuGraphDestroy(graph)
    logger.debug("cuStreamEndCapture on a broken capture returned %s", rc)
    return capture_status(stream) == NONE


def begin_stream_capture(stream):
    """Starts an empty thread-local capture on the stream; True on success."""
    lib = _driver()
    if lib is None:
        return False
    begin = getattr(lib, "cuStreamBeginCapture_v2", None)
    if begin is None:
        return False
    rc = begin(ctypes.c_void_p(stream), ctypes.c_int(_THREAD_LOCAL))
    return rc == 0


def clear_last_error():
    """Clears the CUDA runtime's last error (a capture violation leaves one that the next kernel
    launch check would report)."""
    lib = _runtime()
    if lib is not None:
        lib.cudaGetLastError()

