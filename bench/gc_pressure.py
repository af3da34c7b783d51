"""What the producers add to the scheduler's garbage collections, counted.

On a 200k-task graph, garbage collection was the largest item of what recording
cost the scheduler process (``scheduler_overhead.py``, sixth pass: +2.43 s of
+6.07 s, one more full collection a run). CPython (3.11 here) collects its
youngest generation after 700 net allocations of tracked objects, the middle one
every 10 of those, and the oldest (every object of the scheduler: a full
collection, ~1.5 s at 200k tasks) every 10 of those once the objects promoted
into it since the last full collection exceed a quarter of it. So what the
recording holds across collections matters more than what it allocates: an object
that survives two collections is promoted, and the promoted bring the next full
collection closer.

This bench counts those collections, which machine noise does not move. A real
``Scheduler`` in this process holds :data:`TASKS` tuple-keyed tasks (a heap like
a large graph's). Every task goes through the five transitions of
``scheduler_overhead.py``'s graphs, as ``SchedulerState._transition`` makes them:
a ``Transition`` record with a fresh recommendations dict appended to
``transition_log`` (Dask's 1,000 of them), then the plugin called, with a fresh
kwargs dict and startstops list for processing -> memory, as a worker's message
brings them. A calls a no-op plugin; B the dask-blackbox scheduler plugin (helper
process sender, its relay thread parked), and every :data:`HAND_OVER_EVERY`
transitions this thread does what the relay thread does (``_take_rows`` and the
frame's encoding: about half a second of a 200k graph's transitions, the relay's
linger under load). The heap is collected before each side (``gc.collect()``),
so both start from the same state; sides alternate A B B A.

Printed per side: collections of each generation (the same on every run of a side
unless the code changes), the CPU seconds in each, and the CPU of the whole drive.

Run: ``python bench/gc_pressure.py`` (~15 seconds).

FINDINGS (2026-11-25, session 13; 2 runs a side, the same counts on each run):
before commit 1d776d7, when the buffer held Dask's records (a tuple and its
recommendations dict) until the hand-over, B added 2,732 young, 248 middle and 4
full collections (1.30 s in the full ones); the drive took 0.88 -> 3.56 s of CPU.
Holding a record's five fields instead: 993, 90 and 0 full collections, 0.93 ->
2.11 s. What remains is the hand-over's own rows, freed at each frame. (Run on
the old code: its tree's ``dask_blackbox`` package first on ``PYTHONPATH``.)
Session 17 (2 runs a side, the same counts on each): the scheduler hook takes worker,
nbytes, typename and startstops out of Dask's kwargs instead of holding the kwargs
dict until the hand-over: B's 993 young and 90 middle collections -> **252 and 22**
(drive 1.81 -> 1.75 s of CPU).
A side: no collections at all, as Dask's ``transition_log`` drops a record for
each it appends; in a real run Dask's own allocations add collections on both
sides (``scheduler_overhead.py`` counts them).
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time

from distributed import Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import Transition

from local_broker import local_broker
from parked import NoopPlugin, handed_over, parked_blackbox
from report import report

TASKS = 200_000
#: Transitions between two hand-overs (~0.5 s of a 200k graph's ~7,400 a second).
HAND_OVER_EVERY = 3_700
_TRANSITIONS = (
    ("released", "waiting", False), ("waiting", "processing", False),
    ("processing", "memory", True), ("memory", "released", False),
    ("released", "forgotten", False),
)


class _Probe:
    """Collections per generation and CPU seconds in each (a gc callback)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.thread_time() - self._start

    def reset(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]


def drive(scheduler: Scheduler, keys: list, plugin: SchedulerPlugin, hand_over) -> float:
    """Every key through its five transitions, as Dask makes them; CPU seconds."""
    log = scheduler.transition_log.append
    transition = plugin.transition
    n = len(keys)
    cpu0 = time.thread_time()
    done = 0
    for i, key in enumerate(keys):
        following = keys[(i + 1) % n]
        for a, b, carries in _TRANSITIONS:
            stimulus_id = f"stim-{i // 50}"
            log(Transition(key, a, b, {following: "waiting"}, stimulus_id, time.time()))
            if carries:
                transition(key, a, b, stimulus_id=stimulus_id,
                           worker="tcp://127.0.0.1:40000", nbytes=3_200,
                           type=b"\x80\x04numpy", typename="numpy.ndarray", metadata={},
                           thread=140000000000,
                           startstops=[{"action": "compute", "start": 1.0, "stop": 1.001}])
            else:
                transition(key, a, b, stimulus_id=stimulus_id)
            done += 1
            if done % HAND_OVER_EVERY == 0:
                hand_over()
    hand_over()
    return time.thread_time() - cpu0


async def main() -> None:
    scheduler = await Scheduler(dashboard_address=":0", validate=False)
    keys = [(f"ones-like-{i % 7:02d}0123456789abcdef0123456789abcdef", i, i + 1)
            for i in range(TASKS)]
    for key in keys:
        scheduler.new_task(key, None, "released")
    blackbox = await parked_blackbox(scheduler)
    transport = blackbox.transport
    frames = [0]

    def hand_over() -> None:
        frames[0] += sum(map(len, handed_over(transport)))
        with transport._lock:  # nothing is delivered: give the room back
            transport._held_events = 0
            transport._bytes_out = transport._bytes_in + transport._records_taken

    noop = NoopPlugin()
    probe = _Probe()
    results: dict[str, list] = {"A": [], "B": []}
    try:
        for side in ("A", "B", "B", "A"):
            gc.collect()
            probe.reset()
            plugin, step = (noop, lambda: None) if side == "A" else (blackbox, hand_over)
            cpu = drive(scheduler, keys, plugin, step)
            results[side].append((list(probe.counts), list(probe.seconds), cpu))
            print(f"  {side}: collections gen-0 {probe.counts[0]:,}, gen-1 "
                  f"{probe.counts[1]:,}, gen-2 {probe.counts[2]:,}; CPU in them "
                  f"{probe.seconds[0]:.2f} / {probe.seconds[1]:.2f} / "
                  f"{probe.seconds[2]:.2f} s; drive {cpu:.2f} s", flush=True)
    finally:
        transport.cluster_id = scheduler.id
        await blackbox.close()
        await scheduler.close()
    n = TASKS * len(_TRANSITIONS)
    print(f"{n:,} transitions of {TASKS:,} tasks, a hand-over every {HAND_OVER_EVERY:,} "
          f"({frames[0] / n:.0f} frame bytes per transition); 2 runs a side:")
    for g in range(3):
        a = statistics.median(r[0][g] for r in results["A"])
        b = statistics.median(r[0][g] for r in results["B"])
        sa = statistics.median(r[1][g] for r in results["A"])
        sb = statistics.median(r[1][g] for r in results["B"])
        print(f"  gen-{g} collections {a:8,.0f} -> {b:8,.0f}   CPU {sa:6.2f} -> {sb:6.2f} s")
    cpu_a = statistics.median(r[2] for r in results["A"])
    cpu_b = statistics.median(r[2] for r in results["B"])
    print(f"  drive CPU {cpu_a:.2f} -> {cpu_b:.2f} s (hot path, hand-over and collections)")
    full_a = statistics.median(r[0][2] for r in results["A"])
    full_b = statistics.median(r[0][2] for r in results["B"])
    report("full collections added by the producers", full_b - full_a, "collections",
           target=0)


if __name__ == "__main__":
    with local_broker():
        asyncio.run(main())
