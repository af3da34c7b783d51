"""The whole scheduler process counted in instructions, A/B: what the producers add
to Dask's event loop and to the process, on a real cluster, where the load of a
shared machine cannot move the figure.

``bench/scheduler_overhead.py`` times the scheduler process on real graphs, but on
this 2-core machine its CPU seconds move by ±20 % between runs of the same code and
its event-loop thread showed more CPU with the recorder on than the ``transition``
hook accounts for. This counts instead: the scheduler (``dask scheduler``) runs under
``valgrind --tool=callgrind --separate-threads=yes`` with two ordinary worker
processes, and each timed computation is one callgrind section (zeroed by a
``getppid`` and dumped by a ``getpgrp`` that the client makes the scheduler call).
Sections on one cluster, after two warm-up computations: A, B, B, A (B: the
producers attached as in ``scheduler_overhead.py``, the worker plugins too; the
helper process is not under valgrind). The graph is the ``32k`` shape scaled down
(``(ones(side x side, chunks 20) + 1).sum()``, worker-saturation inf). A B section
ends when the computation's result is back (the relay's hand-over of the tail is
outside it: see ``transition_hotpath.py --callgrind`` for its cost per event).

Printed: per section, its transitions and the event loop's instructions (valgrind
thread 1: a dump holds only the thread that triggered it), in all and per task;
B - A per task and per transition, next to the hook's own figure
(``transition_hotpath.py --callgrind``); and the C functions whose own instructions
per task differ most between the B and the A sections (CPython's interpreter,
allocator, collector, socket calls: where extra instructions went).

Run: ``python bench/scheduler_instructions.py [--side 640]`` (~10 minutes).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
import time

import dask

from local_broker import local_broker
from process_cluster import process_cluster
from report import report
from scheduler_overhead import SATURATED, _array_sum, _wait_delivered, attach, detach
from transition_hotpath import _instructions as _totals

#: The hook's instructions per transition (``transition_hotpath.py --callgrind``,
#: B - A, session 6): what the event loop is expected to add per transition.
HOOK_PER_TRANSITION = 3_169


def _zero(dask_scheduler) -> int:
    os.getppid()  # --zero-before=getppid
    return dask_scheduler.transition_counter


def _dump(dask_scheduler) -> int:
    counter = dask_scheduler.transition_counter
    os.getpgrp()  # --dump-before=getpgrp
    return counter


def _dumps(tmp: str) -> dict[int, dict[int, str]]:
    """{dump number: {valgrind thread number: file}}."""
    out: dict[int, dict[int, str]] = {}
    for path in glob.glob(f"{tmp}/cg.out.*.*-*"):
        m = re.search(r"\.(\d+)-(\d+)$", path)
        if m:
            out.setdefault(int(m[1]), {})[int(m[2])] = path
    return out


def _self_costs(path: str) -> dict[str, int]:
    """Own (exclusive) instructions per function of one callgrind dump, read from
    its file: the cost lines of each ``fn=`` block, less the line after each
    ``calls=`` (a call's inclusive cost)."""
    names: dict[str, str] = {}
    out: dict[str, int] = {}
    fn = "?"
    after_call = False
    with open(path) as f:
        for line in f:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                if after_call:
                    after_call = False
                    continue
                parts = line.split()
                if len(parts) > 1:
                    out[fn] = out.get(fn, 0) + int(parts[1])
            elif line.startswith("fn="):
                m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m:
                    if m[2]:
                        names[m[1]] = m[2]
                    fn = names.get(m[1], m[1])
                else:
                    fn = line[3:].strip()
            elif line.startswith("cfn="):  # names an id for later fn= lines too
                m = re.match(r"cfn=\((\d+)\) (.*)", line.rstrip("\n"))
                if m:
                    names[m[1]] = m[2]
            elif line.startswith("calls="):
                after_call = True
    return {names.get(k, k): v for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=640,
                        help="array side (chunks of 20): 640 gives 1,365 tasks")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="blackbox-scheduler-cg-")
    prefix = ["valgrind", "--tool=callgrind", "--separate-threads=yes",
              "--zero-before=getppid", "--dump-before=getpgrp",
              f"--callgrind-out-file={tmp}/cg.out.%p"]
    compute, warm_up = _array_sum(args.side), _array_sum(args.side // 2)
    sections: list[tuple[str, int]] = []  # (A|B, transitions)
    t0 = time.monotonic()
    with local_broker(), dask.config.set({"optimization.fuse.active": False}):
        with process_cluster(2, SATURATED, scheduler_prefix=prefix, timeout=900) as (client, pid):
            warm_up(client)
            compute(client)
            attached = False
            for side in "ABBA":
                if side == "B" and not attached:
                    attach(client)
                    compute(client)  # the producers' first computation warms them up
                    client.run_on_scheduler(_wait_delivered)
                elif side == "A" and attached:
                    detach(client)
                attached = side == "B"
                start = client.run_on_scheduler(_zero)
                tasks = compute(client)
                end = client.run_on_scheduler(_dump)
                sections.append((side, end - start))
                if side == "B":
                    client.run_on_scheduler(_wait_delivered)
                print(f"  section {len(sections)} {side}: {tasks:,} tasks, "
                      f"{end - start:,} transitions ({time.monotonic() - t0:.0f}s)", flush=True)
    # The scheduler's dumps, in order; the last len(sections) are the sections'.
    # Each holds the thread that triggered it: the event loop (valgrind thread 1).
    dumps = _dumps(tmp)
    order = sorted(dumps)[-len(sections):]
    rows = [(side, transitions, _totals(dumps[number][1]), dumps[number][1])
            for (side, transitions), number in zip(sections, order)]
    print(f"\ninstructions on the scheduler's event loop (valgrind --tool=callgrind, "
          f"thread 1, one run, {time.monotonic() - t0:.0f}s), {tasks:,} tasks a section:")
    print(f"  {'section':10s} {'transitions':>12s} {'total':>16s} {'per task':>12s}")
    for i, (side, n, loop, _) in enumerate(rows):
        print(f"  {i + 1} {side:8s} {n:12,d} {loop:16,d} {loop / tasks:12,.0f}")
    a = [r for r in rows if r[0] == "A"]
    b = [r for r in rows if r[0] == "B"]
    loop_a = sum(r[2] for r in a) / len(a)
    loop_b = sum(r[2] for r in b) / len(b)
    trans_b = sum(r[1] for r in b) / len(b)
    print(f"  B - A: {(loop_b - loop_a) / tasks:+,.0f} per task, "
          f"{(loop_b - loop_a) / trans_b:+,.0f} per B transition (ratio {loop_b / loop_a:.3f}); "
          f"the hook alone: +{HOOK_PER_TRANSITION:,} per transition")
    # Where the event loop's extra instructions went: own costs, B vs A summed.
    ca: dict[str, int] = {}
    cb: dict[str, int] = {}
    for rows_of, costs in ((a, ca), (b, cb)):
        for *_, path in rows_of:
            for f, c in _self_costs(path).items():
                costs[f] = costs.get(f, 0) + c
    delta = {f: (cb.get(f, 0) / len(b) - ca.get(f, 0) / len(a)) / tasks
             for f in set(ca) | set(cb)}
    print("  own instructions per task, B - A, the 25 functions that differ most:")
    for f, d in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:25]:
        print(f"    {d:+10,.0f}  {f[:90]}")
    report("scheduler event loop with/without (instructions per task)",
           loop_b / loop_a, "x", target=None)
    print("dumps kept in", tmp)


if __name__ == "__main__":
    main()
