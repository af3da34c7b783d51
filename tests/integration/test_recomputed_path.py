"""The critical path when keys are computed twice, on real clusters recorded by the
real pipeline (Tansu, the sink on chDB): it follows, finish by finish, the compute
that fed each dependent, and a recomputation after a death is its own part.

- ``reused``: a chain ``c-0`` .. ``c-5`` whose last task runs until the test lets it
  end; while it runs, the client computes ``c-2`` again (its first result was released once ``c-3`` had it):
  ``c-0`` .. ``c-2`` finish a second time, after ``c-3`` did, and before the run ends.
  The path is the chain as first computed.
- ``death``: the same chain on one worker, SIGKILLed while ``c-3`` runs; Dask computes
  ``c-0`` .. ``c-3`` again on the other worker. The path is the chain as computed
  after the death, and the time lost to it is the ``lost`` part.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
import uuid

import dask.config
import pytest
from bokeh.plotting import figure
from distributed import Client, LocalCluster

from dask_blackbox import producers
from dask_blackbox.deploy.supervisor import LocalPipeline
from dask_blackbox.read import backends, critical_path, panels, regressions, templates
from dask_blackbox.read.views import page
from dask_blackbox.read.views import task_stream as streams

from conftest import pipeline_settings
from dask_blackbox.testing.polling import wait_for
from sink_support import wait_loaded
from cluster_support import first_time, live_workers

pytestmark = pytest.mark.slow
CHAIN = [f"c-{i}" for i in range(6)]


def step(seconds: float, *deps) -> int:
    time.sleep(seconds)
    return 1



def held_once(seconds: float, *deps) -> int:
    """Runs long the first time (its worker is killed meanwhile), briefly after."""
    time.sleep(30 if first_time("c-3") else seconds)
    return 1


def held_until_gone(seconds: float, *deps) -> int:
    """Runs until the flag file ``c-5`` is gone (the test removes it)."""
    flag = pathlib.Path(os.environ["BLACKBOX_TEST_FLAGS"]) / "c-5"
    while flag.exists():
        time.sleep(0.05)
    return 1


def _chain(client: Client, third=step, last=step, n: int = len(CHAIN), **where) -> list:
    futures = [client.submit(step, 0.2, key=CHAIN[0], **where)]
    for i, key in enumerate(CHAIN[1:n], 1):
        fn = third if i == 3 else last if i == 5 else step
        futures.append(client.submit(fn, 0.2, futures[-1], key=key, **where))
    return futures


def _dask_tasks(dask_scheduler=None) -> int:
    """Dask's own count of the run's tasks: its root spans' states, summed."""
    return sum(sum(span.states.values())
               for span in dask_scheduler.extensions["spans"].root_spans)


def _held(keys, dask_scheduler=None) -> list[str]:
    """Those of ``keys`` whose results the scheduler still holds (or is computing)."""
    return [k for k in keys if k in dask_scheduler.tasks
            and dask_scheduler.tasks[k].state not in ("released", "forgotten")]


def _finishes(dask_scheduler=None) -> dict:
    """Dask's own record: per key, the times it went processing -> memory."""
    out: dict = {}
    for key, start, finish, *_, ts in dask_scheduler.transition_log:
        if start == "processing" and finish == "memory":
            out.setdefault(str(key), []).append(ts)
    return out


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("recomputed")
    flags = root / "flags"
    flags.mkdir()
    os.environ["BLACKBOX_TEST_FLAGS"] = str(flags)
    settings, _ = pipeline_settings(broker, "k" + uuid.uuid4().hex[:8], root / "data")
    out: dict = {}
    with dask.config.set({**settings, "optimization.fuse.active": False,
                          "distributed.scheduler.allowed-failures": 3,
                          "distributed.deploy.lost-worker-timeout": "1h"}):
        pipeline = LocalPipeline(kafka=broker, processors=1)  # spans' states: Dask's counts
        pipeline.start(progress=lambda m: None)
        try:
            out["reused"] = _record_reused()
            out["death"] = _record_death()
            wait_loaded()
            out["backend"] = backend = backends.running_sink()
            ids = [out["reused"]["cluster_id"], out["death"]["cluster_id"]]
            wait_for(lambda: backend.query(
                "SELECT uniqExact(cluster_id) FROM blackbox.span_state FINAL WHERE done "
                "AND cluster_id IN {ids:Array(String)}", {"ids": ids})[1][0][0] == 2, 120,
                "the processors' last span states")
            yield out
        finally:
            pipeline.stop(drain_timeout=0)


def _record_reused() -> dict:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        cid = producers.attach(client, cluster_name="reused-keys",
                               **{"producer.flush-interval": "20ms"})["cluster_id"]
        flag = pathlib.Path(os.environ["BLACKBOX_TEST_FLAGS"]) / "c-5"
        flag.write_text("")
        futures = _chain(client, last=held_until_gone)
        last = futures[-1]
        del futures[:-1]  # only the end is held: c-0 .. c-4 are released once used
        busy = wait_for(lambda: next((w for w, keys in client.processing().items()
                                      if "c-5" in {str(k) for k in keys}), None),
                        30, "the last link to run", interval=0.05)
        other = next(w for w in live_workers(client) if w != busy)
        # The client's releases reach the scheduler on a stream of their own, late on a
        # loaded machine: a key submitted again while Dask still holds its result is
        # not computed again.
        wait_for(lambda: not client.run_on_scheduler(_held, CHAIN[:3]), 60,
                 "the results of c-0 .. c-2 to be released", interval=0.05)
        again = _chain(client, n=3, workers=[other])  # c-0 .. c-2 again, beside it
        client.gather(again)
        del again
        flag.unlink()  # and only then does c-5 end
        assert last.result() == 1
        finishes = client.run_on_scheduler(_finishes)
        tasks = client.run_on_scheduler(_dask_tasks)
    assert [len(finishes[k]) for k in CHAIN] == [2, 2, 2, 1, 1, 1], finishes
    assert finishes["c-2"][1] > finishes["c-3"][0]  # a dependency computed again after its dependent
    return {"cluster_id": cid, "finishes": finishes, "dask_tasks": tasks}


