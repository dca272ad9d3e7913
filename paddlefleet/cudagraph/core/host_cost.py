"""The host time of a key's graphed calls against its eager calls, measured; a key whose graphed
calls are slower runs eagerly from then on (``eager_if_slower``).

NOTE [ Graphed calls that cannot pay ]
A graphed call replaces the launches of a block's kernels by one graph launch, but pays a fixed
host toll of its own: the key, the replay checks, the input copy, the autograd bridge (Paddle's
PyLayer apply and, in backward, one grad node handing every grad to autograd) and the output
hand-out. For a small block (one decoder layer, one matmul) that toll can exceed the launches it
saves, and graphing makes training slower than eager. So every key is timed, and a key whose
graphed calls cost more is run eagerly:

* **What is timed.** The host time of the forward call (perf_counter around the call, no device
  synchronisation): for an eager call the function's own Python and kernel launches, for a
  graphed call what the wrapper does from its replay checks on (checks, input copy, replay, bridge,
  output copy; the dispatcher reads the clock before the body's ``blocker``, core/dispatch.py). A
  call the checks keep from replaying (one in flight, one captured again) is no sample. The
  dispatcher decides which call is a sample (``wants_eager``); the runner times it and adds it
  here (``add_eager``, ``add_replay``; a call a chain served: chains/record.py ``ChainCost.add``).
  The backward is not weighed, though an eager block's backward costs 4-10x the host time of a graphed
  block's bridge backward (docs/reports/verdict_probe.md): a block whose eager forward costs about the
  graphed call's toll can be judged slower although its step is faster graphed, and a GPU-bound block is
  judged on noise (neither way pays there). A verdict that weighs both needs the eager backward of one key
  (the engine runs every node of a step in one walk) and the graphs' device time.
* **Eager samples before the capture.** A judged key takes its SAMPLES eager samples before it
  captures: its first calls are timed eager calls (TIMED_EAGER), then come its warmup calls (which
  count among the eager samples), then the capture; its replays are timed after (the first replay,
  which may pay set-up, is dropped). Eager samples taken after the capture would make the process
  hold, in the same step, the key's graphs (their pools, static grads) and what an eager call
  allocates (activations, then new parameter grads that are cached once freed): a model graphed
  layer by layer then peaks at its graphs plus a whole eager step (docs/guides/memory.md, "Eager
  samples"). Before the capture no graph holds anything yet. The eager samples are
  eager's own computation: results stay bitwise those of eager; stats() counts them among eager
  calls with the reason "timed against its graphed calls". A call of one key and a call of
  another share a step, so noise that falls on one step (another process, a garbage collection)
  falls on several samples; the lower quartile below keeps any few of them from deciding.
* **Each side's number is its lower quartile**, not its median. Noise only ever adds host time,
  and on some calls it adds much: on the H100 (32 layers of six matmuls, width 512) the first
  layer of every step paid about 150 us more than the next layer, eagerly and graphed alike,
  with a spread wider than the graph's saving there (eager 346-519 us, graphed 165-354 us over
  eight calls each). Compared by medians, that first layer ran eagerly as "slower" in 7 of 16
  timed runs. The lower quartile (between the second and third fastest of eight) is near each
  side's own cost, and still no single call, fast or slow, decides.
* **The decision.** When the graphed quartile is not below the eager quartile the key runs
  eagerly from then on (its graphs and static buffers are released; explain() gives both
  numbers and the reason), with one warning per process. Otherwise it keeps its graphs. Once
  every key of a wrapper runs eagerly as slower, its later calls skip the key too (ALL_SLOWER:
  the key costs host time as well; a call of a new shape is then not graphed, reset() measures
  again).
* **Chained calls** (NOTE [ Chains of graphed calls ] in chains/chain.py) are judged too, by the
  same rule against the same eager quartile, once the key is judged alone (chains/record.py's
  ChainCost, held by the key's chain record). A replay that starts a chain is no sample here
  (``not_a_sample``): it paid the bridge of every member.
* **Where it is off.** A backend whose replay re-runs the function (simulate) is not timed:
  its graphed calls always cost more than eager ones. The whole training step is not judged
  (one graph for the step: the toll is paid once a step). ``eager_if_slower=False`` keeps every
  key graphed: the numbers are still measured (from the warmup calls and the first replays),
  shown by explain() and a slower key still warns once. Decisions depend on timing, so the
  test suite turns the measurement off (tests/conftest.py) except in the tests that drive it
  with a stand-in clock.
"""

