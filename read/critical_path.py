"""The critical path of a recorded run or span: the chain of dependent task actions
that determined its wall time, each link split into what it waited on.

Definition. The scope is one cluster's tasks (optionally those of a span tree and/or
a window) that *finished*: a scheduler transition from ``processing`` to ``memory``
or ``erred`` carrying the worker's ``startstops`` with a compute. Its window is
Dask's: ``t0`` is the earliest compute start (for a span, at least its ``enqueued``:
``Span.start``), ``t1`` the latest compute stop (``Span.stop``). A task's *arrival*
is the time the scheduler put its result in memory (the transition's ``ts``).

The walk goes from finish to finish: a key computed twice (reused across
``compute()`` calls, or run again after a death lost it) has a finish each time. It
starts at the finish whose compute ended last and goes back, at each step to the
dependency whose result *arrived last* before that finish, and to that arrival of it
(the compute that fed this one, not a later recomputation), as long as that
dependency is in the scope. The dependencies come from

- the recorded graph (``graph_tasks``) where the task's submission was recorded with
  all its dependencies (``found_by="graph"``; a task with no dependency that arrived
  in time is a root: ``"root"``);
- otherwise the actions alone: the scheduler moved a task from waiting to
  processing in the same stimulus (``stimulus_id``) that put the dependency which
  released it in memory -- Dask runs a task as soon as its last dependency arrives,
  so that transition names exactly the dependency we want (``"stimulus"``). A task
  that left the scheduler's queue, or was released by the client's submission,
  names no dependency (``"not proven"``): the walk stops there, and says so. A first
  link whose last dependency lies outside the scope is ``"outside"``.

The links cover ``[t0, t1]`` without gap or overlap: a link ends when its task's result
reached the scheduler (the last link: at ``t1``), and the next begins there. Its
time is split into

``client``        the task did not exist yet: the client submitted it later;
``dependencies``  its last dependency was not part of the path (outside the span,
                  or the walk stopped) and had not arrived yet;
``scheduler``     from the previous result's arrival until the scheduler sent this
                  task to a worker: its bookkeeping and its queue (``queued`` tasks
                  wait here);
``lost``          from its first attempt to the attempt that finished, when an
                  earlier one was lost (its worker died while running it) and the
                  task ran again; and, for a task computed again because its result
                  was lost, the time before it was resubmitted;
``transfer``      fetching dependencies from other workers (the union of its transfers);
``disk``          reading spilled dependencies before, and writing its result after, compute;
``thread``        the rest of its time on the worker: waiting for a free thread, and
                  the messages to and from the scheduler;
``compute``       its compute (and any other action the worker reported for it).

Boundaries are scheduler times, and the worker's parts are durations its own clock
measured: two workers' clocks (Dask corrects each by an estimate, ``scheduler_delay``)
never disagree inside a link. The first and last links meet the window's ends, which
are worker times like Dask's; were a worker's reported work longer than the link, its
parts shrink in proportion (``thread`` first). The parts of all links add up to
``t1 - t0`` exactly.

How it runs: one SQL statement computes, in ClickHouse, every finished task's
predecessor (the argMax of its dependencies' arrivals, a hash join of the graph
with the arrivals, or the stimulus join) and returns them as arrays of 64-bit key
hashes; Python follows the pointers (one step per link) and one more statement
fetches the transitions of the path's keys only. Anomalies of the recorded graph are
reported, never raised: dependencies that name a task never recorded (dangling),
and dependencies that finished after their dependent (a cycle in the recorded graph
-- a cycle is shown when one is found -- or a dependency recomputed later).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table
from dask_blackbox.read.path_parts import (_FOUND_CODE, EXAMPLES, FOUND_BY, PARTS, CriticalPath,
                                           GraphIssues, Link, NoActions, Segment, _Task,
                                           link_segments)

#: The parts of a path, named here too (:mod:`.path_parts`).
__all__ = ["PARTS", "FOUND_BY", "CriticalPath", "GraphIssues", "Link", "NoActions", "Segment",
           "link_segments", "graph_issues", "critical_path"]

#: Nodes a cycle search may visit (each level is one SQL statement).
CYCLE_SEARCH_NODES = 5_000


# ------------------------------------------------------------------------- SQL


def _scope(cluster_id: str, span_ids: Sequence[str] | None, since: float | None,
           until: float | None) -> tuple[str, dict]:
    """Conditions on transitions selecting the scope's finishing transitions."""
    where = ["cluster_id = {c:String}", "source = 'scheduler'", "start = 'processing'",
             "finish IN ('memory', 'erred')", "has(startstops.action, 'compute')"]
    p: dict = {"c": cluster_id}
    if span_ids is not None:
        where.append("span_id IN {ids:Array(String)}")
        p["ids"] = list(span_ids)
    if since is not None:
        where.append("ts >= toDateTime64({since:Float64}, 6, 'UTC')")
        p["since"] = since
    if until is not None:
        where.append("ts < toDateTime64({until:Float64}, 6, 'UTC')")
        p["until"] = until
    return " AND ".join(where), p


