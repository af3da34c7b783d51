"""Did a run get slower, beyond the run-to-run noise, and which prefix and action did it?

The runs compared are the instances of one span name across runs and clusters (a
span's '/'-joined name, or its last tag: :func:`span_runs`), or the whole runs of the
clusters sharing a name (:func:`cluster_runs`), in time order. By default the latest
(*candidate*) is compared with the one before it (*baseline*); the runs before the
baseline are the *history*.

For every task prefix and action (``compute``, ``transfer``, ``disk``, and
``waiting``: on the worker before compute, neither transferring nor reading from
disk -- a thread was busy) the per-task durations of baseline and candidate are
compared (:mod:`.noise`): the Mann-Whitney U rank test (two-sided; Bonferroni over
the comparisons made, at :data:`ALPHA`) and the Hodges-Lehmann ratio (the median
ratio of a candidate task to a baseline task) with its 95% confidence interval. The noise band of a prefix and action is three run-to-run standard
deviations of its median over the history and the baseline (at least
:data:`~.noise.MIN_CHANGE`; with no history, just that). A change is *slower*
(*faster*) when the test rejects, the whole interval lies above (below) the band, and
it moves the run's task seconds by :data:`MIN_SHARE` at least; otherwise it is within
noise. At most :data:`SAMPLE` tasks a side are compared (ClickHouse samples them);
totals are exact.

The *culprit* is the slower prefix and action whose total seconds grew most, a work
action (compute, transfer, disk) before waiting (which follows from work elsewhere),
with the share of the change in task seconds it explains and whether it sits on the
candidate's critical path (:mod:`.critical_path`): a link of that prefix that spent
time in that action. The wall time (elapsed, first compute to last) is compared with
its own history the same way (one value a run: the band alone decides).

Runs that cannot be compared raise :class:`NotComparable` with a one-line reason:
fewer than two runs, or runs that share no prefix.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dask_blackbox.read import noise
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.critical_path import NoActions, critical_path
from dask_blackbox.read.filters import TimeBound, build, cluster_ids, cluster_names, epoch, table

#: Significance of a rank test, before the Bonferroni correction.
ALPHA = 0.05
#: A change must move the run's task seconds (compute, transfer, disk) by this fraction
#: at least: a prefix of a few short tasks can double without making a run slower.
MIN_SHARE = 0.01
#: Tasks a side the statistics look at (sampled by ClickHouse beyond that).
SAMPLE = 2000
#: Earlier runs read for the noise (the latest ones).
HISTORY = 20
#: Prefixes shown by name in the runs side by side (the most compute seconds).
TOP_PREFIXES = 8
ACTIONS = ("compute", "transfer", "disk", "waiting")
WORK = ("compute", "transfer", "disk")
#: The critical path's part that corresponds to an action.
_PATH_PART = {"compute": "compute", "transfer": "transfer", "disk": "disk", "waiting": "thread"}


class NotComparable(LookupError):
    """The runs asked for cannot be compared; the message says why."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One run: a span instance (its tree) or a whole cluster's run."""

    cluster_id: str
    cluster_name: str
    #: the span's id, or None for the whole run
    span_id: str | None
    #: when it began (the span's enqueued, or the cluster's first envelope), epoch seconds
    began: float
    #: the span tree's ids, or None for the whole run
    span_ids: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        import datetime

        when = datetime.datetime.fromtimestamp(self.began, datetime.timezone.utc)
        return f"{self.cluster_name} {when:%Y-%m-%d %H:%M:%S}"

    def as_dict(self) -> dict:
        return {"cluster_id": self.cluster_id, "cluster_name": self.cluster_name,
                "span_id": self.span_id, "began": self.began, "label": self.label}


class Sample(NamedTuple):
    """One prefix and action of one run: tasks, exact total seconds, durations (sampled)."""

    n: int
    total: float
    values: np.ndarray

    @property
    def median(self) -> float:
        return float(np.median(self.values)) if len(self.values) else 0.0


class Profile(NamedTuple):
    """What a run is compared by."""

    wall: float | None
    samples: dict[tuple[str, str], Sample]


