"""What the Task groups and the Processing / transfer views cost from the raw rows and
from the page aggregates, on one generated run of the size where the raw rows still
answer (``aggregates.RAW_TRANSITIONS`` transitions, a run shorter than five minutes).

The run comes from ``bench/query_latency.py``'s generator loaded through the sink's
own path (``bench/ui_latency.py``'s ``load_cluster``: migration 006's materialized
views fill the aggregates). Each view is rendered as the web page asks for it
(:func:`views.render_view`: its data, figures and HTML) on a context of its own, for
the same scope read two ways: from the raw rows (what a run this small gets) and from
the aggregates (what a bigger run gets). Medians of ``--repeat`` runs, A and B
alternating so the machine's load falls on both.

    python bench/group_views.py                # about 200k transitions
    python bench/group_views.py --tasks 20000
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from report import report  # noqa: E402
from ui_latency import TRANSITIONS_PER_TASK, load_cluster  # noqa: E402

from dask_blackbox import clickhouse  # noqa: E402
from dask_blackbox.read import aggregates, backends, panels, views  # noqa: E402
from dask_blackbox.sinks.schema import Target, migrate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=int(aggregates.RAW_TRANSITIONS / TRANSITIONS_PER_TASK))
    parser.add_argument("--repeat", type=int, default=5, help="runs per median")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a 20k-task run, 2 runs")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.repeat = 20_000, 2
    root = pathlib.Path(tempfile.mkdtemp(prefix="bb-group-views-"))
    client = clickhouse.open_client(f"chdb://{root / 'chdb'}")
    target = Target("blackbox", 90 * 86400)
    migrate(client, target)
    backend = backends.DirectBackend(client, "blackbox")
    try:
        cluster_id, n_transitions = load_cluster(client, target, args.tasks, 0, args.seed)
        scope = panels.resolve(backend, cluster_id)
        ways = {"raw rows": dataclasses.replace(scope, since=scope.t0),  # an explicit window: raw rows
                "aggregates": dataclasses.replace(scope, n_transitions=aggregates.RAW_TRANSITIONS + 1)}
        assert not aggregates.usable(ways["raw rows"]) and aggregates.usable(ways["aggregates"])
        for name in ("groups", "activity"):
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.repeat + 1):  # the first round warms the columns' parts
                for way, s in ways.items():
                    t = time.perf_counter()
                    views.render_view(name, views.Context(backend, s, {}, views.Memo()))
                    times[way].append((time.perf_counter() - t) * 1000)
            print(f"{name}: " + "; ".join(
                f"{way} {statistics.median(ms[1:]):.0f} ms (runs {[round(m) for m in ms[1:]]})"
                for way, ms in times.items()), flush=True)
            for way, ms in times.items():
                report(f"{name} view rendered from the {way}, {n_transitions:,} transitions (median)",
                       round(statistics.median(ms[1:])), "ms", None)
        print(f"{n_transitions:,} transitions; medians of {args.repeat} runs; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        client.close()


if __name__ == "__main__":
    main()
