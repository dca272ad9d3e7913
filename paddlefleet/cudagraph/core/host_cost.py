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
* **The backward is timed too** (BackwardTimes), where its end can be seen: a key whose function is
  a Layer's (or a Layer method's) with parameters that need grad. An eager block's backward costs
  4-10x the host time of a graphed block's bridge backward (docs/reports/verdict_probe.md), so a
  verdict on forwards alone sent blocks eager whose steps were faster graphed. A backward starts when
  autograd reaches the call: a gradient hook on the eager call's outputs, or the bridge's backward of
  the graphed call; it ends at the last of the Layer's parameters whose grad autograd accumulates
  (a gradient hook on each, before the accumulation: the last parameter's accumulation is not counted,
  on either side). Each parameter counts once per backward (a second arrival is another backward: a
  Layer called twice). The hooks return None (the grads are untouched), are registered on the
  parameters from the key's first eager sample until its verdict and on an eager sample's outputs,
  and cost about a microsecond a parameter per backward while they are there. A key whose backward
  cannot be seen (a plain function, a Layer without such parameters, calls never followed by a
  backward) is judged on its forwards, as before.
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
* **Samples taken at different host speeds.** The eager samples come from a key's first calls and its replays come
  later, so a host that runs slower for a while (another process on its cores, a virtual machine's neighbours) can
  slow one side's samples and not the other's: on an H200 lease the host ran a bare matmul's launch at 37.7 us just
  before a one-matmul model's keys took their eager samples and at 17.6 at the end of the run, and that model's keys
  were judged faster graphed and kept graphed for good, their forwards then costing twice eager's host time
  (docs/reports/pass_through_probe.md). So each sample is followed by a fixed piece of Python (``speed_probe``, dict
  and tuple work, no device call, the least of three ~2 us runs on the CPU machine), and the eager side's cost is
  divided by how much slower that piece ran during the eager samples than during the replays (``slowdown``: the lower
  quartiles' ratio, taken within 1/4 to 4). The ratio of two windows on a quiet host stays within 8% of 1 in 98 of 100
  trials there, so a ratio within 15% either way (SAME_SPEED) counts as the same speed and leaves the numbers as they
  were; explain() shows any other. The probe sees what slows all of the process's Python alike (a busy core sibling, a
  lower clock); what slows only some calls (a garbage collection, a process taking turns with it on one CPU:
  docs/reports/slow_start_probe.md, where such a process moved no verdict) the lower quartile leaves out, as before.
* **Each side's number is its lower quartile**, not its median. Noise only ever adds host time,
  and on some calls it adds much: on the H100 (32 layers of six matmuls, width 512) the first
  layer of every step paid about 150 us more than the next layer, eagerly and graphed alike,
  with a spread wider than the graph's saving there (eager 346-519 us, graphed 165-354 us over
  eight calls each). Compared by medians, that first layer ran eagerly as "slower" in 7 of 16
  timed runs. The lower quartile (between the second and third fastest of eight) is near each
  side's own cost, and still no single call, fast or slow, decides.
* **The decision.** A key's cost on each side is its forward quartile, plus its backward quartile
  where both sides' backwards were timed (the first graphed backward, which may pay set-up, is
  dropped as the first replay is). When the graphed cost is not below the eager one the key runs
  eagerly from then on (its graphs and static buffers are released; explain() gives the numbers
  and the reason), with one warning per process. Otherwise it keeps its graphs. Once
  every key of a wrapper runs eagerly as slower, its later calls skip the key too (ALL_SLOWER:
  the key costs host time as well; a call of a new shape is then not graphed, reset() measures
  again).
* **What it does not see.** Host time only: a block whose kernels, not its launches, bound the step
  (GPU-bound) gains nothing from a graph but the verdict weighs its host time; on the H200 four
  graphed 8x4096 blocks tie eager in throughput and lose about 9% in latency (docs/reports/benchmarks.md).
  Telling such blocks apart needs the graphs' device time against the step's host time, which one
  key does not see; ``eager_if_slower=False`` or graphing larger blocks is the choice there.
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
import weakref

from .slower import host_speed, slower_message, slower_reason

__all__ = ["BackwardTimes", "HostCost", "SAMPLES", "TIMED", "ALL_SLOWER", "act", "clock", "measured", "quartile_us",
           "speed_probe", "warn_once_per_process"]

#: Timed calls per side (eager, graphed alone, chained) a decision needs.
SAMPLES = 8

#: The clock calls are timed with (tests put a stand-in here).
clock = time.perf_counter

#: How far the eager side is scaled for the host's speed at most, either way, and the ratio within which the two
#: windows count as one speed (NOTE [ Graphed calls that cannot pay ], "Samples taken at different host speeds").
MAX_SLOWDOWN = 4.0
SAME_SPEED = 1.15

