"""The scope of a page: one recorded cluster, optionally narrowed to a span and its
sub-spans and/or a time window (:class:`Scope`, from :func:`resolve`), and the
WHERE clause every view's query narrows to it with (:func:`where`).

Which cluster: ``cluster`` is a name or an id. Several runs may share a name; the
latest (by last envelope) is taken and the others are listed in ``Scope.others``.
Unknown clusters, spans and keys raise :class:`NotFound` (a LookupError) whose
message names what was not found. Times are float seconds since the epoch (UTC).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import defaultdict
from typing import Any

from dask_blackbox.read import aggregates, history
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import cluster_ids_sql
from dask_blackbox.read.filters import epoch as _epoch
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.queries import TimeBound

#: Time buckets across the window for binned or aggregated views.
BUCKETS = 300


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


#: The runs of a cluster name or id ``c`` (``{runs}``: :func:`.filters.cluster_ids_sql`,
#: the runs of :func:`.filters.cluster_ids`), latest first: id, name, first and last seen.
RUNS = ("SELECT cluster_id, cluster_name, toFloat64(first_seen), toFloat64(last_seen) "
        "FROM {clusters} WHERE cluster_id IN ({runs}) ORDER BY last_seen DESC")
#: When the run ``c`` was last seen.
LAST_SEEN = "SELECT toFloat64(max(last_seen)) FROM {clusters} WHERE cluster_id = {{c:String}}"
#: The spans of the run ``c``, described or only announced: id, parent, name.
SPAN_EDGES = ("SELECT span_id, any(parent_id), any(name) FROM (SELECT span_id, parent_id, name "
              "FROM {span_state} WHERE cluster_id = {{c:String}} UNION ALL "
              "SELECT span_id, parent_id, name FROM {spans} WHERE cluster_id = {{c:String}}) "
              "GROUP BY span_id")
#: The first and last moment of the run ``c``: its lifecycle and its envelopes.
RUN_BOUNDS = ("SELECT min(a), max(b) FROM ("
              "SELECT min(toFloat64(ts)) AS a, max(toFloat64(ts)) AS b FROM {lifecycle} "
              "WHERE cluster_id = {{c:String}} UNION ALL "
              "SELECT min(toFloat64(sent_at)), max(toFloat64(sent_at)) FROM {envelopes} "
              "WHERE cluster_id = {{c:String}}) WHERE a > 0")
#: The first and last moment of the spans ``ids`` of the run ``c``.
SPAN_BOUNDS = ("SELECT min(toFloat64(enqueued)), max(toFloat64(stop)) FROM {span_state} "
               "WHERE cluster_id = {{c:String}} AND span_id IN {{ids:Array(String)}} AND enqueued > 0")


def _cluster(backend: Backend, cluster: str) -> tuple[str, str, list[tuple]]:
    _, rows = backend.query(RUNS.format(clusters=_t(backend, "clusters"),
                                        runs=cluster_ids_sql(backend)), {"c": cluster})
    if not rows:
        raise NotFound(f"no recorded cluster is named {cluster!r} or has that id")
    chosen = rows[0]
    return chosen[0], chosen[1], [(c, f, l) for c, _, f, l in rows[1:]]


def latest_run(backend: Backend, cluster: str) -> tuple[str, str, list[tuple]]:
    """The latest run (cluster id) of the name or id ``cluster``, its name, and the
    others of that name: (cluster_id, first seen, last seen), latest first.
    NotFound when nothing matches."""
    return _cluster(backend, cluster)


def last_seen(backend: Backend, cluster_id: str) -> float | None:
    _, rows = backend.query(LAST_SEEN.format(clusters=_t(backend, "clusters")), {"c": cluster_id})
    return float(rows[0][0]) if rows and rows[0][0] else None


def _span_ids(backend: Backend, cluster_id: str, span: str) -> list[str]:
    """The spans of ``cluster_id`` named ``span`` (a tag of the name, or the whole
    '/'-joined name) and all their descendants."""
    _, edges = backend.query(SPAN_EDGES.format(span_state=_t(backend, "span_state"),
                                               spans=_t(backend, "spans")), {"c": cluster_id})
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
        _, rows = backend.query(RUN_BOUNDS.format(lifecycle=_t(backend, "lifecycle"),
                                                  envelopes=_t(backend, "envelopes")), p)
    else:
        p["ids"] = span_ids
        _, rows = backend.query(SPAN_BOUNDS.format(span_state=_t(backend, "span_state")), p)
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


def where(scope: Scope, time_column: str = "ts", span: bool = True) -> tuple[str, dict]:
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


def n_buckets(scope: Scope) -> int:
    """The scope's time buckets (at most :data:`BUCKETS`)."""
    return min(BUCKETS, int((scope.t1 - scope.t0) / scope.bucket) + 1)


def ts(value) -> float | None:
    """A recorded time as seconds since the epoch (None for none, or the epoch itself)."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp() if value.timestamp() > 0 else None
    return float(value)


def minutes(scope: Scope) -> history.Window:
    """The scope at its roll-ups' grain (:class:`.history.Window`): buckets of whole
    minutes, :data:`BUCKETS` at most, across the window."""
    return history.Window.around(scope.cluster_id, scope.t0, scope.t1, BUCKETS, scope.span_ids)


def minute_ends(w: history.Window) -> list[float]:
    """The ends of the buckets of ``w``."""
    return [w.t0 + (i + 1) * w.bucket for i in range(w.n_buckets)]