#: A graph row whose dependencies were all recorded (a task's list stops at 3,000;
#: ``n_dependencies`` is the true count, 0 in rows recorded before it was).
_WHOLE = "length(dependencies) >= n_dependencies"


#: The finished tasks of the scope ``{scope}`` (in the transitions ``{t}``), and those whose
#: graph row (in ``{g}``) holds all its dependencies (``{_WHOLE}``).
COVERAGE = ("SELECT count(), countIf(kh IN (SELECT cityHash64(key) FROM {g} WHERE cluster_id "
            "= {{c:String}} AND {_WHOLE})) FROM (SELECT DISTINCT cityHash64(key) AS kh FROM "
            "{t} WHERE {scope})")


def _coverage(backend: Backend, scope: str, p: dict) -> tuple[int, int]:
    """(finished tasks in the scope, those whose graph row, with all its
    dependencies, was recorded)."""
    t, g = table(backend, "transitions"), table(backend, "graph_tasks")
    _, rows = backend.query(COVERAGE.format(g=g, _WHOLE=_WHOLE, t=t, scope=scope), p)
    return int(rows[0][0]), int(rows[0][1])


#: Per finish of a task (``fin`` of the common table expressions ``{ctes}``): the
#: predecessor that fed it (``{pred}``), how it is known (``{how}``) and when that one
#: arrived (``{arrived}``), joined from ``{joins}``; with the scope's first start, last
#: end and the finish that ended last.
PREDECESSORS = (
    "WITH {ctes} "
    "SELECT groupArray(kh), groupArray(arrived), groupArray(pred), groupArray(how), "
    "groupArray(pred_arrived), min(begin_s), max(end_s), argMax((kh, arrived), end_s) FROM ("
    "SELECT fin.kh AS kh, toFloat64(fin.arrived) AS arrived, {pred} AS pred, {how} AS how, "
    "{arrived} AS pred_arrived, fin.begin_s AS begin_s, fin.end_s AS end_s FROM fin{joins}) "
    "SETTINGS join_use_nulls = 0")