class Change(NamedTuple):
    """One prefix and action, baseline against candidate."""

    prefix: str
    action: str
    #: "slower", "faster", "within noise", "too few tasks", "new", "gone"
    verdict: str
    n_base: int
    n_new: int
    median_base: float
    median_new: float
    total_base: float
    total_new: float
    ratio: float
    low: float
    high: float
    p_value: float
    #: the band a ratio must leave (a fraction), and how many earlier runs set it
    band: float
    history: int

    @property
    def delta(self) -> float:
        return self.total_new - self.total_base


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A candidate run against its baseline, with the verdicts first."""

    what: str
    baseline: Run
    candidate: Run
    history: tuple[Run, ...]
    wall_base: float | None
    wall_new: float | None
    wall_band: float
    changes: tuple[Change, ...]
    culprit: Change | None
    #: the culprit on the candidate's critical path: (links of its prefix with time in
    #: its action, seconds of that action on the path); None when the path is unknown
    on_path: tuple[int, float] | None
    comparisons: int
    notes: tuple[str, ...] = ()
    #: every run read (history, baseline, candidate: oldest first) side by side:
    #: (metric, one value per run) rows -- elapsed_s, task_s, tasks, compute_s <prefix>
    table: tuple[tuple, ...] = ()

    @property
    def wall_verdict(self) -> str:
        if not self.wall_base or not self.wall_new:
            return "unknown"
        ratio = self.wall_new / self.wall_base
        return "slower" if ratio > 1 + self.wall_band else \
            "faster" if ratio < 1 / (1 + self.wall_band) else "within noise"

    @property
    def verdict(self) -> str:
        """"regression" when a prefix and action got slower beyond the noise,
        "improvement" when one got faster and none slower, else "no change beyond
        noise" (the wall time alone decides nothing: a machine busier one night moves
        it without any task being at fault; :attr:`wall_verdict` says how it moved)."""
        slower = [c for c in self.changes if c.verdict == "slower"]
        faster = [c for c in self.changes if c.verdict == "faster"]
        if slower:
            return "regression"
        if faster:
            return "improvement"
        return "no change beyond noise"

    @property
    def method(self) -> str:
        return (f"per prefix and action, the per-task durations of both runs: Mann-Whitney U "
                f"rank test (two-sided, alpha {ALPHA} Bonferroni-corrected over "
                f"{self.comparisons} comparisons) and the Hodges-Lehmann ratio with its "
                f"{noise.CONFIDENCE:.0%} confidence interval; a change counts when the test "
                f"rejects and the interval lies beyond the noise band "
                f"({noise.NOISE_SIGMAS:g} run-to-run standard deviations of the median over "
                f"{len(self.history)} earlier run(s) and the baseline, at least "
                f"{noise.MIN_CHANGE:.0%}) and it moves the run's task seconds by "
                f"{MIN_SHARE:.0%} at least")

    def sentences(self) -> list[str]:
        """The verdict in words, most important first."""
        out = []
        what = self.what
        base, new = self.baseline.label, self.candidate.label
        if self.wall_base and self.wall_new:
            change = self.wall_new / self.wall_base - 1
            out.append(f"{self.verdict.upper()}: {what} took {_s(self.wall_new)} in {new} "
                       f"against {_s(self.wall_base)} in {base} ({change:+.1%}; wall-time noise "
                       f"band ±{self.wall_band:.0%}: {self.wall_verdict})")
        else:
            out.append(f"{self.verdict.upper()}: {what}, {new} against {base}")
        c = self.culprit
        if c is not None:
            changed = sum(x.delta for x in self.changes if x.delta > 0 and x.action in WORK) or 1.0
            path = ("unknown whether on the critical path" if self.on_path is None
                    else "on the critical path ({} link(s), {} of {} there)".format(
                        self.on_path[0], _s(self.on_path[1]), c.action)
                    if self.on_path[0] else "not on the critical path")
            out.append(f"culprit: prefix {c.prefix!r}, {c.action}: {c.ratio - 1:+.1%} per task "
                       f"(median {_s(c.median_base)} -> {_s(c.median_new)}, interval "
                       f"{c.low - 1:+.1%} .. {c.high - 1:+.1%}, p={c.p_value:.2g}, band "
                       f"±{c.band:.0%}); {_s(c.delta, signed=True)} task seconds, "
                       f"{max(0.0, c.delta) / changed:.0%} of the work that grew; {path}")
        for x in self.changes:
            if x is not c and x.verdict in ("slower", "faster"):
                out.append(f"also {x.verdict}: prefix {x.prefix!r}, {x.action}: "
                           f"{x.ratio - 1:+.1%} per task (interval {x.low - 1:+.1%} .. "
                           f"{x.high - 1:+.1%}, p={x.p_value:.2g})")
        if c is None and self.verdict == "no change beyond noise":
            out.append("no prefix and action changed beyond the noise")
        out += list(self.notes)
        out.append("method: " + self.method)
        return out

    def as_dict(self) -> dict:
        return {"what": self.what, "verdict": self.verdict, "wall_verdict": self.wall_verdict,
                "sentences": self.sentences(), "baseline": self.baseline.as_dict(),
                "candidate": self.candidate.as_dict(),
                "history": [r.as_dict() for r in self.history], "wall_base": self.wall_base,
                "wall_new": self.wall_new, "wall_band": self.wall_band,
                "culprit": self.culprit._asdict() if self.culprit else None,
                "on_critical_path": self.on_path, "method": self.method,
                "changes": [c._asdict() for c in self.changes],
                "runs": [r.label for r in (*self.history, self.baseline, self.candidate)],
                "table": [list(row) for row in self.table]}


def _s(seconds: float, signed: bool = False) -> str:
    sign = ("+" if seconds >= 0 else "-") if signed else ("-" if seconds < 0 else "")
    v = abs(seconds)
    text = f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s" if v < 60 else f"{v / 60:.1f} min"
    return sign + text


# ----------------------------------------------------------------------- runs


def _tree_ids(backend: Backend, cluster_id: str, root: str) -> tuple[str, ...]:
    _, edges = backend.query(
        f"SELECT DISTINCT span_id, parent_id FROM {table(backend, 'spans')} "
        "WHERE cluster_id = {c:String}", {"c": cluster_id})
    children = defaultdict(list)
    for s, parent in edges:
        if parent:
            children[parent].append(s)
    found, todo = set(), [root]
    while todo:
        s = todo.pop()
        if s not in found:
            found.add(s)
            todo.extend(children[s])
    return tuple(sorted(found))


def span_runs(backend: Backend, span: str, cluster: str | None = None,
              since: TimeBound = None, until: TimeBound = None) -> list[Run]:
    """Every instance of the span named ``span`` ('/'-joined name, or its last tag),
    oldest first."""
    f = build(backend, cluster, since, until, "enqueued")
    f.parameters["span"] = span
    _, rows = backend.query(
        "SELECT cluster_id, span_id, toFloat64(min(enqueued)) AS began "
        f"FROM {table(backend, 'spans')} {f.where()} {f.and_()} "
        "(arrayStringConcat(name, '/') = {span:String} OR arrayStringConcat(name, ' / ') = {span:String} "
        "OR name[-1] = {span:String}) GROUP BY cluster_id, span_id ORDER BY began, cluster_id, span_id",
        f.parameters)
    names = cluster_names(backend)
    return [Run(c, names.get(c, c), s, float(b), _tree_ids(backend, c, s)) for c, s, b in rows]


def cluster_runs(backend: Backend, cluster: str, since: TimeBound = None,
                 until: TimeBound = None) -> list[Run]:
    """The whole runs of every cluster named (or identified by) ``cluster``, oldest first."""
    ids = cluster_ids(backend, cluster) or []
    start, stop = epoch(since, "since"), epoch(until, "until")
    _, rows = backend.query(
        "SELECT cluster_id, cluster_name, toFloat64(first_seen) FROM "
        f"{table(backend, 'clusters')} WHERE cluster_id IN {{ids:Array(String)}} ORDER BY first_seen",
        {"ids": ids})
    return [Run(c, n, None, float(b)) for c, n, b in rows
            if (start is None or b >= start) and (stop is None or b < stop)]


# -------------------------------------------------------------------- profiles


def profile(backend: Backend, run: Run) -> Profile:
    """Per prefix and action, the run's per-task durations; and its wall time."""
    where = ["cluster_id = {c:String}", "source = 'scheduler'"]
    p: dict = {"c": run.cluster_id, "n": SAMPLE}
    if run.span_ids is not None:
        where.append("span_id IN {ids:Array(String)}")
        p["ids"] = list(run.span_ids)
    fin = "start = 'processing' AND finish IN ('memory', 'erred')"

    def spent(kinds: str) -> str:
        return f"arraySum(arrayMap((a, s, e) -> if(a IN ({kinds}), e - s, 0), acts, starts, stops))"

    compute, transfer = spent("'compute'"), spent("'transfer'")
    disk, before = spent("'disk-read', 'disk-write'"), spent("'transfer', 'disk-read'")
    _, rows = backend.query(
        "SELECT prefix, a.1 AS action, count(), sum(a.2), "
        "groupArraySample({n:UInt32}, 1)(a.2), min(first), max(last) FROM ("
        f"SELECT key, argMaxIf(prefix, ts, {fin}) AS prefix, "
        f"argMaxIf(startstops.action, ts, {fin}) AS acts, "
        f"argMaxIf(arrayMap(x -> toFloat64(x), startstops.start), ts, {fin}) AS starts, "
        f"argMaxIf(arrayMap(x -> toFloat64(x), startstops.stop), ts, {fin}) AS stops, "
        "toFloat64(maxIf(ts, finish = 'processing')) AS entered, "
        "arrayMin(arrayFilter((s, a) -> a = 'compute', starts, acts)) AS first, "
        "arrayMax(arrayFilter((e, a) -> a = 'compute', stops, acts)) AS last "
        f"FROM {table(backend, 'transitions')} WHERE {' AND '.join(where)} "
        f"GROUP BY key HAVING countIf({fin}) > 0 AND has(acts, 'compute')) "
        f"ARRAY JOIN [('compute', {compute}), ('transfer', {transfer}), ('disk', {disk}), "
        f"('waiting', greatest(0, first - entered - {before}))] AS a "
        "WHERE a.2 > 0 OR a.1 = 'compute' GROUP BY prefix, action", p)
    samples = {}
    first, last = math.inf, -math.inf
    for prefix, action, n, total, values, a, b in rows:
        samples[(prefix, action)] = Sample(int(n), float(total), np.asarray(values, dtype=float))
        first, last = min(first, a), max(last, b)
    wall = last - first if samples else None
    return Profile(wall, samples)


