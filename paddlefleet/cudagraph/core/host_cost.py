"""The host time a key's graphed calls cost against its eager calls, measured, and a warning
where graphing the block cannot pay.

NOTE [ Graphed calls that cannot pay ]
A graphed call replaces the launches of a block's kernels by one graph launch, but pays a fixed
host toll of its own: the key, the replay checks, the input copy, the autograd bridge (Paddle's
PyLayer apply and, in backward, one grad node handing every grad to autograd) and the output
hand-out. For a small block (one decoder layer, one matmul) that toll can exceed the launches it
saves, and graphing makes training slower than eager. So each key times its last warmup call
(eager) and its first REPLAYS_TIMED replays (forward call, host time, no device sync), and when
the graphed call's median is not below the eager call, warns once with both numbers and points
to larger blocks or the whole-step graph. explain() shows the numbers for every key. The eager
time is that of a warmup call: a first call that paid one-time set-up looks slower, so the
warning errs towards silence. Timing stops after REPLAYS_TIMED replays (two perf_counter reads a
call until then). A backend whose replay re-runs the function (simulate) is not timed: its
graphed calls always cost more than eager ones. The warning is given once per process (a model
graphed layer by layer would give it once per layer); explain() has every key's numbers. A
chain's calls (NOTE [ Chains of graphed calls ] in chains/chain.py) are not timed: none of them
costs what its key alone costs (the chain's first call replays its own graph and applies the one
bridge; the others are handed their output).
"""

import statistics
import time

__all__ = ["HostCost", "REPLAYS_TIMED", "measured", "warn_once_per_process"]

#: Replays of a key whose forward host time is measured (after the first, which may pay set-up).
REPLAYS_TIMED = 16


_warned = []


def measured(backend):
    """Whether the host time of ``backend``'s replays says anything: not where a replay re-runs
    the function (simulate)."""
    return backend is not None and not backend.capture_executes


def warn_once_per_process():
    """True the first time it is called in this process."""
    if _warned:
        return False
    _warned.append(True)
    return True


class HostCost:
    """Host seconds of one key's eager warmup call and of its first replays (``measure`` False:
    nothing is timed)."""

    __slots__ = ("eager_s", "replay_s", "judged", "skip")

    def __init__(self, measure=True):
        self.eager_s = None
        self.replay_s = []
        self.judged = not measure
        self.skip = False  # set by a replay that served more than this key's call (a chain's first call)

    def timed_warmup(self, warmup, entry, call):
        """``warmup(entry, call)``, its host time kept as the eager call's."""
        start = time.perf_counter()
        out = warmup(entry, call)
        self.eager_s = time.perf_counter() - start
        return out

    def timed_replay(self, replay, entry, call, warn_once):
        """``replay(entry, call)``, timed; once judged, ``warn_once(topic, message)`` where the key cannot
        pay (once per process)."""
        start = time.perf_counter()
        out = replay(entry, call)
        if self.skip:
            self.skip = False
            return out
        if self.add_replay(time.perf_counter() - start) and self.cannot_pay() and warn_once_per_process():
            warn_once("cannot_pay", self.warning(entry.label))
        return out

    @property
    def timing(self):
        """True while replays are still timed."""
        return not self.judged

    def add_replay(self, seconds):
        """Records one replay's host seconds; returns True when the key has just been judged."""
        self.replay_s.append(seconds)
        if len(self.replay_s) <= REPLAYS_TIMED:
            return False
        self.judged = True
        return True

    def graphed_us(self):
        timed = self.replay_s[1:]  # the first replay may pay set-up
        return statistics.median(timed) * 1e6 if timed else None

    def eager_us(self):
        return None if self.eager_s is None else self.eager_s * 1e6

    def cannot_pay(self):
        """True when the graphed call costs at least as much host time as the eager one."""
        graphed, eager = self.graphed_us(), self.eager_us()
        return graphed is not None and eager is not None and graphed >= eager

    def describe(self):
        """``host us per forward call: eager X (warmup), graphed Y (median of N replays)`` or ""."""
        graphed, eager = self.graphed_us(), self.eager_us()
        if graphed is None or eager is None:
            return ""
        return (f"host us per forward call: eager {eager:.1f} (a warmup call), graphed {graphed:.1f} "
                f"(median of {len(self.replay_s) - 1} replays)")

    def warning(self, label):
        return (
            f"key {label}: a graphed call costs {self.graphed_us():.1f} us of host time against "
            f"{self.eager_us():.1f} us for the eager call (forward, measured; NOTE [ Graphed calls that cannot pay ] "
            "in core/host_cost.py). Each graphed call pays a fixed toll (key, checks, copies and Paddle's autograd "
            "bridge, again in backward), more than this block's kernel launches cost eagerly, so graphing it makes "
            "training slower where the host is the bottleneck. Graphed calls that each take the previous one's output "
            "as their first argument (h = layer(h)) are chained through one bridge and do not pay it per call (NOTE "
            "[ Chains of graphed calls ] in chains/chain.py); a call between them (a residual add, say) stops a chain. "
            "Otherwise graph larger blocks (several layers in one Layer: autocudagraph on the Layer that calls "
            "them), or the whole training step with autocudagraph_step."
        )
