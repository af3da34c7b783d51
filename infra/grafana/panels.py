"""Every panel of dask-blackbox's Grafana dashboards, and its SQL: the one place where
a panel's query is written. ``dashboards.py`` builds the dashboards from these
(Grafana Foundation SDK), and tests/integration/test_grafana_queries.py runs each query, its macros
expanded, against a recorded run in chDB.

The SQL is for the Grafana ClickHouse data source plugin (grafana-clickhouse-
datasource): its macros (``$__timeFilter(column)``, ``$__fromTime``, ``$__toTime``,
``$__timeInterval(column)``, ``$__interval_s``) and Grafana's template variables
(``${cluster:percentencode}``, see :data:`CLUSTER_VALUE`). Tables are those of the
``blackbox`` database.
"""

from __future__ import annotations

from typing import NamedTuple


class Panel(NamedTuple):
    """A panel: ``kind`` is the Grafana visualisation (timeseries, table, stat,
    state-timeline, barchart, logs); ``query_type`` the plugin's (table, timeSeries,
    logs)."""

    title: str
    kind: str
    query_type: str
    sql: str
    description: str = ""
    width: int = 12
    height: int = 8


class Dashboard(NamedTuple):
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    #: the dashboard has a ``cluster`` variable (a recorded cluster's name)
    per_cluster: bool = False


#: The ``cluster`` variable's query: recorded clusters, the latest first.
CLUSTERS_VARIABLE = ("SELECT cluster_name FROM blackbox.clusters "
                     "ORDER BY last_seen DESC LIMIT 1000")

#: The ``cluster`` variable as a ClickHouse string. A cluster's name is whatever its
#: owner chose, so it reaches the SQL percent-encoded (Grafana's ``percentencode``
#: leaves only ``A-Za-z0-9-_.~%``, none of which a string literal or ClickHouse's
#: backslash escapes can misread) and is decoded by ClickHouse. Grafana's
#: ``singlequote`` would not do: it turns ``'`` into ``\'`` and leaves a backslash
#: as it is, so a name ending in ``\`` closes the literal.
CLUSTER_VALUE = "decodeURLComponent('${cluster:percentencode}')"

#: The runs named by the ``cluster`` variable (a name, or a scheduler id).
_CLUSTER = ("cluster_id IN (SELECT cluster_id FROM blackbox.clusters "
            f"WHERE cluster_name = {CLUSTER_VALUE} OR cluster_id = {CLUSTER_VALUE})")

_UNEXPECTED_REMOVAL = ("action = 'worker_removed' "
                       "AND JSONExtract(detail, 'expected', 'Nullable(Bool)') = false")

CLUSTERS = Dashboard("blackbox-clusters", "dask-blackbox: clusters",
                     "Every recorded Dask cluster: how its runs went.", (
    Panel("Clusters", "table", "table",
          "SELECT cluster_name, cluster_id, first_seen, last_seen, tasks_computed, tasks_erred, "
          "producers, envelopes FROM blackbox.clusters "
          "WHERE last_seen >= $__fromTime AND first_seen <= $__toTime ORDER BY first_seen DESC",
          "Runs seen in the time range: first and last envelope, tasks computed and erred.",
          width=24),
    Panel("Tasks finished", "timeseries", "timeSeries",
          "SELECT $__timeInterval(sent_at) AS time, cluster_name, sum(n_memory) AS tasks "
          "FROM blackbox.envelopes WHERE $__timeFilter(sent_at) "
          "GROUP BY time, cluster_name ORDER BY time",
          "Transitions into memory per interval, per cluster."),
    Panel("Tasks erred", "timeseries", "timeSeries",
          "SELECT $__timeInterval(sent_at) AS time, cluster_name, sum(n_erred) AS erred "
          "FROM blackbox.envelopes WHERE $__timeFilter(sent_at) "
          "GROUP BY time, cluster_name ORDER BY time",
          "Transitions into erred per interval, per cluster."),
    Panel("Workers lost", "stat", "table",
          f"SELECT count() AS workers_lost FROM blackbox.lifecycle WHERE {_UNEXPECTED_REMOVAL} "
          "AND $__timeFilter(ts)",
          "Workers the scheduler removed without expecting it (deaths).", width=6, height=5),
))

