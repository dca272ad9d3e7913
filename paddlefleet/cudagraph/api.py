"""autocudagraph(): decorate a function, a Layer method or a Layer instance."""

import dataclasses
import functools
import weakref

import paddle

from .guards.paddle_patches import install_process_patches
from .block.graphed import GraphedCallable
from .core.front import behind, front
from .chains.entry import CHAINS
from .options import GraphOptions, check_option_names

__all__ = ["autocudagraph"]


# NOTE [ Graphed methods ]
# ``@autocudagraph`` on a function in a class body returns a _GraphedMethod descriptor. Every
# decorated function keeps its own wrappers, under an attribute of its own (the defining class's
# qualified name and the function's name), so ``Base.forward`` and ``Sub.forward`` both graphed,
# with ``Sub.forward`` calling ``super().forward(x)``, are two wrappers of the same instance; the
# inner call runs as any graphed call made inside another capture does (eagerly, as part of the
# outer graph). What a call binds to:
#   instance.fn / Cls.fn(instance, ...)   one wrapper per instance (its own graphs)
#   @classmethod, either order            one wrapper per class, bound to the class
#   @autocudagraph over @staticmethod     one wrapper, no owner: staticmethod(GraphedCallable)
#   @staticmethod over @autocudagraph     the descriptor is called directly, never bound: a call
#                                         whose first argument is not an instance (or subclass)
#                                         of the defining class uses one static wrapper (one
#                                         whose first argument is an instance is computed the
#                                         same way, fn(instance, ...), with that instance's graphs)
# The defining class comes from __set_name__ when the descriptor sits in the class body itself,
# else (under staticmethod, classmethod or another decorator) from the first argument's MRO,
# matched by module and qualified name.


