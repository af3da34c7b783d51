"""The data behind each panel of the web UI, the JSON API and the HTML report,
reduced in ClickHouse to what a screen can show.

Every panel function takes a :class:`~dask_blackbox.read.backends.Backend` and a
:class:`Scope` (from :func:`resolve`: one recorded cluster, optionally narrowed to a
span and its sub-spans and/or a time window) and returns a JSON-able dict. Times are
float seconds since the epoch (UTC). Nothing here draws: :mod:`.report` and
:mod:`.web` turn these dicts into Bokeh documents and pages.

Reduction, so that a run of millions of tasks opens as fast as a run of ten:

- :func:`task_stream` returns one bar per recorded ``startstops`` action (compute,
  transfer, disk-read/write...), laid out one row per worker thread like Dask's task
  stream, when the scope holds at most ``max_bars`` of them; otherwise it returns
  ``mode="binned"``: per worker and time bucket (``buckets`` across the window) the
  busy fraction of the worker's threads and the prefix that kept them busiest,
  computed by ClickHouse. Narrow the window (``since``/``until``) or pick a span to
  see single tasks again.
- The time series (:func:`progress`, :func:`task_states`, :func:`memory`) are
  aggregated into at most ``buckets`` points per series by ClickHouse.
- :func:`logs` returns the newest ``limit`` matching lines and the total count.

Which cluster: ``cluster`` is a name or an id. Several runs may share a name; the
latest (by last envelope) is taken and the others are listed in ``Scope.others``.
Unknown clusters, spans and keys raise :class:`NotFound` (a LookupError) whose
message names what was not found.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections import defaultdict
from typing import Any

from dask_blackbox.read import cost as costs
from dask_blackbox.read import critical_path as paths
from dask_blackbox.read import aggregates, diagnosis, queries, regressions
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import Filter, cluster_ids_sql
from dask_blackbox.read.filters import epoch as _epoch
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.queries import TimeBound, UnknownCluster

#: At most this many task-stream bars are shipped to a page; above, the stream is binned.
MAX_BARS = 20_000
#: Time buckets across the window for binned/aggregated panels.
BUCKETS = 300
#: Prefixes shown by name in the progress panel (the rest are summed as "other").
TOP_PREFIXES = 12
#: Workers drawn one by one in the memory panel (dead workers first, then by peak).
MEMORY_WORKERS = 32
#: The task states drawn in "tasks by state". Not "released": a task is created
#: released without a transition, so its count is not known from transitions alone;
#: forgotten tasks are gone.
STATES = ("waiting", "no-worker", "queued", "processing", "memory", "erred")
#: The Run page computes the critical path and the cost of a scope of at most this
#: many tasks by itself (a few seconds beyond); a bigger one offers a link that does.
SLOWNESS_MAX_TASKS = 20_000
#: Log levels, lowest first: a level filter keeps that level and above.
LEVELS = queries.LEVELS


class NotFound(LookupError):
    """A cluster, span or key that was never recorded; the message names it."""


class UnknownSpan(NotFound):
    pass


class UnknownKey(NotFound):
    pass


@dataclasses.dataclass
class Scope:
    """One recorded cluster, narrowed to a span (and its sub-spans) and/or a window."""

    cluster_id: str
    cluster_name: str
    #: the window drawn: the run (or span) clipped to since/until, seconds since the epoch
    t0: float
    t1: float
    span: str | None = None
    #: ids of the spans matching ``span`` and their descendants (None: every task)
    span_ids: list[str] | None = None
    since: float | None = None
    until: float | None = None
    #: other runs with the same name: (cluster_id, first_seen, last_seen)
    others: list[tuple] = dataclasses.field(default_factory=list)
    #: the scheduler's transitions in the run or span (None: not counted, a window)
    n_transitions: int | None = None

    @property
    def bucket(self) -> float:
        return max((self.t1 - self.t0) / BUCKETS, 1e-3)

    def as_dict(self) -> dict:
        return {"cluster_id": self.cluster_id, "cluster_name": self.cluster_name,
                "t0": self.t0, "t1": self.t1, "span": self.span, "since": self.since,
                "until": self.until, "span_ids": self.span_ids,
                "n_transitions": self.n_transitions,
                "other_runs": [{"cluster_id": c, "first_seen": f, "last_seen": l}
                               for c, f, l in self.others]}


# --------------------------------------------------------------------- scope


def _cluster(backend: Backend, cluster: str) -> tuple[str, str, list[tuple]]:
    # the runs of filters.cluster_ids, in the same statement
    _, rows = backend.query(
        f"SELECT cluster_id, cluster_name, toFloat64(first_seen), toFloat64(last_seen) "
        f"FROM {_t(backend, 'clusters')} WHERE cluster_id IN ({cluster_ids_sql(backend)}) "
        "ORDER BY last_seen DESC", {"c": cluster})
    if not rows:
        raise NotFound(f"no recorded cluster is named {cluster!r} or has that id")
    chosen = rows[0]
    return chosen[0], chosen[1], [(c, f, l) for c, _, f, l in rows[1:]]


def _span_ids(backend: Backend, cluster_id: str, span: str) -> list[str]:
    """The spans of ``cluster_id`` named ``span`` (a tag of the name, or the whole
    '/'-joined name) and all their descendants."""
    _, edges = backend.query(
        f"SELECT span_id, any(parent_id), any(name) FROM (SELECT span_id, parent_id, name "
        f"FROM {_t(backend, 'span_state')} WHERE cluster_id = {{c:String}} UNION ALL "
        f"SELECT span_id, parent_id, name FROM {_t(backend, 'spans')} WHERE cluster_id = {{c:String}}) "
        "GROUP BY span_id", {"c": cluster_id})
    matched = [s for s, _, name in edges
               if span in name or "/".join(name) == span or " / ".join(name) == span]
    if not matched:
        raise UnknownSpan(f"no span named {span!r} in cluster {cluster_id}")
    children = defaultdict(list)
    for span_id, parent, _ in edges:
        if parent:
            children[parent].append(span_id)
    found, todo = set(), list(matched)
    while todo:
        s = todo.pop()
        if s not in found:
            found.add(s)
            todo.extend(children[s])
    return sorted(found)


def resolve(backend: Backend, cluster: str, span: str | None = None, since: TimeBound = None,
            until: TimeBound = None) -> Scope:
    """The scope of a Run page: NotFound for an unknown cluster or span."""
    if not cluster:
        raise NotFound("no cluster given: pass a cluster name or id")
    cluster_id, name, others = _cluster(backend, cluster)
    start, stop = _epoch(since, "since"), _epoch(until, "until")
    span_ids = _span_ids(backend, cluster_id, span) if span else None
    p = {"c": cluster_id}
    first, last, n_transitions = aggregates.bounds(backend, cluster_id, span_ids)
    if span_ids is None:
        _, rows = backend.query(
            "SELECT min(a), max(b) FROM ("
            f"SELECT min(toFloat64(ts)) AS a, max(toFloat64(ts)) AS b FROM {_t(backend, 'lifecycle')} "
            "WHERE cluster_id = {c:String} UNION ALL "
            f"SELECT min(toFloat64(sent_at)), max(toFloat64(sent_at)) FROM {_t(backend, 'envelopes')} "
            "WHERE cluster_id = {c:String}) WHERE a > 0", p)
    else:
        p["ids"] = span_ids
        _, rows = backend.query(
            f"SELECT min(toFloat64(enqueued)), max(toFloat64(stop)) FROM {_t(backend, 'span_state')} "
            "WHERE cluster_id = {c:String} AND span_id IN {ids:Array(String)} AND enqueued > 0", p)
    if first is not None:
        a, b = rows[0] if rows and rows[0][0] is not None else (first, last)
        rows = [(min(first, a or first), max(last, b or last))]
    t0, t1 = rows[0] if rows and rows[0][0] is not None else (0.0, 0.0)
    t0, t1 = float(t0 or 0.0), float(t1 or 0.0)
    if start is not None:
        t0 = start if t0 == 0 else max(t0, start) if span_ids else start
    if stop is not None:
        t1 = stop if t1 == 0 else min(t1, stop) if span_ids else stop
    if t1 <= t0:
        t1 = t0 + 1.0
    return Scope(cluster_id, name, t0, t1, span, span_ids, start, stop, others,
                 n_transitions if start is None and stop is None else None)


def _where(scope: Scope, time_column: str = "ts", span: bool = True) -> tuple[str, dict]:
    """WHERE clause (cluster, window, span) and its parameters."""
    conditions = ["cluster_id = {c:String}"]
    p: dict[str, Any] = {"c": scope.cluster_id}
    if time_column:
        conditions.append(f"{time_column} >= toDateTime64({{t0:Float64}}, 6, 'UTC')")
        conditions.append(f"{time_column} <= toDateTime64({{t1:Float64}}, 6, 'UTC')")
        p.update(t0=scope.t0, t1=scope.t1)
    if span and scope.span_ids is not None:
        conditions.append("span_id IN {ids:Array(String)}")
        p["ids"] = scope.span_ids
    return "WHERE " + " AND ".join(conditions), p


# ---------------------------------------------------------------------- panels


def summary(backend: Backend, scope: Scope, progress_data: dict | None = None) -> dict:
    """Counts for the page header: tasks (distinct keys), transitions into memory and
    into erred (from :func:`progress`'s per-prefix totals, computed once)."""
    totals = progress_data["counts"] if progress_data else prefix_totals(backend, scope)
    return {**scope.as_dict(), "tasks": sum(c["tasks"] for c in totals.values()),
            "finished_in_memory": sum(c["memory"] for c in totals.values()),
            "erred": sum(c["erred"] for c in totals.values())}


def nthreads(backend: Backend, scope: Scope, known: dict | None = None) -> dict[str, int]:
    from dask_blackbox.read import workers

    return workers.nthreads(backend, scope.cluster_id, known)


def task_stream(backend: Backend, scope: Scope, max_bars: int = MAX_BARS,
                finished: int | None = None, worker: str | None = None,
                known: dict | None = None) -> dict:
    """Dask's task stream: ``mode="bars"`` with one bar per recorded startstop
    (``bars``: worker, row, key, prefix, action, start, stop, erred) and ``rows``
    (one per worker thread, "worker thread N"), or ``mode="binned"`` (see the module
    docstring) with ``cells``: worker, row, start, stop, busy fraction, prefix, tasks.
    ``worker``: that worker's rows only; ``known``: the run's :func:`workers.info`, if
    already known.

    Rows: one per worker thread that ran a task (the ``thread`` Dask passed with
    processing->memory/erred, what its own task stream draws a row for), a worker's
    threads in the order they first ran something, workers by when their first task
    started; ``row_workers`` names each row's worker. Tasks recorded without a
    thread (older recordings) are packed onto the fewest rows of their worker where
    their compute intervals do not overlap.

    ``finished``: the transitions into memory or erred in the scope, if known (each
    carries at least one bar); above ``max_bars`` the stream is binned without
    counting its bars first. A whole run or span is counted and binned from the page
    aggregates (:mod:`.aggregates`) when it holds more than ``max_bars`` bars.
    """
    where, p = _where(scope, time_column="", span=True)
    p.update(t0=scope.t0, t1=scope.t1)
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    base = (f"FROM {_t(backend, 'transitions')} ARRAY JOIN startstops AS ss {where} "
            "AND source = 'scheduler' AND ss.stop >= toDateTime64({t0:Float64}, 6, 'UTC') "
            "AND ss.start <= toDateTime64({t1:Float64}, 6, 'UTC')")
    out: dict[str, Any] = {"max_bars": max_bars}
    n_bars = None
    use_aggregates = worker is None and scope.since is None and scope.until is None
    if use_aggregates:
        n_bars, n_compute = aggregates.bars(backend, scope)
        out.update(bars_recorded=n_bars, computes_recorded=n_compute)
    elif finished is None or finished <= max_bars:
        _, counted = backend.query(f"SELECT count(), countIf(ss.action = 'compute') {base}", p)
        n_bars, n_compute = counted[0]
        out.update(bars_recorded=n_bars, computes_recorded=n_compute)
    if n_bars is not None and n_bars <= max_bars:
        _, rows = backend.query(
            "SELECT worker, key, prefix, ss.action, toFloat64(ss.start), toFloat64(ss.stop), "
            f"ss.source, finish = 'erred', toFloat64(ts), thread {base} ORDER BY worker, ts, key", p)
        out.update(mode="bars", **_lay_out(rows))
        return out
    n = _n_buckets(scope)
    if use_aggregates:
        cells = aggregates.stream_cells(backend, scope, n)
    else:
        # Binned: per worker and bucket, busy seconds per prefix (or action), then the
        # dominant one and the total, all in ClickHouse.
        p.update(w=scope.bucket, n=BUCKETS)
        _, cells = backend.query(
            "SELECT worker, b, sum(busy) AS total, argMax(what, busy), sum(computes), sum(bars) FROM ("
            " SELECT worker, what, b, sum(least(e, {t0:Float64} + (b + 1) * {w:Float64}) "
            "   - greatest(s, {t0:Float64} + b * {w:Float64})) AS busy, "
            "   countIf(is_compute AND b = first_b) AS computes, countIf(b = first_b) AS bars FROM ("
            "  SELECT worker, if(ss.action = 'compute', prefix, ss.action) AS what, "
            "   ss.action = 'compute' AS is_compute, "
            "   greatest(toFloat64(ss.start), {t0:Float64}) AS s, least(toFloat64(ss.stop), {t1:Float64}) AS e, "
            "   toUInt32(least(floor((s - {t0:Float64}) / {w:Float64}), {n:Float64} - 1)) AS first_b, "
            "   toUInt32(least(floor((e - {t0:Float64}) / {w:Float64}), {n:Float64} - 1)) AS last_b "
            f"  {base}) ARRAY JOIN range(first_b, last_b + 1) AS b "
            " GROUP BY worker, what, b) GROUP BY worker, b ORDER BY worker, b", p)
    threads = nthreads(backend, scope, known)
    first_cell: dict[str, int] = {}
    peak: dict[str, float] = defaultdict(float)
    for w, b, busy, _, _, _ in cells:
        peak[w] = max(peak[w], busy / scope.bucket)
        first_cell[w] = min(first_cell.get(w, b), b)
    workers = sorted(first_cell, key=lambda w: (first_cell[w], w))  # by first seen
    index = {w: i for i, w in enumerate(workers)}
    out.setdefault("bars_recorded", sum(c[5] for c in cells))
    out.setdefault("computes_recorded", sum(c[4] for c in cells))
    out.update(mode="binned", bucket=scope.bucket, rows=workers, row_workers=workers, cells=[
        {"worker": w, "row": index[w], "start": scope.t0 + b * scope.bucket,
         "stop": scope.t0 + (b + 1) * scope.bucket,
         "busy": min(1.0, busy / scope.bucket / max(threads.get(w) or peak[w], 1e-9)),
         "prefix": what, "tasks": computes}
        for w, b, busy, what, computes, _ in cells
    ])
    return out


def _lay_out(rows: list[tuple]) -> dict:
    """Assign each task to a thread row of its worker (see :func:`task_stream`)."""
    per_task: dict[tuple, list] = {}
    for worker, key, prefix, action, start, stop, source, erred, ts, thread in rows:
        per_task.setdefault((worker, key, ts, thread), []).append(
            (action, start, stop, source, prefix, erred))
    by_worker: dict[str, list] = defaultdict(list)
    for (worker, key, ts, thread), actions in per_task.items():
        compute = [a for a in actions if a[0] == "compute"] or actions
        start = min(a[1] for a in compute)
        stop = max(a[2] for a in compute)
        by_worker[worker].append((start, stop, key, thread, actions))
    row_names, row_workers, bars = [], [], []
    for worker in sorted(by_worker, key=lambda w: (min(t[0] for t in by_worker[w]), w)):
        tasks = sorted(by_worker[worker], key=lambda t: (t[0], t[1]))
        first = len(row_names)
        threads: dict[int, int] = {}  # thread -> its row, in order of first task
        for _, _, _, thread, _ in tasks:
            if thread is not None and thread not in threads:
                threads[thread] = len(threads)
        lanes_end: list[float] = []  # rows of tasks without a thread, after the threads'
        for start, stop, key, thread, actions in tasks:
            if thread is not None:
                row = threads[thread]
            else:
                lane = _free_lane(lanes_end, start)
                if lane is None:
                    lane = len(lanes_end)
                    lanes_end.append(stop)
                else:
                    lanes_end[lane] = stop
                row = len(threads) + lane
            for action, a_start, a_stop, source, prefix, erred in actions:
                bars.append({"worker": worker, "row": first + row, "key": key, "prefix": prefix,
                             "action": action, "start": a_start, "stop": a_stop,
                             "source": source or "", "erred": bool(erred), "thread": thread})
        row_names += [f"{worker} thread {i + 1}" for i in range(len(threads))]
        row_names += [f"{worker} #{i}" for i in range(len(lanes_end))]
        row_workers += [worker] * (len(threads) + len(lanes_end))
    return {"rows": row_names, "row_workers": row_workers, "bars": bars}


def _free_lane(lanes_end: list[float], start: float) -> int | None:
    """The lowest lane whose last task ended by ``start``."""
    for i, end in enumerate(lanes_end):
        if end <= start:
            return i
    return None


def _top(totals: dict[str, float], n: int) -> list[str]:
    return sorted(totals, key=lambda k: (-totals[k], k))[:n]


def _n_buckets(scope: Scope) -> int:
    return min(BUCKETS, int((scope.t1 - scope.t0) / scope.bucket) + 1)


def prefix_totals(backend: Backend, scope: Scope) -> dict[str, dict]:
    """Per prefix (``"(none)"`` for none) in the scope: ``tasks`` (distinct keys),
    ``memory`` and ``erred`` (transitions into memory, into erred): :func:`progress`'s
    ``counts``, and what the page's heading adds up. From the page aggregates
    (:mod:`.aggregates`) for a whole run or span."""
    if aggregates.usable(scope):
        return aggregates.prefix_counts(backend, scope)
    where, p = _where(scope)
    _, totals_rows = backend.query(
        # distinct keys by their 64-bit hash: exact but for collisions (~1e-8 at a
        # million keys), and several times cheaper than comparing the strings
        "SELECT prefix, uniqExact(cityHash64(key)), countIf(finish = 'memory'), "
        f"countIf(finish = 'erred') FROM {_t(backend, 'transitions')} {where} "
        "AND source = 'scheduler' GROUP BY prefix", p)
    return {prefix or "(none)": {"tasks": t, "memory": m, "erred": e}
            for prefix, t, m, e in totals_rows}


def progress(backend: Backend, scope: Scope, per_prefix: dict[str, dict] | None = None) -> dict:
    """Per prefix, over time: the fraction of its tasks finished (in memory or
    erred), like Dask's progress bars. ``times`` are bucket ends; ``series`` maps
    prefix -> fractions; ``totals`` the prefix's distinct keys: the
    :data:`TOP_PREFIXES` with the most tasks by name, and every prefix with an erred
    task by name too (however few its tasks), the rest summed as "other";
    ``counts`` per prefix: tasks, transitions into memory, into erred; ``erred`` per
    series shown: its transitions into erred. ``per_prefix``: the scope's
    :func:`prefix_totals`, if already known.

    From the page aggregates (:mod:`.aggregates`) for a whole run or span."""
    n = _n_buckets(scope)
    per_prefix = prefix_totals(backend, scope) if per_prefix is None else per_prefix
    if aggregates.usable(scope):
        rows = aggregates.finished_per_bucket(backend, scope, n)
    else:
        where, p = _where(scope)
        p.update(w=scope.bucket, t0=scope.t0)
        _, rows = backend.query(
            "SELECT prefix, toUInt32(floor((toFloat64(ts) - {t0:Float64}) / {w:Float64})) AS b, count() "
            f"FROM {_t(backend, 'transitions')} {where} AND source = 'scheduler' "
            "AND finish IN ('memory', 'erred') GROUP BY prefix, b ORDER BY b", p)
    return progress_series(per_prefix, rows, n,
                           [scope.t0 + (i + 1) * scope.bucket for i in range(n)])


def progress_series(per_prefix: dict[str, dict], rows, n: int, times: list[float]) -> dict:
    """The progress panel (:func:`progress`) from ``per_prefix`` (prefix -> tasks,
    memory, erred) and ``rows`` of (prefix, bucket number, tasks finished in it), in
    ``n`` buckets ending at ``times``."""
    totals = {prefix: c["tasks"] for prefix, c in per_prefix.items()}
    shown = set(_top(totals, TOP_PREFIXES)) | {pr for pr, c in per_prefix.items() if c["erred"]}
    label = {prefix: prefix if prefix in shown else "other" for prefix in totals}
    counts: dict[str, list[float]] = {}
    for prefix, b, c in rows:
        name = label.get(prefix or "(none)", "other")
        counts.setdefault(name, [0.0] * n)[min(int(b), n - 1)] += c
    grouped_totals: dict[str, int] = defaultdict(int)
    grouped_erred: dict[str, int] = defaultdict(int)
    for prefix, total in totals.items():
        grouped_totals[label[prefix]] += total
        grouped_erred[label[prefix]] += per_prefix[prefix]["erred"]
    series = {}
    for name, per_bucket in counts.items():
        done, out = 0.0, []
        for c in per_bucket:
            done += c
            out.append(min(1.0, done / max(grouped_totals[name], 1)))
        series[name] = out
    # erred prefixes first, then by size: never lost below the fold of a long legend
    order = sorted(series, key=lambda k: (k == "other", 0 if grouped_erred[k] else 1,
                                          -grouped_totals[k], k))
    return {"times": times, "series": {k: series[k] for k in order},
            "totals": dict(grouped_totals), "erred": {k: grouped_erred[k] for k in order},
            "counts": per_prefix}


def task_states(backend: Backend, scope: Scope) -> dict:
    """Tasks in each state over time, from the transitions themselves (each one
    moves a task from ``start`` to ``finish``): exact, and available without
    scheduler metrics. A window starting mid-run starts from the states at its start."""
    n = _n_buckets(scope)
    if aggregates.usable(scope):
        rows = aggregates.moves_per_bucket(backend, scope, n)
    else:
        where, p = _where(scope, time_column="")
        p.update(w=scope.bucket, t0=scope.t0, t1=scope.t1)
        _, rows = backend.query(
            "SELECT start, finish, if(toFloat64(ts) < {t0:Float64}, -1, "
            "toInt64(floor((toFloat64(ts) - {t0:Float64}) / {w:Float64}))) AS b, count() "
            f"FROM {_t(backend, 'transitions')} {where} AND source = 'scheduler' "
            "AND ts <= toDateTime64({t1:Float64}, 6, 'UTC') GROUP BY start, finish, b", p)
    base: dict[str, int] = defaultdict(int)
    deltas: dict[str, list[int]] = {}
    for start, finish, b, count in rows:
        for state, d in ((finish, count), (start, -count)):
            if state not in STATES:
                continue
            if b < 0:
                base[state] += d
            else:
                deltas.setdefault(state, [0] * n)[min(int(b), n - 1)] += d
    series = {}
    for state in STATES:
        if state not in deltas and not base.get(state):
            continue
        level, out = base.get(state, 0), []
        for d in deltas.get(state, [0] * n):
            level += d
            out.append(level)
        series[state] = out
    return {"times": [scope.t0 + (i + 1) * scope.bucket for i in range(n)], "series": series}


def markers(backend: Backend, scope: Scope, found: list | None = None) -> dict:
    """What to mark on every time axis: worker deaths, cluster restarts, and workers
    that joined after the start.

    A death is a removal whose cause (:mod:`.diagnosis`) is not "expected": the same
    count as the Clusters page's workers lost and the Diagnosis panel's deaths.
    ``found``: the cluster's :func:`diagnosis.deaths`, if already computed.
    """
    lifecycle = _t(backend, "lifecycle")
    _, rows = backend.query(  # with the cluster's first lifecycle event, in one statement
        f"SELECT toFloat64(ts), action, worker, (SELECT min(toFloat64(ts)) FROM {lifecycle} "
        f"WHERE cluster_id = {{c:String}}) FROM {lifecycle} WHERE cluster_id = {{c:String}} "
        "AND action IN ('restart', 'worker_added') ORDER BY ts",
        {"c": scope.cluster_id})
    restarts, arrivals = [], []
    first = float(rows[0][3] or 0.0) if rows else 0.0
    for ts, action, worker, _ in rows:
        if action == "restart":
            restarts.append({"ts": ts})
        elif ts > first + 1.0:
            arrivals.append({"ts": ts, "worker": worker})
    found = diagnosis.deaths(backend, [scope.cluster_id]) if found is None else found
    deaths = [{"ts": d.ts, "worker": d.worker, "reason": d.verdict.cause.label,
               "cause": d.verdict.cause.value, "confidence": d.verdict.confidence,
               "summary": d.verdict.summary, "processing_tasks": d.processing_tasks,
               "lost_computed_tasks": d.lost_computed_tasks,
               "lost_scattered_tasks": d.lost_scattered_tasks}
              for d in found if d.is_death]
    return {"deaths": deaths, "restarts": restarts, "arrivals": arrivals}


def diagnosis_panel(backend: Backend, scope: Scope, key: str | None = None,
                    found: list | None = None) -> dict:
    """Why workers died and why tasks failed with KilledWorker (:func:`diagnosis.diagnose`
    for the cluster and window): one verdict per death and per KilledWorker, with its
    evidence; ``key`` narrows it to that task's KilledWorker. ``found``: the cluster's
    :func:`diagnosis.deaths`, if already computed."""
    return diagnosis.diagnose(backend, key=key, since=scope.since, until=scope.until,
                              ids=[scope.cluster_id], found=found)


def memory(backend: Backend, scope: Scope, dead: list[str] | None = None,
           known: dict | None = None) -> dict:
    """Worker memory over time from the worker metrics, averaged per bucket:
    ``cluster`` (managed/unmanaged/spilled summed over workers) and ``workers``
    (the same per worker, for the :data:`MEMORY_WORKERS` shown: dead workers first,
    then by peak memory), ``n_workers`` in all; ``limits``: each worker's memory
    limit as the scheduler recorded it, and ``limit``: the sum of the memory limits
    of the workers there, per bucket. A time cell is at least twice the workers'
    typical sampling interval, so a worker has a sample in every cell it lived.
    ``known``: the run's :func:`workers.info`, if already known."""
    from dask_blackbox.read import workers

    where, p = _where(scope, span=False)
    w = _metric_cell(backend, scope)
    p.update(w=w, t0=scope.t0)
    _, rows = backend.query(
        "SELECT worker, toUInt32(floor((toFloat64(ts) - {t0:Float64}) / {w:Float64})) AS b, "
        "avg(ifNull(memory_managed, 0)), avg(ifNull(memory_unmanaged, ifNull(memory, 0))), "
        "avg(ifNull(memory_spilled, 0)) "
        f"FROM {_t(backend, 'worker_metrics')} {where} GROUP BY worker, b ORDER BY worker, b", p)
    out = memory_series(rows, scope.t0, w, dead, MEMORY_WORKERS)
    order = out.pop("buckets")
    known = workers.info(backend, scope.cluster_id) if known is None else known
    limits = {a: i["memory_limit"] for a, i in known.items() if i["memory_limit"]}
    times = [scope.t0 + b * w for b in order]
    total = [sum(i["memory_limit"] or 0 for i in known.values()
                 if (i["added"] or 0) <= t + w and (i["removed"] is None or i["removed"] > t))
             for t in times]
    return {**out, "limits": limits,
            "limit": {"times": times, "total": total} if any(total) else {}}


def memory_series(cells, t0: float, bucket: float, dead: list[str] | None, shown: int) -> dict:
    """The memory chart's series from ``cells`` of (worker, bucket number, managed,
    unmanaged, spilled) in order of worker and bucket: ``n_workers``, ``cluster``
    (summed over workers per bucket), ``workers`` (the ``shown`` ones: dead workers
    first, then by peak memory) and ``buckets`` (the numbers, in order)."""
    series: dict[str, dict[str, list]] = {}
    cluster: dict[int, list[float]] = {}
    for worker, b, managed, unmanaged, spilled in cells:
        s = series.setdefault(worker, {"times": [], "managed": [], "unmanaged": [], "spilled": []})
        s["times"].append(t0 + (b + 0.5) * bucket)
        s["managed"].append(managed)
        s["unmanaged"].append(unmanaged)
        s["spilled"].append(spilled)
        c = cluster.setdefault(b, [0.0, 0.0, 0.0])
        c[0] += managed
        c[1] += unmanaged
        c[2] += spilled
    peak = {k: max(m + u for m, u in zip(s["managed"], s["unmanaged"])) for k, s in series.items()}
    dead = [k for k in (dead or []) if k in series]
    chosen = (dead + [k for k in sorted(peak, key=lambda k: -peak[k]) if k not in dead])
    chosen = chosen[:max(shown, len(dead))]
    order = sorted(cluster)
    return {
        "n_workers": len(series),
        "cluster": {"times": [t0 + (b + 0.5) * bucket for b in order],
                    "managed": [cluster[b][0] for b in order],
                    "unmanaged": [cluster[b][1] for b in order],
                    "spilled": [cluster[b][2] for b in order]},
        "workers": {k: series[k] for k in chosen},
        "buckets": order,
    }


def _metric_cell(backend: Backend, scope: Scope, worker: str | None = None) -> float:
    """The time cell of a chart of worker samples: the page's bucket, at least twice
    the workers' typical sampling interval (so a worker has a sample in every cell it
    lived)."""
    where, p = _where(scope, span=False)
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    _, intervals = backend.query(
        "SELECT (max(toFloat64(ts)) - min(toFloat64(ts))) / (count() - 1) "
        f"FROM {_t(backend, 'worker_metrics')} {where} GROUP BY worker HAVING count() > 1", p)
    typical = sorted(r[0] for r in intervals)[len(intervals) // 2] if intervals else 0.0
    return max(scope.bucket, 2 * typical)


def activity(backend: Backend, scope: Scope, worker: str | None = None,
             known: dict | None = None) -> dict:
    """Dask's Processing, CPU and Data Transfer views over time, for the cluster (or
    one ``worker``):

    ``processing``: per time cell (``times``, cell middles; ``cell`` wide) the tasks
    ``executing``, ``ready`` and ``in_flight`` and the ``cpu`` percent (100: one
    core), each the mean of a worker's samples in the cell summed over the workers;
    ``threads``: the threads of the workers there (as the scheduler recorded them);
    ``actions``: per bucket (``times``, bucket ends; ``bucket`` wide) the seconds of
    each action (compute, transfer, disk-read, disk-write, ...) within it per second
    of it -- how many threads were doing it at once, on average over the bucket.
    From the raw startstops, each split over the buckets it spans; for a scope the
    page aggregates answer (:func:`aggregates.usable`), from their whole seconds, in
    buckets of whole seconds starting on one. ``known``: the run's
    :func:`workers.info`, if already known."""
    from dask_blackbox.read import workers as worker_data

    w = _metric_cell(backend, scope, worker)
    where, p = _where(scope, span=False)
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    p.update(w=w)
    _, rows = backend.query(
        "SELECT b, sum(e), sum(r), sum(f), sum(c) FROM ("
        " SELECT worker, toUInt32(floor((toFloat64(ts) - {t0:Float64}) / {w:Float64})) AS b, "
        " avg(executing) AS e, avg(ready) AS r, avg(in_flight) AS f, avg(cpu) AS c "
        f" FROM {_t(backend, 'worker_metrics')} {where} GROUP BY worker, b) GROUP BY b ORDER BY b", p)
    times = [scope.t0 + (b + 0.5) * w for b, *_ in rows]
    known = worker_data.info(backend, scope.cluster_id) if known is None else known
    if worker is not None:
        known = {worker: known[worker]} if worker in known else {}
    threads = [sum(i["nthreads"] or 0 for i in known.values()
                   if (i["added"] or 0) <= t and (i["removed"] is None or i["removed"] > t))
               for t in times]
    processing = {"times": times, "executing": [r[1] for r in rows], "ready": [r[2] for r in rows],
                  "in_flight": [r[3] for r in rows], "cpu": [r[4] for r in rows], "threads": threads}
    if aggregates.usable(scope):
        step = float(math.ceil(scope.bucket))
        start = float(math.floor(scope.t0))
        n = min(BUCKETS, int((scope.t1 - start) / step) + 1)
        per_action = aggregates.activity(backend, scope, n, worker, t0=start, width=step)
    else:
        step, start, n = scope.bucket, scope.t0, _n_buckets(scope)
        per_action = _action_seconds(backend, scope, n, worker)
    series = {a: [per_action[a].get(i, 0.0) / step for i in range(n)]
              for a in sorted(per_action, key=lambda a: (a != "compute", a))}
    return {"processing": processing,
            "actions": {"times": [start + (i + 1) * step for i in range(n)], "series": series,
                        "bucket": step},
            "cell": w}


def _action_seconds(backend: Backend, scope: Scope, n: int, worker: str | None = None) -> dict[str, dict]:
    """Seconds of each action within each of the scope's ``n`` buckets, summed over
    the workers (or of ``worker``), from the raw startstops: ``{action: {bucket:
    seconds}}``, an action's seconds split over the buckets it spans."""
    where, p = _where(scope, time_column="")
    where += " AND source = 'scheduler'"
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    if scope.since is not None:  # a transition comes after its actions
        where += " AND ts >= toDateTime64({t0:Float64}, 6, 'UTC')"
    p.update(t0=scope.t0, t1=scope.t1, w=scope.bucket, nb=float(n))
    _, rows = backend.query(
        "SELECT action, b, sum(greatest(0., least(e, {t0:Float64} + (b + 1) * {w:Float64}) "
        "- greatest(s, {t0:Float64} + b * {w:Float64}))) FROM ("
        " SELECT ss.action AS action, toFloat64(ss.start) AS s, toFloat64(ss.stop) AS e "
        f" FROM {_t(backend, 'transitions')} ARRAY JOIN startstops AS ss {where}"
        " AND ss.stop >= toDateTime64({t0:Float64}, 6, 'UTC') AND ss.start <= toDateTime64({t1:Float64}, 6, 'UTC'))"
        " ARRAY JOIN range(toUInt32(greatest(0., floor((s - {t0:Float64}) / {w:Float64}))), "
        "  toUInt32(least({nb:Float64}, greatest(floor((s - {t0:Float64}) / {w:Float64}) + 1, "
        "  ceil((e - {t0:Float64}) / {w:Float64}))))) AS b "
        "GROUP BY action, b", p)
    out: dict[str, dict] = defaultdict(dict)
    for action, b, seconds in rows:
        out[action][int(b)] = float(seconds)
    return dict(out)


def spans(backend: Backend, scope: Scope) -> dict:
    """The span tree (depth-first) with Dask's numbers: ``task_s`` is Span.duration
    (seconds of every task action in the tree), ``elapsed_s`` stop - start."""
    columns, rows = queries.spans(backend, tree=True, cluster=scope.cluster_id, cost=False)
    out = []
    for row in rows:
        r = dict(zip(columns, row))
        if scope.span_ids is not None and r["span_id"] not in scope.span_ids:
            continue
        out.append({
            "span_id": r["span_id"], "parent_id": r["parent_id"], "depth": r["depth"],
            "name": r["name"].strip(), "enqueued": _ts(r["enqueued"]), "start": _ts(r["start"]),
            "stop": _ts(r["stop"]), "elapsed_s": r["elapsed_s"], "task_s": r["task_s"],
            "tasks": r["tasks"], "nbytes": r["nbytes"], "by_action": r["by_action"] or {},
            "done": r["done"],
        })
    if scope.since is not None or scope.until is not None:
        out = [s for s in out if (s["stop"] or s["enqueued"] or 0) >= scope.t0
               and (s["start"] or s["enqueued"] or 0) <= scope.t1]
    return {"spans": out}


def _ts(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp() if value.timestamp() > 0 else None
    return float(value)


def fine_metrics(backend: Backend, scope: Scope) -> dict:
    """Dask's fine performance metrics: seconds (and bytes) per activity and prefix,
    as the spans rolled them up (``Span.cumulative_worker_metrics`` of the top spans
    of the scope), or summed from the workers' digests when no span state was
    recorded.

    ``execute``: {prefix: {activity: seconds}} of task execution; ``idle``: the
    seconds of Dask's ``("execute", "N/A", "idle or other spans")`` (the threads'
    time offered to the spans and not used by their tasks; None without span
    state); ``transfer``: {context: {activity: seconds}} of sending data
    (``get-data``) and gathering dependencies (``gather-dep``), from the workers'
    digests of the run (these contexts have no span); ``other``: rows of (context,
    prefix, activity, unit, value) for the rest."""
    p: dict[str, Any] = {"c": scope.cluster_id}
    if scope.span_ids is None:
        top = f"parent_id = '' OR parent_id NOT IN (SELECT span_id FROM {_t(backend, 'span_state')} " \
              "WHERE cluster_id = {c:String})"
    else:
        top = "span_id IN {ids:Array(String)} AND parent_id NOT IN {ids:Array(String)}"
        p["ids"] = scope.span_ids
    _, rows = backend.query(
        "SELECT m.context, m.prefix, m.activity, m.unit, sum(m.value) "
        f"FROM {_t(backend, 'span_state')} FINAL ARRAY JOIN cumulative_worker_metrics AS m "
        f"WHERE cluster_id = {{c:String}} AND ({top}) "
        "GROUP BY m.context, m.prefix, m.activity, m.unit", p)
    source = "spans"
    windowed = scope.since is not None or scope.until is not None
    if not rows:
        source = "worker_digests"
        if windowed:
            where, p = _where(scope)
            _, rows = backend.query(
                "SELECT context, prefix, activity, unit, sum(value) "
                f"FROM {_t(backend, 'worker_digests')} {where} GROUP BY context, prefix, activity, unit", p)
        else:
            rows = aggregates.digests(backend, scope.cluster_id, span_ids=scope.span_ids)
    else:
        # the contexts without a span (sending and gathering data, the memory
        # monitor, ...) are only in the digests
        rows = [r for r in rows if r[0] == "execute" or r[0] == "p2p"] + [
            r for r in aggregates.digests(backend, scope.cluster_id)
            if r[0] not in ("execute", "p2p")]
    execute: dict[str, dict[str, float]] = defaultdict(dict)
    transfer: dict[str, dict[str, float]] = defaultdict(dict)
    idle, other = None, []
    for context, prefix, activity, unit, value in rows:
        if context == "execute" and unit == "seconds" and prefix == "N/A":
            idle = (idle or 0.0) + value
        elif context == "execute" and unit == "seconds" and prefix != "":
            execute[prefix or "(none)"][activity] = execute[prefix or "(none)"].get(activity, 0.0) + value
        elif context in ("get-data", "gather-dep") and unit == "seconds":
            transfer[context][activity] = transfer[context].get(activity, 0.0) + value
        else:
            other.append({"context": context, "prefix": prefix, "activity": activity,
                          "unit": unit, "value": value})
    other.sort(key=lambda r: (r["context"], r["unit"], -r["value"]))
    return {"source": source if rows else None, "execute": dict(execute), "idle": idle,
            "transfer": dict(transfer), "other": other}


def failures(backend: Backend, scope: Scope) -> dict:
    """:func:`queries.failures` for the cluster and window: erred tasks with their
    exceptions, dead workers with the tasks they ran, last metrics and log lines."""
    result = queries.failures(backend, cluster=scope.cluster_id, since=scope.since,
                              until=scope.until)
    out = {name: [dict(zip(columns, row)) for row in rows] for name, (columns, rows) in result.items()}
    if scope.span_ids is not None:
        _, in_span = backend.query(
            f"SELECT DISTINCT key FROM {_t(backend, 'transitions')} WHERE cluster_id = {{c:String}} "
            "AND span_id IN {ids:Array(String)} AND finish = 'erred'",
            {"c": scope.cluster_id, "ids": scope.span_ids})
        keys = {k for k, in in_span}
        out["erred_tasks"] = [r for r in out["erred_tasks"] if r["key"] in keys]
    return out


def logs(backend: Backend, scope: Scope, level: str | None = None, worker: str | None = None,
         text: str | None = None, limit: int = 500, logger: str | None = None) -> dict:
    """The newest ``limit`` log records in the window (oldest first), with the total
    matching count and the workers seen (for the worker filter); the filters of
    :func:`queries.logs` (``worker``: a worker's address keeps its own records and
    its nanny's, "scheduler" the scheduler's)."""
    window = {"cluster": scope.cluster_id, "since": scope.t0, "until": scope.t1 + 1e-6,
              "worker": worker, "level": level, "logger": logger, "text": text}
    _, rows = queries.logs(backend, limit=limit, **window)
    total = queries.logs_count(backend, **window)
    _, workers = backend.query(
        f"SELECT DISTINCT worker FROM {_t(backend, 'logs')} WHERE cluster_id = {{c:String}} "
        "AND worker != '' ORDER BY worker", {"c": scope.cluster_id})
    return {
        "total": total, "limit": limit, "processes": [r[0] for r in workers],
        "filters": {"level": level.upper() if level else None, "worker": worker, "text": text,
                    "logger": logger},
        "lines": [{"ts": _ts(r[0]), "level": r[1], "source": r[2], "worker": r[3],
                   "process": r[3] or r[2], "logger": r[4], "key": r[5], "message": r[6],
                   "exc_text": r[7]} for r in rows],
    }


def span_names(backend: Backend, scope: Scope) -> list[str]:
    """The '/'-joined names of the cluster's spans, for the span picker."""
    _, rows = backend.query(
        f"SELECT DISTINCT arrayStringConcat(name, '/') AS n FROM {_t(backend, 'spans')} "
        "WHERE cluster_id = {c:String} ORDER BY n", {"c": scope.cluster_id})
    return [r[0] for r in rows]


def critical_path(backend: Backend, scope: Scope) -> dict:
    """The critical path of the run or span (:mod:`.critical_path`): ``links`` (first
    first) with each link's ``parts`` (seconds waiting on the client, dependencies,
    the scheduler, transfers, disk, a thread, and computing), the window ``t0``..``t1``
    they add up to, ``basis`` (graph, actions, or both) and ``notes``. When no task of
    the scope finished with recorded actions: ``available`` false and the ``reason``."""
    try:
        path = paths.critical_path(backend, scope.cluster_id, scope.span_ids, scope.since,
                                   scope.until, span=scope.span)
    except paths.NoActions as e:
        return {"available": False, "reason": str(e)}
    return {"available": True, **path.as_dict()}


def cost(backend: Backend, scope: Scope) -> dict:
    """What the run (or span) cost (:mod:`.cost`): ``spans`` (each span tree of the
    scope: thread CPU seconds, thread-seconds occupied and offered, idle and who was
    idle, bytes moved and spilled, memory byte-seconds), ``prefixes`` (the additive
    measures per prefix) and ``totals`` (the scope's sum; for the whole run, the
    cluster's)."""
    found = costs.measures(backend, [scope.cluster_id])
    in_scope = set(scope.span_ids) if scope.span_ids is not None else None
    spans_ = [c for c in costs.span_costs(backend, [scope.cluster_id], found, windows_for=in_scope)
              if in_scope is None or c.span_id in in_scope]
    prefixes_ = costs.by_prefix(found, in_scope)
    kept = [m for (_, s, _), m in found.items() if in_scope is None or s in in_scope]
    # parents before children, siblings by time, each with its depth
    nodes = [{"cluster_id": c.cluster_id, "span_id": c.span_id, "parent_id": c.parent_id,
              "enqueued": c.enqueued or 0.0, "cost": c} for c in spans_]
    tree = [{**n["cost"].as_dict(), "depth": depth} for depth, n in queries.tree_order(nodes)]
    return {"spans": tree,
            "prefixes": {p: m._asdict() for p, m in sorted(
                prefixes_.items(), key=lambda kv: (-(kv[1].busy_s or 0.0), -kv[1].memory_byte_s,
                                                   kv[0]))},
            "totals": costs.total(kept)._asdict()}


#: Panels the JSON API serves by these names besides the Run page's views
#: (:data:`dask_blackbox.read.views.RUN_VIEWS`).
RUN_PANELS = {
    "summary": summary, "task_stream": task_stream, "progress": progress,
    "task_states": task_states, "markers": markers, "memory": memory, "spans": spans,
    "fine_metrics": fine_metrics, "failures": failures, "logs": logs,
    "diagnosis": diagnosis_panel, "critical_path": critical_path, "cost": cost,
    "activity": activity,
}


# ------------------------------------------------------------- other pages


#: Clusters on one page of :func:`clusters` unless asked otherwise, and at most.
CLUSTERS_PAGE = 100
CLUSTERS_PAGE_MAX = 1000


def clusters(backend: Backend, name: str | None = None, since: TimeBound = None,
             until: TimeBound = None, now: float | None = None, limit: int = CLUSTERS_PAGE,
             offset: int = 0) -> dict:
    """One page of the recorded clusters (``name``: substring of the name or id, any
    case; since/until: those active in that window), newest first (first seen, then
    id): ``limit`` of them from ``offset``, with how each ended: "closed" (the
    scheduler's close was recorded), "alive" (heard from in the last two minutes) or
    "gone" (neither: killed, or the producer lost), and the workers it lost (deaths:
    removals whose cause is not "expected", see :mod:`.diagnosis`). ``{"clusters":
    [...], "total": <clusters matching>,
    "offset", "limit"}``; the work is the page's, whatever the number of clusters."""
    import time as _time

    if not 1 <= limit <= CLUSTERS_PAGE_MAX or offset < 0:
        raise ValueError(f"limit must be 1..{CLUSTERS_PAGE_MAX} and offset >= 0")
    f = Filter()
    if name:
        f.add("positionCaseInsensitiveUTF8(concat(cluster_name, ' ', cluster_id), {name:String}) > 0",
              name=name)
    start, stop = _epoch(since, "since"), _epoch(until, "until")
    if start is not None:
        f.add("last_seen >= toDateTime64({since:Float64}, 6, 'UTC')", since=start)
    if stop is not None:
        f.add("first_seen < toDateTime64({until:Float64}, 6, 'UTC')", until=stop)
    _, counted = backend.query(f"SELECT count() FROM {_t(backend, 'clusters')} {f.where()}",
                               f.parameters)
    _, rows = backend.query(
        "SELECT cluster_id, cluster_name, first_seen, last_seen, tasks_computed, tasks_erred "
        f"FROM {_t(backend, 'clusters')} {f.where()} ORDER BY first_seen DESC, cluster_id "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt64}",
        {**f.parameters, "limit": limit, "offset": offset})
    ids = [r[0] for r in rows]
    workers, ends = {}, {}
    if ids:
        _, found = backend.query(
            "SELECT cluster_id, uniqExact(worker) FROM ("
            f"SELECT cluster_id, worker FROM {_t(backend, 'lifecycle')} "
            "WHERE worker != '' AND cluster_id IN {ids:Array(String)} UNION ALL "
            f"SELECT DISTINCT cluster_id, worker FROM {_t(backend, 'worker_metrics')} "
            "WHERE cluster_id IN {ids:Array(String)}) GROUP BY cluster_id", {"ids": ids})
        workers = dict(found)
        _, found = backend.query(
            "SELECT cluster_id, countIf(action = 'scheduler_close') > 0, "
            "countIf(action = 'worker_removed') "
            f"FROM {_t(backend, 'lifecycle')} WHERE cluster_id IN {{ids:Array(String)}} "
            "GROUP BY cluster_id", {"ids": ids})
        lost_ = diagnosis.death_counts(backend, ids)
        ends = {c: (closed, lost_.get(c, 0), removed) for c, closed, removed in found}
    now = _time.time() if now is None else now
    out = []
    for cluster_id, cluster_name, first_seen, last_seen, tasks, errors in rows:
        closed, lost, removed = ends.get(cluster_id, (False, 0, 0))
        last = _ts(last_seen) or 0.0
        status = "closed" if closed else "alive" if now - last < 120 else "gone"
        out.append({"cluster_name": cluster_name, "cluster_id": cluster_id,
                    "first_seen": _ts(first_seen), "last_seen": last, "status": status,
                    "workers": workers.get(cluster_id, 0), "tasks": tasks, "errors": errors,
                    "workers_lost": lost, "workers_removed": removed})
    return {"clusters": out, "total": counted[0][0], "offset": offset, "limit": limit}


def task(backend: Backend, cluster: str, key: str, window: float = 2.0,
         log_lines: int = 10) -> dict:
    """One task: its story (scheduler and worker transitions), and around each
    transition on a worker that worker's two nearest metric samples and its log lines
    from ``window`` seconds before the transition to ``window`` seconds after the
    next one (at most ``log_lines``), each marked ``whose``: "task" (logged while
    this task ran, ``logs.key``), "other task" (while another one ran: ``key``
    names it) or "worker" (the worker's own); its dependencies and dependents from
    the recorded graph; where it ran and, if it erred, its exception.

    The worker of a transition into processing is not passed to plugins; it is the
    worker of the transition that left processing next (Dask passes it to memory and
    erred; a release because the worker died names the removal's stimulus), marked
    ``worker_inferred``."""
    cluster_id, cluster_name, _ = _cluster(backend, cluster)
    columns, rows = queries.story(backend, key, cluster=cluster_id, source=None)
    if not rows:
        raise UnknownKey(f"no task {key!r} was recorded in cluster {cluster_name} ({cluster_id})")
    _, detail_rows = backend.query(
        "SELECT toFloat64(ts), start, finish, prefix, task_group, span_id, worker, nbytes, typename, "
        "exception, traceback, cause, startstops.action, "
        # floats: arrays of DateTime64 come back as text through a sink's query server
        "arrayMap(x -> toFloat64(x), startstops.start), arrayMap(x -> toFloat64(x), startstops.stop) "
        f"FROM {_t(backend, 'transitions')} WHERE cluster_id = {{c:String}} AND key = {{k:String}} "
        "AND source = 'scheduler' ORDER BY ts, seq, idx", {"c": cluster_id, "k": key})
    prefix = next((r[3] for r in detail_rows if r[3]), "")
    span_id = next((r[5] for r in detail_rows if r[5]), "")
    group = next((r[4] for r in detail_rows if r[4]), "")
    errors = [{"ts": r[0], "exception": r[9], "traceback": r[10], "cause": r[11]}
              for r in detail_rows if r[2] == "erred"]
    actions = [{"ts": r[0], "action": a, "start": s, "stop": e, "worker": r[6]}
               for r in detail_rows for a, s, e in zip(r[12], r[13], r[14])]
    _, producers = backend.query(
        f"SELECT DISTINCT worker, producer_id FROM {_t(backend, 'worker_metrics')} "
        "WHERE cluster_id = {c:String}", {"c": cluster_id})
    producers_of = defaultdict(list)
    for w, prod in producers:
        producers_of[w].append(prod)
    # Which worker: Dask passes it with the transitions out of processing (to memory
    # or erred); a task released because its worker died names the removal's stimulus.
    _, removals = backend.query(
        f"SELECT stimulus_id, worker FROM {_t(backend, 'lifecycle')} WHERE cluster_id = {{c:String}} "
        "AND action = 'worker_removed' AND stimulus_id != ''", {"c": cluster_id})
    removed_by = dict(removals)
    story = []
    for row in rows:
        r = dict(zip(columns, row))
        entry = {k: r[k] for k in ("start", "finish", "stimulus_id", "ts", "worker", "source")}
        entry.update(metrics=[], logs=[], worker_inferred=False)
        if not entry["worker"] and entry["start"] == "processing" and r["stimulus_id"] in removed_by:
            entry["worker"], entry["worker_inferred"] = removed_by[r["stimulus_id"]], True
        story.append(entry)
    entered = None
    for entry in story:  # the transition into processing ran where the task then left it
        if entry["finish"] == "processing" and entry["source"] == "scheduler":
            entered = entry
        elif entry["start"] == "processing" and entered is not None:
            if entry["worker"] and not entered["worker"]:
                entered["worker"], entered["worker_inferred"] = entry["worker"], True
            entered = None
    for i, entry in enumerate(story):
        worker = entry["worker"]
        if not worker:
            continue
        # Around a transition: from just before it until just after the next one
        # (the whole run of a task entering processing), at most a minute.
        until = min(story[i + 1]["ts"] if i + 1 < len(story) else entry["ts"], entry["ts"] + 60.0)
        p = {"c": cluster_id, "w": worker, "t": entry["ts"], "u": until, "win": window}
        mcols, samples = backend.query(
            "SELECT toFloat64(ts) AS t, memory, memory_managed, memory_unmanaged, memory_spilled, "
            "cpu, executing, ready, in_flight "
            f"FROM {_t(backend, 'worker_metrics')} WHERE cluster_id = {{c:String}} "
            "AND worker = {w:String} AND toFloat64(ts) BETWEEN {t:Float64} - 5 * {win:Float64} "
            "AND {t:Float64} + 5 * {win:Float64} ORDER BY abs(toFloat64(ts) - {t:Float64}) LIMIT 2",
            {k: v for k, v in p.items() if k != "u"})
        entry["metrics"] = sorted((dict(zip(mcols, s)) for s in samples), key=lambda m: m["t"])
        p["prods"] = producers_of.get(worker, [])
        _, lines = backend.query(
            "SELECT toFloat64(ts), level, logger, message, key, exc_text FROM "
            f"{_t(backend, 'logs')} WHERE cluster_id = {{c:String}} "
            # the records that name the worker (its own, its nanny's); records of its
            # producer recorded before records named their worker
            "AND (worker = {w:String} OR (worker = '' AND producer_id IN {prods:Array(String)})) "
            "AND toFloat64(ts) BETWEEN {t:Float64} - {win:Float64} AND {u:Float64} + {win:Float64} "
            "ORDER BY ts, seq, idx LIMIT " + str(int(log_lines)), p)
        # whose line: this task's (logged by its own thread while it ran), another
        # task's, or the worker's own
        entry["logs"] = [{"ts": t, "level": lv, "logger": lg, "message": m, "exc_text": x, "key": k,
                          "whose": "task" if k == key else ("other task" if k else "worker")}
                         for t, lv, lg, m, k, x in lines]
    _, deps = backend.query(
        f"SELECT dependencies FROM {_t(backend, 'graph_tasks')} WHERE cluster_id = {{c:String}} "
        "AND key = {k:String} ORDER BY ts DESC LIMIT 1", {"c": cluster_id, "k": key})
    _, dependents = backend.query(
        f"SELECT DISTINCT key FROM {_t(backend, 'graph_tasks')} WHERE cluster_id = {{c:String}} "
        "AND has(dependencies, {k:String}) ORDER BY key LIMIT 500", {"c": cluster_id, "k": key})
    span_name = ""
    if span_id:
        _, names = backend.query(
            f"SELECT any(name) FROM {_t(backend, 'spans')} WHERE cluster_id = {{c:String}} "
            "AND span_id = {s:String}", {"c": cluster_id, "s": span_id})
        span_name = "/".join(names[0][0]) if names and names[0][0] else ""
    return {"cluster_id": cluster_id, "cluster_name": cluster_name, "key": key, "prefix": prefix,
            "group": group, "span_id": span_id, "span": span_name, "story": story,
            "actions": actions, "errors": errors,
            "dependencies": list(deps[0][0]) if deps else [],
            "dependents": [r[0] for r in dependents]}


def compare(backend: Backend, span: str | None, cluster: str | None = None,
            since: TimeBound = None, until: TimeBound = None) -> dict:
    """The latest run against the one before it (:func:`regressions.compare`):
    ``verdict`` (the comparison's dict, its ``sentences`` first; or ``{"error":
    reason}`` when the runs cannot be compared), and for a span, :func:`queries.compare`
    side by side: ``runs`` are the column labels; ``metrics`` maps a metric to one
    value per run. Without ``span``, the whole runs of the clusters named ``cluster``."""
    if not span and not cluster:
        raise NotFound("no span name given: pass span=NAME (or cluster=NAME to compare "
                       "its whole runs)")
    try:
        if span:
            columns, rows = queries.compare(backend, span, cluster=cluster, since=since,
                                            until=until)
        else:
            queries.cluster_ids(backend, cluster)
            columns, rows = ["metric"], []
    except UnknownCluster as e:
        raise NotFound(str(e)) from None
    if span and not rows:
        where = f" in cluster {cluster}" if cluster else ""
        raise UnknownSpan(f"no span named {span!r} was recorded{where}")
    try:
        verdict = regressions.compare(backend, span, cluster, since, until).as_dict()
    except regressions.NotComparable as e:
        verdict = {"error": str(e)}
    runs, metrics = columns[1:], {row[0]: list(row[1:]) for row in rows}
    if "table" in verdict and all(v is None for values in metrics.values() for v in values):
        # no span snapshots (the processors did not run): the runs as their tasks tell
        runs, metrics = verdict["runs"], {row[0]: list(row[1:]) for row in verdict["table"]}
    return {"span": span, "cluster": cluster, "runs": runs, "verdict": verdict,
            "metrics": metrics}
