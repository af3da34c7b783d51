"""What the producers cost a busy scheduler: one transition-heavy dask.array graph,
run with and without dask-blackbox on the same LocalCluster (worker processes).

The Tansu broker is started once. Runs come in quads on a fresh LocalCluster each,
ordered A B B A or B A A B (A without, B with dask-blackbox): a quad's ratio
(B1 + B2) / (A1 + A2) cancels any linear drift of the cluster's speed (a scheduler
gets slower as its spans and prefixes accumulate). The B runs attach the producers
(scheduler plugin, worker plugins, log shipping) with :func:`producers.attach` and
detach them after, so both sides share the same processes and warm caches.

Figures, each over all quads:

- wall clock of ``compute()``: the median of the quads' ratios, and the pooled ratio
  (all B time over all A time); the target is <= 1.05, aim <= 1.02;
- CPU seconds of this process, which hosts the LocalCluster's scheduler (and the
  client, the same work on both sides), from submission until the producers'
  buffer is drained (waited for inside the scheduler, so the waiting costs
  nothing): the whole cost, including the sender thread's encoding;
- the CPU time of the producer's sender thread (encoding, Kafka I/O) relative to the
  plain run's process CPU: the part of the cost that other load cannot blur (the
  hot path's share is measured by ``bench/transition_hotpath.py``).

Run-to-run noise on a 2-core machine is about +-10% of wall clock (the scheduler and
two busy worker processes share the cores), larger than the effect measured, hence
many runs: 2 quads (4 A/B pairs) of a ~32k-task graph, about 9 minutes.

Run: ``python bench/scheduler_overhead.py [quads]``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

import dask
import dask.array as da
import dask.config
import psutil
from distributed import Client, LocalCluster

from dask_blackbox import producers
from local_broker import local_broker
from report import report

QUADS = (1 if "--quick" in sys.argv else
         int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 2)
SIDE = 3_100
CHUNK = 20  # 155 x 155 chunks: ~32k tasks on the scheduler, 5 transitions each


def _sender_stats(dask_scheduler) -> dict:
    return dask_scheduler.plugins["dask-blackbox"].transport.stats()


async def _wait_delivered(dask_scheduler) -> None:
    """Wait, on the scheduler, until everything accepted so far was delivered."""
    transport = dask_scheduler.plugins["dask-blackbox"].transport
    target = transport.accepted_events
    while not transport.delivered(target):
        await asyncio.sleep(0.005)


def run(client, with_blackbox: bool, side: int = SIDE) -> tuple[float, float, float, int]:
    """(wall seconds of compute, CPU seconds of this process, CPU seconds of the
    producer's sender thread, graph tasks)."""
    if with_blackbox:
        producers.attach(client)
    graph = (da.ones((side, side), chunks=CHUNK) + 1).sum()
    (optimized,) = dask.optimize(graph)
    n_tasks = len(optimized.__dask_graph__())  # what the scheduler runs
    me = psutil.Process(os.getpid())
    cpu0 = sum(me.cpu_times()[:2])
    t0 = time.perf_counter()
    assert graph.compute() == 2 * side * side
    wall = time.perf_counter() - t0
    if with_blackbox:  # the sender's work counts too: wait until it delivered
        client.run_on_scheduler(_wait_delivered)
    cpu = sum(me.cpu_times()[:2]) - cpu0
    sender_cpu = 0.0
    if with_blackbox:
        stats = client.run_on_scheduler(_sender_stats)
        sender_cpu = stats["sender_cpu_seconds"] or 0.0
        producers.detach(client)
    return wall, cpu, sender_cpu, n_tasks


def _quad_ratio(runs: list[tuple[bool, float]]) -> float:
    """(B1 + B2) / (A1 + A2) of one quad's (with_blackbox, figure) runs."""
    return (sum(v for b, v in runs if b) / sum(v for b, v in runs if not b))


def main() -> None:
    quads: list[list[tuple[bool, float, float, float]]] = []
    for q in range(QUADS):
        order = (False, True, True, False) if q % 2 == 0 else (True, False, False, True)
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            run(client, False, side=SIDE // 4)  # warm up imports and worker state
            runs = []
            for with_blackbox in order:
                wall, cpu, sender_cpu, n_tasks = run(client, with_blackbox)
                runs.append((with_blackbox, wall, cpu, sender_cpu))
                print(f"  quad {q + 1}: {'with   ' if with_blackbox else 'without'} dask-blackbox"
                      f"  wall {wall:6.2f}s  scheduler-process CPU {cpu:6.2f}s"
                      + (f" (sender thread {sender_cpu:.2f}s)" if with_blackbox else ""),
                      flush=True)
        quads.append(runs)
    every = [r for runs in quads for r in runs]
    wall_ratios = [_quad_ratio([(r[0], r[1]) for r in runs]) for runs in quads]
    cpu_ratios = [_quad_ratio([(r[0], r[2]) for r in runs]) for runs in quads]
    pooled = _quad_ratio([(r[0], r[1]) for r in every])
    sender_share = sum(r[3] for r in every if r[0]) / sum(r[2] for r in every if not r[0])
    print(f"scheduler overhead: {QUADS} quads (ABBA / BAAB, a fresh LocalCluster with 2 "
          f"worker processes each), dask.array graph of {n_tasks:,} tasks")
    print(f"  wall-clock ratios per quad: {', '.join(f'{r:.3f}' for r in wall_ratios)}")
    print(f"  MEDIAN WALL-CLOCK RATIO with/without: {statistics.median(wall_ratios):.3f} "
          f"(target <= 1.05, aim <= 1.02)")
    print(f"  pooled wall-clock ratio (all with / all without): {pooled:.3f}")
    print(f"  CPU ratios per quad       : {', '.join(f'{r:.3f}' for r in cpu_ratios)}")
    print(f"  MEDIAN SCHEDULER-PROCESS CPU RATIO with/without: {statistics.median(cpu_ratios):.3f}")
    print(f"  sender thread CPU / scheduler-process CPU without: {sender_share:.3f} "
          "(the producer's own work, noise-free part)")
    report(f"scheduler overhead, wall ratio ({n_tasks // 1000}k tasks)",
           statistics.median(wall_ratios), "x", target=1.05, aim=1.02)
    report("scheduler overhead, pooled wall ratio", pooled, "x", target=1.05, aim=1.02)
    report("scheduler-process CPU ratio", statistics.median(cpu_ratios), "x",
           target=1.05, aim=1.02)


if __name__ == "__main__":
    with local_broker(**{
        "optimization.fuse.active": False,
        # Hand all root tasks to the workers at once instead of queuing them on the
        # scheduler: throughput is then bound by the scheduler's work, not by
        # scheduler<->worker round trips, which makes its overhead visible.
        "distributed.scheduler.worker-saturation": "inf",
    }):
        main()
