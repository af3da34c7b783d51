"""The named queries the CLI, the UI and Python users run on the recorded history.

Each takes a :class:`~dask_blackbox.read.backends.Backend` (``connect()``, re-exported
here, gives the right one for the configuration).

Every named query takes ``cluster`` (a cluster name or id; None: all clusters),
``since`` and ``until`` (datetime, seconds since the epoch, or None), and returns
``(columns, rows)`` -- except :func:`failures`, which returns several named result
sets. Timestamps come back as ``datetime`` (UTC) except in :func:`story`, which keeps
Scheduler.story's float seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import defaultdict
from typing import Any

from dask_blackbox.read.backends import Backend, QueryError, Result, connect

__all__ = ["Backend", "QueryError", "Result", "UnknownCluster", "connect", "story", "spans",
           "prefixes", "clusters", "failures", "compare", "table_counts", "gaps_and_drops"]

TimeBound = datetime.datetime | float | int | None

#: Tables where the latest version / one copy per key wins (read with FINAL).
_REPLACING = frozenset({"span_state", "prefix_stats", "gaps", "schema_migrations"})


class UnknownCluster(LookupError):
    """``--cluster`` names no cluster that was ever recorded."""


# ------------------------------------------------------------------- helpers


def _epoch(value: TimeBound, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} must be a datetime or seconds since the epoch, not {value!r}")


@dataclasses.dataclass
class _Filter:
    """WHERE conditions and their parameters, built up per query."""

    conditions: list[str] = dataclasses.field(default_factory=list)
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add(self, condition: str, **parameters) -> None:
        self.conditions.append(condition)
        self.parameters.update(parameters)

    def where(self) -> str:
        return ("WHERE " + " AND ".join(self.conditions)) if self.conditions else ""


def _t(backend: Backend, table: str) -> str:
    return f"{backend.database}.{table}"


def cluster_ids(backend: Backend, cluster: str | None) -> list[str] | None:
    """The ids of the cluster(s) named or identified by ``cluster`` (several runs may
    share a name); None for "all"; UnknownCluster if nothing matches."""
    if cluster is None:
        return None
    _, rows = backend.query(
        f"SELECT DISTINCT cluster_id FROM {_t(backend, 'envelopes')} "
        "WHERE cluster_id = {c:String} OR cluster_name = {c:String}",
        {"c": cluster},
    )
    if not rows:
        raise UnknownCluster(f"no recorded cluster is named {cluster!r} or has that id")
    return sorted(r[0] for r in rows)


def _filter(backend: Backend, cluster: str | None, since: TimeBound, until: TimeBound,
            time_column: str | None, cluster_column: str = "cluster_id") -> _Filter:
    f = _Filter()
    ids = cluster_ids(backend, cluster)
    if ids is not None:
        f.add(f"{cluster_column} IN {{clusters:Array(String)}}", clusters=ids)
    start, stop = _epoch(since, "since"), _epoch(until, "until")
    if time_column and start is not None:
        f.add(f"{time_column} >= toDateTime64({{since:Float64}}, 6, 'UTC')", since=start)
    if time_column and stop is not None:
        f.add(f"{time_column} < toDateTime64({{until:Float64}}, 6, 'UTC')", until=stop)
    return f


def _names(backend: Backend) -> dict[str, str]:
    """cluster_id -> latest cluster name."""
    _, rows = backend.query(f"SELECT cluster_id, cluster_name FROM {_t(backend, 'clusters')}")
    return dict(rows)


# ------------------------------------------------------------- named queries


def story(backend: Backend, key: str, cluster: str | None = None, since: TimeBound = None,
          until: TimeBound = None, source: str | None = "scheduler") -> Result:
    """The transitions of ``key`` as they happened, in the shape of Scheduler.story:
    ``key, start, finish, stimulus_id, ts`` (float seconds), then where it happened.

    ``source`` ("scheduler", the default, is what Scheduler.story shows; "worker" for
    worker-side transitions if recorded; None for both). Unlike Scheduler.story, the
    transitions of *other* keys that recommended this one are not included: Dask
    does not give them to plugins.
    """
    f = _filter(backend, cluster, since, until, "ts")
    f.add("key = {key:String}", key=key)
    if source is not None:
        f.add("source = {source:String}", source=source)
    return backend.query(
        "SELECT key, start, finish, stimulus_id, toFloat64(ts) AS ts, cluster_id, worker, source "
        f"FROM {_t(backend, 'transitions')} {f.where()} "
        # seq/idx: the producer's own order, exact even when timestamps tie
        "ORDER BY ts, seq, idx",
        f.parameters,
    )


def _span_rows(backend: Backend, f: _Filter) -> list[dict]:
    """Spans in ``f``: the processors' latest snapshot where there is one, else the
    span as the scheduler announced it (name, parent, enqueued only)."""
    columns, rows = backend.query(
        "SELECT cluster_id, span_id, name, parent_id, enqueued, start, stop, duration, "
        "nbytes_total, arraySum(mapValues(states)) AS tasks, all_durations, done "
        f"FROM {_t(backend, 'span_state')} FINAL {f.where()} "
        "UNION ALL "
        "SELECT cluster_id, span_id, any(name), any(parent_id), min(enqueued), NULL, NULL, NULL, "
        "NULL, NULL, NULL, NULL "
        f"FROM {_t(backend, 'spans')} {f.where()} "
        f"{'AND' if f.conditions else 'WHERE'} (cluster_id, span_id) NOT IN "
        f"(SELECT cluster_id, span_id FROM {_t(backend, 'span_state')}) "
        "GROUP BY cluster_id, span_id",
        f.parameters,
    )
    return [dict(zip(columns, row)) for row in rows]


def _tree_order(spans: list[dict]) -> list[tuple[int, dict]]:
    """(depth, span) in tree order: per cluster, roots then children depth-first,
    siblings by enqueued time."""
    children = defaultdict(list)
    known = {(s["cluster_id"], s["span_id"]) for s in spans}
    for s in spans:
        parent = (s["cluster_id"], s["parent_id"])
        children[parent if s["parent_id"] and parent in known else (s["cluster_id"], None)].append(s)
    order: list[tuple[int, dict]] = []

    def visit(key, depth):
        for s in sorted(children.get(key, ()), key=lambda s: (s["enqueued"], s["span_id"])):
            order.append((depth, s))
            visit((s["cluster_id"], s["span_id"]), depth + 1)

    for cluster_id in sorted({s["cluster_id"] for s in spans}):
        visit((cluster_id, None), 0)
    return order


def spans(backend: Backend, tree: bool = False, cluster: str | None = None,
          since: TimeBound = None, until: TimeBound = None) -> Result:
    """Span trees: per span its name, times, ``elapsed_s`` (stop - start),
    ``task_s`` (Dask's Span.duration: seconds of all task actions in the tree),
    ``tasks``, ``nbytes`` and seconds per action (compute, transfer, ...).

    ``tree=True`` orders spans as a tree (depth-first, siblings by time) and indents
    each name by its depth; otherwise spans come in order of enqueued time.
    """
    f = _filter(backend, cluster, since, until, "enqueued")
    found = _span_rows(backend, f)
    names = _names(backend)
    ordered = _tree_order(found) if tree else [
        (0, s) for s in sorted(found, key=lambda s: (s["enqueued"], s["cluster_id"], s["span_id"]))
    ]
    columns = ["cluster", "name", "span_id", "parent_id", "enqueued", "start", "stop", "elapsed_s",
               "task_s", "tasks", "nbytes", "by_action", "done", "depth"]
    rows = []
    for depth, s in ordered:
        name = list(s["name"])
        label = "  " * depth + (name[-1] if tree and name else " / ".join(name))
        started = s["start"] if s["start"] and s["start"].timestamp() > 0 else None
        elapsed = (s["stop"] - started).total_seconds() if started and s["stop"] else None
        rows.append((
            names.get(s["cluster_id"], s["cluster_id"]), label, s["span_id"], s["parent_id"],
            s["enqueued"], started, s["stop"], elapsed, s["duration"], s["tasks"],
            s["nbytes_total"], dict(s["all_durations"]) if s["all_durations"] else {},
            s["done"], depth,
        ))
    return columns, rows


def _span_match(backend: Backend, f: _Filter, span: str) -> str:
    """SQL: span ids whose span matches ``span`` -- a tag anywhere in the name (so a
    span and all its sub-spans), or the full name joined with '/' -- and their
    descendants' ids."""
    f.parameters["span"] = span
    condition = ("(has(name, {span:String}) OR arrayStringConcat(name, '/') = {span:String} "
                 "OR startsWith(arrayStringConcat(name, '/'), {span:String} || '/'))")
    return (f"(SELECT span_id FROM {_t(backend, 'span_state')} WHERE {condition} "
            f"UNION DISTINCT SELECT span_id FROM {_t(backend, 'spans')} WHERE {condition})")


def prefixes(backend: Backend, span: str | None = None, limit: int = 20,
             cluster: str | None = None, since: TimeBound = None,
             until: TimeBound = None) -> Result:
    """Top task prefixes by compute time, from the processors' per-minute partials
    (each partial counted once): compute seconds, seconds per action, tasks finished
    in memory, erred, bytes produced, the longest single compute, and in how many
    clusters. ``span``: only within spans whose name contains that tag (or equals
    that '/'-joined path), sub-spans included."""
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, not {limit!r}")
    f = _filter(backend, cluster, since, until, "window_start")
    if span is not None:
        f.add(f"span_id IN {_span_match(backend, f, span)}")
    f.parameters["limit"] = limit
    return backend.query(
        "SELECT prefix, sum(durations['compute']) AS compute_s, sumMap(durations) AS by_action, "
        "sum(finished['memory']) AS tasks, sum(n_erred) AS erred, sum(nbytes) AS nbytes, "
        "max(max_duration) AS longest_s, uniqExact(cluster_id) AS clusters "
        f"FROM {_t(backend, 'prefix_stats')} FINAL {f.where()} "
        "GROUP BY prefix ORDER BY compute_s DESC, prefix LIMIT {limit:UInt32}",
        f.parameters,
    )


def clusters(backend: Backend, cluster: str | None = None, since: TimeBound = None,
             until: TimeBound = None) -> Result:
    """Every cluster seen (or those matching ``cluster``; with since/until, those
    active in that window): first and last envelope, workers seen (joined, left or
    reporting metrics), tasks computed, tasks erred, worker removals, producers and
    envelopes."""
    f = _filter(backend, cluster, None, None, None)
    start, stop = _epoch(since, "since"), _epoch(until, "until")
    if start is not None:
        f.add("last_seen >= toDateTime64({since:Float64}, 6, 'UTC')", since=start)
    if stop is not None:
        f.add("first_seen < toDateTime64({until:Float64}, 6, 'UTC')", until=stop)
    return backend.query(
        "SELECT cluster_name, cluster_id, first_seen, last_seen, ifNull(w.workers, 0) AS workers, "
        "tasks_computed AS tasks, tasks_erred AS errors, ifNull(r.removed, 0) AS workers_removed, "
        f"producers, envelopes FROM {_t(backend, 'clusters')} AS c "
        "LEFT JOIN (SELECT cluster_id, uniqExact(worker) AS workers FROM ("
        f"SELECT cluster_id, worker FROM {_t(backend, 'lifecycle')} WHERE worker != '' UNION ALL "
        f"SELECT DISTINCT cluster_id, worker FROM {_t(backend, 'worker_metrics')}) "
        "GROUP BY cluster_id) AS w USING (cluster_id) "
        "LEFT JOIN (SELECT cluster_id, countIf(action = 'worker_removed') AS removed "
        f"FROM {_t(backend, 'lifecycle')} GROUP BY cluster_id) AS r USING (cluster_id) "
        f"{f.where()} ORDER BY first_seen",
        f.parameters,
    )


def failures(backend: Backend, cluster: str | None = None, since: TimeBound = None,
             until: TimeBound = None, log_lines: int = 20,
             metric_samples: int = 5) -> dict[str, Result]:
    """A post-mortem, as several result sets (in this order):

    ``erred_tasks``
        every transition into 'erred': key, when, on which worker, exception, the key
        that caused it, traceback.
    ``dead_workers``
        workers removed while tasks were running on them (Dask released those tasks,
        or marked them erred with KilledWorker): when, stimulus, reason, whether Dask
        expected the removal (its "remove-worker" event), how many tasks. A worker
        that leaves idle is no task's failure; ``clusters`` counts its removal.
    ``dead_worker_tasks``
        the tasks each of them was running: released (or erred, KilledWorker) by the
        removal's stimulus.
    ``dead_worker_metrics``
        each one's last ``metric_samples`` metric samples before its removal.
    ``dead_worker_logs``
        each one's last ``log_lines`` log records.
    """
    out: dict[str, Result] = {}
    f = _filter(backend, cluster, since, until, "ts")
    out["erred_tasks"] = backend.query(
        "SELECT cluster_id, key, ts, worker, prefix, exception, cause, traceback "
        f"FROM {_t(backend, 'transitions')} {f.where()} "
        f"{'AND' if f.conditions else 'WHERE'} finish = 'erred' ORDER BY ts, seq, idx",
        f.parameters,
    )
    _, removals = backend.query(
        "SELECT cluster_id, worker, ts, stimulus_id, reason "
        f"FROM {_t(backend, 'lifecycle')} {f.where()} "
        f"{'AND' if f.conditions else 'WHERE'} action = 'worker_removed' ORDER BY ts",
        f.parameters,
    )
    stimuli = sorted({r[3] for r in removals if r[3]})
    _, running = backend.query(
        "SELECT cluster_id, stimulus_id, key, prefix, finish, ts "
        f"FROM {_t(backend, 'transitions')} "
        "WHERE start = 'processing' AND stimulus_id IN {stimuli:Array(String)} "
        "ORDER BY ts, seq, idx",
        {"stimuli": stimuli},
    ) if stimuli else ([], [])
    _, remove_events = backend.query(
        "SELECT cluster_id, JSONExtractString(msg, 'stimulus_id'), JSONExtractBool(msg, 'expected') "
        f"FROM {_t(backend, 'events')} "
        "WHERE topic = 'all' AND JSONExtractString(msg, 'action') = 'remove-worker' "
        "AND JSONExtractString(msg, 'stimulus_id') IN {stimuli:Array(String)}",
        {"stimuli": stimuli},
    ) if stimuli else ([], [])
    expected = {(c, s): bool(e) for c, s, e in remove_events}
    tasks_of = defaultdict(list)
    for cluster_id, stimulus_id, key, prefix, finish, ts in running:
        tasks_of[(cluster_id, stimulus_id)].append((key, prefix, finish, ts))
    dead = [
        (cluster_id, worker, ts, stimulus_id, reason, expected.get((cluster_id, stimulus_id)),
         len(tasks_of[(cluster_id, stimulus_id)]))
        for cluster_id, worker, ts, stimulus_id, reason in removals
        if tasks_of[(cluster_id, stimulus_id)]
    ]
    out["dead_workers"] = (
        ["cluster_id", "worker", "removed_at", "stimulus_id", "reason", "expected", "tasks_running"],
        dead,
    )
    out["dead_worker_tasks"] = (
        ["cluster_id", "worker", "key", "prefix", "finish", "ts"],
        [(c, w, *task) for c, w, _, s, *_ in dead for task in tasks_of[(c, s)]],
    )
    pairs = sorted({(c, w) for c, w, *_ in dead})
    removed_at = {(c, w): ts for c, w, ts, *_ in dead}
    if not pairs:
        out["dead_worker_metrics"] = (["cluster_id", "worker", "ts"], [])
        out["dead_worker_logs"] = (["cluster_id", "worker", "ts", "level", "logger", "message"], [])
        return out
    workers_condition, workers_parameters = _pairs("cluster_id", "worker", pairs)
    columns, samples = backend.query(
        "SELECT cluster_id, worker, ts, memory, memory_managed, memory_unmanaged, memory_spilled, "
        "cpu, executing, ready, in_flight, event_loop_interval "
        f"FROM {_t(backend, 'worker_metrics')} WHERE {workers_condition} ORDER BY ts DESC",
        workers_parameters,
    )
    kept: dict[tuple, list] = defaultdict(list)
    for row in samples:
        owner = (row[0], row[1])
        if row[2] <= removed_at[owner] and len(kept[owner]) < metric_samples:
            kept[owner].append(row)
    out["dead_worker_metrics"] = (columns, [r for owner in pairs for r in reversed(kept[owner])])
    # A worker's log records are those its producer sent (known from its metrics).
    _, producers = backend.query(
        f"SELECT DISTINCT cluster_id, worker, producer_id FROM {_t(backend, 'worker_metrics')} "
        f"WHERE {workers_condition}",
        workers_parameters,
    )
    worker_of = {(c, p): w for c, w, p in producers}
    producers_condition, producers_parameters = _pairs("cluster_id", "producer_id", sorted(worker_of))
    _, lines = backend.query(
        "SELECT cluster_id, producer_id, ts, level, logger, message, exc_text "
        f"FROM {_t(backend, 'logs')} WHERE {producers_condition} "
        "ORDER BY ts DESC, seq DESC, idx DESC",
        producers_parameters,
    ) if worker_of else ([], [])
    logs: dict[tuple, list] = defaultdict(list)
    for cluster_id, producer_id, ts, level, logger_name, message, exc_text in lines:
        worker = worker_of[(cluster_id, producer_id)]
        if len(logs[(cluster_id, worker)]) < log_lines:
            text = message + (f"\n{exc_text}" if exc_text else "")
            logs[(cluster_id, worker)].append((cluster_id, worker, ts, level, logger_name, text))
    out["dead_worker_logs"] = (
        ["cluster_id", "worker", "ts", "level", "logger", "message"],
        [r for owner in pairs for r in reversed(logs[owner])],
    )
    return out


def _pairs(first: str, second: str, pairs: list[tuple[str, str]]) -> tuple[str, dict]:
    """SQL matching rows whose (first, second) columns are one of ``pairs``: two
    parallel array parameters (tuples do not survive the query server's JSON)."""
    return (f"has(arrayZip({{{first}s:Array(String)}}, {{{second}s:Array(String)}}), ({first}, {second}))",
            {f"{first}s": [a for a, _ in pairs], f"{second}s": [b for _, b in pairs]})


def _subtrees(backend: Backend, roots: list[tuple[str, str]]) -> dict[tuple[str, str], set[str]]:
    """For each (cluster_id, span_id) root, the span ids of its tree."""
    clusters_involved = sorted({c for c, _ in roots})
    _, edges = backend.query(
        f"SELECT DISTINCT cluster_id, span_id, parent_id FROM {_t(backend, 'span_state')} "
        "WHERE cluster_id IN {c:Array(String)} UNION DISTINCT "
        f"SELECT DISTINCT cluster_id, span_id, parent_id FROM {_t(backend, 'spans')} "
        "WHERE cluster_id IN {c:Array(String)}",
        {"c": clusters_involved},
    )
    children = defaultdict(set)
    for cluster_id, span_id, parent_id in edges:
        if parent_id:
            children[(cluster_id, parent_id)].add(span_id)
    trees = {}
    for cluster_id, root in roots:
        tree, todo = set(), [root]
        while todo:
            span_id = todo.pop()
            if span_id not in tree:
                tree.add(span_id)
                todo.extend(children[(cluster_id, span_id)])
        trees[(cluster_id, root)] = tree
    return trees


def compare(backend: Backend, span_name: str, cluster: str | None = None,
            since: TimeBound = None, until: TimeBound = None, top: int = 10) -> Result:
    """The span called ``span_name`` (its '/'-joined full name, or its last tag) in
    every run and cluster, side by side: one column per span instance (cluster name
    and start), one row per metric -- elapsed seconds, task seconds, tasks, bytes,
    then compute seconds for the ``top`` prefixes."""
    f = _filter(backend, cluster, since, until, "enqueued")
    found = [
        s for s in _span_rows(backend, f)
        if " / ".join(s["name"]) == span_name or "/".join(s["name"]) == span_name
        or (s["name"] and s["name"][-1] == span_name)
    ]
    found.sort(key=lambda s: s["enqueued"])
    if not found:
        return ["metric"], []
    names = _names(backend)
    trees = _subtrees(backend, [(s["cluster_id"], s["span_id"]) for s in found])
    all_ids = sorted(set().union(*trees.values()))
    _, partials = backend.query(
        "SELECT cluster_id, span_id, prefix, sum(durations['compute']) "
        f"FROM {_t(backend, 'prefix_stats')} FINAL "
        "WHERE span_id IN {ids:Array(String)} GROUP BY cluster_id, span_id, prefix",
        {"ids": all_ids},
    )
    compute = [defaultdict(float) for _ in found]
    for i, s in enumerate(found):
        tree = trees[(s["cluster_id"], s["span_id"])]
        for cluster_id, span_id, prefix, seconds in partials:
            if cluster_id == s["cluster_id"] and span_id in tree:
                compute[i][prefix] += seconds
    totals = defaultdict(float)
    for per_prefix in compute:
        for prefix, seconds in per_prefix.items():
            totals[prefix] += seconds
    top_prefixes = sorted(totals, key=lambda p: (-totals[p], p))[:top]
    columns = ["metric"] + [
        f"{names.get(s['cluster_id'], s['cluster_id'])} {s['enqueued']:%Y-%m-%d %H:%M:%S}"
        for s in found
    ]

    def elapsed(s):
        start = s["start"]
        if not start or start.timestamp() <= 0 or not s["stop"]:
            return None
        return (s["stop"] - start).total_seconds()

    rows = [
        ("elapsed_s", *(elapsed(s) for s in found)),
        ("task_s", *(s["duration"] for s in found)),
        ("tasks", *(s["tasks"] for s in found)),
        ("nbytes", *(s["nbytes_total"] for s in found)),
    ] + [(f"compute_s {p}", *(c.get(p, 0.0) for c in compute)) for p in top_prefixes]
    return columns, rows


def table_counts(backend: Backend) -> Result:
    """Rows per table (one copy per key for the replacing tables)."""
    # The tables the sink writes are those with its _batch column.
    _, found = backend.query(
        "SELECT table FROM system.columns WHERE database = {db:String} AND name = '_batch' "
        "AND NOT endsWith(table, '_local') ORDER BY table", {"db": backend.database})
    parts = [
        f"SELECT '{table}' AS table, count() AS rows FROM {_t(backend, table)}"
        + (" FINAL" if table in _REPLACING else "")
        for (table,) in found
    ]
    return backend.query(" UNION ALL ".join(parts) + " ORDER BY table")


def gaps_and_drops(backend: Backend, cluster: str | None = None) -> Result:
    """Per producer: envelopes received, first and last seq, envelopes missing between
    them (seen by the sink), gaps the processors reported, events the producer
    dropped."""
    f = _filter(backend, cluster, None, None, None, cluster_column="e.cluster_id")
    return backend.query(
        "SELECT e.cluster_id AS cluster_id, any(e.cluster_name) AS cluster_name, "
        "e.producer_id AS producer_id, any(e.source) AS source, count() AS envelopes, "
        "min(e.seq) AS first_seq, max(e.seq) AS last_seq, "
        "max(e.seq) - min(e.seq) + 1 - uniqExact(e.seq) AS missing, "
        "any(g.reported) AS gaps_reported, any(d.dropped) AS dropped_events, "
        "max(e.sent_at) AS last_seen "
        f"FROM {_t(backend, 'envelopes')} AS e "
        "LEFT JOIN (SELECT cluster_id, producer_id, sum(missing_to - missing_from + 1) AS reported "
        f"FROM {_t(backend, 'gaps')} FINAL GROUP BY cluster_id, producer_id) AS g "
        "ON e.cluster_id = g.cluster_id AND e.producer_id = g.producer_id "
        "LEFT JOIN (SELECT cluster_id, producer_id, sum(dropped_events) AS dropped "
        f"FROM {_t(backend, 'drops')} GROUP BY cluster_id, producer_id) AS d "
        "ON e.cluster_id = d.cluster_id AND e.producer_id = d.producer_id "
        f"{f.where()} "
        "GROUP BY e.cluster_id, e.producer_id ORDER BY cluster_name, source, producer_id",
        f.parameters,
    )
