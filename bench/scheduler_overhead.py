"""What recording costs a busy Dask cluster: wall time, the scheduler process's CPU and
the whole process tree's CPU, with and without the producers, A/B in ABBA/BAAB quads.

    nice -n 5 python bench/scheduler_overhead.py [--quads 4] [--shapes fresh40k,32k]
                                                 [--scheduler in,own] [--quick]
                                                 [--recorder producers|least]
                                                 [--no-hook-sample]

Each run is a fresh cluster of two single-thread worker processes (with nannies) on
a bare local Tansu broker that nothing consumes, warmed up with a small graph, then
timed on one graph:

- ``fresh40k``: ``(ones((2000, 2000), chunks=20) * 2 + 1).sum()`` unoptimized (fusion
  off): 40,003 tasks, elementwise then a sum;
- ``32k``: ``(ones((3100, 3100), chunks=20) + 1).sum()``, worker-saturation inf.

B attaches the producers (``producers.attach``: scheduler, worker and nanny plugins,
log shipping) to the fresh cluster before the timed graph; with ``--recorder least``,
:class:`LeastRecorder` instead: about the least a recorder of every transition can do
in Dask's process, a bound for what the producers can cost. The timed window runs
from the compute call until the scheduler has forgotten the graph's tasks and, in B,
until the producers have delivered everything they accepted (their work counts).

Two placements of the scheduler (``--scheduler``):

- ``in``: in this process, with the client (``LocalCluster(processes=True)``), as a
  notebook runs it: the scheduler process's CPU is this process's (scheduler, client,
  nannies, the recorder's threads);
- ``own``: in a process of its own (``dask scheduler``), the client here: the
  scheduler process's CPU is that process's alone.

The process tree is this process and every process under it (workers, nannies, the
scheduler of ``own``) but the broker. Figures: per
quad, B's sum over A's sum for wall, scheduler-process CPU and tree CPU; their medians
over quads (targets, :data:`TARGETS`: on fresh40k wall <= 1.02, scheduler CPU and tree
CPU <= 1.03; on 32k 1.03 / 1.05 / 1.05, and B's excess over ``--recorder least``). A quad
one of whose runs lost a worker or did not finish within ``WAIT_DEADLINE`` runs again
(and says so).

With ``in``, each B run also prints the recorder's CPU per recorded transition, per
part, from thread CPU clocks (the machine's load does not blur them as it blurs the
difference of A and B):

- ``hook``: the scheduler plugin's ``transition``, one call in :data:`HOOK_EVERY`
  timed with the thread CPU clock (``time.thread_time``, the clock's own cost
  subtracted), times the calls; a timed call during which the collector ran is left
  out (the collection is the whole process's allocations' doing, and one of them would
  count :data:`HOOK_EVERY` times over); ``gc``: the collector's CPU in this process
  (``gc.callbacks``, :class:`GcClock`), B's less A's, per transition, and the same
  estimated from the collections B made beyond A's, by generation, at a collection's
  mean cost (the count moves with what the recorder allocates; the cost of a
  generation-2 collection with the heap's size when it runs, which makes the
  difference of CPU times noisy);
- ``take``, ``encode``, ``send``: the scheduler's sender thread as it counts itself
  (``Sender.stats``: taking items and making the rows of all but transitions; captures
  and MessagePack; aiokafka), and ``sender`` that thread's whole CPU
  (``/proc/self/task``: its sleeps and wake-ups too);
- ``nanny``: the nannies' sender threads (in this process);
- ``sender_gc``, ``nanny_gc``: the collector's CPU inside those threads (in ``sender``
  and ``nanny``): a collection runs in the thread whose allocation set it off and
  scans the whole heap, most of it Dask's;
- ``workers``: the workers' sender threads (in theirs, through ``client.run``).

and their sum over A's scheduler-process CPU. "All parts" is printed twice: as the
threads clock them, and with the collector counted once (its time in the recorder's
threads replaced by ``gc``, the whole process's collector time B less A). The
per-transition figures divide by the transitions the scheduler's hook saw (at least 200k over a run of fresh40k and 32k's
quads). What the recorder adds on Dask's event loop besides the hook (the nannies'
watch, the collector's work on what the hook allocates) is not in them.
``--no-hook-sample`` leaves the hook untimed (its wrapper adds a Python call to each
of Dask's calls of the hook).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

import dask
import dask.array as da
import msgspec
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_blackbox import producers
from dask_blackbox.contract import TRANSITION_KWARGS
from dask_blackbox.producers.sender import THREAD_PREFIX
from dask_blackbox.producers.scheduler import PLUGIN_NAME
from local_broker import local_broker
from process_cluster import process_cluster, process_cpu
from report import report

SHAPES = {
    "fresh40k": ((2000, 20, "affine"), {}),
    "32k": ((3100, 20, "inc"), {"distributed.scheduler.worker-saturation": "inf"}),
}
#: Each shape's bars for B over A: wall, scheduler-process CPU, process-tree CPU.
TARGETS = {"fresh40k": (1.02, 1.03, 1.03), "32k": (1.03, 1.05, 1.05)}
WAIT_DEADLINE = 600.0
_encode = msgspec.msgpack.Encoder().encode
#: One call of the transition hook in this many is timed.
HOOK_EVERY = 32


def graph(side: int, chunks: int, kind: str):
    x = da.ones((side, side), chunks=chunks)
    return ((x * 2 + 1) if kind == "affine" else (x + 1)).sum()


class LeastRecorder(SchedulerPlugin):
    """Per call of Dask's transition hook, a tuple of the record's fields (the task's
    group, Dask's kwargs as MessagePack) appended to a deque that a thread empties every half
    second, discarding what it takes: no buffer rule, no rows, nothing sent."""

    name = "dask-blackbox"  # found where the producers' plugin is
    accepted_events = 0

    def __init__(self):
        self.transport = self  # what the bench asks the producers' transport

    def delivered(self, accepted: int) -> bool:
        return True

    async def start(self, scheduler) -> None:
        self._records: deque = deque()
        self._get, self._log = scheduler.tasks.get, scheduler.transition_log
        self.stopped = threading.Event()
        threading.Thread(target=self._empty, daemon=True).start()

    async def close(self) -> None:
        self.stopped.set()

    def _empty(self) -> None:
        take = self._records.popleft
        while not self.stopped.wait(0.5):
            for _ in range(len(self._records)):
                take()

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        ts = self._get(key)
        self._records.append((key, start, finish, stimulus_id, self._log[-1][5],
                              None if ts is None else ts.group,
                              _encode(tuple(map(kwargs.get, TRANSITION_KWARGS)))
                              if kwargs else None))


@dataclass
class Tally:
    """Collections and their CPU seconds."""

    collections: int = 0
    seconds: float = 0.0

    def __sub__(self, earlier: Tally) -> Tally:
        return Tally(self.collections - earlier.collections, self.seconds - earlier.seconds)


def _totals(tallies) -> Tally:
    """The sum of ``tallies`` (any iterable)."""
    tallies = list(tallies)
    return Tally(sum(t.collections for t in tallies), sum(t.seconds for t in tallies))


class GcClock:
    """The collector's collections and CPU seconds in this process (``gc.callbacks``;
    a collection holds the GIL, so the thread clock of the thread running it counts it
    whole and nothing else), by generation and by the name of the thread that ran them
    (a collection runs in whichever thread's allocation set it off, so a thread's CPU
    clock counts the collections it happened to start: work on the whole process's
    heap, most of it Dask's)."""

    def __init__(self):
        #: by thread name, a :class:`Tally` a generation
        self.by_thread: dict[str, list[Tally]] = {}
        #: all collections so far: what :class:`HookSampler` reads around each timed
        #: call, kept as a counter so that reading it costs Dask's event loop nothing
        self.collections = 0
        self._began = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.thread_time()
            return
        took = time.thread_time() - self._began
        self.collections += 1
        name = threading.current_thread().name
        tally = self.by_thread.setdefault(name, [Tally() for _ in range(3)])[info["generation"]]
        tally.collections += 1
        tally.seconds += took

    def by_generation(self, prefix: str = "") -> list[Tally]:
        """A :class:`Tally` a generation so far, of the threads named ``prefix``..."""
        mine = [v for k, v in self.by_thread.items() if k.startswith(prefix)]
        return [_totals(t[g] for t in mine) for g in range(3)]


GC = GcClock()


class HookSampler:
    """Stands for a plugin's ``transition``: calls it, and times one call in
    :data:`HOOK_EVERY` with the thread CPU clock (less the clock's own cost)."""

    def __init__(self, hook):
        self.hook = hook
        self.calls = self.sampled = 0
        self.seconds = 0.0
        clock = time.thread_time
        self.clock_cost = statistics.median(-clock() + clock() for _ in range(2001))

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls % HOOK_EVERY:
            return self.hook(*args, **kwargs)
        collections = GC.collections
        t0 = time.thread_time()
        self.hook(*args, **kwargs)
        t1 = time.thread_time()
        if GC.collections == collections:
            self.seconds += t1 - t0 - self.clock_cost
            self.sampled += 1

    @property
    def total(self) -> float:
        """The hook's CPU seconds over all calls (estimated from the timed ones)."""
        return self.seconds / self.sampled * self.calls if self.sampled else 0.0


def _sample_hook(dask_scheduler) -> None:
    plugin = dask_scheduler.plugins[PLUGIN_NAME]
    plugin.transition = HookSampler(plugin.transition)


def _scheduler_parts(dask_scheduler) -> dict:
    plugin = dask_scheduler.plugins[PLUGIN_NAME]
    stats = plugin.transport.drain.stats()
    hook = plugin.transition
    out = {part: stats[f"cpu_{part}"] for part in ("take", "encode", "send")}
    out["envelopes"] = stats["sent_envelopes"]
    if isinstance(hook, HookSampler):
        out.update(hook=hook.total, transitions=hook.calls)
    return out


def _worker_sender_cpu(dask_worker) -> float:
    """CPU seconds of this worker process's recorder threads."""
    return sum(_thread_cpu_here(THREAD_PREFIX).values())


def _thread_cpu_here(prefix: str = "") -> dict[str, float]:
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        name = names.get(int(tid), "other")
        if not name.startswith(prefix):
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[name] = out.get(name, 0.0) + int(f.read().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


class RunLost(Exception):
    """A run lost a worker or did not finish in time: its quad is run again."""


def _removed(dask_scheduler) -> list[str]:
    """The stimulus of each worker removal since the scheduler started (a run that
    loses a worker is not the shape measured)."""
    return [str(msg.get("stimulus_id", "?")) for _, msg in dask_scheduler.get_events("all")
            if isinstance(msg, dict) and msg.get("action") == "remove-worker"]


def _settled(dask_scheduler) -> bool:
    return not dask_scheduler.tasks


def _delivered(target, dask_scheduler) -> bool:
    return dask_scheduler.plugins["dask-blackbox"].transport.delivered(target)


def _accepted(dask_scheduler) -> int:
    return dask_scheduler.plugins["dask-blackbox"].transport.accepted_events


def _wait(on_scheduler, function, *args) -> None:
    """Poll ``function`` on the scheduler until true: the poll costs both sides alike
    (and nearly nothing: a direct call in process, a request every 0.2 s otherwise)."""
    deadline = time.monotonic() + WAIT_DEADLINE
    while not on_scheduler(function, *args):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{function.__name__} not reached within {WAIT_DEADLINE:.0f}s")
        time.sleep(0.05)


def _tree(exclude: set[int]) -> list[int]:
    """This process and its descendants but ``exclude``."""
    import psutil

    me = psutil.Process()
    return [me.pid] + [p.pid for p in me.children(recursive=True) if p.pid not in exclude]


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads by name (one name may be many)."""
    return _thread_cpu_here()


def _recorder_threads(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name.removeprefix(THREAD_PREFIX): seconds - before.get(name, 0.0)
            for name, seconds in after.items() if name.startswith(THREAD_PREFIX)}


@dataclass
class Run:
    recorded: bool
    wall: float
    scheduler_cpu: float
    tree_cpu: float
    tasks: int
    recorder_threads: dict[str, float]
    #: the recorder's CPU seconds per part (module docstring), and ``transitions``
    parts: dict[str, float]
    #: the collector in this process during the run, a :class:`Tally` a generation
    gc_generations: tuple = ()

    @property
    def gc_seconds(self) -> float:
        """The collector's CPU seconds in this process during the run."""
        return _totals(self.gc_generations).seconds


@contextlib.contextmanager
def cluster(placement: str, config: dict):
    """``(client, scheduler pid, on_scheduler)`` of a fresh cluster of two
    single-thread workers; ``on_scheduler(function, *args)`` calls ``function(*args,
    dask_scheduler)`` there."""
    if placement == "own":
        with process_cluster(2, config) as (client, pid):
            def remote(function, *args):
                time.sleep(0.15)
                return client.run_on_scheduler(function, *args)
            yield client, pid, remote
        return
    with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, memory_limit=0,
            dashboard_address=":0") as local, Client(local) as client:
        yield client, os.getpid(), lambda function, *args: function(
            *args, dask_scheduler=local.scheduler)


def timed(placement: str, shape: str, recorded: bool, broker_pid: int,
          recorder: str = "producers", sample_hook: bool = True) -> Run:
    (side, chunks, kind), config = SHAPES[shape]
    with dask.config.set({"optimization.fuse.active": False}), cluster(placement, config) as (
            client, scheduler, on_scheduler):
        client.compute(graph(400, chunks, kind), optimize_graph=False).result(WAIT_DEADLINE)  # warm-up
        _wait(on_scheduler, _settled)
        if recorded and recorder == "least":
            client.register_plugin(LeastRecorder())
        elif recorded:
            producers.attach(client)
        parts_here = recorded and recorder == "producers" and placement == "in"
        if parts_here and sample_hook:
            on_scheduler(_sample_hook)
        timed_graph = graph(side, chunks, kind)
        n_tasks = len(timed_graph.__dask_graph__())
        pids = _tree({broker_pid})
        threads0 = _thread_cpu()
        if parts_here:
            parts0 = on_scheduler(_scheduler_parts)
            workers0 = client.run(_worker_sender_cpu)
        cpu0, tree0, t0 = _cpu([scheduler]), _cpu(pids), time.perf_counter()
        sender, nanny = THREAD_PREFIX + "scheduler-", THREAD_PREFIX + "nanny-"
        gc0, sender_gc0, nanny_gc0 = (GC.by_generation(), GC.by_generation(sender),
                                      GC.by_generation(nanny))
        assert client.compute(timed_graph, optimize_graph=False).result(WAIT_DEADLINE) > 0
        _wait(on_scheduler, _settled)
        lost = on_scheduler(_removed)
        if lost:
            raise RunLost(f"{len(lost)} worker(s) removed during the run: {', '.join(lost)}")
        if recorded:
            _wait(on_scheduler, _delivered, on_scheduler(_accepted))
        wall = time.perf_counter() - t0
        threads = _recorder_threads(threads0, _thread_cpu()) if placement == "in" else {}
        parts: dict[str, float] = {}
        if parts_here:
            now = on_scheduler(_scheduler_parts)
            parts = {part: now[part] - parts0.get(part, 0) for part in now}
            parts["sender"] = sum(v for k, v in threads.items() if k.startswith("scheduler-"))
            parts["nanny"] = sum(v for k, v in threads.items() if k.startswith("nanny-"))
            sender_gc = [t - before for t, before in zip(GC.by_generation(sender), sender_gc0)]
            parts["sender_gc"] = _totals(sender_gc).seconds
            parts["sender_collections"] = _totals(sender_gc).collections
            parts["sender_collections_2"] = sender_gc[2].collections
            parts["nanny_gc"] = (_totals(GC.by_generation(nanny)) - _totals(nanny_gc0)).seconds
            workers = client.run(_worker_sender_cpu)
            parts["workers"] = sum(workers[w] - workers0.get(w, 0.0) for w in workers)
        generations = tuple(t - before for t, before in zip(GC.by_generation(), gc0))
        pids = sorted(set(pids) | set(_tree({broker_pid})))
        return Run(recorded, wall, _cpu([scheduler]) - cpu0, _cpu(pids) - tree0, n_tasks,
                   threads, parts, generations)


def ratio(runs: list[Run], figure: str) -> float:
    b = sum(getattr(r, figure) for r in runs if r.recorded)
    a = sum(getattr(r, figure) for r in runs if not r.recorded)
    return b / a


def quad(q: int) -> tuple[bool, ...]:
    return (False, True, True, False) if q % 2 == 0 else (True, False, False, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quads", type=int, default=4)
    parser.add_argument("--shapes", default="fresh40k,32k")
    parser.add_argument("--scheduler", default="in,own", help="in, own, or both")
    parser.add_argument("--quick", action="store_true", help="1 quad of fresh40k, in process")
    parser.add_argument("--recorder", choices=("producers", "least"), default="producers",
                        help="what B attaches (module docstring)")
    parser.add_argument("--no-hook-sample", action="store_true",
                        help="leave the transition hook untimed (module docstring)")
    args = parser.parse_args()
    if args.quick:
        args.quads, args.shapes, args.scheduler = 1, "fresh40k", "in"
    with local_broker() as broker:
        broker_pid = broker.proc.pid
        for shape in args.shapes.split(","):
            for placement in args.scheduler.split(","):
                quads: list[list[Run]] = []
                while len(quads) < args.quads:
                    q = len(quads)
                    runs = []
                    try:
                        for recorded in quad(q):
                            runs.append(timed(placement, shape, recorded, broker_pid,
                                              args.recorder, not args.no_hook_sample))
                    except (RunLost, TimeoutError) as e:
                        print(f"{shape} scheduler {placement} quad {q + 1}: run {len(runs) + 1} "
                              f"({'B' if quad(q)[len(runs)] else 'A'}) was lost at "
                              f"{time.strftime('%H:%M:%S')} ({e}); the quad runs again", flush=True)
                        continue
                    quads.append(runs)
                    print(f"{shape} scheduler {placement} quad {q + 1}: " + ", ".join(
                        f"{'B' if r.recorded else 'A'} {r.wall:.1f}s wall {r.scheduler_cpu:.1f}s "
                        f"sched {r.tree_cpu:.1f}s tree" for r in runs) + " -> wall "
                        f"{ratio(runs, 'wall'):.3f} sched {ratio(runs, 'scheduler_cpu'):.3f} "
                        f"tree {ratio(runs, 'tree_cpu'):.3f}", flush=True)
                    for r in runs:
                        if r.recorded and r.parts:
                            print("  " + _parts_text(r.parts), flush=True)
                    if placement == "in":
                        print("  the collector in this process: " + ", ".join(
                            f"{'B' if r.recorded else 'A'} {r.gc_seconds:.2f}s ("
                            + " / ".join(f"{t.collections} in {t.seconds:.2f}s"
                                         for t in r.gc_generations)
                            + ")" for r in runs) + " (collections by generation 0 / 1 / 2)",
                            flush=True)
                name = f"{shape} ({quads[0][0].tasks:,} tasks), scheduler {placement}"
                if args.recorder == "least":
                    name += ", B the least recorder"
                for (figure, label), target in zip((
                        ("wall", "wall"), ("scheduler_cpu", "scheduler-process CPU"),
                        ("tree_cpu", "process-tree CPU")), TARGETS[shape]):
                    per_quad = [ratio(runs, figure) for runs in quads]
                    report(f"{name}: {label} with/without, median of {len(quads)} quads "
                           f"({', '.join(f'{r:.3f}' for r in per_quad)})",
                           round(statistics.median(per_quad), 3), "x", target)
                if placement == "in" and args.recorder == "producers":
                    recorded = [r for runs in quads for r in runs if r.recorded]
                    n = sum(r.parts.get("transitions", 0) for r in recorded)
                    for part in _PARTS:
                        seconds = sum(r.parts.get(part, 0.0) for r in recorded)
                        report(f"{name}: recorder CPU per transition, {part} ({n:,} "
                               f"transitions, {len(recorded)} runs)",
                               round(seconds / n * 1e6, 3) if n else None, "us", None)
                    extra_gc = sum(r.gc_seconds if r.recorded else -r.gc_seconds
                                   for runs in quads for r in runs)
                    report(f"{name}: the collector's extra CPU per transition, B less A "
                           f"({n:,} transitions)", round(extra_gc / n * 1e6, 3) if n else None,
                           "us", None)
                    runs_all = [r for runs in quads for r in runs]
                    counts = [sum(r.gc_generations[g].collections * (1 if r.recorded else -1)
                                  for r in runs_all) for g in range(3)]
                    all_runs = [_totals(r.gc_generations[g] for r in runs_all) for g in range(3)]
                    mean_cost = [t.seconds / max(t.collections, 1) for t in all_runs]
                    by_count = sum(c * t for c, t in zip(counts, mean_cost))
                    report(f"{name}: the collector's extra collections, B less A, by "
                           f"generation {' / '.join(f'{c:+d}' for c in counts)} (a collection "
                           f"{' / '.join(f'{t * 1e3:.2f}' for t in mean_cost)} ms), at their "
                           f"mean cost, per transition", round(by_count / n * 1e6, 3) if n else None,
                           "us", None)
                    total = sum(_recorder_total(r.parts) for r in recorded)
                    report(f"{name}: recorder CPU per transition, all parts as their threads "
                           f"clock them ({n:,} transitions)",
                           round(total / n * 1e6, 3) if n else None, "us", None)
                    own = total - sum(_collector_in_threads(r.parts) for r in recorded) + extra_gc
                    report(f"{name}: recorder CPU per transition, all parts, the collector "
                           f"counted once: its time in the recorder's threads replaced by its "
                           f"extra time, B less A ({n:,} transitions)",
                           round(own / n * 1e6, 3) if n else None, "us", 5.0)
                    shares = [sum(_recorder_total(r.parts) for r in runs if r.recorded)
                              / sum(r.scheduler_cpu for r in runs if not r.recorded)
                              for runs in quads]
                    report(f"{name}: the recorder's CPU (all parts) over A's scheduler-process "
                           f"CPU, median of {len(quads)} quads", round(statistics.median(shares), 4),
                           "x", None)


#: The parts of the recorder's CPU printed per transition (module docstring).
_PARTS = ("hook", "take", "encode", "send", "sender", "sender_gc", "nanny", "nanny_gc",
          "workers")


def _collector_in_threads(parts: dict[str, float]) -> float:
    """The collector's seconds inside the recorder's threads of this process (in
    ``sender`` and ``nanny``): collections their allocations set off, on the whole heap."""
    return parts.get("sender_gc", 0.0) + parts.get("nanny_gc", 0.0)


def _recorder_total(parts: dict[str, float]) -> float:
    """The recorder's CPU seconds: the hook, the scheduler's sender thread (take,
    encode and send are in it), the nannies' and the workers' senders."""
    return sum(parts.get(p, 0.0) for p in ("hook", "sender", "nanny", "workers"))


def _parts_text(parts: dict[str, float]) -> str:
    n = parts.get("transitions", 0)
    per = ", ".join(f"{p} {parts[p] / n * 1e6:.2f}" for p in _PARTS if p in parts) if n else ""
    return (f"recorder CPU: {', '.join(f'{p} {parts[p]:.3f}s' for p in _PARTS if p in parts)}; "
            f"per transition ({n:,}), us: {per}; all {_recorder_total(parts) / max(n, 1) * 1e6:.2f}; "
            f"{parts.get('envelopes', 0):,} envelopes, {n / max(parts.get('envelopes', 0), 1):,.0f} "
            f"transitions each; the collector ran {parts.get('sender_collections', 0):,} times in "
            f"the sender thread ({parts.get('sender_collections_2', 0):,} of generation 2)")


if __name__ == "__main__":
    main()