import statistics
import time

__all__ = ["HostCost", "SAMPLES", "TIMED", "ALL_SLOWER", "act", "clock", "measured", "quartile_us", "slower_message",
           "slower_reason", "warn_once_per_process"]

#: Timed calls per side (eager, graphed alone, chained) a decision needs.
SAMPLES = 8

#: The clock calls are timed with (tests put a stand-in here).
clock = time.perf_counter

#: The reason stats() gives the eager calls timed against a key's graphed calls.
TIMED = "timed against its graphed calls (eager_if_slower)"

#: The reason of the calls of a wrapper whose every key runs eagerly as slower: they skip the key.
ALL_SLOWER = "every key of this wrapper was slower graphed than eager: run without a key (eager_if_slower=False keeps " \
    "it graphed; reset() measures again)"

_warned = []


def measured(backend):
    """Whether the host time of ``backend``'s replays says anything: not where a replay re-runs
    the function (simulate)."""
    return backend is not None and not backend.replays_python


def warn_once_per_process():
    """True the first time it is called in this process."""
    if _warned:
        return False
    _warned.append(True)
    return True


def quartile_us(samples):
    """The lower quartile of ``samples`` (seconds) in us (NOTE [ Graphed calls that cannot pay ])."""
    if not samples:
        return None
    if len(samples) == 1:
        return samples[0] * 1e6
    return statistics.quantiles(samples, n=4, method="inclusive")[0] * 1e6


class HostCost:
    """Host seconds of one key's eager forward calls and its graphed calls alone, and the decision
    made on them (its calls chains served: chains/record.py's ChainCost).

    Args:
        measure: time this key's calls at all (False: nothing is timed).
        judge: time eager calls before the capture and run the key eagerly when its graphed
            calls are slower (``eager_if_slower``); False: measure and warn only.
    """

    __slots__ = ("eager_s", "replay_s", "measure", "judge", "verdict", "skip")

    def __init__(self, measure=True, judge=False):
        self.eager_s = []
        self.replay_s = []
        self.measure = measure
        self.judge = measure and judge
        self.verdict = None if measure else "not timed"  # None while calls alone are timed
        self.skip = False  # the replay under way is no sample (not_a_sample)

    # ------------------------------------------------------------------ what the lifecycle asks
    @property
    def timing(self):
        """True while calls of this key alone are still timed."""
        return self.verdict is None

    @property
    def judging(self):
        """True while this key's calls alone decide whether it stays graphed (it joins no chain)."""
        return self.judge and self.verdict is None

    def wants_eager(self, warmups_left):
        """True when the next call of this key, still warming up with ``warmups_left`` warmup calls
        to come (each an eager sample too), should be a timed eager call (the dispatcher's
        TIMED_EAGER: core/dispatch.py)."""
        return self.judging and not self.replay_s and len(self.eager_s) + warmups_left < SAMPLES

    # ------------------------------------------------------------------ samples (the runner times the calls)
    def add_eager(self, seconds):
        """Records one eager call's host seconds (a warmup call, a timed eager sample)."""
        if self.verdict is None:
            self.eager_s.append(seconds)

    def not_a_sample(self):
        """The replay under way is no sample of this key's calls alone (a replay that started a chain
        paid the bridge of every member: chains/record.py)."""
        self.skip = self.verdict is None

    def add_replay(self, seconds):
        """Records one replay's host seconds, as a graphed call alone unless ``not_a_sample`` said so."""
        if self.skip:
            self.skip = False
        elif self.verdict is None:
            self.replay_s.append(seconds)
            self._judge_alone()

    def _judge_alone(self):
        if len(self.replay_s) <= SAMPLES:
            return
        if not self.eager_s:  # no eager call was timed (warmup_steps=0, eager_if_slower=False)
            self.verdict = "unmeasured"
            return
        self.verdict = "eager" if self.slower_than_eager(self.replay_s[1:]) else "graphed"

    def slower_than_eager(self, graphed):
        """Whether the lower quartile of ``graphed`` (seconds) is not below the eager one."""
        return quartile_us(graphed) >= quartile_us(self.eager_s)

    # ------------------------------------------------------------------ results
    def graphed_us(self):
        return quartile_us(self.replay_s[1:])

    def eager_us(self):
        return quartile_us(self.eager_s)

    def slower(self):
        """True when this key's graphed calls alone were found slower than its eager calls."""
        return self.verdict == "eager"

    def describe(self):
        """The measured host times for explain(), or ""."""
        eager, graphed = self.eager_us(), self.graphed_us()
        if eager is None or graphed is None:
            return ""
        return (f"host us per forward call: eager {eager:.1f} (lower quartile of {len(self.eager_s)}), "
                f"graphed {graphed:.1f} (lower quartile of {len(self.replay_s) - 1})")

    def reason(self, alone=None):
        """Why the key runs eagerly (``slower()``): both numbers and the override."""
        return slower_reason("graphed calls", self.graphed_us(), self.eager_us())

    def warning(self, label, alone, acted):
        return slower_message(label, "a graphed call", self.graphed_us(), self.eager_us(), acted)


