"""The pages besides the Run page and a worker's page (whose views are
:mod:`dask_blackbox.read.views`): the clusters recorded (:func:`clusters`), a task's
story (:func:`task`), a span or a run compared across runs (:func:`compare`). Each
takes a :class:`~dask_blackbox.read.backends.Backend` and returns a JSON-able dict;
times are float seconds since the epoch (UTC).

The scope of a page (:func:`resolve`, :class:`Scope`, :class:`NotFound`, the latest
run of a name) and the critical path of a scope are :mod:`.views.scope`'s and
:mod:`.views.page`'s, named here too for the CLI.
"""

from __future__ import annotations

from collections import defaultdict

from dask_blackbox.read import diagnosis, function_changes, queries, regressions, statements
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import Filter
from dask_blackbox.read.filters import epoch as _epoch
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.queries import TimeBound, UnknownCluster
from dask_blackbox.read.views.page import critical_path
from dask_blackbox.read.views.scope import (NotFound, Scope, UnknownKey, UnknownSpan, _cluster,
                                           last_seen, latest_run, resolve)
from dask_blackbox.read.views.scope import ts as _ts

__all__ = ["NotFound", "UnknownKey", "UnknownSpan", "Scope", "resolve", "latest_run", "last_seen",
           "critical_path", "clusters", "task", "compare", "CLUSTERS_PAGE", "CLUSTERS_PAGE_MAX"]


# ------------------------------------------------------------- other pages


#: Clusters on one page of :func:`clusters` unless asked otherwise, and at most.
CLUSTERS_PAGE = 100
CLUSTERS_PAGE_MAX = 1000


#: How many clusters the filter ``{where}`` keeps.
CLUSTER_COUNT = "SELECT count() FROM {clusters} {where}"
#: A page of the clusters ``{where}`` keeps, the newest first.
CLUSTER_PAGE = ("SELECT cluster_id, cluster_name, first_seen, last_seen, tasks_computed, "
                "tasks_erred FROM {clusters} {where} ORDER BY first_seen DESC, cluster_id LIMIT "
                "{{limit:UInt32}} OFFSET {{offset:UInt64}}")
#: Per cluster of ``ids``: the workers its lifecycle and its metrics name.
WORKER_COUNTS = ("SELECT cluster_id, uniqExact(worker) FROM (SELECT cluster_id, worker FROM "
                 "{lifecycle} WHERE worker != '' AND cluster_id IN {{ids:Array(String)}} UNION "
                 "ALL SELECT DISTINCT cluster_id, worker FROM {worker_metrics} WHERE cluster_id "
                 "IN {{ids:Array(String)}}) GROUP BY cluster_id")
#: Per cluster of ``ids``: whether its scheduler closed, and how many workers were removed.
ENDINGS = ("SELECT cluster_id, countIf(action = 'scheduler_close') > 0, countIf(action = "
           "'worker_removed') FROM {lifecycle} WHERE cluster_id IN {{ids:Array(String)}} "
           "GROUP BY cluster_id")


