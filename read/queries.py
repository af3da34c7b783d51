"""The named queries the CLI, the UI and Python users run on the recorded history.

Each takes a :class:`~dask_blackbox.read.backends.Backend` (``connect()``, re-exported
here, gives the right one for the configuration; every backend runs one read-only
statement at a time, see :mod:`dask_blackbox.read.guard`).

Every named query takes ``cluster`` (a cluster name or id; None: all clusters),
``since`` and ``until`` (datetime, seconds since the epoch, or None; see
:mod:`dask_blackbox.read.filters`), and returns ``(columns, rows)`` -- except
:func:`failures` (the post-mortem, :mod:`dask_blackbox.read.failures`, re-exported
here), which returns several named result sets. Timestamps come back as ``datetime``
(UTC) except in :func:`story`, which keeps Scheduler.story's float seconds.
"""

from __future__ import annotations

from collections import defaultdict

from dask_blackbox.read import diagnosis
from dask_blackbox.read import cost as costs
from dask_blackbox.read.backends import Backend, QueryError, QueryRejected, Result, connect
from dask_blackbox.read.failures import failures
from dask_blackbox.read.filters import (Filter, TimeBound, UnknownCluster, build, cluster_ids,
                                        cluster_names, epoch, table)
from dask_blackbox.read.log_search import LEVELS, logs, logs_count

__all__ = ["Backend", "QueryError", "QueryRejected", "Result", "TimeBound", "UnknownCluster",
           "connect", "cluster_ids", "story", "spans", "prefixes", "metrics", "clusters", "failures",
           "compare", "table_counts", "gaps_and_drops", "recording_summary",
           "SPAN_COST_COLUMNS", "PREFIX_COST_COLUMNS", "logs", "logs_count", "LEVELS"]

#: The cost columns ``spans`` and ``prefixes`` add (see :mod:`dask_blackbox.read.cost`).
SPAN_COST_COLUMNS = ["cpu_s", "busy_s", "offered_s", "idle_s", "who_idle_s",
                     "moved_bytes", "spilled_bytes", "memory_byte_s"]
PREFIX_COST_COLUMNS = ["cpu_s", "busy_s", "moved_bytes", "spilled_bytes", "memory_byte_s"]

#: Tables where the latest version / one copy per key wins (read with FINAL).
_REPLACING = frozenset({"span_state", "prefix_stats", "gaps", "schema_migrations"})


# ------------------------------------------------------------- named queries


#: The transitions of tasks as they happened, in the shape of Scheduler.story (``key,
#: start, finish, stimulus_id, ts`` in float seconds), then where each happened;
#: ``{where}`` picks the cluster, the keys and the sources.
STORY = ("SELECT key, start, finish, stimulus_id, toFloat64(ts) AS ts, cluster_id, worker, source "
         "FROM {transitions} {where} "
         # seq/idx: the producer's own order, exact even when timestamps tie
         "ORDER BY ts, seq, idx")


def story(backend: Backend, key: str, cluster: str | None = None, since: TimeBound = None,
          until: TimeBound = None, source: str | None = "scheduler") -> Result:
    """The transitions of ``key`` as they happened, in the shape of Scheduler.story:
    ``key, start, finish, stimulus_id, ts`` (float seconds), then where it happened.

    ``source`` ("scheduler", the default, is what Scheduler.story shows; "worker" for
    worker-side transitions if recorded; None for both). Unlike Scheduler.story, the
    transitions of *other* keys that recommended this one are not included: Dask
    does not give them to plugins.
    """
    f = build(backend, cluster, since, until, "ts")
    f.add("key = {key:String}", key=key)
    if source is not None:
        f.add("source = {source:String}", source=source)
    return backend.query(STORY.format(transitions=table(backend, "transitions"), where=f.where()),
                         f.parameters)


