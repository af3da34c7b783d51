"""The workers of a run as the scheduler recorded them, what the views of a page
share about them: what the scheduler said of each when it joined (:func:`info`: Dask's
``Scheduler.workers`` entry: its name, threads (``WorkerState.nthreads``), memory limit
(``WorkerState.memory_limit``), process id and nanny; its removal; the memory at which
its nanny kills it), its threads (:func:`nthreads`) and the bytes moved between
workers (:func:`moved_bytes`). The Workers panel is :mod:`.views.workers`.
"""

from __future__ import annotations

import json

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t


#: Tasks in a run above which bytes in and out are counted only when asked for.
MOVED_MAX_TASKS = 200_000


def _detail(text) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) and text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: What :func:`info` reads (from ``{lifecycle}``).
WORKER_LIFECYCLE = ("SELECT toFloat64(ts), action, worker, detail FROM {lifecycle} WHERE cluster_id = "
                    "{{c:String}} AND action IN ('scheduler_start', 'worker_added', 'worker_removed') "
                    "ORDER BY ts")
#: What :func:`info` reads (from ``{worker_exits}``).
MEMORY_LIMITS = ("SELECT worker, max(memory_limit), max(memory_limit * memory_terminate) FROM "
                 "{worker_exits} WHERE cluster_id = {{c:String}} AND worker != '' GROUP BY worker")


def info(backend: Backend, cluster_id: str) -> dict[str, dict]:
    """Per worker address: what the scheduler recorded when it joined -- ``name``,
    ``nthreads``, ``memory_limit``, ``pid``, ``nanny`` (None where unknown), ``added``
    (its ``worker_added`` time; None for a worker there before the recording) --,
    ``removed``, the time of its removal (None if it was not removed), and
    ``memory_kill``: the process memory at which its nanny kills it, its memory limit
    times ``distributed.worker.memory.terminate`` as the nanny recorded them when the
    process ended (None without that record, or with terminating off)."""
    _, rows = backend.query(
        WORKER_LIFECYCLE.format(lifecycle=_t(backend, 'lifecycle')),
        {"c": cluster_id})
    out: dict[str, dict] = {}

    def joined(address: str, ts: float | None, d: dict) -> None:
        name = d.get("name")
        out[address] = {"name": None if name is None else str(name), "nthreads": _int(d.get("nthreads")),
                        "memory_limit": _int(d.get("memory_limit")), "pid": _int(d.get("pid")),
                        "nanny": d.get("nanny") if isinstance(d.get("nanny"), str) else None,
                        "added": ts, "removed": None, "memory_kill": None}

    for ts, action, worker, detail in rows:
        d = _detail(detail)
        if action == "scheduler_start":
            there = d.get("workers")
            for address, w in (there.items() if isinstance(there, dict) else ()):
                if isinstance(w, dict):
                    joined(str(address), None, w)
        elif action == "worker_added" and worker:
            joined(worker, ts, d)
        elif action == "worker_removed" and worker:
            out.setdefault(worker, {"name": None, "nthreads": None, "memory_limit": None, "pid": None,
                                    "nanny": None, "added": None, "removed": None,
                                    "memory_kill": None})["removed"] = ts
    _, exits = backend.query(
        MEMORY_LIMITS.format(worker_exits=_t(backend, 'worker_exits')), {"c": cluster_id})
    for worker, limit, kill in exits:
        if worker not in out:
            continue
        if out[worker]["memory_limit"] is None and limit:
            out[worker]["memory_limit"] = int(limit)
        if kill:
            out[worker]["memory_kill"] = int(kill)
    return out


def nthreads(backend: Backend, cluster_id: str, known: dict | None = None) -> dict[str, int]:
    """Per worker, its threads as the scheduler recorded them. ``known``: the run's
    :func:`info`, if already known."""
    known = info(backend, cluster_id) if known is None else known
    return {w: i["nthreads"] for w, i in known.items() if i["nthreads"]}


#: Whether the graph ``{g}`` holds a row of the cluster.
HAS_GRAPH = "SELECT count() FROM {g} WHERE cluster_id = {{c:String}} LIMIT 1"
#: What :func:`moved_bytes` reads (the transitions ``{t}``, the graph ``{g}``).
BYTES_MOVED = ("WITH fin AS (SELECT cityHash64(key) AS kh, argMax(worker, ts) AS worker, "
               "argMax(ifNull(nbytes, 0), ts) AS nbytes FROM {t} WHERE cluster_id = "
               "{{c:String}} AND source = 'scheduler' AND start = 'processing' AND finish = "
               "'memory' GROUP BY kh) SELECT sender, dest, sum(n) FROM ( SELECT dh, dest, "
               "any(sender) AS sender, any(n) AS n FROM (  SELECT e.kh, e.dh AS dh, "
               "anyIf(f.worker, e.is_dest) AS dest,    anyIf(f.worker, NOT e.is_dest) AS "
               "sender, anyIf(f.nbytes, NOT e.is_dest) AS n,    count() AS ends FROM (   "
               "SELECT kh, dh, arrayJoin([(kh, true), (dh, false)]) AS side, side.1 AS h,   "
               "  side.2 AS is_dest FROM (    SELECT DISTINCT cityHash64(key) AS kh, "
               "cityHash64(arrayJoin(dependencies)) AS dh FROM {g}     WHERE cluster_id = "
               "{{c:String}})) AS e INNER JOIN fin AS f ON f.kh = e.h   GROUP BY e.kh, e.dh "
               "HAVING ends = 2) GROUP BY dh, dest) WHERE sender != dest GROUP BY sender, "
               "dest")


def moved_bytes(backend: Backend, cluster_id: str) -> dict[tuple[str, str], int] | None:
    """Bytes fetched between workers, per (sender, receiver): each dependency once per
    worker that ran a dependent and did not hold it (where the dependency finished
    last), from the recorded graph; None when no graph was recorded."""
    g, t = _t(backend, "graph_tasks"), _t(backend, "transitions")
    _, graphed = backend.query(HAS_GRAPH.format(g=g),
                               {"c": cluster_id})
    if not graphed or not graphed[0][0]:
        return None
    # fin: each task's last worker and size in memory; each dependency edge (kh -> dh)
    # looks both of its ends up in one join (two rows per edge, then paired again),
    # so fin is computed once
    _, rows = backend.query(
        BYTES_MOVED.format(t=t, g=g),
        {"c": cluster_id})
    return {(sender, receiver): int(n) for sender, receiver, n in rows}