def clusters(backend: Backend, name: str | None = None, since: TimeBound = None,
             until: TimeBound = None, now: float | None = None, limit: int = CLUSTERS_PAGE,
             offset: int = 0) -> dict:
    """One page of the recorded clusters (``name``: substring of the name or id, any
    case; since/until: those active in that window), newest first (first seen, then
    id): ``limit`` of them from ``offset``, with how each ended: "closed" (the
    scheduler's close was recorded), "alive" (heard from in the last two minutes) or
    "gone" (neither: killed, or the producer lost), and the workers it lost (deaths:
    removals whose cause is not "expected", see :mod:`.diagnosis`). ``{"clusters":
    [...], "total": <clusters matching>,
    "offset", "limit"}``; the work is the page's, whatever the number of clusters."""
    import time as _time

    if not 1 <= limit <= CLUSTERS_PAGE_MAX or offset < 0:
        raise ValueError(f"limit must be 1..{CLUSTERS_PAGE_MAX} and offset >= 0")
    f = Filter()
    if name:
        f.add("positionCaseInsensitiveUTF8(concat(cluster_name, ' ', cluster_id), {name:String}) > 0",
              name=name)
    start, stop = _epoch(since, "since"), _epoch(until, "until")
    if start is not None:
        f.add("last_seen >= toDateTime64({since:Float64}, 6, 'UTC')", since=start)
    if stop is not None:
        f.add("first_seen < toDateTime64({until:Float64}, 6, 'UTC')", until=stop)
    _, counted = backend.query(CLUSTER_COUNT.format(clusters=_t(backend, 'clusters'), where=f.where()),
                               f.parameters)
    _, rows = backend.query(
        CLUSTER_PAGE.format(clusters=_t(backend, 'clusters'), where=f.where()),
        {**f.parameters, "limit": limit, "offset": offset})
    ids = [r[0] for r in rows]
    workers, ends = {}, {}
    if ids:
        _, found = backend.query(
            WORKER_COUNTS.format(lifecycle=_t(backend, 'lifecycle'), worker_metrics=_t(backend, 'worker_metrics')), {"ids": ids})
        workers = dict(found)
        _, found = backend.query(ENDINGS.format(lifecycle=_t(backend, 'lifecycle')), {"ids": ids})
        lost_ = diagnosis.death_counts(backend, ids)
        ends = {c: (closed, lost_.get(c, 0), removed) for c, closed, removed in found}
    now = _time.time() if now is None else now
    out = []
    for cluster_id, cluster_name, first_seen, seen_last, tasks, errors in rows:
        closed, lost, removed = ends.get(cluster_id, (False, 0, 0))
        last = _ts(seen_last) or 0.0
        status = "closed" if closed else "alive" if now - last < 120 else "gone"
        out.append({"cluster_name": cluster_name, "cluster_id": cluster_id,
                    "first_seen": _ts(first_seen), "last_seen": last, "status": status,
                    "workers": workers.get(cluster_id, 0), "tasks": tasks, "errors": errors,
                    "workers_lost": lost, "workers_removed": removed})
    return {"clusters": out, "total": counted[0][0], "offset": offset, "limit": limit}


def task(backend: Backend, cluster: str, key: str, window: float = 2.0,
         log_lines: int = 10) -> dict:
    """One task: its story (scheduler and worker transitions), and around each
    transition on a worker that worker's two nearest metric samples and its log lines
    from ``window`` seconds before the transition to ``window`` seconds after the
    next one (at most ``log_lines``), each marked ``whose``: "task" (logged while
    this task ran, ``logs.key``), "other task" (while another one ran: ``key``
    names it) or "worker" (the worker's own); its dependencies and dependents from
    the recorded graph; where it ran and, if it erred, its exception.

    The worker of a transition into processing is not passed to plugins; it is the
    worker of the transition that left processing next (Dask passes it to memory and
    erred; a release because the worker died names the removal's stimulus), marked
    ``worker_inferred``."""
    cluster_id, cluster_name, _ = _cluster(backend, cluster)
    columns, rows = queries.story(backend, key, cluster=cluster_id, source=None)
    if not rows:
        raise UnknownKey(f"no task {key!r} was recorded in cluster {cluster_name} ({cluster_id})")
    detail_rows = _details(backend, cluster_id, key)
    prefix = next((r[3] for r in detail_rows if r[3]), "")
    span_id = next((r[5] for r in detail_rows if r[5]), "")
    group = next((r[4] for r in detail_rows if r[4]), "")
    errors = [{"ts": r[0], "exception": r[9], "traceback": r[10], "cause": r[11]}
              for r in detail_rows if r[2] == "erred"]
    actions = [{"ts": r[0], "action": a, "start": s, "stop": e, "worker": r[6]}
               for r in detail_rows for a, s, e in zip(r[12], r[13], r[14])]
    story = _story(backend, cluster_id, columns, rows)
    _around(backend, cluster_id, key, story, window, log_lines)
    deps, dependents, span_name = _neighbours(backend, cluster_id, key, span_id)
    return {"cluster_id": cluster_id, "cluster_name": cluster_name, "key": key, "prefix": prefix,
            "group": group, "span_id": span_id, "span": span_name, "story": story,
            "actions": actions, "errors": errors,
            "dependencies": list(deps[0][0]) if deps else [],
            "dependents": [r[0] for r in dependents]}


#: The scheduler's transitions of one task ``k``, with their startstops (floats: arrays
#: of DateTime64 come back as text through a sink's query server).
TASK_TRANSITIONS = ("SELECT toFloat64(ts), start, finish, prefix, task_group, span_id, worker, nbytes, "
                    "typename, exception, traceback, cause, startstops.action, arrayMap(x -> "
                    "toFloat64(x), startstops.start), arrayMap(x -> toFloat64(x), startstops.stop) "
                    "FROM {transitions} WHERE cluster_id = {{c:String}} AND key = {{k:String}} AND "
                    "source = 'scheduler' ORDER BY ts, seq, idx")


