"""History that outlives its detail: a day of 100 clusters, what it costs on disk, and
whether the roll-ups answer as the raw rows do.

Generates a day of recorded history: ``--clusters`` clusters (default 100), each
running one job at a random time of the day, ``--transitions`` task transitions in
all (default 10 million; query_latency.py's realistic clusters: task stories, graphs
in spans, scheduler and worker metrics every second, logs, span snapshots, prefix
partials), encoded as the producers send them (sink_ingest.py), and loads it,
accelerated, through the sink's own Batch and Loader into a fresh chDB directory:
ClickHouse's materialized views fill the roll-ups as the raw rows are inserted
(sinks/sql/008_rollups.sql). Then:

- disk per day: the raw tables (kept for ``blackbox.clickhouse.retention``), the
  tables kept as long as the roll-ups (spans, prefix partials, lifecycle, ...), and
  the roll-ups as loaded (a row per batch) and as they are once folded (seven days
  on: measured by folding a copy);
- for every cluster, the answers of read/history.py from the raw rows and from the
  roll-ups (tasks finished per prefix and minute, task states over time, memory per
  worker, totals per prefix and per worker, the run's bounds): how many clusters'
  answers differ (must be 0), and the time to answer from each;
- the raw rows then expire (truncated, as the retention TTL would drop them): every
  cluster is still listed with the same numbers, its detail says ``rollups``, and
  the roll-ups' answers are the ones the raw rows gave.

    python bench/history.py             # 100 clusters, 10M transitions (~10 min)
    python bench/history.py --quick     # 10 clusters, 500k transitions
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import report  # noqa: E402
from sink_ingest import MessageFile, encode_cluster, read_messages  # noqa: E402

#: Tables the retention drops, and tables kept as long as the roll-ups.
RAW = ("transitions", "graphs", "graph_tasks", "events", "scheduler_metrics", "worker_metrics",
       "worker_digests", "logs", "envelopes", "dead_letters")
LONG_LIVED = ("span_state", "spans", "prefix_stats", "lifecycle", "worker_exits", "gaps", "drops")
ROLLUP_KEYS = {"task_minutes": "cluster_id, minute, span_id, prefix, worker",
               "worker_minutes": "cluster_id, minute, worker", "cluster_minutes": "cluster_id, minute"}


def generate(args, path: pathlib.Path, day0: float) -> dict:
    """A day of ``args.clusters`` clusters, each running one job that starts at a
    random time of the day, into ``path``."""
    from query_latency import ClusterRun

    rng = random.Random(args.seed)
    out = MessageFile(path)
    per_cluster = args.transitions // args.clusters
    for index in range(args.clusters):
        start = day0 + rng.uniform(0, 86400 - 3600)
        run = ClusterRun(index, per_cluster, start, random.Random(args.seed * 100_000 + index))
        run.generate()
        out.counts["events"] += encode_cluster(run, out.put)
    return out.close()


def load(client, loader, path: pathlib.Path) -> int:
    from dask_blackbox.sinks.batch import Batch

    rows = 0
    batch, starts = Batch(loader.schemas), {}
    for message in read_messages(path):
        starts.setdefault((message.kafka_topic, message.partition), message.offset)
        batch.add(message)
        if batch.n_rows >= 100_000:
            loader.prepare(batch)
            loader.load(batch, starts)
            rows += batch.n_rows
            batch, starts = Batch(loader.schemas), {}
    loader.prepare(batch)
    loader.load(batch, starts)
    return rows + batch.n_rows


def settle(client) -> None:
    """Wait for ClickHouse's merges to finish, so that parts are measured merged."""
    while client.query("SELECT count() FROM system.merges").result_rows[0][0]:
        time.sleep(0.5)


def disk(client, database: str, tables) -> tuple[int, int]:
    """(bytes on disk, rows) of ``tables``."""
    n, rows = client.query(
        "SELECT sum(bytes_on_disk), sum(rows) FROM system.parts WHERE active "
        "AND database = {db:String} AND table IN {t:Array(String)}",
        parameters={"db": database, "t": list(tables)}).result_rows[0]
    return int(n or 0), int(rows or 0)


def folded(client) -> tuple[int, int]:
    """(bytes, rows) of the roll-ups once folded: each copied into a table of the
    same definition, a row per key and minute, merged."""
    total = rows = 0
    for table, key in ROLLUP_KEYS.items():
        ddl = client.query(f"SHOW CREATE TABLE blackbox_rollups.{table}").result_rows[0][0]
        client.command(ddl.replace(f"blackbox_rollups.{table}", f"blackbox_rollups.{table}_folded", 1))
        columns = [name for name, in client.query(
            "SELECT name FROM system.columns WHERE database = 'blackbox_rollups' "
            "AND table = {t:String} ORDER BY position", parameters={"t": table}).result_rows]
        merged = {"_batch": "min(_batch)", "cluster_name": "argMaxMergeState(cluster_name)",
                  "producers": "uniqExactMergeState(producers)"}
        functions = dict(client.query(
            "SELECT name, extract(type, '^SimpleAggregateFunction\\\\((\\\\w+),') FROM system.columns "
            "WHERE database = 'blackbox_rollups' AND table = {t:String}",
            parameters={"t": table}).result_rows)
        select = ", ".join(c if c in key.split(", ") else merged.get(c, f"{functions[c]}({c})")
                           for c in columns)
        client.command(f"INSERT INTO blackbox_rollups.{table}_folded SELECT {select} "
                       f"FROM blackbox_rollups.{table} GROUP BY {key}")
        client.command(f"OPTIMIZE TABLE blackbox_rollups.{table}_folded FINAL")
        n, r = disk(client, "blackbox_rollups", [f"{table}_folded"])
        client.command(f"DROP TABLE blackbox_rollups.{table}_folded")
        total, rows = total + n, rows + r
    return total, rows


