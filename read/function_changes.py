"""What changed between two runs, by function: the frames of the culprit prefix whose
time grew, each with a verdict held to the same discipline as the prefixes'.

A comparison (:mod:`.regressions`) names the prefix that got slower (its culprit);
the workers' profiles (:mod:`.profiles`, Dask's statistical profiler: a sample of
every executing thread's stack every ``distributed.worker.profile.interval``, 10 ms
by default) say where in its tasks the time went. For each frame (its identity as
:mod:`.profiles` names it: function, file and the line where it begins) the samples
in which it was innermost (its *own* samples) are a share of the prefix's samples in
each run; that share times the prefix's measured compute seconds (the comparison's,
exact) is the frame's seconds, and per task (over the prefix's tasks) its time. Own
time, not total: a frame whose callee got slower did not get slower itself, and
every caller of the planted function would be named with it.

The change of a frame's time per task is a ratio, candidate / baseline, with a 95 %
interval: its logarithm's variance is the sampling variance of both shares (the
samples are counts: binomial, ``1/k - 1/N`` for ``k`` of ``N`` samples, by the delta
method; ``k`` the samples its own rest on, fewer than they number where Dask's tree
left them to be apportioned, :func:`samples_of`), or, if larger, that of its own
samples times their overdispersion from one profile cycle to the next
(:func:`dispersion`), plus the uncertainty of the prefix's own per-task ratio (the
width of the comparison's Hodges-Lehmann interval). Its two-sided z-test enters Holm's step-down
correction over every frame tested (at :data:`~.comparison.ALPHA` family-wise), as
the prefixes' rank tests do. The noise band is three run-to-run standard deviations
of the frame's time per task over the earlier runs that have profiles and the
baseline (:func:`.noise.run_noise`; at least :data:`~.noise.MIN_CHANGE`). A frame
*grew* (*shrank*) when its test rejects, the whole interval lies beyond the band,
its seconds moved by :data:`~.comparison.MIN_SHARE` of the run's task seconds at
least, and its share of the prefix's samples moved the same way beyond their noise
(the same z-test without the prefix's part, Holm-corrected too); without that last,
it *grew with its prefix*: its time moved as the whole prefix's did (a machine busier
that run moves every frame's time, not their shares), the prefix's verdict is the one
to read; it is *within noise* when its interval (widened by the run-to-run noise of
the pair) rules out a change of :data:`~.comparison.RESOLVE` (or the band) both
ways, or when a change that large would not move the run's task seconds by
:data:`~.comparison.MIN_SHARE`; else, and below :data:`MIN_SAMPLES` samples (that
its own rest on) in both runs together, *too few samples* to tell.

Without a culprit the prefix looked into is the one whose compute seconds grew most
(a function can change beyond its noise while its prefix does not); a prefix without
profiles in either run is said so, in one line.

The profiles table has no span column: a span's profile is its prefix's cycles in the
span's time (its tasks' first compute start to the last stop, and one profile cycle
after), which another span of the same prefix running at that very time would share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import NamedTuple

from dask_blackbox.read import noise, profiles
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.comparison import (ALPHA, MIN_SHARE, RESOLVE, WORK, Change, Comparison,
                                           Run)
from dask_blackbox.read.filters import table
from dask_blackbox.read.regressions import _resolved, holm, profile

#: Fewer samples (that a frame's own rest on) in both runs together: "too few samples".
MIN_SAMPLES = 20
#: Frames whose time grew shown (the most seconds grown first).
TOP = 5
#: Seconds of profile after a span's last task (a cycle is dated when it ends: Dask's
#: ``distributed.worker.profile.cycle``, 1 s by default, and a little more).
CYCLE_SLACK = 2.0

VERDICTS = ("grew", "shrank", "grew with its prefix", "shrank with its prefix", "within noise",
            "too few samples")


@dataclasses.dataclass(frozen=True)
class Samples:
    """One run's profile of one prefix, as a function comparison reads it."""

    #: frame text -> samples in which it was innermost (its own)
    own: dict[str, int]
    #: frame text -> samples in which it was on the stack
    on_stack: dict[str, int]
    #: frame text -> the samples its own ones rest on (:func:`samples_of`)
    info: dict[str, int]
    #: the prefix's samples
    samples: int
    #: the prefix's compute seconds (every task's) and tasks, from the comparison
    compute: float
    tasks: int
    #: the prefix's samples in each profile cycle (of each worker), and each frame's own
    cycles: tuple[int, ...] = ()
    cycle_own: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def seconds(self, text: str) -> float:
        """The frame's own seconds: its share of the samples times the compute seconds."""
        return float(self.own.get(text, 0) / self.samples * self.compute) if self.samples else 0.0

    def per_task(self, text: str) -> float:
        return self.seconds(text) / self.tasks if self.tasks else 0.0


