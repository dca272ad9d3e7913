"""autocudagraph(): decorate a function, a Layer method or a Layer instance."""

import functools

import paddle

from .block import GraphedCallable
from .options import GraphOptions

__all__ = ["autocudagraph"]


class _GraphedMethod:
    """Descriptor for ``@autocudagraph`` on a method: every instance gets its own graphs."""

    def __init__(self, fn, options):
        self._fn = fn
        self._options = options
        self._attr = f"_autocudagraph_{fn.__name__}_{id(self)}"
        functools.update_wrapper(self, fn)

    def __set_name__(self, owner, name):
        self._attr = f"_autocudagraph_{name}"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        wrapper = obj.__dict__.get(self._attr)
        if wrapper is None:
            wrapper = GraphedCallable(self._fn, self._options, owner=obj)
            obj.__dict__[self._attr] = wrapper
        return wrapper

    def __call__(self, obj, *args, **kwargs):  # Class.method(instance, ...)
        return self.__get__(obj)(*args, **kwargs)


def _distributed_wrapper_name(layer):
    """The class name when ``layer`` is a Paddle distributed wrapper (DataParallel, Fleet's
    TensorParallel/PipelineParallel/...), else None."""
    names = {cls.__name__ for cls in type(layer).__mro__}
    if "DataParallel" in names or "MetaParallelBase" in names:
        return type(layer).__name__
    return None


def _wrap(target, options):
    wrapper_name = _distributed_wrapper_name(target) if isinstance(target, paddle.nn.Layer) else None
    if wrapper_name is not None:
        # See docs/distributed.md: the wrapper's forward is host code around the model.
        raise TypeError(
            f"autocudagraph: got the distributed wrapper {wrapper_name}. Its forward arms the gradient "
            "reducer on the host after the model runs, which a graph replay would skip, so grads would "
            "not be synchronised. Graph the model or its blocks, then wrap: "
            "paddle.DataParallel(autocudagraph(model)) or fleet.distributed_model(...)."
        )
    if isinstance(target, paddle.nn.Layer):
        if isinstance(target.__dict__.get("forward"), GraphedCallable) or isinstance(
            type(target).__dict__.get("forward"), _GraphedMethod
        ):
            raise TypeError(
                f"autocudagraph: the forward of {type(target).__name__} is already graphed. Wrapping it again "
                "would nest one capture in another (or drop the first wrapper's graphs). Apply autocudagraph "
                "once: either to the Layer instance or to its forward method."
            )
        forward = type(target).forward
        wrapper = GraphedCallable(forward, options, owner=target)
        # An instance attribute: Layer.__call__ finds it before the class's forward, hooks still
        # run around it, and state_dict is unchanged (the wrapper is neither Layer nor Tensor).
        object.__setattr__(target, "forward", wrapper)
        return target
    if isinstance(target, GraphedCallable) or isinstance(target, _GraphedMethod):
        raise TypeError(
            f"autocudagraph: {target!r} is already wrapped. Apply autocudagraph once; call "
            ".reset() on it to drop its graphs."
        )
    if not callable(target):
        raise TypeError(
            f"autocudagraph: expected a function, a method or a paddle.nn.Layer, got {target!r} "
            f"({type(target).__name__})."
        )
    if _defined_in_a_class_body(target):
        return _GraphedMethod(target, options)
    return GraphedCallable(target, options)


def _defined_in_a_class_body(fn):
    """True for a function written in a class body ("Class.method", not "outer.<locals>.f") that
    takes at least one positional argument (the instance)."""
    parts = getattr(fn, "__qualname__", "").split(".")
    code = getattr(fn, "__code__", None)
    return len(parts) >= 2 and parts[-2] != "<locals>" and code is not None and code.co_argcount >= 1


def autocudagraph(target=None, **options):
    """Captures the forward and backward of ``target`` into CUDA graphs and replays them.

    Usable bare (``@autocudagraph``), with options (``@autocudagraph(warmup_steps=2)``), on a
    method (each instance keeps its own graphs) or on a Layer instance
    (``autocudagraph(layer)`` graphs its forward in place and returns the same Layer).

    Per key (by default: the argument structure, each tensor's shape/dtype/place/stop_gradient,
    non-tensor values, grad mode, AMP state and the training flag of the Layers involved) the
    first ``warmup_steps`` calls run eagerly, the next call captures, and later calls replay.
    Every call returns what eager would; grads flow to inputs and to the parameters of the
    Layers used through autograd, so hooks, DataParallel and accumulation behave as in eager.

    Args:
        target: the function, method or Layer; omitted when options are given.
        **options: see GraphOptions (warmup_steps, max_graphs, dispatch_key_fn, backend,
            clone_outputs, clone_param_grads, verify_replays, max_bytes, capture_hooks,
            check_stale_outputs).

    Returns:
        The wrapped callable (with ``stats()``, ``explain()``, ``reset()``), the same Layer, or
        a decorator when ``target`` is omitted.

    Raises:
        TypeError, ValueError: at decoration time, for a bad option.

    Limitations:
        See docs/limitations.md: static shapes per key, no host syncs inside the function, one
        forward replay per key in flight before its backward.
    """
    opts = GraphOptions(**options)
    if target is None:
        return lambda t: _wrap(t, opts)
    return _wrap(target, opts)