# ------------------------------------------------------------------- compare


def _change(key: tuple[str, str], base: Sample | None, new: Sample | None,
            history: list[Sample], k: int, floor: float) -> Change:
    prefix, action = key
    nan = math.nan
    if base is None or new is None:
        s = base or new
        verdict = "new" if base is None else "gone"
        return Change(prefix, action, verdict, base.n if base else 0, new.n if new else 0,
                      base.median if base else nan, new.median if new else nan,
                      base.total if base else 0.0, new.total if new else 0.0, nan, nan, nan,
                      nan, nan, len(history))
    medians = [h.median for h in history if h.n >= noise.MIN_TASKS] + [base.median]
    fraction = noise.band(noise.run_noise(medians))
    if min(base.n, new.n) < noise.MIN_TASKS:
        return Change(prefix, action, "too few tasks", base.n, new.n, base.median, new.median,
                      base.total, new.total, nan, nan, nan, nan, fraction, len(history))
    interval = noise.ratio_interval(base.values, new.values)
    p = noise.rank_test(base.values, new.values)
    side = noise.beyond(interval, fraction) if p < ALPHA / max(k, 1) else 0
    if abs(new.total - base.total) < floor:
        side = 0
    verdict = {1: "slower", -1: "faster", 0: "within noise"}[side]
    return Change(prefix, action, verdict, base.n, new.n, base.median, new.median, base.total,
                  new.total, *interval, p, fraction, len(history))


