"""How fast what a removed worker held is found (read/held_memory.py ``at_deaths``), A/B
of a baseline revision's module against this tree's, on the same synthetic run in chDB.

    nice -n 5 python bench/held_memory.py [--tasks 366000] [--repeat 3] [--baseline main]
                                          [--keep DIR] [--quick]

The run is :mod:`critical_path`'s (its generator and loader reused): ``--tasks`` tasks
on 32 workers, five or six scheduler transitions each (366k tasks: about 1.9M
transitions), every result in memory until the client releases them all at the end,
so a worker removed late holds ~11k keys. Removals asked about, each set in one call:
one worker mid-run, two workers (mid-run and late), one late, four late, all 32 late
(as when a cluster's workers are all lost at once). Each set is
asked ``--repeat`` times of each side, alternating A (``git show
BASELINE:read/held_memory.py``, imported as a module of its own) and B (this tree's,
its kept answers dropped first), B followed by ``B again`` (the same question at once:
the answer kept, checked against the transitions' state), wall clock and this
process's CPU (chDB runs in it); the answers of every side are compared (they must
be the same), prefixes of equal bytes and keys put in one order first (the baseline
leaves theirs to ClickHouse; this tree orders them by name). ``--keep DIR`` keeps the chDB directory, and loads
nothing when DIR already holds the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from critical_path import WORKERS, Run, insert
from report import report

from dask_blackbox import clickhouse
from dask_blackbox.read import backends
from dask_blackbox.read import held_memory as tree_module
from dask_blackbox.read.guard import QueryError
from dask_blackbox.sinks.schema import Target, migrate

CLUSTER = "bench-held"
ROOT = pathlib.Path(__file__).resolve().parent.parent


class Removal(NamedTuple):
    cluster_id: str
    worker: str
    ts: float
    stimulus_id: str


def baseline_module(revision: str):
    source = subprocess.run(["git", "show", f"{revision}:read/held_memory.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp(prefix="bb-held-")) / "held_memory_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("held_memory_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def removal_sets(t0: float, last: float) -> dict[str, list[Removal]]:
    def at(w: int, ts: float) -> Removal:
        return Removal(CLUSTER, f"tcp://w{w}", ts, f"remove-worker-w{w}-{ts:.3f}")

    mid, late = t0 + (last - t0) / 2, last + 0.1
    return {"one worker mid-run": [at(3, mid)],
            "two workers, mid-run and late": [at(3, mid), at(7, late)],
            "one worker late": [at(5, late)],
            "four workers late": [at(w, late) for w in range(8, 8 + 4)],
            f"all {WORKERS} workers late": [at(w, late) for w in range(WORKERS)]}


def timed(module, backend, removals) -> tuple[float, float, list | str]:
    t, c = time.perf_counter(), time.process_time()
    try:
        answer = [h._replace(prefixes=sorted(h.prefixes, key=lambda p: (-p.nbytes, -p.keys, p.prefix)))
                  .as_dict() for h in module.at_deaths(backend, removals)]
    except QueryError as e:
        answer = f"failed: {str(e)[:120]}"
    return time.perf_counter() - t, time.process_time() - c, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=366_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", help="keep the chDB directory here (and reuse it)")
    parser.add_argument("--quick", action="store_true", help="20k tasks, once a side")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.repeat = 20_000, 1
    root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="bb-held-bench-"))
    client = clickhouse.open_client(f"chdb://{root / 'chdb'}")
    migrate(client, Target("blackbox", 90 * 86400))
    backend = backends.DirectBackend(client, "blackbox")
    loaded = client.query(f"SELECT count(), toFloat64(min(ts)), toFloat64(maxIf(ts, finish = 'memory')) "
                          f"FROM blackbox.transitions WHERE cluster_id = '{CLUSTER}'").result_rows[0]
    if not loaded[0]:
        t = time.perf_counter()
        run = Run(args.tasks, args.seed, time.time() - 86400)
        transitions = run.transitions(CLUSTER)
        insert(client, "transitions", transitions)
        print(f"{run.n:,} tasks on {WORKERS} workers, {transitions.num_rows:,} transitions, "
              f"synthesised and loaded in {time.perf_counter() - t:.0f}s", flush=True)
        del transitions
        loaded = client.query(f"SELECT count(), toFloat64(min(ts)), toFloat64(maxIf(ts, finish = 'memory')) "
                              f"FROM blackbox.transitions WHERE cluster_id = '{CLUSTER}'").result_rows[0]
    n_transitions, t0, last = loaded
    print(f"{n_transitions:,} transitions in chDB ({root})", flush=True)
    sides = {"A": baseline_module(args.baseline), "B": tree_module}
    for name, removals in removal_sets(t0, last).items():
        walls: dict[str, list[float]] = {"A": [], "B": [], "B again": []}
        cpus: dict[str, list[float]] = {"A": [], "B": [], "B again": []}
        answers: dict[str, object] = {}
        for r in range(args.repeat):
            for side in (("A", "B", "B again") if r % 2 == 0 else ("B", "B again", "A")):
                if side == "A" and isinstance(answers.get("A"), str):
                    continue  # failed once (the read guard's time limit): not again
                if side == "B":
                    tree_module._cache.clear()
                wall, cpu, answer = timed(sides[side[0]], backend, removals)
                walls[side].append(wall)
                cpus[side].append(cpu)
                answers.setdefault(side, answer)
                held = (", ".join(f"{h['keys']:,} keys" for h in answer) if isinstance(answer, list)
                        else answer)
                print(f"{name}: {side} {wall:.3f}s wall {cpu:.3f}s CPU ({held})", flush=True)
        failed = isinstance(answers["A"], str)
        same = (failed or answers["A"] == answers["B"]) and answers["B"] == answers["B again"]
        print(f"{name}: the answers of {'B and B again' if failed else 'A, B and B again'} are "
              f"{'the same' if same else 'DIFFERENT'}", flush=True)
        for side, label in (("A", f"baseline {args.baseline}"), ("B", "this tree"),
                            ("B again", "this tree, asked again (its answer kept)")):
            if side == "A" and failed:
                print(f"{name}: A {answers['A']} after {walls['A'][0]:.1f}s", flush=True)
                continue
            report(f"held memory at deaths, {name}, {n_transitions / 1e6:.2f}M transitions, {label}: "
                   f"wall, median of {len(walls[side])} ({min(walls[side]):.3f}-{max(walls[side]):.3f}; "
                   f"CPU {statistics.median(cpus[side]):.3f}s)",
                   round(statistics.median(walls[side]), 3), "s", None)
        if not same:
            sys.exit(f"{name}: A and B answer differently")


if __name__ == "__main__":
    main()