#: What :func:`_span_rows` reads (from ``{span_state}``, ``{spans}``; ``{where}``,
#: ``{and_}`` filled in where it is run).
SPAN_ROWS = ("SELECT cluster_id, span_id, name, parent_id, enqueued, start, stop, duration, "
             "nbytes_total, arraySum(mapValues(states)) AS tasks, all_durations, done FROM "
             "{span_state} FINAL {where} UNION ALL SELECT cluster_id, span_id, any(name), "
             "any(parent_id), min(enqueued), NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM "
             "{spans} {where} {and_} (cluster_id, span_id) NOT IN (SELECT cluster_id, span_id "
             "FROM {span_state}) GROUP BY cluster_id, span_id")


def _span_rows(backend: Backend, f: Filter) -> list[dict]:
    """Spans in ``f``: the processors' latest snapshot where there is one, else the
    span as the scheduler announced it (name, parent, enqueued only)."""
    columns, rows = backend.query(
        SPAN_ROWS.format(span_state=table(backend, 'span_state'), where=f.where(), spans=table(backend, 'spans'), and_=f.and_()),
        f.parameters,
    )
    return [dict(zip(columns, row)) for row in rows]


#: Per span of a cluster (all, or those of ``ids``): its parent and Dask's count of the
#: tasks of its tree (``Span.states`` summed).
SPAN_TASKS = ("SELECT span_id, parent_id, arraySum(mapValues(states)) FROM {span_state} FINAL "
              "WHERE cluster_id = {{c:String}}{only}")


def dask_tasks(backend: Backend, cluster_id: str, span_ids: list[str] | None = None) -> int | None:
    """Dask's count of a run's tasks (or of the span trees of ``span_ids``): the
    tasks its root spans' trees held (``Span.states`` summed, forgotten ones
    included: a key submitted again after it was forgotten is a task again), what the
    Spans view shows at its roots; None when no span of it was recorded."""
    only, p = "", {"c": cluster_id}
    if span_ids is not None:
        only, p["ids"] = " AND span_id IN {ids:Array(String)}", list(span_ids)
    _, rows = backend.query(SPAN_TASKS.format(span_state=table(backend, "span_state"),
                                              only=only), p)
    if not rows:
        return None
    ids = {span_id for span_id, _, _ in rows}
    return int(sum(n for _, parent, n in rows if not parent or parent not in ids))


#: What :func:`span_name` reads (from ``{spans}``).
SPAN_NAME = ("SELECT any(name) FROM {spans} WHERE cluster_id = {{c:String}} AND span_id = "
             "{{s:String}}")


def span_name(backend: Backend, cluster_id: str, span_id: str) -> str:
    """The name of span ``span_id`` of ``cluster_id`` as the scheduler announced it,
    its parts joined by "/" ("" when no such span was recorded)."""
    _, rows = backend.query(
        SPAN_NAME.format(spans=table(backend, 'spans')), {"c": cluster_id, "s": span_id})
    return "/".join(rows[0][0]) if rows and rows[0][0] else ""


def tree_order(spans: list[dict]) -> list[tuple[int, dict]]:
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
          since: TimeBound = None, until: TimeBound = None, cost: bool | None = None) -> Result:
    """Span trees: per span its name, times, ``elapsed_s`` (stop - start),
    ``task_s`` (Dask's Span.duration: seconds of all task actions in the tree),
    ``tasks``, ``nbytes`` and seconds per action (compute, transfer, ...).

    ``tree=True`` orders spans as a tree (depth-first, siblings by time) and indents
    each name by its depth; otherwise spans come in order of enqueued time.

    ``cost`` (default: when a ``cluster`` is named; a cost reads every task of the
    clusters involved) adds the span tree's cost, :data:`SPAN_COST_COLUMNS` (see
    :mod:`~dask_blackbox.read.cost`): thread CPU seconds, thread-seconds occupied,
    offered (Dask's ``active_cpu_seconds``), idle in its window and who was idle,
    bytes moved between workers and spilled, and memory held (byte-seconds).
    """
    f = build(backend, cluster, since, until, "enqueued")
    found = _span_rows(backend, f)
    names = cluster_names(backend)
    ordered = tree_order(found) if tree else [
        (0, s) for s in sorted(found, key=lambda s: (s["enqueued"], s["cluster_id"], s["span_id"]))
    ]
    columns = ["cluster", "name", "span_id", "parent_id", "enqueued", "start", "stop", "elapsed_s",
               "task_s", "tasks", "nbytes", "by_action", "done", "depth"]
    priced = {}
    with_cost = cost if cost is not None else cluster is not None
    if with_cost:
        involved = sorted({s["cluster_id"] for s in found})
        priced = {(c.cluster_id, c.span_id): c for c in costs.span_costs(backend, involved)}
        columns += SPAN_COST_COLUMNS
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
        ) + (_span_cost(priced.get((s["cluster_id"], s["span_id"]))) if with_cost else ()))
    return columns, rows


