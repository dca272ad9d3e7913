"""Argument objects a graph cannot follow: key/value caches and other objects holding tensors.

NOTE [ Argument objects ]
flatten() (static_io.py) turns tensors, lists, tuples and dicts into static inputs; any other
argument is a constant of the key. An object that holds tensors, or that a call fills with tensors
(a key/value cache: ``past_key_values=DynamicCache(...)``, whose ``update`` appends this step's keys
and values), is neither: a graph would keep reading the tensors it held at capture and would never
write new ones into it, and a new object per step would be a new key per step (warmup forever, each
key holding the object). So a call with such an argument runs eagerly, with the argument's name and
the fix in the reason. PaddleFormers' models create a ``DynamicCache`` when ``use_cache`` is True.
"""

import paddle

from .static_io import holds_tensor

__all__ = ["refusal"]


def _is_cache(value):
    """The key/value cache protocol of PaddleFormers and Hugging Face (``Cache``): ``update`` and
    ``get_seq_length``."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def _leaves(name, value):
    """``(path, leaf)`` of every non-tensor, non-container leaf of an argument."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{name}[{i}]", v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(f"{name}[{k!r}]", v)
    elif not isinstance(value, paddle.Tensor):
        yield name, value


def refusal(named_arguments):
    """None, or why a call with these ``[(name, value)]`` arguments must run eagerly."""
    for top, value in named_arguments:
        for name, leaf in _leaves(top, value):
            if _is_cache(leaf):
                return (
                    f"argument '{name}' is a {type(leaf).__name__} (a key/value cache the call updates); a graph "
                    "would keep the tensors of its capture and never write new ones. Pass use_cache=False "
                    f"and {top}=None when training, or return None from dispatch_key_fn for decoding calls"
                )
            if holds_tensor(leaf, depth=3):
                return (
                    f"argument '{name}' is a {type(leaf).__name__} object holding tensors; a graph would keep "
                    "reading the tensors it held at capture. Pass the tensors themselves (or a tuple, list "
                    "or dict of them) as arguments"
                )
    return None
