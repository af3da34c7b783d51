-- dask-blackbox ClickHouse schema, migration 009: the tasks of each group that reached
-- memory, counted exactly for the page aggregates.
--
-- Placeholders as in 001_init.sql (single-node values in brackets):
--   {database} [blackbox]   {ttl} [7776000 SECOND]   {on_cluster} []   {replicated} []
--   {local} []   {cluster}
-- Lines starting with "--cluster: " are kept only in cluster mode; lines starting with
-- "--backfill: " are run once after the DDL (sinks/schema.py).
--
-- group_totals (006) counts a group's transitions into memory: a task whose result was
-- computed again (its worker lost it) counts twice there, so on a big run the Task
-- groups view could not tell one task recomputed from every task computed when
-- another task of the group never finished. group_memory_keys holds, per group (and
-- day and sink batch, as 006's aggregates), the distinct keys that reached memory:
-- uniqExactMerge(keys) is the group's tasks computed, and group_totals' sum(memory)
-- minus it the recomputations (read/aggregates.py groups).
--
-- Exactly once and the backfill as in 006: `_batch` ends the sorting key, the loader
-- deletes an abandoned batch's rows (sinks/tables.py AGGREGATES), and the backfill
-- aggregates only the batches the view has not (GLOBAL, as in 008: on a cluster both
-- tables are Distributed).

CREATE TABLE IF NOT EXISTS {database}.group_memory_keys{local} {on_cluster}
(
    cluster_id  LowCardinality(String),
    span_id     LowCardinality(String),
    task_group  LowCardinality(String),
    day         Date,
    _batch      UInt64,
    keys        AggregateFunction(uniqExact, UInt64)             -- cityHash64 of the keys into memory
)
ENGINE = {replicated}AggregatingMergeTree
PARTITION BY toMonday(day)
ORDER BY (cluster_id, span_id, task_group, day, _batch)
TTL day + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.group_memory_keys {on_cluster}
--cluster:   AS {database}.group_memory_keys_local
--cluster:   ENGINE = Distributed({cluster}, {database}, group_memory_keys_local, cityHash64(cluster_id));

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.group_memory_keys_mv{local} {on_cluster}
TO {database}.group_memory_keys{local} AS
SELECT cluster_id, span_id, task_group, toDate(ts, 'UTC') AS day, _batch,
       uniqExactState(cityHash64(key)) AS keys
FROM {database}.transitions{local}
WHERE source = 'scheduler' AND finish = 'memory'
GROUP BY cluster_id, span_id, task_group, day, _batch;

--backfill: INSERT INTO {database}.group_memory_keys
--backfill: SELECT cluster_id, span_id, task_group, toDate(ts, 'UTC') AS day, _batch,
--backfill:        uniqExactState(cityHash64(key)) AS keys
--backfill: FROM {database}.transitions
--backfill: WHERE source = 'scheduler' AND finish = 'memory'
--backfill:   AND _batch GLOBAL NOT IN (SELECT _batch FROM {database}.group_memory_keys)
--backfill: GROUP BY cluster_id, span_id, task_group, day, _batch;
