"""How often does ``compare`` find a planted slowdown, and how often does it cry wolf?

Runs are drawn from a model of what this project's recorded runs look like, then
compared by the same statistics ``dask-blackbox compare`` applies
(:func:`dask_blackbox.read.regressions.compare_profiles`, and the headline of
:class:`~dask_blackbox.read.regressions.Comparison`): four prefixes, ``aggregate``
(10 tasks, 0.2 s), ``transform`` (200 tasks, 0.05 s), ``extract`` (200 tasks,
0.02 s) and ``load`` (50 tasks, 0.04 s); each task's compute time varies by
``--task-noise`` (lognormal sigma, default 10 %), each run by ``--run-noise`` (a
factor on all its tasks, default 2 %: a machine busier one night). Each trial is a
history of ``--history`` runs, a baseline and a candidate:

- *planted*: the candidate's ``aggregate`` (10 tasks) or ``transform`` (200 tasks)
  takes ``--planted`` longer (default 15 %);
- *unchanged*: the candidate is drawn like the others.

For each, the share of trials whose headline is a regression blaming the planted
prefix (*found*), another headline ("inconclusive": the data cannot tell, said so;
"no change beyond noise": a verdict the data did not support when a change was
planted), the planted prefix's own verdict in brackets ("within noise" there is a
miss that misleads), and for unchanged pairs any regression or improvement (*false
alarms*). Both corrections
of the rank tests are measured: Holm (what ``compare`` uses) and Bonferroni.

    python bench/regressions.py [--trials 200] [--seed 1]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

from dask_blackbox.read.regressions import Comparison, Profile, Run, Sample, compare_profiles

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from report import report  # noqa: E402

PREFIXES = {"aggregate": (10, 0.2), "transform": (200, 0.05), "extract": (200, 0.02),
            "load": (50, 0.04)}


def draw(rng: np.random.Generator, task_noise: float, run_noise: float,
         planted: str | None = None, factor: float = 1.0) -> Profile:
    run = float(np.exp(rng.normal(0.0, run_noise)))
    samples = {}
    for prefix, (n, median) in PREFIXES.items():
        scale = median * run * (factor if prefix == planted else 1.0)
        values = scale * np.exp(rng.normal(0.0, task_noise, n))
        samples[(prefix, "compute")] = Sample(n, float(values.sum()), values)
    # the wall time: the work over 4 threads, which the run's factor moves too
    wall = sum(s.total for s in samples.values()) / 4
    return Profile(wall, samples)


def verdict(base: Profile, new: Profile, past: list[Profile], correction: str,
            prefix: str | None) -> tuple[str, str | None, str | None]:
    """The headline, the culprit's prefix, and the verdict of ``prefix``'s compute."""
    changes, culprit, tests, band = compare_profiles(base, new, past, correction)
    run = Run("c", "bench", None, 0.0)
    c = Comparison("bench", run, run, (), base.wall, new.wall, band, tuple(changes), culprit,
                   None, tests)
    own = next((x.verdict for x in changes if (x.prefix, x.action) == (prefix, "compute")), None)
    return c.verdict, (culprit.prefix if culprit else None), own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--history", type=int, default=4)
    ap.add_argument("--task-noise", type=float, default=0.10)
    ap.add_argument("--run-noise", type=float, default=0.02)
    ap.add_argument("--planted", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="50 trials each")
    args = ap.parse_args()
    if args.quick:
        args.trials = 50
    started = time.perf_counter()
    print(f"{args.trials} trials each; task noise {args.task_noise:.0%}, run noise "
          f"{args.run_noise:.0%}, planted +{args.planted:.0%}, {args.history} earlier runs")
    for correction in ("holm", "bonferroni"):
        for case in ("aggregate", "transform", None):
            rng = np.random.default_rng(args.seed)  # the same runs for both corrections
            counts: dict[str, int] = {}
            for _ in range(args.trials):
                past = [draw(rng, args.task_noise, args.run_noise) for _ in range(args.history)]
                base = draw(rng, args.task_noise, args.run_noise)
                new = draw(rng, args.task_noise, args.run_noise, case, 1 + args.planted)
                v, culprit, own = verdict(base, new, past, correction, case)
                if case is None:
                    outcome = "false alarm" if v in ("regression", "improvement") else v
                else:
                    outcome = ("found" if v == "regression" and culprit == case
                               else "wrong culprit" if v == "regression" else v)
                    # the planted prefix's own line: "slower", "inconclusive", or a
                    # "within noise" the data did not support
                    counts[f"[{case}: {own}]"] = counts.get(f"[{case}: {own}]", 0) + 1
                counts[outcome] = counts.get(outcome, 0) + 1
            what = (f"planted in {case} ({PREFIXES[case][0]} tasks)" if case
                    else "unchanged pairs")
            shares = ", ".join(f"{k} {n / args.trials:.1%}" for k, n in sorted(counts.items()))
            print(f"{correction:<10} {what:<34} {shares}")
            if correction != "holm":
                continue
            if case is None:
                report("compare: false alarms on unchanged pairs",
                       counts.get("false alarm", 0) / args.trials, "fraction", 0.10)
            else:
                report(f"compare: {case} ({PREFIXES[case][0]} tasks) planted, found",
                       counts.get("found", 0) / args.trials, "fraction", None, better="higher")
                report(f"compare: {case} ({PREFIXES[case][0]} tasks) planted, called within noise",
                       counts.get(f"[{case}: within noise]", 0) / args.trials, "fraction", 0.0)
    print(f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
