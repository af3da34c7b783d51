"""The workers of a run: the Workers panel (one row per worker over the run) and the
data of a worker's own page.

A worker is an address the scheduler knew (``scheduler_start``'s list of the workers
there before the recording, ``worker_added``), or one that reported metrics or ran a
task. What the scheduler said of it when it joined is Dask's ``Scheduler.workers``
entry: its name, threads (``WorkerState.nthreads``), memory limit
(``WorkerState.memory_limit``), process id and nanny.

The panel's columns, per worker, over the whole run:

``threads``, ``memory_limit``    as the scheduler recorded them when it joined (the
                                 nanny's record of its end for a memory limit the
                                 scheduler did not give);
``memory_peak``                  the highest process memory (RSS) it sampled;
``managed_peak``, ``spilled_peak`` the highest managed and spilled bytes sampled;
``cpu_mean``                     its samples' mean CPU, in percent of one core;
``tasks``, ``erred``             computes it began (its task stream's bars), and of
                                 them those of tasks that erred (page aggregates);
``bytes_in``, ``bytes_out``      bytes fetched from other workers for the tasks it ran,
                                 and fetched from it for tasks others ran: each
                                 dependency once per worker that ran a dependent
                                 elsewhere, from the recorded graph (the rule of
                                 :mod:`.cost`'s ``moved_bytes``, which they add up to;
                                 None without a recorded graph);
                                 Above :data:`MOVED_MAX_TASKS` tasks in the run
                                 the count (a join of the whole graph with every
                                 task's worker) is made only when asked for
                                 (``count_bytes``): ``bytes_deferred`` says so;
``first_seen``, ``last_seen``    its joining (or first sample or task) and its removal
                                 (or last sample or task);
``ended``                        how it ended: the cause :mod:`.diagnosis` gives its
                                 removal (``died`` true for a death), or "there at the
                                 close" / "still there" without a removal.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from dask_blackbox.read import aggregates
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


def info(backend: Backend, cluster_id: str) -> dict[str, dict]:
    """Per worker address: what the scheduler recorded when it joined -- ``name``,
    ``nthreads``, ``memory_limit``, ``pid``, ``nanny`` (None where unknown), ``added``
    (its ``worker_added`` time; None for a worker there before the recording) -- and
    ``removed``, the time of its removal (None if it was not removed)."""
    _, rows = backend.query(
        "SELECT toFloat64(ts), action, worker, detail "
        f"FROM {_t(backend, 'lifecycle')} WHERE cluster_id = {{c:String}} "
        "AND action IN ('scheduler_start', 'worker_added', 'worker_removed') ORDER BY ts",
        {"c": cluster_id})
    out: dict[str, dict] = {}

    def joined(address: str, ts: float | None, d: dict) -> None:
        name = d.get("name")
        out[address] = {"name": None if name is None else str(name), "nthreads": _int(d.get("nthreads")),
                        "memory_limit": _int(d.get("memory_limit")), "pid": _int(d.get("pid")),
                        "nanny": d.get("nanny") if isinstance(d.get("nanny"), str) else None,
                        "added": ts, "removed": None}

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
                                    "nanny": None, "added": None, "removed": None})["removed"] = ts
    _, exits = backend.query(
        f"SELECT worker, max(memory_limit) FROM {_t(backend, 'worker_exits')} "
        "WHERE cluster_id = {c:String} AND worker != '' GROUP BY worker", {"c": cluster_id})
    for worker, limit in exits:
        if worker in out and out[worker]["memory_limit"] is None and limit:
            out[worker]["memory_limit"] = int(limit)
    return out


def nthreads(backend: Backend, cluster_id: str, known: dict | None = None) -> dict[str, int]:
    """Per worker, its threads as the scheduler recorded them. ``known``: the run's
    :func:`info`, if already known."""
    known = info(backend, cluster_id) if known is None else known
    return {w: i["nthreads"] for w, i in known.items() if i["nthreads"]}


def _samples(backend: Backend, cluster_id: str) -> dict[str, tuple]:
    _, rows = backend.query(
        "SELECT worker, max(memory), max(memory_managed), max(memory_spilled), avg(cpu), "
        "toFloat64(min(ts)), toFloat64(max(ts)), count() "
        f"FROM {_t(backend, 'worker_metrics')} WHERE cluster_id = {{c:String}} GROUP BY worker",
        {"c": cluster_id})
    return {r[0]: r[1:] for r in rows}


def moved_bytes(backend: Backend, cluster_id: str) -> dict[tuple[str, str], int] | None:
    """Bytes fetched between workers, per (sender, receiver): each dependency once per
    worker that ran a dependent and did not hold it (where the dependency finished
    last), from the recorded graph; None when no graph was recorded."""
    g, t = _t(backend, "graph_tasks"), _t(backend, "transitions")
    _, graphed = backend.query(f"SELECT count() FROM {g} WHERE cluster_id = {{c:String}} LIMIT 1",
                               {"c": cluster_id})
    if not graphed or not graphed[0][0]:
        return None
    # fin: each task's last worker and size in memory; each dependency edge (kh -> dh)
    # looks both of its ends up in one join (two rows per edge, then paired again),
    # so fin is computed once
    _, rows = backend.query(
        f"WITH fin AS (SELECT cityHash64(key) AS kh, argMax(worker, ts) AS worker, "
        f"argMax(ifNull(nbytes, 0), ts) AS nbytes FROM {t} "
        "WHERE cluster_id = {c:String} AND source = 'scheduler' "
        "AND start = 'processing' AND finish = 'memory' GROUP BY kh) "
        "SELECT sender, dest, sum(n) FROM ("
        " SELECT dh, dest, any(sender) AS sender, any(n) AS n FROM ("
        "  SELECT e.kh, e.dh AS dh, anyIf(f.worker, e.is_dest) AS dest, "
        "   anyIf(f.worker, NOT e.is_dest) AS sender, anyIf(f.nbytes, NOT e.is_dest) AS n, "
        "   count() AS ends FROM ("
        "   SELECT kh, dh, arrayJoin([(kh, true), (dh, false)]) AS side, side.1 AS h, "
        "    side.2 AS is_dest FROM ("
        f"    SELECT DISTINCT cityHash64(key) AS kh, cityHash64(arrayJoin(dependencies)) AS dh FROM {g} "
        "    WHERE cluster_id = {c:String})) AS e INNER JOIN fin AS f ON f.kh = e.h "
        "  GROUP BY e.kh, e.dh HAVING ends = 2) GROUP BY dh, dest) "
        "WHERE sender != dest GROUP BY sender, dest",
        {"c": cluster_id})
    return {(sender, receiver): int(n) for sender, receiver, n in rows}


def workers(backend: Backend, scope, found: list | None = None,
            moved: dict | None = None, bytes_deferred: bool = False,
            known: dict | None = None) -> dict:
    """The Workers panel of ``scope``'s run (see the module docstring): ``workers`` (one
    row each, in the order they joined), ``graph`` (whether bytes in and out could be
    counted) and ``bytes_deferred``. ``found``: the run's :func:`diagnosis.deaths`, if
    already known; ``moved``: its :func:`moved_bytes`, if already known, unless
    ``bytes_deferred`` (then bytes in and out are None); ``known``: its :func:`info`, if
    already known."""
    from dask_blackbox.read import diagnosis

    cid = scope.cluster_id
    known = info(backend, cid) if known is None else known
    samples = _samples(backend, cid)
    ran = aggregates.per_worker(backend, cid)
    if not bytes_deferred and moved is None:
        moved = moved_bytes(backend, cid)
    found = diagnosis.deaths(backend, [cid]) if found is None else found
    ended = {d.worker: d for d in found}
    _, closed = backend.query(
        f"SELECT countIf(action = 'scheduler_close') FROM {_t(backend, 'lifecycle')} "
        "WHERE cluster_id = {c:String}", {"c": cid})
    was_closed = bool(closed and closed[0][0])
    bytes_in: dict[str, int] = defaultdict(int)
    bytes_out: dict[str, int] = defaultdict(int)
    for (sender, receiver), n in (moved or {}).items():
        bytes_out[sender] += n
        bytes_in[receiver] += n
    addresses = set(known) | set(samples) | {w for w in ran if w}
    rows = []
    for w in addresses:
        k = known.get(w, {})
        s = samples.get(w)
        r = ran.get(w, {})
        seen = [t for t in (k.get("added"), s[4] if s else None) if t]
        last = [t for t in (k.get("removed"), s[5] if s else None) if t]
        death = ended.get(w)
        if death is not None:
            how = {"cause": death.verdict.cause.value, "label": death.verdict.cause.label,
                   "died": death.is_death, "explanation": death.verdict.explanation,
                   "confidence": death.verdict.confidence, "ts": death.ts}
        else:
            how = {"cause": None, "label": "there at the close" if was_closed else "still there",
                   "died": False, "explanation": "", "confidence": None, "ts": None}
        rows.append({
            "worker": w, "name": k.get("name"), "threads": k.get("nthreads"),
            "memory_limit": k.get("memory_limit"), "pid": k.get("pid"), "nanny": k.get("nanny"),
            "memory_peak": s[0] if s else None, "managed_peak": s[1] if s else None,
            "spilled_peak": s[2] if s else None, "cpu_mean": s[3] if s else None,
            "samples": s[6] if s else 0,
            "tasks": r.get("tasks", 0), "erred": r.get("erred", 0),
            "compute_s": r.get("compute_s", 0.0), "transfer_s": r.get("transfer_s", 0.0),
            "bytes_in": bytes_in.get(w, 0) if moved is not None else None,
            "bytes_out": bytes_out.get(w, 0) if moved is not None else None,
            "first_seen": min(seen) if seen else None, "last_seen": max(last) if last else None,
            "ended": how})
    rows.sort(key=lambda r: (r["first_seen"] if r["first_seen"] is not None else float("inf"),
                             r["worker"]))
    return {"workers": rows, "graph": moved is not None, "bytes_deferred": bytes_deferred,
            "n_workers": len(rows),
            "deaths": sum(1 for r in rows if r["ended"]["died"])}


def series(backend: Backend, scope, worker: str, buckets: int) -> dict[str, Any]:
    """One worker's metrics over the scope's window, per time bucket: ``times`` (bucket
    middles), process memory (mean and highest sample), managed, unmanaged and
    spilled (means), CPU (mean percent), executing, ready and in flight (means)."""
    w = max(scope.bucket, (scope.t1 - scope.t0) / buckets)
    _, rows = backend.query(
        "SELECT toUInt32(floor((toFloat64(ts) - {t0:Float64}) / {w:Float64})) AS b, "
        "avg(memory), max(memory), avg(memory_managed), avg(ifNull(memory_unmanaged, memory)), "
        "avg(memory_spilled), avg(cpu), avg(executing), avg(ready), avg(in_flight) "
        f"FROM {_t(backend, 'worker_metrics')} WHERE cluster_id = {{c:String}} "
        "AND worker = {worker:String} AND ts >= toDateTime64({t0:Float64}, 6, 'UTC') "
        "AND ts <= toDateTime64({t1:Float64}, 6, 'UTC') GROUP BY b ORDER BY b",
        {"c": scope.cluster_id, "worker": worker, "t0": scope.t0, "t1": scope.t1, "w": w})
    names = ("memory", "memory_max", "managed", "unmanaged", "spilled", "cpu", "executing",
             "ready", "in_flight")
    out: dict[str, Any] = {"times": [scope.t0 + (b + 0.5) * w for b, *_ in rows]}
    for i, name in enumerate(names, start=1):
        out[name] = [r[i] for r in rows]
    return out
