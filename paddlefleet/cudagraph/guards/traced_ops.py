"""The Paddle entry points an op trace sees, wrapped while a trace needs them (for the rest of the
process on the simulated backend) and switched per thread (NOTE [ Traced entry points ]).

NOTE [ Traced entry points ]
An op trace (guards/host_reads.py) must see every call that launches a kernel or picks the tensor
a kernel reads: the public ``paddle._C_ops`` / ``_legacy_C_ops`` functions, ``paddle.to_tensor``,
``Tensor.__getitem__`` / ``__setitem__`` and every method of ``paddle.Tensor`` that Paddle binds in
C++ (``x[k]``'s ``_getitem_dygraph``, ``clone``, ``detach``, ``copy_``, the operators, the ``grad``
getter), which run without any ``_C_ops`` call. Those methods are not listed by hand: ``install``
enumerates ``paddle.Tensor``'s attributes and wraps every one that is bound in C++ and every Python
function of the class (``_slice`` makes a tensor through ``core.eager.Tensor``), except a small
explicit set that reads only metadata (``HARMLESS``, each with its reason) and the host reads that
``host_guard`` refuses during a capture (``REFUSED``); tests/guards/test_traced_ops.py enumerates
them on both Paddles and fails when Paddle grows a C++ attribute of neither kind. A method called
by a traced method is not recorded again (one record per call the user's code makes), except
inside ``backward``, whose gradient hooks run the user's Python. ``PyLayer.apply`` is
seen too, without hiding the ops its forward runs: its outputs are the outputs of one record.

Where the wrappers stay depends on the backend. A simulated replay re-runs the function under a
trace, so the simulated backend's first capture (and its first whole step) installs them for the
rest of the process (``install``): each checks a thread-local (``current()``) and calls the original
at once when no trace is open on its thread, and a replay opens a trace by setting that thread-local
instead of replacing ~2,700 attributes around every replay. A backend whose replays run no Python
(CUDA) traces only a whole step's warmup and capture runs: those hold the wrappers (``held_for``,
``hold``/``release``; an ``OpTrace`` holds them while open) and the last release takes them back,
so that the process's later ops, the user's and the package's own around every replay, run Paddle's
own functions: an installed wrapper adds about 1 us to every op it wraps. A run holds them before
any temporary patch of the same attributes is made (host_guard, DrawGuard, InPlaceWrites, a step's
grad scope), so those sit above them and run first, and the ops they make for their own purposes
are traced unless they run under ``paused()``. A wrapper installed beneath such a patch is taken
back beneath it too (paddle_patches.remove_beneath); one that a process-wide patch made later now
calls stays in place. A harmless or refused method written in Python runs paused (a host read's own
calls differ between a capture, which runs it, and a simulated replay, which hands back the
capture's value).
"""

import threading
import types

import paddle

from .paddle_patches import install_beneath, own_beneath, remove_beneath, unpatched

__all__ = ["install", "installed", "hold", "release", "held", "held_for", "current", "paused",
           "native_tensor_attributes", "HARMLESS", "REFUSED", "traced_tensor_methods", "original"]

#: How Paddle's C++ bindings show up among a class's attributes.
_NATIVE_KINDS = ("method_descriptor", "wrapper_descriptor", "builtin_function_or_method", "getset_descriptor",
                 "classmethod_descriptor", "PyCapsule")

#: Native Tensor attributes that launch no kernel and choose no tensor: reading them cannot make a
#: replay read other data than its capture (a key fixes shapes, dtypes and places).
HARMLESS = {
    "__class__": "the type", "__dict__": "the instance dictionary", "__dir__": "attribute names",
    "__getattribute__": "attribute lookup (what it finds is traced)", "__setattr__": "attribute assignment",
    "__delattr__": "attribute deletion", "__init_subclass__": "subclass hook", "__subclasshook__": "isinstance hook",
    "__new__": "an empty tensor object", "__sizeof__": "object size", "__format__": "formatting (reads go "
    "through numpy, refused)", "__array_ufunc__": "numpy protocol marker (None)",
    "__c_dlpack_exchange_api__": "a capsule, not callable", "__dlpack_c_exchange_api__": "a capsule, not callable",
    "name": "the tensor's name", "shape": "metadata", "dtype": "metadata", "place": "metadata", "_place_str":
    "metadata", "stop_gradient": "an autograd flag (a whole step checks it before every replay)", "persistable":
    "a flag", "is_leaf": "autograd metadata", "grad_fn": "the autograd node", "layout": "metadata", "type":
    "metadata", "strides": "metadata", "offset": "metadata", "_local_shape": "metadata", "process_mesh":
    "distributed metadata", "placements": "distributed metadata", "_placements_str": "distributed metadata",
    "num_shard": "distributed metadata", "dist_attr": "distributed metadata",
    "_is_initialized": "metadata", "is_contiguous": "metadata", "stride": "metadata", "get_strides": "metadata",
    "element_size": "metadata", "is_dense": "metadata", "is_dist": "metadata", "is_sparse": "metadata",
    "is_sparse_coo": "metadata", "is_sparse_csr": "metadata", "is_selected_rows": "metadata", "is_same_shape":
    "metadata", "is_coalesced": "metadata", "nnz": "metadata", "dense_dim": "metadata", "sparse_dim": "metadata",
    "_inplace_version": "the version counter", "_offset": "metadata", "data_ptr": "the address (the trace "
    "records it itself)", "_holder_size": "metadata", "_is_dense_tensor_hold_allocation": "metadata",
    "_is_shared_buffer_with": "metadata", "_is_shared_underline_tensor_with": "metadata", "_grad_name": "a name",
    "_tensor_use_gpudnn": "a flag", "_bump_inplace_version": "the version counter", "_set_grad_type": "a flag",
    "_reset_grad_inplace_version": "the grad's version counter", "_unset_fake_empty": "a flag",
    "_register_grad_hook": "autograd hooks (a graphed block routes them)", "_remove_grad_hook": "autograd hooks",
    "_register_backward_hook": "autograd hooks", "_apply_backward_hook": "autograd hooks",
    "retain_grads": "an autograd flag", "__reduce__": "pickling (reads go through numpy, refused)",
    "__reduce_ex__": "pickling", "__getstate__": "pickling (reads go through numpy, refused)",
    # Python-level functions that read only metadata or hand the tensor to another library.
    "__hash__": "identity", "__len__": "the shape", "__dlpack__": "interop (a host export)",
    "__dlpack_device__": "metadata", "__tvm_ffi_env_stream__": "metadata",
}

