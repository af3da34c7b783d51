-- dask-blackbox ClickHouse schema, migration 008: roll-ups, the history that outlives
-- its detail.
--
-- Placeholders as in 001_init.sql (single-node values in brackets), and:
--   {rollup_ttl}  blackbox.clickhouse.rollup-retention as an interval [63072000 SECOND]
-- Lines starting with "--cluster: " are kept only in cluster mode.
--
-- Raw rows (transitions, graphs, logs, metrics, envelopes, ...) are kept for
-- blackbox.clickhouse.retention. What a run leaves behind for longer
-- (blackbox.clickhouse.rollup-retention) is:
-- * three roll-up tables, per minute, filled by materialized views as the sink inserts
--   the raw rows: task_minutes (scheduler transitions per span, prefix and worker:
--   counts into and out of each state, seconds per action, bytes, the longest compute),
--   worker_minutes (worker metrics: samples, memory, CPU) and cluster_minutes
--   (envelopes: the cluster's name, producers, first and last envelope, events, tasks
--   computed and erred);
-- * the tables that are already one row per span, prefix-minute or event of a
--   cluster's life: span_state, spans, prefix_stats, lifecycle, worker_exits, gaps,
--   drops (their TTL moves to {rollup_ttl} below).
-- The `clusters` view reads cluster_minutes from now on: its answer does not change
-- when the envelopes expire.
--
-- Exactly once: a roll-up row belongs to the sink batch whose insert made it (`_batch`
-- ends the sorting key, so rows of different batches never merge while a batch may
-- still be abandoned), and the loader deletes an abandoned batch's rows from the
-- roll-ups as from every table. Seven days after a batch was loaded (its id is its
-- time: microseconds << 12), a TTL GROUP BY folds its rows into one row per key and
-- minute; a sink that stays down for more than seven days with a batch half loaded
-- would leave that batch counted in the folded rows.
--
-- The roll-ups and the materialized views that fill them (<table>_mv) live in the
-- database {database}_rollups: what {database} holds stays one row per thing
-- recorded. In cluster mode the views are on each node's <table>_local and write that
-- node's roll-up (a cluster's rows stay on one shard).
--
-- The roll-ups are backfilled from the raw rows already loaded (the "--backfill: "
-- lines, which sinks/schema.py runs after the DDL, on a cluster too): every batch the
-- views have not rolled up yet (`_batch` not in the roll-up), so re-running this
-- migration after an interruption counts nothing twice.
--
-- Readers aggregate the roll-ups (sum, sumMap, max, min; argMaxMerge, uniqExactMerge
-- in cluster_minutes); read/history.py says which answers come from them.

CREATE DATABASE IF NOT EXISTS {database}_rollups {on_cluster};

