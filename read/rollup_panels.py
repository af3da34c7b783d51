"""The Run page's panels from a run's per-minute roll-ups, once its raw rows have
expired (read/history.py decides; :func:`dask_blackbox.read.views.run_data` calls
these then).

Each returns the dict its namesake in :mod:`.panels` returns, so the page and the
report draw it the same way, at the roll-ups' grain: buckets of whole minutes
(:class:`~dask_blackbox.read.history.Window`), and a task's work counted in the
minute of the transition that reported it. What the roll-ups cannot say is said:
``tasks`` counts the tasks that finished (into memory or erred) -- a task recomputed
after a worker died counts twice, where the raw rows count distinct keys -- and the
task stream is binned per worker (busy: compute seconds over the threads' seconds).
The panels the raw rows alone can fill (the task stream's bars, fine performance
metrics, logs, erred tasks' exceptions, the critical path) are answered by
:mod:`.panels` from what is left, which is nothing, under the page's note."""

from __future__ import annotations


from dask_blackbox.read import history, panels
from dask_blackbox.read.backends import Backend

#: Time buckets across the window (as the raw panels).
BUCKETS = 300
#: Task states drawn in "tasks by state" (see :data:`dask_blackbox.read.panels.STATES`).
STATES = ("waiting", "no-worker", "queued", "processing", "memory", "erred")


def window(scope) -> history.Window:
    return history.Window.around(scope.cluster_id, scope.t0, scope.t1, BUCKETS, scope.span_ids)


def _times(w: history.Window) -> list[float]:
    return [w.t0 + (i + 1) * w.bucket for i in range(w.n_buckets)]


def progress(backend: Backend, scope) -> dict:
    """:func:`panels.progress` from ``task_minutes`` (:func:`panels.progress_series`):
    per prefix the fraction of its finished tasks finished by each bucket's end;
    ``totals`` and ``counts['tasks']`` are tasks finished (memory or erred)."""
    w = window(scope)
    finished = history.finished(backend, w, "rollups")
    per_prefix: dict[str, dict] = {}
    for (prefix, _), (memory, erred) in finished.items():
        c = per_prefix.setdefault(prefix or "(none)", {"tasks": 0, "memory": 0, "erred": 0})
        c["memory"] += memory
        c["erred"] += erred
        c["tasks"] += memory + erred
    rows = [(prefix, b, memory + erred) for (prefix, b), (memory, erred) in finished.items()]
    return panels.progress_series(per_prefix, rows, w.n_buckets, _times(w))


def summary(scope, progress_data: dict) -> dict:
    totals = progress_data["counts"]
    return {**scope.as_dict(), "tasks": sum(c["tasks"] for c in totals.values()),
            "finished_in_memory": sum(c["memory"] for c in totals.values()),
            "erred": sum(c["erred"] for c in totals.values())}


def task_states(backend: Backend, scope) -> dict:
    """:func:`panels.task_states` from ``task_minutes`` (transitions into and out of
    each state per minute)."""
    w = window(scope)
    moves = history.state_moves(backend, w, "rollups")
    return {"times": _times(w), "series": history.levels(moves, STATES, w.n_buckets)}


def memory(backend: Backend, scope, dead: list[str] | None = None, shown: int = 32) -> dict:
    """:func:`panels.memory` from ``worker_minutes``: per bucket the average of each
    worker's samples."""
    w = window(scope)
    cells = history.worker_memory(backend, w, "rollups")
    out = panels.memory_series(
        [(worker, b, managed, unmanaged, spilled)
         for (worker, b), (managed, unmanaged, spilled, _) in sorted(cells.items())],
        w.t0, w.bucket, dead, shown)
    del out["buckets"]
    return out


def task_stream(backend: Backend, scope, threads: dict[str, int]) -> dict:
    """:func:`panels.task_stream` in its binned mode, from ``task_minutes``: per
    worker and bucket, the compute seconds reported in it over the seconds its
    ``threads`` offered, and the prefix that took most of them."""
    w = window(scope)
    where = ["cluster_id = {c:String}", "minute >= toDateTime({t0:Float64}, 'UTC')",
             "minute < toDateTime({t1:Float64}, 'UTC')", "worker != ''"]
    p: dict = {"c": w.cluster_id, "t0": w.t0, "t1": w.t1, "w": w.bucket}
    if w.span_ids is not None:
        where.append("span_id IN {ids:Array(String)}")
        p["ids"] = w.span_ids
    _, rows = backend.query(
        "SELECT worker, b, sum(compute), argMax(prefix, compute), sum(n) FROM ("
        " SELECT worker, prefix, toUInt32(intDiv(toUInt32(minute) - toUInt32({t0:Float64}), "
        " toUInt32({w:Float64}))) AS b, sumMap(durations)['compute'] AS compute, "
        " sum(into['memory']) + sum(into['erred']) AS n "
        f" FROM {history.rollup_table(backend, 'task_minutes')} WHERE {' AND '.join(where)} "
        " GROUP BY worker, prefix, b) GROUP BY worker, b ORDER BY worker, b", p)
    workers = sorted({r[0] for r in rows})
    return {
        "max_bars": 0, "bars_recorded": int(sum(r[4] for r in rows)),
        "computes_recorded": int(sum(r[4] for r in rows)), "mode": "binned",
        "bucket": w.bucket, "rows": workers, "from_rollups": True,
        "cells": [{"worker": worker, "row": workers.index(worker),
                   "start": w.t0 + b * w.bucket, "stop": w.t0 + (b + 1) * w.bucket,
                   "busy": min(1.0, compute / w.bucket / max(threads.get(worker) or 1, 1)),
                   "prefix": prefix, "tasks": int(n)}
                  for worker, b, compute, prefix, n in rows],
    }