def _predecessors_sql(backend: Backend, scope: str, graph: bool, actions: bool) -> str:
    """One row: the scope's key hashes, each one's predecessor hash (0: none),
    how it was found (codes of :data:`_FOUND_CODE`), the predecessor's arrival, and
    the window and the last task."""
    t, g = table(backend, "transitions"), table(backend, "graph_tasks")
    ctes = [
        # the scope's tasks: each one's last finish
        # every finish of the scope's tasks (a key computed twice is two of them)
        f"fin AS (SELECT cityHash64(key) AS kh, ts AS arrived, toFloat64(any("
        "arrayMax(arrayFilter((e, a) -> a = 'compute', startstops.stop, startstops.action)))) "
        "AS end_s, toFloat64(any(arrayMin(arrayFilter((b, a) -> a = 'compute', "
        f"startstops.start, startstops.action)))) AS begin_s FROM {t} WHERE {scope} GROUP BY kh, ts)",
    ]
    if graph:
        ctes += [
            # every arrival in memory of each key of the cluster
            f"arr AS (SELECT DISTINCT cityHash64(key) AS dh, ts AS arrived FROM {t} "
            "WHERE cluster_id = {c:String} AND source = 'scheduler' AND finish = 'memory')",
            # the scope's finishes alone (fin without its arrays: cheaper to read twice)
            f"done AS (SELECT DISTINCT cityHash64(key) AS kh, ts AS arrived FROM {t} "
            f"WHERE {scope})",
            f"graphed AS (SELECT DISTINCT cityHash64(key) AS kh FROM {g} "
            f"WHERE cluster_id = {{c:String}} AND {_WHOLE})",
            # per finish, the dependency that arrived last before it: the compute of
            # that dependency that fed this one (an arrival after it fed a later one)
            "gp AS (SELECT e.kh AS kh, f.arrived AS arrived, argMax(e.dh, a.arrived) AS pred, "
            "toFloat64(max(a.arrived)) AS pred_arrived FROM ("
            "SELECT DISTINCT cityHash64(key) AS kh, cityHash64(arrayJoin(dependencies)) AS dh "
            f"FROM {g} WHERE cluster_id = {{c:String}}) AS e "
            "INNER JOIN done AS f ON f.kh = e.kh INNER JOIN arr AS a ON a.dh = e.dh "
            "WHERE a.arrived < f.arrived GROUP BY e.kh, f.arrived)",
        ]
    if actions and not graph:  # the scope's finishes, for rel
        ctes.append(f"done AS (SELECT DISTINCT cityHash64(key) AS kh, ts AS arrived FROM {t} "
                    f"WHERE {scope})")
    if actions:
        ctes += [
            # the stimulus that last moved each task from waiting to processing
            # before a finish of it (a record that has none before: its latest) ...
            "rel AS (SELECT r.kh AS kh, f.arrived AS arrived, "
            "argMax(r.sh, (r.ts <= f.arrived, r.ts)) AS sh FROM ("
            "SELECT cityHash64(key) AS kh, ts, cityHash64(stimulus_id) AS sh "
            f"FROM {t} WHERE cluster_id = {{c:String}} AND source = 'scheduler' "
            "AND start = 'waiting' AND finish = 'processing') AS r "
            "INNER JOIN done AS f ON f.kh = r.kh GROUP BY r.kh, f.arrived)",
            # ... is the one that put the dependency releasing it in memory
            f"fs AS (SELECT cityHash64(stimulus_id) AS sh, argMax(cityHash64(key), ts) AS pred, "
            f"toFloat64(max(ts)) AS pred_arrived FROM {t} "
            "WHERE cluster_id = {c:String} AND source = 'scheduler' AND start = 'processing' "
            "AND finish = 'memory' AND stimulus_id != '' GROUP BY sh)",
            "sp AS (SELECT rel.kh AS kh, rel.arrived AS arrived, fs.pred AS pred, "
            "fs.pred_arrived AS pred_arrived FROM rel INNER JOIN fs ON fs.sh = rel.sh)",
        ]
    joins, pred, how, arrived = "", "toUInt64(0)", "toUInt8(4)", "toFloat64(0)"
    if graph:
        joins += " LEFT JOIN gp ON gp.kh = fin.kh AND gp.arrived = fin.arrived"
        g_has = "fin.kh IN (SELECT kh FROM graphed)"
        g_pred, g_how = "gp.pred", "if(gp.pred != 0, 1, 2)"
    if actions:
        joins += " LEFT JOIN sp ON sp.kh = fin.kh AND sp.arrived = fin.arrived"
        a_pred, a_how = "sp.pred", "if(sp.pred != 0, 3, 4)"
    if graph and actions:
        pred = f"if({g_has}, {g_pred}, {a_pred})"
        how = f"if({g_has}, {g_how}, {a_how})"
        arrived = f"if({g_has}, gp.pred_arrived, sp.pred_arrived)"
    elif graph:
        pred, how, arrived = g_pred, g_how, "gp.pred_arrived"
    elif actions:
        pred, how, arrived = a_pred, a_how, "sp.pred_arrived"
    return PREDECESSORS.format(ctes=", ".join(ctes), pred=pred, how=how, arrived=arrived,
                               joins=joins)


