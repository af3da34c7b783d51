"""What the scheduler's sender thread costs per transition, with no Dask cluster: an
A/B of codecs or of revisions, from thread CPU clocks.

    python bench/sender_cost.py [--transitions 200000] [--runs 4] [--rate 20000]
                                [--compression zstd,lz4,none] [--baseline REV] [--busy]
                                [--quick]
    python bench/sender_cost.py --hook [--transitions 200000] [--runs 4] [--baseline REV]

Each run is a process of its own. It makes ``--transitions`` items with the scheduler
plugin's own ``transition`` (``BlackboxSchedulerPlugin``, its buffer and lookups bound
as ``start`` binds them) over Dask's own ``TaskState``/``TaskGroup`` objects, the
shape of a ``(ones * 2 + 1).sum()`` graph: tuple keys (one in a hundred a string), a
task's released->waiting->processing->memory->released->forgotten (one in four queued
on the way), processing->memory carrying what ``task-finished`` passes (worker, nbytes,
type, typename, metadata, thread, startstops: a compute, one in three a transfer
too). Then a real :class:`~producers.buffer.Buffer` and
:class:`~producers.sender.Sender` deliver them to a local Tansu broker (a fresh topic
per run), offered at ``--rate`` a second in ticks of 10 ms, after a warm-up of 2,000.
Figures per transition: the sender thread's CPU as it counts itself (``take``,
``encode``, ``send``: ``Sender.stats``), the thread's whole CPU (``thread``:
``/proc/self/task``, its sleeps and wake-ups too), the envelopes' bytes as sent
(``raw``) and as the codec makes them (``wire``: each envelope compressed by aiokafka's
codec, as one batch holds it). ``--busy``: a thread runs Python code meanwhile, as
Dask's event loop does (the sender then waits for the interpreter's lock after each
system call).

Routes: one per ``--compression`` codec with this checkout's code, or with
``--baseline REV`` A that revision's code (its ``dask_blackbox`` rebuilt from
``git archive``) and B this checkout's, at the first codec. Runs alternate (A, B, A,
B, ...: the machine's load falls on both alike); each route's figure is the median
of its ``--runs`` runs, every run printed. ``--quick``: 2 runs of 50k transitions.

``--hook``: the plugin's ``transition`` alone, the same calls into a real buffer that
nothing drains, the loop timed whole with the thread CPU clock less the same loop
calling a hook that does nothing (``hook``: Dask's call of the hook included), the
collector's time during it (``gc.callbacks``) apart (``gc``), with a scheduler's
worth of live objects (a ``TaskState`` and four containers per task) for it to walk.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque

from report import report

ROOT = pathlib.Path(__file__).resolve().parent.parent
TICK = 0.01
WARMUP = 2_000
PARTS = ("take", "encode", "send", "thread")


# ----------------------------------------------------------------- the transitions


def hook_calls(n: int) -> tuple[list, dict]:
    """About ``n`` calls of the scheduler's transition hook in the order a graph's run
    makes them, as ``(key, start, finish, stimulus_id, kwargs, time)``, and the
    ``scheduler.tasks`` they look up."""
    from distributed.scheduler import TaskGroup, TaskPrefix, TaskState

    rng = random.Random(7)
    tasks: dict = {}
    groups = []
    for name in ("ones_like", "mul", "add", "sum", "sum-aggregate"):
        group = TaskGroup(f"{name}-{uuid.uuid4().hex}", TaskPrefix(name))
        group.span_id = str(uuid.uuid4())
        groups.append(group)
    n_tasks = n // 5 + 1
    workers = ("tcp://127.0.0.1:40123", "tcp://127.0.0.1:38211")
    t = 1_765_000_000.0 + rng.random()
    keys = []
    for i in range(n_tasks):
        group = groups[i * 4 // n_tasks] if i % 50 else groups[4]
        key = (group.name, i % 10_000 // 100, i % 100) if i % 100 else f"{group.name}-{i}"
        tasks[key] = TaskState(key, None, "released", group, False)
        keys.append(key)

    def tick() -> float:
        nonlocal t
        t += rng.expovariate(25_000)
        return t

    graph = f"update-graph-{t:.6f}"
    calls: list = [(key, "released", "waiting", graph, {}, tick()) for key in keys]
    lag = 200  # a task's inputs are released this many tasks later
    for i, key in enumerate(keys + [None] * lag):
        if key is not None:
            finished = f"task-finished-{t + 0.0001:.6f}"
            if i % 4 == 0:
                calls.append((key, "waiting", "queued", graph, {}, tick()))
                calls.append((key, "queued", "processing", finished, {}, tick()))
            else:
                calls.append((key, "waiting", "processing", finished, {}, tick()))
            start = t - rng.uniform(0.0002, 0.002)
            startstops = [{"action": "compute", "start": start,
                           "stop": start + rng.uniform(0.0001, 0.0004)}]
            if i % 3 == 0:
                startstops.insert(0, {"action": "transfer", "start": start - 0.001,
                                      "stop": start - rng.uniform(0.0001, 0.0009),
                                      "source": workers[1 - i % 2]})
            calls.append((key, "processing", "memory", finished, {
                "worker": workers[i % 2], "nbytes": 3200,
                "type": b"\x80\x05\x95\x1c\x00numpy.ndarray", "typename": "numpy.ndarray",
                "metadata": {}, "thread": 140_230_000_000_000 + i % 2 * 7_340_032,
                "startstops": startstops, "status": "OK"}, tick()))
        if i >= lag:
            released = f"task-finished-{t:.6f}"
            calls.append((keys[i - lag], "memory", "released", released, {}, tick()))
            calls.append((keys[i - lag], "released", "forgotten", released, {}, tick()))
    return calls[:n], tasks


def plugin_for(tasks: dict, offer) -> tuple[object, deque]:
    """The scheduler plugin bound as ``start`` binds it: its offer, the tasks'
    lookup, the transition log (appended to before each call, as Dask does)."""
    from dask_blackbox.producers.scheduler import BlackboxSchedulerPlugin
    from dask_blackbox.producers.settings import ProducerSettings

    plugin = BlackboxSchedulerPlugin(ProducerSettings.resolve())
    plugin._offer = offer
    plugin._tasks_get = tasks.get
    log: deque = deque(maxlen=100_000)
    plugin._log = log
    return plugin, log


def make_items(calls: list, tasks: dict) -> list:
    """The items the hook offers for ``calls``."""
    items: list = []
    plugin, log = plugin_for(tasks, items.append)
    hook, append = plugin.transition, log.append
    for key, start, finish, stimulus_id, kwargs, t in calls:
        append((key, start, finish, {}, stimulus_id, t))
        hook(key, start, finish, stimulus_id=stimulus_id, **kwargs)
    return items


# ----------------------------------------------------------------- one run


def thread_cpu(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def busy(stop: threading.Event) -> None:
    """Python code running while the sender works, as Dask's event loop runs: the
    sender waits for the interpreter's lock after each of its system calls."""
    while not stop.is_set():
        x = 0
        for i in range(10_000):
            x += i


