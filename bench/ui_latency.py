"""How fast the UI opens a big run, and how big its report is.

Generates one cluster of ``--tasks`` tasks (default: a 100k-task run and a 1M-task
run) with the generator of ``bench/query_latency.py`` (task stories with
compute/transfer startstops, worker and scheduler metrics, spans, span snapshots,
prefix partials, log lines), loads it through the sink's own loading path
(``sinks.batch.Batch`` + ``sinks.loader.Loader``) into a fresh chDB directory, then
measures, each the median of ``--repeat`` runs:

- Run page data: every panel of the Run page (:func:`views.run_data`, the
  ClickHouse side, reduced to what a screen shows);
- Run page served: the same plus the Bokeh page rendered by the web UI's handler
  (what a browser waits for before it draws; "cluster opening");
- report: :func:`report.write_report` to a file, and the file's size.

Each time is given as wall clock and as this process's CPU time (chDB runs in it): on
a shared machine the second is the steadier figure; the load average is printed.

    python bench/ui_latency.py                 # 100k and 1M tasks (~10 min on 2 cores)
    python bench/ui_latency.py --tasks 100000  # one size
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from query_latency import ClusterRun  # noqa: E402  (the generator, reused)
from report import report  # noqa: E402

from dask_blackbox import clickhouse, contract  # noqa: E402
from dask_blackbox.read import backends, views  # noqa: E402
from dask_blackbox.read import report as html_report  # noqa: E402
from dask_blackbox.sinks.loader import Loader  # noqa: E402
from dask_blackbox.sinks.batch import Batch  # noqa: E402
from dask_blackbox.sinks.schema import Target, migrate  # noqa: E402

TRANSITIONS_PER_TASK = 5.3  # the generator's stories: released..forgotten, 30% queued


def load_cluster(client, target, tasks: int, index: int, seed: int) -> tuple[str, int]:
    """Generate one cluster of about ``tasks`` tasks and load it; (cluster id, transitions)."""
    rng = random.Random(seed * 1000 + index)
    run = ClusterRun(index, int(tasks * TRANSITIONS_PER_TASK), time.time() - 86400 - index * 7200, rng)
    gc.disable()
    t = time.perf_counter()
    run.generate()
    offsets: dict = {}
    messages = run.messages(offsets)
    n_transitions = sum(1 for e in run.scheduler_events if e["kind"] == contract.TRANSITION)
    cluster_id = run.cluster_id
    del run
    gc.enable()
    print(f"  generated {n_transitions:,} transitions in {time.perf_counter() - t:.0f}s", flush=True)
    t = time.perf_counter()
    loader = Loader(client, target, f"bench-ui-{index}")
    batch, starts = Batch(), {}
    for message in messages:
        starts.setdefault((message.kafka_topic, message.partition), message.offset)
        batch.add(message)
        if batch.n_rows >= 200_000:
            loader.prepare(batch)
            loader.load(batch, starts)
            batch, starts = Batch(), {}
    if batch.n_messages:
        loader.prepare(batch)
        loader.load(batch, starts)
    print(f"  loaded through the sink path in {time.perf_counter() - t:.0f}s", flush=True)
    return cluster_id, n_transitions


def median_s(fn, repeat: int) -> tuple[float, float, object]:
    """Median wall-clock seconds, median CPU seconds of this process (chDB runs in it,
    so its query threads count; less sensitive than wall clock to other processes
    sharing the cores), and the last result."""
    times, cpu, result = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        result = fn()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(times), statistics.median(cpu), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, action="append",
                        help="tasks in a generated cluster (repeatable; default 100000 and 1000000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per median")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--keep", help="keep the chDB directory here")
    parser.add_argument("--quick", action="store_true", help="one 20k-task cluster, 2 runs")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.repeat = args.tasks or [20_000], 2
    sizes = args.tasks or [100_000, 1_000_000]
    root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="bb-ui-bench-"))
    client = clickhouse.open_client(f"chdb://{root / 'chdb'}")
    target = Target("blackbox", 90 * 86400)
    migrate(client, target)
    backend = backends.DirectBackend(client, "blackbox")
    try:
        for index, tasks in enumerate(sizes):
            label = f"{tasks // 1000}k" if tasks < 1_000_000 else f"{tasks / 1e6:g}M"
            print(f"{label}-task cluster:", flush=True)
            cluster_id, n_transitions = load_cluster(client, target, tasks, index, args.seed)
            computes = backend.query(
                "SELECT countIf(ss.action = 'compute') FROM blackbox.transitions "
                "ARRAY JOIN startstops AS ss WHERE cluster_id = {c:String}", {"c": cluster_id})[1][0][0]
            views.run_data(backend, cluster_id)  # warm: first reads of each column's parts
            data_s, data_cpu, data = median_s(lambda: views.run_data(backend, cluster_id), args.repeat)
            page_s, page_cpu, page = median_s(
                lambda: html_report.render_run(views.run_data(backend, cluster_id), web=True),
                args.repeat)
            out = root / f"report-{label}.html"
            report_s, report_cpu, written = median_s(
                lambda: html_report.write_report(out, cluster_id, backend=backend), args.repeat)
            stream = data["task_stream"]
            print(f"  {computes:,} computes recorded, {n_transitions:,} transitions; task stream "
                  f"{stream['mode']} ({len(stream.get('bars') or stream.get('cells') or []):,} "
                  f"{'bars' if stream['mode'] == 'bars' else 'cells'}); page {len(page) / 1e6:.2f} MB; "
                  f"medians of {args.repeat} runs; load average {os.getloadavg()[0]:.1f} on "
                  f"{os.cpu_count()} cores", flush=True)
            big = tasks >= 1_000_000
            report(f"Run page data, {label}-task run (median, wall)", round(data_s * 1000), "ms", 1000, 300)
            report(f"Run page data, {label}-task run (median, CPU)", round(data_cpu * 1000), "ms", 1000, 300)
            report(f"Run page served (data + Bokeh page), {label}-task run (median, wall)",
                   round(page_s * 1000), "ms", 2000 if big else None, 2000 if big else None)
            report(f"Run page served (data + Bokeh page), {label}-task run (median, CPU)",
                   round(page_cpu * 1000), "ms", 2000 if big else None, 2000 if big else None)
            report(f"report written, {label}-task run (median, wall)", round(report_s, 2), "s", 5, 2)
            report(f"report written, {label}-task run (median, CPU)", round(report_cpu, 2), "s", 5, 2)
            report(f"report size, {label}-task run", round(written["bytes"] / 1e6, 2), "MB", 10)
    finally:
        client.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