def _span_cost(c: costs.SpanCost | None) -> tuple:
    if c is None:
        return (None,) * len(SPAN_COST_COLUMNS)
    m = c.measures
    return (m.cpu_s, m.busy_s, c.offered_s, c.idle_s, c.idle_by_worker, m.moved_bytes,
            m.spilled_bytes, m.memory_byte_s)


#: What :func:`_span_match` reads (from ``{span_state}``, ``{spans}``; ``{condition}``
#: filled in where it is run).
SPAN_MATCH = ("(SELECT span_id FROM {span_state} WHERE {condition} UNION DISTINCT SELECT "
              "span_id FROM {spans} WHERE {condition})")


def _span_match(backend: Backend, f: Filter, span: str) -> str:
    """SQL: span ids whose span matches ``span`` -- a tag anywhere in the name (so a
    span and all its sub-spans), or the full name joined with '/' -- and their
    descendants' ids."""
    f.parameters["span"] = span
    condition = ("(has(name, {span:String}) OR arrayStringConcat(name, '/') = {span:String} "
                 "OR startsWith(arrayStringConcat(name, '/'), {span:String} || '/'))")
    return (SPAN_MATCH.format(span_state=table(backend, 'span_state'), condition=condition, spans=table(backend, 'spans')))


#: What :func:`prefixes` reads (from ``{prefix_stats}``; ``{where}`` filled in where it is
#: run).
PREFIXES = ("SELECT prefix, sum(durations['compute']) AS compute_s, sumMap(durations) AS "
            "by_action, sum(finished['memory']) AS tasks, sum(n_erred) AS erred, sum(nbytes) "
            "AS nbytes, max(max_duration) AS longest_s, uniqExact(cluster_id) AS clusters "
            "FROM {prefix_stats} FINAL {where} GROUP BY prefix ORDER BY compute_s DESC, "
            "prefix LIMIT {{limit:UInt32}}")
#: What :func:`prefixes` reads (from ``{prefix_stats}``; ``{where}`` filled in where it is
#: run).
CLUSTERS_OF_PREFIXES = "SELECT DISTINCT cluster_id FROM {prefix_stats} {where}"
#: What :func:`prefixes` reads (``{span_match}`` filled in where it is run).
MATCHED_SPANS = "SELECT span_id FROM {span_match}"


