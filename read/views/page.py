"""What the views of a page share, below the views: the page's :class:`Context`
(its scope and parameters, and the results several views read: the run's deaths and
the markers of every time axis, its workers, the per-prefix counts of the heading, the
critical path), kept for :data:`MEMO_SECONDS` by a :class:`Memo` shared by the web
app's requests (the panels of one page ask for them within a second of each other),
and the page's heading (:func:`summary`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from dask_blackbox.read import aggregates, diagnosis, history, queries
from dask_blackbox.read import critical_path as paths
from dask_blackbox.read import workers as worker_data
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.log_search import LEVELS
from dask_blackbox.read.params import BadParameter, filters
from dask_blackbox.read.statements import LIFECYCLE
from dask_blackbox.read.views.scope import Scope, resolve
from dask_blackbox.read.views.scope import where as _where

#: Seconds a shared result (deaths, progress, critical path, scope) is kept for the
#: next panels of the same page.
MEMO_SECONDS = 30.0
#: The Run page computes the critical path and the cost of a scope of at most this
#: many tasks by itself (a few seconds beyond); a bigger one offers a link that does.
SLOWNESS_MAX_TASKS = 20_000


class Memo:
    """A small time-bounded cache shared by the web app's requests (thread-safe):
    at most ``size`` entries, each kept ``seconds``."""

    def __init__(self, seconds: float = MEMO_SECONDS, size: int = 64) -> None:
        self.seconds, self.size = seconds, size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make: Callable[[], Any]):
        now = time.monotonic()
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        value = make()
        with self._lock:
            self._items[key] = (now + self.seconds, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


#: Per prefix of the scheduler's transitions (``{where}``: the scope): distinct keys (by
#: their 64-bit hash: exact but for collisions, ~1e-8 at a million keys, and several
#: times cheaper than comparing the strings), transitions into memory and into erred,
#: and distinct keys that went into memory.
PREFIX_TOTALS = ("SELECT prefix, uniqExact(cityHash64(key)), countIf(finish = 'memory'), "
                 "countIf(finish = 'erred'), uniqExactIf(cityHash64(key), finish = 'memory') "
                 "FROM {transitions} {where} AND source = 'scheduler' GROUP BY prefix")


def prefix_totals(backend: Backend, scope: Scope) -> dict[str, dict]:
    """Per prefix (``"(none)"`` for none) in the scope: ``tasks`` (distinct keys),
    ``memory`` and ``erred`` (transitions into memory, into erred) and ``recomputed``
    (the transitions into memory beyond each key's first): :func:`progress`'s
    ``counts``, and what the page's heading adds up. From the page aggregates
    (:mod:`.aggregates`) for a whole run or span."""
    if aggregates.usable(scope):
        return aggregates.prefix_counts(backend, scope)
    where, p = _where(scope)
    _, totals_rows = backend.query(
        PREFIX_TOTALS.format(transitions=_t(backend, "transitions"), where=where), p)
    return {prefix or "(none)": {"tasks": t, "memory": m, "erred": e, "recomputed": m - k}
            for prefix, t, m, e, k in totals_rows}


def markers(backend: Backend, scope: Scope, found: list | None = None) -> dict:
    """What to mark on every time axis: worker deaths, cluster restarts, and workers
    that joined after the start.

    A death is a removal whose cause (:mod:`.diagnosis`) is not "expected": the same
    count as the Clusters page's workers lost and the Diagnosis panel's deaths.
    ``found``: the cluster's :func:`diagnosis.deaths`, if already computed.
    """
    _, rows = backend.query(LIFECYCLE.format(lifecycle=_t(backend, "lifecycle"), also=""),
                            {"c": scope.cluster_id})
    restarts, arrivals = [], []
    first = float(rows[0][0] or 0.0) if rows else 0.0  # the cluster's first lifecycle event
    for ts, action, worker, *_ in rows:
        if action == "restart":
            restarts.append({"ts": ts})
        elif action == "worker_added" and ts > first + 1.0:
            arrivals.append({"ts": ts, "worker": worker})
    found = diagnosis.deaths(backend, [scope.cluster_id]) if found is None else found
    deaths = [{"ts": d.ts, "worker": d.worker, "reason": d.verdict.cause.label,
               "cause": d.verdict.cause.value, "confidence": d.verdict.confidence,
               "summary": d.verdict.summary, "processing_tasks": d.processing_tasks,
               "lost_computed_tasks": d.lost_computed_tasks,
               "lost_scattered_tasks": d.lost_scattered_tasks}
              for d in found if d.is_death]
    return {"deaths": deaths, "restarts": restarts, "arrivals": arrivals}


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


def rollup_counts(finished: dict) -> dict[str, dict]:
    """:func:`prefix_totals` from a run's roll-ups (:func:`.history.finished`): per
    prefix the tasks that finished (into memory or erred; a task recomputed after its
    worker died counts twice), into memory and into erred."""
    per_prefix: dict[str, dict] = {}
    for (prefix, _), (memory, erred) in finished.items():
        c = per_prefix.setdefault(prefix or "(none)", {"tasks": 0, "memory": 0, "erred": 0,
                                                       "recomputed": None})
        c["memory"] += memory
        c["erred"] += erred
        c["tasks"] += memory + erred
    return per_prefix


class Context:
    """One page's scope and parameters, and what its panels share."""

    def __init__(self, backend: Backend, scope: Scope, params: Mapping | None = None,
                 memo: Memo | None = None, worker: str | None = None,
                 slowness: bool | None = None) -> None:
        self.backend, self.scope = backend, scope
        self.params = dict(params or {})
        self.memo = memo or Memo()
        self.worker = worker
        self._slowness = slowness
        s = scope
        self._key = (s.cluster_id, s.span, s.since, s.until)

    def shared(self, what: str, make: Callable[[], Any]):
        """``make()``, once for this page's scope (kept by the memo)."""
        return self.memo.get((what, *self._key), make)

    def deaths(self) -> list:
        return self.memo.get(("deaths", self.scope.cluster_id),
                             lambda: diagnosis.deaths(self.backend, [self.scope.cluster_id]))

    def info(self) -> dict[str, dict]:
        """The run's workers as the scheduler recorded them (:func:`workers.info`)."""
        return self.memo.get(("info", self.scope.cluster_id),
                             lambda: worker_data.info(self.backend, self.scope.cluster_id))

    def markers(self) -> dict:
        return self.shared("markers", lambda: markers(self.backend, self.scope, self.deaths()))

    def history(self) -> history.Detail:
        """Where the run's panels come from (:func:`.history.detail`): its raw rows, or
        its per-minute roll-ups once the raw rows expired (the progress, task states,
        memory and a binned task stream then come from the roll-ups, and the heading
        says so; what only raw rows could show is empty)."""
        return self.memo.get(("history", self.scope.cluster_id),
                             lambda: history.detail(self.backend, self.scope.cluster_id))

    def from_rollups(self) -> bool:
        return self.history().source == "rollups"

    def finished_minutes(self) -> dict:
        """The roll-ups' tasks finished per (prefix, bucket) (:func:`.history.finished`)."""
        from dask_blackbox.read.views.scope import minutes

        return self.shared("finished_minutes", lambda: history.finished(
            self.backend, minutes(self.scope), "rollups"))

    def counts(self) -> dict[str, dict]:
        """Per prefix: tasks, transitions into memory and into erred (the progress
        panel's ``counts``; the heading's and the task stream's sums)."""
        if self.from_rollups():
            return self.shared("rollup_counts", lambda: rollup_counts(self.finished_minutes()))
        return self.shared("counts", lambda: prefix_totals(self.backend, self.scope))

    def n_tasks(self) -> int:
        return sum(c["tasks"] for c in self.counts().values())

    def slowness(self) -> bool:
        """Whether the critical path and the costs are computed for this page: asked
        for (``slowness``), or a scope of at most :data:`SLOWNESS_MAX_TASKS`."""
        if self._slowness is not None:
            return self._slowness
        if self.params.get("slowness"):
            return True
        return self.n_tasks() <= SLOWNESS_MAX_TASKS

    def critical_path(self) -> dict:
        if not self.slowness():
            return {"deferred": self.n_tasks()}
        return self.shared("critical_path", lambda: critical_path(self.backend, self.scope))

    def count_bytes(self) -> bool:
        """Whether bytes moved between workers are counted for this page: asked for
        (``slowness``), or a run of at most :data:`workers.MOVED_MAX_TASKS` tasks."""
        if self._slowness or self.params.get("slowness"):
            return True
        return self.n_tasks() <= worker_data.MOVED_MAX_TASKS

    def moved(self) -> dict | None:
        """The run's bytes moved per (sender, receiver) (:func:`workers.moved_bytes`),
        None when not counted (:meth:`count_bytes`) or without a recorded graph."""
        if not self.count_bytes():
            return None
        return self.memo.get(("moved", self.scope.cluster_id),
                             lambda: worker_data.moved_bytes(self.backend, self.scope.cluster_id))

    def critical_keys(self) -> set[str] | None:
        path = self.critical_path()
        if path.get("deferred") is not None or not path.get("available"):
            return None
        return {link["key"] for link in path["links"]}


def summary(ctx: Context) -> dict:
    """The page's heading: the scope and its counts (tasks, in memory, erred, workers,
    deaths, restarts).

    ``tasks`` is Dask's count (:func:`~dask_blackbox.read.queries.dask_tasks`: every
    task its spans held, a key submitted again after it was forgotten counting again,
    what the Spans view shows) for a run or span whose spans were recorded, else the
    distinct keys (``tasks_counted`` says which: "dask" or "keys"); ``distinct_keys`` the
    distinct keys; ``recomputed`` the results computed again (transitions into memory
    beyond each key's first: after a worker holding them died), None where the
    roll-ups cannot tell."""
    totals = ctx.counts()
    keys = sum(c["tasks"] for c in totals.values())
    recomputed = [c.get("recomputed") for c in totals.values()]
    scope = ctx.scope
    dask = None
    if scope.since is None and scope.until is None:
        dask = ctx.shared("dask_tasks", lambda: queries.dask_tasks(
            ctx.backend, scope.cluster_id, scope.span_ids))
    head = {**scope.as_dict(), "tasks": keys if dask is None else dask,
            "tasks_counted": "keys" if dask is None else "dask", "distinct_keys": keys,
            "recomputed": None if None in recomputed else sum(recomputed),
            "finished_in_memory": sum(c["memory"] for c in totals.values()),
            "erred": sum(c["erred"] for c in totals.values())}
    marks = ctx.markers()
    found = ctx.history()
    head.update(deaths=len(marks["deaths"]), restarts=len(marks["restarts"]),
                workers=len(ctx.info()),
                history={"source": found.source, "note": found.note})
    return head


def context(backend: Backend, params: Mapping, memo: Memo | None = None,
            worker: str | None = None) -> Context:
    """The context of a page from its query parameters (``cluster``, ``span``,
    ``since``, ``until``; parsed by :func:`dask_blackbox.read.params.filters`)."""
    f = filters(params)
    if not f["cluster"]:
        raise BadParameter("cluster is required: a cluster name or id")
    memo = memo or Memo()
    scope = memo.get(("scope", f["cluster"], f["span"], f["since"], f["until"]),
                     lambda: resolve(backend, f["cluster"], f["span"], f["since"], f["until"]))
    return Context(backend, scope, params, memo, worker)


def page_variables(ctx: Context, web: bool, query_string: str = "") -> dict:
    """What every panel's template is given besides its data."""
    return {"scope": ctx.scope, "web": web, "query": ctx.params, "query_string": query_string,
            "levels": LEVELS, "worker_address": ctx.worker}


#: The '/'-joined names of a cluster's spans, in order.
SPAN_NAMES = ("SELECT DISTINCT arrayStringConcat(name, '/') AS n FROM {spans} "
              "WHERE cluster_id = {{c:String}} ORDER BY n")


def span_names(backend: Backend, scope: Scope) -> list[str]:
    """The '/'-joined names of the cluster's spans, for the span picker."""
    _, rows = backend.query(SPAN_NAMES.format(spans=_t(backend, "spans")), {"c": scope.cluster_id})
    return [r[0] for r in rows]


#: Per worker (``{where}``: the scope), the mean interval between its samples.
SAMPLING_INTERVALS = ("SELECT (max(toFloat64(ts)) - min(toFloat64(ts))) / (count() - 1) "
                      "FROM {worker_metrics} {where} GROUP BY worker HAVING count() > 1")


def metric_cell(backend: Backend, scope: Scope, worker: str | None = None) -> float:
    """The time cell of a chart of worker samples: the page's bucket, at least twice
    the workers' typical sampling interval (so a worker has a sample in every cell it
    lived)."""
    where, p = _where(scope, span=False)
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    _, intervals = backend.query(
        SAMPLING_INTERVALS.format(worker_metrics=_t(backend, "worker_metrics"), where=where), p)
    typical = sorted(r[0] for r in intervals)[len(intervals) // 2] if intervals else 0.0
    return max(scope.bucket, 2 * typical)
