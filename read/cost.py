"""What every span and task prefix cost, in measures that add up to the cluster's totals.

Additive measures (:class:`Measures`), per (cluster, span, prefix), summed over a span
tree, a prefix or a whole cluster:

(None where the cluster recorded no fine performance metrics, or no graph, for
the measures read from them.)

``cpu_s``           thread CPU seconds of the tasks: the fine performance metric
                    ``("execute", span, prefix, "thread-cpu", "seconds")`` the workers
                    reported (``worker_digests``), which is what Dask's
                    ``Span.cumulative_worker_metrics`` sums;
``busy_s``          thread-seconds the tasks occupied: every ``execute`` metric in
                    seconds (thread CPU and non-CPU, executor, deserialisation, disk,
                    other) -- Dask's "known seconds" of a span;
``moved_bytes``     bytes fetched from other workers for the tasks: for each
                    dependency and each worker that ran a dependent elsewhere, its
                    ``nbytes`` once, charged to the first such dependent; from the
                    recorded graph (None for a cluster whose graph was not recorded);
``spilled_bytes``   bytes written to disk while the tasks executed
                    (``("execute", ..., "disk-write", "bytes")``);
``memory_byte_s``   bytes of the tasks' results times the seconds they were held in
                    memory (from entering memory until leaving it, or the cluster's
                    last transition if they never did).

Window measures, per span tree (:class:`SpanCost`): ``offered_s`` is Dask's
``Span.active_cpu_seconds`` (the cluster's threads times the seconds from the span's
``enqueued`` to its ``stop``, as ``Scheduler.total_nthreads_history`` changed,
recorded in ``lifecycle.total_nthreads``); ``idle_or_other_s`` is Dask's
``("execute", "N/A", "idle or other spans", "seconds")``, ``max(0, offered -
busy)``; ``idle_s`` the thread-seconds in the window when a thread ran no task of any
span (from the compute actions), and ``idle_by_worker`` who was idle: each worker's
threads (``nthreads`` when it joined) times its time in the window, less its compute.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table

#: At most this many spans get their idle threads computed in one call (each costs a
#: pass over the cluster's compute actions inside one statement).
IDLE_SPANS = 200


class Measures(NamedTuple):
    """Additive cost measures (see the module docstring). None: not recorded (no fine
    performance metrics, or no graph, for the cluster); a sum with None is None."""

    cpu_s: float | None = 0.0
    busy_s: float | None = 0.0
    moved_bytes: int | None = 0
    spilled_bytes: int | None = 0
    memory_byte_s: float = 0.0

    def __add__(self, other: Measures) -> Measures:  # type: ignore[override]
        return Measures(*(None if a is None or b is None else a + b
                          for a, b in zip(self, other)))


def total(items: Iterable[Measures]) -> Measures:
    out = Measures()
    for m in items:
        out = out + m
    return out


@dataclasses.dataclass(frozen=True)
class SpanCost:
    """A span tree's cost (the span and its descendants)."""

    cluster_id: str
    span_id: str
    name: tuple[str, ...]
    parent_id: str
    measures: Measures
    enqueued: float | None
    start: float | None
    stop: float | None
    offered_s: float | None
    idle_s: float | None
    idle_by_worker: dict[str, float]

    @property
    def idle_or_other_s(self) -> float | None:
        if self.offered_s is None or self.measures.busy_s is None:
            return None
        return max(0.0, self.offered_s - self.measures.busy_s)

    def as_dict(self) -> dict:
        return {"cluster_id": self.cluster_id, "span_id": self.span_id,
                "name": list(self.name), "parent_id": self.parent_id,
                **self.measures._asdict(), "enqueued": self.enqueued, "start": self.start,
                "stop": self.stop, "offered_s": self.offered_s,
                "idle_or_other_s": self.idle_or_other_s, "idle_s": self.idle_s,
                "idle_by_worker": self.idle_by_worker}


# ---------------------------------------------------------------- the measures


#: Per cluster, span and prefix, from the worker digests ``{d}`` of the executions:
#: thread CPU seconds, all seconds, bytes written to disk.
EXECUTE_DIGESTS = ("SELECT cluster_id, span_id, prefix, sumIf(value, activity = 'thread-cpu' AND "
                   "unit = 'seconds'), sumIf(value, unit = 'seconds'), sumIf(value, activity = "
                   "'disk-write' AND unit = 'bytes') FROM {d} WHERE cluster_id IN "
                   "{{ids:Array(String)}} AND context = 'execute' AND prefix != 'N/A' GROUP BY "
                   "cluster_id, span_id, prefix")
#: Per cluster, span and prefix (from the transitions ``{t}``): the byte-seconds its results
#: were held in memory, from entering memory until leaving it (or the cluster's end).
HELD_BYTE_SECONDS = ("WITH ends AS (SELECT cluster_id, toFloat64(max(ts)) AS end_s FROM {t} WHERE "
                     "cluster_id IN {{ids:Array(String)}} GROUP BY cluster_id) SELECT k.cluster_id, "
                     "span_id, prefix, sum(nb * (left_s - entered_s + open * ends.end_s)) FROM "
                     "(SELECT cluster_id, cityHash64(key) AS kh, argMaxIf(span_id, ts, span_id != "
                     "'') AS span_id, argMaxIf(prefix, ts, prefix != '') AS prefix, "
                     "toFloat64(argMaxIf(nbytes, ts, nbytes IS NOT NULL)) AS nb, "
                     "sumIf(toFloat64(ts), finish = 'memory') AS entered_s, sumIf(toFloat64(ts), "
                     "start = 'memory') AS left_s, countIf(finish = 'memory') - countIf(start = "
                     "'memory') AS open FROM {t} WHERE cluster_id IN {{ids:Array(String)}} AND "
                     "source = 'scheduler' GROUP BY cluster_id, kh HAVING countIf(finish = 'memory') "
                     "> 0) AS k INNER JOIN ends ON ends.cluster_id = k.cluster_id GROUP BY "
                     "k.cluster_id, span_id, prefix")
#: Which of the clusters ``ids`` have rows in the table ``{table}``.
RECORDED_CLUSTERS = "SELECT DISTINCT cluster_id FROM {table} WHERE cluster_id IN {{ids:Array(String)}}"
#: Per cluster, span and prefix of the dependents: the bytes of their dependencies (the graph
#: ``{g}``) fetched from another worker, one fetch per other worker that ran a dependent
#: (who ran what: the transitions ``{t}``).
MOVED_BYTES = ("WITH fin AS (SELECT cluster_id, cityHash64(key) AS kh, argMax(worker, ts) AS "
               "worker, argMax(ifNull(nbytes, 0), ts) AS nbytes, argMax(span_id, ts) AS "
               "span_id, argMax(prefix, ts) AS prefix, min(ts) AS first FROM {t} WHERE "
               "cluster_id IN {{g:Array(String)}} AND source = 'scheduler' AND start = "
               "'processing' AND finish = 'memory' GROUP BY cluster_id, kh) SELECT "
               "m.cluster_id, m.span_id, m.prefix, sum(d.nbytes) FROM ( SELECT e.cluster_id AS "
               "cluster_id, e.dh AS dh, f.worker AS dest,  argMin(f.span_id, f.first) AS "
               "span_id, argMin(f.prefix, f.first) AS prefix  FROM (SELECT DISTINCT "
               "cluster_id, cityHash64(key) AS kh,  cityHash64(arrayJoin(dependencies)) AS dh "
               "FROM {g}  WHERE cluster_id IN {{g:Array(String)}}) AS e  INNER JOIN fin AS f "
               "ON f.cluster_id = e.cluster_id AND f.kh = e.kh  GROUP BY e.cluster_id, e.dh, "
               "f.worker) AS m INNER JOIN fin AS d ON d.cluster_id = m.cluster_id AND d.kh = "
               "m.dh WHERE d.worker != m.dest GROUP BY m.cluster_id, m.span_id, m.prefix")


