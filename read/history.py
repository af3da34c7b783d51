"""What a cluster's recorded history still holds, and the answers its roll-ups give.

Raw rows (transitions, worker metrics, logs, envelopes, ...) are kept for
``blackbox.clickhouse.retention``; per-minute roll-ups (``task_minutes``,
``worker_minutes``, ``cluster_minutes`` in the database ``<database>_rollups``, filled
by materialized views: sinks/sql/008_rollups.sql) and the tables
that are already one row per span, prefix-minute or lifecycle event, for
``blackbox.clickhouse.rollup-retention``. :func:`detail` says, for one cluster,
whether its raw rows still cover its run; where they do not, the queries, pages and
reports answer from the roll-ups and say so (:attr:`Detail.note`).

The answers here (:func:`finished`, :func:`state_moves`, :func:`worker_memory`,
:func:`prefix_totals`, :func:`worker_totals`, :func:`bounds`) are computed from either
source, ``"raw"`` or ``"rollups"``, by the same SQL over two relations of the same
columns: the roll-up table, or the raw rows aggregated per minute exactly as the
materialized view does (:data:`RAW_TASK_MINUTES`, :data:`RAW_WORKER_MINUTES`). While
the raw rows exist both give the same answer (tests/unit/test_rollups.py). Their time unit
is the minute: a :class:`Window` starts on a minute and its buckets are whole minutes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table

SOURCES = ("raw", "rollups")


def rollup_table(backend: Backend, name: str) -> str:
    """``<database>_rollups.name``: a roll-up of the backend's database."""
    return f"{backend.database}_rollups.{name}"

#: The raw transitions per minute, as the view ``<db>_rollups.task_minutes_mv`` rolls
#: them up (the same columns as ``task_minutes``, ``_batch`` aside).
RAW_TASK_MINUTES = (
    "SELECT cluster_id, toStartOfMinute(toDateTime(ts)) AS minute, span_id, prefix, worker, "
    "sumMap(map(toString(finish), toUInt64(1))) AS into, "
    "sumMap(map(toString(start), toUInt64(1))) AS out_of, "
    "sumMap(mapFromArrays(arrayMap(a -> toString(a), startstops.action), "
    "arrayMap((s, e) -> toFloat64(e) - toFloat64(s), startstops.start, startstops.stop))) AS durations, "
    "sumIf(ifNull(nbytes, 0), finish = 'memory') AS nbytes, "
    "max(arrayMax(arrayMap((a, s, e) -> if(a = 'compute', toFloat64(e) - toFloat64(s), 0.), "
    "startstops.action, startstops.start, startstops.stop))) AS longest, "
    "min(ts) AS first_ts, max(ts) AS last_ts "
    "FROM {transitions} WHERE source = 'scheduler' AND cluster_id = {{c:String}} "
    "GROUP BY cluster_id, minute, span_id, prefix, worker")

#: The raw worker metrics per minute, as ``<db>_rollups.worker_minutes_mv`` rolls them up.
RAW_WORKER_MINUTES = (
    "SELECT cluster_id, toStartOfMinute(toDateTime(ts)) AS minute, worker, count() AS samples, "
    "sum(ifNull(memory_managed, 0)) AS memory_managed, "
    "sum(ifNull(memory_unmanaged, ifNull(memory, 0))) AS memory_unmanaged, "
    "sum(ifNull(memory_spilled, 0)) AS memory_spilled, max(ifNull(memory, 0)) AS memory_peak, "
    "sum(ifNull(cpu, 0)) AS cpu, min(ts) AS first_ts, max(ts) AS last_ts "
    "FROM {worker_metrics} WHERE cluster_id = {{c:String}} GROUP BY cluster_id, minute, worker")


class Detail(NamedTuple):
    """How much of a cluster's history is left: ``raw`` when its raw transitions
    (or, for a cluster that ran no task, its worker metrics) still reach back to the
    start its roll-ups record, ``rollups`` when only the roll-ups do, ``none`` when
    neither holds anything of it."""

    source: str
    #: the first minute the roll-ups hold, and the first raw transition (seconds)
    rollups_since: float | None
    raw_since: float | None

    @property
    def note(self) -> str:
        """One line for a page or a command's output ('' while the raw rows are there)."""
        if self.source != "rollups":
            return ""
        if self.raw_since is None:
            return ("the raw rows of this run have expired (blackbox.clickhouse.retention): "
                    "these answers come from its per-minute roll-ups")
        return ("the raw rows of this run before the first one left have expired "
                "(blackbox.clickhouse.retention): these answers come from its per-minute roll-ups")