class _Pointers(NamedTuple):
    """One entry per finish of a task in the scope (a key computed twice has two),
    sorted by key hash, then arrival."""

    keys: np.ndarray          # uint64
    arrived: np.ndarray       # float64: when that finish reached the scheduler
    preds: np.ndarray         # uint64, 0 = none
    how: np.ndarray           # uint8 codes
    pred_arrived: np.ndarray  # float64: which finish of the predecessor fed this one
    t0: float
    t1: float
    last: tuple[int, float]   # the finish that ended last: (key hash, arrival)

    def find(self, kh: int, arrived: float) -> int | None:
        """The index of the finish of ``kh`` that arrived at ``arrived``, or None."""
        lo = int(np.searchsorted(self.keys, np.uint64(kh), "left"))
        hi = int(np.searchsorted(self.keys, np.uint64(kh), "right"))
        if lo == hi:
            return None
        times = self.arrived[lo:hi]
        j = int(np.argmin(np.abs(times - arrived)))
        return lo + j if abs(times[j] - arrived) < 1e-5 else None

    def node(self, i: int) -> tuple[int, float]:
        return int(self.keys[i]), float(self.arrived[i])


def _pointers(backend: Backend, scope: str, p: dict, graph: bool, actions: bool) -> _Pointers:
    _, rows = backend.query(_predecessors_sql(backend, scope, graph, actions), p)
    keys, arrived, preds, how, pred_arrived, t0, t1, last = rows[0]
    keys = np.asarray(keys, dtype=np.uint64)
    arrived = np.asarray(arrived, dtype=np.float64)
    # groupArray keeps no order across ClickHouse's threads: sort here, once
    order = np.lexsort((arrived, keys))
    last = (int(last[0]), float(last[1])) if last else (0, 0.0)
    return _Pointers(keys[order], arrived[order], np.asarray(preds, dtype=np.uint64)[order],
                     np.asarray(how, dtype=np.uint8)[order],
                     np.asarray(pred_arrived, dtype=np.float64)[order],
                     float(t0 or 0.0), float(t1 or 0.0), last)


def _walk(ptr: _Pointers) -> tuple[list[int], bool]:
    """Indexes into ``ptr.keys`` from the last finish back to the path's first, and
    whether the walk stopped because arrivals stopped going back in time (a recorded
    stimulus id repeated, say): a path is only ever followed into the past. Each step
    goes to the finish of the predecessor that fed this one."""
    i = ptr.find(*ptr.last)
    if i is None:
        i = int(np.searchsorted(ptr.keys, np.uint64(ptr.last[0])))
    path = [i]
    while True:
        pred = ptr.preds[i]
        if not pred:
            return path, False
        j = ptr.find(int(pred), float(ptr.pred_arrived[i]))
        if j is None:  # outside the scope
            return path, False
        if ptr.preds[j] and not ptr.pred_arrived[j] < ptr.pred_arrived[i]:
            return path + [j], True
        path.append(j)
        i = j


# ---------------------------------------------------------------------- links


#: What :func:`_tasks` reads (from ``{transitions}``).
TASKS = ("SELECT cityHash64(key) AS kh, key, toFloat64(ts), start, finish, stimulus_id, "
         "worker, prefix, span_id, startstops.action, arrayMap(x -> toFloat64(x), "
         "startstops.start), arrayMap(x -> toFloat64(x), startstops.stop) FROM {transitions} "
         "WHERE cluster_id = {{c:String}} AND source = 'scheduler' AND kh IN "
         "{{hs:Array(UInt64)}} ORDER BY kh, ts, seq, idx")


def _tasks(backend: Backend, cluster_id: str,
           nodes: list[tuple[int, float]]) -> dict[tuple[int, float], _Task]:
    """Each finish ``(key hash, arrival)``'s task, read from the transitions of that
    occurrence: since the key's previous finish, until this one."""
    hashes = sorted({kh for kh, _ in nodes})
    _, rows = backend.query(
        TASKS.format(transitions=table(backend, 'transitions')),
        {"c": cluster_id, "hs": hashes})
    by_key: dict[int, list] = {}
    for row in rows:
        by_key.setdefault(int(row[0]), []).append(row[1:])
    out = {}
    for kh, at in nodes:
        story = by_key.get(kh, [])
        finishes = [r for r in story if r[2] == "processing" and r[3] in ("memory", "erred")
                    and "compute" in r[8]]
        if not finishes:
            continue
        fin = min(finishes, key=lambda r: abs(r[1] - at))
        arrived = fin[1]
        previous = max((r[1] for r in finishes if r[1] < arrived), default=-float("inf"))
        entries = [r[1] for r in story if r[3] == "processing" and previous < r[1] <= arrived]
        entered = max(entries, default=arrived)
        first_entered = min(entries, default=entered)
        submitted = max((r[1] for r in story if r[2] == "released" and previous < r[1] <= first_entered),
                        default=min(r[1] for r in story))
        actions = sorted(zip(fin[8], fin[9], fin[10]), key=lambda a: a[1])
        window = [r for r in story if submitted <= r[1] <= arrived]
        out[(kh, at)] = _Task(fin[0], fin[6] or "", fin[5] or "", fin[7] or "", arrived, entered,
                              submitted, actions, tuple((r[1], r[2], r[3], r[4]) for r in window),
                              first_entered, previous > -float("inf"))
    return out