_PROBE_ITEMS = tuple(range(32))


def speed_probe():
    """Seconds a fixed piece of Python (dict and tuple work, no device call) takes on this host now, the least of
    three runs: the host's speed at a sample (NOTE [ Graphed calls that cannot pay ], "Samples taken at different
    host speeds")."""
    runs = []
    for _ in range(3):
        start = clock()
        {i: (i, -i) for i in _PROBE_ITEMS}  # noqa: B018 (the work timed)
        runs.append(clock() - start)
    return min(runs)


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


def _start_hook(ref, serial):
    """A gradient hook marking where one call's backward starts (``serial``: the call's; its other
    outputs' hooks, reached later in the same backward, change nothing)."""

    def hook(grad):
        times = ref()
        if times is not None:
            times.started(serial, False)
        return None

    return hook


def _end_hook(ref, index):
    """A gradient hook on parameter ``index``: its grad arrived (NOTE [ Graphed calls that cannot pay ])."""

    def hook(grad):
        times = ref()
        if times is not None:
            times.ended(index)
        return None

    return hook


class BackwardTimes:
    """Host seconds of one key's backwards, eager (``eager_s``) and graphed (``graphed_s``), from where
    autograd reaches the call to the last of its Layer's parameters' grads (NOTE [ Graphed calls that
    cannot pay ], "The backward is timed too"). Holds its parameters weakly (a hook left by a dropped
    key does nothing) and no reference from its hooks (they hold it weakly)."""

    __slots__ = ("__weakref__", "eager_s", "graphed_s", "_open", "_hooks", "_serial")

    def __init__(self):
        self.eager_s = []
        self.graphed_s = []
        self._open = None  # [start, end, graphed, serial, parameters seen] of the backward under way
        self._hooks = None  # [(weak parameter, hook id)] while armed; () once closed
        self._serial = 0

    @property
    def armed(self):
        """True while backwards are timed (the parameters' hooks are registered)."""
        return bool(self._hooks)

    def arm(self, layers):
        """Registers the end hooks on the parameters of ``layers`` that need grad, once per key; nothing
        when none does (the backward cannot be seen)."""
        if self._hooks is not None:
            return
        ref = weakref.ref(self)
        params = [p for layer in layers for p in layer.parameters()]
        self._hooks = [(weakref.ref(p), p._register_grad_hook(_end_hook(ref, i)))
                       for i, p in enumerate(params) if not p.stop_gradient]

    def next_call(self):
        """A number for the next timed call: its backward's start is marked once, however many of its
        outputs autograd reaches."""
        self._serial += 1
        return self._serial

    def eager_call(self, outputs):
        """Marks the start of the backward of an eager call that returned the tensors ``outputs``."""
        ref, serial = weakref.ref(self), self.next_call()
        for t in outputs:
            if not t.stop_gradient:
                t._register_grad_hook(_start_hook(ref, serial))

    def started(self, serial, graphed):
        """Autograd reached the call ``serial`` (next_call(); ``graphed``: in the bridge's backward)."""
        opened = self._open
        if opened is not None:
            if opened[3] == serial:
                return
            self._finish(opened)
        self._open = [clock(), None, graphed, serial, set()]

    def ended(self, index):
        opened = self._open
        if opened is None or index in opened[4]:  # a second arrival belongs to another backward
            return
        opened[4].add(index)
        opened[1] = clock()

    def _finish(self, opened):
        if opened[1] is not None:
            (self.graphed_s if opened[2] else self.eager_s).append(opened[1] - opened[0])

    def close(self):
        """Stops timing for good: the backward under way is kept if its end was seen, the hooks are removed."""
        opened, self._open = self._open, None
        if opened is not None:
            self._finish(opened)
        hooks, self._hooks = self._hooks, ()
        for ref, hook_id in hooks or ():
            p = ref()
            if p is not None:
                p._remove_grad_hook(hook_id)

    def quartiles_us(self):
        """``(eager, graphed, eager samples, graphed samples)``: the lower quartiles in us (the first
        graphed backward dropped) and how many each is of, or None unless both sides were timed."""
        graphed = self.graphed_s[1:] if len(self.graphed_s) > 1 else self.graphed_s
        if not self.eager_s or not graphed:
            return None
        return quartile_us(self.eager_s), quartile_us(graphed), len(self.eager_s), len(graphed)


