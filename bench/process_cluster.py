"""A Dask cluster whose scheduler runs in a process of its own, for benchmarks that
measure the scheduler process alone.

``dask scheduler`` and ``dask worker --nworkers N --nthreads 1`` are started as
subprocesses on free loopback ports; Dask config for them travels as ``DASK_*``
environment variables (the scheduler reads its own config, not the client's). The
client side (graph construction and optimization) stays in the calling process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from distributed import Client

from dask_blackbox.deploy.brokers import free_port, port_open
from dask_blackbox.testing.settings import dask_env

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _env(config: dict[str, object]) -> dict[str, str]:
    env = dict(os.environ)
    # Functions of these bench modules (thread names, the producers' drain) are
    # pickled by reference and run in the scheduler: it must import them too.
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.update(dask_env(config))
    return env


@contextlib.contextmanager
def process_cluster(n_workers: int = 2, config: dict[str, object] | None = None,
                    scheduler_prefix: tuple[str, ...] | list[str] = (),
                    timeout: float = 120.0):
    """``(client, scheduler_pid)`` of a fresh cluster; everything is killed after.
    ``scheduler_prefix`` runs the scheduler under a command (``valgrind ...``)."""
    env = _env(config or {})
    port = free_port()
    scheduler_log, workers_log = _logs(port)
    address = f"tcp://127.0.0.1:{port}"
    procs = []
    try:
        scheduler = subprocess.Popen(
            [*scheduler_prefix, sys.executable, "-m", "distributed.cli.dask_scheduler",
             "--host", "127.0.0.1",
             "--port", str(port), "--dashboard-address", ":0", "--no-show"],
            env=env, stdout=subprocess.DEVNULL, stderr=scheduler_log)
        procs.append(scheduler)
        # Workers started before the scheduler listens give up on it (a scheduler
        # under valgrind takes minutes to start).
        deadline = time.monotonic() + timeout
        while not port_open("127.0.0.1", port):
            if scheduler.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler did not listen on port {port}")
            time.sleep(0.1)
        workers = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address,
             "--nworkers", str(n_workers), "--nthreads", "1", "--no-dashboard",
             "--memory-limit", "0", "--host", "127.0.0.1"],
            env=env, stdout=subprocess.DEVNULL, stderr=workers_log)
        procs.append(workers)
        client = Client(address, timeout=timeout)
        try:
            client.wait_for_workers(n_workers, timeout=timeout)
            yield client, scheduler.pid
        finally:
            client.close()
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in (scheduler_log, workers_log):
            if log is not subprocess.DEVNULL:
                log.close()


def _logs(port: int) -> tuple:
    """Where the scheduler's and the workers' logs go: files under
    ``$BENCH_CLUSTER_LOGS`` (named by the scheduler's port) if set, else nowhere."""
    where = os.environ.get("BENCH_CLUSTER_LOGS")
    if not where:
        return subprocess.DEVNULL, subprocess.DEVNULL
    os.makedirs(where, exist_ok=True)
    return (open(os.path.join(where, f"{port}-scheduler.log"), "ab"),
            open(os.path.join(where, f"{port}-workers.log"), "ab"))


def process_cpu(pid: int) -> float:
    """utime + stime seconds of the whole process ``pid`` (ended threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK
