"""How long ``dask-blackbox trace`` takes on a big run, and how big the file is.

Synthesises a run of ``--tasks`` tasks (default 1,000,000) straight into a fresh chDB
directory with ``INSERT ... SELECT FROM numbers()``: 50 workers of 4 threads each
computing back to back (every tenth task first fetches a dependency: a transfer
before its compute, so 1.1 actions a task), 1% of the tasks erred, nested spans with
their snapshots, a worker death. Then writes the trace file with
:func:`dask_blackbox.read.tracefile.trace_events` and :func:`~.tracefile.write`
(``-o run.json.gz`` as the CLI does), ``--repeat`` times, and prints the median wall
time (reading ClickHouse, building the events, writing), this process's CPU time
(chDB runs in it), and the file's size, gzip level 1 (what the command writes)
against level 6 in the same run so the noise cancels.

    python bench/trace_file.py                  # 1M tasks: the target is <= 10 s, <= 50 MB
    python bench/trace_file.py --tasks 100000
    python bench/trace_file.py --quick          # 100,000 tasks (targets scaled to a tenth)
"""

from __future__ import annotations

import argparse
import gzip
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import clickhouse_connect
import orjson

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from report import report  # noqa: E402

from dask_blackbox.clickhouse import Target
from dask_blackbox.read.backends import DirectBackend
from dask_blackbox.read import tracefile
from dask_blackbox.sinks.schema import migrate

CLUSTER = "Scheduler-bench"
T0 = 1_790_000_000.0