def prefixes(backend: Backend, span: str | None = None, limit: int = 20,
             cluster: str | None = None, since: TimeBound = None,
             until: TimeBound = None, cost: bool | None = None) -> Result:
    """Top task prefixes by compute time, from the processors' per-minute partials
    (each partial counted once): compute seconds, seconds per action, tasks finished
    in memory, erred, bytes produced, the longest single compute, and in how many
    clusters. ``span``: only within spans whose name contains that tag (or equals
    that '/'-joined path), sub-spans included.

    ``cost`` (default: when a ``cluster`` is named) adds each prefix's cost in the
    clusters involved, :data:`PREFIX_COST_COLUMNS` (see :mod:`~dask_blackbox.read.cost`)."""
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, not {limit!r}")
    f = build(backend, cluster, since, until, "window_start")
    if span is not None:
        f.add(f"span_id IN {_span_match(backend, f, span)}")
    f.parameters["limit"] = limit
    columns, rows = backend.query(
        PREFIXES.format(prefix_stats=table(backend, 'prefix_stats'), where=f.where()),
        f.parameters,
    )
    if not (cost if cost is not None else cluster is not None):
        return columns, rows
    involved = cluster_ids(backend, cluster)
    if involved is None:
        g = build(backend, None, since, until, "window_start")
        _, found = backend.query(
            CLUSTERS_OF_PREFIXES.format(prefix_stats=table(backend, 'prefix_stats'), where=g.where()),
            g.parameters)
        involved = sorted(r[0] for r in found)
    in_span = None
    if span is not None:
        _, matched = backend.query(MATCHED_SPANS.format(span_match=_span_match(backend, Filter(), span)),
                                   {"span": span})
        in_span = {r[0] for r in matched}
    per_prefix = costs.by_prefix(costs.measures(backend, involved), in_span)
    return columns + PREFIX_COST_COLUMNS, [
        tuple(row) + tuple(per_prefix.get(row[0], costs.Measures(moved_bytes=None)))
        for row in rows]


#: What :func:`metrics` reads (from ``{worker_digests}``; ``{where}`` filled in where it is
#: run).
METRICS = ("SELECT context, prefix, activity, unit, sum(value) AS total, uniqExact(worker) AS "
           "workers FROM {worker_digests} {where} GROUP BY context, prefix, activity, unit "
           "ORDER BY unit, total DESC, context, prefix, activity LIMIT {{limit:UInt32}}")


def metrics(backend: Backend, context: str | None = None, limit: int = 50,
            cluster: str | None = None, since: TimeBound = None, until: TimeBound = None) -> Result:
    """Fine performance metrics, as the workers digested them (``Worker.digests_total``:
    Dask's own contexts, and what tasks reported with
    ``context_meter.digest_metric(label, value, unit)``): the total of each (context,
    prefix, activity, unit) over the scope, summed over workers and spans, largest
    first; ``context`` keeps one context (``execute``, ``gather-dep``, ``get-data``,
    ...)."""
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, not {limit!r}")
    f = build(backend, cluster, since, until, "ts")
    if context is not None:
        f.add("context = {context:String}", context=context)
    f.parameters["limit"] = limit
    return backend.query(
        METRICS.format(worker_digests=table(backend, 'worker_digests'), where=f.where()), f.parameters)


#: What :func:`clusters` reads (from ``{clusters}``, ``{lifecycle}``; ``{database}``,
#: ``{where}`` filled in where it is run).
#: The workers that reported metrics, from their roll-up (it outlives the metrics)
CLUSTERS = ("SELECT cluster_name, cluster_id, first_seen, last_seen, ifNull(w.workers, 0) AS "
            "workers, tasks_computed AS tasks, tasks_erred AS errors, ifNull(r.removed, 0) AS "
            "workers_removed, producers, envelopes FROM {clusters} AS c LEFT JOIN (SELECT "
            "cluster_id, uniqExact(worker) AS workers FROM (SELECT cluster_id, worker FROM "
            "{lifecycle} WHERE worker != '' UNION ALL SELECT DISTINCT cluster_id, worker FROM "
            "{database}_rollups.worker_minutes) GROUP BY cluster_id) AS w USING (cluster_id) "
            "LEFT JOIN (SELECT cluster_id, countIf(action = 'worker_removed') AS removed FROM "
            "{lifecycle} GROUP BY cluster_id) AS r USING (cluster_id) {where} ORDER BY "
            "first_seen")