def answers(backend, cluster_id: str, source: str) -> dict:
    from dask_blackbox.read import history

    bounds = history.bounds(backend, cluster_id, source)
    if bounds is None:
        return {}
    w = history.Window.around(cluster_id, *bounds, buckets=300)
    return {
        "bounds": bounds, "finished": history.finished(backend, w, source),
        "state_moves": history.state_moves(backend, w, source),
        "worker_memory": history.worker_memory(backend, w, source),
        "prefix_totals": history.prefix_totals(backend, w, source),
        "worker_totals": history.worker_totals(backend, w, source),
    }


def same(a, b) -> bool:
    """Equal, floats to 1e-9 relative (sums taken in another order)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--transitions", type=int, default=10_000_000)
    parser.add_argument("--quick", action="store_true", help="10 clusters, 500k transitions")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.clusters, args.transitions = 10, 500_000

    from dask_blackbox import clickhouse
    from dask_blackbox.read import history, queries
    from dask_blackbox.read.backends import DirectBackend
    from dask_blackbox.sinks.loader import Loader
    from dask_blackbox.sinks.schema import Target, migrate
    from dask_blackbox.sinks.service import tune_gc

    work = pathlib.Path(tempfile.mkdtemp(prefix="bb-history-"))
    try:
        day0 = time.time() - 86400 - 3600
        t = time.perf_counter()
        counts = generate(args, work / "messages.bin", day0)
        print(f"a day of {args.clusters} clusters: {counts['events']:,} events in "
              f"{counts['messages']:,} messages ({counts['bytes'] / 1e6:,.0f} MB), generated in "
              f"{time.perf_counter() - t:.0f}s", flush=True)
        target = Target("blackbox", 90 * 86400)
        client = clickhouse.open_client(f"chdb://{work / 'chdb'}")
        migrate(client, target)
        loader = Loader(client, target, "history")
        tune_gc()
        t = time.perf_counter()
        rows = load(client, loader, work / "messages.bin")
        print(f"loaded {rows:,} rows in {time.perf_counter() - t:.0f}s (the day replayed "
              f"{86400 / (time.perf_counter() - t):,.0f} times faster than it happened)",
              flush=True)
        settle(client)
        raw_bytes, raw_rows = disk(client, "blackbox", RAW)
        long_bytes, long_rows = disk(client, "blackbox", LONG_LIVED)
        roll_bytes, roll_rows = disk(client, "blackbox_rollups", ROLLUP_KEYS)
        fold_bytes, fold_rows = folded(client)
        mb = 1e6
        print(f"per day: raw {raw_bytes / mb:,.1f} MB ({raw_rows:,} rows); kept as long as the "
              f"roll-ups {long_bytes / mb:,.1f} MB ({long_rows:,} rows); roll-ups "
              f"{roll_bytes / mb:,.2f} MB ({roll_rows:,} rows, a row per batch), folded "
              f"{fold_bytes / mb:,.2f} MB ({fold_rows:,} rows)", flush=True)
        report("disk per day, raw rows (kept for clickhouse.retention)", round(raw_bytes / mb, 1),
               "MB", None)
        report("disk per day, roll-ups folded + tables kept as long (rollup-retention)",
               round((fold_bytes + long_bytes) / mb, 2), "MB", None)
        report("disk per day, what outlives the raw rows / the raw rows",
               round((fold_bytes + long_bytes) / raw_bytes, 4), "x", 0.1, 0.05)

        backend = DirectBackend(clickhouse.open_client(f"chdb://{work / 'chdb'}", owned=True,
                                                       database="blackbox"), "blackbox")
        ids = sorted(r[1] for r in queries.clusters(backend)[1])
        assert len(ids) == args.clusters, (len(ids), args.clusters)
        raw_answers, differ, raw_ms, roll_ms = {}, [], [], []
        for cluster_id in ids:
            t = time.perf_counter()
            raw_answers[cluster_id] = answers(backend, cluster_id, "raw")
            raw_ms.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            rolled = answers(backend, cluster_id, "rollups")
            roll_ms.append((time.perf_counter() - t) * 1000)
            if not raw_answers[cluster_id] or not same(rolled, raw_answers[cluster_id]):
                differ.append(cluster_id)
        print(f"{len(ids) - len(differ)} of {len(ids)} clusters: the roll-ups' answers equal the "
              f"raw rows' (median {statistics.median(raw_ms):.0f} ms from raw rows, "
              f"{statistics.median(roll_ms):.0f} ms from roll-ups per cluster)", flush=True)
        report("clusters whose roll-up answers differ from the raw answers", len(differ),
               "clusters", 0)
        report("a cluster's answers from its roll-ups (median)", round(statistics.median(roll_ms)),
               "ms", None)

        listed = sorted(queries.clusters(backend)[1])
        for table in RAW:  # the retention TTL drops these
            client.command(f"TRUNCATE TABLE blackbox.{table}")
        after, kept = [], 0
        for cluster_id in ids:
            found = history.detail(backend, cluster_id)
            after.append(found.source)
            kept += same(answers(backend, cluster_id, "rollups"), raw_answers[cluster_id])
        still = sorted(queries.clusters(backend)[1]) == listed
        print(f"raw rows expired: {after.count('rollups')} of {len(ids)} clusters now answer from "
              f"roll-ups, {kept} with the answers the raw rows gave; the cluster list "
              f"{'is unchanged' if still else 'CHANGED'}", flush=True)
        report("clusters answering as before after the raw rows expired", kept, "clusters",
               len(ids), better="higher")
        backend.close()
        client.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
