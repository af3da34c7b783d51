"""Did a run get slower, beyond the run-to-run noise, and which prefix and action did it?

The runs compared are the instances of one span name across runs and clusters (a
span's '/'-joined name, or its last tag: :func:`span_runs`), or the whole runs of the
clusters sharing a name (:func:`cluster_runs`), in time order. By default the latest
(*candidate*) is compared with the one before it (*baseline*); the runs before the
baseline are the *history*.

For every task prefix and action (``compute``, ``transfer``, ``disk``, and
``waiting``: on the worker before compute, neither transferring nor reading from
disk -- a thread was busy) the per-task durations of baseline and candidate are
compared (:mod:`.noise`): the Mann-Whitney U rank test (two-sided; Holm's step-down
correction over the comparisons made, at :data:`ALPHA` family-wise) and the
Hodges-Lehmann ratio (the median ratio of a candidate task to a baseline task) with
its 95% confidence interval. The noise band of a prefix and action is three
run-to-run standard deviations of its median over the history and the baseline (at
least :data:`~.noise.MIN_CHANGE`; with no history, just that). A change is *slower*
(*faster*) when the test rejects, the whole interval lies above (below) the band, and
it moves the run's task seconds by :data:`MIN_SHARE` at least. Otherwise it is
*within noise* only when its interval, widened by the run-to-run noise of the pair,
rules out a change of :data:`RESOLVE` (or of the band, if wider) both ways, or when
a change that large would not move the run's task seconds by :data:`MIN_SHARE`; an
interval too wide for that (few tasks, noisy ones) is *inconclusive*: the data cannot
tell. At most :data:`SAMPLE` tasks a side are
compared (ClickHouse samples them); totals are exact.

The *culprit* is the slower prefix and action whose total seconds grew most, a work
action (compute, transfer, disk) before waiting (which follows from work elsewhere),
with the share of the change in task seconds it explains and whether it sits on the
candidate's critical path (:mod:`.critical_path`): a link of that prefix that spent
time in that action. The wall time (elapsed, first compute to last) is compared with
its own history the same way (one value a run: the band alone decides), and the
headline follows it when no prefix and action changed: a run whose wall time left its
band is not "no change".

A baseline that failed (tasks erred in it) is not compared with: :func:`compare`
takes the latest earlier run without erred tasks, and says which runs it passed
over; when every earlier run erred, the comparison says so in its notes.

Runs that cannot be compared raise :class:`NotComparable` with a one-line reason:
fewer than two runs, or runs that share no prefix.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from dask_blackbox.read import noise, queries
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.comparison import (_PATH_PART, ACTIONS, ALPHA, HISTORY, MIN_SHARE, RESOLVE,
                                           SAMPLE, TOP_PREFIXES, WORK, Change, Comparison,
                                           NotComparable, Profile, Run, Sample)
from dask_blackbox.read.critical_path import NoActions, critical_path
from dask_blackbox.read.filters import TimeBound, build, cluster_ids, cluster_names, epoch, table

#: What a comparison is made of, named here too (:mod:`.comparison`).
__all__ = ["ACTIONS", "ALPHA", "HISTORY", "MIN_SHARE", "RESOLVE", "SAMPLE", "TOP_PREFIXES", "WORK",
           "Change", "Comparison", "NotComparable", "Profile", "Run", "Sample", "span_runs",
           "cluster_runs", "profile", "holm", "compare_profiles", "compare_runs", "compare",
           "erred_tasks"]


# ----------------------------------------------------------------------- runs


#: What :func:`_tree_ids` reads (from ``{spans}``).
TREE_IDS = "SELECT DISTINCT span_id, parent_id FROM {spans} WHERE cluster_id = {{c:String}}"


def _tree_ids(backend: Backend, cluster_id: str, root: str) -> tuple[str, ...]:
    _, edges = backend.query(TREE_IDS.format(spans=table(backend, 'spans')), {"c": cluster_id})
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


#: What :func:`span_runs` reads (from ``{spans}``; ``{where}``, ``{and_}`` filled in where
#: it is run).
SPAN_RUNS = ("SELECT cluster_id, span_id, toFloat64(min(enqueued)) AS began FROM {spans} "
             "{where} {and_} (arrayStringConcat(name, '/') = {{span:String}} OR "
             "arrayStringConcat(name, ' / ') = {{span:String}} OR name[-1] = {{span:String}}) "
             "GROUP BY cluster_id, span_id ORDER BY began, cluster_id, span_id")


def span_runs(backend: Backend, span: str, cluster: str | None = None,
              since: TimeBound = None, until: TimeBound = None) -> list[Run]:
    """Every instance of the span named ``span`` ('/'-joined name, or its last tag),
    oldest first."""
    f = build(backend, cluster, since, until, "enqueued")
    f.parameters["span"] = span
    _, rows = backend.query(
        SPAN_RUNS.format(spans=table(backend, 'spans'), where=f.where(), and_=f.and_()),
        f.parameters)
    names = cluster_names(backend)
    return [Run(c, names.get(c, c), s, float(b), _tree_ids(backend, c, s)) for c, s, b in rows]


#: What :func:`cluster_runs` reads (from ``{clusters}``).
CLUSTER_RUNS = ("SELECT cluster_id, cluster_name, toFloat64(first_seen) FROM {clusters} WHERE "
                "cluster_id IN {{ids:Array(String)}} ORDER BY first_seen")


def cluster_runs(backend: Backend, cluster: str, since: TimeBound = None,
                 until: TimeBound = None) -> list[Run]:
    """The whole runs of every cluster named (or identified by) ``cluster``, oldest first."""
    ids = cluster_ids(backend, cluster) or []
    start, stop = epoch(since, "since"), epoch(until, "until")
    _, rows = backend.query(
        CLUSTER_RUNS.format(clusters=table(backend, 'clusters')),
        {"ids": ids})
    return [Run(c, n, None, float(b)) for c, n, b in rows
            if (start is None or b >= start) and (stop is None or b < stop)]


# -------------------------------------------------------------------- profiles


#: What :func:`profile` reads (from ``{transitions}``; ``{fin}``, ``{where}``,
#: ``{compute}``, ``{transfer}``, ``{disk}``, ``{before}`` filled in where it is run).
PROFILE = ("SELECT prefix, a.1 AS action, count(), sum(a.2), groupArraySample({{n:UInt32}}, "
           "1)(a.2), min(first), max(last) FROM (SELECT key, argMaxIf(prefix, ts, {fin}) AS "
           "prefix, argMaxIf(startstops.action, ts, {fin}) AS acts, argMaxIf(arrayMap(x -> "
           "toFloat64(x), startstops.start), ts, {fin}) AS starts, argMaxIf(arrayMap(x -> "
           "toFloat64(x), startstops.stop), ts, {fin}) AS stops, toFloat64(maxIf(ts, finish = "
           "'processing')) AS entered, arrayMin(arrayFilter((s, a) -> a = 'compute', starts, "
           "acts)) AS first, arrayMax(arrayFilter((e, a) -> a = 'compute', stops, acts)) AS "
           "last FROM {transitions} WHERE {where} GROUP BY key HAVING countIf({fin}) "
           "> 0 AND has(acts, 'compute')) ARRAY JOIN [('compute', {compute}), ('transfer', "
           "{transfer}), ('disk', {disk}), ('waiting', greatest(0, first - entered - "
           "{before}))] AS a WHERE a.2 > 0 OR a.1 = 'compute' GROUP BY prefix, action")


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
        PROFILE.format(fin=fin, transitions=table(backend, 'transitions'), where=' AND '.join(where), compute=compute, transfer=transfer, disk=disk, before=before), p)
    samples = {}
    first, last = math.inf, -math.inf
    for prefix, action, n, total, values, a, b in rows:
        samples[(prefix, action)] = Sample(int(n), float(total), np.asarray(values, dtype=float))
        first, last = min(first, a), max(last, b)
    wall = last - first if samples else None
    return Profile(wall, samples)


# ------------------------------------------------------------------- compare


def _change(key: tuple[str, str], base: Sample | None, new: Sample | None,
            history: list[Sample], rejected: bool, floor: float) -> Change:
    """One prefix and action's verdict; ``rejected``: whether its rank test rejected
    after the correction for every comparison made (:func:`holm`)."""
    prefix, action = key
    nan = math.nan
    if base is None or new is None:
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
    side = noise.beyond(interval, fraction) if rejected else 0
    negligible = abs(new.total - base.total) < floor
    if negligible:
        side = 0
    verdict = {1: "slower", -1: "faster", 0: "within noise"}[side]
    # no change is claimed where the data cannot rule out one that would matter
    matters = max(RESOLVE, fraction) * base.total >= floor
    if side == 0 and matters and not _resolved(interval, fraction):
        verdict = "inconclusive"
    return Change(prefix, action, verdict, base.n, new.n, base.median, new.median, base.total,
                  new.total, *interval, p, fraction, len(history))


def _resolved(interval: noise.Interval, band: float) -> bool:
    """Whether the interval rules out a change of :data:`RESOLVE` (or of the band, if
    wider) both ways. The interval sees only the tasks of the two runs; the pair of
    runs also moves by the run-to-run noise the band stands for (its standard
    deviation, ``log(1 + band) / NOISE_SIGMAS`` a run), so the interval is widened by
    that pair's 95 % margin first (added to the interval's own: conservative, so that
    a planted change is not called "within noise" when run noise hid part of it)."""
    if math.isnan(interval.low) or interval.low <= 0:
        return False
    size = math.log1p(max(RESOLVE, band))
    pair = 1.96 * math.sqrt(2.0) * math.log1p(band) / noise.NOISE_SIGMAS
    return math.log(interval.high) + pair <= size and math.log(interval.low) - pair >= -size


def holm(p_values: dict, alpha: float = ALPHA) -> set:
    """The keys whose test rejects under Holm's step-down correction: the i-th
    smallest of m p-values is compared with alpha / (m - i), stopping at the first
    that is not below it (family-wise error at most ``alpha``, uniformly more
    powerful than Bonferroni's alpha / m)."""
    ordered = sorted(p_values.items(), key=lambda kv: kv[1])
    m = len(ordered)
    out = set()
    for i, (key, p) in enumerate(ordered):
        if p > alpha / (m - i):
            break
        out.add(key)
    return out


def compare_profiles(base: Profile, new: Profile, past: Sequence[Profile] = (),
                     correction: str = "holm") -> tuple[list[Change], Change | None, int, float]:
    """The statistics of a comparison, without reading anything: the changes (the
    verdicts first), the culprit, the number of rank tests made, the wall time's
    band. ``correction``: "holm", or "bonferroni" (alpha / m for every test)."""
    keys = sorted(set(base.samples) | set(new.samples))
    tests = {k: noise.rank_test(base.samples[k].values, new.samples[k].values) for k in keys
             if k in base.samples and k in new.samples
             and min(base.samples[k].n, new.samples[k].n) >= noise.MIN_TASKS}
    if correction == "holm":
        rejected = holm(tests)
    else:
        rejected = {k for k, p in tests.items() if p < ALPHA / max(len(tests), 1)}
    work = sum(s.total for (_, action), s in base.samples.items() if action in WORK)
    changes = [_change(k, base.samples.get(k), new.samples.get(k),
                       [h.samples[k] for h in past if k in h.samples], k in rejected,
                       MIN_SHARE * work)
               for k in keys]
    order = {"slower": 0, "faster": 1, "inconclusive": 2, "new": 3, "gone": 4, "within noise": 5,
             "too few tasks": 6}
    changes.sort(key=lambda c: (order[c.verdict], -abs(c.delta)))
    slower = [c for c in changes if c.verdict == "slower"]
    culprit = max(slower, key=lambda c: (c.action in WORK, c.delta), default=None)
    walls = [h.wall for h in past if h.wall] + ([base.wall] if base.wall else [])
    return changes, culprit, len(tests), noise.band(noise.run_noise(walls))


def compare_runs(backend: Backend, baseline: Run, candidate: Run,
                 history: Sequence[Run] = (), what: str | None = None,
                 with_path: bool = True, notes: Sequence[str] = ()) -> Comparison:
    """``candidate`` against ``baseline``, the noise from ``history`` (earlier runs);
    see the module docstring. :class:`NotComparable` when they share no prefix.
    ``notes``: said first among the comparison's notes."""
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
    changes, culprit, testable, wall_band = compare_profiles(base, new, past)
    notes = list(notes)
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
                      _side_by_side(backend, [*history, baseline, candidate], [*past, base, new]))


