-- dask-blackbox ClickHouse schema, migration 001: every table the sink loads.
--
-- Placeholders (sinks/schema.py replaces them; to run this file by hand, replace them
-- yourself -- the values for a single node are shown in brackets):
--   {database}    the database, blackbox.clickhouse.database            [blackbox]
--   {ttl}         blackbox.clickhouse.retention as an interval          [7776000 SECOND]
--   {on_cluster}  empty, or ON CLUSTER '<name>' (blackbox.clickhouse.cluster)      []
--   {replicated}  empty, or Replicated: the engine family in cluster mode          []
--   {local}       empty, or _local: suffix of each storage table in cluster mode   []
--   {cluster}     the ClickHouse cluster name, used only on --cluster: lines
-- Lines starting with "--cluster: " are kept (without that marker) only in cluster
-- mode: they create the Distributed table that reads and writes every shard's
-- <table>_local. Replicated engines take their ZooKeeper path and replica name from
-- the server's default_replica_path / default_replica_name ({uuid}, {shard},
-- {replica} macros), so the same DDL runs on every node.
--
-- Conventions, and why:
-- * Every table the sink writes has `_batch`, the id of the sink batch that inserted
--   the row (see sink_batches below). After a crash, rows of a batch that was never
--   marked loaded are deleted by that id before the Kafka messages are read again:
--   this is what makes loading exactly-once, whatever the Kafka offsets of a new
--   broker incarnation are. Rows of one cluster come from few batches, so the column
--   costs well under a byte per row after compression.
-- * Timestamps are DateTime64(6) (microseconds, UTC): Dask's time() floats rounded to
--   the microsecond. Sorted within a key or a producer, Delta + ZSTD stores them in
--   one or two bytes.
-- * cluster_id leads every ORDER BY: nearly every question is about one cluster, and
--   a cluster is also the sharding key in cluster mode, so one cluster's rows never
--   need another shard.
-- * Names with few distinct values per part (states, prefixes, groups, workers, span
--   ids, loggers) are LowCardinality(String): a dictionary per part and 1-2 byte
--   indexes per row.
-- * PARTITION BY toMonday(...) gives ~13 partitions for the default 90 days: few
--   enough to keep point lookups cheap, fine enough for ttl_only_drop_parts to drop
--   whole expired parts instead of rewriting them.
-- * No CHECK constraints: the sink validates every value before inserting (an event
--   time must lie between 2000-01-01 and a day ahead, or the row would land in a
--   bogus partition and be dropped at once by the TTL, silently), which costs far less
--   than a constraint per insert. Invalid events go to dead_letters with the reason;
--   rows ClickHouse still rejects (a constraint a DBA added, say) are isolated by
--   splitting the insert and go there too, with ClickHouse's message.

CREATE DATABASE IF NOT EXISTS {database} {on_cluster};

