"""What a key whose graphed calls cost more host time than its eager calls says: its fallback reason and its
warning (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py)."""

__all__ = ["host_speed", "slower_message", "slower_reason"]


def slower_reason(calls, graphed, eager, weighed="forward", slowdown=1.0):
    """The fallback reason of a key whose ``calls`` cost ``graphed`` us against ``eager`` (``weighed``:
    "forward", or "forward and backward"; ``slowdown``: HostCost.slowdown(), the eager side already divided by
    it)."""
    per = "per forward call" if weighed == "forward" else "per call, forward and backward"
    return (f"its {calls} cost more host time than its eager calls: {graphed:.1f} against {eager:.1f} "
            f"us {per} (lower quartiles of its eager calls before its capture and its replays{_scaled(slowdown)}; "
            "eager_if_slower=False keeps it graphed)")


def host_speed(slowdown):
    """How the host ran during the eager calls against the replays, in words ("1.30x slower", "2.00x faster")."""
    return f"{slowdown:.2f}x slower" if slowdown >= 1.0 else f"{1.0 / slowdown:.2f}x faster"


def _scaled(slowdown):
    """What the numbers say about the host's speed: nothing where the eager calls and the replays ran at one speed."""
    if slowdown == 1.0:
        return ""
    return f", the eager calls' at the replays' host speed (the host ran {host_speed(slowdown)} during them)"


def slower_message(label, call, graphed, eager, acted, weighed="forward", slowdown=1.0):
    """The warning for key ``label``, whose ``call`` costs ``graphed`` us against ``eager`` (``weighed``:
    "forward", or "forward and backward"; ``slowdown``: as slower_reason's); ``acted``: it runs eagerly from now on."""
    then = ("so it runs eagerly from now on (results are eager's; eager_if_slower=False keeps it graphed)" if acted
            else "so graphing it makes training slower where the host is the bottleneck")
    return (
        f"key {label}: {call} costs {graphed:.1f} us of host "
        f"time against {eager:.1f} us for the eager call ({weighed}, lower quartiles{_scaled(slowdown)}), {then}. Each "
        "graphed call pays a fixed toll (key, checks, copies and Paddle's autograd bridge, again in backward), more than this "
        "block's kernel launches cost eagerly. Graph larger blocks (several layers in one Layer: autocudagraph "
        "on the Layer that calls them), or the whole training step with autocudagraph_step. Every key's numbers "
        "are in explain()."
    )