def _tasks(backend: Backend, run: Run, prof: Profile) -> int:
    """Dask's count of a run's tasks (the header's and the Spans view's,
    :func:`~dask_blackbox.read.queries.dask_tasks`), else its computed tasks."""
    n = queries.dask_tasks(backend, run.cluster_id,
                           list(run.span_ids) if run.span_ids is not None else None)
    return n if n is not None else sum(s.n for (_, a), s in prof.samples.items() if a == "compute")


def _side_by_side(backend: Backend, runs: list[Run],
                  profiles: list[Profile]) -> tuple[tuple, ...]:
    """Rows of metric and one value per run (``runs`` and their ``profiles``, in the
    same order): wall, task seconds, tasks (Dask's count, :func:`_tasks`), and the
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
            ("tasks", *(_tasks(backend, r, p) for r, p in zip(runs, profiles))),
            *((f"compute_s {prefix}", *(value(p, prefix) for p in profiles)) for prefix in top))


def _span_name(backend: Backend, run: Run) -> str:
    return queries.span_name(backend, run.cluster_id, str(run.span_id)) or str(run.span_id)


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
    candidate, earlier = runs[-1], runs[:-1][-(HISTORY + 1):]
    failed = erred_tasks(backend, [*earlier, candidate])
    notes = []
    good = [r for r in earlier if not failed.get(r)]
    if good:
        baseline = good[-1]
        passed = [r for r in earlier if r.began > baseline.began]
        if passed:
            notes.append("baseline " + baseline.label + ", the latest earlier run without erred "
                         "tasks; passed over: " + ", ".join(
                             f"{r.label} ({failed[r]} erred task(s))" for r in passed))
        history = [r for r in good if r.began < baseline.began]
    else:
        baseline, history = earlier[-1], earlier[:-1]
        notes.append(f"every earlier run had erred tasks: the baseline {baseline.label} failed "
                     f"({failed[baseline]} erred task(s)); its times are those of a failed run")
    if failed.get(candidate):
        notes.append(f"the candidate {candidate.label} had {failed[candidate]} erred task(s)")
    return compare_runs(backend, baseline, candidate, history[-HISTORY:], what, notes=notes)


#: What :func:`erred_tasks` reads (from ``{transitions}``).
ERRED_TASKS = ("SELECT cluster_id, span_id, uniqExact(key) FROM {transitions} WHERE "
               "cluster_id IN {{ids:Array(String)}} AND source = 'scheduler' AND finish = "
               "'erred' GROUP BY cluster_id, span_id")


def erred_tasks(backend: Backend, runs: Sequence[Run]) -> dict[Run, int]:
    """run -> how many of its tasks ended erred (their own error or a dependency's);
    runs without any are left out. One query."""
    if not runs:
        return {}
    ids = sorted({r.cluster_id for r in runs})
    _, rows = backend.query(
        ERRED_TASKS.format(transitions=table(backend, 'transitions')), {"ids": ids})
    by = defaultdict(int)
    for c, span_id, n in rows:
        by[(c, span_id)] += int(n)
    out = {}
    for r in runs:
        n = (sum(v for (c, _), v in by.items() if c == r.cluster_id) if r.span_ids is None
             else sum(by.get((r.cluster_id, s), 0) for s in r.span_ids))
        if n:
            out[r] = n
    return out