def slower_reason(calls, graphed, eager):
    """The fallback reason of a key whose ``calls`` cost ``graphed`` us against ``eager``."""
    return (f"its {calls} cost more host time than its eager calls: {graphed:.1f} against {eager:.1f} "
            "us per forward call (lower quartiles of its eager calls before its capture and its replays; "
            "eager_if_slower=False keeps it graphed)")


def slower_message(label, call, graphed, eager, acted):
    """The warning for key ``label``, whose ``call`` costs ``graphed`` us against ``eager``; ``acted``:
    it runs eagerly from now on."""
    then = ("so it runs eagerly from now on (results are eager's; eager_if_slower=False keeps it graphed)" if acted
            else "so graphing it makes training slower where the host is the bottleneck")
    return (
        f"key {label}: {call} costs {graphed:.1f} us of host "
        f"time against {eager:.1f} us for the eager call (forward, lower quartiles), {then}. Each "
        "graphed call pays a fixed toll (key, checks, copies and Paddle's autograd bridge, again in backward), more than this "
        "block's kernel launches cost eagerly. Graph larger blocks (several layers in one Layer: autocudagraph "
        "on the Layer that calls them), or the whole training step with autocudagraph_step. Every key's numbers "
        "are in explain()."
    )


def judged_slower(entry):
    """What found ``entry``'s graphed calls slower than its eager calls: its HostCost (calls alone), its
    chain record's cost (calls chains served: chains/record.py), or None."""
    cost = entry.host_cost
    if cost.slower():
        return cost
    chain = entry.chain
    return chain.cost if chain is not None and chain.cost.slower() else None


def act(entry, warn_once, entries):
    """Acts on ``entry``'s verdict once it is made: eager from now on (``eager_if_slower``: the
    entry falls back with the reason), and ``warn_once(topic, message)`` once per process.
    Returns ALL_SLOWER when the entry has just fallen back and every key of ``entries`` (its
    wrapper's) runs eagerly as slower, else None."""
    judged = judged_slower(entry)
    if judged is None or not entry.has_graphs:
        return None
    cost = entry.host_cost
    if cost.judge:
        entry.fall_back(judged.reason(cost))
    if warn_once_per_process():
        warn_once("cannot_pay", judged.warning(entry.label, cost, acted=cost.judge))
    return ALL_SLOWER if cost.judge and all(judged_slower(e) for e in entries) else None
