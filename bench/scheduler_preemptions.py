"""Who preempts the scheduler's event loop, with and without the producers.

``scheduler_overhead.py`` counts the event loop's involuntary context switches
(preemptions): with the producers there are more. This script says whose wake-ups
they are. One cluster of a ``scheduler_overhead.py`` shape (its scheduler a process
of its own) is warmed up with one untimed run of the graph, then runs it once per
side of ``--sides`` (default ``AB``); during each run ``perf record -e
sched:sched_switch -a`` traces every context switch of the machine. A switch away
from the scheduler's main thread while it was still runnable (``prev_state`` R) is
a preemption; the thread switched to is named by its role: the scheduler's other
threads (by Python thread name: the producers' relay ``dask-blackbox-scheduler-
sender`` and ``...-relay-status``), the worker processes and their threads, the
producers' helper process, the broker, this client, the workers' nannies, or else
the thread's own name (kernel threads, other processes).

Printed per side: wall seconds, preemptions, and preemptions per role, most first.

FINDINGS (2026-11-23, session 7; fresh40k, one A and one B run on one cluster, ~100 s
each): A 23,518 preemptions (workers' main threads 12,857, their other threads
8,283, rcu 1,019); B 28,897 (workers' 13,667 and 10,750, the relay thread 556, the
broker 461, the relay's status thread 399, the helper 141). What the workers add
follows B's longer wall (+12 %); the recording's own processes and threads preempt
the event loop about 1,550 times a run directly.

32k, the same way (~45 s runs): A 5,194 (workers' 3,274 and 886), B 5,761
(workers' 3,080 and 1,402, the relay thread 211, the broker 128, the status thread
104, the helper 29).

Run: ``python bench/scheduler_preemptions.py [--shape fresh40k] [--sides AB]``
(needs ``perf``, as root: Debian's ``linux-perf``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

from local_broker import local_broker
from process_cluster import process_cluster, thread_label, thread_names
from scheduler_overhead import SHAPES, _settled, _wait_delivered, attach, detach

_SWITCH = re.compile(r"prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> "
                     r"next_comm=(.+?) next_pid=(\d+)")


def _helper_pid(dask_scheduler) -> int | None:
    plugin = dask_scheduler.plugins.get("dask-blackbox")
    return None if plugin is None or plugin.transport is None else plugin.transport.relay_pid


def _threads(pid: int, role: str) -> dict[int, str]:
    """``{tid: role}`` of every thread of ``pid``: its main thread ``role``, the others
    ``role``-thread."""
    try:
        return {int(t): role if int(t) == pid else f"{role}-thread"
                for t in os.listdir(f"/proc/{pid}/task")}
    except FileNotFoundError:
        return {}


def roles(client, pid: int, broker_pid: int) -> dict[int, str]:
    """``{tid: role}`` of every thread that matters (module docstring)."""
    out = {}
    for nanny in set(client.run(os.getppid).values()):
        out.update(_threads(nanny, "nanny"))
    for wpid in client.run(os.getpid).values():
        out.update(_threads(wpid, "worker"))
    helper = client.run_on_scheduler(_helper_pid)
    if helper:
        out.update(_threads(helper, "helper"))
    out.update(_threads(broker_pid, "broker"))
    out.update(_threads(os.getpid(), "this client"))
    names = thread_names(client)
    for tid in names:
        out[tid] = "scheduler: " + thread_label(tid, "", names)
    return out


def preemptions(trace: str, pid: int, role: dict[int, str]) -> collections.Counter:
    """Preemptions of thread ``pid`` in a ``perf record`` file, by the next thread's
    role."""
    script = subprocess.run(["perf", "script", "-i", trace, "-F", "trace"],
                            capture_output=True, text=True, check=True).stdout
    by = collections.Counter()
    for line in script.splitlines():
        m = _SWITCH.search(line)
        if m and int(m.group(1)) == pid and m.group(2).startswith("R"):
            by[role.get(int(m.group(4)), f"other: {m.group(3)}")] += 1
    return by


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="fresh40k", choices=sorted(SHAPES))
    parser.add_argument("--sides", default="AB")
    args = parser.parse_args()
    if set(args.sides) - {"A", "B"}:
        sys.exit("--sides: a sequence of A (without) and B (with), e.g. AB or ABBA")
    shape = SHAPES[args.shape]
    with local_broker(**{"optimization.fuse.active": False}) as broker, \
            tempfile.TemporaryDirectory() as tmp, \
            process_cluster(2, shape.scheduler_config) as (client, pid):
        shape.compute(client)  # warm-up: the heap grown to a run's size
        for i, side in enumerate(args.sides):
            if side == "B":
                attach(client)
                time.sleep(1.0)  # the helper process is started by the relay thread
            trace = f"{tmp}/{i}.data"
            recorder = subprocess.Popen(
                ["perf", "record", "-q", "-e", "sched:sched_switch", "-a", "-o", trace],
                stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            t0 = time.perf_counter()
            shape.compute(client)
            wall = time.perf_counter() - t0
            client.run_on_scheduler(_settled)
            if side == "B":
                client.run_on_scheduler(_wait_delivered)
            recorder.send_signal(2)
            recorder.wait()
            role = roles(client, pid, broker.proc.pid)
            if side == "B":
                detach(client)
            by = preemptions(trace, pid, role)
            print(f"{shape.name} {side}: wall {wall:.1f}s, event loop preempted "
                  f"{sum(by.values()):,}x by:", flush=True)
            for who, n in by.most_common(12):
                print(f"    {who:45s} {n:8,}", flush=True)


if __name__ == "__main__":
    main()
