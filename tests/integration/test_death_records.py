"""Every removal Dask did not expect is a death, wherever a death is shown, and each
death's words agree with its evidence.

One recorded run on the real local pipeline (Tansu, the sink on chDB, the alerter
posting to a webhook on loopback): a LocalCluster with nannies (processes=True,
2 GiB memory limits, allowed-failures 2). The producers are attached and, at once,
a task is submitted that SIGKILLs its own worker at low memory: it kills three
workers and fails with KilledWorker, its first deaths in the first moments after
``attach`` returned. Then a task that SIGABRTs its worker and one that calls
``os._exit(7)`` (KilledWorker each), and a worker whose nanny has no plugin (removed
from it) SIGKILLed from outside: a death no nanny recorded. The cluster closes a
moment later (the scheduler closing right after a death explains nothing), and its
close is the expected end of the workers left.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import uuid

import pytest
from distributed import Client, LocalCluster
from distributed.scheduler import KilledWorker

from dask_blackbox import producers
from dask_blackbox.causes import Exit, gather
from dask_blackbox.producers.scheduler import PLUGIN_NAME
from dask_blackbox.read import api, diagnosis, filters, panels, report
from dask_blackbox.read.views import diagnosis as diagnosis_view
from dask_blackbox.read.views import page
from dask_blackbox.read.views import task_stream as streams

from dask_blackbox.testing.alerts import Webhook
from conftest import pipeline_settings
from recording_support import recorded_through_pipeline, worker_env
from dask_blackbox.testing.polling import wait_for
from cluster_support import live_workers

pytestmark = pytest.mark.slow
LIMIT = 2 * 2**30
ALLOWED_FAILURES = 2
TESTS = pathlib.Path(__file__).parent


def sigkill_now(x):
    os.kill(os.getpid(), signal.SIGKILL)


def abort_now(x):
    os.abort()


def exit7_now(x):
    os._exit(7)


async def _drop_nanny_plugin(dask_worker=None):
    """On a nanny: remove the recorder's plugin (its worker's next end goes unrecorded)."""
    await dask_worker.plugin_remove(PLUGIN_NAME)
    return sorted(dask_worker.plugins)


#: plant -> (its task, the cause of each of its deaths, words the explanation holds)
PLANTS = {"sigkill-now": (sigkill_now, "killed", "SIGKILL"),
          "abort-now": (abort_now, "crashed", "SIGABRT"),
          "exit7-now": (exit7_now, "exited", "status 7")}


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("death-records")
    hook = Webhook()
    settings, bb_env = pipeline_settings(broker, "r" + uuid.uuid4().hex[:8], root / "data")
    env = worker_env(bb_env, TESTS)
    config = {**settings, "optimization.fuse.active": False,
              "blackbox.alerts.rules": [{"name": "deaths", "when": "worker-died", "webhook": hook.url}],
              "blackbox.alerts.evidence-wait": "2s",
              "distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
              "distributed.deploy.lost-worker-timeout": "1h"}
    truth: dict = {"env": env, "hook": hook}
    try:
        with recorded_through_pipeline(broker, config, lambda: _record(truth)) as backend:
            truth["backend"] = backend
            yield truth
    finally:
        hook.close()


def _record(truth: dict) -> None:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=LIMIT,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        truth["cluster_id"] = producers.attach(client, cluster_name="death-records", **{
            "producer.flush-interval": "20ms", "producer.metrics-interval": "200ms"})["cluster_id"]
        for key, (fn, *_) in PLANTS.items():  # the first one at once after attach
            with pytest.raises(KilledWorker):
                client.submit(fn, 1, key=key).result(timeout=120)
            client.wait_for_workers(2, timeout=90)
        # a worker whose nanny records nothing any more, SIGKILLed from outside
        victim = sorted(live_workers(client))[0]
        left = client.run(_drop_nanny_plugin, workers=[victim], nanny=True)
        assert PLUGIN_NAME not in next(iter(left.values()))
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: victim not in live_workers(client), 60, "the scheduler to remove it",
                 interval=0.1)
        truth["unrecorded"] = victim
        truth["dask_removals"] = [msg for _, msg in client.get_events("all")
                                  if msg.get("action") == "remove-worker"]
        wait_for(lambda: len(live_workers(client)) == 2, 60, "its nanny to restart it", interval=0.1)
        truth["closed"] = sorted(live_workers(client))
    # the scheduler closed within seconds of the last death


def _deaths(recorded) -> list[diagnosis.Death]:
    return diagnosis.deaths(recorded["backend"], [recorded["cluster_id"]])


def test_every_removal_dask_did_not_expect_is_a_death(recorded):
    """Dask's own removals before the close (its remove-worker events), each not
    expected: each is a death, by its stimulus."""
    unexpected = {m["stimulus_id"] for m in recorded["dask_removals"] if m["expected"] is False}
    assert len(unexpected) == len(PLANTS) * (ALLOWED_FAILURES + 1) + 1
    found = _deaths(recorded)
    by_stimulus = {d.stimulus_id: d for d in found}
    assert unexpected <= set(by_stimulus)
    assert all(by_stimulus[s].is_death for s in unexpected), [
        by_stimulus[s].verdict.summary for s in unexpected if not by_stimulus[s].is_death]
    assert {d.stimulus_id for d in found if d.is_death} == unexpected
    by_worker: dict[str, list[diagnosis.Death]] = {}
    for d in found:
        by_worker.setdefault(d.worker, []).append(d)
    # the workers the close ended are expected ends (their nannies recorded the close)
    closed = [d for w in recorded["closed"] if w != recorded["unrecorded"] for d in by_worker[w]]
    assert closed and all(d.verdict.cause.value == "expected" for d in closed), \
        [d.verdict for d in closed]


def test_deaths_right_after_attach_have_their_nanny_record(recorded):
    """Each planted KilledWorker's deaths, the first ones a moment after attach
    returned: one nanny record each, and the cause its exit says."""
    backend = recorded["backend"]
    killed = {k.key: k for k in diagnosis.killed_workers(backend, [recorded["cluster_id"]])}
    assert sorted(killed) == sorted(PLANTS)
    for key, (_, cause, words) in PLANTS.items():
        k = killed[key]
        assert len(k.deaths) == ALLOWED_FAILURES + 1, (key, k.deaths)
        for d in k.deaths:
            assert d.is_death and d.verdict.cause.value == cause, (key, d.verdict)
            assert words in d.verdict.summary, (key, d.verdict.summary)
            assert "worker_exits" in {e.source for e in d.verdict.evidence}, (key, d.verdict)
        assert k.suspects[0].key == key
    _, rows = backend.query(
        f"SELECT count() FROM {filters.table(backend, 'worker_exits')} "
        "WHERE cluster_id = {c:String} AND exitcode IS NOT NULL", {"c": recorded["cluster_id"]})
    assert rows[0][0] == len(PLANTS) * (ALLOWED_FAILURES + 1)


def test_a_sigkill_at_low_memory_does_not_blame_memory(recorded):
    killed = {k.key: k for k in diagnosis.killed_workers(recorded["backend"], [recorded["cluster_id"]])}
    for d in killed["sigkill-now"].deaths:
        [x] = [e for e in d.verdict.evidence if e.source == "worker_exits"]
        facts_exit = gather(d.removal, _exits(recorded)).exit
        assert facts_exit.memory_peak and facts_exit.memory_peak < 0.5 * LIMIT
        if facts_exit.host_memory_available >= 0.25 * facts_exit.host_memory:
            assert d.verdict.explanation.startswith("not memory: peak "), d.verdict
            assert "something outside Dask sent SIGKILL" in d.verdict.explanation
            assert "OOM" not in d.verdict.explanation
        else:  # the host itself was short: the OOM killer is a fair suspect
            assert "host short of memory" in d.verdict.explanation
        assert "process" in x.text


def _exits(recorded) -> list[Exit]:
    backend = recorded["backend"]
    _, rows = backend.query(
        "SELECT worker, pid, toFloat64(ts), exitcode, signal, memory, memory_peak, memory_limit, "
        "memory_terminate, host_memory, host_memory_available, nanny_status "
        f"FROM {filters.table(backend, 'worker_exits')} WHERE cluster_id = {{c:String}}",
        {"c": recorded["cluster_id"]})
    return [Exit(*r) for r in rows]


def test_a_death_no_nanny_recorded_is_unknown_not_expected(recorded):
    [d] = [d for d in _deaths(recorded) if d.worker == recorded["unrecorded"] and d.expected is False]
    assert d.is_death and d.verdict.cause.value == "unknown", d.verdict
    assert "no nanny record" in d.verdict.summary and "Dask did not expect it" in d.verdict.summary
    assert d.stimulus_id.split("-1")[0] in d.verdict.summary  # Dask's stimulus, as known


def test_why_the_panel_the_report_and_the_alerter_count_the_same_deaths(recorded, tmp_path):
    backend, cid = recorded["backend"], recorded["cluster_id"]
    deaths = [d for d in _deaths(recorded) if d.is_death]
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "why", "--cluster", "death-records",
                          "--data-dir", recorded["env"]["DASK_BLACKBOX__DATA_DIR"]],
                         env=recorded["env"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{len(deaths)} worker death(s), {len(PLANTS)} KilledWorker" in out.stdout, out.stdout
    chains = out.stdout.split("left as expected:")[-1] if "left as expected:" in out.stdout else ""
    assert "expected [" not in out.stdout  # no death counted against a task as expected
    assert "the scheduler closed right after" not in chains
    scope = panels.resolve(backend, cid)
    assert diagnosis_view.diagnosis_panel(backend, scope)["counts"]["deaths"] == len(deaths)
    assert api.run_panel(backend, "diagnosis", {"cluster": "death-records"})["counts"]["deaths"] == len(deaths)
    report.write_report(tmp_path / "r.html", "death-records", backend=backend)
    html = (tmp_path / "r.html").read_text()
    assert html.count('class="verdict death"') == len(deaths)
    hook = recorded["hook"]
    wait_for(lambda: len([p for p in hook.payloads() if p["rule"] == "deaths"]) >= len(deaths), 60,
             "the alerter to post every death")
    posted = [p for p in hook.payloads() if p["rule"] == "deaths"]
    assert sorted((p["worker"], p["cause"]) for p in posted) == sorted(
        (d.worker, d.verdict.cause.value) for d in deaths)


def test_a_task_running_when_its_worker_died_is_drawn_hatched(recorded):
    """The planted tasks reported no startstops (their workers died running them):
    each death still draws a bar for the task, on the dead worker's row, ending at
    the removal; the figure draws those bars hatched."""
    from dask_blackbox.read import figures

    backend, cid = recorded["backend"], recorded["cluster_id"]
    scope = panels.resolve(backend, cid)
    stream = streams.task_stream(backend, scope)
    assert stream["mode"] == "bars"
    died = [b for b in stream["bars"] if b["action"] == streams.DIED]
    chains = {k.key: k for k in diagnosis.killed_workers(backend, [cid])}
    for key in PLANTS:
        mine = sorted((b for b in died if b["key"] == key), key=lambda b: b["stop"])
        deaths = sorted(chains[key].deaths, key=lambda d: d.ts)
        assert [b["worker"] for b in mine] == [d.worker for d in deaths], (key, mine)
        for b, d in zip(mine, deaths):
            assert b["stop"] == pytest.approx(d.ts, abs=0.1) and b["start"] < b["stop"]
            assert stream["row_workers"][b["row"]] == d.worker
    drawer = figures.Figures(scope, page.markers(backend, scope), web=False)
    streams.figures(drawer, stream)
    fig = drawer.figures["task_stream"]
    [source] = [r.data_source for r in fig.renderers if r.data_source.name == "task-stream-died"]
    assert sorted(source.data["key"]) == sorted(b["key"] for b in died)
    [glyph] = [r.glyph for r in fig.renderers if r.data_source is source]
    assert glyph.hatch_pattern == "/"
    assert "running when their worker died" in fig.title.text


def test_the_export_sends_a_died_span_for_each_hatched_bar(recorded):
    """``dask-blackbox export otlp``'s trace of the run (built as the command builds
    it, before sending) has a ``died`` span for each hatched bar: each death of each
    planted task, the last one too (the removal that sent it to erred, the
    KilledWorker), on the dead worker, ending at the removal."""
    from dask_blackbox.cli.export import run_trace
    from dask_blackbox.read.runs import read_run

    backend, cid = recorded["backend"], recorded["cluster_id"]
    stream = streams.task_stream(backend, panels.resolve(backend, cid))
    hatched = sorted((b["key"], b["worker"], round(b["stop"] * 1e6))
                     for b in stream["bars"] if b["action"] == streams.DIED)
    spans = run_trace(backend, read_run(backend, cid, logs=False), 10**6)
    died = sorted((s.attributes["dask.task.key"], s.attributes["dask.worker.address"],
                   s.end_ns // 1000) for s in spans if s.attributes.get("dask.task.action") == "died")
    assert died == hatched
    for key in PLANTS:  # every allowed failure, and the fatal one
        assert sum(1 for k, _, _ in died if k == key) == ALLOWED_FAILURES + 1, (key, died)


def test_the_workers_table_peak_is_at_least_the_diagnosis_peak(recorded):
    """One peak per dead worker: the Workers table's is never below the one the
    Diagnosis names (its nanny's samples, or the RSS at a memory kill)."""
    from dask_blackbox.read.views import workers

    backend = recorded["backend"]
    scope = panels.resolve(backend, recorded["cluster_id"])
    rows = {r["worker"]: r for r in workers.workers(backend, scope)["workers"]}
    checked = 0
    for d in _deaths(recorded):
        if d.is_death and d.memory_peak:
            assert rows[d.worker]["memory_peak"] >= d.memory_peak, (d.worker, rows[d.worker])
            checked += 1
    assert checked >= len(PLANTS) * (ALLOWED_FAILURES + 1)
