"""The relay helper's CPU on a fixed input: frames captured from a real run, replayed.

Why. In ``scheduler_overhead.py`` the helper process is the largest CPU cost that
recording adds to the machine (fresh40k: 4.2-4.5 s a run, the relay thread 1.1 s,
the broker 0.9 s), and on a 2-core machine that Dask already fills, every second of
it lengthens the run. A whole-cluster A/B resolves about 5 %; the helper's own CPU
on a fixed input is steadier, so its changes can be measured here first.

``capture``: runs a shape of ``scheduler_overhead.py`` (default fresh40k: warm-up,
then the timed compute) on a LocalCluster (2 worker processes, 1 thread each; the
scheduler in this process) with the producers attached, and writes every frame the
relay thread hands to its helper, with its time since the first, to ``--frames``.

``replay``: for each side (``--sides``: ``new`` this tree, ``base`` the tree at
``--base``, checked out in a temporary worktree), starts a fresh Tansu broker and a
helper exactly as :class:`producers.relay._Helper` does (the side's code comes with
its ``sys.path``), hands it the hello frame and then the captured frames at their
captured times (``--speed`` divides the times), closes its input and waits for it
to deliver everything and exit. Printed per run: the helper's CPU (user + system,
``os.wait4``), per thread (``/proc/<pid>/task``, highest reading), the broker's CPU,
the events and envelopes delivered; per side, medians. Sides alternate ABBA.
``--spy DIR`` records each helper with py-spy (raw format, every thread).

``collector``: the helper's receiving and packing in this process, no broker: each
captured frame decoded and applied (``relay._Receiver.apply``), then packed until
nothing is left (``Transport._pack``, its sender never sending), with the
collector's thresholds at CPython's defaults and at ``relay.HELPER_GC_THRESHOLDS``,
alternating ABBA; printed per run: ns an event and collections per generation.

Run: ``python bench/relay_replay.py capture`` then
``python bench/relay_replay.py replay [--runs 4] [--base REV] [--speed 2]`` or
``python bench/relay_replay.py collector [--runs 4]``.

FINDINGS (2026-11-26, session 19; a 32k capture of the tape tree: 57 frames, 21.5 MB,
161,905 events in 24 s; ``nice -n 5 python bench/relay_replay.py replay --base 4768d75
--runs 4 --speed 2``, medians of 4 runs a side)

- The helper's collector was a third to half of its interpreter time. ``python
  bench/relay_replay.py collector --runs 4`` (the same frames applied and packed in
  this process, no broker; 4 runs a side, ABBA): **2,905 -> 1,842 ns an event**
  (medians; per run 2,621-3,451 against 1,489-3,183, later runs slower on both
  sides), collections per run **709 / 64 / 5 -> 11 / 0 / 0** (young / middle /
  full; identical in every run). What it allocates per event (a row, its key,
  strings and float, a buffer item) is acyclic and short-lived.
- The change (``relay.HELPER_GC_THRESHOLDS``, and ``gc.freeze()`` after start):
  helper **0.93 -> 0.74 s (0.792; 5.7 -> 4.5 us an event)**, its reading thread
  0.48-0.57 -> 0.35-0.39 s, its sender thread 0.28-0.41 -> 0.27-0.31 s; the same
  156 envelopes and 161,905 events, none lost.
- Where the remaining 4.5 us go (py-spy, 1 run; pieces alone): ``marshal`` of the
  tape's rows ~0.9 us, naming them ~0.4 us, a run's columns and key texts ~0.6 us,
  zstd ~0.2 us, aiokafka's request building and the packing loops the rest.

FINDINGS (2026-11-25, session 16; a fresh40k capture of session 15: 245 frames,
17.2 MB, 236,915 events in 74 s; ``nice -n 5 python bench/relay_replay.py replay
--base 2f3cc51 --runs 4 --speed 2``, medians of 4 runs a side)

- Transitions as ``TRANSITION_RUN`` columns (``producers.events.TransitionRuns``),
  first for the records only (fa39573): helper 1.52 -> 1.38 s (0.910). The runs
  were short: a transition with Dask's kwargs (one per task, processing -> memory)
  ended each one, so a run averaged ~5 records and its fixed cost (transposition, names
  table, an orjson call) was paid per ~5 events (py-spy, 1 run: the runs' encoding
  still ~16 % of the samples).
- With every transition in the runs (their kwargs as optional columns, left out
  where all None) and the helper putting a frame's records in its buffer a run at
  a time (``zip``/``islice`` in C): helper **1.69 -> 1.17 s (0.694)**, 7.1 -> 5.0
  us an event; its sender thread 0.95-1.11 -> 0.51-0.56 s, its reading thread
  (``marshal`` decode, buffering) 0.59-0.63 -> 0.54-0.58 s; system time 0.20-0.27
  -> 0.11-0.14 s (fewer bytes to compress and send). Envelopes 237 on both sides
  (each leaves at the linger, not full); broker 0.12 -> 0.11 s.

FINDINGS (2026-11-23, session 8; fresh40k frames: 1,199 frames, 19.7 MB of
``marshal``, 280,301 events in 97 s)

- Where the helper's ~4 s go (``--spy``, ``perf record -e cpu-clock`` on the
  helper, and the pieces timed alone on the captured frames): 74 % of its samples
  are in the interpreter, 8 % in the kernel, 5 % in zstd (cramjam), 2.5 % in
  orjson. Alone: decoding the frames 0.54 s, rebuilding the rows 0.18 s, the
  records' JSON 0.76 s (3.2 us a record, 418 bytes), the other transitions'
  events 0.30 s. The rest is the packing loop, aiokafka (0.5 ms of Python per
  envelope: one envelope per frame, 1,200 a run) and the loop's plumbing.
- The helper as one event loop (frames read with ``add_reader``, the sender a task,
  no second thread): 4.36 s against 3.99 s (2 runs a side at ``--speed 2``):
  dropped.
- After a busy envelope (200+ events) the helper lingers 0.5 s instead of
  ``flush-interval`` (``producers.relay.LINGER``): 1,270 -> 357 envelopes; helper
  4.11 -> 3.39 s and broker 0.59 -> 0.21 s (medians of 2 runs a side at speed 1;
  3.31 -> 2.82 s and 0.52 -> 0.18 s at speed 2). In a real fresh40k run, where
  every wake-up competes with Dask for the CPU, the helper fell from 4.2-4.5 s to
  1.9-2.8 s and the broker from 0.9 s to 0.22-0.28 s (``scheduler_overhead.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pathlib
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

import dask
import dask.config

from dask_blackbox import producers
from dask_blackbox.producers import relay
from local_broker import local_broker
from process_cluster import process_cpu, thread_cpu

FRAMES = pathlib.Path(tempfile.gettempdir()) / "blackbox-relay-frames.bin"
_FRAME = struct.Struct("<dI")  # seconds since the first frame, length


def capture(shape_name: str, path: pathlib.Path) -> None:
    from distributed import Client, LocalCluster

    from scheduler_overhead import SHAPES

    shape = SHAPES[shape_name]
    out = path.open("wb")
    start: list[float] = []  # the first frame's time; then one entry per frame
    write = relay._Helper.write

    def tee(self, data: bytes) -> None:
        now = time.perf_counter()
        start.append(now)
        out.write(_FRAME.pack(now - start[0], len(data)))
        out.write(data)
        write(self, data)

    relay._Helper.write = tee
    with dask.config.set(shape.scheduler_config), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True,
            dashboard_address=":0") as cluster, Client(cluster) as client:
        (shape.warm_up or shape.compute)(client)
        producers.attach(client)
        t0 = time.perf_counter()
        n = shape.compute(client)
        wall = time.perf_counter() - t0
        producers.detach(client)
    out.close()
    relay._Helper.write = write
    print(f"captured {len(start)} frames ({path.stat().st_size / 1e6:.1f} MB) of {shape_name}: "
          f"{n:,} tasks, compute {wall:.1f}s, to {path}")


def read_frames(path: pathlib.Path) -> list[tuple[float, bytes]]:
    frames = []
    with path.open("rb") as f:
        while header := f.read(_FRAME.size):
            at, n = _FRAME.unpack(header)
            frames.append((at, f.read(n)))
    return frames


def replay_once(frames: list[tuple[float, bytes]], code_path: list[str], speed: float,
                broker_pid: int | None, spy_to: pathlib.Path | None = None) -> dict:
    """One helper (with ``code_path`` first on its sys.path) fed ``frames``."""
    settings = producers.ProducerSettings.resolve()
    hello = relay.decode_frame(frames[0][1])
    hello.update(settings=settings, producer_id=relay.new_producer_id("scheduler"))
    path = code_path + [os.path.abspath(p) for p in sys.path]
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", relay._HELPER_MAIN, json.dumps(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
    broker0 = process_cpu(broker_pid) if broker_pid else 0.0
    stdin = proc.stdin

    def send(data: bytes) -> None:
        stdin.write(relay._HEADER.pack(len(data)))
        stdin.write(data)
        stdin.flush()

    send(relay.encode_frame(hello))
    proc.stdout.readline()  # its first status: started
    spy = None
    if spy_to is not None:
        spy = subprocess.Popen(
            ["py-spy", "record", "--threads", "--nonblocking", "-r", "250", "--format",
             "raw", "-o", str(spy_to), "--pid", str(proc.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
    lines: list[bytes] = []  # its status lines, read all along (a full pipe stalls it)
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    threads: dict[str, float] = {}
    t0 = time.perf_counter()
    for at, data in frames[1:]:
        wait = t0 + at / speed - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        send(data)
    stdin.close()
    while reader.is_alive():
        try:
            now = thread_cpu(proc.pid)
        except OSError:  # it has exited
            now = {}
        for tid, (comm, cpu) in now.items():
            name = f"{comm} ({tid})"
            threads[name] = max(cpu, threads.get(name, 0.0))
        reader.join(0.05)
    if spy is not None:
        spy.wait(30)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    final = json.loads(lines[-1]) if lines else {}
    return {
        "cpu": usage.ru_utime + usage.ru_stime, "user": usage.ru_utime,
        "system": usage.ru_stime, "threads": threads, "wall": wall,
        "broker": (process_cpu(broker_pid) - broker0) if broker_pid else 0.0,
        "events": final.get("sent_events", 0), "envelopes": final.get("sent_envelopes", 0),
        "lost": final.get("lost_at_close", 0), "exit": status,
    }


@contextlib.contextmanager
def _base_tree(rev: str):
    root = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="blackbox-base-") as tmp:
        tree = pathlib.Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), rev],
                       check=True, capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force",
                            str(tree)], capture_output=True)


def replay(frames_path: pathlib.Path, sides: str, runs: int, base: str, speed: float,
           spy: pathlib.Path | None = None) -> None:
    frames = read_frames(frames_path)
    size = sum(len(d) for _, d in frames)
    print(f"{len(frames) - 1} frames, {size / 1e6:.1f} MB, {frames[-1][0]:.1f}s captured; "
          f"replayed at speed {speed}; {runs} run(s) a side, sides alternate ABBA")
    results: dict[str, list[dict]] = {s: [] for s in sides.split(",")}
    names = list(results)
    order = []
    for i in range(runs):
        order += names if i % 2 == 0 else names[::-1]
    with contextlib.ExitStack() as stack:
        paths = {}
        for side in names:
            if side == "new":
                paths[side] = []  # the installed (editable) tree
            else:
                tree = stack.enter_context(_base_tree(base))
                paths[side] = _installed_like(tree)
        for side in order:
            with local_broker() as broker:
                spy_to = None if spy is None else spy / f"{side}-{len(results[side])}.txt"
                r = replay_once(frames, paths[side], speed, _broker_pid(broker), spy_to)
            results[side].append(r)
            top = sorted(r["threads"].items(), key=lambda kv: -kv[1])[:3]
            print(f"  {side:5s} helper CPU {r['cpu']:6.2f}s (user {r['user']:.2f}, system "
                  f"{r['system']:.2f}), broker {r['broker']:5.2f}s, {r['events']:,} events in "
                  f"{r['envelopes']} envelopes, lost {r['lost']}, wall {r['wall']:.1f}s; "
                  + ", ".join(f"{k} {v:.2f}s" for k, v in top), flush=True)
    print("medians:")
    for side, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("cpu", "broker", "events")}
        per = 1e6 * med["cpu"] / max(med["events"], 1)
        print(f"  {side:5s} helper {med['cpu']:.2f}s ({per:.1f} µs an event), broker "
              f"{med['broker']:.2f}s, events {med['events']:,.0f}")
    if len(names) == 2:
        a, b = (statistics.median(r["cpu"] for r in results[s]) for s in names)
        print(f"  {names[1]}/{names[0]} helper CPU: {b / a:.3f}")


def _installed_like(tree: pathlib.Path) -> list[str]:
    """``[tree]``, with ``tree/dask_blackbox/<stage>`` linked to ``tree/<stage>``: on
    that sys.path ``dask_blackbox`` and its stages import from ``tree`` (the path
    finder comes before the editable install's finder), laid out as pyproject's
    package-dir lays out the installed package."""
    for stage in ("producers", "stream_processors", "sinks", "read", "cli"):
        link = tree / "dask_blackbox" / stage
        if not link.exists():
            link.symlink_to(tree / stage)
    return [str(tree)]


def collector(path: pathlib.Path, runs: int) -> None:
    """The ``collector`` step (module docstring)."""
    frames = read_frames(path)
    hello = relay.decode_frame(frames[0][1])
    hello.update(settings=producers.ProducerSettings.resolve(), producer_id="collector",
                 cluster_id=None)  # no identity: its sender never packs nor sends
    raw = [data for _, data in frames[1:]]
    events = sum(len(f[3]) + len(f[4]) for f in map(relay.decode_frame, raw))
    default = gc.get_threshold()  # CPython's, as this process has them
    sides = {"default": default, "helper": relay.HELPER_GC_THRESHOLDS}
    results: dict[str, list[float]] = {side: [] for side in sides}
    order = ["default", "helper", "helper", "default"]
    for i in range(runs * 2):
        side = order[i % 4]
        receiver = relay._Receiver(hello)
        transport, carry, packed = receiver.transport, deque(), 0
        gc.collect()
        gc.set_threshold(*sides[side])
        before = [g["collections"] for g in gc.get_stats()]
        t0 = time.perf_counter()
        for data in raw:
            receiver.apply(relay.decode_frame(data))
            while (envelope := transport._pack(carry)) is not None:
                packed += envelope[1]
        took = time.perf_counter() - t0
        after = [g["collections"] for g in gc.get_stats()]
        gc.set_threshold(*default)
        transport.close_blocking(time.monotonic() + 1)
        assert packed == events, (packed, events)
        results[side].append(took / events * 1e9)
        print(f"  {side:8s} {results[side][-1]:,.0f} ns an event, collections "
              f"{[b - a for a, b in zip(before, after)]}", flush=True)
    print(f"{events:,} events a run; medians: " + ", ".join(
        f"{side} {statistics.median(v):,.0f} ns" for side, v in results.items()))


def _broker_pid(broker) -> int | None:
    return broker.proc.pid if broker.proc is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("capture", "replay", "collector"))
    parser.add_argument("--shape", default="fresh40k")
    parser.add_argument("--frames", type=pathlib.Path, default=FRAMES)
    parser.add_argument("--sides", default="base,new")
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--spy", type=pathlib.Path,
                        help="a directory: py-spy records each helper there (raw format)")
    args = parser.parse_args()
    if args.step == "collector":
        collector(args.frames, args.runs)
    elif args.step == "capture":
        with local_broker(**{"optimization.fuse.active": False}):
            capture(args.shape, args.frames)
    else:
        if args.spy:
            args.spy.mkdir(parents=True, exist_ok=True)
        replay(args.frames, args.sides, args.runs, args.base, args.speed, args.spy)


if __name__ == "__main__":
    main()