def measures(backend: Backend, cluster_ids: Sequence[str]) -> dict[tuple[str, str, str], Measures]:
    """Additive measures per (cluster_id, span_id, prefix) of the clusters."""
    p = {"ids": list(cluster_ids)}
    t, g, d = (table(backend, n) for n in ("transitions", "graph_tasks", "worker_digests"))
    out: dict[tuple[str, str, str], list] = defaultdict(lambda: [0.0, 0.0, 0, 0, 0.0])
    _, rows = backend.query(EXECUTE_DIGESTS.format(d=d), p)
    for c, s, pr, cpu, busy, spilled in rows:
        m = out[(c, s, pr)]
        m[0], m[1], m[3] = float(cpu), float(busy), int(spilled)
    # results held in memory: from entering memory until leaving it (or the end)
    _, rows = backend.query(HELD_BYTE_SECONDS.format(t=t), p)
    for c, s, pr, byte_s in rows:
        out[(c, s, pr)][4] = float(byte_s or 0.0)
    # bytes moved: a dependency fetched once by each other worker that ran a dependent
    _, graphed = backend.query(RECORDED_CLUSTERS.format(table=g), p)
    graphed_ids = {r[0] for r in graphed}
    if graphed_ids:
        _, rows = backend.query(
            MOVED_BYTES.format(t=t, g=g),
            {"g": sorted(graphed_ids)})
        for c, s, pr, moved in rows:
            out[(c, s, pr)][2] = int(moved)
    _, digested = backend.query(RECORDED_CLUSTERS.format(table=d), p)
    metered = {r[0] for r in digested}
    return {k: Measures(cpu if k[0] in metered else None, busy if k[0] in metered else None,
                        moved if k[0] in graphed_ids else None,
                        spilled if k[0] in metered else None, mem)
            for k, (cpu, busy, moved, spilled, mem) in out.items()}


def by_prefix(found: dict[tuple[str, str, str], Measures],
              span_ids: set[str] | None = None) -> dict[str, Measures]:
    """The measures per prefix (within ``span_ids`` if given)."""
    out: dict[str, list[Measures]] = defaultdict(list)
    for (_, span_id, prefix), m in found.items():
        if span_ids is None or span_id in span_ids:
            out[prefix].append(m)
    return {prefix: total(ms) for prefix, ms in out.items()}


def cluster_totals(backend: Backend, cluster_ids: Sequence[str]) -> dict[str, Measures]:
    """Per cluster, the sum of its measures."""
    out: dict[str, list[Measures]] = defaultdict(list)
    for (cluster_id, _, _), m in measures(backend, cluster_ids).items():
        out[cluster_id].append(m)
    return {c: total(ms) for c, ms in out.items()}


# ------------------------------------------------------------------ the windows


class _Worker(NamedTuple):
    nthreads: int
    joined: float
    left: float | None


#: The cluster's ``total_nthreads_history`` as its lifecycle records it: per record, whether it
#: is the scheduler's start, the times and the thread counts.
THREADS_HISTORY = ("SELECT action = 'scheduler_start', arrayMap(x -> toFloat64(x), "
                   "total_nthreads.time), total_nthreads.nthreads FROM {lifecycle} WHERE cluster_id = "
                   "{{c:String}} AND notEmpty(total_nthreads.time) ORDER BY ts")


def _history(backend: Backend, cluster_id: str) -> tuple[list[float], list[int]]:
    """The cluster's ``Scheduler.total_nthreads_history`` as recorded (scheduler_start
    carries it whole, later lifecycle events the entries appended since)."""
    _, rows = backend.query(
        THREADS_HISTORY.format(lifecycle=table(backend, 'lifecycle')), {"c": cluster_id})
    times: list[float] = []
    counts: list[int] = []
    for whole, ts, ns in rows:
        if whole:
            times, counts = [], []
        for t, n in zip(ts, ns):
            if not times or t >= times[-1]:
                if times and t == times[-1] and n == counts[-1]:
                    continue
                times.append(t)
                counts.append(int(n))
    return times, counts


def active_cpu_seconds(times: list[float], counts: list[int], enqueued: float, stop: float) -> float:
    """Dask's ``Span.active_cpu_seconds`` of a done span: the integral of the
    cluster's thread count from ``enqueued`` to ``stop``, the count starting at the
    last history entry at or before ``enqueued`` (``Span._total_nthreads_offset``)."""
    if not times or stop <= enqueued:
        return 0.0
    first = max(bisect.bisect_right(times, enqueued) - 1, 0)
    out, t, n = 0.0, enqueued, counts[first] if times[first] <= enqueued else 0
    for i in range(first, len(times)):
        if times[i] <= enqueued:
            n = counts[i]
            continue
        if times[i] >= stop:
            break
        out += (times[i] - t) * n
        t, n = times[i], counts[i]
    return out + (stop - t) * n


#: The workers' arrivals and departures (and the scheduler's starts) in time order: the
#: worker, what, when, its threads, the cluster's thread counts.
WORKER_LIVES = ("SELECT worker, action, toFloat64(ts), JSONExtractInt(detail, 'nthreads'), "
                "total_nthreads.nthreads FROM {lifecycle} WHERE cluster_id = {{c:String}} AND "
                "(action IN ('worker_added', 'worker_removed') AND worker != '' OR action = "
                "'scheduler_start') ORDER BY ts")