def samples_of(stacks: dict[str, int], compute: float, tasks: int,
               cycles: Sequence[dict[str, int]] = ()) -> Samples:
    """:class:`Samples` of folded stacks (stack -> samples), and of the stacks of each
    profile cycle (``cycles``: their sum is ``stacks``), whose spread is the samples'
    overdispersion (:func:`dispersion`).

    Dask's worker does not count a sample in its innermost frame
    (``Worker.trigger_profile``), only in its callers; the recorded stacks give the
    samples a node's children do not account for to its children (``folded`` in the
    worker plugin): to those never seen calling, equally, else in proportion to their
    counts. So a frame's own samples rest on fewer samples than they number: on its
    count as a caller where it calls other frames (what they were apportioned by), on
    nothing where it shares its caller with other frames never seen calling (an equal
    split), on themselves where it is its caller's only such frame. ``info`` holds
    that number, which the sampling variance is taken from."""
    own: dict[str, int] = {}
    on_stack: dict[str, int] = {}
    paths = {}
    through: dict[tuple, int] = {}
    for stack, n in stacks.items():
        frames = tuple(stack.split(";"))
        paths[frames] = n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for text in set(frames):
            on_stack[text] = on_stack.get(text, 0) + n
        for i in range(1, len(frames)):
            through[frames[:i]] = through.get(frames[:i], 0) + n
    leaves: dict[tuple, int] = {}
    for frames in paths:
        if frames not in through:
            leaves[frames[:-1]] = leaves.get(frames[:-1], 0) + 1
    info: dict[str, int] = {}
    for frames, n in paths.items():
        if frames in through:
            k = through[frames]
        elif leaves[frames[:-1]] >= 2:
            k = 0
        else:
            k = n
        info[frames[-1]] = info.get(frames[-1], 0) + k
    totals, cycle_own = [], {}
    for i, cycle in enumerate(cycles):
        totals.append(sum(cycle.values()))
        for stack, n in cycle.items():
            leaf = stack.rsplit(";", 1)[-1]
            counts = cycle_own.setdefault(leaf, [0] * len(cycles))
            counts[i] += n
    return Samples(own, on_stack, info, sum(stacks.values()), float(compute), int(tasks),
                   tuple(totals), {t: tuple(c) for t, c in cycle_own.items()})


def dispersion(runs: Sequence[Samples], text: str) -> float:
    """How much more the frame's own samples vary from one profile cycle to the next
    than counts drawn independently would (the quasi-binomial dispersion: Pearson's
    chi-square over its degrees of freedom, each run about its own share), at least
    1. The samples of a worker are not independent draws: on a loaded machine the
    profiler thread wakes when it can, more often in one second than in the next, and
    a function that runs in those seconds is sampled more; a frame's own samples
    apportioned by its caller's count (:func:`samples_of`) move with that count."""
    chi2, df = 0.0, 0
    for r in runs:
        counts = r.cycle_own.get(text)
        if not counts or not r.samples or len(r.cycles) < 2:
            continue
        share = r.own.get(text, 0) / r.samples
        if not 0 < share < 1:
            continue
        for k, n in zip(counts, r.cycles):
            if n:
                chi2 += (k - n * share) ** 2 / (n * share * (1 - share))
        df += sum(1 for n in r.cycles if n) - 1
    return max(1.0, chi2 / df) if df > 0 else 1.0


class FunctionChange(NamedTuple):
    """One frame of the prefix, baseline against candidate."""

    function: str
    location: str
    #: the frame's text, ``file:line:function``
    frame: str
    #: "grew", "shrank", "grew with its prefix", "shrank with its prefix", "within
    #: noise", "too few samples"
    verdict: str
    #: own samples, and their share of the prefix's
    samples_base: int
    samples_new: int
    share_base: float
    share_new: float
    #: share of the prefix's samples on the stack (the frame and its callees)
    total_share_base: float
    total_share_new: float
    #: own seconds (share x the prefix's compute seconds)
    seconds_base: float
    seconds_new: float
    #: own time per task, candidate / baseline, and its interval
    ratio: float
    low: float
    high: float
    p_value: float
    band: float
    history: int
    #: the p-value of the change of its share of the prefix's samples
    share_p_value: float = math.nan

    @property
    def delta(self) -> float:
        return self.seconds_new - self.seconds_base

    def described(self) -> str:
        """"+29.8 % [+21.0 %, +39.2 %], 412 / 530 samples"."""
        change = "" if math.isnan(self.ratio) else f"{self.ratio - 1:+.1%}"
        if not math.isnan(self.low):
            change += f" [{self.low - 1:+.1%}, {self.high - 1:+.1%}]"
        return f"{change}, {self.samples_base} / {self.samples_new} samples".lstrip(", ")


