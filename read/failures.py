"""The post-mortem: what failed in a cluster, and what the workers that died were doing.

:func:`failures` returns several named result sets (in this order):

``erred_tasks``
    every transition into 'erred': key, when, on which worker, exception, the key
    that caused it, traceback. A dependent that erred for its dependency's error
    (Dask's ``exception_blame``, recorded as ``cause``) has as exception "erred
    because <cause> raised <that task's exception>".
``dead_workers``
    workers that died (:mod:`.diagnosis`: a removal whose cause is not "expected")
    while tasks were running on them (Dask released those tasks, or marked them
    erred with KilledWorker): when, stimulus, reason, whether Dask expected the
    removal (its "remove-worker" event), how many tasks, and the cause with its
    confidence and explanation. A worker that dies idle is no task's failure; the
    Run page's deaths and ``queries.clusters`` count it.
``dead_worker_tasks``
    the tasks each of them was running: released (or erred, KilledWorker) by the
    removal's stimulus.
``dead_worker_metrics``
    each one's last ``metric_samples`` metric samples before its removal.
``dead_worker_logs``
    each one's last ``log_lines`` log records; a worker's records are those its
    producer sent (the producer is known from the worker's metric samples).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from dask_blackbox.read import diagnosis
from dask_blackbox.read.backends import Backend, Result
from dask_blackbox.read.filters import Filter, TimeBound, build, pairs, table

_METRIC_COLUMNS = ["cluster_id", "worker", "ts"]
_LOG_COLUMNS = ["cluster_id", "worker", "ts", "level", "logger", "message"]


class DeadWorker(NamedTuple):
    """A worker that died while it ran tasks."""

    cluster_id: str
    worker: str
    removed_at: object
    stimulus_id: str
    reason: str
    expected: bool | None
    tasks_running: int
    cause: str
    confidence: str
    summary: str


def failures(backend: Backend, cluster: str | None = None, since: TimeBound = None,
             until: TimeBound = None, log_lines: int = 20,
             metric_samples: int = 5) -> dict[str, Result]:
    """A post-mortem as several result sets; see the module docstring."""
    f = build(backend, cluster, since, until, "ts")
    out: dict[str, Result] = {"erred_tasks": _erred_tasks(backend, f)}
    dead, tasks_of = _dead_workers(backend, f)
    out["dead_workers"] = (list(DeadWorker._fields), [tuple(d) for d in dead])
    out["dead_worker_tasks"] = (
        ["cluster_id", "worker", "key", "prefix", "finish", "ts"],
        [(d.cluster_id, d.worker, *task) for d in dead
         for task in tasks_of[(d.cluster_id, d.stimulus_id)]],
    )
    owners = sorted({(d.cluster_id, d.worker) for d in dead})
    if not owners:
        out["dead_worker_metrics"] = (_METRIC_COLUMNS, [])
        out["dead_worker_logs"] = (_LOG_COLUMNS, [])
        return out
    removed_at = {(d.cluster_id, d.worker): d.removed_at for d in dead}
    out["dead_worker_metrics"] = _last_metrics(backend, owners, removed_at, metric_samples)
    out["dead_worker_logs"] = _last_logs(backend, owners, log_lines)
    return out


#: The transitions into erred (``{where}``, ``{and_}``: the filter), as they happened, with
#: their exception, cause and traceback.
ERRED_TRANSITIONS = ("SELECT cluster_id, key, ts, worker, prefix, exception, cause, traceback FROM "
                     "{transitions} {where} {and_} finish = 'erred' ORDER BY ts, seq, idx")
#: The exceptions the tasks of ``{condition}`` (pairs of cluster and key) raised.
RAISED = ("SELECT cluster_id, key, exception FROM {transitions} WHERE ({condition}) "
          "AND finish = 'erred' AND exception != '' ORDER BY ts, seq, idx")


def _erred_tasks(backend: Backend, f: Filter) -> Result:
    """The transitions into 'erred'; a dependent that erred for another task's error
    (``cause``, Dask's ``exception_blame``) has as exception "erred because <cause>
    raised <its exception>"."""
    columns, rows = backend.query(
        ERRED_TRANSITIONS.format(transitions=table(backend, 'transitions'), where=f.where(), and_=f.and_()),
        f.parameters,
    )
    inherited = sorted({(r[0], r[6]) for r in rows if r[6] and r[6] != r[1] and not r[5]})
    if not inherited:
        return columns, rows
    condition, parameters = pairs("cluster_id", "key", inherited)
    _, raised = backend.query(
        RAISED.format(transitions=table(backend, 'transitions'), condition=condition),
        parameters,
    )
    exception_of: dict[tuple, str] = {}
    for cluster_id, key, exception in raised:
        exception_of.setdefault((cluster_id, key), exception)
    return columns, [blamed(r, exception_of) for r in rows]


def blamed(row: tuple, exception_of: dict[tuple, str]) -> tuple:
    """An erred row (cluster_id, key, ts, worker, prefix, exception, cause, ...) whose
    exception says whose error it inherited, when it has none of its own."""
    cluster_id, key, exception, cause = row[0], row[1], row[5], row[6]
    if exception or not cause or cause == key:
        return row
    raised = exception_of.get((cluster_id, cause))
    said = f"erred because {cause} raised {raised}" if raised else f"erred because {cause} erred"
    return (*row[:5], said, *row[6:])


#: The workers' removals (``{where}``, ``{and_}``: the filter) in time order.
REMOVALS = ("SELECT cluster_id, worker, ts, stimulus_id, reason FROM {lifecycle} {where} "
            "{and_} action = 'worker_removed' ORDER BY ts")
#: The transitions out of processing the removals' ``stimuli`` made: cluster, stimulus,
#: key, prefix, where the task went and when.
RELEASED_BY = ("SELECT cluster_id, stimulus_id, key, prefix, finish, ts FROM {transitions} "
               "WHERE start = 'processing' AND stimulus_id IN {{stimuli:Array(String)}} "
               "ORDER BY ts, seq, idx")


def _dead_workers(backend: Backend, f: Filter) -> tuple[list[DeadWorker], dict]:
    """The deaths that released running tasks, and per (cluster_id, stimulus_id) the
    tasks that removal released: (key, prefix, finish, ts)."""
    _, removals = backend.query(
        REMOVALS.format(lifecycle=table(backend, 'lifecycle'), where=f.where(), and_=f.and_()),
        f.parameters,
    )
    stimuli = sorted({r[3] for r in removals if r[3]})
    tasks_of: dict[tuple, list] = defaultdict(list)
    if not stimuli:
        return [], tasks_of
    _, running = backend.query(
        RELEASED_BY.format(transitions=table(backend, 'transitions')),
        {"stimuli": stimuli},
    )
    for cluster_id, stimulus_id, key, prefix, finish, ts in running:
        tasks_of[(cluster_id, stimulus_id)].append((key, prefix, finish, ts))
    clusters = sorted({r[0] for r in removals if tasks_of.get((r[0], r[3]))})
    verdicts = {(d.cluster_id, d.stimulus_id, d.worker): d
                for d in diagnosis.deaths(backend, clusters)} if clusters else {}
    dead = []
    for cluster_id, worker, ts, stimulus_id, reason in removals:
        death = verdicts.get((cluster_id, stimulus_id, worker))
        if tasks_of.get((cluster_id, stimulus_id)) and death is not None and death.is_death:
            v = death.verdict
            dead.append(DeadWorker(cluster_id, worker, ts, stimulus_id, reason, death.expected,
                                   len(tasks_of[(cluster_id, stimulus_id)]), v.cause.value,
                                   v.confidence, v.summary))
    return dead, tasks_of


#: The metric samples of the workers of ``{condition}`` (pairs of cluster and worker),
#: newest first.
METRICS_NEWEST_FIRST = ("SELECT cluster_id, worker, ts, memory, memory_managed, memory_unmanaged, "
                        "memory_spilled, cpu, executing, ready, in_flight, event_loop_interval FROM "
                        "{worker_metrics} WHERE {condition} ORDER BY ts DESC")


def _last_metrics(backend: Backend, owners: list[tuple[str, str]], removed_at: dict,
                  samples: int) -> Result:
    """Each worker's last ``samples`` metric samples up to its removal, oldest first."""
    condition, parameters = pairs("cluster_id", "worker", owners)
    columns, rows = backend.query(
        METRICS_NEWEST_FIRST.format(worker_metrics=table(backend, 'worker_metrics'), condition=condition),
        parameters,
    )
    kept: dict[tuple, list] = defaultdict(list)
    for row in rows:
        owner = (row[0], row[1])
        if row[2] <= removed_at[owner] and len(kept[owner]) < samples:
            kept[owner].append(row)
    return columns, [r for owner in owners for r in reversed(kept[owner])]


#: The producers of the workers of ``{condition}``, known from their metric samples.
PRODUCERS_OF = ("SELECT DISTINCT cluster_id, worker, producer_id FROM {worker_metrics} WHERE "
                "{condition}")
#: The log records of the workers of ``{condition}`` and of their producers
#: (``{by_producer}``) that named no worker, newest first.
LOGS_NEWEST_FIRST = ("SELECT cluster_id, producer_id, worker, ts, level, logger, message, exc_text "
                     "FROM {logs} WHERE {condition} OR (worker = '' AND {by_producer}) ORDER BY ts "
                     "DESC, seq DESC, idx DESC")


def _last_logs(backend: Backend, owners: list[tuple[str, str]], lines: int) -> Result:
    """Each worker's last ``lines`` log records (exception text appended), oldest first:
    the records that name it (``worker``: its own, its nanny's), and those of its
    producer recorded before records named their worker (known from its metric
    samples)."""
    condition, parameters = pairs("cluster_id", "worker", owners)
    _, producers = backend.query(
        PRODUCERS_OF.format(worker_metrics=table(backend, 'worker_metrics'), condition=condition),
        parameters,
    )
    worker_of = {(c, p): w for c, w, p in producers}
    known = sorted(worker_of)
    by_producer = ("has(arrayZip({pc:Array(String)}, {pp:Array(String)}), (cluster_id, producer_id))")
    more = {"pc": [c for c, _ in known], "pp": [p for _, p in known]}
    _, records = backend.query(
        LOGS_NEWEST_FIRST.format(logs=table(backend, 'logs'), condition=condition, by_producer=by_producer),
        {**parameters, **more},
    )
    logs: dict[tuple, list] = defaultdict(list)
    for cluster_id, producer_id, worker, ts, level, logger_name, message, exc_text in records:
        worker = worker or worker_of[(cluster_id, producer_id)]
        if len(logs[(cluster_id, worker)]) < lines:
            text = message + (f"\n{exc_text}" if exc_text else "")
            logs[(cluster_id, worker)].append((cluster_id, worker, ts, level, logger_name, text))
    return _LOG_COLUMNS, [r for owner in owners for r in reversed(logs[owner])]
