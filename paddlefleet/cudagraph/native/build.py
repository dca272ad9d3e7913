"""Builds tensor_reads.cc against the installed Paddle, once per machine, Python and Paddle, into a cache
(NOTE [ Compiled tensor reads ] in native/__init__.py). Policy only: no Paddle state is read but paths and
versions."""

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import paddle

__all__ = ["ENV_CACHE", "NotBuilt", "cache_dir", "built_module"]

#: Where built modules are kept (default ``$XDG_CACHE_HOME/paddlefleet`` or ``~/.cache/paddlefleet``).
ENV_CACHE = "PADDLEFLEET_CACHE_DIR"

NAME = "_tensor_reads"
COMPILE_TIMEOUT_S = 300


class NotBuilt(Exception):
    """Why the module could not be built or loaded on this machine (a sentence for status())."""


def source():
    """The path of tensor_reads.cc (installed with the package)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensor_reads.cc")


def cache_dir():
    root = os.environ.get(ENV_CACHE)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "paddlefleet")
    return os.path.join(root, "native")


def _paddle_dirs():
    """``(include dirs, directory of libpaddle.so)`` of the installed Paddle."""
    root = os.path.dirname(os.path.abspath(paddle.__file__))
    include = os.path.join(root, "include")
    if not os.path.isfile(os.path.join(include, "paddle", "phi", "api", "include", "tensor.h")):
        raise NotBuilt(f"Paddle's C++ headers are not installed ({include} has no paddle/phi/api/include/tensor.h)")
    base = os.path.join(root, "base")
    if not os.path.isfile(os.path.join(base, "libpaddle.so")):
        raise NotBuilt(f"no libpaddle.so in {base}")
    return [include, os.path.join(include, "third_party")], base


def _tag():
    """What the built module depends on: the source, this Paddle (version and commit) and this Python."""
    with open(source(), "rb") as fh:
        digest = hashlib.sha256(fh.read())
    commit = getattr(getattr(paddle, "version", None), "commit", "")
    for part in (paddle.__version__, str(commit), sys.implementation.cache_tag, sysconfig.get_platform(),
                 str(paddle.is_compiled_with_cuda())):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:20]


def _compiler():
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise NotBuilt("no C++ compiler found (set CXX, or install g++)")


def _compile(target):
    includes, base = _paddle_dirs()
    python_include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(python_include, "Python.h")):
        raise NotBuilt(f"Python's headers are not installed (no Python.h in {python_include})")
    command = [_compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-DPADDLE_WITH_CUSTOM_KERNEL",
               *[f"-I{d}" for d in includes], f"-I{python_include}", source(), "-o", target, f"-L{base}",
               # libpaddle.so is always loaded before this module (paddle is imported first), so no rpath: the
               # loader finds it by its soname; --no-as-needed keeps it where the symbols live in its dependencies.
               "-Wl,--no-as-needed", "-l:libpaddle.so", "-Wl,--as-needed"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NotBuilt(f"compiling tensor_reads.cc failed: {type(err).__name__}: {err}") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise NotBuilt(f"compiling tensor_reads.cc failed (exit {done.returncode}): {tail[:400]}")


def _load(path):
    loader = importlib.machinery.ExtensionFileLoader(NAME, path)
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def built_module():
    """The compiled module, built first where the cache has none for this source, Paddle and Python.

    Raises:
        NotBuilt: no compiler, no headers, a failed compile or load.
    """
    directory = cache_dir()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    path = os.path.join(directory, f"{NAME}-{_tag()}{suffix}")
    if not os.path.isfile(path):
        try:
            os.makedirs(directory, exist_ok=True)
            fd, partial = tempfile.mkstemp(prefix=f".{NAME}-", suffix=suffix, dir=directory)
            os.close(fd)
        except OSError as err:
            raise NotBuilt(f"cannot write the cache {directory} ({err}); set {ENV_CACHE}") from None
        try:
            _compile(partial)
            os.replace(partial, path)  # atomic: a concurrent build replaces it with the same module
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    try:
        return _load(path)
    except ImportError as err:
        raise NotBuilt(f"loading {path} failed: {err}") from None