def _ratio(base: Samples, new: Samples, text: str,
           prefix_change: Change | None) -> tuple[noise.Interval, float, float, float]:
    """The ratio of the frame's own time per task and its interval; the p-value of
    its z-test (on the logarithm); the logarithm of the ratio of its shares of the
    prefix's samples and the p-value of its z-test."""
    # a frame absent from one run: half a sample there (a continuity correction)
    k_b, k_n = max(base.own.get(text, 0), 0.5), max(new.own.get(text, 0), 0.5)
    per_task_b = k_b / base.samples * base.compute / base.tasks
    per_task_n = k_n / new.samples * new.compute / new.tasks
    log_ratio = math.log(per_task_n / per_task_b)
    i_b, i_n = max(base.info.get(text, 0), 0.5), max(new.info.get(text, 0), 0.5)
    apportioned = max(0.0, 1 / i_b - 1 / base.samples) + max(0.0, 1 / i_n - 1 / new.samples)
    spread = dispersion((base, new), text) * (max(0.0, 1 / k_b - 1 / base.samples)
                                              + max(0.0, 1 / k_n - 1 / new.samples))
    variance = max(apportioned, spread)
    log_shares = math.log((k_n / new.samples) / (k_b / base.samples))
    share_p = _p(log_shares, math.sqrt(variance))
    z = NormalDist().inv_cdf(1 - (1 - noise.CONFIDENCE) / 2)
    if prefix_change is not None and prefix_change.low > 0 and prefix_change.high > 0:
        variance += ((math.log(prefix_change.high) - math.log(prefix_change.low)) / (2 * z)) ** 2
    se = math.sqrt(variance)
    interval = noise.Interval(math.exp(log_ratio), math.exp(log_ratio - z * se),
                              math.exp(log_ratio + z * se))
    return interval, _p(log_ratio, se), log_shares, share_p


def _p(log_ratio: float, se: float) -> float:
    """Two-sided p-value of a z-test of a logarithm with standard error ``se``."""
    if se <= 0:
        return 0.0 if log_ratio else 1.0
    return math.erfc(abs(log_ratio) / se / math.sqrt(2))


def compare_samples(base: Samples, new: Samples, past: Sequence[Samples] = (),
                    floor: float = 0.0, prefix_change: Change | None = None,
                    alpha: float = ALPHA) -> list[FunctionChange]:
    """Every frame of the prefix, baseline against candidate, the most seconds grown
    first; ``past``: the earlier runs' profiles of the prefix (the noise band);
    ``floor``: the seconds a change must move (:data:`~.comparison.MIN_SHARE` of the
    run's task seconds); ``prefix_change``: the comparison's compute change of the
    prefix (its interval's width enters each frame's). Reads nothing."""
    if not base.samples or not new.samples or not base.tasks or not new.tasks:
        return []
    frames = sorted(set(base.own) | set(new.own))
    counted = {t for t in frames if base.info.get(t, 0) + new.info.get(t, 0) >= MIN_SAMPLES}
    tests = {t: _ratio(base, new, t, prefix_change) for t in counted}
    rejected = holm({t: test[1] for t, test in tests.items()}, alpha)
    within = holm({t: test[3] for t, test in tests.items()}, alpha)
    nan = math.nan
    out = []
    for text in frames:
        f = profiles.frame(text)
        seconds_b, seconds_n = base.seconds(text), new.seconds(text)
        history = [h.per_task(text) for h in past if h.info.get(text, 0) >= MIN_SAMPLES]
        fraction = noise.band(noise.run_noise(history + [base.per_task(text)]))
        common = (f.function, f.location, text)
        shares = (base.own.get(text, 0), new.own.get(text, 0),
                  base.own.get(text, 0) / base.samples, new.own.get(text, 0) / new.samples,
                  base.on_stack.get(text, 0) / base.samples,
                  new.on_stack.get(text, 0) / new.samples, seconds_b, seconds_n)
        if text not in tests:
            out.append(FunctionChange(*common, "too few samples", *shares, nan, nan, nan, nan,
                                      fraction, len(past)))
            continue
        interval, p, log_shares, share_p = tests[text]
        side = noise.beyond(interval, fraction) if text in rejected else 0
        if abs(seconds_n - seconds_b) < floor:
            side = 0
        verdict = {1: "grew", -1: "shrank", 0: "within noise"}[side]
        if side and not (text in within and side * log_shares > 0):
            verdict += " with its prefix"  # its share of the prefix did not move with it
        matters = max(RESOLVE, fraction) * max(seconds_b, seconds_n) >= floor
        if side == 0 and matters and not _resolved(interval, fraction):
            verdict = "too few samples"
        out.append(FunctionChange(*common, verdict, *shares, *interval, p, fraction, len(past),
                                  share_p))
    out.sort(key=lambda c: (-c.delta, c.frame))
    return out


