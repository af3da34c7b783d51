"""How often does ``compare`` name a function planted slower, and how often does it cry
wolf by function, on real clusters recorded by the real pipeline?

Every run is a LocalCluster (two worker processes, one thread each, Dask's profiler
every ``--interval``) on a local pipeline (Tansu, the sink on chDB), computing
``--tasks`` tasks of prefix ``fnwork`` (:mod:`dask_blackbox.testing.planted`, the
workload ``tests/integration/test_function_changes.py`` runs too); each spends
``--spin`` seconds in ``steady`` and as long in ``slowed``, in five turns
(pure-Python busy loops for an amount of the thread's CPU time, which call a Python helper: Dask's worker counts a sample
only in the frames that called another). ``--unchanged`` pairs of runs are identical; ``--planted`` pairs compare
the first run of an unchanged pair with a run whose ``slowed`` takes ``--factor``
times as long (default 1.3). Each pair is compared as ``dask-blackbox compare`` does
it (:func:`~dask_blackbox.read.regressions.compare_runs`, no earlier runs: the
noise band is its minimum), then by function
(:func:`~dask_blackbox.read.function_changes.of_comparison`):

- *found*: a planted pair whose frames that grew name ``slowed`` (verdict "grew")
  and not ``steady``;
- *false alarm*: an unchanged pair with any frame said to have grown ("grew with
  its prefix", the prefix's time moving every frame's, is counted apart).

    python bench/function_regressions.py [--unchanged 10] [--planted 5] [--tasks 48]

It takes about 40 s a run on a loaded 2-core machine (``--quick``: 4 and 2 pairs).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
import time

import dask.config
from distributed import Client, LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from report import report  # noqa: E402

from dask_blackbox.testing.planted import fnwork  # noqa: E402


def record(name: str, tasks: int, spin: float, factor: float) -> str:
    from dask_blackbox import producers

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=50) as cluster, \
            Client(cluster) as client:
        cluster_id = producers.attach(client, cluster_name=name,
                                      **{"producer.flush-interval": "20ms"})["cluster_id"]
        futures = client.map(fnwork, range(tasks), spin=spin, factor=factor,
                             key=[f"fnwork-{i}" for i in range(tasks)])
        client.gather(futures)
    return cluster_id


def loaded(timeout: float = 180.0) -> None:
    """Until the sink's group has committed every message, twice half a second apart."""
    from dask_blackbox import config, contract, kafka

    def lag() -> int:
        return sum(asyncio.run(kafka.consumer_lag(
            config.get("sink.group-id"), [config.topic(t) for t in contract.TOPICS])).values())

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lag() == 0:
            time.sleep(0.5)
            if lag() == 0:
                return
        time.sleep(0.3)
    raise SystemExit("the sink did not load every run in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unchanged", type=int, default=10)
    ap.add_argument("--planted", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--spin", type=float, default=0.25)
    ap.add_argument("--factor", type=float, default=1.3)
    ap.add_argument("--interval", default="5ms", help="distributed.worker.profile.interval")
    ap.add_argument("--quick", action="store_true", help="4 unchanged and 2 planted pairs")
    args = ap.parse_args()
    if args.quick:
        args.unchanged, args.planted = 4, 2
    args.planted = min(args.planted, args.unchanged)
    from dask_blackbox.deploy.supervisor import LocalPipeline
    from dask_blackbox.read import backends, function_changes, regressions

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as data_dir, dask.config.set({
            "blackbox.data-dir": data_dir, "distributed.worker.profile.interval": args.interval}):
        pipeline = LocalPipeline(processors=0)
        pipeline.start(progress=lambda m: None)
        try:
            names = []
            for i in range(args.unchanged):
                for side in "ab":
                    names.append(f"fnb-{i}-{side}")
                    record(names[-1], args.tasks, args.spin, 1.0)
                if i < args.planted:
                    names.append(f"fnb-{i}-slow")
                    record(names[-1], args.tasks, args.spin, args.factor)
            loaded()
            backend = backends.running_sink()
            runs = {n: regressions.cluster_runs(backend, n)[0] for n in names}
            outcomes: dict[str, dict[str, int]] = {"unchanged": {}, "planted": {}}
            for i in range(args.unchanged):
                for case, other in (("unchanged", f"fnb-{i}-b"), ("planted", f"fnb-{i}-slow")):
                    if other not in runs:
                        continue
                    c = regressions.compare_runs(backend, runs[f"fnb-{i}-a"], runs[other],
                                                 with_path=False)
                    f = function_changes.of_comparison(backend, c)
                    grew = {x.function for x in f.grown if x.verdict == "grew"}
                    if case == "unchanged":
                        outcome = "false alarm" if grew else "quiet"
                    else:
                        outcome = ("found" if "slowed" in grew and "steady" not in grew
                                   else "wrong" if grew else
                                   next((x.verdict for x in f.grown if x.function == "slowed"),
                                        "not listed"))
                    outcomes[case][outcome] = outcomes[case].get(outcome, 0) + 1
                    print(f"{case:<9} pair {i}: {outcome:<15} prefix {c.verdict}; "
                          + "; ".join(f"{x.function} {x.verdict} {x.described()}"
                                      for x in f.grown[:3]) + (f.missing or ""), flush=True)
        finally:
            pipeline.stop(drain_timeout=0)
    for case, counts in outcomes.items():
        print(f"{case}: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    report("compare by function: false alarms in unchanged pairs",
           outcomes["unchanged"].get("false alarm", 0), "pairs",
           max(1, args.unchanged // 10))
    if args.planted:
        report(f"compare by function: slowed (x{args.factor:g}) named, of {args.planted} pairs",
               outcomes["planted"].get("found", 0) / args.planted, "fraction", None,
               better="higher")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