-- Which migrations ran. ReplacingMergeTree: two sinks migrating at the same time
-- record a version twice; the duplicate merges away and readers use FINAL.
CREATE TABLE IF NOT EXISTS {database}.schema_migrations{local} {on_cluster}
(
    version    UInt32,
    name       String,
    checksum   String,            -- sha256 of the migration file as shipped
    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = {replicated}ReplacingMergeTree
ORDER BY version;
--cluster: CREATE TABLE IF NOT EXISTS {database}.schema_migrations {on_cluster}
--cluster:   AS {database}.schema_migrations_local
--cluster:   ENGINE = Distributed({cluster}, {database}, schema_migrations_local, version);

-- The sink's own journal, one row per (batch, topic, partition) when a batch begins,
-- and one 'loaded' or 'abandoned' row (topic '') when it ends. A batch is loaded once
-- its 'loaded' row exists (a single-part insert: atomic). On every partition
-- assignment, batches with 'begin' and no end are abandoned: their rows are deleted
-- from every table (`_batch`). If the consumer group's committed offset for a
-- partition still equals the from_offset of the latest loaded batch, and the message
-- at that offset still has the recorded timestamp and CRC (the same broker
-- incarnation), the sink died between loading and committing: it skips to
-- next_offset and commits that instead of loading the messages again.
CREATE TABLE IF NOT EXISTS {database}.sink_batches{local} {on_cluster}
(
    group_id        LowCardinality(String),   -- blackbox.sink.group-id
    batch_id        UInt64,                   -- increases per sink process (time-based)
    state           Enum8('begin' = 1, 'loaded' = 2, 'abandoned' = 3),
    topic           LowCardinality(String),
    partition       UInt32,
    from_offset     Int64,                    -- committed position when the batch began
    next_offset     Int64,                    -- position after the batch (committed after it)
    first_timestamp Int64,                    -- Kafka timestamp (ms) of the message at from_offset
    first_crc       UInt32,                   -- CRC-32 of that message's value
    at              DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = {replicated}MergeTree
ORDER BY (group_id, batch_id, state)
TTL toDateTime(at) + INTERVAL 30 DAY;
--cluster: CREATE TABLE IF NOT EXISTS {database}.sink_batches {on_cluster}
--cluster:   AS {database}.sink_batches_local
--cluster:   ENGINE = Distributed({cluster}, {database}, sink_batches_local, batch_id);

-- One row per Kafka envelope on the raw topic: who sent it, its sequence number and a
-- few counts. Small (an envelope carries up to thousands of events) and the basis
-- of the `clusters` view, the per-producer sequence check and `status`.
CREATE TABLE IF NOT EXISTS {database}.envelopes{local} {on_cluster}
(
    cluster_id    LowCardinality(String),
    cluster_name  LowCardinality(String),
    source        LowCardinality(String),  -- scheduler | worker | client
    producer_id   LowCardinality(String),
    seq           UInt64,                  -- per producer, +1 per envelope
    sent_at       DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    n_events      UInt32,
    n_bytes       UInt32,                  -- encoded size on Kafka
    n_transitions UInt32,
    n_memory      UInt32,                  -- transitions that finished in 'memory'
    n_erred       UInt32,                  -- transitions that finished in 'erred'
    partition     UInt32,                  -- Kafka partition and offset, for reference
    offset        Int64,
    _batch        UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(sent_at)
ORDER BY (cluster_id, producer_id, seq)
TTL toDateTime(sent_at) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.envelopes {on_cluster}
--cluster:   AS {database}.envelopes_local
--cluster:   ENGINE = Distributed({cluster}, {database}, envelopes_local, cityHash64(cluster_id));

-- Scheduler (and, if enabled, worker) task transitions: what Scheduler.story shows.
-- ORDER BY (cluster_id, key, ts) puts a key's story in one place: `story` reads a
-- few granules. The same key sorts next to itself, so ZSTD finds the key, prefix and
-- stimulus text it just saw; seq/idx (envelope seq, position in it) give the exact
-- order of transitions with equal timestamps.
CREATE TABLE IF NOT EXISTS {database}.transitions{local} {on_cluster}
(
    cluster_id  LowCardinality(String),
    key         String CODEC(ZSTD(3)),
    ts          DateTime64(6, 'UTC') CODEC(Delta, ZSTD(3)),
    start       LowCardinality(String),
    finish      LowCardinality(String),
    stimulus_id String CODEC(ZSTD(3)),
    source      LowCardinality(String),
    seq         UInt32 CODEC(Delta, ZSTD(3)),
    idx         UInt16 CODEC(ZSTD(3)),
    prefix      LowCardinality(String),
    task_group  LowCardinality(String),
    span_id     LowCardinality(String),
    worker      LowCardinality(String),
    nbytes      Nullable(Int64) CODEC(ZSTD(3)),
    typename    LowCardinality(String),
    -- Dask's startstops: one element per action (compute, transfer, disk-read, ...)
    startstops  Nested(
        action LowCardinality(String),
        start  DateTime64(6, 'UTC'),
        stop   DateTime64(6, 'UTC'),
        source LowCardinality(String)
    ) CODEC(ZSTD(3)),
    exception   String CODEC(ZSTD(3)),
    traceback   String CODEC(ZSTD(3)),
    cause       String CODEC(ZSTD(3)),
    _batch      UInt64 CODEC(Delta, ZSTD(3))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, key, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.transitions {on_cluster}
--cluster:   AS {database}.transitions_local
--cluster:   ENGINE = Distributed({cluster}, {database}, transitions_local, cityHash64(cluster_id));

-- Graph submissions (SchedulerPlugin.update_graph): one row per submission ...
CREATE TABLE IF NOT EXISTS {database}.graphs{local} {on_cluster}
(
    cluster_id  LowCardinality(String),
    ts          DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    client      LowCardinality(String),
    stimulus_id String,
    n_tasks     UInt32,                   -- the true count (graph_tasks may be capped)
    keys        Array(String) CODEC(ZSTD(3)),  -- keys the client asked for
    annotations String CODEC(ZSTD(3)),     -- JSON
    _batch      UInt64
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.graphs {on_cluster}
--cluster:   AS {database}.graphs_local
--cluster:   ENGINE = Distributed({cluster}, {database}, graphs_local, cityHash64(cluster_id));

-- ... and one row per submitted task (up to blackbox.producer.graph-max-tasks each),
-- keyed like transitions so "which submission brought key K, with what dependencies"
-- is a point lookup.
CREATE TABLE IF NOT EXISTS {database}.graph_tasks{local} {on_cluster}
(
    cluster_id   LowCardinality(String),
    key          String CODEC(ZSTD(3)),
    ts           DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    stimulus_id  String CODEC(ZSTD(3)),
    prefix       LowCardinality(String),
    task_group   LowCardinality(String),
    span_id      LowCardinality(String),
    dependencies Array(String) CODEC(ZSTD(3)),
    _batch       UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, key, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.graph_tasks {on_cluster}
--cluster:   AS {database}.graph_tasks_local
--cluster:   ENGINE = Distributed({cluster}, {database}, graph_tasks_local, cityHash64(cluster_id));

-- Structured events (log_event) on any topic: what client.get_events(topic) returns.
-- msg is the JSON text of the payload (non-JSON values described by the producer).
CREATE TABLE IF NOT EXISTS {database}.events{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    topic      LowCardinality(String),
    ts         DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    source     LowCardinality(String),
    seq        UInt32 CODEC(Delta, ZSTD(1)),
    idx        UInt16,
    msg        String CODEC(ZSTD(3)),
    _batch     UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, topic, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.events {on_cluster}
--cluster:   AS {database}.events_local
--cluster:   ENGINE = Distributed({cluster}, {database}, events_local, cityHash64(cluster_id));

-- Spans as the scheduler created them (name, parent, enqueued): the tree's skeleton,
-- there even when the stream processors are not running.
CREATE TABLE IF NOT EXISTS {database}.spans{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    span_id    String,
    name       Array(String),             -- Dask's tag tuple, e.g. ['etl', 'load']
    parent_id  String,                    -- '' for a root span
    enqueued   DateTime64(6, 'UTC'),
    ts         DateTime64(6, 'UTC'),
    _batch     UInt64
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, span_id)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.spans {on_cluster}
--cluster:   AS {database}.spans_local
--cluster:   ENGINE = Distributed({cluster}, {database}, spans_local, cityHash64(cluster_id));

-- Span snapshots from the stream processors: the values of distributed.spans.Span for
-- the tree rooted at span_id. The latest version wins: ReplacingMergeTree(version)
-- keeps one row per (cluster_id, span_id) after merges; readers use FINAL (the table
-- has one row per span, so FINAL is cheap). Partitioned by enqueued, which never
-- changes for a span, so all versions of a span meet in one partition.
CREATE TABLE IF NOT EXISTS {database}.span_state{local} {on_cluster}
(
    cluster_id    LowCardinality(String),
    cluster_name  LowCardinality(String),
    span_id       String,
    name          Array(String),
    parent_id     String,
    version       UInt64,
    enqueued      DateTime64(6, 'UTC'),
    start         DateTime64(6, 'UTC'),    -- 1970-01-01 while no task has finished
    stop          DateTime64(6, 'UTC'),
    duration      Float64,                 -- seconds of all task actions in the tree
    nbytes_total  Int64,
    states        Map(LowCardinality(String), Int64),     -- tasks per state
    all_durations Map(LowCardinality(String), Float64),   -- seconds per action
    cumulative_worker_metrics Nested(
        context  LowCardinality(String),
        prefix   LowCardinality(String),
        activity LowCardinality(String),
        unit     LowCardinality(String),
        value    Float64
    ),
    done          Bool,
    updated_at    DateTime64(6, 'UTC'),
    _batch        UInt64
)
ENGINE = {replicated}ReplacingMergeTree(version)
PARTITION BY toMonday(enqueued)
ORDER BY (cluster_id, span_id)
TTL toDateTime(enqueued) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.span_state {on_cluster}
--cluster:   AS {database}.span_state_local
--cluster:   ENGINE = Distributed({cluster}, {database}, span_state_local, cityHash64(cluster_id));

-- Per-(cluster, span, prefix, 1-minute window) partials from the stream processors.
-- Partials are additive; a replayed partial carries the same partial_id, so
-- ReplacingMergeTree keyed on it keeps one copy and readers sum over FINAL.
CREATE TABLE IF NOT EXISTS {database}.prefix_stats{local} {on_cluster}
(
    cluster_id   LowCardinality(String),
    cluster_name LowCardinality(String),
    span_id      LowCardinality(String),
    prefix       LowCardinality(String),
    window_start DateTime('UTC'),
    partial_id   String,
    finished     Map(LowCardinality(String), UInt64),  -- transitions by finish state
    durations    Map(LowCardinality(String), Float64), -- startstop seconds by action
    nbytes       Int64,
    n_erred      UInt64,
    max_duration Float64,                              -- longest single compute
    _batch       UInt64
)
ENGINE = {replicated}ReplacingMergeTree
PARTITION BY toMonday(window_start)
ORDER BY (cluster_id, prefix, span_id, window_start, partial_id)
TTL window_start + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.prefix_stats {on_cluster}
--cluster:   AS {database}.prefix_stats_local
--cluster:   ENGINE = Distributed({cluster}, {database}, prefix_stats_local, cityHash64(cluster_id));

-- Periodic scheduler metrics (blackbox.producer.metrics-interval).
CREATE TABLE IF NOT EXISTS {database}.scheduler_metrics{local} {on_cluster}
(
    cluster_id          LowCardinality(String),
    ts                  DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    tasks_by_state      Map(LowCardinality(String), Int64),
    n_workers           Nullable(UInt32),
    n_threads           Nullable(UInt32),
    memory              Nullable(Int64) CODEC(ZSTD(1)),
    memory_managed      Nullable(Int64) CODEC(ZSTD(1)),
    memory_unmanaged    Nullable(Int64) CODEC(ZSTD(1)),
    memory_spilled      Nullable(Int64) CODEC(ZSTD(1)),
    event_loop_interval Nullable(Float64) CODEC(ZSTD(1)),
    _batch              UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.scheduler_metrics {on_cluster}
--cluster:   AS {database}.scheduler_metrics_local
--cluster:   ENGINE = Distributed({cluster}, {database}, scheduler_metrics_local, cityHash64(cluster_id));

-- Periodic worker metrics, one series per worker: ORDER BY (cluster_id, worker, ts)
-- makes "the last samples of worker W" a short backwards read.
CREATE TABLE IF NOT EXISTS {database}.worker_metrics{local} {on_cluster}
(
    cluster_id          LowCardinality(String),
    worker              LowCardinality(String),
    producer_id         LowCardinality(String),
    ts                  DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    memory              Nullable(Int64) CODEC(ZSTD(1)),
    memory_managed      Nullable(Int64) CODEC(ZSTD(1)),
    memory_unmanaged    Nullable(Int64) CODEC(ZSTD(1)),
    memory_spilled      Nullable(Int64) CODEC(ZSTD(1)),
    cpu                 Nullable(Float64) CODEC(ZSTD(1)),
    executing           Nullable(UInt32),
    ready               Nullable(UInt32),
    in_flight           Nullable(UInt32),
    event_loop_interval Nullable(Float64) CODEC(ZSTD(1)),
    gil_contention      Nullable(Float64) CODEC(ZSTD(1)),
    _batch              UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, worker, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.worker_metrics {on_cluster}
--cluster:   AS {database}.worker_metrics_local
--cluster:   ENGINE = Distributed({cluster}, {database}, worker_metrics_local, cityHash64(cluster_id));

-- Increases of Worker.digests_total (fine performance metrics) per sample, one row
-- per (context, span, prefix, activity, unit).
CREATE TABLE IF NOT EXISTS {database}.worker_digests{local} {on_cluster}
(
    cluster_id LowCardinality(String),
    worker     LowCardinality(String),
    ts         DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    context    LowCardinality(String),
    span_id    LowCardinality(String),
    prefix     LowCardinality(String),
    activity   LowCardinality(String),
    unit       LowCardinality(String),
    value      Float64 CODEC(ZSTD(1)),
    _batch     UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, span_id, prefix, activity, unit, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.worker_digests {on_cluster}
--cluster:   AS {database}.worker_digests_local
--cluster:   ENGINE = Distributed({cluster}, {database}, worker_digests_local, cityHash64(cluster_id));

-- Log records of the `distributed` loggers (and users' own) from every process.
-- ORDER BY (cluster_id, producer_id, ts): one process's lines are contiguous, so "the
-- last lines of the worker that died" reads backwards from one place.
CREATE TABLE IF NOT EXISTS {database}.logs{local} {on_cluster}
(
    cluster_id  LowCardinality(String),
    producer_id LowCardinality(String),
    source      LowCardinality(String),
    process     LowCardinality(String),   -- the worker / scheduler address if known
    ts          DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    seq         UInt32 CODEC(Delta, ZSTD(1)),
    idx         UInt16,
    logger      LowCardinality(String),
    level       LowCardinality(String),
    message     String CODEC(ZSTD(3)),
    exc_text    String CODEC(ZSTD(3)),
    _batch      UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, producer_id, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.logs {on_cluster}
--cluster:   AS {database}.logs_local
--cluster:   ENGINE = Distributed({cluster}, {database}, logs_local, cityHash64(cluster_id));

-- Cluster lifecycle: workers and clients added and removed, restarts, start and close.
CREATE TABLE IF NOT EXISTS {database}.lifecycle{local} {on_cluster}
(
    cluster_id  LowCardinality(String),
    ts          DateTime64(6, 'UTC'),
    action      LowCardinality(String),
    worker      LowCardinality(String),
    client      LowCardinality(String),
    reason      String,
    stimulus_id String,
    detail      String,                   -- JSON
    _batch      UInt64
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.lifecycle {on_cluster}
--cluster:   AS {database}.lifecycle_local
--cluster:   ENGINE = Distributed({cluster}, {database}, lifecycle_local, cityHash64(cluster_id));

-- Events a producer dropped because its buffer was full (reported once it could send
-- again).
CREATE TABLE IF NOT EXISTS {database}.drops{local} {on_cluster}
(
    cluster_id     LowCardinality(String),
    producer_id    LowCardinality(String),
    source         LowCardinality(String),
    ts             DateTime64(6, 'UTC'),
    dropped_events UInt64,
    dropped_bytes  UInt64,
    since          DateTime64(6, 'UTC'),
    until          DateTime64(6, 'UTC'),
    _batch         UInt64
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(ts)
ORDER BY (cluster_id, producer_id, ts)
TTL toDateTime(ts) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.drops {on_cluster}
--cluster:   AS {database}.drops_local
--cluster:   ENGINE = Distributed({cluster}, {database}, drops_local, cityHash64(cluster_id));

-- Sequence gaps the stream processors detected: envelopes missing_from..missing_to
-- (inclusive) of a producer never arrived. A replayed gap record has the same key
-- and merges away.
CREATE TABLE IF NOT EXISTS {database}.gaps{local} {on_cluster}
(
    cluster_id   LowCardinality(String),
    producer_id  LowCardinality(String),
    source       LowCardinality(String),
    missing_from UInt64,
    missing_to   UInt64,
    detected_at  DateTime64(6, 'UTC'),
    _batch       UInt64
)
ENGINE = {replicated}ReplacingMergeTree
PARTITION BY toMonday(detected_at)
ORDER BY (cluster_id, producer_id, missing_from, missing_to)
TTL toDateTime(detected_at) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.gaps {on_cluster}
--cluster:   AS {database}.gaps_local
--cluster:   ENGINE = Distributed({cluster}, {database}, gaps_local, cityHash64(cluster_id));

-- Everything that could not be loaded as data, with the reason: invalid raw messages
-- and events (origin 'sink', reason from the contract's validation), rows ClickHouse
-- rejected (origin 'sink', reason = ClickHouse's error), and the processors'
-- dead-letter topic (origin 'processor'). topic/partition/offset point at the Kafka
-- message the record came from; payload is its text, cut to 64 KiB.
CREATE TABLE IF NOT EXISTS {database}.dead_letters{local} {on_cluster}
(
    origin      LowCardinality(String),
    topic       LowCardinality(String),
    partition   UInt32,
    offset      Int64,
    key         String,
    reason      String,
    payload     String CODEC(ZSTD(3)),
    detected_at DateTime64(6, 'UTC'),
    _batch      UInt64
)
ENGINE = {replicated}MergeTree
PARTITION BY toMonday(detected_at)
ORDER BY (topic, partition, offset)
TTL toDateTime(detected_at) + INTERVAL {ttl}
SETTINGS ttl_only_drop_parts = 1;
--cluster: CREATE TABLE IF NOT EXISTS {database}.dead_letters {on_cluster}
--cluster:   AS {database}.dead_letters_local
--cluster:   ENGINE = Distributed({cluster}, {database}, dead_letters_local, rand());

-- Every cluster ever seen, from its envelopes: name (the latest one), first and last
-- envelope, producers, tasks computed and erred. A view, so it is never stale.
CREATE VIEW IF NOT EXISTS {database}.clusters {on_cluster} AS
SELECT
    cluster_id,
    argMax(cluster_name, sent_at) AS cluster_name,
    min(sent_at)                  AS first_seen,
    max(sent_at)                  AS last_seen,
    uniqExact(producer_id)        AS producers,
    count()                       AS envelopes,
    sum(n_events)                 AS events,
    sum(n_memory)                 AS tasks_computed,
    sum(n_erred)                  AS tasks_erred
FROM {database}.envelopes
GROUP BY cluster_id;