CREATE TABLE IF NOT EXISTS {database}_rollups.task_minutes{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    minute     DateTime('UTC'),                -- the minute of the transitions' ts
    span_id    LowCardinality(String),
    prefix     LowCardinality(String),
    worker     LowCardinality(String),
    _batch     UInt64,
    into       SimpleAggregateFunction(sumMap, Map(String, UInt64)),   -- transitions by finish
    out_of     SimpleAggregateFunction(sumMap, Map(String, UInt64)),   -- transitions by start
    durations  SimpleAggregateFunction(sumMap, Map(String, Float64)),  -- startstop seconds by action
    nbytes     SimpleAggregateFunction(sum, Int64),                    -- bytes of results (into memory)
    longest    SimpleAggregateFunction(max, Float64),                  -- longest single compute
    first_ts   SimpleAggregateFunction(min, DateTime64(6, 'UTC')),
    last_ts    SimpleAggregateFunction(max, DateTime64(6, 'UTC'))
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toStartOfMonth(minute)
ORDER BY (cluster_id, minute, span_id, prefix, worker, _batch)
TTL toDateTime(intDiv(_batch, 4096000000)) + INTERVAL 7 DAY
        GROUP BY cluster_id, minute, span_id, prefix, worker
        SET _batch = min(_batch), into = sumMap(into), out_of = sumMap(out_of),
            durations = sumMap(durations), nbytes = sum(nbytes), longest = max(longest),
            first_ts = min(first_ts), last_ts = max(last_ts),
    minute + INTERVAL {rollup_ttl};
--cluster: CREATE TABLE IF NOT EXISTS {database}_rollups.task_minutes {on_cluster}
--cluster:   AS {database}_rollups.task_minutes_local
--cluster:   ENGINE = Distributed({cluster}, {database}_rollups, task_minutes_local, cityHash64(cluster_id));

CREATE TABLE IF NOT EXISTS {database}_rollups.worker_minutes{local} {on_cluster}
(
    cluster_id       LowCardinality(String),
    minute           DateTime('UTC'),
    worker           LowCardinality(String),
    _batch           UInt64,
    samples          SimpleAggregateFunction(sum, UInt64),
    -- sums over the samples (an average is sum / samples), NULL counted as 0
    memory_managed   SimpleAggregateFunction(sum, Int64),
    memory_unmanaged SimpleAggregateFunction(sum, Int64),  -- memory_unmanaged, else memory
    memory_spilled   SimpleAggregateFunction(sum, Int64),
    memory_peak      SimpleAggregateFunction(max, Int64),  -- the largest `memory` sampled
    cpu              SimpleAggregateFunction(sum, Float64),
    first_ts         SimpleAggregateFunction(min, DateTime64(6, 'UTC')),
    last_ts          SimpleAggregateFunction(max, DateTime64(6, 'UTC'))
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toStartOfMonth(minute)
ORDER BY (cluster_id, minute, worker, _batch)
TTL toDateTime(intDiv(_batch, 4096000000)) + INTERVAL 7 DAY
        GROUP BY cluster_id, minute, worker
        SET _batch = min(_batch), samples = sum(samples), memory_managed = sum(memory_managed),
            memory_unmanaged = sum(memory_unmanaged), memory_spilled = sum(memory_spilled),
            memory_peak = max(memory_peak), cpu = sum(cpu), first_ts = min(first_ts),
            last_ts = max(last_ts),
    minute + INTERVAL {rollup_ttl};
--cluster: CREATE TABLE IF NOT EXISTS {database}_rollups.worker_minutes {on_cluster}
--cluster:   AS {database}_rollups.worker_minutes_local
--cluster:   ENGINE = Distributed({cluster}, {database}_rollups, worker_minutes_local, cityHash64(cluster_id));

CREATE TABLE IF NOT EXISTS {database}_rollups.cluster_minutes{local} {on_cluster}
(
    cluster_id     LowCardinality(String),
    minute         DateTime('UTC'),              -- the minute of the envelopes' sent_at
    _batch         UInt64,
    cluster_name   AggregateFunction(argMax, String, DateTime64(6, 'UTC')),
    producers      AggregateFunction(uniqExact, String),
    first_seen     SimpleAggregateFunction(min, DateTime64(6, 'UTC')),
    last_seen      SimpleAggregateFunction(max, DateTime64(6, 'UTC')),
    envelopes      SimpleAggregateFunction(sum, UInt64),
    events         SimpleAggregateFunction(sum, UInt64),
    tasks_computed SimpleAggregateFunction(sum, UInt64),
    tasks_erred    SimpleAggregateFunction(sum, UInt64)
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toStartOfMonth(minute)
ORDER BY (cluster_id, minute, _batch)
TTL toDateTime(intDiv(_batch, 4096000000)) + INTERVAL 7 DAY
        GROUP BY cluster_id, minute
        SET _batch = min(_batch), cluster_name = argMaxMergeState(cluster_name),
            producers = uniqExactMergeState(producers), first_seen = min(first_seen),
            last_seen = max(last_seen), envelopes = sum(envelopes), events = sum(events),
            tasks_computed = sum(tasks_computed), tasks_erred = sum(tasks_erred),
    minute + INTERVAL {rollup_ttl};
--cluster: CREATE TABLE IF NOT EXISTS {database}_rollups.cluster_minutes {on_cluster}
--cluster:   AS {database}_rollups.cluster_minutes_local
--cluster:   ENGINE = Distributed({cluster}, {database}_rollups, cluster_minutes_local, cityHash64(cluster_id));

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}_rollups.task_minutes_mv {on_cluster}
TO {database}_rollups.task_minutes{local} AS
SELECT
    cluster_id, toStartOfMinute(toDateTime(ts)) AS minute, span_id, prefix, worker, _batch,
    sumMap(map(toString(finish), toUInt64(1))) AS into,
    sumMap(map(toString(start), toUInt64(1))) AS out_of,
    sumMap(mapFromArrays(arrayMap(a -> toString(a), startstops.action),
                         arrayMap((s, e) -> toFloat64(e) - toFloat64(s), startstops.start, startstops.stop))) AS durations,
    sumIf(ifNull(nbytes, 0), finish = 'memory') AS nbytes,
    max(arrayMax(arrayMap((a, s, e) -> if(a = 'compute', toFloat64(e) - toFloat64(s), 0.),
                          startstops.action, startstops.start, startstops.stop))) AS longest,
    min(ts) AS first_ts, max(ts) AS last_ts
FROM {database}.transitions{local}
WHERE source = 'scheduler'
GROUP BY cluster_id, minute, span_id, prefix, worker, _batch;

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}_rollups.worker_minutes_mv {on_cluster}
TO {database}_rollups.worker_minutes{local} AS
SELECT
    cluster_id, toStartOfMinute(toDateTime(ts)) AS minute, worker, _batch,
    count() AS samples, sum(ifNull(memory_managed, 0)) AS memory_managed,
    sum(ifNull(memory_unmanaged, ifNull(memory, 0))) AS memory_unmanaged,
    sum(ifNull(memory_spilled, 0)) AS memory_spilled, max(ifNull(memory, 0)) AS memory_peak,
    sum(ifNull(cpu, 0)) AS cpu, min(ts) AS first_ts, max(ts) AS last_ts
FROM {database}.worker_metrics{local}
GROUP BY cluster_id, minute, worker, _batch;

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}_rollups.cluster_minutes_mv {on_cluster}
TO {database}_rollups.cluster_minutes{local} AS
SELECT
    cluster_id, toStartOfMinute(toDateTime(sent_at)) AS minute, _batch,
    argMaxState(toString(cluster_name), sent_at) AS cluster_name,
    uniqExactState(toString(producer_id)) AS producers,
    min(sent_at) AS first_seen, max(sent_at) AS last_seen, count() AS envelopes,
    sum(n_events) AS events, sum(n_memory) AS tasks_computed, sum(n_erred) AS tasks_erred
