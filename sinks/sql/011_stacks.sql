-- dask-blackbox ClickHouse schema, migration 011: worker processes' stacks, read from
-- outside by their nannies.
--
-- Placeholders as in 001_init.sql (single-node values in brackets):
--   {database} [blackbox]   {ttl} [7776000 SECOND]   {on_cluster} []   {replicated} []
--   {local} []   {cluster}
-- Lines starting with "--cluster: " are kept only in cluster mode.
--
-- stacks: one row per thread of one reading (contract Stacks) of worker process `pid`
-- by its nanny (py-spy), taken because the process neared the memory its nanny kills
-- it at (`reason` 'memory', its RSS `memory` against `memory_limit`) or its event
-- loop had not answered for `silent` seconds ('unresponsive'). `stack`: the thread's
-- Python frames file:line:function (the line executing) from the outermost, joined
-- by ';' (as the profiles'); `active`: running rather than waiting; `gil`: it held
-- the GIL. A reading that read nothing is one row with no thread and its `error`.
-- ORDER BY (cluster_id, worker, ts): a dead worker's last readings are one range.

CREATE TABLE IF NOT EXISTS {database}.stacks{local} {on_cluster}
(
    cluster_id   LowCardinality(String),
    worker       LowCardinality(String),
    pid          UInt32,
    ts           DateTime64(6, 'UTC'),
    reason       LowCardinality(String),
    memory       Nullable(Int64),
    memory_limit Nullable(Int64),
    silent       Nullable(Float64),
    error        String CODEC(ZSTD(3)),
    thread       String,
    thread_id    UInt64,
    active       UInt8,
    gil          UInt8,
    stack        String CODEC(ZSTD(3)),
    producer_id  LowCardinality(String),
    _batch       UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, worker, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.stacks {on_cluster}
--cluster:   AS {database}.stacks_local
--cluster:   ENGINE = Distributed({cluster}, {database}, stacks_local, cityHash64(cluster_id));
