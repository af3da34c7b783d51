"""What recording Dask's profiles, and the nanny's pings, cost the workers: CPU
seconds of the worker processes per task, A/B(/C) in one invocation.

    nice -n 5 python bench/profile_cost.py [--runs 3] [--tasks 12000] [--task-ms 1]
                                           [--no-pings-route] [--quick]

Each run is a fresh ``LocalCluster(processes=True)`` of two single-thread worker
processes with nannies, the producers attached (``producers.attach``: scheduler, worker
and nanny plugins) and recording to a bare local Tansu broker that nothing consumes
(:mod:`scheduler_overhead`'s broker and clocks), warmed up, then timed on ``--tasks``
small tasks of about ``--task-ms`` of pure-Python work each (the iterations for it
measured once an invocation, here: the same in every run of it), in four task prefixes
(so Dask's profiler keeps a tree per prefix), with Dask's profile defaults (a sample
every 10 ms, a cycle every 1 s). The routes, alternating run by run:

- ``A``: ``producer.record.profiles`` off;
- ``B``: on (the worker plugin publishes the cycles every ``PROFILE_CYCLES`` cycles);
- ``C`` (unless ``--no-pings-route``): profiles off and the nanny's pings off. There
  is no setting for the pings: the nannies of a LocalCluster live in this process, so
  the route sets :data:`dask_blackbox.producers.nanny.PING_INTERVAL` to infinity here.

Measured per run: the worker processes' CPU (utime + stime of each worker process, the
nannies' children) from the first submission until every task is done and a second
more (the same in every route, so the profile cycles and the senders' flushes after the
last task count), divided by the tasks. Besides the A/B, the run's B measures its own
parts with thread clocks inside the workers: the plugin's publishing of the profile on
the event loop (``_publish_profiles``, ``time.thread_time``) and the workers' sender
threads (``/proc/self/task``); and, once after the runs, the worker CPU one nanny ping
costs (500 ``identity`` calls to a worker, its process clock, less what the idle
worker spends in as long).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import dask
from distributed import Client, LocalCluster, wait
from distributed.core import rpc

from dask_blackbox import producers
from dask_blackbox.producers import nanny as nanny_producer
from dask_blackbox.producers.scheduler import PLUGIN_NAME
from local_broker import local_broker
from process_cluster import process_cpu
from report import report
from scheduler_overhead import WAIT_DEADLINE, _accepted, _delivered, _wait, _worker_sender_cpu

ROUTES = {"A": "profiles off", "B": "profiles on", "C": "profiles off, nanny pings off"}
PINGS = 500


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def _inner(n: int) -> int:
    return _spin(n)


def load_a(i: int, n: int) -> int:
    return _inner(n) + i


def load_b(i: int, n: int) -> int:
    return _spin(n) - i


def load_c(i: int, n: int) -> int:
    return _inner(n // 2) + _spin(n - n // 2)


def load_d(i: int, n: int) -> int:
    return sum(_spin(n // 4) for _ in range(4))


LOADS = (load_a, load_b, load_c, load_d)


def spins_for(ms: float) -> int:
    """Iterations of :func:`_spin` in about ``ms`` of CPU here."""
    n = 20000
    t0 = time.process_time()
    _spin(n)
    return max(1, int(n * ms / 1000 / max(time.process_time() - t0, 1e-6)))


def _time_publishing(dask_worker) -> None:
    """Wrap the plugin's periodic publishing of the profile in a thread clock."""
    plugin = dask_worker.plugins[PLUGIN_NAME]
    periodic = plugin._profiles
    if periodic is None or hasattr(periodic.callback, "seconds"):
        return
    publish = periodic.callback

    def timed() -> None:
        t0 = time.thread_time()
        publish()
        timed.seconds += time.thread_time() - t0
        timed.calls += 1

    timed.seconds, timed.calls = 0.0, 0
    periodic.callback = timed


def _parts(dask_worker) -> tuple[float, int, float]:
    """(publishing seconds, publications, sender threads' seconds) of this worker."""
    periodic = dask_worker.plugins[PLUGIN_NAME]._profiles
    callback = getattr(periodic, "callback", None)
    return (getattr(callback, "seconds", 0.0), getattr(callback, "calls", 0),
            _worker_sender_cpu(dask_worker))


def _pid(dask_worker=None) -> int:
    return os.getpid()


def _cpu(pids) -> float:
    return sum(process_cpu(p) for p in pids)