def synthesise(client, tasks: int) -> None:
    db = "blackbox"
    client.command(
        f"INSERT INTO {db}.envelopes (cluster_id, cluster_name, source, producer_id, seq, sent_at, "
        "n_events, n_bytes, n_transitions, n_memory, n_erred, partition, offset, _batch) "
        f"VALUES ('{CLUSTER}', 'bench', 'scheduler', 'p', 0, {T0}, {tasks}, 0, {tasks}, {tasks}, 0, 0, 0, 1)")
    # task i runs on worker i % 50, thread (i / 50) % 4, in round i / 200 (50 ms each)
    client.command(
        f"INSERT INTO {db}.transitions (cluster_id, key, ts, start, finish, stimulus_id, source, "
        "seq, idx, prefix, task_group, span_id, worker, startstops.action, startstops.start, "
        "startstops.stop, startstops.source, exception, _batch) "
        f"SELECT '{CLUSTER}', concat('(''', p, '-0123456789abcdef'', ', toString(number), ')'), "
        f"toDateTime64({T0} + intDiv(number, 200) * 0.05 + 0.045, 6, 'UTC'), 'processing', "
        "if(number % 100 = 99, 'erred', 'memory'), concat('task-finished-', toString(number)), "
        "'scheduler', intDiv(number, 1000), number % 1000, p, concat(p, '-0123456789abcdef'), "
        "concat('span-', toString(number % 4)), "
        "concat('tcp://10.0.0.', toString(number % 50), ':40000'), "
        "if(number % 10 = 0, ['transfer', 'compute'], ['compute']), "
        f"arrayMap(x -> toDateTime64({T0} + intDiv(number, 200) * 0.05 + x, 6, 'UTC'), "
        "  if(number % 10 = 0, [0.0, 0.005], [0.0])), "
        f"arrayMap(x -> toDateTime64({T0} + intDiv(number, 200) * 0.05 + x, 6, 'UTC'), "
        "  if(number % 10 = 0, [0.005, 0.045], [0.045])), "
        "if(number % 10 = 0, ['tcp://10.0.0.99:40000', ''], ['']), "
        "if(number % 100 = 99, 'ValueError(''bad row'')', ''), 1 "
        f"FROM (SELECT number, ['read-parquet', 'getitem', 'sum-chunk', 'merge'][number % 4 + 1] AS p "
        f"FROM numbers({tasks}))")
    rounds = tasks / 200 * 0.05
    client.command(
        f"INSERT INTO {db}.span_state (cluster_id, cluster_name, span_id, name, parent_id, version, "
        "enqueued, start, stop, duration, nbytes_total, states, all_durations, done, updated_at, _batch) "
        f"SELECT '{CLUSTER}', 'bench', concat('span-', toString(number)), "
        "if(number = 0, ['etl'], ['etl', concat('part-', toString(number))]), "
        "if(number = 0, '', 'span-0'), 1, "
        f"toDateTime64({T0}, 6, 'UTC'), toDateTime64({T0} + number, 6, 'UTC'), "
        f"toDateTime64({T0} + {rounds} - number, 6, 'UTC'), 1.0, 0, map('memory', 1), "
        f"map('compute', 1.0), true, toDateTime64({T0}, 6, 'UTC'), 1 FROM numbers(4)")
    client.command(
        f"INSERT INTO {db}.lifecycle (cluster_id, ts, action, worker, client, reason, stimulus_id, "
        f"detail, _batch) VALUES ('{CLUSTER}', toDateTime64({T0} + 5, 6, 'UTC'), 'worker_removed', "
        "'tcp://10.0.0.7:40000', '', 'worker-died', 'worker-died-1', "
        "'{\"expected\": false, \"processing_tasks\": 4}', 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="100,000 tasks, 2 runs")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.repeat = 100_000, 2
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="trace-bench-"))
    try:
        client = clickhouse_connect.get_client(dsn=f"chdb://{tmp / 'ch'}")
        migrate(client, Target("blackbox", 90 * 86400))
        began = time.monotonic()
        synthesise(client, args.tasks)
        print(f"synthesised {args.tasks:,} tasks in {time.monotonic() - began:.1f}s "
              f"(load average {os.getloadavg()[0]:.2f})")
        backend = DirectBackend(client, "blackbox")
        walls, cpus, sizes, events = [], [], [], 0
        out = tmp / "run.json.gz"
        for _ in range(args.repeat):
            w, c = time.monotonic(), time.process_time()
            trace = tracefile.trace_events(backend, CLUSTER)
            sizes.append(tracefile.write(trace, out))
            walls.append(time.monotonic() - w)
            cpus.append(time.process_time() - c)
            events = len(trace.events) + len(trace.slices)
            del trace
        with gzip.open(out, "rb") as f:
            raw = f.read()
        slices = sum(1 for e in orjson.loads(raw)["traceEvents"] if e["ph"] == "X")
        w = time.monotonic()
        level6 = len(gzip.compress(raw, compresslevel=6, mtime=0))
        gzip6 = time.monotonic() - w
        print(f"trace file of {args.tasks:,} tasks: {events:,} events ({slices:,} slices), "
              f"{len(raw) / 2**20:.1f} MiB of JSON")
        print(f"  wall {statistics.median(walls):.2f}s, CPU {statistics.median(cpus):.2f}s "
              f"(median of {args.repeat}; all: {', '.join(f'{x:.2f}' for x in walls)})")
        print(f"  gzip level 1 (written): {sizes[-1] / 1e6:.1f} MB; level 6: {level6 / 1e6:.1f} MB "
              f"(+{gzip6:.1f}s to compress)")
        scale = 1_000_000 / args.tasks  # the targets are a 1M-task run's
        met = statistics.median(walls) <= 10 / scale and sizes[-1] <= 50e6 / scale
        print(f"  targets (a 1M-task run: <= 10 s, <= 50 MB; scaled to {args.tasks:,} tasks): "
              f"{'met' if met else 'NOT met'}")
        report(f"trace file of {args.tasks:,} tasks: wall", statistics.median(walls), "s",
               10.0 / scale)
        report(f"trace file of {args.tasks:,} tasks: gzipped size", sizes[-1] / 1e6, "MB",
               50.0 / scale)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
