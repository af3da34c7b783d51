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

``--callgrind``: the same A/B counted in instructions, which the load of a shared
machine does not move. The script re-runs itself under ``valgrind --tool=callgrind
--separate-threads=yes``; sections are delimited by calls of ``os.getppid()``
(``--zero-before=getppid``) and ``os.getpgrp()`` (``--dump-before=getpgrp``), and
only the main thread's counts are read. On a real Scheduler with
:data:`CG_KEYS` tuple-keyed tasks, each key goes through the five transitions a
task of ``scheduler_overhead.py``'s graphs goes through (released->waiting,
waiting->processing, processing->memory with the kwargs Dask passes,
memory->released, released->forgotten), called as ``SchedulerState._transition``
calls plugins. Figures, per transition: the no-op plugin's call (A), the
dask-blackbox hook (B: the compiled one, ``producers/_hotpath.c``, where it is
built), B - A (what the event loop pays), and last B', the plugin's Python method
(what ``producer.compiled-hook: false`` runs); then, with the sender
thread parked (a flush interval of an hour), draining the same buffer in the main
thread with the sender's own code: building and encoding the envelopes (what the
sender thread pays per event besides Kafka), and zstd-compressing them as aiokafka
does. Before each section the heap is collected and frozen (``gc.freeze``): the counts
include the collections a section's own allocations trigger, over its own objects,
not a full collection of whatever the process held (which lands in one section or
another by chance). ``perf stat -e instructions`` is not supported on this
machine's virtual CPU, hence callgrind.

