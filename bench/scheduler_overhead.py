"""What the producers cost a busy scheduler: one transition-heavy dask.array graph,
run with and without dask-blackbox on the same LocalCluster (worker processes),
interleaved A/B, alternating which goes first.

The cluster and the Tansu broker are started once; the B runs attach the producers
(scheduler plugin, worker plugins, log shipping) with :func:`producers.attach` and
detach them after, so both sides share the same processes and warm caches.

Figures per run, each reported as the median over pairs of B / A:

- wall clock of ``compute()`` (the target: <= 1.05, aim <= 1.02);
- CPU seconds of this process, which hosts the LocalCluster's scheduler (and the
  client, the same work on both sides), from submission until the producers'
  buffer is drained: the whole cost, including the sender thread's encoding. On a
  shared machine this is less noisy than wall clock;
- the CPU time of the producer's sender thread (encoding, Kafka I/O) relative to the
  plain run's process CPU: the part of the cost that other load cannot blur (the
  hot path's share is measured by ``bench/transition_hotpath.py``).

Run: ``python bench/scheduler_overhead.py [pairs]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import dask
import dask.array as da
import dask.config
import psutil
from distributed import Client, LocalCluster

import producers
from local_broker import local_broker
from report import report

PAIRS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 3
SIDE = 3_100
CHUNK = 20  # 155 x 155 chunks: ~32k tasks on the scheduler, after blockwise fusion


def _accepted(dask_scheduler) -> int:
    return dask_scheduler.plugins["dask-blackbox"].transport.accepted_events


def _sender_stats(dask_scheduler) -> dict:
    return dask_scheduler.plugins["dask-blackbox"].transport.stats()


def _delivered(target: int, dask_scheduler) -> bool:
    return dask_scheduler.plugins["dask-blackbox"].transport.delivered(target)


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
        target = client.run_on_scheduler(_accepted)
        while not client.run_on_scheduler(_delivered, target):
            time.sleep(0.01)
    cpu = sum(me.cpu_times()[:2]) - cpu0
    sender_cpu = 0.0
    if with_blackbox:
        stats = client.run_on_scheduler(_sender_stats)
        sender_cpu = stats["sender_cpu_seconds"] or 0.0
        producers.detach(client)
    return wall, cpu, sender_cpu, n_tasks


def main() -> None:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        run(client, False, side=SIDE // 4)  # warm up imports and worker state
        results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for i in range(PAIRS):
            for with_blackbox in ((False, True) if i % 2 == 0 else (True, False)):
                wall, cpu, sender_cpu, n_tasks = run(client, with_blackbox)
                results[with_blackbox].append((wall, cpu, sender_cpu))
                print(f"  pair {i + 1}: {'with   ' if with_blackbox else 'without'} dask-blackbox"
                      f"  wall {wall:6.2f}s  scheduler-process CPU {cpu:6.2f}s"
                      + (f" (sender thread {sender_cpu:.2f}s)" if with_blackbox else ""),
                      flush=True)
    wall_ratios = [b[0] / a[0] for a, b in zip(results[False], results[True])]
    cpu_ratios = [b[1] / a[1] for a, b in zip(results[False], results[True])]
    print(f"scheduler overhead: {PAIRS} interleaved A/B pairs, dask.array graph of "
          f"{n_tasks:,} tasks, LocalCluster with 2 worker processes")
    print(f"  wall-clock ratios : {', '.join(f'{r:.3f}' for r in wall_ratios)}")
    print(f"  MEDIAN WALL-CLOCK RATIO with/without: {statistics.median(wall_ratios):.3f} "
          f"(target <= 1.05, aim <= 1.02)")
    print(f"  CPU ratios        : {', '.join(f'{r:.3f}' for r in cpu_ratios)}")
    print(f"  MEDIAN SCHEDULER-PROCESS CPU RATIO with/without: {statistics.median(cpu_ratios):.3f}")
    shares = [b[2] / a[1] for a, b in zip(results[False], results[True])]
    print(f"  sender thread CPU / scheduler-process CPU without: median "
          f"{statistics.median(shares):.3f} (the producer's own work, noise-free part)")
    report(f"scheduler overhead, wall ratio ({n_tasks // 1000}k tasks)",
           statistics.median(wall_ratios), "x", target=1.05, aim=1.02)
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
