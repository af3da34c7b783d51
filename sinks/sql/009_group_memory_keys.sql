-- dask-blackbox ClickHouse schema, migration 009: the tasks of each group that reached
-- memory, counted exactly by the page aggregates.
--
-- Placeholders as in 001_init.sql (single-node values in brackets):
--   {database} [blackbox]   {on_cluster} []   {local} []
-- Lines starting with "--cluster: " are kept only in cluster mode; lines starting with
-- "--backfill: " are run once after the DDL (sinks/schema.py).
--
-- group_totals (006) counts a group's transitions into memory: a task whose result was
-- computed again (its worker lost it) counts twice there, so on a big run the Task
-- groups view could not tell one task recomputed from every task computed when
-- another task of the group never finished. memory_keys holds the distinct keys that
-- reached memory: uniqExactMerge(memory_keys) is the group's tasks computed, and
-- sum(memory) minus it the recomputations (read/aggregates.py groups). It is a column
-- of group_totals, filled by the same materialized view, rather than a table of its
-- own: each view costs every sink batch an insert.
--
-- The backfill adds, per group and batch already aggregated, a row holding only that
-- batch's memory_keys (sums 0, no compute times, the same prefix): merged, it changes
-- nothing else; run again, it adds keys already counted, which a distinct count
-- ignores. (006's backfill names no columns: it runs before this migration only.)

ALTER TABLE {database}.group_totals{local} {on_cluster}
    ADD COLUMN IF NOT EXISTS memory_keys AggregateFunction(uniqExact, UInt64);
--cluster: ALTER TABLE {database}.group_totals {on_cluster}
--cluster:     ADD COLUMN IF NOT EXISTS memory_keys AggregateFunction(uniqExact, UInt64);

ALTER TABLE {database}.group_totals_mv{local} {on_cluster} MODIFY QUERY
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
                   has(startstops.action, 'compute')) AS last_stop,
       uniqExactStateIf(cityHash64(key), finish = 'memory') AS memory_keys
FROM {database}.transitions{local}
WHERE source = 'scheduler'
GROUP BY cluster_id, span_id, task_group, day, _batch;

--backfill: INSERT INTO {database}.group_totals (cluster_id, span_id, task_group, day, _batch, prefix, memory_keys)
--backfill: SELECT cluster_id, span_id, task_group, toDate(ts, 'UTC') AS day, _batch,
--backfill:        anyLast(toString(prefix)) AS prefix, uniqExactState(cityHash64(key)) AS memory_keys
--backfill: FROM {database}.transitions
--backfill: WHERE source = 'scheduler' AND finish = 'memory'
--backfill: GROUP BY cluster_id, span_id, task_group, day, _batch;