def timed(route: str, tasks: int, spins: int) -> dict:
    nanny_producer.PING_INTERVAL = float("inf") if route == "C" else PING_INTERVAL
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=0,
                      dashboard_address=":0") as local, Client(local) as client:
        on_scheduler = lambda function, *args: function(*args, dask_scheduler=local.scheduler)  # noqa: E731
        producers.attach(client, **{"producer.record.profiles": route == "B"})
        wait(client.map(load_a, range(200), n=spins, pure=False))  # warm-up
        pids = list(client.run(_pid).values())
        if route == "B":
            client.run(_time_publishing)
        parts0 = client.run(_parts)
        cpu0, t0 = _cpu(pids), time.perf_counter()
        futures = [client.submit(LOADS[i % len(LOADS)], i, n=spins, pure=False)
                   for i in range(tasks)]
        wait(futures, timeout=WAIT_DEADLINE)
        del futures
        _wait(on_scheduler, _delivered, on_scheduler(_accepted))
        time.sleep(1.0)
        cpu, wall = _cpu(pids) - cpu0, time.perf_counter() - t0 - 1.0
        parts = client.run(_parts)
        publish = sum(parts[w][0] - parts0[w][0] for w in parts)
        publications = sum(parts[w][1] - parts0[w][1] for w in parts)
        sender = sum(parts[w][2] - parts0[w][2] for w in parts)
        lost = [m for _, m in local.scheduler.get_events("all")
                if isinstance(m, dict) and m.get("action") == "remove-worker"]
        if lost:
            raise RuntimeError(f"{len(lost)} worker(s) lost during the run")
        return {"route": route, "wall": wall, "cpu": cpu, "us_per_task": cpu / tasks * 1e6,
                "publish": publish, "publications": publications, "sender": sender}


def ping_cost(spins: int) -> float:
    """Worker CPU seconds of one ``identity`` call, as the nanny makes it."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, memory_limit=0,
                      dashboard_address=":0") as local, Client(local) as client:
        wait(client.map(load_a, range(50), n=spins, pure=False))
        (address, pid), = client.run(_pid).items()

        async def pings() -> None:
            worker = rpc(address)
            try:
                for _ in range(PINGS):
                    await worker.identity()
            finally:
                await worker.close_rpc()

        cpu0, t0 = process_cpu(pid), time.perf_counter()
        client.sync(pings)
        cpu, wall = process_cpu(pid) - cpu0, time.perf_counter() - t0
        time.sleep(0.5)
        idle0, t0 = process_cpu(pid), time.perf_counter()
        time.sleep(max(wall, 1.0))
        idle = (process_cpu(pid) - idle0) / (time.perf_counter() - t0) * wall
        return (cpu - idle) / PINGS


PING_INTERVAL = nanny_producer.PING_INTERVAL


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per route")
    parser.add_argument("--tasks", type=int, default=12000)
    parser.add_argument("--task-ms", type=float, default=1.0)
    parser.add_argument("--no-pings-route", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 run a route of 1,500 tasks")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.tasks = 1, 1500
    routes = "AB" if args.no_pings_route else "ABC"
    spins = spins_for(args.task_ms)
    print(f"{args.tasks:,} tasks of {spins:,} iterations (~{args.task_ms} ms) a run; "
          f"profile interval {dask.config.get('distributed.worker.profile.interval')}, "
          f"cycle {dask.config.get('distributed.worker.profile.cycle')}", flush=True)
    runs: list[dict] = []
    with local_broker():
        for i in range(args.runs):
            order = routes if i % 2 == 0 else routes[::-1]
            for route in order:
                r = timed(route, args.tasks, spins)
                runs.append(r)
                extra = ""
                if route == "B":
                    extra = (f"; publishing {r['publish'] * 1e3:.1f} ms in {r['publications']} "
                             f"calls ({r['publish'] / args.tasks * 1e6:.2f} us a task)")
                print(f"run {i + 1} {route} ({ROUTES[route]}): {r['wall']:.1f}s wall, worker CPU "
                      f"{r['cpu']:.2f}s = {r['us_per_task']:.1f} us a task; workers' senders "
                      f"{r['sender'] * 1e3:.1f} ms{extra}", flush=True)
        ping = ping_cost(spins)
    print(f"one nanny ping: {ping * 1e6:.0f} us of worker CPU ({PINGS} identity calls)")
    by = {route: [r for r in runs if r["route"] == route] for route in routes}
    med = {route: statistics.median(r["us_per_task"] for r in rs) for route, rs in by.items()}
    n = args.runs
    for route in routes:
        report(f"worker CPU per task, {ROUTES[route]}, median of {n} runs "
               f"({spread([r['us_per_task'] for r in by[route]])})", round(med[route], 1), "us",
               None)
    report(f"worker CPU per task, profiles on less off, B-A of the medians ({n} runs each)",
           round(med["B"] - med["A"], 1), "us", None)
    b = by["B"]
    report(f"the profile's publishing on the workers' event loops per task, thread clock "
           f"({n} B runs, {spread([r['publish'] / args.tasks * 1e6 for r in b])})",
           round(statistics.median(r["publish"] / args.tasks * 1e6 for r in b), 2), "us", None)
    report(f"the workers' sender threads per task: B less A, medians ({n} runs each)",
           round((statistics.median(r["sender"] for r in b)
                  - statistics.median(r["sender"] for r in by["A"])) / args.tasks * 1e6, 2),
           "us", None)
    if "C" in by:
        report(f"worker CPU per task, nanny pings on less off, A-C of the medians ({n} runs each)",
               round(med["A"] - med["C"], 1), "us", None)
    walls = [r["wall"] for r in runs]
    pings_per_task = 2 * statistics.median(walls) / args.tasks  # a ping a second a worker
    report(f"worker CPU of the nanny's pings per task, one ping's cost ({PINGS} calls) at a ping "
           f"a second a worker", round(ping * pings_per_task * 1e6, 3), "us", None)


if __name__ == "__main__":
    main()