def sender_run(args) -> dict:
    import dask.config
    from aiokafka import AIOKafkaConsumer, codec

    import dask_blackbox
    from dask_blackbox import kafka
    from dask_blackbox.producers.buffer import Buffer
    from dask_blackbox.producers.rows import RowMaker
    from dask_blackbox.producers.sender import Identity, Sender
    from dask_blackbox.producers.settings import ProducerSettings

    prefix = "bench-" + uuid.uuid4().hex[:8]
    with dask.config.set({"blackbox.kafka.bootstrap-servers": args.broker,
                          "blackbox.kafka.topic-prefix": prefix,
                          "blackbox.kafka.partitions": 1,
                          "blackbox.kafka.compression": args.child_compression}):
        asyncio.run(kafka.ensure_topics())
        settings = ProducerSettings.resolve()
    calls, tasks = hook_calls(args.transitions + WARMUP)
    items = make_items(calls, tasks)
    buffer = Buffer(settings.buffer_max_events, settings.buffer_max_bytes)
    sender = Sender(buffer, settings, Identity("scheduler", "bench-cluster", "bench"),
                    RowMaker(settings.max_value_bytes)).start()

    def wait_delivered(accepted: int) -> None:
        deadline = time.monotonic() + 300
        while not sender.delivered(accepted):
            if time.monotonic() > deadline:
                sys.exit(f"not delivered: {sender.stats()}")
            time.sleep(0.02)

    stop = threading.Event()
    if args.busy:
        threading.Thread(target=busy, args=(stop,), daemon=True).start()
    offer = buffer.offer
    for item in items[:WARMUP]:
        offer(item)
    wait_delivered(buffer.accepted)
    gc.collect()
    gc.freeze()
    before, envelopes = sender.stats(), sender.sent_envelopes
    cpu0 = thread_cpu(sender.thread.native_id)
    wall = time.monotonic()
    per_tick = max(1, int(args.rate * TICK))
    timed = items[WARMUP:]
    next_tick = time.monotonic()
    for i in range(0, len(timed), per_tick):
        for item in timed[i:i + per_tick]:
            offer(item)
        next_tick += TICK
        if (pause := next_tick - time.monotonic()) > 0:
            time.sleep(pause)
    wait_delivered(buffer.accepted)
    cpu = thread_cpu(sender.thread.native_id) - cpu0
    wall = time.monotonic() - wall
    after = sender.stats()
    stop.set()
    sender.close(time.monotonic() + 5)
    sender.thread.join(10)
    n = len(timed)
    out = {f"{part}_us": (after[f"cpu_{part}"] - before[f"cpu_{part}"]) / n * 1e6
           for part in PARTS[:3]}
    out["thread_us"] = cpu / n * 1e6
    out["envelopes"] = after["sent_envelopes"] - envelopes
    out["dropped"] = buffer.dropped_events
    out["wall"] = wall
    out.update(wire_bytes(args, settings, codec, AIOKafkaConsumer, n, envelopes,
                          after["next_seq"]))
    out["location"] = dask_blackbox.__file__
    return out