class _GraphedMethod:
    """Descriptor for ``@autocudagraph`` on a function in a class body (NOTE [ Graphed methods ])."""

    def __init__(self, fn, options, classmethod_=False):
        self._fn = fn
        self._options = options
        self._classmethod = classmethod_
        self._attr = f"_autocudagraph_{fn.__module__}.{fn.__qualname__}"
        self._owner_cls = None  # the defining class, once known
        self._owner_name = fn.__qualname__.rpartition(".")[0]
        self._per_class = weakref.WeakKeyDictionary()
        self._static = None
        functools.update_wrapper(self, fn)

    def __set_name__(self, owner, name):
        self._owner_cls = owner
        self._attr = f"_autocudagraph_{owner.__module__}.{owner.__qualname__}.{name}"

    # ---------------------------------------------------------------- binding
    def _defines(self, cls):
        """True when ``cls`` is the defining class or a subclass of it."""
        if self._owner_cls is not None:
            return issubclass(cls, self._owner_cls)
        for base in cls.__mro__:
            if base.__qualname__ == self._owner_name and base.__module__ == self._fn.__module__:
                self._owner_cls = base
                return True
        return False

    def _for_instance(self, obj):
        wrapper = obj.__dict__.get(self._attr)
        if wrapper is None:
            wrapper = _graphed(self._fn, self._options, owner=obj)
            obj.__dict__[self._attr] = wrapper
        return wrapper

    def _for_class(self, cls):
        wrapper = self._per_class.get(cls)
        if wrapper is None:
            wrapper = _graphed(self._fn, self._options, owner=cls)
            self._per_class[cls] = wrapper
        return wrapper

    def _static_wrapper(self):
        if self._static is None:
            self._static = _graphed(self._fn, self._options)
        return self._static

    def __get__(self, obj, objtype=None):
        if obj is not None and not self._classmethod:
            wrapper = obj.__dict__.get(self._attr)  # the common case: an instance already bound
            if wrapper is not None:
                return wrapper
        if self._classmethod:
            return self._for_class(objtype if objtype is not None else type(obj))
        if obj is None:
            return self
        if isinstance(obj, type):  # classmethod over this descriptor (Python < 3.13 binds through __get__)
            return self._for_class(obj)
        return self._for_instance(obj)

    def __call__(self, *args, **kwargs):
        # Cls.fn(instance, ...), or a call through staticmethod/classmethod/another decorator.
        if self._classmethod:
            return self._for_class(args[0])(*args[1:], **kwargs)
        first = args[0] if args else None
        if isinstance(first, type) and self._defines(first):
            return self._for_class(first)(*args[1:], **kwargs)
        if args and not isinstance(first, type) and self._defines(type(first)):
            return self._for_instance(first)(*args[1:], **kwargs)
        return self._static_wrapper()(*args, **kwargs)

    # ---------------------------------------------------------------- a static method's report
    def _reported(self, what):
        if self._static is None and len(self._per_class) == 1:  # a class method read as Cls.fn
            return next(iter(self._per_class.values()))
        if self._static is None and self._owner_cls is not None:
            raise TypeError(
                f"autocudagraph: {self._fn.__qualname__} is graphed per instance: each instance keeps its own "
                f"graphs, so the class has no {what}() of its own. Call it on an instance's method "
                f"(obj.{self._fn.__name__}.{what}())."
            )
        return self._static_wrapper()

    def stats(self):
        """stats() of a static method's wrapper (NOTE [ Graphed methods ])."""
        return self._reported("stats").stats()

    def report(self):
        return self._reported("report").report()

    def explain(self):
        return self._reported("explain").explain()

    def reset(self):
        return self._reported("reset").reset()

    @property
    def counters(self):
        return self._reported("counters").counters


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
        # See docs/guides/distributed.md: the wrapper's forward is host code around the model.
        raise TypeError(
            f"autocudagraph: got the distributed wrapper {wrapper_name}. Its forward arms the gradient "
            "reducer on the host after the model runs, which a graph replay would skip, so grads would "
            "not be synchronised. Graph the model or its blocks, then wrap: "
            "paddle.DataParallel(autocudagraph(model)) or fleet.distributed_model(...)."
        )
    if isinstance(target, paddle.nn.Layer):
        if isinstance(behind(target.__dict__.get("forward")), GraphedCallable) or isinstance(
            getattr(type(target), "forward", None), _GraphedMethod
        ):
            raise TypeError(
                f"autocudagraph: the forward of {type(target).__name__} is already graphed. Wrapping it again "
                "would nest one capture in another (or drop the first wrapper's graphs). Apply autocudagraph "
                "once: either to the Layer instance or to its forward method."
            )
        forward = type(target).forward
        wrapper = _graphed(forward, options, owner=target)
        # An instance attribute: Layer.__call__ finds it before the class's forward, hooks still
        # run around it, and state_dict is unchanged (the wrapper is neither Layer nor Tensor). A
        # compiled front door where it can (NOTE [ The front door ] in core/front.py).
        object.__setattr__(target, "forward", front(wrapper))
        _attach_reports(target, wrapper)
        return target
    if isinstance(target, type):
        _refuse_class(target)
    if isinstance(target, (staticmethod, classmethod)):
        return _wrap_static_or_class(target, options)
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
    return _graphed(target, options)


def _graphed(fn, options, owner=None):
    """The one way the API makes a block: with the chains' hooks (chains/entry.py)."""
    return GraphedCallable(fn, options, owner, CHAINS)


#: What a Layer graphed in place answers itself, each the same as ``layer.forward.<name>()``.
REPORTS = ("stats", "explain", "report", "reset")


def _attach_reports(layer, wrapper):
    """Gives a Layer graphed in place ``stats()``, ``explain()``, ``report()`` and ``reset()``: its
    forward wrapper's, as instance attributes. A name the Layer's class already defines (a model's own
    ``reset()``, a sublayer named ``stats``) is left as it is; ``layer.forward.<name>()`` always works."""
    for name in REPORTS:
        if not hasattr(layer, name):  # a class method, sublayer, parameter or buffer of that name wins
            object.__setattr__(layer, name, getattr(wrapper, name))