def _workers(backend: Backend, cluster_id: str) -> dict[str, list[_Worker]]:
    """Each worker's lives: threads, when it joined and left (None: never left).

    A worker's threads are those its worker_added event names, else the step its
    arrival or departure made in the cluster's thread count (``total_nthreads``). A
    worker already there when the recording began (no worker_added) joined, for
    these purposes, when the recording began."""
    _, rows = backend.query(
        WORKER_LIVES.format(lifecycle=table(backend, 'lifecycle')), {"c": cluster_id})
    lives: dict[str, list[_Worker]] = defaultdict(list)
    began, running = None, 0
    for worker, action, ts, nthreads, counts in rows:
        counts = [int(n) for n in counts]
        before = counts[-2] if len(counts) > 1 else running
        step = abs(counts[-1] - before) if counts else 0
        running = counts[-1] if counts else running
        if action == "scheduler_start":
            began = ts if began is None else began
        elif action == "worker_added":
            lives[worker].append(_Worker(int(nthreads or step), ts, None))
        elif lives[worker] and lives[worker][-1].left is None:
            life = lives[worker][-1]
            lives[worker][-1] = life._replace(left=ts, nthreads=life.nthreads or step)
        elif not lives[worker]:
            lives[worker].append(_Worker(step, began if began is not None else ts, ts))
    return lives


#: Per window (``w0``..``w1``, its span ``ids``) and worker: the compute seconds inside it.
COMPUTE_IN_WINDOWS = ("SELECT w.3 AS span, worker, sum(least(e, w.2) - greatest(s, w.1)) FROM "
                      "(SELECT worker, toFloat64(ss.start) AS s, toFloat64(ss.stop) AS e FROM "
                      "{transitions} ARRAY JOIN startstops AS ss WHERE cluster_id = {{c:String}} "
                      "AND source = 'scheduler' AND start = 'processing' AND ss.action = "
                      "'compute') ARRAY JOIN arrayZip({{w0:Array(Float64)}}, "
                      "{{w1:Array(Float64)}}, {{ids:Array(String)}}) AS w WHERE s < w.2 AND e > "
                      "w.1 GROUP BY span, worker")


