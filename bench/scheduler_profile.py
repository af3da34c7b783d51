"""Where the scheduler process's CPU goes, per thread, with and without the producers.

One run without (A) and one with dask-blackbox (B) of a ``scheduler_overhead.py``
shape, each on a fresh cluster whose scheduler is a process of its own; ``py-spy
record --threads --nonblocking -r 200 --format raw`` samples every thread of the
scheduler process (active samples only: CPU, not waiting) during the timed compute
and until the producer's buffer is delivered. Per-thread CPU seconds come from
``/proc/<pid>/task/*/stat`` over the same interval.

Printed per side: CPU seconds per thread; for each thread with samples, where its
samples go by category (the producers' hooks on the event loop, the sender's build,
encode, Kafka I/O, asyncio plumbing, ...) and the heaviest frames by self time. The
raw py-spy files are kept (path printed) for ``speedscope`` or flamegraph.pl.

Run: ``nice -n 5 python bench/scheduler_profile.py [--shape 32k] [--sides AB]``
(needs ``pip install py-spy``).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from dask_blackbox import producers
from local_broker import local_broker
from process_cluster import cpu_by_thread, process_cluster, process_cpu, thread_cpu, thread_names
from scheduler_overhead import SHAPES, _wait_delivered

#: (category, regex on one frame "function (file:line)"); the frame nearest the leaf
#: that matches any of them decides a sample's category (first pattern wins).
CATEGORIES = [
    ("producers hook: transition", r"^\S*transition \(.*producers/scheduler\.py"),
    ("producers hook: update_graph", r"^\S*update_graph\S* \(.*producers/scheduler\.py"),
    ("producers hook: offer", r"^\S*(offer|push_transition) \(.*producers/transport\.py"),
    ("producers: log handler", r"producers/logs\.py"),
    ("relay: hand-over (frame encoding, pipe write)",
     r"^\S*(_encoded|encode_frame|write|write_frame|_hand_over) \(.*producers/relay\.py"),
    ("relay: status lines", r"^\S*(_read_status|_status) \(.*producers/relay\.py"),
    ("relay: rows", r"producers/relay\.py"),
    ("sender: build events", r"(producers/events\.py|producers/encode\.py|contract\.py|"
     r"_graph_event|_structured_event|_annotation_summary|^\S*ready \()"),
    ("sender: encode (orjson)", r"^\S*_encode\w* \(.*producers/"),
    ("producers: other hooks, metrics", r"producers/scheduler\.py"),
    ("sender: pack, loop", r"producers/"),
    ("sender: compression", r"aiokafka/codec\.py"),
    ("sender: socket send (and GIL re-acquire)", r"^\S*_SelectorSocketTransport\.write \("),
    ("sender: Kafka client", r"aiokafka/"),
    ("Dask", r"(distributed/|dask/|tornado/|msgpack|toolz|tlz)"),
    ("asyncio", r"(asyncio/|selectors\.py)"),
]
_COMPILED = [(name, re.compile(p)) for name, p in CATEGORIES]
#: Categories a sample belongs to if any of its frames matches (the hooks).
_ANYWHERE = _COMPILED[:3]
#: A sample whose leaf is one of these is a thread waiting, not working.
IDLE_LEAVES = re.compile(r"^\S*(select|wait|sleep|_wait_for_tstate_lock|acquire) \(")


def categorize(frames: list[str]) -> str:
    """The category of one sample (``frames`` root first): a producers hook if any
    frame is one, else the category of the frame nearest the leaf that has one."""
    if frames and IDLE_LEAVES.search(frames[-1]):
        return "idle"
    for name, rx in _ANYWHERE:
        if any(rx.search(frame) for frame in frames):
            return name
    for frame in reversed(frames):
        for name, rx in _COMPILED:
            if rx.search(frame):
                return name
    return "other"


def parse_raw(path: pathlib.Path) -> dict[str, list[tuple[list[str], int]]]:
    """``{thread label: [(frames root first, count), ...]}`` from py-spy's raw output."""
    out: dict[str, list] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0]
        out[thread].append((frames[1:], int(count)))
    return out