# -------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class FunctionComparison:
    """The frames of one prefix whose time grew, in a comparison."""

    prefix: str | None
    #: why this prefix: "culprit", or "grew most" (no prefix was slower beyond noise)
    why: str
    #: the frames whose time grew, the most seconds first (at most :data:`TOP`)
    grown: tuple[FunctionChange, ...] = ()
    #: frames compared, and how many of them had enough samples for a test
    frames: int = 0
    tested: int = 0
    samples_base: int = 0
    samples_new: int = 0
    #: a one-line reason when nothing could be compared (no profiles recorded, ...)
    missing: str | None = None

    @property
    def method(self) -> str:
        return (f"per frame of the prefix, its own samples (innermost) as a share of the "
                f"prefix's, times the prefix's compute seconds, per task; the ratio's "
                f"{noise.CONFIDENCE:.0%} interval from the samples' binomial variance "
                f"(overdispersed as the profile cycles spread) and the prefix's own per-task "
                f"interval, z-tests Holm-corrected over {self.tested} "
                f"frames (alpha {ALPHA}); a change counts when the test rejects, the interval "
                f"lies beyond the noise band ({noise.NOISE_SIGMAS:g} run-to-run standard "
                f"deviations over earlier runs with profiles, at least {noise.MIN_CHANGE:.0%}), "
                f"it moves the run's task seconds by {MIN_SHARE:.0%} and its share of the "
                f"prefix's samples moved too (else: with its prefix); too few samples "
                f"where the interval cannot rule out {RESOLVE:.0%} either way, or below "
                f"{MIN_SAMPLES} samples")

    def sentences(self) -> list[str]:
        if self.missing:
            return [self.missing]
        which = ("the culprit prefix" if self.why == "culprit"
                 else "no prefix was slower beyond noise; the prefix whose compute grew most,")
        head = (f"by function, {which} {self.prefix!r}: {self.samples_base} -> "
                f"{self.samples_new} profile samples, {self.frames} frames, {self.tested} "
                "with enough samples to test")
        out = [head]
        if not self.grown:
            out.append("no frame's own time grew")
        for c in self.grown:
            out.append(f"{c.verdict}: {c.function} ({c.location}) "
                       f"{_s(c.seconds_base)} -> {_s(c.seconds_new)} ({_s(c.delta, True)}), "
                       f"{c.described()}")
        return out

    def as_dict(self) -> dict:
        return {"prefix": self.prefix, "why": self.why, "frames": self.frames,
                "tested": self.tested, "samples_base": self.samples_base,
                "samples_new": self.samples_new, "missing": self.missing,
                "grown": [c._asdict() for c in self.grown], "sentences": self.sentences(),
                "method": self.method}


def target(comparison: Comparison) -> tuple[str | None, str]:
    """The prefix to look into: the culprit's, else the one whose compute seconds
    grew most (else the one with the most), and why."""
    if comparison.culprit is not None:
        return comparison.culprit.prefix, "culprit"
    compute = [c for c in comparison.changes if c.action == "compute"
               and c.verdict not in ("new", "gone")]
    if not compute:
        return None, "grew most"
    best = max(compute, key=lambda c: (c.delta, c.total_new, c.prefix))
    return best.prefix, "grew most"


#: What :func:`read` reads (from ``{profiles}``; ``{where}`` filled in where it is run).
STACKS = ("SELECT worker, toFloat64(ts), stack, toUInt64(sum(count)) FROM {profiles} WHERE "
          "{where} GROUP BY worker, ts, stack")