def _busy_in_windows(backend: Backend, cluster_id: str,
                     windows: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """span_id -> worker -> compute seconds of any task inside the span's window."""
    if not windows:
        return {}
    _, rows = backend.query(
        COMPUTE_IN_WINDOWS.format(transitions=table(backend, 'transitions')),
        {"c": cluster_id, "w0": [w[1] for w in windows], "w1": [w[2] for w in windows],
         "ids": [w[0] for w in windows]})
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for span_id, worker, seconds in rows:
        out[span_id][worker] = float(seconds)
    return out


def _offered_by_worker(lives: dict[str, list[_Worker]], w0: float, w1: float,
                       end: float) -> dict[str, float]:
    out = {}
    for worker, spans in lives.items():
        seconds = sum(max(0.0, min(w1, life.left if life.left is not None else end)
                          - max(w0, life.joined)) * life.nthreads for life in spans)
        if seconds > 0:
            out[worker] = seconds
    return out


# ---------------------------------------------------------------------- spans


#: Every span of the clusters ``ids``: its name, parent and when it was enqueued.
SPANS_OF_CLUSTERS = ("SELECT cluster_id, span_id, any(name), any(parent_id), toFloat64(min(enqueued)) "
                     "FROM {spans} WHERE cluster_id IN {{ids:Array(String)}} GROUP BY cluster_id, "
                     "span_id")
#: Per span of the clusters ``ids``: its own tasks' earliest compute start and latest stop.
SPAN_COMPUTE_BOUNDS = ("SELECT cluster_id, span_id, toFloat64(min(ss.start)), toFloat64(max(ss.stop)) "
                       "FROM {transitions} ARRAY JOIN startstops AS ss WHERE cluster_id IN "
                       "{{ids:Array(String)}} AND source = 'scheduler' AND start = 'processing' AND "
                       "ss.action = 'compute' GROUP BY cluster_id, span_id")


def _span_tree(backend: Backend, cluster_ids: Sequence[str]) -> list[dict]:
    """Every span of the clusters: id, name, parent, enqueued, and its own tasks'
    earliest compute start and latest compute stop."""
    p = {"ids": list(cluster_ids)}
    _, spans = backend.query(SPANS_OF_CLUSTERS.format(spans=table(backend, 'spans')), p)
    _, times = backend.query(
        SPAN_COMPUTE_BOUNDS.format(transitions=table(backend, 'transitions')), p)
    own = {(c, s): (a, b) for c, s, a, b in times}
    return [{"cluster_id": c, "span_id": s, "name": tuple(name), "parent_id": parent or "",
             "enqueued": enqueued, "own": own.get((c, s))}
            for c, s, name, parent, enqueued in spans]


def descendants(spans: list[dict]) -> dict[tuple[str, str], set[str]]:
    """(cluster_id, span_id) -> the span ids of its tree (itself included)."""
    children: dict[tuple[str, str], list[str]] = defaultdict(list)
    for s in spans:
        if s["parent_id"]:
            children[(s["cluster_id"], s["parent_id"])].append(s["span_id"])
    out = {}
    for s in spans:
        tree, todo = set(), [s["span_id"]]
        while todo:
            sid = todo.pop()
            if sid not in tree:
                tree.add(sid)
                todo.extend(children[(s["cluster_id"], sid)])
        out[(s["cluster_id"], s["span_id"])] = tree
    return out


def span_costs(backend: Backend, cluster_ids: Sequence[str],
               found: dict[tuple[str, str, str], Measures] | None = None,
               windows_for: set[str] | None = None) -> list[SpanCost]:
    """The cost of every span tree of the clusters. ``found``: :func:`measures`, if
    already read. Idle threads are computed for the spans in ``windows_for`` (default:
    every span, up to :data:`IDLE_SPANS` per cluster; None for the others)."""
    found = measures(backend, cluster_ids) if found is None else found
    spans = _span_tree(backend, cluster_ids)
    trees = descendants(spans)
    per_span: dict[tuple[str, str], list[Measures]] = defaultdict(list)
    for (c, s, _), m in found.items():
        per_span[(c, s)].append(m)
    own = {k: total(v) for k, v in per_span.items()}
    graphed = {c for (c, _, _), m in found.items() if m.moved_bytes is not None}
    metered = {c for (c, _, _), m in found.items() if m.cpu_s is not None}
    by_cluster: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by_cluster[s["cluster_id"]].append(s)
    out = []
    for cluster_id, members in by_cluster.items():
        times, counts = _history(backend, cluster_id)
        lives = _workers(backend, cluster_id)
        end = max([life.left or life.joined for ls in lives.values() for life in ls] + [0.0])
        rows = []
        for s in members:
            tree = trees[(cluster_id, s["span_id"])]
            mine = [x for x in members if x["span_id"] in tree and x["own"]]
            start = min((x["own"][0] for x in mine), default=None)
            stop = max((x["own"][1] for x in mine), default=None)
            if start is not None and s["enqueued"]:
                start, stop = max(start, s["enqueued"]), max(stop, s["enqueued"])
            m = total(own.get((cluster_id, sid), Measures()) for sid in tree)
            if cluster_id not in graphed:
                m = m._replace(moved_bytes=None)
            if cluster_id not in metered:
                m = m._replace(cpu_s=None, busy_s=None, spilled_bytes=None)
            rows.append((s, m, start, stop))
        wanted = [(s["span_id"], s["enqueued"], stop) for s, _, _, stop in rows
                  if stop is not None and s["enqueued"]
                  and (windows_for is None or s["span_id"] in windows_for)][:IDLE_SPANS]
        busy = _busy_in_windows(backend, cluster_id, wanted)
        windowed = {w[0] for w in wanted}
        for s, m, start, stop in rows:
            offered = idle = None
            who: dict[str, float] = {}
            if stop is not None and s["enqueued"] and times:
                offered = active_cpu_seconds(times, counts, s["enqueued"], stop)
            if s["span_id"] in windowed:
                offered_w = _offered_by_worker(lives, s["enqueued"], stop, max(end, stop))
                used = busy.get(s["span_id"], {})
                who = {w: max(0.0, o - used.get(w, 0.0)) for w, o in offered_w.items()}
                who = dict(sorted(((w, v) for w, v in who.items() if v > 0),
                                  key=lambda kv: -kv[1]))
                if offered is not None:
                    idle = max(0.0, min(offered, offered - sum(used.values())))
            out.append(SpanCost(cluster_id, s["span_id"], s["name"], s["parent_id"], m,
                                s["enqueued"], start, stop, offered, idle, who))
    return out
