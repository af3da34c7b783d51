"""The critical path of a recorded run or span: the chain of dependent task actions
that determined its wall time, each link split into what it waited on.

Definition. The scope is one cluster's tasks (optionally those of a span tree and/or
a window) that *finished*: a scheduler transition from ``processing`` to ``memory``
or ``erred`` carrying the worker's ``startstops`` with a compute. Its window is
Dask's: ``t0`` is the earliest compute start (for a span, at least its ``enqueued``:
``Span.start``), ``t1`` the latest compute stop (``Span.stop``). A task's *arrival*
is the time the scheduler put its result in memory (the transition's ``ts``).

The walk starts at the task whose compute finished last and goes back, at each step to
the dependency whose result *arrived last* (of those that arrived before the task
itself did; a dependency recomputed later does not count), as long as that dependency
is in the scope. The dependencies come from

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

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table

#: The parts of a link, in the order they happen.
PARTS = ("client", "dependencies", "scheduler", "transfer", "disk", "thread", "compute")
#: How a link's predecessor was found (see the module docstring).
FOUND_BY = ("graph", "root", "stimulus", "not proven", "outside")
_FOUND_CODE = {1: "graph", 2: "root", 3: "stimulus", 4: "not proven"}
#: Graph anomalies shown by example (at most this many each).
EXAMPLES = 5
#: Nodes a cycle search may visit (each level is one SQL statement).
CYCLE_SEARCH_NODES = 5_000


class NoActions(LookupError):
    """The scope holds no task that finished with recorded actions; the message says
    which scope."""


class Segment(NamedTuple):
    """A stretch of a link: ``part`` (one of :data:`PARTS`) from ``start`` to ``stop``."""

    part: str
    start: float
    stop: float


@dataclasses.dataclass(frozen=True)
class Link:
    """One task on the path and the time that led to its end."""

    key: str
    prefix: str
    worker: str
    span_id: str
    #: how its predecessor (the previous link, or the dependency outside the path) was found
    found_by: str
    #: the link covers [start, stop]: from the previous link's end to this one's
    start: float
    stop: float
    segments: tuple[Segment, ...]
    #: the task's compute as its worker reported it (where the task stream draws it)
    compute_start: float
    compute_stop: float
    #: the transitions the link is read from: (ts, start, finish, stimulus_id)
    evidence: tuple[tuple, ...]

    @property
    def seconds(self) -> float:
        return self.stop - self.start

    @property
    def parts(self) -> dict[str, float]:
        """Seconds per part (every part of :data:`PARTS`, zeros included)."""
        out = dict.fromkeys(PARTS, 0.0)
        for s in self.segments:
            out[s.part] += s.stop - s.start
        return out

    def as_dict(self) -> dict:
        return {"key": self.key, "prefix": self.prefix, "worker": self.worker,
                "span_id": self.span_id, "found_by": self.found_by, "start": self.start,
                "stop": self.stop, "seconds": self.seconds, "parts": self.parts,
                "segments": [s._asdict() for s in self.segments],
                "compute_start": self.compute_start, "compute_stop": self.compute_stop,
                "evidence": [{"ts": ts, "start": a, "finish": b, "stimulus_id": s}
                             for ts, a, b, s in self.evidence]}


@dataclasses.dataclass(frozen=True)
class GraphIssues:
    """What the recorded graph says that cannot be true."""

    #: dependencies naming a task the cluster never recorded: (key, dependency)
    dangling: tuple[tuple[str, str], ...] = ()
    n_dangling: int = 0
    #: dependencies whose result arrived after their dependent's: (key, dependency)
    backwards: tuple[tuple[str, str], ...] = ()
    n_backwards: int = 0
    #: a cycle of the recorded graph, if one was found: keys, first repeated last
    cycle: tuple[str, ...] = ()

    def notes(self) -> list[str]:
        out = []
        if self.cycle:
            out.append("the recorded graph has a cycle (" + " -> ".join(self.cycle)
                       + "); Dask cannot have run it as recorded: its dependencies were "
                       "followed only where their results arrived before their dependent's")
        if self.n_backwards and not self.cycle:
            k, d = self.backwards[0]
            out.append(f"{self.n_backwards:,} recorded dependencies finished after their "
                       f"dependent (e.g. {k!r} on {d!r}): recomputed later, or a wrong graph; "
                       "not followed")
        if self.n_dangling:
            k, d = self.dangling[0]
            out.append(f"{self.n_dangling:,} recorded dependencies name a task this cluster "
                       f"never recorded (e.g. {k!r} on {d!r}); treated as already there")
        return out


@dataclasses.dataclass(frozen=True)
class CriticalPath:
    """The path, first link first, with the window it explains."""

    cluster_id: str
    span: str | None
    t0: float
    t1: float
    links: tuple[Link, ...]
    #: tasks in the scope, and how many of them had their graph recorded
    n_tasks: int
    n_graphed: int
    #: "graph", "actions" (no graph recorded), or "graph and actions" (part of it)
    basis: str
    issues: GraphIssues
    #: the key of the dependency outside the path the first link waited on, if any
    waited_on: str | None = None
    #: the walk stopped where the recorded arrivals stopped going back in time
    stopped: bool = False

    @property
    def wall(self) -> float:
        return self.t1 - self.t0

    @property
    def parts(self) -> dict[str, float]:
        out = dict.fromkeys(PARTS, 0.0)
        for link in self.links:
            for part, seconds in link.parts.items():
                out[part] += seconds
        return out

    @property
    def notes(self) -> list[str]:
        """What the reader should know about how far the path can be trusted."""
        out = []
        if self.basis == "actions":
            out.append("the graph of these tasks was not recorded: each dependency is the "
                       "task whose completion released it (the scheduler's stimulus ids)")
        elif self.basis == "graph and actions":
            out.append(f"the graph was recorded for {self.n_graphed:,} of {self.n_tasks:,} "
                       "tasks (graph-max-tasks, or a task with more dependencies than a "
                       "graph row lists); the others' dependencies come from the "
                       "scheduler's stimulus ids")
        if self.stopped and self.links:
            out.append(f"the walk stopped at {self.links[0].key!r}: its dependency's result "
                       "did not arrive before the one it led to (repeated stimulus ids, or "
                       "a corrupt record)")
        if self.links and self.links[0].found_by == "not proven":
            out.append(f"the walk stopped at {self.links[0].key!r}: it left the scheduler's "
                       "queue (or was released by its submission), and without its recorded "
                       "graph no dependency is proven")
        return out + self.issues.notes()

    def as_dict(self) -> dict:
        return {"cluster_id": self.cluster_id, "span": self.span, "t0": self.t0,
                "t1": self.t1, "wall": self.wall, "parts": self.parts, "basis": self.basis,
                "n_tasks": self.n_tasks, "n_graphed": self.n_graphed, "notes": self.notes,
                "waited_on": self.waited_on, "links": [link.as_dict() for link in self.links]}


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


def _coverage(backend: Backend, scope: str, p: dict) -> tuple[int, int]:
    """(finished tasks in the scope, those whose graph row, with all its
    dependencies, was recorded)."""
    t, g = table(backend, "transitions"), table(backend, "graph_tasks")
    _, rows = backend.query(
        f"SELECT count(), countIf(kh IN (SELECT cityHash64(key) FROM {g} "
        f"WHERE cluster_id = {{c:String}} AND {_WHOLE})) "
        f"FROM (SELECT DISTINCT cityHash64(key) AS kh FROM {t} WHERE {scope})", p)
    return int(rows[0][0]), int(rows[0][1])


def _predecessors_sql(backend: Backend, scope: str, graph: bool, actions: bool) -> str:
    """One row: the scope's key hashes, each one's predecessor hash (0: none),
    how it was found (codes of :data:`_FOUND_CODE`), the predecessor's arrival, and
    the window and the last task."""
    t, g = table(backend, "transitions"), table(backend, "graph_tasks")
    ctes = [
        # the scope's tasks: each one's last finish
        f"fin AS (SELECT cityHash64(key) AS kh, max(ts) AS arrived, toFloat64(argMax("
        "arrayMax(arrayFilter((e, a) -> a = 'compute', startstops.stop, startstops.action)), ts)) "
        "AS end_s, toFloat64(argMax(arrayMin(arrayFilter((b, a) -> a = 'compute', "
        f"startstops.start, startstops.action)), ts)) AS begin_s FROM {t} WHERE {scope} GROUP BY kh)",
    ]
    if graph:
        ctes += [
            # when each key of the cluster last arrived in memory
            f"arr AS (SELECT cityHash64(key) AS dh, max(ts) AS arrived FROM {t} "
            "WHERE cluster_id = {c:String} AND source = 'scheduler' AND finish = 'memory' "
            "GROUP BY dh)",
            # the scope's arrivals alone (fin without its arrays: cheaper to read twice)
            f"done AS (SELECT cityHash64(key) AS kh, max(ts) AS arrived FROM {t} "
            f"WHERE {scope} GROUP BY kh)",
            f"graphed AS (SELECT DISTINCT cityHash64(key) AS kh FROM {g} "
            f"WHERE cluster_id = {{c:String}} AND {_WHOLE})",
            # per task, the dependency that arrived last before the task itself did
            "gp AS (SELECT e.kh AS kh, argMax(e.dh, a.arrived) AS pred, "
            "toFloat64(max(a.arrived)) AS pred_arrived FROM ("
            "SELECT cityHash64(key) AS kh, cityHash64(arrayJoin(dependencies)) AS dh "
            f"FROM {g} WHERE cluster_id = {{c:String}}) AS e "
            "INNER JOIN done AS f ON f.kh = e.kh INNER JOIN arr AS a ON a.dh = e.dh "
            "WHERE a.arrived < f.arrived GROUP BY e.kh)",
        ]
    if actions:
        ctes += [
            # the stimulus that moved each task from waiting to processing ...
            f"rel AS (SELECT cityHash64(key) AS kh, argMax(cityHash64(stimulus_id), ts) AS sh "
            f"FROM {t} WHERE cluster_id = {{c:String}} AND source = 'scheduler' "
            "AND start = 'waiting' AND finish = 'processing' GROUP BY kh)",
            # ... is the one that put the dependency releasing it in memory
            f"fs AS (SELECT cityHash64(stimulus_id) AS sh, argMax(cityHash64(key), ts) AS pred, "
            f"toFloat64(max(ts)) AS pred_arrived FROM {t} "
            "WHERE cluster_id = {c:String} AND source = 'scheduler' AND start = 'processing' "
            "AND finish = 'memory' AND stimulus_id != '' GROUP BY sh)",
            "sp AS (SELECT rel.kh AS kh, fs.pred AS pred, fs.pred_arrived AS pred_arrived "
            "FROM rel INNER JOIN fs ON fs.sh = rel.sh)",
        ]
    joins, pred, how, arrived = "", "toUInt64(0)", "toUInt8(4)", "toFloat64(0)"
    if graph:
        joins += " LEFT JOIN gp ON gp.kh = fin.kh"
        g_has = "fin.kh IN (SELECT kh FROM graphed)"
        g_pred, g_how = "gp.pred", "if(gp.pred != 0, 1, 2)"
    if actions:
        joins += " LEFT JOIN sp ON sp.kh = fin.kh"
        a_pred, a_how = "sp.pred", "if(sp.pred != 0, 3, 4)"
    if graph and actions:
        pred = f"if({g_has}, {g_pred}, {a_pred})"
        how = f"if({g_has}, {g_how}, {a_how})"
        arrived = f"if({g_has}, gp.pred_arrived, sp.pred_arrived)"
    elif graph:
        pred, how, arrived = g_pred, g_how, "gp.pred_arrived"
    elif actions:
        pred, how, arrived = a_pred, a_how, "sp.pred_arrived"
    return (
        "WITH " + ", ".join(ctes) + " "
        "SELECT groupArray(kh), groupArray(pred), groupArray(how), groupArray(pred_arrived), "
        "min(begin_s), max(end_s), argMax(kh, end_s) FROM ("
        f"SELECT fin.kh AS kh, {pred} AS pred, {how} AS how, {arrived} AS pred_arrived, "
        f"fin.begin_s AS begin_s, fin.end_s AS end_s FROM fin{joins}) "
        "SETTINGS join_use_nulls = 0"
    )


class _Pointers(NamedTuple):
    keys: np.ndarray          # uint64, sorted (the other arrays in the same order)
    preds: np.ndarray         # uint64, 0 = none
    how: np.ndarray           # uint8 codes
    pred_arrived: np.ndarray  # float64
    t0: float
    t1: float
    last: int                 # hash of the task that finished last


def _pointers(backend: Backend, scope: str, p: dict, graph: bool, actions: bool) -> _Pointers:
    _, rows = backend.query(_predecessors_sql(backend, scope, graph, actions), p)
    keys, preds, how, arrived, t0, t1, last = rows[0]
    keys = np.asarray(keys, dtype=np.uint64)
    # groupArray keeps no order across ClickHouse's threads: sort here, once
    order = np.argsort(keys, kind="stable")
    return _Pointers(keys[order], np.asarray(preds, dtype=np.uint64)[order],
                     np.asarray(how, dtype=np.uint8)[order],
                     np.asarray(arrived, dtype=np.float64)[order],
                     float(t0 or 0.0), float(t1 or 0.0), int(last or 0))


def _walk(ptr: _Pointers) -> tuple[list[int], bool]:
    """Indexes into ``ptr.keys`` from the last task back to the path's first, and
    whether the walk stopped because arrivals stopped going back in time (a recorded
    stimulus id repeated, say): a path is only ever followed into the past."""
    keys = ptr.keys
    n = len(keys)
    i = int(np.searchsorted(keys, np.uint64(ptr.last)))
    path = [i]
    while True:
        pred = ptr.preds[i]
        if not pred:
            return path, False
        j = int(np.searchsorted(keys, pred))
        if j >= n or keys[j] != pred:  # outside the scope
            return path, False
        if ptr.preds[j] and not ptr.pred_arrived[j] < ptr.pred_arrived[i]:
            return path + [j], True
        path.append(j)
        i = j


# ---------------------------------------------------------------------- links


class _Task(NamedTuple):
    key: str
    prefix: str
    worker: str
    span_id: str
    arrived: float
    entered: float          # last transition into processing before it finished
    submitted: float        # last released -> waiting before that
    actions: list[tuple[str, float, float]]
    evidence: tuple[tuple, ...]

    @property
    def compute(self) -> tuple[float, float]:
        """Its compute's first start and last stop (the worker's clock)."""
        computes = [(a, b) for action, a, b in self.actions if action == "compute"]
        return min(a for a, _ in computes), max(b for _, b in computes)


def _tasks(backend: Backend, cluster_id: str, hashes: list[int]) -> dict[int, _Task]:
    _, rows = backend.query(
        "SELECT cityHash64(key) AS kh, key, toFloat64(ts), start, finish, stimulus_id, worker, "
        "prefix, span_id, startstops.action, arrayMap(x -> toFloat64(x), startstops.start), "
        "arrayMap(x -> toFloat64(x), startstops.stop) "
        f"FROM {table(backend, 'transitions')} WHERE cluster_id = {{c:String}} "
        "AND source = 'scheduler' AND kh IN {hs:Array(UInt64)} ORDER BY kh, ts, seq, idx",
        {"c": cluster_id, "hs": hashes})
    by_key: dict[int, list] = {}
    for row in rows:
        by_key.setdefault(int(row[0]), []).append(row[1:])
    out = {}
    for kh, story in by_key.items():
        finishes = [r for r in story if r[2] == "processing" and r[3] in ("memory", "erred")
                    and "compute" in r[8]]
        if not finishes:
            continue
        fin = finishes[-1]
        arrived = fin[1]
        entered = max((r[1] for r in story if r[3] == "processing" and r[1] <= arrived),
                      default=arrived)
        submitted = max((r[1] for r in story if r[2] == "released" and r[1] <= entered),
                        default=min(r[1] for r in story))
        actions = sorted(zip(fin[8], fin[9], fin[10]), key=lambda a: a[1])
        window = [r for r in story if submitted <= r[1] <= arrived]
        out[kh] = _Task(fin[0], fin[6] or "", fin[5] or "", fin[7] or "", arrived, entered,
                        submitted, actions, tuple((r[1], r[2], r[3], r[4]) for r in window))
    return out


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def link_segments(task: _Task, start: float, stop: float, ready: float | None,
                  ready_part: str, last: bool = False) -> list[Segment]:
    """The segments of a link from ``start`` to ``stop`` (see the module docstring),
    contiguous. ``ready``: when the task's last dependency arrived (None: no
    dependency), counted as ``ready_part`` ("scheduler" when that dependency is the
    previous link, else "dependencies"). ``last``: the link ends at the task's compute
    stop (the window's end), so what the worker did after it is not in it.

    Until the task reached a worker, the scheduler's times place the segments; from
    there, the worker's durations in the order it works: transfers, the wait for a
    thread, reading from disk, compute, writing to disk."""
    segments: list[Segment] = []
    t = start

    def take(part: str, seconds: float) -> None:
        nonlocal t
        until = min(t + max(seconds, 0.0), stop)
        if until > t:
            if segments and segments[-1].part == part:  # one stretch, not two
                segments[-1] = segments[-1]._replace(stop=until)
            else:
                segments.append(Segment(part, t, until))
            t = until

    if ready is None:
        take("client", task.submitted - t)
    else:
        take(ready_part, ready - t)
    take("scheduler", task.entered - t)
    compute_stop = task.compute[1]
    actions = [(a, b - c) for a, c, b in task.actions if not last or b <= compute_stop]
    # (a, duration) pairs; transfers may overlap each other: count their union
    transfer = _union_length([(c, b) for a, c, b in task.actions if a == "transfer"
                              and (not last or b <= compute_stop)])
    before = sum(d for a, d in actions if a == "disk-read")
    after = sum(d for a, d in actions if a == "disk-write")
    compute = sum(d for a, d in actions if a not in ("transfer", "disk-read", "disk-write"))
    budget = stop - t
    work = transfer + before + compute + after
    scale = min(1.0, budget / work) if work > 0 else 1.0
    thread = max(0.0, budget - work * scale)
    for part, seconds in (("transfer", transfer * scale), ("thread", thread),
                          ("disk", before * scale), ("compute", compute * scale),
                          ("disk", after * scale)):
        take(part, seconds)
    if t < stop:  # rounding: the link ends where it ends
        take(segments[-1].part if segments else "thread", stop - t)
    return segments


def _links(path: list[int], ptr: _Pointers, tasks: dict[int, _Task],
           stopped: bool = False) -> tuple[list[Link], int | None]:
    """The path's links, first link first, contiguous from ``ptr.t0`` to ``ptr.t1``;
    and the key hash of the dependency outside the path that the first link waited on.
    ``stopped``: the walk stopped at the first link (its predecessor is not followed)."""
    chain = [(i, tasks[int(ptr.keys[i])]) for i in reversed(path) if int(ptr.keys[i]) in tasks]
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
            found_by, waited_on = "outside", int(ptr.preds[i])
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
        "WITH seen AS (SELECT cityHash64(key) AS h, maxIf(ts, finish = 'memory') AS arrived, "
        f"countIf(finish = 'memory') > 0 AS done FROM {t} WHERE cluster_id = {{c:String}} "
        "AND source = 'scheduler' GROUP BY h), "
        f"edges AS (SELECT key, dep FROM {g} ARRAY JOIN dependencies AS dep "
        f"WHERE cluster_id = {{c:String}} {span_filter}) "
        "SELECT countIf(d.h = 0) AS dangling, "
        "groupArrayIf({n:UInt32})((key, dep), d.h = 0), "
        "countIf(d.done AND k.done AND d.arrived >= k.arrived) AS backwards, "
        "groupArrayIf({n:UInt32})((key, dep), d.done AND k.done AND d.arrived >= k.arrived) "
        "FROM edges LEFT JOIN seen AS d ON d.h = cityHash64(edges.dep) "
        "LEFT JOIN seen AS k ON k.h = cityHash64(edges.key) "
        "SETTINGS join_use_nulls = 0", p)
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


def _find_path(backend: Backend, cluster_id: str, source: str, target: str) -> tuple[str, ...]:
    """Keys from ``source`` to ``target`` along recorded dependencies, or ()."""
    parent: dict[str, str | None] = {source: None}
    frontier = [source]
    while frontier and len(parent) < CYCLE_SEARCH_NODES:
        _, rows = backend.query(
            f"SELECT key, dependencies FROM {table(backend, 'graph_tasks')} "
            "WHERE cluster_id = {c:String} AND key IN {keys:Array(String)}",
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
        _, rows = backend.query(
            f"SELECT toFloat64(min(enqueued)) FROM {table(backend, 'spans')} "
            "WHERE cluster_id = {c:String} AND span_id IN {ids:Array(String)}", p)
        enqueued = float(rows[0][0] or 0.0) if rows else 0.0
        if enqueued > ptr.t0:
            ptr = ptr._replace(t0=min(enqueued, ptr.t1))
    path, stopped = _walk(ptr)
    tasks = _tasks(backend, cluster_id, [int(ptr.keys[i]) for i in path]
                   + [int(ptr.preds[path[-1]])] * bool(ptr.preds[path[-1]]))
    links, waited_on = _links(path, ptr, tasks, stopped)
    outside = tasks.get(waited_on) if waited_on is not None else None
    issues = graph_issues(backend, cluster_id, span_ids) if (check_graph and graph) else GraphIssues()
    basis = "graph" if not actions else "actions" if not graph else "graph and actions"
    return CriticalPath(cluster_id, span, ptr.t0, ptr.t1, tuple(links), n_tasks, n_graphed,
                        basis, issues, outside.key if outside else None, stopped)