class HostCost:
    """Host seconds of one key's eager forward calls and its graphed calls alone, and the decision
    made on them (its calls chains served: chains/record.py's ChainCost).

    Args:
        measure: time this key's calls at all (False: nothing is timed).
        judge: time eager calls before the capture and run the key eagerly when its graphed
            calls are slower (``eager_if_slower``); False: measure and warn only.
    """

    __slots__ = ("eager_s", "replay_s", "eager_probe_s", "replay_probe_s", "measure", "judge", "verdict", "skip",
                 "backward", "backward_us")

    def __init__(self, measure=True, judge=False):
        self.eager_s = []
        self.replay_s = []
        self.eager_probe_s = []  # speed_probe() after each eager sample, and after each replay sample
        self.replay_probe_s = []
        self.measure = measure
        self.judge = measure and judge
        self.verdict = None if measure else "not timed"  # None while calls alone are timed
        self.skip = False  # the replay under way is no sample (not_a_sample)
        self.backward = BackwardTimes() if measure else None  # None once the verdict is made
        self.backward_us = None  # (eager, graphed) backward lower quartiles the verdict weighed, or None

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
            self.eager_probe_s.append(speed_probe())

    def eager_backward(self, outputs, layers):
        """Times the backward of the eager sample that returned the tensors ``outputs``, its end seen on
        the parameters of ``layers`` (hooked at the first sample)."""
        times = self.backward
        if times is None:
            return
        times.arm(layers)
        if times.armed:
            times.eager_call(outputs)

    def graphed_backward(self):
        """The BackwardTimes the bridge's backward of the replay under way tells it starts (a replay
        that is a sample of this key's calls alone), or None."""
        times = self.backward
        return times if times is not None and times.armed and not self.skip else None

    def stop_backward(self):
        """No more backward samples (the verdict, or the key's graphs dropped): the hooks go."""
        times, self.backward = self.backward, None
        if times is not None:
            times.close()
            if self.backward_us is None:
                self.backward_us = times.quartiles_us()

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
            self.replay_probe_s.append(speed_probe())
            self._judge_alone()

    def _judge_alone(self):
        if len(self.replay_s) <= SAMPLES:
            return
        self.stop_backward()
        if not self.eager_s:  # no eager call was timed (warmup_steps=0, eager_if_slower=False)
            self.verdict = "unmeasured"
            return
        self.verdict = "eager" if self.slower_than_eager(self.replay_s[1:]) else "graphed"

    def slower_than_eager(self, graphed):
        """Whether a call whose forwards took ``graphed`` (seconds), with this key's graphed backward,
        costs no less host time than an eager call (lower quartiles; NOTE [ Graphed calls that cannot pay ])."""
        return self.total_us(quartile_us(graphed)) >= self.total_us(None)

    def total_us(self, graphed_forward):
        """A graphed call's host us with a forward of ``graphed_forward`` us, or (None) an eager call's:
        forward plus backward where both sides' backwards were timed; the eager call's at the host speed of the
        replays (``slowdown``)."""
        backward = self.backward_us
        if graphed_forward is None:
            return (quartile_us(self.eager_s) + (backward[0] if backward is not None else 0.0)) / self.slowdown()
        return graphed_forward + (backward[1] if backward is not None else 0.0)

    def slowdown(self):
        """How much slower the host ran speed_probe() during the eager samples than during the replays (lower
        quartiles; within 1/MAX_SLOWDOWN to MAX_SLOWDOWN; 1.0 within SAME_SPEED either way, and until both were
        probed: NOTE [ Graphed calls that cannot pay ], "Samples taken at different host speeds")."""
        eager, replay = quartile_us(self.eager_probe_s), quartile_us(self.replay_probe_s)
        if not eager or not replay or 1.0 / SAME_SPEED <= eager / replay <= SAME_SPEED:
            return 1.0
        return min(max(eager / replay, 1.0 / MAX_SLOWDOWN), MAX_SLOWDOWN)

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
        text = (f"host us per forward call: eager {eager:.1f} (lower quartile of {len(self.eager_s)}), "
                f"graphed {graphed:.1f} (lower quartile of {len(self.replay_s) - 1})")
        backward = self.backward_us
        if backward is not None:
            text += (f"; per backward: eager {backward[0]:.1f} (lower quartile of {backward[2]}), graphed "
                     f"{backward[1]:.1f} (lower quartile of {backward[3]})")
        slowdown = self.slowdown()
        if slowdown != 1.0:
            text += (f"; the host ran {host_speed(slowdown)} during the eager "
                     f"calls than during the replays (their host time divided by {slowdown:.2f} where compared)")
        return text

    def weighed(self):
        """What the verdict weighed, in words."""
        return "forward and backward" if self.backward_us is not None else "forward"

    def reason(self, alone=None):
        """Why the key runs eagerly (``slower()``): both numbers and the override."""
        return slower_reason("graphed calls", self.total_us(self.graphed_us()), self.total_us(None), self.weighed(),
                             self.slowdown())

    def warning(self, label, alone, acted):
        return slower_message(label, "a graphed call", self.total_us(self.graphed_us()), self.total_us(None), acted,
                              self.weighed(), self.slowdown())


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
