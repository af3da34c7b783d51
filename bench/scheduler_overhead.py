"""What recording costs a busy Dask cluster: wall time, the scheduler process's CPU and
the whole process tree's CPU, with and without the producers, A/B in ABBA/BAAB quads.

    nice -n 5 python bench/scheduler_overhead.py [--quads 4] [--shapes fresh40k,32k]
                                                 [--scheduler in,own] [--quick]
                                                 [--recorder producers|least]

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
producers' helper process, the scheduler of ``own``) but the broker. Figures: per
quad, B's sum over A's sum for wall, scheduler-process CPU and tree CPU; their medians
over quads (targets: wall <= 1.03, scheduler CPU <= 1.05, tree CPU <= 1.05). A quad
one of whose runs lost a worker or did not finish within ``WAIT_DEADLINE`` runs again
(and says so).

With ``in``, each B run also prints the CPU of the recorder's own threads in the
scheduler process (from ``/proc/self/task``: the relay, its status reader, the
nannies' senders) and of the producers' helper process, and a figure gives the
threads' sum over A's scheduler-process CPU: the machine's load does not blur it as
it blurs the difference of A and B. What the recorder adds on Dask's event loop (the
hooks, the nannies' watch) is not in it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

import dask
import dask.array as da
import orjson
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_blackbox import producers
from dask_blackbox.contract import TRANSITION_KWARGS
from dask_blackbox.producers.sender import THREAD_PREFIX
from local_broker import local_broker
from process_cluster import process_cluster, process_cpu
from report import report

SHAPES = {
    "fresh40k": ((2000, 20, "affine"), {}),
    "32k": ((3100, 20, "inc"), {"distributed.scheduler.worker-saturation": "inf"}),
}
WAIT_DEADLINE = 600.0


def graph(side: int, chunks: int, kind: str):
    x = da.ones((side, side), chunks=chunks)
    return ((x * 2 + 1) if kind == "affine" else (x + 1)).sum()


class LeastRecorder(SchedulerPlugin):
    """Per call of Dask's transition hook, a tuple of the record's fields (the task's
    group, Dask's kwargs as JSON) appended to a deque that a thread empties every half
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
                              orjson.dumps(tuple(map(kwargs.get, TRANSITION_KWARGS)))
                              if kwargs else None))


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


def _helpers(pids: list[int]) -> list[int]:
    """The producers' helper processes among ``pids``."""
    import psutil

    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if "producers.relay" in " ".join(psutil.Process(pid).cmdline()):
                found.append(pid)
    return found


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
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = names.get(int(tid), "other")
        out[name] = out.get(name, 0.0) + seconds
    return out


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
    helper_cpu: float


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
          recorder: str = "producers") -> Run:
    (side, chunks, kind), config = SHAPES[shape]
    with dask.config.set({"optimization.fuse.active": False}), cluster(placement, config) as (
            client, scheduler, on_scheduler):
        client.compute(graph(400, chunks, kind), optimize_graph=False).result(WAIT_DEADLINE)  # warm-up
        _wait(on_scheduler, _settled)
        if recorded and recorder == "least":
            client.register_plugin(LeastRecorder())
        elif recorded:
            producers.attach(client)
        timed_graph = graph(side, chunks, kind)
        n_tasks = len(timed_graph.__dask_graph__())
        pids = _tree({broker_pid})
        helpers = _helpers(pids)
        threads0 = _thread_cpu()
        cpu0, tree0, helper0, t0 = (_cpu([scheduler]), _cpu(pids), _cpu(helpers),
                                    time.perf_counter())
        assert client.compute(timed_graph, optimize_graph=False).result(WAIT_DEADLINE) > 0
        _wait(on_scheduler, _settled)
        lost = on_scheduler(_removed)
        if lost:
            raise RunLost(f"{len(lost)} worker(s) removed during the run: {', '.join(lost)}")
        if recorded:
            _wait(on_scheduler, _delivered, on_scheduler(_accepted))
        wall = time.perf_counter() - t0
        threads = _recorder_threads(threads0, _thread_cpu()) if placement == "in" else {}
        helper_cpu = _cpu(helpers) - helper0
        pids = sorted(set(pids) | set(_tree({broker_pid})))
        return Run(recorded, wall, _cpu([scheduler]) - cpu0, _cpu(pids) - tree0, n_tasks,
                   threads, helper_cpu)


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
                                              args.recorder))
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
                        if r.recorded and args.recorder == "producers":
                            threads = ", ".join(f"{name} {seconds:.2f}s" for name, seconds
                                                in sorted(r.recorder_threads.items()))
                            print(f"  recorder threads in the scheduler process: {threads}; "
                                  if threads else "  ", end="")
                            print(f"the helper process {r.helper_cpu:.2f}s", flush=True)
                name = f"{shape} ({quads[0][0].tasks:,} tasks), scheduler {placement}"
                if args.recorder == "least":
                    name += ", B the least recorder"
                for figure, label, target in (("wall", "wall", 1.03),
                                              ("scheduler_cpu", "scheduler-process CPU", 1.05),
                                              ("tree_cpu", "process-tree CPU", 1.05)):
                    per_quad = [ratio(runs, figure) for runs in quads]
                    report(f"{name}: {label} with/without, median of {len(quads)} quads "
                           f"({', '.join(f'{r:.3f}' for r in per_quad)})",
                           round(statistics.median(per_quad), 3), "x", target)
                if placement == "in" and args.recorder == "producers":
                    shares = [sum(sum(r.recorder_threads.values()) for r in runs if r.recorded)
                              / sum(r.scheduler_cpu for r in runs if not r.recorded)
                              for runs in quads]
                    report(f"{name}: the recorder's threads' CPU over A's scheduler-process "
                           f"CPU, median of {len(quads)} quads", round(statistics.median(shares), 4),
                           "x", None)


if __name__ == "__main__":
    main()
