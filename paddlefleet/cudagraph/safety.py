"""Kept for imports written before the split: host tensors now live in host.py, stale outputs in
stale.py, user locations in location.py. New code imports from those modules."""

from .host import MAX_HOST_KEY_ELEMENTS, check_host_inputs, host_key, host_mask, is_marked_host, mark_host
from .location import user_call_site, user_location, user_stacklevel
from .stale import StaleOutputs, check_fresh

__all__ = [
    "MAX_HOST_KEY_ELEMENTS",
    "mark_host",
    "is_marked_host",
    "host_mask",
    "host_key",
    "check_host_inputs",
    "user_location",
    "user_call_site",
    "user_stacklevel",
    "StaleOutputs",
    "check_fresh",
]