def _links(path: list[int], ptr: _Pointers, tasks: dict[tuple[int, float], _Task],
           stopped: bool = False) -> tuple[list[Link], tuple[int, float] | None]:
    """The path's links, first link first, contiguous from ``ptr.t0`` to ``ptr.t1``;
    and the key hash of the dependency outside the path that the first link waited on.
    ``stopped``: the walk stopped at the first link (its predecessor is not followed)."""
    chain = [(i, tasks[ptr.node(i)]) for i in reversed(path) if ptr.node(i) in tasks]
    links: list[Link] = []
    previous: _Task | None = None
    waited_on = None
    position = ptr.t0
    for n, (i, task) in enumerate(chain):
        last = n == len(chain) - 1
        found_by = _FOUND_CODE.get(int(ptr.how[i]), "not proven")
        if previous is not None:
            ready, part = previous.arrived, "scheduler"
        elif stopped:
            found_by, ready, part = "not proven", None, "client"
        elif ptr.preds[i]:
            found_by, waited_on = "outside", (int(ptr.preds[i]), float(ptr.pred_arrived[i]))
            ready, part = float(ptr.pred_arrived[i]), "dependencies"
        else:
            ready, part = None, "client"
        stop = max(position, ptr.t1 if last else task.arrived)
        segments = link_segments(task, position, stop, ready, part, last)
        links.append(Link(task.key, task.prefix, task.worker, task.span_id, found_by,
                          position, stop, tuple(segments), *task.compute, task.evidence))
        previous, position = task, stop
    return links, waited_on


# -------------------------------------------------------------------- anomalies


#: What :func:`graph_issues` reads (the transitions ``{t}``, the graph ``{g}``;
#: ``{span_filter}``:
#: the spans).
GRAPH_ISSUES = ("WITH seen AS (SELECT cityHash64(key) AS h, minIf(ts, finish = 'memory') AS "
                "arrived, countIf(finish = 'memory') > 0 AS done FROM {t} WHERE cluster_id = "
                "{{c:String}} AND source = 'scheduler' GROUP BY h), edges AS (SELECT key, dep "
                "FROM {g} ARRAY JOIN dependencies AS dep WHERE cluster_id = {{c:String}} "
                "{span_filter}) SELECT countIf(d.h = 0) AS dangling, "
                "groupArrayIf({{n:UInt32}})((key, dep), d.h = 0), countIf(d.done AND k.done "
                "AND d.arrived >= k.arrived) AS backwards, groupArrayIf({{n:UInt32}})((key, "
                "dep), d.done AND k.done AND d.arrived >= k.arrived) FROM edges LEFT JOIN "
                "seen AS d ON d.h = cityHash64(edges.dep) LEFT JOIN seen AS k ON k.h = "
                "cityHash64(edges.key) SETTINGS join_use_nulls = 0")