FROM {database}.envelopes{local}
GROUP BY cluster_id, minute, _batch;

--backfill: INSERT INTO {database}_rollups.task_minutes
--backfill: SELECT
--backfill:     cluster_id, toStartOfMinute(toDateTime(ts)) AS minute, span_id, prefix, worker, _batch,
--backfill:     sumMap(map(toString(finish), toUInt64(1))), sumMap(map(toString(start), toUInt64(1))),
--backfill:     sumMap(mapFromArrays(arrayMap(a -> toString(a), startstops.action),
--backfill:                          arrayMap((s, e) -> toFloat64(e) - toFloat64(s), startstops.start, startstops.stop))),
--backfill:     sumIf(ifNull(nbytes, 0), finish = 'memory'),
--backfill:     max(arrayMax(arrayMap((a, s, e) -> if(a = 'compute', toFloat64(e) - toFloat64(s), 0.),
--backfill:                           startstops.action, startstops.start, startstops.stop))),
--backfill:     min(ts), max(ts)
--backfill: FROM {database}.transitions
--backfill: WHERE source = 'scheduler' AND _batch GLOBAL NOT IN (SELECT _batch FROM {database}_rollups.task_minutes)
--backfill: GROUP BY cluster_id, minute, span_id, prefix, worker, _batch;

--backfill: INSERT INTO {database}_rollups.worker_minutes
--backfill: SELECT
--backfill:     cluster_id, toStartOfMinute(toDateTime(ts)) AS minute, worker, _batch, count(),
--backfill:     sum(ifNull(memory_managed, 0)), sum(ifNull(memory_unmanaged, ifNull(memory, 0))),
--backfill:     sum(ifNull(memory_spilled, 0)), max(ifNull(memory, 0)), sum(ifNull(cpu, 0)), min(ts), max(ts)
--backfill: FROM {database}.worker_metrics
--backfill: WHERE _batch GLOBAL NOT IN (SELECT _batch FROM {database}_rollups.worker_minutes)
--backfill: GROUP BY cluster_id, minute, worker, _batch;

--backfill: INSERT INTO {database}_rollups.cluster_minutes
--backfill: SELECT
--backfill:     cluster_id, toStartOfMinute(toDateTime(sent_at)) AS minute, _batch,
--backfill:     argMaxState(toString(cluster_name), sent_at), uniqExactState(toString(producer_id)),
--backfill:     min(sent_at), max(sent_at), count(), sum(n_events), sum(n_memory), sum(n_erred)
--backfill: FROM {database}.envelopes
--backfill: WHERE _batch GLOBAL NOT IN (SELECT _batch FROM {database}_rollups.cluster_minutes)
--backfill: GROUP BY cluster_id, minute, _batch;

CREATE OR REPLACE VIEW {database}.clusters {on_cluster} AS
SELECT
    cluster_id,
    argMaxMerge(cluster_name)  AS cluster_name,
    min(first_seen)            AS first_seen,
    max(last_seen)             AS last_seen,
    uniqExactMerge(producers)  AS producers,
    sum(envelopes)             AS envelopes,
    sum(events)                AS events,
    sum(tasks_computed)        AS tasks_computed,
    sum(tasks_erred)           AS tasks_erred
FROM {database}_rollups.cluster_minutes
GROUP BY cluster_id;

-- The tables that outlive the raw rows.
ALTER TABLE {database}.span_state{local} {on_cluster} MODIFY TTL toDateTime(enqueued) + INTERVAL {rollup_ttl};
ALTER TABLE {database}.spans{local} {on_cluster} MODIFY TTL toDateTime(ts) + INTERVAL {rollup_ttl};
ALTER TABLE {database}.prefix_stats{local} {on_cluster} MODIFY TTL window_start + INTERVAL {rollup_ttl};
ALTER TABLE {database}.lifecycle{local} {on_cluster} MODIFY TTL toDateTime(ts) + INTERVAL {rollup_ttl};
ALTER TABLE {database}.worker_exits{local} {on_cluster} MODIFY TTL toDateTime(ts) + INTERVAL {rollup_ttl};
ALTER TABLE {database}.gaps{local} {on_cluster} MODIFY TTL toDateTime(detected_at) + INTERVAL {rollup_ttl};
ALTER TABLE {database}.drops{local} {on_cluster} MODIFY TTL toDateTime(ts) + INTERVAL {rollup_ttl};