def _refuse_class(cls):
    """A class is not graphed: its call makes an instance. Says what to decorate instead."""
    name = cls.__name__
    if issubclass(cls, paddle.nn.Layer):
        raise TypeError(
            f"autocudagraph: got the Layer class {name}, not an instance. Calling a class makes a new Layer, which "
            f"no graph can replay. Graph an instance: model = autocudagraph({name}(...)), or decorate the method: "
            "put @autocudagraph above 'def forward(self, ...)' in the class body."
        )
    raise TypeError(
        f"autocudagraph: got the class {name}. Decorate a function, a method in the class body, or a "
        "paddle.nn.Layer instance."
    )


def _wrap_static_or_class(target, options):
    """``@autocudagraph`` over ``@staticmethod`` / ``@classmethod`` (NOTE [ Graphed methods ])."""
    fn = target.__func__
    if isinstance(fn, (GraphedCallable, _GraphedMethod)) or not callable(fn):
        raise TypeError(
            f"autocudagraph: expected a {type(target).__name__} of a plain function, got one of {fn!r}. "
            "Apply autocudagraph once, directly above or below the @staticmethod/@classmethod line."
        )
    if isinstance(target, staticmethod):
        return staticmethod(_graphed(fn, options))
    return _GraphedMethod(fn, options, classmethod_=True)


def _defined_in_a_class_body(fn):
    """True for a function written in a class body ("Class.method", not "outer.<locals>.f") that
    takes at least one positional argument (the instance)."""
    parts = getattr(fn, "__qualname__", "").split(".")
    code = getattr(fn, "__code__", None)
    return len(parts) >= 2 and parts[-2] != "<locals>" and code is not None and code.co_argcount >= 1


def autocudagraph(target=None, **options):
    """Captures the forward and backward of ``target`` into CUDA graphs and replays them.

    Usable bare (``@autocudagraph``), with options (``@autocudagraph(warmup_steps=2)``), on a
    method (each instance keeps its own graphs), a static method (one set of graphs) or a class
    method (one per class), above or below ``@staticmethod`` / ``@classmethod``, or on a Layer
    instance (``autocudagraph(layer)`` graphs its forward in place and returns the same Layer).
    The wrapper presents the signature of what it wraps, bound where it is bound.

    Per key (by default: the argument structure, each tensor's shape/dtype/place/stop_gradient,
    non-tensor values, grad mode, AMP state and the training flag of the Layers involved) the
    first ``warmup_steps`` calls run eagerly, the next call captures, and later calls replay (on a
    GPU, with ``eager_if_slower``, timed eager calls come first, up to 8 eager calls in all).
    Every call returns what eager would; grads flow to inputs and to the parameters of the
    Layers used through autograd, so hooks, DataParallel and accumulation behave as in eager.
    Graphed calls that each take the previous one's output (a model graphed layer by layer) are
    replayed as one chain through one autograd bridge once the pattern repeats (chain_calls).

    Args:
        target: the function, method or Layer; omitted when options are given.
        **options: see GraphOptions (warmup_steps, max_graphs, dispatch_key_fn, backend,
            clone_outputs, clone_param_grads, verify_replays, max_bytes, capture_hooks,
            check_stale_outputs, max_inflight, chain_calls).

    Returns:
        The wrapped callable (with ``stats()``, ``explain()``, ``reset()``), the same Layer (with
        the same three, unless its class defines one of those names; ``layer.forward`` has them
        all), or a decorator when ``target`` is omitted.

    Raises:
        TypeError, ValueError: at decoration time, for a bad option.

    Limitations:
        See docs/guides/limitations.md: static shapes per key, no host syncs inside the function, at
        most max_inflight forward replays per key in flight before their backwards
        (docs/guides/pipeline.md).
    """
    check_option_names("autocudagraph", options, [f.name for f in dataclasses.fields(GraphOptions)])
    opts = GraphOptions(**options)
    install_process_patches(opts)  # NOTE [ Paddle patches ] in guards/paddle_patches.py: a method's wrappers come later
    if target is None:
        return lambda t: _wrap(t, opts)
    return _wrap(target, opts)