RUN = Dashboard("blackbox-run", "dask-blackbox: a run",
                "One recorded cluster: its task stream, progress, memory and spans.", (
    Panel("Task stream", "state-timeline", "timeSeries",
          "SELECT $__timeInterval(ss.start) AS time, worker, "
          "anyHeavy(if(ss.action = 'compute', prefix, ss.action)) AS doing "
          "FROM blackbox.transitions ARRAY JOIN startstops AS ss "
          f"WHERE source = 'scheduler' AND {_CLUSTER} AND $__timeFilter(ss.start) "
          "GROUP BY time, worker ORDER BY time, worker",
          "Per worker, what its threads spent each interval on most: the prefix computed, "
          "or transfer / disk.", width=24, height=10),
    Panel("Tasks finished per prefix", "timeseries", "timeSeries",
          "SELECT $__timeInterval(ts) AS time, prefix, count() AS tasks FROM blackbox.transitions "
          f"WHERE source = 'scheduler' AND finish IN ('memory', 'erred') AND {_CLUSTER} "
          "AND $__timeFilter(ts) GROUP BY time, prefix ORDER BY time",
          "Transitions into memory or erred per interval, per task prefix."),
    Panel("Tasks by state", "timeseries", "timeSeries",
          "SELECT $__timeInterval(ts) AS time, state, max(n) AS tasks FROM ("
          "SELECT ts, state, n FROM blackbox.scheduler_metrics "
          "ARRAY JOIN mapKeys(tasks_by_state) AS state, mapValues(tasks_by_state) AS n "
          f"WHERE {_CLUSTER} AND $__timeFilter(ts)) GROUP BY time, state ORDER BY time",
          "The scheduler's tasks per state, as it sampled them."),
    Panel("Memory per worker", "timeseries", "timeSeries",
          "SELECT $__timeInterval(ts) AS time, worker, avg(memory) AS memory "
          f"FROM blackbox.worker_metrics WHERE {_CLUSTER} AND $__timeFilter(ts) "
          "GROUP BY time, worker ORDER BY time",
          "Process memory of each worker (bytes), averaged per interval."),
    Panel("Managed, unmanaged and spilled memory", "timeseries", "timeSeries",
          "SELECT time, sum(managed) AS managed, sum(unmanaged) AS unmanaged, "
          "sum(spilled) AS spilled FROM (SELECT $__timeInterval(ts) AS time, worker, "
          "avg(ifNull(memory_managed, 0)) AS managed, avg(ifNull(memory_unmanaged, 0)) AS unmanaged, "
          f"avg(ifNull(memory_spilled, 0)) AS spilled FROM blackbox.worker_metrics WHERE {_CLUSTER} "
          "AND $__timeFilter(ts) GROUP BY time, worker) GROUP BY time ORDER BY time",
          "All workers' memory as Dask splits it (bytes)."),
    Panel("Spans", "table", "table",
          "SELECT arrayStringConcat(name, ' / ') AS span, start, stop, "
          "dateDiff('microsecond', start, stop) / 1e6 AS elapsed_s, duration AS task_s, "
          "arraySum(mapValues(states)) AS tasks, nbytes_total, done "
          f"FROM blackbox.span_state FINAL WHERE {_CLUSTER} "
          "AND enqueued <= $__toTime AND stop >= $__fromTime ORDER BY enqueued",
          "Dask's spans: elapsed and task seconds (Span.duration), tasks, bytes.", width=24),
    Panel("Compute seconds by prefix", "barchart", "table",
          "SELECT prefix, sum(durations['compute']) AS compute_s, sum(finished['memory']) AS tasks "
          f"FROM blackbox.prefix_stats FINAL WHERE {_CLUSTER} AND $__timeFilter(window_start) "
          "GROUP BY prefix ORDER BY compute_s DESC LIMIT 20",
          "Where the compute time went, per task prefix."),
    Panel("Worker deaths", "table", "table",
          "SELECT ts, worker, reason, JSONExtractInt(detail, 'processing_tasks') AS tasks_running "
          f"FROM blackbox.lifecycle WHERE {_CLUSTER} AND action = 'worker_removed' "
          "AND $__timeFilter(ts) ORDER BY ts",
          "Workers removed, with why and how many tasks each was running."),
), per_cluster=True)