FINDINGS (2026-11-26, session 17, one run; 10,000 transitions of 2,000 tasks): the
hook added 4,318 instructions a transition in Python (B' - A) and 2,206 compiled
(B - A): the four plain transitions of a task take the C path, the fifth (with
Dask's kwargs) the Python method behind it. The buffers both fill are equal
(``tests/test_hotpath.py``). Then the hook took worker, nbytes, typename and
startstops out of Dask's kwargs (the dict is no longer held, ``gc_pressure.py``):
hook 2,206 -> 2,792 (Python 4,318 -> 4,916), the relay's hand-over 6,002 -> 5,348 an
event; the scheduler process's own per event (helper-process sender) 8,209 -> 8,140.
The dict's release moved from the relay thread to the event loop, where the no-op
plugin (A) pays it too.

FINDINGS (2026-11-26, session 18, one run a side): the compiled hook writes every
transition without an error (processing->memory's worker, nbytes, typename and
startstops included) as a row in ``marshal``'s format to a tape, the group to the
buffer; the relay hands a frame's rows over as one bytes object.

| per transition / event          | before (b21605b) | tape       | Python hook |
|---------------------------------|------------------|------------|-------------|
| hook added (B - A)              | 2,799            | **111**    | 4,948       |
| relay hand-over                 | 5,348            | **1,925**  | 5,523       |
| scheduler process, helper sender| 8,140            | **2,037**  | 10,454      |
| thread sender (build + encode)  | —                | 17,347     | 13,700      |

The hook now costs about what calling a no-op Python plugin costs (A builds the
kwargs dict of processing->memory for its ``**kwargs``; the C hook reads the
keywords where they are). The thread sender (``producer.sender: thread``, not the
scheduler's default) decodes the tape's rows, each key and stimulus id a new
object (Dask's states and startstops' keys are references to shared strings):
more than the fields it used to take as they were, though the scheduler process
per event with the thread sender is still below the Python hook's (18,673 vs
19,913).
"""

from __future__ import annotations

import asyncio
import gc
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

from distributed import Scheduler
from distributed.scheduler import Transition
from distributed.diagnostics.plugin import SchedulerPlugin

from local_broker import local_broker
from parked import NoopPlugin, handed_over, parked_blackbox
from report import report
from dask_blackbox.producers.events import tape_rows
from dask_blackbox.producers.scheduler import BlackboxSchedulerPlugin
from dask_blackbox.producers.settings import ProducerSettings

BATCH = 1_000  # calls between two waits for the sender to drain
BATCHES_PER_ROUND = 20
CALLS_PER_ROUND = BATCH * BATCHES_PER_ROUND
ROUNDS = 9


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
    scheduler.transition_log.append(
        Transition(key, "processing", "memory", {}, "task-finished-1.0", time.time()))
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


#: Tasks driven through their transitions in the callgrind run.
CG_KEYS = 2_000
_TRANSITIONS = (
    ("released", "waiting", False), ("waiting", "processing", False),
    ("processing", "memory", True), ("memory", "released", False),
    ("released", "forgotten", False),
)


def _section(name: str, fn) -> None:
    """Run ``fn`` as one callgrind section (zeroed before, dumped after). Objects
    from before are collected and frozen first, so the garbage collections inside
    the section are those its own allocations trigger, over its own objects."""
    gc.collect()
    gc.freeze()
    os.getppid()  # --zero-before=getppid
    fn()
    os.getpgrp()  # --dump-before=getpgrp
    _SECTIONS.append(name)


_SECTIONS: list[str] = []


async def callgrind_child(out: str, broker) -> None:
    """The part that runs under valgrind; writes the section names to ``out``."""
    scheduler = await Scheduler(dashboard_address=":0", validate=False)
    keys = [(f"ones-like-{i % 7:02d}0123456789abcdef0123456789abcdef", i, i + 1)
            for i in range(CG_KEYS)]
    for key in keys:
        scheduler.new_task(key, None, "released")
    scheduler.transition_log.append(Transition(
        keys[0], "processing", "memory", {}, "task-finished-1.0", time.time()))
    done = {
        "worker": "tcp://127.0.0.1:40000", "nbytes": 3_200, "type": b"\x80\x04numpy",
        "typename": "numpy.ndarray", "metadata": {}, "thread": 140000000000,
        "startstops": ({"action": "compute", "start": 1.0, "stop": 1.001},),
    }
    blackbox = await parked_blackbox(scheduler)
    transport = blackbox.transport
    noop = NoopPlugin()
    now = time.time()
    calls = [(key, a, b, f"stim-{i}", done if carries else {},
              Transition(key, a, b, {}, f"stim-{i}", now + i))
             for i, key in enumerate(keys) for a, b, carries in _TRANSITIONS]

    def drive(plugin):
        def run():  # as SchedulerState._transition: log the record, call the plugin
            transition, log = plugin.transition, scheduler.transition_log.append
            for key, a, b, stimulus_id, kwargs, record in calls:
                log(record)
                transition(key, a, b, stimulus_id=stimulus_id, **kwargs)
        return run

    for _ in range(2):  # warm up both (caches, specialization), then count
        drive(noop)()
    _section("A: no-op plugin, per transition", drive(noop))
    kind = "compiled" if type(blackbox.transition).__name__ == "Hook" else "Python"
    _section(f"B: dask-blackbox hook ({kind}), per transition", drive(blackbox))
    envelopes: list[bytes] = []
    items, fields = list(transport._buffer), list(transport._record_fields)
    tape = transport._tape  # the compiled hook's rows (None with the Python hook)
    rows = tape_rows(tape.take(len(tape))) if tape is not None else []

    def refill():  # the same buffered items again
        transport._buffer.extend(items)
        transport._record_fields.extend(fields)
        for row in rows:
            tape.append(row)

    transport._buffer.clear()
    transport._record_fields.clear()
    refill()
    frames: list[bytes] = []

    def hand_over():  # what the relay thread does in the scheduler process
        frames.extend(handed_over(transport))

    _section("relay: hand-over to the helper, per event", hand_over)
    refill()  # for the thread sender

    def drain():
        carry = __import__("collections").deque()
        transport.cluster_id = scheduler.id
        while True:
            packed = transport._pack(carry)
            if packed is None:
                break
            envelopes.append(packed[0])
        transport.cluster_id = None

    _section("sender: build + encode, per event", drain)
    from aiokafka.codec import zstd_encode

    _section("sender: zstd level 3 (aiokafka), per event",
             lambda: [zstd_encode(e) for e in envelopes])
    transport._buffer.clear()
    transport._record_fields.clear()
    if tape is not None:
        tape.clear()

    class PythonHook:  # the plugin's own method: what producer.compiled-hook false runs
        transition = BlackboxSchedulerPlugin.transition.__get__(blackbox)

    blackbox._records = scheduler.transition_log  # as without the compiled hook

    _section("B': the Python hook, per transition", drive(PythonHook))
    with open(out, "w") as f:
        f.write("\n".join(_SECTIONS) + "\n" + str(len(calls)) + "\n"
                + str(sum(len(e) for e in envelopes)))
    transport.cluster_id = scheduler.id
    await scheduler.close()
    broker.kill()  # os._exit skips the context that would
    os._exit(0)  # no flush at exit: nothing listens


def _instructions(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"no totals in {path}")


def callgrind_main() -> None:
    tmp = tempfile.mkdtemp(prefix="blackbox-callgrind-")
    names = os.path.join(tmp, "sections.txt")
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes",
           "--zero-before=getppid", "--dump-before=getpgrp",
           f"--callgrind-out-file={tmp}/cg.out",
           sys.executable, os.path.abspath(__file__), "--callgrind-child", names]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    lines = open(names).read().split("\n")
    sections, n_calls, n_bytes = lines[:-2], int(lines[-2]), int(lines[-1])
    # dumps are numbered in order; thread 1 is the main thread
    dumps = sorted(glob.glob(f"{tmp}/cg.out.*-01"),
                   key=lambda p: int(p.rsplit(".", 1)[1].split("-")[0]))
    counts = [_instructions(p) for p in dumps[-len(sections):]]
    per = {name: c / n_calls for name, c in zip(sections, counts)}
    a, b = per[sections[0]], per[sections[1]]
    compiled = "(compiled)" in sections[1]
    print(f"instructions (valgrind --tool=callgrind, main thread only, one run; "
          f"{n_calls:,} transitions of {CG_KEYS:,} tuple-keyed tasks; "
          f"{time.monotonic() - t0:.0f}s):")
    for name in sections:
        print(f"  {name:46s} {per[name]:10,.0f}")
    print(f"  {'HOT PATH ADDED (B - A), per transition':46s} {b - a:10,.0f}"
          f"   ({'compiled' if compiled else 'Python'} hook)")
    label = "same, Python hook (B' - A)"
    print(f"  {label:46s} {per[sections[5]] - a:10,.0f}")
    sender = per[sections[3]] + per[sections[4]]
    print(f"  {'thread sender besides Kafka I/O, per event':46s} {sender:10,.0f}"
          f"   ({n_bytes / n_calls:.0f} encoded bytes per event)")
    print(f"  {'scheduler process per event, thread sender':46s} {b - a + sender:10,.0f}")
    print(f"  {'scheduler process per event, helper process':46s} "
          f"{b - a + per[sections[2]]:10,.0f}   (the helper's own work is not counted)")
    report("transition() hot path added (instructions)", b - a, "instr", target=None)
    report("sender build+encode+compress per event (instructions)", sender, "instr",
           target=None)


if __name__ == "__main__":
    if "--callgrind-child" in sys.argv:
        with local_broker() as broker:
            asyncio.run(callgrind_child(sys.argv[sys.argv.index("--callgrind-child") + 1],
                                        broker))
    elif "--callgrind" in sys.argv:
        callgrind_main()
    else:
        with local_broker():
            asyncio.run(main())
