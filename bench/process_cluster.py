"""A Dask cluster whose scheduler runs in a process of its own, for benchmarks that
measure the scheduler process alone (its CPU per thread, py-spy on its pid).

``dask scheduler`` and ``dask worker --nworkers N --nthreads 1`` are started as
subprocesses on free loopback ports; Dask config for them travels as ``DASK_*``
environment variables (the scheduler reads its own config, not the client's). The
client side (graph construction and optimization) stays in the calling process.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time

from distributed import Client

from dask_blackbox.cli.brokers import free_port, port_open

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _env(config: dict[str, object]) -> dict[str, str]:
    env = dict(os.environ)
    # Functions of these bench modules (thread names, the producers' drain) are
    # pickled by reference and run in the scheduler: it must import them too.
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    for key, value in config.items():
        name = "DASK_" + "__".join(part.upper().replace("-", "_") for part in key.split("."))
        env[name] = str(value)
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


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """``{tid: (comm, utime + stime seconds)}`` of every live thread of ``pid``."""
    out = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/stat") as f:
                stat = f.read()
            with open(f"{base}/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


def process_cpu(pid: int) -> float:
    """utime + stime seconds of the whole process ``pid`` (ended threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def context_switches(pid: int) -> tuple[int, int]:
    """``(voluntary, involuntary)`` context switches of the main thread of ``pid`` so
    far: an involuntary one is a preemption."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def _python_thread_names(dask_scheduler=None) -> dict[int, str]:
    import threading
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def thread_names(client) -> dict[int, str]:
    """``{tid: Python thread name}`` of the scheduler process's Python threads."""
    return client.run_on_scheduler(_python_thread_names)


def thread_label(tid: int, comm: str, names: dict[int, str]) -> str:
    """A stable label for a thread across runs: its Python name with pool numbers
    cut (``ThreadPoolExecutor-0_1`` -> ``ThreadPoolExecutor``), else its comm."""
    name = names.get(tid, comm)
    if name.startswith("dask-blackbox-"):
        return name
    if name == "MainThread":
        return "MainThread (event loop)"
    return re.sub(r"[-_]?\d+$", "", name) or name


def cpu_by_thread(before: dict, after: dict, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds per thread label used between two :func:`thread_cpu` snapshots."""
    out: dict[str, float] = {}
    for tid, (comm, cpu) in after.items():
        used = cpu - before.get(tid, (comm, 0.0))[1]
        if used > 0:
            label = thread_label(tid, comm, names)
            out[label] = out.get(label, 0.0) + used
    return out


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(interval)