#: What :func:`detail` reads (from ``{transitions}``, ``{worker_metrics}``;
#: ``{task_minutes}``, ``{worker_minutes}`` filled in where it is run).
DETAIL = ("SELECT 'rollups', toFloat64(min(first_ts)), count() FROM {task_minutes} WHERE "
          "cluster_id = {{c:String}} UNION ALL SELECT 'raw', toFloat64(min(ts)), count() FROM "
          "{transitions} WHERE cluster_id = {{c:String}} AND source = 'scheduler' UNION ALL "
          "SELECT 'workers', toFloat64(min(first_ts)), count() FROM {worker_minutes} WHERE "
          "cluster_id = {{c:String}} UNION ALL SELECT 'raw workers', toFloat64(min(ts)), "
          "count() FROM {worker_metrics} WHERE cluster_id = {{c:String}}")


def detail(backend: Backend, cluster_id: str) -> Detail:
    """What is left of ``cluster_id``'s history (see :class:`Detail`)."""
    p = {"c": cluster_id}
    _, rows = backend.query(
        DETAIL.format(task_minutes=rollup_table(backend, 'task_minutes'), transitions=table(backend, 'transitions'), worker_minutes=rollup_table(backend, 'worker_minutes'), worker_metrics=table(backend, 'worker_metrics')), p)
    found = {name: (first if n else None) for name, first, n in rows}
    rolled, raw = found.get("rollups"), found.get("raw")
    if rolled is None:  # no task ever ran: judge by the worker metrics
        rolled, raw = found.get("workers"), found.get("raw workers")
    if rolled is None and raw is None:
        return Detail("none", None, None)
    if raw is not None and (rolled is None or raw <= rolled + 60.0):
        return Detail("raw", rolled, raw)
    return Detail("rollups", rolled, raw)


class Window(NamedTuple):
    """One cluster, whole minutes ``[t0, t1)`` (seconds since the epoch), in buckets
    of ``bucket`` seconds (a whole number of minutes), optionally only the tasks of
    ``span_ids``."""

    cluster_id: str
    t0: float
    t1: float
    bucket: float = 60.0
    span_ids: list[str] | None = None

    @classmethod
    def around(cls, cluster_id: str, t0: float, t1: float, buckets: int,
               span_ids: list[str] | None = None) -> Window:
        """The window of whole minutes covering ``[t0, t1]`` in at most ``buckets``
        buckets."""
        start = math.floor(t0 / 60.0) * 60.0
        stop = max(math.floor(t1 / 60.0) * 60.0 + 60.0, start + 60.0)
        minutes = (stop - start) / 60.0
        bucket = 60.0 * max(1, math.ceil(minutes / max(buckets, 1)))
        return cls(cluster_id, start, stop, bucket, span_ids)

    @property
    def n_buckets(self) -> int:
        return max(1, math.ceil((self.t1 - self.t0) / self.bucket))


def _relation(backend: Backend, name: str, source: str) -> str:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    if source == "rollups":
        return rollup_table(backend, name)
    raw = RAW_TASK_MINUTES if name == "task_minutes" else RAW_WORKER_MINUTES
    return "(" + raw.format(transitions=table(backend, "transitions"),
                            worker_metrics=table(backend, "worker_metrics")) + ")"


def _where(w: Window, spans: bool = True) -> tuple[str, dict]:
    conditions = ["cluster_id = {c:String}", "minute >= toDateTime({t0:Float64}, 'UTC')",
                  "minute < toDateTime({t1:Float64}, 'UTC')"]
    p: dict = {"c": w.cluster_id, "t0": w.t0, "t1": w.t1}
    if spans and w.span_ids is not None:
        conditions.append("span_id IN {ids:Array(String)}")
        p["ids"] = w.span_ids
    return "WHERE " + " AND ".join(conditions), p


_BUCKET = "toUInt32(intDiv(toUInt32(minute) - toUInt32({t0:Float64}), toUInt32({w:Float64})))"


#: What :func:`finished` reads (``{_BUCKET}``, ``{task_minutes}``, ``{where}`` filled in
#: where it is run).
FINISHED = ("SELECT prefix, {_BUCKET} AS b, sum(into['memory']), sum(into['erred']) FROM "
            "{task_minutes} {where} GROUP BY prefix, b HAVING sum(into['memory']) + "
            "sum(into['erred']) > 0")


def finished(backend: Backend, w: Window, source: str) -> dict[tuple[str, int], tuple[int, int]]:
    """(prefix, bucket) -> scheduler transitions into memory and into erred."""
    where, p = _where(w)
    p["w"] = w.bucket
    _, rows = backend.query(
        FINISHED.format(_BUCKET=_BUCKET, task_minutes=_relation(backend, 'task_minutes', source), where=where), p)
    return {(prefix, int(b)): (int(m), int(e)) for prefix, b, m, e in rows}


#: What :func:`state_moves` reads (``{bucket}``, ``{task_minutes}``, ``{where}`` filled in
#: where it is run).
STATE_MOVES = ("SELECT state, b, sum(d) FROM (SELECT {bucket} AS b, "
               "arrayJoin(arrayConcat(arrayZip(mapKeys(into), arrayMap(v -> toInt64(v), "
               "mapValues(into))), arrayZip(mapKeys(out_of), arrayMap(v -> -toInt64(v), "
               "mapValues(out_of))))) AS move, move.1 AS state, move.2 AS d FROM "
               "{task_minutes} {where}) GROUP BY state, b HAVING sum(d) != 0")


def state_moves(backend: Backend, w: Window, source: str) -> dict[tuple[str, int], int]:
    """(state, bucket) -> transitions into it minus transitions out of it (bucket -1:
    everything before the window, the levels it starts from)."""
    where, p = _where(w)
    p["w"] = w.bucket
    where = where.replace("minute >= toDateTime({t0:Float64}, 'UTC') AND ", "")
    bucket = f"if(minute < toDateTime({{t0:Float64}}, 'UTC'), -1, toInt64({_BUCKET}))"
    _, rows = backend.query(
        STATE_MOVES.format(bucket=bucket, task_minutes=_relation(backend, 'task_minutes', source), where=where), p)
    return {(state, int(b)): int(d) for state, b, d in rows}


#: What :func:`worker_memory` reads (``{_BUCKET}``, ``{worker_minutes}``, ``{where}`` filled
#: in where it is run).
WORKER_MEMORY = ("SELECT worker, {_BUCKET} AS b, sum(memory_managed) / sum(samples), "
                 "sum(memory_unmanaged) / sum(samples), sum(memory_spilled) / sum(samples), "
                 "sum(samples) FROM {worker_minutes} {where} GROUP BY worker, b")


def worker_memory(backend: Backend, w: Window, source: str) -> dict[tuple[str, int], tuple]:
    """(worker, bucket) -> the average managed, unmanaged and spilled memory of its
    samples, and their count."""
    where, p = _where(w, spans=False)
    p["w"] = w.bucket
    _, rows = backend.query(
        WORKER_MEMORY.format(_BUCKET=_BUCKET, worker_minutes=_relation(backend, 'worker_minutes', source), where=where), p)
    return {(worker, int(b)): (m, u, s, int(n)) for worker, b, m, u, s, n in rows}


class Totals(NamedTuple):
    """What the tasks of a prefix (or a worker) did over a window."""

    memory: int
    erred: int
    durations: dict[str, float]
    nbytes: int
    longest: float


def prefix_totals(backend: Backend, w: Window, source: str) -> dict[str, Totals]:
    """prefix -> :class:`Totals` of the scheduler transitions in the window."""
    return _totals(backend, w, source, "prefix")


def worker_totals(backend: Backend, w: Window, source: str) -> dict[str, Totals]:
    """worker -> :class:`Totals` (the worker Dask passed with the transition; '' for
    transitions that name none)."""
    return _totals(backend, w, source, "worker")


#: What :func:`_totals` reads (``{by}``, ``{task_minutes}``, ``{where}`` filled in where it
#: is run).
TOTALS = ("SELECT {by}, sum(into['memory']), sum(into['erred']), sumMap(durations), "
          "sum(nbytes), max(longest) FROM {task_minutes} {where} GROUP BY {by}")


def _totals(backend: Backend, w: Window, source: str, by: str) -> dict[str, Totals]:
    where, p = _where(w)
    _, rows = backend.query(
        TOTALS.format(by=by, task_minutes=_relation(backend, 'task_minutes', source), where=where), p)
    return {key: Totals(int(m), int(e), dict(d), int(n), float(longest))
            for key, m, e, d, n, longest in rows}


#: What :func:`bounds` reads (``{task_minutes}``, ``{spans}`` filled in where it is run).
BOUNDS = ("SELECT toFloat64(min(first_ts)), toFloat64(max(last_ts)), count() FROM "
          "{task_minutes} WHERE cluster_id = {{c:String}}{spans}")


def bounds(backend: Backend, cluster_id: str, source: str,
           span_ids: list[str] | None = None) -> tuple[float, float] | None:
    """The first and last scheduler transition of the cluster (of ``span_ids``), or
    None."""
    p: dict = {"c": cluster_id}
    spans = ""
    if span_ids is not None:
        spans = " AND span_id IN {ids:Array(String)}"
        p["ids"] = span_ids
    _, rows = backend.query(
        BOUNDS.format(task_minutes=_relation(backend, 'task_minutes', source), spans=spans),
        p)
    if not rows or not rows[0][2]:
        return None
    return float(rows[0][0]), float(rows[0][1])


def levels(moves: dict[tuple[str, int], int], states: tuple[str, ...],
           n_buckets: int) -> dict[str, list[int]]:
    """Tasks in each of ``states`` at the end of each bucket, from :func:`state_moves`."""
    base: dict[str, int] = defaultdict(int)
    deltas: dict[str, list[int]] = {}
    for (state, b), d in moves.items():
        if state not in states:
            continue
        if b < 0:
            base[state] += d
        else:
            deltas.setdefault(state, [0] * n_buckets)[min(b, n_buckets - 1)] += d
    series = {}
    for state in states:
        if state not in deltas and not base.get(state):
            continue
        level, out = base.get(state, 0), []
        for d in deltas.get(state, [0] * n_buckets):
            level += d
            out.append(level)
        series[state] = out
    return series