def clusters(backend: Backend, cluster: str | None = None, since: TimeBound = None,
             until: TimeBound = None) -> Result:
    """Every cluster seen (or those matching ``cluster``; with since/until, those
    active in that window): first and last envelope, workers seen (joined, left or
    reporting metrics), tasks computed, tasks erred, worker removals, workers lost
    (removals whose cause is not "expected", :mod:`.diagnosis`), producers and
    envelopes. From the roll-ups and the lifecycle: the same answer after the raw rows
    (envelopes, metrics) have expired."""
    f = build(backend, cluster, None, None, None)
    start, stop = epoch(since, "since"), epoch(until, "until")
    if start is not None:
        f.add("last_seen >= toDateTime64({since:Float64}, 6, 'UTC')", since=start)
    if stop is not None:
        f.add("first_seen < toDateTime64({until:Float64}, 6, 'UTC')", until=stop)
    columns, rows = backend.query(
        CLUSTERS.format(clusters=table(backend, 'clusters'), lifecycle=table(backend, 'lifecycle'), database=backend.database, where=f.where()),
        f.parameters,
    )
    lost = diagnosis.death_counts(backend, sorted({r[1] for r in rows})) if rows else {}
    at = columns.index("workers_removed") + 1
    return (columns[:at] + ["workers_lost"] + columns[at:],
            [(*r[:at], lost.get(r[1], 0), *r[at:]) for r in rows])


#: What :func:`_subtrees` reads (from ``{span_state}``, ``{spans}``).
SUBTREES = ("SELECT DISTINCT cluster_id, span_id, parent_id FROM {span_state} WHERE "
            "cluster_id IN {{c:Array(String)}} UNION DISTINCT SELECT DISTINCT cluster_id, "
            "span_id, parent_id FROM {spans} WHERE cluster_id IN {{c:Array(String)}}")


