"""What changed between two runs, by function, against a slowdown planted in one of
two functions: real LocalClusters (two worker processes, Dask's profiler every
5 ms) on the real local pipeline (Tansu, the sink on chDB).

Two runs of cluster ``fn-test`` compute the same tasks of prefix ``fnwork``; each
task spends the same time in ``steady`` and in ``slowed``, in turns (pure-Python busy loops:
the profiler samples the frames of executing Python), and in the second run
``slowed`` spends twice as long (its own time, the samples in which it is the
innermost frame, is the measure). The loops run for an amount of the thread's CPU time:
the profiler samples a thread when it runs (it takes the GIL from it), so on a
machine that runs other jobs their samples follow their CPU time, while their wall
time stretches by whatever load comes and goes (two to four times, on a shared
2-core machine). A busier machine in one run moves every frame's time with the
prefix's, not their shares: ``steady`` may then have "grown with its prefix", never
"grown". ``compare --cluster fn-test`` names ``slowed`` as grown
under its prefix, and not ``steady`` (whose share of the samples fell, its seconds
not), whenever Dask's own profile shows the plant (on a heavily loaded machine its
samples need not follow CPU time; compare then never says ``slowed`` grew on its own
when its share fell). Two runs of ``fn-unprofiled`` record with ``producer.record.profiles`` off:
compare says so in one line. The Compare page shows the same frames.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import time
import uuid

import dask.config
import pytest
from distributed import Client, LocalCluster

from dask_blackbox import producers
from dask_blackbox.cli import main as cli
from dask_blackbox.deploy.supervisor import LocalPipeline
from dask_blackbox.read import api, backends, function_changes, profiles, regressions, report

from conftest import pipeline_settings
from dask_blackbox.testing.planted import fnwork
from sink_support import wait_loaded

pytestmark = pytest.mark.slow
#: CPU seconds a task spends in each function, tasks a run, the planted factor
SPIN = 0.25
TASKS = 48
#: twice the time (bench/function_regressions.py measures a 30 % plant): a loaded
#: machine moves the profile's shares by about as much as 30 %
PLANTED = 2.0


def quick(i: int) -> int:
    time.sleep(0.05)
    return i


def _run(name: str, factor: float, processes: bool = True, **overrides) -> str:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=processes,
                      dashboard_address=":0", silence_logs=50) as cluster, \
            Client(cluster) as client:
        cluster_id = producers.attach(client, cluster_name=name, **{
            "producer.flush-interval": "20ms", **overrides})["cluster_id"]
        if processes:
            futures = client.map(fnwork, range(TASKS), spin=SPIN, factor=factor,
                                 key=[f"fnwork-{i}" for i in range(TASKS)])
        else:
            futures = client.map(quick, range(8), key=[f"quick-{i}" for i in range(8)])
        assert len(client.gather(futures)) == len(futures)
    return cluster_id


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("function-changes")
    settings, env = pipeline_settings(broker, "g" + uuid.uuid4().hex[:8], root / "data")
    out: dict = {"env": env, "settings": settings}
    # a sample every 5 ms (Dask's default is 10): on a loaded machine the profiler
    # thread wakes less often than asked
    with dask.config.set({**settings, "distributed.worker.profile.interval": "5ms"}):
        pipeline = LocalPipeline(kafka=broker, processors=0)
        pipeline.start(progress=lambda m: None)
        try:
            out["base"] = _run("fn-test", 1.0)
            out["slow"] = _run("fn-test", PLANTED)
            for _ in range(2):
                _run("fn-unprofiled", 1.0, processes=False, **{"producer.record.profiles": False})
            wait_loaded()
            out["backend"] = backends.running_sink()
            yield out
        finally:
            pipeline.stop(drain_timeout=0)


def _cli(recorded, *args) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with dask.config.set(recorded["settings"]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _shares(recorded, run: str) -> dict[str, float]:
    """Each frame's own share of the prefix's samples in a run, as compare reads them."""
    r = regressions.cluster_runs(recorded["backend"], "fn-test")
    (mine,) = [x for x in r if x.cluster_id == recorded[run]]
    s = function_changes._samples(function_changes.read(recorded["backend"], mine, "fnwork"),
                                  1.0, 1)
    return {profiles.frame(t).function: n / s.samples for t, n in s.own.items()}


def test_compare_names_the_function_planted_slower_and_not_the_other(recorded):
    out = _cli(recorded, "compare", "--cluster", "fn-test", "--format", "json")
    assert out.returncode == 0, out.stderr
    verdict = json.loads(out.stdout)["verdict"]
    assert verdict["candidate"]["cluster_id"] == recorded["slow"]
    functions = verdict["functions"]
    assert functions["missing"] is None and functions["prefix"] == "fnwork"
    said = functions["sentences"]
    grown = {c["function"]: c for c in functions["grown"]}
    base, slow = _shares(recorded, "base"), _shares(recorded, "slow")
    if not slow["slowed"] / base["slowed"] > 1 > slow["steady"] / base["steady"]:
        # Dask's own profile did not see the plant: on a loaded machine (load 10 on 2
        # cores) its samples can follow neither function's CPU time, and slowed's share
        # of them fell. Compare reads those samples: it must not say slowed grew on its own.
        assert grown.get("slowed", {}).get("verdict") != "grew", (base, slow, said)
        return
    # steady spent the same CPU time: never said to have grown on its own
    assert "steady" not in grown or grown["steady"]["verdict"] != "grew", said
    # what grew on its own: slowed, or the helper both loops call (slowed calls it more)
    assert {c["function"] for c in functions["grown"] if c["verdict"] == "grew"} <= {
        "slowed", "_tick"}, said
    # slowed: when the prefix's time per task did not fall (a machine less busy in the
    # second run can hide the plant), the most seconds grown, and beyond the noise
    compute = next(c for c in verdict["changes"] if c["action"] == "compute")
    if compute["ratio"] >= 1:
        assert functions["grown"][0]["function"] == "slowed", said
        assert grown["slowed"]["verdict"] in ("grew", "grew with its prefix"), said


def test_compare_prints_the_grown_frames_under_the_prefix_within_120_columns(recorded):
    out = _cli(recorded, "compare", "--cluster", "fn-test")
    assert out.returncode == 0, out.stderr
    assert all(len(line) <= 120 for line in out.stdout.splitlines())
    text = out.stdout
    changes = text.index("== changes per prefix")
    section = text.index("== frames of prefix 'fnwork' whose own time grew")
    assert changes < section
    rows = text[section:].split("\n\n", 1)[0].splitlines()
    assert not any(re.search(r"\bgrew\b(?! with)", r) for r in rows if "steady" in r)
    grown = json.loads(_cli(recorded, "compare", "--cluster", "fn-test", "--format",
                            "json").stdout)["verdict"]["functions"]["grown"]
    for c in grown:  # every frame listed, with its verdict, in the order of the JSON
        row = next(r for r in rows if r.startswith(c["function"] + " "))
        assert c["verdict"] in row and rows.index(row) == 3 + grown.index(c)
    assert len([r for r in rows if "planted.py" in r or "/" in r]) <= 5


def test_runs_without_profiles_say_so_in_one_line(recorded):
    out = _cli(recorded, "compare", "--cluster", "fn-unprofiled", "--format", "json")
    assert out.returncode == 0, out.stderr
    functions = json.loads(out.stdout)["verdict"]["functions"]
    assert functions["grown"] == [] and functions["missing"].startswith(
        "no profiles recorded for prefix 'quick'")
    text = _cli(recorded, "compare", "--cluster", "fn-unprofiled").stdout
    lines = [line for line in text.splitlines() if "no profiles recorded" in line]
    assert len(lines) == 1 and "frames of prefix" not in text


def test_the_compare_page_shows_the_same_frames(recorded):
    with dask.config.set(recorded["settings"]):
        compared = api.compare(recorded["backend"], {"cluster": "fn-test"})
    page = report.render_page("compare.html", web=False, cmp=compared, spans=[], query={},
                              generated=0, page_title="compare",
                              figures=report.compare_figures(compared))
    assert 'id="functions-panel" data-prefix="fnwork"' in page
    assert 'data-function="steady" data-verdict="grew"' not in page
    for c in compared["verdict"]["functions"]["grown"]:
        assert f'data-function="{c["function"]}" data-verdict="{c["verdict"]}"' in page
    if compared["verdict"]["functions"]["grown"]:
        assert 'id="function-changes"' in page
        assert "compare_functions" in page  # the figure beside its table



