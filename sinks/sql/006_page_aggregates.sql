-- dask-blackbox ClickHouse schema, migration 006: what the Run page reads, aggregated as
-- the rows arrive, so that a page costs what it shows, not what the run holds.
--
-- Placeholders as in 001_init.sql (single-node values in brackets):
--   {database} [blackbox]   {ttl} [7776000 SECOND]   {on_cluster} []   {replicated} []
--   {local} []   {cluster}
-- Lines starting with "--cluster: " are kept only in cluster mode. Lines starting with
-- "--backfill: " are run once after the DDL (sinks/schema.py): they fill the aggregates
-- from the rows loaded before this migration.
--
-- Four aggregates, each filled by a materialized view (<table>_mv) as the sink inserts
-- raw rows, and read by read/aggregates.py:
-- * task_seconds: the scheduler's transitions per second, span, prefix and (start,
--   finish): the Run page's progress, tasks by state, counts and its time bounds.
-- * stream_seconds: the task stream per worker and second: the seconds of every
--   startstop (compute, transfer, disk-read, ...) within that second, and how many
--   began in it, per action, prefix, span and (transfers) the worker it came from. The
--   binned task stream, the Processing and Transfer views, tasks run per worker.
-- * group_totals: per task group (and day): its prefix, the distinct keys seen, the
--   transitions into memory and erred, compute and transfer seconds, bytes, its first
--   compute start and last stop. The Task Groups view, the grouped task graph, the
--   distinct tasks per prefix (uniqExactMerge over groups).
-- * digest_totals: the workers' fine performance metrics (worker_digests) per worker,
--   context, span, prefix, activity and unit (and day): every context, execute and
--   the others (get-data, gather-dep, memory-monitor, ...).
--
-- Exactly once: `_batch` ends each sorting key, so rows of different sink batches
-- never merge, and the loader deletes an abandoned batch's rows from these tables as
-- from the raw ones (sinks/tables.py AGGREGATES). Readers aggregate (sum, min, max,
-- uniqExactMerge); a row is never read as final.
--
-- The backfill is idempotent: it aggregates only the batches the views have not
-- (`_batch` not yet in the aggregate), so re-running it after an interruption
-- counts nothing twice.