#: Tensor methods that read tensor values on the host: host_guard refuses them while a capture is
#: open, and a simulated replay hands back what they returned at capture (backends/simulated.py).
REFUSED = {
    "numpy": "a host read", "__bool__": "a host read", "__float__": "a host read", "__int__": "a host read",
    "__index__": "a host read", "__long__": "a host read", "__nonzero__": "a host read", "__complex__":
    "a host read", "__array__": "a host read", "__repr__": "prints values (a host read)", "__str__":
    "prints values (a host read)", "__format__": "prints values (a host read)",
    "__init__": "paddle.Tensor(value): host data refused (host_guard's constructor guard); Paddle 2.6's C "
    "constructor rejects a Python replacement",
}


#: Tensor methods that run the user's Python inside (gradient hooks): their ops are traced too.
_SEE_INSIDE = ("backward",)

_local = threading.local()
# installed: the wrappers are in place; pinned: they stay for the process; holds: traces open now (all threads);
# originals: (id(owner), name) -> what the wrapper wraps; put: (id(owner), name) -> (owner, name, what the owner's
# own __dict__ held before, the wrapper), for each wrapper in place.
# entries: _entries() as last made (wrappers reused while what they wrap is unchanged).
_STATE = {"installed": False, "pinned": False, "holds": 0, "originals": {}, "put": {}, "entries": None}
_LOCK = threading.Lock()


def current():
    """The op trace open on this thread, or None."""
    return getattr(_local, "trace", None)


def set_current(trace):
    """Opens ``trace`` on this thread (None closes); returns the one it replaces."""
    previous = getattr(_local, "trace", None)
    _local.trace = trace
    return previous


class paused:
    """``with paused():`` the ops run inside are not traced (the package's own copies and probes)."""

    __slots__ = ("_saved",)

    def __enter__(self):
        self._saved = set_current(None)
        return self

    def __exit__(self, *exc):
        _local.trace = self._saved
        return False


def native_tensor_attributes():
    """``{name: kind}`` of the attributes of ``paddle.Tensor`` that Paddle binds in C++."""
    found = {}
    for name in dir(paddle.Tensor):
        for owner in paddle.Tensor.__mro__[:-1]:
            if name in owner.__dict__:
                kind = type(_STATE["originals"].get((id(owner), name)) or unpatched(owner, name)).__name__
                if kind in _NATIVE_KINDS:
                    found[name] = kind
                break
    return found


def traced_tensor_methods():
    """The Tensor attributes the trace wraps: every one that Paddle binds in C++ and every Python
    function of the class, except HARMLESS and REFUSED."""
    own = paddle.Tensor.__dict__
    names = set(native_tensor_attributes()) | {
        n for n in own if isinstance(_STATE["originals"].get((id(paddle.Tensor), n)) or unpatched(paddle.Tensor, n),
                                     types.FunctionType)}
    return sorted(n for n in names if n not in HARMLESS and n not in REFUSED)


def _op_modules():
    modules = [("_C_ops", paddle._C_ops)]
    legacy = getattr(paddle, "_legacy_C_ops", None)
    if legacy is not None:
        modules.append(("_legacy_C_ops", legacy))
    return modules


def _wrap(label, original, see_inside=False):
    def traced(*args, **kwargs):
        trace = getattr(_local, "trace", None)
        if trace is None:
            return original(*args, **kwargs)
        return trace.record(label, original, args, kwargs, see_inside)

    traced.__native__ = getattr(original, "__native__", original)
    traced.__name__ = getattr(original, "__name__", label)
    return traced