def graph_issues(backend: Backend, cluster_id: str, span_ids: Sequence[str] | None = None) -> GraphIssues:
    """Dangling and backward dependencies of the cluster's recorded graph (those of
    the span tree's tasks when ``span_ids``), and a cycle through a backward one if
    there is one (searched breadth-first, at most :data:`CYCLE_SEARCH_NODES` keys)."""
    t, g = table(backend, "transitions"), table(backend, "graph_tasks")
    p: dict = {"c": cluster_id, "n": EXAMPLES}
    span_filter = ""
    if span_ids is not None:
        span_filter = "AND span_id IN {ids:Array(String)}"
        p["ids"] = list(span_ids)
    _, rows = backend.query(
        # a dependency is backwards when not even its first result came before its
        # dependent's first (a key computed again later fed later computations only)
        GRAPH_ISSUES.format(t=t, g=g, span_filter=span_filter), p)
    n_dangling, dangling, n_backwards, backwards = rows[0]
    dangling = tuple((str(a), str(b)) for a, b in dangling)
    backwards = tuple((str(a), str(b)) for a, b in backwards)
    cycle: tuple[str, ...] = ()
    for key, dep in backwards:
        found = _find_path(backend, cluster_id, dep, key)
        if found:
            cycle = (key, *found)
            break
    return GraphIssues(dangling, int(n_dangling), backwards, int(n_backwards), cycle)


#: What :func:`_find_path` reads (from ``{graph_tasks}``).
FIND_PATH = ("SELECT key, dependencies FROM {graph_tasks} WHERE cluster_id = {{c:String}} AND "
             "key IN {{keys:Array(String)}}")


def _find_path(backend: Backend, cluster_id: str, source: str, target: str) -> tuple[str, ...]:
    """Keys from ``source`` to ``target`` along recorded dependencies, or ()."""
    parent: dict[str, str | None] = {source: None}
    frontier = [source]
    while frontier and len(parent) < CYCLE_SEARCH_NODES:
        _, rows = backend.query(
            FIND_PATH.format(graph_tasks=table(backend, 'graph_tasks')),
            {"c": cluster_id, "keys": frontier})
        nxt = []
        for key, deps in rows:
            for dep in deps:
                if dep in parent:
                    continue
                parent[dep] = key
                if dep == target:
                    out = [dep]
                    while parent[out[-1]] is not None:
                        out.append(parent[out[-1]])
                    return tuple(reversed(out))
                nxt.append(dep)
        frontier = nxt
    return ()


# ------------------------------------------------------------------------ entry


#: What :func:`critical_path` reads (from ``{spans}``).
CRITICAL_PATH = ("SELECT toFloat64(min(enqueued)) FROM {spans} WHERE cluster_id = "
                 "{{c:String}} AND span_id IN {{ids:Array(String)}}")


def critical_path(backend: Backend, cluster_id: str, span_ids: Sequence[str] | None = None,
                  since: float | None = None, until: float | None = None,
                  span: str | None = None, check_graph: bool = True) -> CriticalPath:
    """The critical path of the cluster's run (or of the span tree ``span_ids``, whose
    name ``span`` is only carried along), optionally within [since, until).
    :class:`NoActions` when no task of the scope finished with recorded actions.
    ``check_graph``: also look for anomalies of the recorded graph (one more pass)."""
    scope, p = _scope(cluster_id, span_ids, since, until)
    n_tasks, n_graphed = _coverage(backend, scope, p)
    what = f"span {span!r}" if span else "the run"
    if not n_tasks:
        raise NoActions(f"no task of {what} in cluster {cluster_id} finished with recorded "
                        "actions (startstops): there is no path to show")
    graph, actions = n_graphed > 0, n_graphed < n_tasks
    ptr = _pointers(backend, scope, p, graph, actions)
    if span_ids is not None:  # like Span.start: not before the span was enqueued
        _, rows = backend.query(CRITICAL_PATH.format(spans=table(backend, 'spans')), p)
        enqueued = float(rows[0][0] or 0.0) if rows else 0.0
        if enqueued > ptr.t0:
            ptr = ptr._replace(t0=min(enqueued, ptr.t1))
    path, stopped = _walk(ptr)
    first = path[-1]
    tasks = _tasks(backend, cluster_id, [ptr.node(i) for i in path]
                   + [(int(ptr.preds[first]), float(ptr.pred_arrived[first]))] * bool(ptr.preds[first]))
    links, waited_on = _links(path, ptr, tasks, stopped)
    outside = tasks.get(waited_on) if waited_on is not None else None
    issues = graph_issues(backend, cluster_id, span_ids) if (check_graph and graph) else GraphIssues()
    basis = "graph" if not actions else "actions" if not graph else "graph and actions"
    return CriticalPath(cluster_id, span, ptr.t0, ptr.t1, tuple(links), n_tasks, n_graphed,
                        basis, issues, outside.key if outside else None, stopped)
