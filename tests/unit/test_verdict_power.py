"""Verdicts that state their power: a change the data cannot rule out is
"inconclusive", never "no change"; Holm's correction; the headline follows the wall
time's own test; a failed baseline is passed over; ``compare NAME`` with a cluster's
name compares its whole runs.

The statistics on runs drawn with known noise (as bench/regressions.py draws them);
the baseline and cluster-name cases on a real chDB holding synthetic runs written as
the sink writes them (tests/test_slowness_input.py's ``write_run``).
"""

from __future__ import annotations

import numpy as np
import pytest

from dask_blackbox import clickhouse
from dask_blackbox.read import backends, panels, regressions
from dask_blackbox.read.regressions import Comparison, Profile, Run, Sample, compare_profiles
from dask_blackbox.sinks.schema import Target, migrate

from test_slowness_input import Task, _t, write_run

PREFIXES = {"aggregate": (10, 0.2), "transform": (200, 0.05)}


def draw(rng, planted: str | None = None, factor: float = 1.15, run_noise: float = 0.02,
         wall_factor: float = 1.0) -> Profile:
    run = float(np.exp(rng.normal(0, run_noise)))
    samples = {}
    for prefix, (n, median) in PREFIXES.items():
        values = median * run * (factor if prefix == planted else 1.0) * np.exp(rng.normal(0, 0.1, n))
        samples[(prefix, "compute")] = Sample(n, float(values.sum()), values)
    return Profile(sum(s.total for s in samples.values()) / 4 * wall_factor, samples)


def comparison(base: Profile, new: Profile, past: list[Profile]) -> Comparison:
    changes, culprit, tests, band = compare_profiles(base, new, past)
    run = Run("c", "runs", None, 0.0)
    return Comparison("the run", run, run, (run,) * len(past), base.wall, new.wall, band,
                      tuple(changes), culprit, None, tests)


def test_a_ten_task_prefix_slowed_15_percent_is_inconclusive_or_slower_never_no_change():
    rng = np.random.default_rng(7)
    seen = {}
    for _ in range(60):
        past = [draw(rng) for _ in range(4)]
        c = comparison(draw(rng), draw(rng, "aggregate"), past)
        [agg] = [x for x in c.changes if x.prefix == "aggregate"]
        seen[agg.verdict] = seen.get(agg.verdict, 0) + 1
        assert agg.verdict in ("inconclusive", "slower"), (agg, c.sentences())
        assert c.verdict != "no change beyond noise"
        if agg.verdict == "inconclusive":
            [line] = [s for s in c.sentences() if s.startswith("inconclusive: prefix 'aggregate'")]
            assert f"{agg.ratio - 1:+.1%} [{agg.low - 1:+.1%}, {agg.high - 1:+.1%}], 10 / 10 tasks" in line
    assert seen.get("inconclusive")  # the data mostly cannot tell at this size


def test_a_large_prefix_unchanged_is_within_noise_and_slowed_is_found():
    rng = np.random.default_rng(8)
    found, resolved = 0, 0
    for _ in range(20):
        past = [draw(rng) for _ in range(4)]
        base = draw(rng)
        same = comparison(base, draw(rng), past)
        [t] = [x for x in same.changes if x.prefix == "transform"]
        assert t.verdict in ("within noise", "inconclusive"), t
        resolved += t.verdict == "within noise"
        assert same.verdict not in ("regression", "improvement")
        slow = comparison(base, draw(rng, "transform"), past)
        found += slow.verdict == "regression" and slow.culprit.prefix == "transform"
    # the band the history sets (from five medians) is itself noisy: a wide one
    # leaves even 200 tasks unable to rule out 15 % now and then
    assert resolved >= 15 and found >= 16, (resolved, found)


def test_holm_rejects_step_down():
    p = {"a": 0.001, "b": 0.013, "c": 0.04, "d": 0.5}
    # 0.001 <= 0.05/4, 0.013 <= 0.05/3, 0.04 > 0.05/2: stop
    assert regressions.holm(p) == {"a", "b"}
    # Bonferroni (0.05/4 = 0.0125) would have rejected only "a"
    assert {k for k, v in p.items() if v < 0.05 / 4} == {"a"}
    assert regressions.holm({}) == set()


def test_the_headline_follows_the_wall_times_own_test():
    rng = np.random.default_rng(9)
    past = [draw(rng, run_noise=0.0) for _ in range(4)]
    base = draw(rng, run_noise=0.0)
    c = comparison(base, draw(rng, run_noise=0.0, wall_factor=6.0), past)
    assert c.wall_verdict == "slower" and c.verdict == "wall time slower"
    first = c.sentences()[0]
    assert first.startswith("WALL TIME SLOWER: ") and "NO CHANGE" not in first
    assert any("the wall time moved outside the tasks compared" in s for s in c.sentences())


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    client = clickhouse.open_client(f"chdb://{tmp_path_factory.mktemp('verdicts') / 'ch'}")
    migrate(client, Target("blackbox", 90 * 86400))
    for i, (cid, seconds) in enumerate((("night-1", 1.0), ("night-2", 1.0), ("night-3", 0.2),
                                        ("night-4", 1.0))):
        t0 = 1000.0 * i
        write_run(client, cid, "nightly", [Task(f"work-{j}", t0 + j, t0 + j + seconds)
                                           for j in range(8)])
    # night-3 failed after a fifth of its work: three tasks erred
    client.insert("blackbox.transitions",
                  [["night-3", f"work-{j}", "scheduler", "work", "work", "s-etl", _t(2000.5),
                    "processing", "erred", "task-erred-1", "", [], [], []] for j in (5, 6, 7)],
                  column_names=["cluster_id", "key", "source", "prefix", "task_group", "span_id",
                                "ts", "start", "finish", "stimulus_id", "worker",
                                "startstops.action", "startstops.start", "startstops.stop"])
    b = backends.DirectBackend(client, "blackbox")
    yield b
    b.close()


def test_a_failed_baseline_is_passed_over_and_said(backend):
    c = regressions.compare(backend, cluster="nightly")
    assert c.candidate.cluster_id == "night-4" and c.baseline.cluster_id == "night-2"
    assert [r.cluster_id for r in c.history] == ["night-1"]
    assert any("passed over" in n and "3 erred task(s)" in n for n in c.notes), c.notes
    assert c.verdict not in ("regression", "improvement")


def test_compare_with_a_clusters_name_compares_its_whole_runs(backend):
    data = panels.compare(backend, "nightly", None)
    assert data["span"] is None and data["cluster"] == "nightly"
    assert data["verdict"]["candidate"]["cluster_id"] == "night-4"
    with pytest.raises(panels.NotFound, match="no span named 'nope'"):
        panels.compare(backend, "nope", None)