def _subtrees(backend: Backend, roots: list[tuple[str, str]]) -> dict[tuple[str, str], set[str]]:
    """For each (cluster_id, span_id) root, the span ids of its tree."""
    clusters_involved = sorted({c for c, _ in roots})
    _, edges = backend.query(
        SUBTREES.format(span_state=table(backend, 'span_state'), spans=table(backend, 'spans')),
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


#: What :func:`compare` reads (from ``{prefix_stats}``).
COMPARE = ("SELECT cluster_id, span_id, prefix, sum(durations['compute']) FROM {prefix_stats} "
           "FINAL WHERE span_id IN {{ids:Array(String)}} GROUP BY cluster_id, span_id, prefix")


def compare(backend: Backend, span_name: str, cluster: str | None = None,
            since: TimeBound = None, until: TimeBound = None, top: int = 10) -> Result:
    """The span called ``span_name`` (its '/'-joined full name, or its last tag) in
    every run and cluster, side by side: one column per span instance (cluster name
    and start), one row per metric -- elapsed seconds, task seconds, tasks, bytes,
    then compute seconds for the ``top`` prefixes."""
    f = build(backend, cluster, since, until, "enqueued")
    found = [
        s for s in _span_rows(backend, f)
        if " / ".join(s["name"]) == span_name or "/".join(s["name"]) == span_name
        or (s["name"] and s["name"][-1] == span_name)
    ]
    found.sort(key=lambda s: s["enqueued"])
    if not found:
        return ["metric"], []
    names = cluster_names(backend)
    trees = _subtrees(backend, [(s["cluster_id"], s["span_id"]) for s in found])
    all_ids = sorted(set().union(*trees.values()))
    _, partials = backend.query(
        COMPARE.format(prefix_stats=table(backend, 'prefix_stats')),
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


#: What :func:`table_counts` reads.
TABLE_COUNTS = ("SELECT table FROM system.columns WHERE database = {db:String} AND name = "
                "'_batch' AND NOT endsWith(table, '_local') ORDER BY table")


#: The rows of one table ``{table}``, named ``{name}`` (``{final}``: `` FINAL`` for one
#: copy per key); :func:`table_counts` unites them.
TABLE_ROWS = "SELECT '{name}' AS table, count() AS rows FROM {table}{final}"


def table_counts(backend: Backend) -> Result:
    """Rows per table (one copy per key for the replacing tables)."""
    # The tables the sink writes are those with its _batch column.
    _, found = backend.query(TABLE_COUNTS, {"db": backend.database})
    parts = [TABLE_ROWS.format(name=name, table=table(backend, name),
                               final=" FINAL" if name in _REPLACING else "")
             for (name,) in found]
    return backend.query(" UNION ALL ".join(parts) + " ORDER BY table")


#: Per producer (``{where}``: the clusters, of ``e``): envelopes received, first and last
#: seq, envelopes missing between them, gaps the processors reported, events it dropped,
#: when it last sent; ``{having}`` keeps only some, ``{order}`` sorts before the names,
#: ``{limit}`` caps them.
GAPS_AND_DROPS = (
    "SELECT e.cluster_id AS cluster_id, any(e.cluster_name) AS cluster_name, "
    "e.producer_id AS producer_id, any(e.source) AS source, count() AS envelopes, "
    "min(e.seq) AS first_seq, max(e.seq) AS last_seq, "
    "max(e.seq) - min(e.seq) + 1 - uniqExact(e.seq) AS missing, "
    "any(g.reported) AS gaps_reported, any(d.dropped) AS dropped_events, "
    "max(e.sent_at) AS last_seen FROM {envelopes} AS e "
    "LEFT JOIN (SELECT cluster_id, producer_id, sum(missing_to - missing_from + 1) AS reported "
    "FROM {gaps} FINAL GROUP BY cluster_id, producer_id) AS g "
    "ON e.cluster_id = g.cluster_id AND e.producer_id = g.producer_id "
    "LEFT JOIN (SELECT cluster_id, producer_id, sum(dropped_events) AS dropped "
    "FROM {drops} GROUP BY cluster_id, producer_id) AS d "
    "ON e.cluster_id = d.cluster_id AND e.producer_id = d.producer_id "
    "{where} GROUP BY e.cluster_id, e.producer_id {having}"
    "ORDER BY {order}cluster_name, source, producer_id{limit}")


def gaps_and_drops(backend: Backend, cluster: str | None = None, problems_only: bool = False,
                   limit: int | None = None) -> Result:
    """Per producer: envelopes received, first and last seq, envelopes missing between
    them (seen by the sink), gaps the processors reported, events the producer
    dropped. ``problems_only``: only producers with something missing, reported or
    dropped; ``limit``: at most that many rows (the worst first when
    ``problems_only``)."""
    f = build(backend, cluster, None, None, None, cluster_column="e.cluster_id")
    having = ("HAVING missing > 0 OR ifNull(gaps_reported, 0) > 0 OR ifNull(dropped_events, 0) > 0 "
              if problems_only else "")
    order = ("missing + ifNull(gaps_reported, 0) + ifNull(dropped_events, 0) DESC, "
             if problems_only else "")
    if limit is not None:
        f.parameters["limit"] = int(limit)
    return backend.query(
        GAPS_AND_DROPS.format(envelopes=table(backend, 'envelopes'), gaps=table(backend, 'gaps'),
                              drops=table(backend, 'drops'), where=f.where(), having=having,
                              order=order,
                              limit=" LIMIT {limit:UInt32}" if limit is not None else ""),
        f.parameters,
    )


#: What :func:`recording_summary` reads (from ``{gaps}``, ``{drops}``, ``{envelopes}``).
RECORDING_SUMMARY = ("SELECT uniqExact(cluster_id) AS clusters, count() AS producers, sum(n) "
                     "AS envelopes, countIf(missing > 0) AS producers_missing_envelopes, "
                     "(SELECT uniqExact(cluster_id, producer_id) FROM {gaps}) AS "
                     "producers_with_gaps, (SELECT uniqExact(cluster_id, producer_id) FROM "
                     "{drops} WHERE dropped_events > 0) AS producers_with_drops FROM (SELECT "
                     "cluster_id, producer_id, count() AS n, max(seq) - min(seq) + 1 - "
                     "uniqExact(seq) AS missing FROM {envelopes} GROUP BY cluster_id, "
                     "producer_id)")


def recording_summary(backend: Backend) -> Result:
    """One row: clusters and producers recorded, envelopes, and how many producers
    have envelopes missing, gaps reported or events dropped."""
    return backend.query(
        RECORDING_SUMMARY.format(gaps=table(backend, 'gaps'), drops=table(backend, 'drops'), envelopes=table(backend, 'envelopes')))
