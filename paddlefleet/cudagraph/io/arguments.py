"""Argument objects a graph cannot follow: key/value caches.

NOTE [ Argument objects ]
flatten() (io/nested.py) turns tensors, lists, tuples and dicts into static inputs; any other
argument is a constant of the key (by identity for an object). A key/value cache
(``past_key_values=DynamicCache(...)``, recognised by the ``update`` + ``get_seq_length`` protocol
of PaddleFormers and Hugging Face) is filled by the call: its ``update`` appends this step's keys
and values on the host side, which a graph would not repeat, and a new cache per step would be a
new key per step (warmup forever, each key holding the cache). So a call with a cache argument runs
eagerly, with the argument's name and the fix in the reason. PaddleFormers' models create a
``DynamicCache`` when ``use_cache`` is True. Other objects holding tensors stay constants of the key
(a communicator passed each call, say, whose buffers are updated in place, graphs fine).
"""

import paddle

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
    return None