def wire_bytes(args, settings, codec, consumer_class, n: int, first: int, last: int) -> dict:
    """Per transition, the bytes of the timed envelopes (``seq`` ``first`` to
    ``last - 1``, the warm-up's came before) as sent and as compressed."""
    compress = {"zstd": codec.zstd_encode, "lz4": codec.lz4_encode, "gzip": codec.gzip_encode,
                "snappy": codec.snappy_encode, "none": bytes}[args.child_compression]

    async def read() -> list[bytes]:
        consumer = consumer_class(settings.raw_topic, bootstrap_servers=args.broker,
                                  auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        values: list[bytes] = []
        try:
            while len(values) < last:
                batch = await consumer.getmany(timeout_ms=5000)
                if not batch:
                    break
                values += [r.value for records in batch.values() for r in records]
        finally:
            await consumer.stop()
        return values

    values = asyncio.run(read())[first:last]
    if len(values) != last - first:
        sys.exit(f"read {len(values)} envelopes of {last - first}")
    return {"raw_bytes": sum(map(len, values)) / n,
            "wire_bytes": sum(len(compress(v)) for v in values) / n}


def hook_run(args) -> dict:
    import dask_blackbox
    from dask_blackbox.producers.buffer import Buffer

    calls, tasks = hook_calls(args.transitions)
    # a scheduler's worth of live, tracked objects for the collector to walk
    ballast = [{"i": i, "deps": set(), "who_has": {}} for i in range(len(tasks) * 4)]
    buffer = Buffer(len(calls) + 1, 1 << 40)
    plugin, log = plugin_for(tasks, buffer.offer)
    append, clock = log.append, time.thread_time
    collector = [0.0, 0.0, 0]  # seconds, the start of the current one, collections

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collector[1] = clock()
        else:
            collector[0] += clock() - collector[1]
            collector[2] += 1

    def nothing(key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        """What Dask's call of a hook costs with no hook."""

    def loop(hook) -> float:
        t0 = clock()
        for key, start, finish, stimulus_id, kwargs, t in calls:
            append((key, start, finish, {}, stimulus_id, t))
            hook(key, start, finish, stimulus_id=stimulus_id, **kwargs)
        return clock() - t0

    loop(plugin.transition)  # the warm-up, on a buffer emptied after
    buffer.discard()
    gc.callbacks.append(on_gc)
    gc.collect()
    collector[:] = [0.0, 0.0, 0]
    bare = loop(nothing) - collector[0]  # the collector's time apart in both loops
    gc.collect()
    collector[:] = [0.0, 0.0, 0]
    spent = loop(plugin.transition)
    gc.callbacks.remove(on_gc)
    n = len(calls)
    del ballast
    return {"hook_us": (spent - collector[0] - bare) / n * 1e6,
            "gc_us": collector[0] / n * 1e6, "collections": collector[2],
            "location": dask_blackbox.__file__}


# ----------------------------------------------------------------- the A/B


def run_child(args, compression: str, package: pathlib.Path | None, broker: str | None) -> dict:
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(package), env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--child", "hook" if args.hook else "sender",
               "--transitions", str(args.transitions), "--rate", str(args.rate),
               "--child-compression", compression, *(["--busy"] if args.busy else [])]
    if broker:
        command += ["--broker", broker]
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"a run failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if package is not None and not result["location"].startswith(str(package)):
        sys.exit(f"a run imported {result['location']}, not the baseline")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transitions", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=4, help="runs of each route")
    parser.add_argument("--rate", type=int, default=20_000, help="transitions offered a second")
    parser.add_argument("--compression", default="zstd",
                        help="codecs, a route each (comma-separated)")
    parser.add_argument("--baseline", default=None,
                        help="a git revision: route A its code, B this checkout's")
    parser.add_argument("--hook", action="store_true", help="the hook alone")
    parser.add_argument("--busy", action="store_true",
                        help="a thread of Python code runs beside the sender (Dask's event loop)")
    parser.add_argument("--quick", action="store_true", help="2 runs of 50k transitions")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--broker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-compression", default="zstd", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(hook_run(args) if args.child == "hook" else sender_run(args)))
        return
    if args.quick:
        args.runs, args.transitions = 2, 50_000
    codecs = args.compression.split(",")
    with tempfile.TemporaryDirectory() as work:
        from sink_ingest import baseline_package
        package = baseline_package(args.baseline, pathlib.Path(work)) if args.baseline else None
        if args.baseline:
            shown = "" if args.hook else f" {codecs[0]}"
            routes = [(f"A {args.baseline}{shown}", codecs[0], package),
                      (f"B this checkout{shown}", codecs[0], None)]
        else:
            routes = [("this checkout" if args.hook else codec, codec, None)
                      for codec in codecs[:1 if args.hook else None]]
        broker = None
        if not args.hook:
            from dask_blackbox.deploy import brokers

            broker = brokers.from_config(work, "tansu").start(timeout=120)
        try:
            figures = ("hook_us", "gc_us") if args.hook else (
                "take_us", "encode_us", "send_us", "thread_us", "raw_bytes", "wire_bytes")
            results: dict[str, list[dict]] = {label: [] for label, *_ in routes}
            for i in range(args.runs):
                for label, codec, pkg in routes:
                    r = run_child(args, codec, pkg, broker.address if broker else None)
                    results[label].append(r)
                    print(f"run {i + 1} {label}: " + "  ".join(
                        f"{f} {r[f]:.3f}" for f in figures)
                        + ("" if args.hook else f"  envelopes {r['envelopes']} dropped "
                           f"{r['dropped']} wall {r['wall']:.1f}s"), flush=True)
            print(f"\nmedians over {args.runs} runs a route, {args.transitions} transitions a run"
                  + ("" if args.hook else f" at {args.rate}/s") + ":")
            for label, runs in results.items():
                print(f"  {label}: " + "  ".join(
                    f"{f} {statistics.median(r[f] for r in runs):.3f} "
                    f"[{min(r[f] for r in runs):.3f}-{max(r[f] for r in runs):.3f}]"
                    for f in figures))
            for label, runs in results.items():
                for f in figures[:2] if args.hook else figures[3:4]:
                    report(f"sender alone, {f.removesuffix('_us')} CPU a transition ({label})",
                           round(statistics.median(r[f] for r in runs), 3), "us", None)
        finally:
            if broker is not None:
                broker.kill()


if __name__ == "__main__":
    main()
