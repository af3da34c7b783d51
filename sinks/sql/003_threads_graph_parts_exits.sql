-- dask-blackbox ClickHouse schema, migration 003: worker threads, graphs in parts,
-- logs that name their worker and task, and how worker processes ended.
--
-- Placeholders as in 001_init.sql (single-node values in brackets):
--   {database} [blackbox]   {ttl} [7776000 SECOND]   {on_cluster} []   {replicated} []
--   {local} []   {cluster}
-- Lines starting with "--cluster: " are kept only in cluster mode.
--
-- * transitions.thread: the ident of the worker thread that ran the task (contract
--   Transition.thread; processing->memory and ->erred), what Dask's task stream draws
--   a row for. NULL where Dask passed none, and for rows loaded before this migration.
--   New columns that Dask passes with a transition are appended after it.
-- * graphs.n_recorded / n_keys: how many of the submission's tasks its graph_tasks
--   rows list (n_tasks is the true count; fewer past blackbox.producer.graph-max-tasks)
--   and the true count of the keys the client asked for (keys is capped).
-- * graph_tasks.n_dependencies: how many dependencies the task has (its
--   dependencies array lists at most 3,000 of them); 0 for rows loaded before.
-- * logs.worker / logs.key: the worker a record concerns (a worker's or its nanny's;
--   '' on the scheduler), and the task a worker thread was running when it logged.
-- * worker_exits: one row per worker process a nanny saw end (contract WorkerExit).

ALTER TABLE {database}.transitions{local} {on_cluster}
    ADD COLUMN IF NOT EXISTS thread Nullable(UInt64) CODEC(ZSTD(3));
--cluster: ALTER TABLE {database}.transitions {on_cluster}
--cluster:     ADD COLUMN IF NOT EXISTS thread Nullable(UInt64) CODEC(ZSTD(3));

ALTER TABLE {database}.graphs{local} {on_cluster}
    ADD COLUMN IF NOT EXISTS n_recorded UInt32 AFTER n_tasks,
    ADD COLUMN IF NOT EXISTS n_keys UInt32 AFTER n_recorded;
--cluster: ALTER TABLE {database}.graphs {on_cluster}
--cluster:     ADD COLUMN IF NOT EXISTS n_recorded UInt32 AFTER n_tasks,
--cluster:     ADD COLUMN IF NOT EXISTS n_keys UInt32 AFTER n_recorded;

ALTER TABLE {database}.graph_tasks{local} {on_cluster}
    ADD COLUMN IF NOT EXISTS n_dependencies UInt32 AFTER dependencies;
--cluster: ALTER TABLE {database}.graph_tasks {on_cluster}
--cluster:     ADD COLUMN IF NOT EXISTS n_dependencies UInt32 AFTER dependencies;

ALTER TABLE {database}.logs{local} {on_cluster}
    ADD COLUMN IF NOT EXISTS worker LowCardinality(String) AFTER exc_text,
    ADD COLUMN IF NOT EXISTS key String CODEC(ZSTD(3)) AFTER worker;
--cluster: ALTER TABLE {database}.logs {on_cluster}
--cluster:     ADD COLUMN IF NOT EXISTS worker LowCardinality(String) AFTER exc_text,
--cluster:     ADD COLUMN IF NOT EXISTS key String CODEC(ZSTD(3)) AFTER worker;

CREATE TABLE IF NOT EXISTS {database}.worker_exits{local} {on_cluster}
(
    cluster_id            LowCardinality(String),
    worker                LowCardinality(String),
    pid                   Nullable(UInt32),
    ts                    DateTime64(6, 'UTC'),
    exitcode              Nullable(Int32),          -- < 0: killed by signal -exitcode
    signal                LowCardinality(String),
    memory                Nullable(Int64),
    memory_peak           Nullable(Int64),
    memory_limit          Nullable(Int64),
    memory_terminate      Nullable(Float64),
    host_memory           Nullable(Int64),
    host_memory_available Nullable(Int64),
    nanny_status          LowCardinality(String),
    starts                Nullable(UInt32),
    started               Nullable(DateTime64(6, 'UTC')),
    producer_id           LowCardinality(String),
    _batch                UInt64
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, worker, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.worker_exits {on_cluster}
--cluster:   AS {database}.worker_exits_local
--cluster:   ENGINE = Distributed({cluster}, {database}, worker_exits_local, cityHash64(cluster_id));
