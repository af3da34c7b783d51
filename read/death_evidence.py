"""The evidence of the deaths :mod:`.diagnosis` diagnoses: per removal, the tasks
the worker was running, the log lines about its process (its nanny's, the
scheduler's) and its own last warnings, its last metric sample, and all of it in one
timeline.
"""

from __future__ import annotations

from collections import defaultdict

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import clusters_condition, table
from dask_blackbox.read.statements import TAKEN_OUT_OF_PROCESSING

#: Log lines shown per death: about its process (nanny, scheduler), and its own last
#: warnings and errors.
LOG_LINES = 8
#: Window around a death in which log lines about it are looked for (seconds).
LOG_WINDOW_S = 30.0


def _timeline(row: dict) -> list[dict]:
    """A death's evidence, its log lines and its last metric sample in one list, by
    time: ``ts``, ``source`` (a table, ``logs`` with its level, or ``metrics``),
    ``text``."""
    out = [dict(e) for e in row["evidence"]]
    for line in row.get("logs", []):
        where = line["source"] + (f" {line['worker']}" if line["worker"] else "")
        out.append({"ts": line["ts"], "source": f"logs {line['level']}",
                    "text": f"{line['logger']} ({where}): {line['message']}"})
    m = row.get("metrics")
    if m:
        out.append({"ts": m["ts"], "source": "metrics",
                    "text": f"last sample: memory {_size(m['memory'])}, managed "
                            f"{_size(m['memory_managed'])}, executing {m['executing']}, "
                            f"ready {m['ready']}"})
    return sorted(out, key=lambda e: e["ts"])


def _size(n: int | None) -> str:
    from dask.utils import format_bytes

    return format_bytes(n) if n is not None else "?"


def _death_evidence(backend: Backend, found: list, lines: int) -> dict:
    """(cluster_id, stimulus_id, worker) -> tasks, logs and metrics of that removal."""
    if not found:
        return {}
    clusters = sorted({d.cluster_id for d in found})
    cwhere, cp = clusters_condition(clusters)
    stimuli = sorted({d.stimulus_id for d in found if d.stimulus_id})
    _, tasks = backend.query(TAKEN_OUT_OF_PROCESSING.format(
        transitions=table(backend, "transitions"), where=f"WHERE {cwhere}"),
        {**cp, "stimuli": stimuli})
    tasks_of: dict[tuple[str, str], list] = defaultdict(list)
    for c, stimulus_id, k, prefix, _, _, finish, _ in tasks:
        tasks_of[(c, stimulus_id)].append({"key": k, "prefix": prefix, "finish": finish})
    logs, metrics = _logs_about(backend, found, lines), _last_metrics(backend, found)
    return {(d.cluster_id, d.stimulus_id, d.worker): {
                "tasks": tasks_of.get((d.cluster_id, d.stimulus_id), []),
                "logs": logs[i], "metrics": metrics[i]}
            for i, d in enumerate(found)}


def _each_death(found: list) -> tuple[str, dict]:
    """Array parameters naming each death (``cs``, ``ws``, ``ts``: its cluster, worker
    and time, 1-based as ClickHouse's arrays) and the SQL of their numbers, so one
    statement answers for every death (``ARRAY JOIN`` of the deaths a row concerns)."""
    return ("range(1, length({ws:Array(String)}) + 1)",
            {"cs": [d.cluster_id for d in found], "ws": [d.worker for d in found],
             "ts": [float(d.ts) for d in found]})