def compare_runs(backend: Backend, baseline: Run, candidate: Run,
                 history: Sequence[Run] = (), what: str | None = None,
                 with_path: bool = True) -> Comparison:
    """``candidate`` against ``baseline``, the noise from ``history`` (earlier runs);
    see the module docstring. :class:`NotComparable` when they share no prefix."""
    base, new = profile(backend, baseline), profile(backend, candidate)
    if not base.samples or not new.samples:
        empty = baseline if not base.samples else candidate
        raise NotComparable(f"the run {empty.label} ({empty.cluster_id}) has no finished task "
                            "with recorded actions: nothing to compare")
    base_prefixes = {p for p, _ in base.samples}
    new_prefixes = {p for p, _ in new.samples}
    if not base_prefixes & new_prefixes:
        raise NotComparable(
            f"the runs share no task prefix: {baseline.label} ran {_few(base_prefixes)}, "
            f"{candidate.label} ran {_few(new_prefixes)}; nothing to compare")
    past = [profile(backend, r) for r in history]
    keys = sorted(set(base.samples) | set(new.samples))
    testable = sum(1 for k in keys if k in base.samples and k in new.samples
                   and min(base.samples[k].n, new.samples[k].n) >= noise.MIN_TASKS)
    work = sum(s.total for (_, action), s in base.samples.items() if action in WORK)
    changes = [_change(k, base.samples.get(k), new.samples.get(k),
                       [h.samples[k] for h in past if k in h.samples], testable, MIN_SHARE * work)
               for k in keys]
    order = {"slower": 0, "faster": 1, "new": 2, "gone": 3, "within noise": 4, "too few tasks": 5}
    changes.sort(key=lambda c: (order[c.verdict], -abs(c.delta)))
    slower = [c for c in changes if c.verdict == "slower"]
    culprit = max(slower, key=lambda c: (c.action in WORK, c.delta), default=None)
    walls = [h.wall for h in past if h.wall] + ([base.wall] if base.wall else [])
    wall_band = noise.band(noise.run_noise(walls))
    notes = []
    on_path = None
    if culprit is not None and with_path:
        try:
            path = critical_path(backend, candidate.cluster_id,
                                 list(candidate.span_ids) if candidate.span_ids is not None else None,
                                 check_graph=False)
            part = _PATH_PART[culprit.action]
            mine = [link.parts[part] for link in path.links
                    if link.prefix == culprit.prefix and link.parts[part] > 0]
            on_path = (len(mine), float(sum(mine)))
        except NoActions as e:
            notes.append(f"critical path unknown: {e}")
    if not history:
        notes.append("no earlier runs: the noise band is the minimum change, "
                     f"{noise.MIN_CHANGE:.0%}; more runs of it make the verdict surer")
    name = what or (f"span {candidate.span_id and _span_name(backend, candidate)!r}"
                    if candidate.span_id else f"the run of {candidate.cluster_name!r}")
    return Comparison(name, baseline, candidate, tuple(history), base.wall, new.wall,
                      wall_band, tuple(changes), culprit, on_path, testable, tuple(notes),
                      _side_by_side([*past, base, new]))