def _quiet(original):
    """A Tensor method in Python that is no op of the trace: what it calls is not traced either."""

    def quiet(*args, **kwargs):
        if getattr(_local, "trace", None) is None:
            return original(*args, **kwargs)
        with paused():
            return original(*args, **kwargs)

    quiet.__native__ = getattr(original, "__native__", original)
    return quiet


def _getter(label, descriptor):
    """A property standing for a C++ getter (``Tensor.grad``): the read is traced, the setter kept."""
    read = _wrap(label, descriptor.__get__)
    setter = descriptor.__set__ if hasattr(descriptor, "__set__") else None
    return property(lambda t: read(t, type(t)), setter, None, descriptor.__doc__)


def _apply(original):
    """``PyLayer.apply`` recorded as one op whose outputs are the layer's, its forward's ops traced."""

    def apply(cls, *args, **kwargs):
        trace = getattr(_local, "trace", None)
        call = original.__get__(None, cls)
        if trace is None:
            return call(*args, **kwargs)
        return trace.record(f"PyLayer.apply({cls.__qualname__})", call, args, kwargs, see_inside=True)

    return classmethod(apply)


def _entries():
    """``[(owner, name, replacement)]`` of every traced entry point."""
    entries = []
    for prefix, module in _op_modules():
        for name in dir(module):
            if name.startswith("_"):
                continue
            value = unpatched(module, name)
            if callable(value):
                entries.append((module, name, _wrap(f"{prefix}.{name}", value)))
    native = native_tensor_attributes()
    for name in traced_tensor_methods():
        value = unpatched(paddle.Tensor, name)
        if native.get(name) == "getset_descriptor":
            entries.append((paddle.Tensor, name, _getter(f"Tensor.{name}", value)))
        elif callable(value):
            entries.append((paddle.Tensor, name, _wrap(f"Tensor.{name}", value, name in _SEE_INSIDE)))
    for name in sorted(set(REFUSED) | set(HARMLESS)):  # their Python runs untraced: a host read returns
        value = unpatched(paddle.Tensor, name)       # the capture's value on a simulated replay, unrun
        if isinstance(value, types.FunctionType) and name != "__init__":
            entries.append((paddle.Tensor, name, _quiet(value)))
    entries.append((paddle, "to_tensor", _wrap("paddle.to_tensor", unpatched(paddle, "to_tensor"))))
    layer = paddle.autograd.PyLayer
    for base in layer.__mro__[1:]:
        if "apply" in base.__dict__:
            entries.append((layer, "apply", _apply(base.__dict__["apply"])))
            break
    return entries


def install():
    """Wraps the traced entry points for the rest of the process (NOTE [ Traced entry points ]): a backend
    whose replays re-run the function traces every replay. Each wraps what its attribute is beneath any
    temporary patch in force now."""
    with _LOCK:
        _STATE["pinned"] = True
        _put()


def hold():
    """Wraps the traced entry points until the matching release() (an op trace opens: NOTE [ Traced entry
    points ]); nested and concurrent holds keep them in place until the last is released."""
    with _LOCK:
        try:
            _put()
        except BaseException:  # a wrapper that could not be put: none stays where no other hold or pin wants it
            if not _STATE["holds"] and not _STATE["pinned"]:
                _take_back()
            raise
        _STATE["holds"] += 1


def release():
    """Ends a hold(); the last one takes the wrappers back unless install() pinned them for the process."""
    with _LOCK:
        _STATE["holds"] -= 1
        if not _STATE["holds"] and not _STATE["pinned"]:
            _take_back()


class held:
    """``with held():`` hold() for the block (entered before any temporary patch of the block is made)."""

    __slots__ = ()

    def __enter__(self):
        hold()
        return self

    def __exit__(self, *exc):
        release()
        return False


def held_for(backend):
    """held() around a traced run on ``backend``; install() first where its replays re-run the function
    (every replay traces: the wrappers stay)."""
    if backend.replays_python:
        install()
    return held()


def _put():
    if _STATE["installed"]:
        return
    originals, put = _STATE["originals"], _STATE["put"]
    entries = _STATE["entries"]  # the wrappers made before, while what they wrap is still there
    if entries is None or any(unpatched(owner, name) is not originals.get((id(owner), name))
                              for owner, name, _ in entries if (id(owner), name) not in put):
        entries = _STATE["entries"] = _entries()
    for owner, name, replacement in entries:
        key = (id(owner), name)
        if key in put:  # never taken back: a process-wide patch made after it calls it (_take_back)
            continue
        originals[key] = unpatched(owner, name)
        put[key] = (owner, name, own_beneath(owner, name), replacement)
        install_beneath(owner, name, replacement)  # another thread's capture may hold a patch now
    _STATE["installed"] = True


def _take_back():
    put = _STATE["put"]
    for key, (owner, name, own, replacement) in list(put.items()):
        if remove_beneath(owner, name, replacement, own):
            del put[key]
    _STATE["installed"] = False


def installed():
    """Whether the traced entry points are wrapped now."""
    return _STATE["installed"]


def original(owner, name):
    """What ``owner.name`` was before the trace wrapped it (the attribute itself when not wrapped)."""
    found = _STATE["originals"].get((id(owner), name))
    return found if found is not None else owner.__dict__.get(name, getattr(owner, name, None))