#: What :func:`_logs_about` reads (``{columns}``, ``{logs}``, ``{deaths}`` filled in where
#: it is run).
LOGS_ABOUT = ("SELECT * FROM (SELECT i, {columns} FROM {logs} ARRAY JOIN arrayFilter(i -> "
              "cluster_id = {{cs:Array(String)}}[i] AND toFloat64(ts) >= "
              "{{ss:Array(Float64)}}[i] AND toFloat64(ts) <= {{ts:Array(Float64)}}[i] + 10 "
              "AND (position(message, {{ws:Array(String)}}[i]) > 0 OR position(message, "
              "{{pids:Array(String)}}[i]) > 0 OR position(message, "
              "{{pidqs:Array(String)}}[i]) > 0), {deaths}) AS i WHERE cluster_id IN "
              "{{cs:Array(String)}} AND toFloat64(ts) >= arrayMin({{ss:Array(Float64)}}) AND "
              "toFloat64(ts) <= arrayMax({{ts:Array(Float64)}}) + 10 ORDER BY t DESC LIMIT "
              "{{n:UInt32}} BY i) UNION ALL SELECT * FROM (SELECT i, {columns} FROM {logs} "
              "ARRAY JOIN arrayFilter(i -> cluster_id = {{cs:Array(String)}}[i] AND worker = "
              "{{ws:Array(String)}}[i] AND toFloat64(ts) <= {{ts:Array(Float64)}}[i] + 1 AND "
              "toFloat64(ts) >= {{ss:Array(Float64)}}[i] - 600, {deaths}) AS i WHERE "
              "cluster_id IN {{cs:Array(String)}} AND worker IN {{ws:Array(String)}} AND "
              "level IN ('WARNING', 'ERROR', 'CRITICAL') ORDER BY t DESC LIMIT {{n:UInt32}} "
              "BY i)")


def _logs_about(backend: Backend, found: list, lines: int) -> list[list[dict]]:
    """Per death (in ``found``'s order), the log lines about the removed worker's
    process (any process's lines naming its address or "Worker process <pid>", around
    the removal; at most ``lines``) and its own last warnings and errors before it (at
    most ``lines``), oldest first; one statement for every death."""
    deaths, p = _each_death(found)
    # from a little after it joined: the lines of its registration say nothing of its end
    p["ss"] = [d.ts - LOG_WINDOW_S if d.added is None else max(d.ts - LOG_WINDOW_S, min(d.added + 0.2, d.ts))
               for d in found]
    p["pids"] = [f"Worker process {d.pid} " if d.pid is not None else "\x00" for d in found]
    p["pidqs"] = [f"(pid={d.pid})" if d.pid is not None else "\x00" for d in found]
    p["n"] = lines
    columns = "toFloat64(ts) AS t, level, source, worker, logger, message, seq, idx"
    logs = table(backend, "logs")
    _, rows = backend.query(LOGS_ABOUT.format(columns=columns, logs=logs, deaths=deaths), p)
    per: list[set] = [set() for _ in found]
    for i, *line in rows:
        per[i - 1].add(tuple(line))  # a line may match both
    return [[{"ts": t, "level": lv, "source": src, "worker": w, "logger": lg, "message": m}
             for t, lv, src, w, lg, m, _, _ in sorted(lines_, key=lambda r: (r[0], r[6], r[7]))]
            for lines_ in per]


#: What :func:`_last_metrics` reads (from ``{worker_metrics}``; ``{deaths}`` filled in where
#: it is run).
LAST_METRICS = ("SELECT i, toFloat64(ts) AS ts, memory, memory_managed, memory_unmanaged, "
                "cpu, executing, ready FROM {worker_metrics} ARRAY JOIN arrayFilter(i -> "
                "cluster_id = {{cs:Array(String)}}[i] AND worker = {{ws:Array(String)}}[i] "
                "AND toFloat64(ts) <= {{ts:Array(Float64)}}[i], {deaths}) AS i WHERE "
                "cluster_id IN {{cs:Array(String)}} AND worker IN {{ws:Array(String)}} ORDER "
                "BY ts DESC LIMIT 1 BY i")


def _last_metrics(backend: Backend, found: list) -> list[dict | None]:
    """Per death (in ``found``'s order), the dead worker's last metric sample at or
    before its removal (None without one); one statement for every death."""
    deaths, p = _each_death(found)
    columns, rows = backend.query(
        LAST_METRICS.format(worker_metrics=table(backend, 'worker_metrics'), deaths=deaths), p)
    out: list[dict | None] = [None] * len(found)
    for i, *sample in rows:
        out[i - 1] = dict(zip(columns[1:], sample))
    return out
