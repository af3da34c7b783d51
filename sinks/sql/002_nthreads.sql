-- dask-blackbox ClickHouse schema, migration 002: the cluster's thread count over time.
--
-- Placeholders as in 001_init.sql (single-node values in brackets):
--   {database} [blackbox]   {on_cluster} []   {local} []
-- Lines starting with "--cluster: " are kept only in cluster mode: there the column
-- goes on every shard's <table>_local and on the Distributed <table> in front of it.
--
-- * lifecycle.total_nthreads: the entries [time, nthreads] of Dask's
--   Scheduler.total_nthreads_history that a lifecycle event carries (contract.Lifecycle);
--   empty for events that carry none, and for rows loaded before this migration.
-- * span_state.nthreads_intervals: Span.nthreads_intervals, [begin, end, nthreads]
--   while the span tree ran; span_state.active_cpu_seconds: Span.active_cpu_seconds,
--   the thread-seconds the cluster offered meanwhile (contract.SpanState). Empty / 0
--   for records published before the processors computed them.

ALTER TABLE {database}.lifecycle{local} {on_cluster}
    ADD COLUMN IF NOT EXISTS total_nthreads Nested(
        time     DateTime64(6, 'UTC'),
        nthreads UInt32
    ) AFTER detail;
--cluster: ALTER TABLE {database}.lifecycle {on_cluster}
--cluster:     ADD COLUMN IF NOT EXISTS total_nthreads Nested(
--cluster:         time     DateTime64(6, 'UTC'),
--cluster:         nthreads UInt32
--cluster:     ) AFTER detail;

ALTER TABLE {database}.span_state{local} {on_cluster}
    ADD COLUMN IF NOT EXISTS nthreads_intervals Nested(
        `begin`  DateTime64(6, 'UTC'),
        `end`    DateTime64(6, 'UTC'),
        nthreads UInt32
    ) AFTER updated_at,
    ADD COLUMN IF NOT EXISTS active_cpu_seconds Float64 AFTER nthreads_intervals.nthreads;
--cluster: ALTER TABLE {database}.span_state {on_cluster}
--cluster:     ADD COLUMN IF NOT EXISTS nthreads_intervals Nested(
--cluster:         `begin`  DateTime64(6, 'UTC'),
--cluster:         `end`    DateTime64(6, 'UTC'),
--cluster:         nthreads UInt32
--cluster:     ) AFTER updated_at,
--cluster:     ADD COLUMN IF NOT EXISTS active_cpu_seconds Float64 AFTER nthreads_intervals.nthreads;