def profile(shape_name: str, with_blackbox: bool, rate: int, outdir: pathlib.Path) -> None:
    shape = SHAPES[shape_name]
    side = "B with" if with_blackbox else "A without"
    with process_cluster(2, shape.scheduler_config) as (client, pid):
        if with_blackbox:
            producers.attach(client)
        (shape.warm_up or shape.compute)(client)
        if with_blackbox:
            client.run_on_scheduler(_wait_delivered)
        raw = outdir / f"{shape_name}-{'B' if with_blackbox else 'A'}.txt"
        spy = subprocess.Popen(
            ["py-spy", "record", "--threads", "--nonblocking", "-r", str(rate),
             "--format", "raw", "-o", str(raw), "--pid", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)
        names = thread_names(client)
        before, cpu0 = thread_cpu(pid), process_cpu(pid)
        t0 = time.perf_counter()
        n = shape.compute(client)
        wall = time.perf_counter() - t0
        if with_blackbox:
            client.run_on_scheduler(_wait_delivered)
        after, cpu1 = thread_cpu(pid), process_cpu(pid)
        names.update(thread_names(client))
        spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
        spy.wait(60)
    threads = cpu_by_thread(before, after, names)
    print(f"\n=== {shape_name} ({n:,} tasks), {side} dask-blackbox: wall {wall:.2f}s, "
          f"scheduler-process CPU {cpu1 - cpu0:.2f}s; py-spy raw: {raw}")
    for label, cpu in sorted(threads.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.01:
            print(f"  {label[:40]:40s} {cpu:7.2f}s CPU")
    if not raw.exists():
        print("  (py-spy wrote nothing)")
        return
    samples = parse_raw(raw)
    by_tid = {int(re.search(r"\((\d+)\)", t).group(1)): t for t in samples}
    for tid, thread in by_tid.items():
        stacks = samples[thread]
        cats: collections.Counter = collections.Counter()
        selfs: collections.Counter = collections.Counter()
        for frames, count in stacks:
            cat = categorize(frames)
            cats[cat] += count
            if cat != "idle" and frames:
                selfs[frames[-1]] += count
        busy = sum(c for k, c in cats.items() if k != "idle")
        cpu = (after.get(tid, ("", 0.0))[1] - before.get(tid, ("", 0.0))[1])
        if busy < rate * 0.05 or cpu < 0.05:
            continue
        print(f"  -- {thread}: {cpu:.2f}s CPU; {busy} busy samples, shares scaled to "
              "its CPU seconds:")
        for cat, c in cats.most_common():
            if cat != "idle":
                print(f"     {100 * c / busy:5.1f}%  {cpu * c / busy:6.2f}s  {cat}")
        print("     heaviest frames (self):")
        for frame, c in selfs.most_common(10):
            print(f"     {100 * c / busy:5.1f}%  {frame[:110]}")


def summarize_raw(raw: pathlib.Path) -> None:
    """Shares of busy samples per category for each thread of one raw file."""
    print(f"=== {raw}")
    for thread, stacks in parse_raw(raw).items():
        cats: collections.Counter = collections.Counter()
        for frames, count in stacks:
            cats[categorize(frames)] += count
        busy = sum(c for k, c in cats.items() if k != "idle")
        if busy >= 50:
            print(f"  {thread}: {busy} busy samples: " + ", ".join(
                f"{cat} {100 * c / busy:.1f}%" for cat, c in cats.most_common() if cat != "idle"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="32k", choices=list(SHAPES))
    parser.add_argument("--sides", default="AB", help="A, B or AB")
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--analyze", nargs="*", type=pathlib.Path,
                        help="only summarize these py-spy raw files (shares of samples)")
    args = parser.parse_args()
    if args.analyze:
        for raw in args.analyze:
            summarize_raw(raw)
        return
    outdir = args.out or pathlib.Path(tempfile.mkdtemp(prefix="blackbox-profile-"))
    outdir.mkdir(parents=True, exist_ok=True)
    for side in args.sides:
        profile(args.shape, side == "B", args.rate, outdir)


if __name__ == "__main__":
    if "--analyze" in sys.argv:
        main()
        sys.exit()
    with local_broker(**{"optimization.fuse.active": False}):
        main()