def _side_by_side(profiles: list[Profile]) -> tuple[tuple, ...]:
    """Rows of metric and one value per run: wall, task seconds, tasks, and the
    compute seconds of the prefixes with the most of it."""
    compute: dict[str, float] = defaultdict(float)
    for prof in profiles:
        for (prefix, action), s in prof.samples.items():
            if action == "compute":
                compute[prefix] += s.total
    top = sorted(compute, key=lambda p: (-compute[p], p))[:TOP_PREFIXES]

    def work(prof: Profile) -> float:
        return sum(s.total for (_, a), s in prof.samples.items() if a in WORK)

    def value(prof: Profile, prefix: str) -> float:
        s = prof.samples.get((prefix, "compute"))
        return s.total if s else 0.0

    return (("elapsed_s", *(p.wall for p in profiles)),
            ("task_s", *(work(p) for p in profiles)),
            ("tasks", *(sum(s.n for (_, a), s in p.samples.items() if a == "compute")
                        for p in profiles)),
            *((f"compute_s {prefix}", *(value(p, prefix) for p in profiles)) for prefix in top))


def _span_name(backend: Backend, run: Run) -> str:
    _, rows = backend.query(
        f"SELECT any(name) FROM {table(backend, 'spans')} WHERE cluster_id = {{c:String}} "
        "AND span_id = {s:String}", {"c": run.cluster_id, "s": run.span_id})
    return "/".join(rows[0][0]) if rows and rows[0][0] else str(run.span_id)


def _few(names: set[str], n: int = 4) -> str:
    shown = sorted(names)[:n]
    return ", ".join(shown) + (f" and {len(names) - n} more" if len(names) > n else "")


def compare(backend: Backend, span: str | None = None, cluster: str | None = None,
            since: TimeBound = None, until: TimeBound = None) -> Comparison:
    """The latest run of ``span`` (or, without a span, of the clusters named
    ``cluster``) against the one before it, the earlier ones as history."""
    if span:
        runs = span_runs(backend, span, cluster, since, until)
        what = f"span {span!r}"
    elif cluster:
        runs = cluster_runs(backend, cluster, since, until)
        what = f"the run of {cluster!r}"
    else:
        raise NotComparable("nothing named: give a span name, or a cluster name to compare "
                            "its whole runs")
    if len(runs) < 2:
        where = f" in cluster {cluster!r}" if (span and cluster) else ""
        raise NotComparable(f"{what}{where} was recorded {len(runs)} time(s): at least two "
                            "runs are needed to compare")
    return compare_runs(backend, runs[-2], runs[-1], runs[:-2][-HISTORY:], what)