def _details(backend: Backend, cluster_id: str, key: str) -> list[tuple]:
    """The scheduler's transitions of ``key``: what each says of the task (prefix, group,
    span, worker, size, exception, startstops)."""
    _, detail_rows = backend.query(
        TASK_TRANSITIONS.format(transitions=_t(backend, 'transitions')), {"c": cluster_id, "k": key})
    return detail_rows


def _story(backend: Backend, cluster_id: str, columns: list[str], rows: list) -> list[dict]:
    """The task's story (:func:`queries.story`'s rows), each transition with the
    worker it ran on (inferred where Dask did not pass it: ``worker_inferred``)."""
    # Which worker: Dask passes it with the transitions out of processing (to memory
    # or erred); a task released because its worker died names the removal's stimulus.
    _, removals = backend.query(statements.WORKER_REMOVALS.format(
        lifecycle=_t(backend, "lifecycle"), also=" AND stimulus_id != ''"), {"c": cluster_id})
    removed_by = dict(removals)
    story = []
    for row in rows:
        r = dict(zip(columns, row))
        entry = {k: r[k] for k in ("start", "finish", "stimulus_id", "ts", "worker", "source")}
        entry.update(metrics=[], logs=[], worker_inferred=False)
        if not entry["worker"] and entry["start"] == "processing" and r["stimulus_id"] in removed_by:
            entry["worker"], entry["worker_inferred"] = removed_by[r["stimulus_id"]], True
        story.append(entry)
    entered = None
    for entry in story:  # the transition into processing ran where the task then left it
        if entry["finish"] == "processing" and entry["source"] == "scheduler":
            entered = entry
        elif entry["start"] == "processing" and entered is not None:
            if entry["worker"] and not entered["worker"]:
                entered["worker"], entered["worker_inferred"] = entry["worker"], True
            entered = None
    return story


#: The producers of each worker of the cluster, known from its metric samples.
WORKER_PRODUCERS = ("SELECT DISTINCT worker, producer_id FROM {worker_metrics} WHERE cluster_id = "
                    "{{c:String}}")
#: A worker's two metric samples nearest a transition at ``t`` (within five windows).
METRICS_AROUND = ("SELECT toFloat64(ts) AS t, memory, memory_managed, memory_unmanaged, "
                  "memory_spilled, cpu, executing, ready, in_flight FROM {worker_metrics} WHERE "
                  "cluster_id = {{c:String}} AND worker = {{w:String}} AND toFloat64(ts) BETWEEN "
                  "{{t:Float64}} - 5 * {{win:Float64}} AND {{t:Float64}} + 5 * {{win:Float64}} "
                  "ORDER BY abs(toFloat64(ts) - {{t:Float64}}) LIMIT 2")


def _around(backend: Backend, cluster_id: str, key: str, story: list[dict], window: float,
            log_lines: int) -> None:
    """Each transition on a worker of ``story`` gets that worker's two nearest metric
    samples (``metrics``) and its log lines around it (``logs``, see :func:`task`)."""
    _, producers = backend.query(
        WORKER_PRODUCERS.format(worker_metrics=_t(backend, 'worker_metrics')), {"c": cluster_id})
    producers_of = defaultdict(list)
    for w, prod in producers:
        producers_of[w].append(prod)
    for i, entry in enumerate(story):
        worker = entry["worker"]
        if not worker:
            continue
        # Around a transition: from just before it until just after the next one
        # (the whole run of a task entering processing), at most a minute.
        until = min(story[i + 1]["ts"] if i + 1 < len(story) else entry["ts"], entry["ts"] + 60.0)
        p = {"c": cluster_id, "w": worker, "t": entry["ts"], "u": until, "win": window}
        mcols, samples = backend.query(
            METRICS_AROUND.format(worker_metrics=_t(backend, 'worker_metrics')),
            {k: v for k, v in p.items() if k != "u"})
        entry["metrics"] = sorted((dict(zip(mcols, s)) for s in samples), key=lambda m: m["t"])
        p["prods"] = producers_of.get(worker, [])
        _, lines = backend.query(
            LOGS_AROUND.format(logs=_t(backend, 'logs'), limit=int(log_lines)), p)
        # whose line: this task's (logged by its own thread while it ran), another
        # task's, or the worker's own
        entry["logs"] = [{"ts": t, "level": lv, "logger": lg, "message": m, "exc_text": x, "key": k,
                          "whose": "task" if k == key else ("other task" if k else "worker")}
                         for t, lv, lg, m, k, x in lines]