CREATE TABLE IF NOT EXISTS {database}.task_seconds{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    span_id    LowCardinality(String),
    prefix     LowCardinality(String),
    start      LowCardinality(String),
    finish     LowCardinality(String),
    second     DateTime('UTC'),                                  -- the transitions' ts, whole seconds
    _batch     UInt64,
    n          SimpleAggregateFunction(sum, UInt64),             -- transitions
    first_ts   SimpleAggregateFunction(min, DateTime64(6, 'UTC')),
    last_ts    SimpleAggregateFunction(max, DateTime64(6, 'UTC'))
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toMonday(second)
ORDER BY (cluster_id, span_id, prefix, start, finish, second, _batch)
TTL second + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.task_seconds {on_cluster}
--cluster:   AS {database}.task_seconds_local
--cluster:   ENGINE = Distributed({cluster}, {database}, task_seconds_local, cityHash64(cluster_id));

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.task_seconds_mv{local} {on_cluster}
TO {database}.task_seconds{local} AS
SELECT cluster_id, span_id, prefix, start, finish, toDateTime(ts, 'UTC') AS second, _batch,
       count() AS n, min(ts) AS first_ts, max(ts) AS last_ts
FROM {database}.transitions{local}
WHERE source = 'scheduler'
GROUP BY cluster_id, span_id, prefix, start, finish, second, _batch;

CREATE TABLE IF NOT EXISTS {database}.stream_seconds{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    worker     LowCardinality(String),
    second     DateTime('UTC'),
    action     LowCardinality(String),                           -- compute, transfer, disk-read, ...
    prefix     LowCardinality(String),                           -- of the task the action was for
    span_id    LowCardinality(String),
    sender     LowCardinality(String),                           -- a transfer's sender ('' otherwise)
    _batch     UInt64,
    busy       SimpleAggregateFunction(sum, Float64),            -- seconds of the actions within this second
    started    SimpleAggregateFunction(sum, UInt64),             -- actions that began in this second
    erred      SimpleAggregateFunction(sum, UInt64)              -- of them, those of tasks that erred
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toMonday(second)
ORDER BY (cluster_id, worker, second, action, prefix, span_id, sender, _batch)
TTL second + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.stream_seconds {on_cluster}
--cluster:   AS {database}.stream_seconds_local
--cluster:   ENGINE = Distributed({cluster}, {database}, stream_seconds_local, cityHash64(cluster_id));

-- An action from start to stop covers the seconds floor(start) .. ceil(stop) - 1 (at
-- least one): its seconds within each, and "began" in the first.
CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.stream_seconds_mv{local} {on_cluster}
TO {database}.stream_seconds{local} AS
SELECT cluster_id, worker, toDateTime(s, 'UTC') AS second, ss.action AS action, prefix, span_id,
       ss.source AS sender, _batch,
       sum(greatest(0., least(toFloat64(ss.stop), toFloat64(s) + 1) - greatest(toFloat64(ss.start), toFloat64(s)))) AS busy,
       countIf(s = toUInt32(floor(toFloat64(ss.start)))) AS started,
       countIf(s = toUInt32(floor(toFloat64(ss.start))) AND finish = 'erred') AS erred
FROM {database}.transitions{local}
ARRAY JOIN startstops AS ss
ARRAY JOIN range(toUInt32(floor(toFloat64(ss.start))),
                 toUInt32(greatest(floor(toFloat64(ss.start)) + 1, ceil(toFloat64(ss.stop))))) AS s
WHERE source = 'scheduler'
GROUP BY cluster_id, worker, second, action, prefix, span_id, sender, _batch;

CREATE TABLE IF NOT EXISTS {database}.group_totals{local} {on_cluster}
(
    cluster_id  LowCardinality(String),
    span_id     LowCardinality(String),
    task_group  LowCardinality(String),
    day         Date,
    _batch      UInt64,
    prefix      SimpleAggregateFunction(anyLast, String),
    keys        AggregateFunction(uniqExact, UInt64),            -- cityHash64 of the keys seen
    memory      SimpleAggregateFunction(sum, UInt64),            -- transitions into memory
    erred       SimpleAggregateFunction(sum, UInt64),            -- transitions into erred
    compute_s   SimpleAggregateFunction(sum, Float64),
    transfer_s  SimpleAggregateFunction(sum, Float64),
    nbytes      SimpleAggregateFunction(sum, Int64),             -- of the results (into memory)
    first_start SimpleAggregateFunction(min, Nullable(Float64)), -- first compute start, epoch seconds
    last_stop   SimpleAggregateFunction(max, Nullable(Float64))  -- last compute stop
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toMonday(day)
ORDER BY (cluster_id, span_id, task_group, day, _batch)
TTL day + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.group_totals {on_cluster}
--cluster:   AS {database}.group_totals_local
--cluster:   ENGINE = Distributed({cluster}, {database}, group_totals_local, cityHash64(cluster_id));

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.group_totals_mv{local} {on_cluster}
TO {database}.group_totals{local} AS
SELECT cluster_id, span_id, task_group, toDate(ts, 'UTC') AS day, _batch,
       anyLast(toString(prefix)) AS prefix, uniqExactState(cityHash64(key)) AS keys,
       countIf(finish = 'memory') AS memory, countIf(finish = 'erred') AS erred,
       sum(arraySum(arrayMap((a, b, e) -> if(a = 'compute', toFloat64(e) - toFloat64(b), 0.),
                             startstops.action, startstops.start, startstops.stop))) AS compute_s,
       sum(arraySum(arrayMap((a, b, e) -> if(a = 'transfer', toFloat64(e) - toFloat64(b), 0.),
                             startstops.action, startstops.start, startstops.stop))) AS transfer_s,
       sumIf(ifNull(nbytes, 0), finish = 'memory') AS nbytes,
       minOrNullIf(toFloat64(startstops.start[indexOf(startstops.action, 'compute')]),
                   has(startstops.action, 'compute')) AS first_start,
       maxOrNullIf(toFloat64(startstops.stop[indexOf(startstops.action, 'compute')]),
                   has(startstops.action, 'compute')) AS last_stop
FROM {database}.transitions{local}
WHERE source = 'scheduler'
GROUP BY cluster_id, span_id, task_group, day, _batch;

CREATE TABLE IF NOT EXISTS {database}.digest_totals{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    worker     LowCardinality(String),
    context    LowCardinality(String),
    span_id    LowCardinality(String),
    prefix     LowCardinality(String),
    activity   LowCardinality(String),
    unit       LowCardinality(String),
    day        Date,
    _batch     UInt64,
    value      SimpleAggregateFunction(sum, Float64)
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toMonday(day)
ORDER BY (cluster_id, worker, context, span_id, prefix, activity, unit, day, _batch)
TTL day + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.digest_totals {on_cluster}
--cluster:   AS {database}.digest_totals_local
--cluster:   ENGINE = Distributed({cluster}, {database}, digest_totals_local, cityHash64(cluster_id));

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.digest_totals_mv{local} {on_cluster}
TO {database}.digest_totals{local} AS
SELECT cluster_id, worker, context, span_id, prefix, activity, unit, toDate(ts, 'UTC') AS day, _batch,
       sum(value) AS value
FROM {database}.worker_digests{local}
GROUP BY cluster_id, worker, context, span_id, prefix, activity, unit, day, _batch;

--backfill: INSERT INTO {database}.task_seconds
--backfill: SELECT cluster_id, span_id, prefix, start, finish, toDateTime(ts, 'UTC') AS second, _batch,
--backfill:        count() AS n, min(ts) AS first_ts, max(ts) AS last_ts
--backfill: FROM {database}.transitions
--backfill: WHERE source = 'scheduler' AND _batch NOT IN (SELECT DISTINCT _batch FROM {database}.task_seconds)
--backfill: GROUP BY cluster_id, span_id, prefix, start, finish, second, _batch;
--backfill: INSERT INTO {database}.stream_seconds
--backfill: SELECT cluster_id, worker, toDateTime(s, 'UTC') AS second, ss.action AS action, prefix, span_id,
--backfill:        ss.source AS sender, _batch,
--backfill:        sum(greatest(0., least(toFloat64(ss.stop), toFloat64(s) + 1) - greatest(toFloat64(ss.start), toFloat64(s)))) AS busy,
--backfill:        countIf(s = toUInt32(floor(toFloat64(ss.start)))) AS started,
--backfill:        countIf(s = toUInt32(floor(toFloat64(ss.start))) AND finish = 'erred') AS erred
--backfill: FROM {database}.transitions
--backfill: ARRAY JOIN startstops AS ss
--backfill: ARRAY JOIN range(toUInt32(floor(toFloat64(ss.start))),
--backfill:                  toUInt32(greatest(floor(toFloat64(ss.start)) + 1, ceil(toFloat64(ss.stop))))) AS s
--backfill: WHERE source = 'scheduler' AND _batch NOT IN (SELECT DISTINCT _batch FROM {database}.stream_seconds)
--backfill: GROUP BY cluster_id, worker, second, action, prefix, span_id, sender, _batch;
--backfill: INSERT INTO {database}.group_totals
--backfill: SELECT cluster_id, span_id, task_group, toDate(ts, 'UTC') AS day, _batch,
--backfill:        anyLast(toString(prefix)) AS prefix, uniqExactState(cityHash64(key)) AS keys,
--backfill:        countIf(finish = 'memory') AS memory, countIf(finish = 'erred') AS erred,
--backfill:        sum(arraySum(arrayMap((a, b, e) -> if(a = 'compute', toFloat64(e) - toFloat64(b), 0.),
--backfill:                              startstops.action, startstops.start, startstops.stop))) AS compute_s,
--backfill:        sum(arraySum(arrayMap((a, b, e) -> if(a = 'transfer', toFloat64(e) - toFloat64(b), 0.),
--backfill:                              startstops.action, startstops.start, startstops.stop))) AS transfer_s,
--backfill:        sumIf(ifNull(nbytes, 0), finish = 'memory') AS nbytes,
--backfill:        minOrNullIf(toFloat64(startstops.start[indexOf(startstops.action, 'compute')]),
--backfill:                    has(startstops.action, 'compute')) AS first_start,
--backfill:        maxOrNullIf(toFloat64(startstops.stop[indexOf(startstops.action, 'compute')]),
--backfill:                    has(startstops.action, 'compute')) AS last_stop
--backfill: FROM {database}.transitions
--backfill: WHERE source = 'scheduler' AND _batch NOT IN (SELECT DISTINCT _batch FROM {database}.group_totals)
--backfill: GROUP BY cluster_id, span_id, task_group, day, _batch;
--backfill: INSERT INTO {database}.digest_totals
--backfill: SELECT cluster_id, worker, context, span_id, prefix, activity, unit, toDate(ts, 'UTC') AS day, _batch,
--backfill:        sum(value) AS value
--backfill: FROM {database}.worker_digests
--backfill: WHERE _batch NOT IN (SELECT DISTINCT _batch FROM {database}.digest_totals)
--backfill: GROUP BY cluster_id, worker, context, span_id, prefix, activity, unit, day, _batch;
