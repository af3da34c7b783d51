"""The Run page's panels read from the page aggregates ClickHouse keeps as rows arrive
(sinks/sql/006_page_aggregates.sql), so that their cost grows with the seconds,
workers, prefixes and groups a page shows, not with the tasks a run holds.

Each function answers what its namesake in a view (:mod:`.views`) answers from the raw rows,
in the same shape, for a scope of a whole run or a span (:func:`usable`): an explicit
``since``/``until`` window cuts through the aggregates' seconds, so such scopes are
answered from the raw rows. The aggregates keep whole seconds: a transition or an
action is placed in the time bucket of the second it happened in, which is exact for
buckets of a second or more (:func:`usable` demands them, unless the run holds more
than :data:`RAW_TRANSITIONS` transitions, where one-second steps are the price of an
answer in time).

Every reader sums the rows of all sink batches (``_batch`` is part of each
aggregate's key, see the migration); ``keys`` is merged with ``uniqExactMerge``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t

#: Above this many transitions in the scope the aggregates answer even when a time
#: bucket is shorter than a second.
RAW_TRANSITIONS = 200_000


#: What :func:`bounds` reads (from ``{task_seconds}``; ``{where}`` filled in where it is
#: run).
BOUNDS = ("SELECT toFloat64(min(first_ts)), toFloat64(max(last_ts)), sum(n) FROM "
          "{task_seconds} {where}")


def bounds(backend: Backend, cluster_id: str, span_ids: list[str] | None) -> tuple:
    """(first transition, last transition, transitions) of the cluster or of its spans
    ``span_ids``, from ``task_seconds``: exact times (the aggregate keeps each
    second's first and last ``ts``)."""
    where, p = _where(cluster_id, span_ids)
    _, rows = backend.query(BOUNDS.format(task_seconds=_t(backend, 'task_seconds'), where=where), p)
    first, last, n = rows[0] if rows else (None, None, 0)
    if not n:
        return None, None, 0
    return float(first), float(last), int(n)


def usable(scope) -> bool:
    """Whether the aggregates answer for ``scope``: a whole run or span (no explicit
    window), in buckets of a second or more or with many transitions."""
    return (scope.since is None and scope.until is None
            and (scope.bucket >= 1.0 or (scope.n_transitions or 0) > RAW_TRANSITIONS))


def _where(cluster_id: str, span_ids: list[str] | None, extra: str = "") -> tuple[str, dict]:
    p: dict[str, Any] = {"c": cluster_id}
    where = "WHERE cluster_id = {c:String}"
    if span_ids is not None:
        where += " AND span_id IN {ids:Array(String)}"
        p["ids"] = list(span_ids)
    return where + (f" AND {extra}" if extra else ""), p


#: SQL: the time bucket of ``second``, 0 .. nb - 1 (parameters of :func:`_buckets`).
_BUCKET = ("toUInt32(least(greatest(floor((toFloat64(second) - {t0:Float64}) / {w:Float64}), 0), "
           "{nb:Float64} - 1))")


def _buckets(p: dict, scope, n: int) -> dict:
    p.update(t0=scope.t0, w=scope.bucket, nb=float(n))
    return p


#: What :func:`prefix_counts` reads (from ``{group_totals}``; ``{where}`` filled in where it
#: is run).
PREFIX_COUNTS = ("SELECT prefix, uniqExactMerge(keys), sum(memory), sum(erred), "
                 "uniqExactMerge(memory_keys) FROM {group_totals} {where} GROUP BY prefix")


def prefix_counts(backend: Backend, scope) -> dict[str, dict]:
    """Per prefix: distinct tasks, transitions into memory and into erred, and the
    transitions into memory beyond each task's first (``recomputed``)."""
    where, p = _where(scope.cluster_id, scope.span_ids)
    _, rows = backend.query(
        PREFIX_COUNTS.format(group_totals=_t(backend, 'group_totals'), where=where), p)
    return {prefix or "(none)": {"tasks": int(n), "memory": int(m), "erred": int(e),
                                 "recomputed": int(m) - int(k)}
            for prefix, n, m, e, k in rows}


#: What :func:`finished_per_bucket` reads (from ``{task_seconds}``; ``{_BUCKET}``,
#: ``{where}`` filled in where it is run).
FINISHED_PER_BUCKET = ("SELECT prefix, {_BUCKET} AS b, sum(n) FROM {task_seconds} {where} "
                       "GROUP BY prefix, b ORDER BY b")


def finished_per_bucket(backend: Backend, scope, n: int) -> list[tuple[str, int, int]]:
    """(prefix, bucket, transitions into memory or erred) of the scope."""
    where, p = _where(scope.cluster_id, scope.span_ids, "finish IN ('memory', 'erred')")
    _buckets(p, scope, n)
    _, rows = backend.query(
        FINISHED_PER_BUCKET.format(_BUCKET=_BUCKET, task_seconds=_t(backend, 'task_seconds'), where=where), p)
    return rows


#: What :func:`moves_per_bucket` reads (from ``{task_seconds}``; ``{_BUCKET}``, ``{where}``
#: filled in where it is run).
MOVES_PER_BUCKET = ("SELECT start, finish, {_BUCKET} AS b, sum(n) FROM {task_seconds} {where} "
                    "GROUP BY start, finish, b")


def moves_per_bucket(backend: Backend, scope, n: int) -> list[tuple[str, str, int, int]]:
    """(start, finish, bucket, transitions) of the scope."""
    where, p = _where(scope.cluster_id, scope.span_ids)
    _buckets(p, scope, n)
    _, rows = backend.query(
        MOVES_PER_BUCKET.format(_BUCKET=_BUCKET, task_seconds=_t(backend, 'task_seconds'), where=where), p)
    return rows


#: What :func:`bars` reads (from ``{stream_seconds}``; ``{where}`` filled in where it is
#: run).
BARS = "SELECT sum(started), sumIf(started, action = 'compute') FROM {stream_seconds} {where}"


def bars(backend: Backend, scope) -> tuple[int, int]:
    """(startstops, computes) that began in the scope."""
    where, p = _where(scope.cluster_id, scope.span_ids)
    _, rows = backend.query(
        BARS.format(stream_seconds=_t(backend, 'stream_seconds'), where=where), p)
    return (int(rows[0][0] or 0), int(rows[0][1] or 0)) if rows else (0, 0)


#: What :func:`stream_cells` reads (from ``{stream_seconds}``; ``{_BUCKET}``, ``{where}``
#: filled in where it is run).
STREAM_CELLS = ("SELECT worker, b, sum(busy) AS total, argMax(what, busy), sum(computes), "
                "sum(bars) FROM ( SELECT worker, {_BUCKET} AS b, if(action = 'compute', "
                "prefix, action) AS what,   sum(busy) AS busy, sumIf(started, action = "
                "'compute') AS computes, sum(started) AS bars  FROM {stream_seconds} {where} "
                "GROUP BY worker, b, what) GROUP BY worker, b ORDER BY worker, b")


def stream_cells(backend: Backend, scope, n: int) -> list[tuple]:
    """The binned task stream: per worker and bucket, busy seconds, the busiest prefix
    (an action's name for other actions), computes and startstops that began in it."""
    where, p = _where(scope.cluster_id, scope.span_ids)
    _buckets(p, scope, n)
    _, rows = backend.query(
        STREAM_CELLS.format(_BUCKET=_BUCKET, stream_seconds=_t(backend, 'stream_seconds'), where=where), p)
    return rows


#: What :func:`activity` reads (from ``{stream_seconds}``; ``{_BUCKET}``, ``{where}`` filled
#: in where it is run).
ACTIVITY = ("SELECT action, {_BUCKET} AS b, sum(busy) FROM {stream_seconds} {where} GROUP BY "
            "action, b")


def activity(backend: Backend, scope, n: int, worker: str | None = None,
             t0: float | None = None, width: float | None = None) -> dict[str, dict]:
    """Seconds of each action per bucket, summed over the workers (or of ``worker``):
    ``{action: {bucket: seconds}}``; the seconds of the scope's window (whole
    seconds: a window's edges are rounded out to them). Buckets are ``width`` wide
    from ``t0`` (the scope's bucket and start by default); a second falls wholly in
    the bucket it begins in, so buckets of whole seconds starting on one hold
    exactly the seconds of the actions within them."""
    where, p = _where(scope.cluster_id, scope.span_ids, "worker = {worker:String}" if worker else "")
    if worker:
        p["worker"] = worker
    _buckets(p, scope, n)
    p.update(t0=scope.t0 if t0 is None else t0, w=scope.bucket if width is None else width)
    where += (" AND second >= toDateTime(toUInt32(floor({start:Float64})), 'UTC') "
              "AND second <= toDateTime(toUInt32({t1:Float64}), 'UTC')")
    p.update(start=scope.t0, t1=scope.t1)
    _, rows = backend.query(
        ACTIVITY.format(_BUCKET=_BUCKET, stream_seconds=_t(backend, 'stream_seconds'), where=where), p)
    out: dict[str, dict] = defaultdict(dict)
    for action, b, busy in rows:
        out[action][int(b)] = float(busy)
    return dict(out)


#: What :func:`transfers` reads (from ``{stream_seconds}``; ``{where}`` filled in where it
#: is run).
TRANSFERS = ("SELECT sender, worker, sum(busy), sum(started) FROM {stream_seconds} {where} "
             "GROUP BY sender, worker ORDER BY sender, worker")


def transfers(backend: Backend, scope) -> list[tuple[str, str, float, int]]:
    """(sender, receiver, seconds, transfers) of the scope, from the transfers'
    startstops."""
    where, p = _where(scope.cluster_id, scope.span_ids, "action = 'transfer'")
    _, rows = backend.query(
        TRANSFERS.format(stream_seconds=_t(backend, 'stream_seconds'), where=where), p)
    return rows


#: What :func:`per_worker` reads (from ``{stream_seconds}``; ``{where}`` filled in where it
#: is run).
PER_WORKER = ("SELECT worker, sumIf(started, action = 'compute'), sumIf(erred, action = "
              "'compute'), sumIf(busy, action = 'compute'), sumIf(busy, action = 'transfer') "
              "FROM {stream_seconds} {where} GROUP BY worker")


def per_worker(backend: Backend, cluster_id: str, span_ids: list[str] | None = None) -> dict[str, dict]:
    """Per worker: computes begun, erred computes, compute and transfer seconds."""
    where, p = _where(cluster_id, span_ids)
    _, rows = backend.query(
        PER_WORKER.format(stream_seconds=_t(backend, 'stream_seconds'), where=where), p)
    return {w: {"tasks": int(t), "erred": int(e), "compute_s": float(c), "transfer_s": float(x)}
            for w, t, e, c, x in rows}


#: What :func:`groups` reads (from ``{group_totals}``; ``{where}`` filled in where it is
#: run).
GROUPS = ("SELECT task_group, anyLast(prefix), uniqExactMerge(keys), "
          "uniqExactMerge(memory_keys), sum(memory), sum(erred), sum(compute_s), "
          "sum(transfer_s), sum(nbytes), min(first_start), max(last_stop) FROM {group_totals} "
          "{where} GROUP BY task_group ORDER BY sum(compute_s) DESC, task_group")


def groups(backend: Backend, cluster_id: str, span_ids: list[str] | None = None) -> list[dict]:
    """Every task group of the scope: prefix, distinct tasks, tasks that reached memory
    (``memory``) and the transitions into memory beyond each task's first
    (``recomputed``), transitions into erred, compute and transfer seconds, bytes of
    every result (a recomputed task's each time), first compute start and last stop
    (None when none computed), largest first."""
    where, p = _where(cluster_id, span_ids)
    _, rows = backend.query(GROUPS.format(group_totals=_t(backend, 'group_totals'), where=where), p)
    return [{"group": g, "prefix": prefix, "tasks": int(n), "memory": int(k),
             "recomputed": int(m) - int(k), "erred": int(e), "compute_s": float(c),
             "transfer_s": float(x), "nbytes": int(b), "start": s, "stop": e2}
            for g, prefix, n, k, m, e, c, x, b, s, e2 in rows]


#: What :func:`digests` reads (from ``{digest_totals}``; ``{where}`` filled in where it is
#: run).
DIGESTS = ("SELECT context, prefix, activity, unit, sum(value) FROM {digest_totals} {where} "
           "GROUP BY context, prefix, activity, unit")


def digests(backend: Backend, cluster_id: str, worker: str | None = None,
            span_ids: list[str] | None = None) -> list[tuple]:
    """(context, prefix, activity, unit, value) summed over the workers (or of
    ``worker``) and the run (or spans ``span_ids``)."""
    where, p = _where(cluster_id, span_ids, "worker = {worker:String}" if worker else "")
    if worker:
        p["worker"] = worker
    _, rows = backend.query(
        DIGESTS.format(digest_totals=_t(backend, 'digest_totals'), where=where), p)
    return rows