def _record_death() -> dict:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        cid = producers.attach(client, cluster_name="death-recompute",
                               **{"producer.flush-interval": "20ms"})["cluster_id"]
        doomed = sorted(live_workers(client))[0]
        pid = client.run(os.getpid, workers=[doomed])[doomed]
        futures = _chain(client, third=held_once, workers=[doomed], allow_other_workers=True)
        wait_for(lambda: "c-3" in {str(k) for k in client.processing(workers=[doomed])[doomed]}, 30,
                 "c-3 to run", interval=0.05)
        time.sleep(0.5)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        assert client.gather(futures)[-1] == 1
        finishes = client.run_on_scheduler(_finishes)
        tasks = client.run_on_scheduler(_dask_tasks)
    return {"cluster_id": cid, "finishes": finishes, "killed": killed, "dask_tasks": tasks}


def test_reused_keys_follow_the_compute_that_fed_each_dependent(recorded):
    run = recorded["reused"]
    path = critical_path.critical_path(recorded["backend"], run["cluster_id"])
    assert [link.key for link in path.links] == CHAIN, (
        [(link.key, link.stop, link.compute_stop, link.found_by) for link in path.links],
        run["finishes"], path.t1, path.notes)
    # each link is the first computation: it arrived when Dask's first record says
    first = {k: v[0] for k, v in run["finishes"].items()}
    for link in path.links:
        assert link.stop == pytest.approx(first[link.key], abs=0.05) or link.key == CHAIN[-1]
    assert path.parts["scheduler"] < 0.5 * path.wall, path.parts
    assert sum(path.parts.values()) == pytest.approx(path.wall)
    assert not any("not followed" in n for n in path.notes), path.notes


def test_a_recomputation_after_a_death_is_its_own_part_of_the_path(recorded):
    run = recorded["death"]
    path = critical_path.critical_path(recorded["backend"], run["cluster_id"])
    assert [link.key for link in path.links] == CHAIN, [link.key for link in path.links]
    last = {k: v[-1] for k, v in run["finishes"].items()}
    for link in path.links[:-1]:  # the computations after the death
        assert link.stop == pytest.approx(last[link.key], abs=0.05)
        assert link.compute_start > run["killed"] - 0.5
    assert path.links[0].parts["lost"] > 0 and path.links[0].parts["client"] == 0
    assert path.parts["lost"] >= run["killed"] - path.t0 - 0.5
    assert sum(path.parts.values()) == pytest.approx(path.wall)


def test_the_outline_is_drawn_on_the_bar_it_names(recorded):
    backend = recorded["backend"]
    for name in ("reused", "death"):
        scope = panels.resolve(backend, recorded[name]["cluster_id"])
        stream = streams.task_stream(backend, scope)
        path = panels.critical_path(backend, scope)
        assert stream["mode"] == "bars"
        fig = figure()
        streams.critical_path_outline(fig, stream, path)
        [source] = [r.data_source for r in fig.renderers if r.data_source.name == "critical-path"]
        bars = {(b["key"], b["row"]): b for b in stream["bars"] if b["action"] == "compute"}
        for key, left, bottom in zip(source.data["key"], source.data["left"], source.data["bottom"]):
            row = round(bottom + 0.45)
            bar = bars[(key, row)]  # a compute bar of that key on that row ...
            link = next(lk for lk in path["links"] if lk["key"] == key)
            assert bar["start"] == pytest.approx(link["compute_start"], abs=1e-3)  # ... the link's


def test_one_task_count_dasks_with_the_recomputations_named(recorded):
    """The heading counts tasks as Dask does (its spans' states: a key submitted again
    after it was forgotten is a task again; one computed again while Dask kept it is
    not), names the distinct keys when they differ and the results computed again;
    Compare's tasks are the same count, not the computes."""
    backend = recorded["backend"]
    for name in ("reused", "death"):
        run = recorded[name]
        ctx = page.context(backend, {"cluster": run["cluster_id"]})
        head = page.summary(ctx)
        assert head["tasks_counted"] == "dask"
        assert head["tasks"] == run["dask_tasks"], name
        assert head["distinct_keys"] == len(CHAIN)
        # the transitions into memory beyond each key's first, as Dask's own log has them
        assert head["recomputed"] == sum(len(v) - 1 for v in run["finishes"].values()) == 3
    # the keys computed again (held by a dependent, or lost in the death) stayed the same
    # tasks for Dask: its count is the keys'; the computes were 9
    assert recorded["reused"]["dask_tasks"] == recorded["death"]["dask_tasks"] == len(CHAIN)
    env = templates.env()
    reused = recorded["reused"]["cluster_id"]
    ctx = page.context(backend, {"cluster": reused})
    html = env.get_template("header.html").render(head=page.summary(ctx), scope=ctx.scope)
    assert f"<b>{len(CHAIN)}</b> tasks, <b>3</b> recomputed" in html
    [death] = regressions.cluster_runs(backend, "death-recompute")
    [again] = regressions.cluster_runs(backend, "reused-keys")
    comparison = regressions.compare_runs(backend, death, again, with_path=False)
    [tasks] = [row for row in comparison.table if row[0] == "tasks"]
    assert list(tasks[1:]) == [len(CHAIN), len(CHAIN)]