FAILURES = Dashboard("blackbox-failures", "dask-blackbox: failures",
                     "Erred tasks, dead workers and what was logged, across clusters.", (
    Panel("Erred tasks", "table", "table",
          "SELECT t.ts, c.cluster_name, t.key, t.worker, t.exception, t.cause "
          "FROM blackbox.transitions AS t LEFT JOIN blackbox.clusters AS c USING (cluster_id) "
          "WHERE t.finish = 'erred' AND t.source = 'scheduler' AND $__timeFilter(t.ts) "
          "ORDER BY t.ts DESC LIMIT 500",
          "Each erred task with its exception and the task that caused it.", width=24),
    Panel("Erred tasks per prefix", "barchart", "table",
          "SELECT prefix, count() AS erred FROM blackbox.transitions "
          "WHERE finish = 'erred' AND source = 'scheduler' AND $__timeFilter(ts) "
          "GROUP BY prefix ORDER BY erred DESC LIMIT 20"),
    Panel("Worker deaths", "table", "table",
          "SELECT l.ts, c.cluster_name, l.worker, l.reason, "
          "JSONExtractInt(l.detail, 'processing_tasks') AS tasks_running, "
          "JSONExtractInt(l.detail, 'lost_computed_tasks') AS results_lost "
          "FROM blackbox.lifecycle AS l LEFT JOIN blackbox.clusters AS c USING (cluster_id) "
          f"WHERE l.{_UNEXPECTED_REMOVAL.replace('detail', 'l.detail')} AND $__timeFilter(l.ts) "
          "ORDER BY l.ts DESC",
          "Workers the scheduler did not expect to lose, and what they held."),
    Panel("Warnings and errors logged", "logs", "logs",
          "SELECT ts AS timestamp, level, concat(process, ' ', logger, ': ', message) AS body "
          "FROM blackbox.logs WHERE level IN ('WARNING', 'ERROR', 'CRITICAL') "
          "AND $__timeFilter(ts) ORDER BY ts DESC LIMIT 1000",
          "Log records of WARNING and above from every scheduler and worker.", width=24, height=10),
))

PIPELINE = Dashboard("blackbox-pipeline", "dask-blackbox: the pipeline",
                     "The recorder's own health: what arrived, what was loaded, what was lost.", (
    Panel("Envelopes received", "timeseries", "timeSeries",
          "SELECT $__timeInterval(sent_at) AS time, source, count() AS envelopes "
          "FROM blackbox.envelopes WHERE $__timeFilter(sent_at) GROUP BY time, source ORDER BY time",
          "Kafka messages loaded, by the kind of process that sent them."),
    Panel("Events per second", "timeseries", "timeSeries",
          "SELECT $__timeInterval(sent_at) AS time, sum(n_events) / $__interval_s AS events_per_s "
          "FROM blackbox.envelopes WHERE $__timeFilter(sent_at) GROUP BY time ORDER BY time"),
    Panel("Sink batches loaded", "timeseries", "timeSeries",
          "SELECT $__timeInterval(at) AS time, count() AS batches FROM blackbox.sink_batches "
          "WHERE state = 'loaded' AND $__timeFilter(at) GROUP BY time ORDER BY time"),
    Panel("Rows per table", "barchart", "table",
          "SELECT table, sum(rows) AS rows FROM system.parts WHERE database = 'blackbox' "
          "AND active GROUP BY table ORDER BY table"),
    Panel("Producers: envelopes missing, gaps, drops", "table", "table",
          "SELECT e.cluster_id, e.producer_id, any(e.source) AS source, count() AS envelopes, "
          "max(e.seq) - min(e.seq) + 1 - uniqExact(e.seq) AS missing, "
          "any(d.dropped) AS dropped_events FROM blackbox.envelopes AS e LEFT JOIN ("
          "SELECT cluster_id, producer_id, sum(dropped_events) AS dropped FROM blackbox.drops "
          "GROUP BY cluster_id, producer_id) AS d "
          "ON e.cluster_id = d.cluster_id AND e.producer_id = d.producer_id "
          "WHERE $__timeFilter(e.sent_at) GROUP BY e.cluster_id, e.producer_id "
          "ORDER BY missing DESC, envelopes DESC",
          "Per producer: envelopes loaded, envelopes missing between its first and last "
          "sequence number, events it reported dropping.", width=24),
    Panel("Dead letters", "stat", "table",
          "SELECT count() AS dead_letters FROM blackbox.dead_letters WHERE $__timeFilter(detected_at)",
          "Messages and events that could not be loaded as data (see the dead_letters table).",
          width=6, height=5),
    Panel("Sequence gaps", "stat", "table",
          "SELECT ifNull(sum(missing_to - missing_from + 1), 0) AS envelopes_missing "
          "FROM blackbox.gaps FINAL WHERE $__timeFilter(detected_at)",
          "Envelopes the processors saw missing.", width=6, height=5),
    Panel("Events dropped by producers", "stat", "table",
          "SELECT ifNull(sum(dropped_events), 0) AS dropped FROM blackbox.drops WHERE $__timeFilter(ts)",
          "Events the producers dropped because their buffer was full.", width=6, height=5),
))

DASHBOARDS = (CLUSTERS, RUN, FAILURES, PIPELINE)