def read(backend: Backend, run: Run, prefix: str) -> list[dict[str, int]]:
    """The folded stacks (stack -> samples) of ``prefix`` in ``run``, one mapping per
    profile cycle of a worker: its cluster's, within the span's time for a span's run
    (the module docstring)."""
    where = ["cluster_id = {c:String}", "prefix = {p:String}"]
    params: dict = {"c": run.cluster_id, "p": prefix}
    if run.span_ids is not None:
        window = _window(backend, run, prefix)
        if window is None:
            return []
        where += ["ts >= toDateTime64({since:Float64}, 6, 'UTC')",
                  "ts < toDateTime64({until:Float64}, 6, 'UTC')"]
        params.update(since=window[0], until=window[1] + CYCLE_SLACK)
    _, rows = backend.query(
        STACKS.format(profiles=table(backend, 'profiles'), where=' AND '.join(where)),
        params)
    cycles: dict[tuple, dict[str, int]] = {}
    for worker, ts, stack, n in rows:
        cycles.setdefault((worker, ts), {})[stack] = int(n)
    return [cycles[k] for k in sorted(cycles)]


def _samples(cycles: list[dict[str, int]], compute: float, tasks: int) -> Samples:
    stacks: dict[str, int] = {}
    for cycle in cycles:
        for stack, n in cycle.items():
            stacks[stack] = stacks.get(stack, 0) + n
    return samples_of(stacks, compute, tasks, cycles)


#: What :func:`_window` reads (from ``{transitions}``).
WINDOW = ("SELECT toFloat64(min(arrayMin(arrayMap(x -> toFloat64(x), startstops.start)))), "
          "toFloat64(max(arrayMax(arrayMap(x -> toFloat64(x), startstops.stop)))), count() "
          "FROM {transitions} WHERE cluster_id = {{c:String}} AND source = 'scheduler' AND "
          "prefix = {{p:String}} AND span_id IN {{ids:Array(String)}} AND "
          "notEmpty(startstops.start)")


def _window(backend: Backend, run: Run, prefix: str) -> tuple[float, float] | None:
    """The first compute start and the last stop of the span's tasks of ``prefix``."""
    _, rows = backend.query(
        WINDOW.format(transitions=table(backend, 'transitions')),
        {"c": run.cluster_id, "p": prefix, "ids": list(run.span_ids or ())})
    if not rows or not rows[0][2]:
        return None
    return float(rows[0][0]), float(rows[0][1])


def _prefix_compute(backend: Backend, run: Run, prefix: str) -> tuple[float, int]:
    s = profile(backend, run).samples.get((prefix, "compute"))
    return (s.total, s.n) if s else (0.0, 0)


def of_comparison(backend: Backend, comparison: Comparison) -> FunctionComparison:
    """The frames of the comparison's culprit prefix (:func:`target`) whose time grew
    (module docstring); ``missing`` says in one line why there are none to show."""
    prefix, why = target(comparison)
    if prefix is None:
        return FunctionComparison(None, why, missing="no prefix to compare by function")
    change = next((c for c in comparison.changes
                   if c.prefix == prefix and c.action == "compute"), None)
    if change is None or not change.n_base or not change.n_new:
        return FunctionComparison(prefix, why, missing=f"prefix {prefix!r} computed in only "
                                  "one of the runs: nothing to compare by function")
    stacks_b = read(backend, comparison.baseline, prefix)
    stacks_n = read(backend, comparison.candidate, prefix)
    empty = [r for r, s in ((comparison.baseline, stacks_b), (comparison.candidate, stacks_n))
             if not s]
    if empty:
        runs = " and ".join(f"{r.label} ({r.cluster_id})" for r in empty)
        return FunctionComparison(prefix, why, missing=(
            f"no profiles recorded for prefix {prefix!r} in {runs}: no comparison by function "
            "(blackbox.producer.record.profiles was off, or its tasks were too short to sample)"))
    base = _samples(stacks_b, change.total_base, change.n_base)
    new = _samples(stacks_n, change.total_new, change.n_new)
    past = []
    for run in comparison.history:
        stacks = read(backend, run, prefix)
        if stacks:
            past.append(_samples(stacks, *_prefix_compute(backend, run, prefix)))
    work = sum(c.total_base for c in comparison.changes if c.action in WORK)
    changes = compare_samples(base, new, past, MIN_SHARE * work, change)
    grown = tuple(c for c in changes if c.delta > 0)[:TOP]
    return FunctionComparison(prefix, why, grown, len(changes),
                              sum(1 for c in changes if not math.isnan(c.p_value)),
                              base.samples, new.samples)


def _s(seconds: float, signed: bool = False) -> str:
    sign = ("+" if seconds >= 0 else "-") if signed else ("-" if seconds < 0 else "")
    v = abs(seconds)
    text = f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s" if v < 60 else f"{v / 60:.1f} min"
    return sign + text
