-- dask-blackbox ClickHouse schema, migration 010: the workers' own profiles.
--
-- Placeholders as in 001_init.sql (single-node values in brackets):
--   {database} [blackbox]   {ttl} [7776000 SECOND]   {on_cluster} []   {replicated} []
--   {local} []   {cluster}
-- Lines starting with "--cluster: " are kept only in cluster mode.
--
-- profiles: one row per folded stack of one profile cycle (contract Profile) of one
-- worker and one task prefix ('' for the worker's whole profile, every prefix
-- together: Dask's Worker.profile_history): `count` samples had the stack `stack`,
-- its frames file:line:function from the outermost, joined by ';'. A prefix's
-- profile over any time range is the sum of count by stack (Dask's profile.merge).
-- ORDER BY (cluster_id, prefix, worker, ts): a prefix's profile, or a worker's,
-- reads one range; stacks repeat cycle after cycle, which ZSTD stores in little.

CREATE TABLE IF NOT EXISTS {database}.profiles{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    worker     LowCardinality(String),
    prefix     LowCardinality(String),
    ts         DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    stack      String CODEC(ZSTD(3)),
    count      UInt32 CODEC(ZSTD(1)),
    _batch     UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, prefix, worker, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.profiles {on_cluster}
--cluster:   AS {database}.profiles_local
--cluster:   ENGINE = Distributed({cluster}, {database}, profiles_local, cityHash64(cluster_id));