#: The log records of a worker around a transition (``{c}``, ``{w}``, from ``{t}`` -
#: ``{win}`` to ``{u}`` + ``{win}``), at most ``{limit}``: those that name the worker
#: (its own, its nanny's) and those of its producers ``{prods}`` recorded before records
#: named their worker.
LOGS_AROUND = ("SELECT toFloat64(ts), level, logger, message, key, exc_text FROM {logs} "
               "WHERE cluster_id = {{c:String}} AND (worker = {{w:String}} OR (worker = '' "
               "AND producer_id IN {{prods:Array(String)}})) AND toFloat64(ts) BETWEEN "
               "{{t:Float64}} - {{win:Float64}} AND {{u:Float64}} + {{win:Float64}} "
               "ORDER BY ts, seq, idx LIMIT {limit}")


#: The dependencies of task ``k`` as last submitted.
DEPENDENCIES = ("SELECT dependencies FROM {graph_tasks} WHERE cluster_id = {{c:String}} AND key "
                "= {{k:String}} ORDER BY ts DESC LIMIT 1")
#: The tasks that depend on task ``k`` (at most 500).
DEPENDENTS = ("SELECT DISTINCT key FROM {graph_tasks} WHERE cluster_id = {{c:String}} AND "
              "has(dependencies, {{k:String}}) ORDER BY key LIMIT 500")


def _neighbours(backend: Backend, cluster_id: str, key: str, span_id: str) -> tuple:
    """The task's dependencies (the latest recorded), its dependents (at most 500) and
    its span's '/'-joined name."""
    _, deps = backend.query(
        DEPENDENCIES.format(graph_tasks=_t(backend, 'graph_tasks')), {"c": cluster_id, "k": key})
    _, dependents = backend.query(
        DEPENDENTS.format(graph_tasks=_t(backend, 'graph_tasks')), {"c": cluster_id, "k": key})
    return deps, dependents, queries.span_name(backend, cluster_id, span_id) if span_id else ""


def compare(backend: Backend, span: str | None, cluster: str | None = None,
            since: TimeBound = None, until: TimeBound = None) -> dict:
    """The latest run against the one before it (:func:`regressions.compare`):
    ``verdict`` (the comparison's dict, its ``sentences`` first, and ``functions``:
    the frames of its culprit prefix whose time grew, :mod:`.function_changes`; or
    ``{"error": reason}`` when the runs cannot be compared), and for a span, :func:`queries.compare`
    side by side: ``runs`` are the column labels; ``metrics`` maps a metric to one
    value per run. Without ``span``, the whole runs of the clusters named ``cluster``."""
    if not span and not cluster:
        raise NotFound("no span name given: pass span=NAME (or cluster=NAME to compare "
                       "its whole runs)")
    if span and cluster is None and not queries.compare(backend, span)[1]:
        try:  # ``compare NAME`` with a cluster's name: its whole runs
            queries.cluster_ids(backend, span)
            span, cluster = None, span
        except UnknownCluster:
            pass
    try:
        if span:
            columns, rows = queries.compare(backend, span, cluster=cluster, since=since,
                                            until=until)
        else:
            queries.cluster_ids(backend, cluster)
            columns, rows = ["metric"], []
    except UnknownCluster as e:
        raise NotFound(str(e)) from None
    if span and not rows:
        where = f" in cluster {cluster}" if cluster else ""
        raise UnknownSpan(f"no span named {span!r} was recorded{where}")
    try:
        comparison = regressions.compare(backend, span, cluster, since, until)
    except regressions.NotComparable as e:
        verdict = {"error": str(e)}
    else:
        verdict = comparison.as_dict()
        verdict["functions"] = function_changes.of_comparison(backend, comparison).as_dict()
    runs, metrics = columns[1:], {row[0]: list(row[1:]) for row in rows}
    if "table" in verdict and all(v is None for values in metrics.values() for v in values):
        # no span snapshots (the processors did not run): the runs as their tasks tell
        runs, metrics = verdict["runs"], {row[0]: list(row[1:]) for row in verdict["table"]}
    return {"span": span, "cluster": cluster, "runs": runs, "verdict": verdict,
            "metrics": metrics}
