"""Cost of one ``SchedulerPlugin.transition`` call on the producers' hot path.

A real Scheduler (no workers) in this process, the dask-blackbox scheduler plugin
started on it and publishing to a real Tansu broker, and a no-op plugin with the
same signature. Both are called exactly as ``SchedulerState._transition`` calls
plugins (``plugin.transition(key, start, finish, stimulus_id=..., **kwargs)`` with
the kwargs of a processing->memory transition), alternating A/B rounds. The
figure is the median over rounds of (blackbox - no-op) CPU time of the calling
thread per call: what the plugin adds to the event loop for every transition. The
sender thread keeps draining meanwhile; its own CPU per event and the wall-clock
difference (which includes waiting for the GIL it holds) are printed too.

Run: ``python bench/transition_hotpath.py`` (target <= 5 us, aim <= 2 us).
"""

from __future__ import annotations

import asyncio
import statistics
import time

from distributed import Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin

from local_broker import local_broker
from report import report
from dask_blackbox.producers.scheduler import BlackboxSchedulerPlugin
from dask_blackbox.producers.settings import ProducerSettings

BATCH = 1_000  # calls between two waits for the sender to drain
BATCHES_PER_ROUND = 20
CALLS_PER_ROUND = BATCH * BATCHES_PER_ROUND
ROUNDS = 9


class NoopPlugin(SchedulerPlugin):
    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs):
        pass


async def timed_round(
    plugin: SchedulerPlugin, key, kwargs: dict, transport
) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) per call, in batches of calls
    separated by (untimed) waits until the sender drained the buffer: a scheduler
    emits transitions in bursts, and the buffer must not grow without bound here
    either, or the figure measures memory growth."""
    transition = plugin.transition
    cpu = wall = 0.0
    for _ in range(BATCHES_PER_ROUND):
        cpu0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(BATCH):
            transition(key, "processing", "memory", stimulus_id="task-finished-1.0", **kwargs)
        cpu += time.thread_time() - cpu0
        wall += time.perf_counter() - t0
        while transport.buffered_events:
            await asyncio.sleep(0.001)
    return cpu / CALLS_PER_ROUND, wall / CALLS_PER_ROUND


async def main() -> None:
    scheduler = await Scheduler(dashboard_address=":0", validate=False)
    key = ("inc-0123456789abcdef", 3, 7)
    scheduler.new_task(key, None, "memory")
    scheduler.transition_log.append((key, "processing", "memory", {}, "task-finished-1.0", time.time()))
    kwargs = {
        "worker": "tcp://127.0.0.1:40000", "nbytes": 80_000, "type": b"\x80\x04numpy",
        "typename": "numpy.ndarray", "metadata": {}, "thread": 140000000000,
        "startstops": [{"action": "compute", "start": 1.0, "stop": 1.001}],
    }
    settings = ProducerSettings.resolve(
        {"producer.buffer-max-events": 10_000_000, "producer.buffer-max-bytes": "4GiB"}
    )
    blackbox = BlackboxSchedulerPlugin(settings)
    await blackbox.start(scheduler)
    noop = NoopPlugin()
    try:
        cpu_diffs, wall_diffs, absolute, baseline = [], [], [], []
        for i in range(ROUNDS):
            order = (noop, blackbox) if i % 2 == 0 else (blackbox, noop)
            cost = {id(p): await timed_round(p, key, kwargs, blackbox.transport) for p in order}
            (bb_cpu, bb_wall), (noop_cpu, noop_wall) = cost[id(blackbox)], cost[id(noop)]
            cpu_diffs.append(bb_cpu - noop_cpu)
            wall_diffs.append(bb_wall - noop_wall)
            absolute.append(bb_cpu)
            baseline.append(noop_cpu)
        stats = blackbox.transport.stats()
    finally:
        await blackbox.close()
        await scheduler.close()
    sender_us = stats["sender_cpu_seconds"] / max(stats["sent_events"], 1) * 1e6
    print(f"transition() hot path, {ROUNDS} A/B rounds x {CALLS_PER_ROUND:,} calls "
          "(CPU time of the calling thread)")
    print(f"  no-op plugin call           : {statistics.median(baseline) * 1e6:6.2f} us/call (median)")
    print(f"  dask-blackbox plugin call   : {statistics.median(absolute) * 1e6:6.2f} us/call (median)")
    print(f"  HOT PATH ADDED BY dask-blackbox: {statistics.median(cpu_diffs) * 1e6:6.2f} us/call "
          f"(median of per-round differences; target <= 5, aim <= 2)")
    print(f"  same, wall clock            : {statistics.median(wall_diffs) * 1e6:6.2f} us/call "
          "(includes waiting for the GIL while the sender thread encodes)")
    print(f"  sender thread (off the event loop): {sender_us:.2f} us CPU per event to build, "
          f"encode and deliver; {stats['sent_events']:,} events in "
          f"{stats['sent_envelopes']:,} envelopes, dropped {stats['dropped_events']:,}")
    report("transition() hot path added (CPU)", statistics.median(cpu_diffs) * 1e6, "us",
           target=5.0, aim=2.0)


if __name__ == "__main__":
    with local_broker():
        asyncio.run(main())
