"""Why did my worker die: every cause planted in one real cluster, named with its
evidence after the cluster is gone, and alerted on while it lived.

One recorded run (module scope) on the real local pipeline (``LocalPipeline``: Tansu,
faust, the sink on chDB, and the alerter, which ``up`` starts because alert rules are
configured, posting to a webhook on loopback): a LocalCluster with nannies
(processes=True, a 400 MiB memory limit, a short worker-ttl, allowed-failures=1), a
``dask worker`` subprocess with a nanny of its own (a separate nanny process, whose
records ship through the nanny's producer) and one without a nanny. Planted, one
after the other, each on a chosen worker:

- ``exit3``: a task calls ``os._exit(3)`` (after logging an error on its own logger)
- ``sigkill``: a task SIGKILLs its own process
- ``segv``: a task reads address 0 (``ctypes.string_at(0)``)
- ``gil``: a task holds the GIL (a C sleep through ``ctypes.PyDLL``) past worker-ttl
- ``hog-once``: a task allocates past the memory limit (the nanny terminates it)
- the worker without a nanny is SIGKILLed from outside
- ``hog-killed``: a task that always allocates past the limit, among innocent tasks:
  it dies twice and fails with KilledWorker
- ``retire_workers``, ``client.restart()``, stopping the subprocess worker, and
  ``cluster.close()``: expected ends.

Each planted task dies on its first run only (a flag file), so its retry succeeds and
each plant is one death.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import uuid

import dask.config
import orjson
import pytest
from distributed import Client, LocalCluster
from distributed.scheduler import KilledWorker

from dask_blackbox import contract, producers
from dask_blackbox.read import api, diagnosis, filters, held_memory, panels, queries, report
from dask_blackbox.read.views import failures as failure_view
from dask_blackbox.read.views import diagnosis as diagnosis_view
from dask_blackbox.read.views import page
from dask_blackbox.read.views import task_stream as streams

from dask_blackbox.testing.alerts import Cluster, Webhook
from conftest import pipeline_settings
from recording_support import recorded_through_pipeline, worker_env
from dask_blackbox.testing.polling import wait_for
from sink_support import produce, wait_loaded
from cluster_support import GIL_TTL, first_time, live_workers

pytestmark = pytest.mark.slow  # one recorded run of about a minute and a half
LIMIT = 400 * 2**20
#: this module (its tasks are pickled by reference) and the support modules it imports
HERE = pathlib.Path(__file__).resolve().parent
TESTS = (HERE, HERE.parent)


def die_exit3(x):
    if first_time("exit3"):
        logging.getLogger("myjob").error("about to call os._exit(3)")
        time.sleep(0.3)  # the log line leaves first
        os._exit(3)
    return x


def die_sigkill(x):
    if first_time("sigkill"):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def die_segv(x):
    if first_time("segv"):
        time.sleep(0.3)
        ctypes.string_at(0)
    return x


def hold_gil(x):
    if first_time("gil"):
        time.sleep(0.3)
        ctypes.PyDLL(None).sleep(60)  # a C call that keeps the GIL: no heartbeat
    return x


def _allocate_past_the_limit() -> None:
    """Allocate until the nanny terminates this process for memory."""
    time.sleep(0.3)
    hoard = []
    while True:
        hoard.append(bytearray(16 * 2**20))
        time.sleep(0.02)
        if len(hoard) * 16 * 2**20 > 4 * LIMIT:  # the nanny never came: don't hang
            os._exit(1)


def hog_once(x):
    if first_time("hog-once"):
        _allocate_past_the_limit()
    return x


def hog(x):
    _allocate_past_the_limit()


def innocent(x):
    time.sleep(0.2)
    return x + 1


def _start_worker(scheduler: str, name: str, env: dict, nanny: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "distributed.cli.dask_worker", scheduler, "--nthreads", "1",
           "--name", name, "--memory-limit", str(LIMIT), "--no-dashboard"]
    if not nanny:
        cmd.append("--no-nanny")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _worker_named(client: Client, name: str) -> str:
    return next(a for a, w in live_workers(client).items() if str(w["name"]) == name)


def _pid(client: Client, worker: str) -> int:
    return client.run(os.getpid, workers=[worker])[worker]


def _set(name, value, dask_scheduler=None):
    """Set a scheduler attribute (worker_ttl, allowed_failures) while it runs."""
    setattr(dask_scheduler, name, value)


def _heartbeats_recent(dask_scheduler=None) -> bool:
    """Whether every worker heartbeated in the last second."""
    now = time.time()
    return all(now - ws.last_seen < 1.0 for ws in dask_scheduler.workers.values())


def _gone(client: Client, workers) -> bool:
    return not set(workers) & set(live_workers(client))


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("deaths")
    flags = root / "flags"
    flags.mkdir()
    os.environ["BLACKBOX_TEST_FLAGS"] = str(flags)
    hook = Webhook()
    commands = root / "killed-workers.jsonl"
    rules = [
        {"name": "deaths", "when": "worker-died", "webhook": hook.url},
        {"name": "crashes", "when": "worker-died", "causes": ["crashed"], "webhook": hook.url + "?crash"},
        {"name": "kw", "when": "killed-worker", "command": [
            sys.executable, "-c",
            f"import sys; open({str(commands)!r}, 'a').write(sys.stdin.read() + '\\n')"]},
        {"name": "hogs", "when": "task-erred", "prefix": ["hog-killed", "hog-once"],
         "webhook": hook.url + "?hogs"},
    ]
    settings, bb_env = pipeline_settings(broker, "d" + uuid.uuid4().hex[:8], root / "data")
    env = worker_env(bb_env, *TESTS)
    truth: dict = {"root": root, "env": env, "hook": hook, "commands": commands, "victims": {},
                   "settings": settings}
    config = {**settings, "blackbox.alerts.rules": rules, "blackbox.alerts.evidence-wait": "2s",
              "optimization.fuse.active": False,
              "distributed.scheduler.allowed-failures": 1,
              # checked every second; GIL_TTL while the GIL is held, an hour
              # otherwise, so that a worker slow to heartbeat on a loaded machine
              # is not taken for a hung one
              "distributed.scheduler.worker-ttl": "1s",
              # the cluster never closes a nanny whose worker was briefly gone
              "distributed.deploy.lost-worker-timeout": "1h",
              "distributed.worker.memory.terminate": 0.9}
    subprocesses: list[subprocess.Popen] = []
    # no stream processors: nothing here reads spans or prefix statistics
    try:
        with recorded_through_pipeline(broker, config,
                                       lambda: _record(truth, env, subprocesses)) as backend:
            truth["backend"] = backend
            try:
                yield truth
            finally:
                _kill(subprocesses)  # before the pipeline stops
    finally:
        _kill(subprocesses)
        hook.close()


def _kill(subprocesses: list[subprocess.Popen]) -> None:
    for proc in subprocesses:
        if proc.poll() is None:
            proc.kill()


def _record(truth: dict, env: dict, subprocesses: list) -> None:
    victims = truth["victims"]
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, memory_limit=LIMIT,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        truth["cluster_id"] = producers.attach(client, cluster_name="deaths-test", **{
            "producer.flush-interval": "20ms", "producer.metrics-interval": "200ms"})["cluster_id"]
        client.run_on_scheduler(_set, "worker_ttl", 3600)
        address = cluster.scheduler_address
        subprocesses += [_start_worker(address, "sub-nanny", env, nanny=True),
                         _start_worker(address, "no-nanny", env, nanny=False)]
        client.wait_for_workers(6, timeout=90)
        local = lambda: sorted(a for a, w in live_workers(client).items()  # noqa: E731
                               if str(w["name"]) not in ("sub-nanny", "no-nanny"))
        # 1. The GIL held past worker-ttl, alone: the ttl is GIL_TTL only while every
        # worker heartbeats and this plant runs. A shorter one (Dask's floor is 5 s at
        # this size) also times out a worker that a loaded machine keeps from
        # heartbeating, and the plant's retry dies with it: a KilledWorker.
        wait_for(lambda: client.run_on_scheduler(_heartbeats_recent), 60, "every worker to heartbeat")
        victims["gil"] = local()[0]
        client.run_on_scheduler(_set, "worker_ttl", GIL_TTL)
        future = client.submit(hold_gil, 1, key="gil", workers=[victims["gil"]], allow_other_workers=True)
        assert future.result(timeout=90) == 1
        client.run_on_scheduler(_set, "worker_ttl", 3600)
        client.wait_for_workers(6, timeout=90)
        # 2. Five deaths at once, each on its own worker (a retry that lands on another
        # dying worker must not make a planted task fail with KilledWorker here).
        client.run_on_scheduler(_set, "allowed_failures", 100)
        sub, lone = _worker_named(client, "sub-nanny"), _worker_named(client, "no-nanny")
        truth["sub_nanny_worker"] = sub
        l0, l1, l2, _ = local()
        victims.update({"exit3": sub, "sigkill": l0, "segv": l1, "hog-once": l2, "no-nanny": lone})
        lone_pid = _pid(client, lone)
        futures = [client.submit(fn, 1, key=key, workers=[victims[key]], allow_other_workers=True)
                   for key, fn in (("exit3", die_exit3), ("sigkill", die_sigkill), ("segv", die_segv),
                                   ("hog-once", hog_once))]
        os.kill(lone_pid, signal.SIGKILL)  # the worker without a nanny, from outside
        wait_for(lambda: _gone(client, victims.values()), 90, "the planted deaths", interval=0.1)
        assert client.gather(futures) == [1, 1, 1, 1]
        client.wait_for_workers(5, timeout=90)
        client.run_on_scheduler(_set, "allowed_failures", 1)
        # 3. KilledWorker: a task that always exceeds the limit, among innocent tasks
        innocents = client.map(innocent, range(40), key=[f"innocent-{i}" for i in range(40)])
        doomed = client.submit(hog, 1, key="hog-killed")
        with pytest.raises(KilledWorker):
            doomed.result(timeout=120)
        client.gather(innocents, errors="skip")
        client.wait_for_workers(5, timeout=90)
        # 4. Expected ends (a retirement, a restart, the close) and a SIGTERM from outside
        victims["retired"] = local()[0]
        client.retire_workers([victims["retired"]])
        truth["restarted"] = sorted(live_workers(client))
        client.restart()
        client.wait_for_workers(4, timeout=90)
        victims["sigterm"] = _worker_named(client, "sub-nanny")
        subprocesses[0].send_signal(signal.SIGTERM)
        subprocesses[0].wait(60)
        wait_for(lambda: _gone(client, [victims["sigterm"]]), 60, "the SIGTERMed worker to leave")
        truth["closed"] = sorted(live_workers(client))
        truth["dask_removals"] = [msg for _, msg in client.get_events("all")
                                  if msg.get("action") == "remove-worker"]


PLANTED = {  # plant -> (cause, words its explanation must hold, an evidence source it must cite)
    "exit3": ("exited", "status 3", "worker_exits"),
    "sigkill": ("killed", "SIGKILL", "worker_exits"),
    "segv": ("crashed", "SIGSEGV", "worker_exits"),
    "gil": ("unresponsive", "worker-ttl", "events"),
    "hog-once": ("memory-limit", "limit", "events"),
    "no-nanny": ("unknown", "no nanny", "lifecycle"),
    "sigterm": ("killed", "SIGTERM", "events"),
}


def _deaths(recorded) -> list[diagnosis.Death]:
    return diagnosis.deaths(recorded["backend"], [recorded["cluster_id"]])


def test_each_planted_cause_is_named_with_its_evidence(recorded):
    found = {d.worker: d for d in _deaths(recorded)}
    for plant, (cause, words, source) in PLANTED.items():
        d = found[recorded["victims"][plant]]
        v = d.verdict
        assert v.cause.value == cause, (plant, v)
        assert words in v.summary, (plant, v.summary)
        assert source in {e.source for e in v.evidence}, (plant, v.evidence)
        assert d.is_death
    # the nanny's kill at the terminate fraction, against the limit
    hog = found[recorded["victims"]["hog-once"]]
    assert hog.memory_peak >= 0.9 * LIMIT and hog.memory_limit == LIMIT
    assert "terminates at 90%" in hog.verdict.summary
    assert found[recorded["victims"]["no-nanny"]].nanny is None
    # Dask's own record of each planted death: the scheduler did not expect it, and it
    # released the planted task
    # Dask's record of each planted death: not expected, and running the planted task,
    # as the diagnosis lists it
    dask_view = {m["worker"]: m for m in recorded["dask_removals"]}
    dx = diagnosis.diagnose(recorded["backend"], ids=[recorded["cluster_id"]])
    tasks_of = {d["worker"]: {t["key"] for t in d["tasks"]} for d in dx["deaths"]}
    for plant in ("exit3", "sigkill", "segv", "gil", "hog-once"):
        victim = recorded["victims"][plant]
        m = dask_view[victim]
        assert m["expected"] is False
        assert tasks_of[victim] == {str(k) for k in m["processing-tasks"]} and plant in tasks_of[victim]


def test_what_each_dying_worker_held_is_what_dask_said_its_removal_lost(recorded):
    """Without the workers' own transitions, and no task here depending on another (no
    replica anywhere), the keys a dying worker held are those Dask's remove-worker
    event says the cluster lost with it; the KilledWorker's task never finished, so
    its own result's size is unknown, and said so."""
    deaths = [d for d in _deaths(recorded) if d.is_death]
    held = held_memory.at_deaths(recorded["backend"], deaths, top=1000)
    lost = {m["worker"]: {str(k) for k in m["lost-computed-tasks"]} for m in recorded["dask_removals"]}
    for d, h in zip(deaths, held):
        assert {k.key for k in h.top} == lost[d.worker], d.worker
        assert h.keys == len(lost[d.worker]) == d.lost_computed_tasks and h.unknown == 0
        assert h.recorded and not h.replicas_recorded
    hogs = [h for h in held if any(r.key == "hog-killed" for r in h.running)]
    assert len(hogs) == 2
    for h in hogs:
        [r] = [r for r in h.running if r.key == "hog-killed"]
        assert (r.nbytes, r.finished) == (None, 0)
        assert "running hog-killed: its result unknown (it never finished)" in h.lines()[-1]


def test_each_worker_process_ended_once(recorded):
    """A nanny publishes one exit per process it ran, even while Dask's WorkerProcess
    still holds the dead process as it starts the next one."""
    backend = recorded["backend"]
    exits = filters.table(backend, "worker_exits")
    _, rows = backend.query(
        f"SELECT pid, count() FROM {exits} "
        "WHERE cluster_id = {c:String} GROUP BY pid HAVING count() > 1",
        {"c": recorded["cluster_id"]})
    assert rows == []
    _, (n,) = backend.query(
        f"SELECT count() FROM {exits} WHERE cluster_id = {{c:String}}",
        {"c": recorded["cluster_id"]})
    assert n[0] >= len(PLANTED)


def test_expected_ends_are_not_deaths(recorded):
    found = {d.worker: d for d in _deaths(recorded)}
    retired = found[recorded["victims"]["retired"]]
    assert retired.verdict.cause.value == "expected" and "retired" in retired.verdict.summary
    restarted = [found[w] for w in recorded["restarted"] if w != recorded["victims"]["retired"]]
    assert restarted and all(d.verdict.cause.value == "expected" for d in restarted)
    assert all("client.restart" in d.verdict.summary for d in restarted)
    closed = [found[w] for w in recorded["closed"]]
    assert closed and all(d.verdict.cause.value == "expected" for d in closed), [d.verdict for d in closed]


def test_killed_worker_names_its_chain_and_the_planted_suspect(recorded):
    backend = recorded["backend"]
    killed = diagnosis.killed_workers(backend, [recorded["cluster_id"]])
    by_key = {k.key: k for k in killed}
    assert "hog-killed" in by_key
    for k in killed:  # an innocent that shared both deaths fails too; its suspect is the hog
        assert k.suspects[0].key == "hog-killed", (k.key, k.suspects)
        assert len(k.deaths) == 2
        assert [d.verdict.cause.value for d in k.deaths] == ["memory-limit", "memory-limit"]
    hog = by_key["hog-killed"]
    assert hog.exception.startswith("KilledWorker")
    assert hog.prefix == "hog-killed"  # Dask's key_split
    # the innocents' prefix may have been there at both deaths too (other keys each time)
    assert "hog-killed" in hog.prefixes and set(hog.prefixes) <= {"hog-killed", "innocent"}
    assert all(p and p >= 0.9 * LIMIT for p in hog.peak_memory) and hog.memory_limit == LIMIT
    assert hog.confidence in ("high", "medium")
    # the deaths of the chain are the removals Dask's remove-worker events say ran it
    ran = {m["worker"] for m in recorded["dask_removals"]
           if "hog-killed" in {str(k) for k in m["processing-tasks"]}}
    assert {d.worker for d in hog.deaths} == ran


def test_death_counts_agree_on_every_page(recorded):
    backend, cid = recorded["backend"], recorded["cluster_id"]
    deaths = [d for d in _deaths(recorded) if d.is_death]
    assert len(deaths) == len(PLANTED) + 2  # hog-killed died twice
    [row] = [c for c in panels.clusters(backend)["clusters"] if c["cluster_id"] == cid]
    assert row["workers_lost"] == len(deaths)
    scope = panels.resolve(backend, cid)
    assert len(page.markers(backend, scope)["deaths"]) == len(deaths)
    assert diagnosis_view.diagnosis_panel(backend, scope)["counts"]["deaths"] == len(deaths)
    answer = api.run_panel(backend, "diagnosis", {"cluster": "deaths-test"})  # the JSON API's
    assert answer["counts"]["deaths"] == len(deaths)
    assert {d["worker"]: d["cause"] for d in answer["deaths"]} == {
        d.worker: d.verdict.cause.value for d in deaths}
    one = api.run_panel(backend, "diagnosis", {"cluster": "deaths-test", "key": "hog-killed"})
    assert [k["key"] for k in one["killed_workers"]] == ["hog-killed"] and len(one["deaths"]) == 2
    columns, rows = queries.clusters(backend, cluster=cid)
    assert rows[0][columns.index("workers_lost")] == len(deaths)
    assert rows[0][columns.index("workers_removed")] > len(deaths)  # the expected ends too
    # the post-mortem's dead workers are the deaths that interrupted tasks
    failures = failure_view.failures(backend, scope)
    assert {w["worker"] for w in failures["dead_workers"]} == {
        d.worker for d in deaths if d.processing_tasks}


def test_why_prints_a_verdict_per_death_and_killed_worker_in_120_columns(recorded):
    data_dir = recorded["env"]["DASK_BLACKBOX__DATA_DIR"]
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "why", "--cluster", "deaths-test",
                          "--data-dir", data_dir], env=recorded["env"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 120
    verdicts = [line for line in lines if re.match(r"\[\d+\] \d\d:\d\d:\d\d\.\d{3}  ", line)]
    assert sum("KilledWorker hog-killed: suspect hog-killed" in v for v in verdicts) == 1
    for plant, (cause, *_) in PLANTED.items():
        worker = recorded["victims"][plant]
        label = diagnosis.Cause(cause).label
        assert any(worker in v and label in v for v in verdicts), (plant, verdicts)
    assert "os._exit(3)" in out.stdout  # the user's own log line, as evidence
    assert "Worker process" in out.stdout  # the nanny's line about a process's end
    # --key: that KilledWorker and its two deaths only
    one = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "why", "--cluster", "deaths-test",
                          "--key", "hog-killed", "--format", "json", "--data-dir", data_dir],
                         env=recorded["env"], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    answer = json.loads(one.stdout)
    assert [k["key"] for k in answer["killed_workers"]] == ["hog-killed"]
    assert len(answer["deaths"]) == 2


def test_logs_search_by_worker_returns_its_own_and_its_nannys_records(recorded):
    backend, sub = recorded["backend"], recorded["sub_nanny_worker"]
    columns, rows = queries.logs(backend, cluster="deaths-test", worker=sub, limit=10_000)
    got = [dict(zip(columns, r)) for r in rows]
    assert {r["worker"] for r in got} == {sub}
    sources = {r["source"] for r in got}
    assert {"worker", "nanny"} <= sources
    assert any(r["source"] == "nanny" and "exited with status 3" in r["message"] for r in got)
    mine = [r for r in got if r["logger"] == "myjob"]
    assert [r["key"] for r in mine] == ["exit3"] and mine[0]["level"] == "ERROR"
    # the JSON API's filter is the same search
    data = api.run_panel(backend, "logs", {"cluster": "deaths-test", "worker": sub, "limit": "10000"})
    assert data["total"] == len(got) and {line["worker"] for line in data["lines"]} == {sub}
    # level, logger and text narrow it; the CLI prints one line a record
    assert queries.logs_count(backend, cluster="deaths-test", logger="myjob", level="error") == 1
    assert queries.logs_count(backend, cluster="deaths-test", text="OS._EXIT(3)") == 1
    data_dir = recorded["env"]["DASK_BLACKBOX__DATA_DIR"]
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "logs", "--cluster", "deaths-test",
                          "--worker", sub, "--level", "warning", "--data-dir", data_dir],
                         env=recorded["env"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR    " + sub + " myjob [exit3]: about to call os._exit(3)" in out.stdout
    assert all(len(line) <= 120 for line in out.stdout.splitlines())


def test_logs_follow_prints_records_as_the_sink_loads_them(recorded):
    """``logs --follow`` against the running pipeline: a record that reaches Kafka
    after it started is printed once it is loaded."""
    follow = subprocess.Popen(
        [sys.executable, "-m", "dask_blackbox.cli", "logs", "--cluster", "deaths-test", "--logger", "myjob",
         "--follow", "--data-dir", recorded["env"]["DASK_BLACKBOX__DATA_DIR"]],
        env=recorded["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "about to call os._exit(3)" in follow.stdout.readline()  # what was there
        late = {"kind": contract.LOG, "ts": time.time(), "logger": "myjob.late", "level": "WARNING",
                "message": "a late line", "process": 1, "exc_text": None,
                "worker": recorded["sub_nanny_worker"], "key": None}
        envelope = {"schema": contract.SCHEMA_VERSION, "cluster_id": recorded["cluster_id"],
                    "cluster_name": "deaths-test", "source": "worker", "producer_id": "late-producer",
                    "seq": 0, "sent_at": time.time(), "events": [late]}
        with dask.config.set(recorded["settings"]):
            produce([(recorded["cluster_id"].encode(), orjson.dumps(envelope))])
        line = follow.stdout.readline()
        assert "WARNING" in line and "myjob.late: a late line" in line
    finally:
        follow.terminate()
        follow.wait(30)


def test_the_alerter_delivered_each_death_once_with_the_read_sides_cause(recorded):
    hook = recorded["hook"]
    deaths = [d for d in _deaths(recorded) if d.is_death]
    wait_for(lambda: len([p for p in hook.payloads() if p["rule"] == "deaths"]) >= len(deaths), 30,
             "the alerter to post every death")
    posted = [p for p in hook.payloads() if p["rule"] == "deaths"]
    assert len({p["id"] for p in posted}) == len(posted)  # once each
    assert {(p["worker"], p["cause"]) for p in posted} == {(d.worker, d.verdict.cause.value) for d in deaths}
    crashes = [p for p in hook.payloads() if p["rule"] == "crashes"]
    assert [p["worker"] for p in crashes] == [recorded["victims"]["segv"]]
    hogs = [p for p in hook.payloads() if p["rule"] == "hogs"]
    assert [p["key"] for p in hogs] == ["hog-killed"]  # erred in prefix hog-killed
    # the KilledWorker went to the command, with its chain of deaths and their causes
    wait_for(lambda: recorded["commands"].exists(), 30, "the KilledWorker command")
    lines = [json.loads(line) for line in recorded["commands"].read_text().splitlines() if line]
    assert "hog-killed" in {p["key"] for p in lines}
    kw = next(p for p in lines if p["key"] == "hog-killed")
    assert [d["cause"] for d in kw["deaths"]] == ["memory-limit", "memory-limit"]
    # latency: the webhook had each death within seconds of its removal
    for p in posted:
        assert p["detected_at"] - p["ts"] < 30


def test_memory_charts_draw_the_nannys_kill_value_and_the_highest_sample(recorded, tmp_path):
    """The kill value is the one the nanny recorded (the planted limit times the
    planted terminate fraction), only where a nanny recorded it; the Run page's
    chart of a worker the nanny killed for memory says it, with its highest sample."""
    from dask_blackbox.read import workers
    from dask_blackbox.read.templates import fmt_bytes

    known = workers.info(recorded["backend"], recorded["cluster_id"])
    for plant in ("hog-once", "sigkill", "segv"):
        assert known[recorded["victims"][plant]]["memory_kill"] == int(0.9 * LIMIT), plant
    assert known[recorded["victims"]["no-nanny"]]["memory_kill"] is None
    report.write_report(tmp_path / "r.html", "deaths-test", backend=recorded["backend"])
    html = (tmp_path / "r.html").read_text()
    hog = recorded["victims"]["hog-once"]
    title = re.search(re.escape(hog) + r' \(died\), memory limit [^"]*', html)
    assert title, "no memory chart of the worker killed for memory"
    assert f"its nanny kills at {fmt_bytes(int(0.9 * LIMIT))}" in title.group(0)
    assert "highest sample " in title.group(0)


def test_the_binned_task_stream_hatches_the_tasks_running_when_their_worker_died(recorded):
    """Binned (more bars than are drawn one by one), the stream still draws each task
    that was running when its worker died, on its worker's row: the same ones the
    bars draw."""
    from dask_blackbox.read import figures

    backend = recorded["backend"]
    scope = panels.resolve(backend, recorded["cluster_id"])
    died = [b for b in streams.task_stream(backend, scope)["bars"] if b["action"] == streams.DIED]
    assert {b["key"] for b in died} >= {"hog-killed"}
    windowed = dataclasses.replace(scope, since=scope.t0)  # counted here, not from the aggregates
    binned = streams.task_stream(backend, windowed, max_bars=1)
    assert binned["mode"] == "binned"
    assert sorted((c["key"], c["worker"], c["stop"]) for c in binned["died"]) == sorted(
        (b["key"], b["worker"], b["stop"]) for b in died)
    assert all(binned["row_workers"][c["row"]] == c["worker"] for c in binned["died"])
    drawer = figures.Figures(scope, page.markers(backend, scope), web=False)
    streams.figures(drawer, binned)
    fig = drawer.figures["task_stream"]
    [source] = [r.data_source for r in fig.renderers if r.data_source.name == "task-stream-died"]
    assert sorted(source.data["key"]) == sorted(b["key"] for b in died)
    assert "running when their worker died" in fig.title.text


def test_the_run_page_and_the_report_open_with_the_diagnosis(recorded, tmp_path):
    backend = recorded["backend"]
    written = report.write_report(tmp_path / "r.html", "deaths-test", backend=backend)
    html = (tmp_path / "r.html").read_text()
    start = html.index('<div id="diagnosis"')
    assert start < html.index('id="task-stream"')  # at the top
    n = len([d for d in _deaths(recorded) if d.is_death])
    assert f'data-deaths="{n}"' in html[start:start + 300]
    assert html.count('class="verdict death"') == n
    assert 'data-suspect="hog-killed"' in html
    assert written["bytes"] > 0


def test_the_suspect_is_not_the_innocent_that_shared_every_death(recorded):
    """Two tasks on each of the two workers that died, the innocent one sent first
    both times (so it had been processing longer): the suspect is still the one
    whose prefix's tasks never finished, not the one whose siblings finished fine.
    A recording made for the purpose (the envelopes the producers send), loaded by
    the module's running sink."""
    c = Cluster("suspects-test")
    t = time.time()
    T = c.transition
    events = [c.added("tcp://w:0", 100, ts=t), c.added("tcp://w:1", 101, ts=t), c.added("tcp://w:2", 102, ts=t)]
    for i in range(10):  # the innocents' siblings finish, elsewhere
        events += [T(f"innocent-{i}", "waiting", "processing", f"s-{i}", ts=t + 0.01 * i, prefix="innocent"),
                   T(f"innocent-{i}", "processing", "memory", f"f-{i}", ts=t + 0.01 * i + 0.005,
                     prefix="innocent", worker="tcp://w:0")]
    for n, (worker, pid) in enumerate((("tcp://w:1", 101), ("tcp://w:2", 102))):
        at, stimulus = t + 1 + 5 * n, f"handle-worker-cleanup-{t + 5 * n}"
        last = n == 1
        events += [T("innocent-99", "waiting", "processing", f"a-{n}", ts=at, prefix="innocent"),
                   T("hog-7", "waiting", "processing", f"b-{n}", ts=at + 0.5, prefix="hog"),
                   c.memory_kill(worker, pid, ts=at + 2)]
        for key, prefix in (("innocent-99", "innocent"), ("hog-7", "hog")):
            events.append(T(key, "processing", "erred" if last else "released", stimulus, ts=at + 2.1,
                            prefix=prefix, worker=worker if last else None,
                            exception=f"KilledWorker: Attempted to run task {key!r}" if last else None))
        events.append(c.removed(worker, stimulus, processing=2, ts=at + 2.1))
    envelopes = [c.envelope(events)] + [c.envelope([c.exited(w, pid, -15, ts=t + 3.2 + 5 * n)], "nanny")
                                        for n, (w, pid) in enumerate((("tcp://w:1", 101), ("tcp://w:2", 102)))]
    with dask.config.set(recorded["settings"]):
        produce([(c.id.encode(), orjson.dumps(e)) for e in envelopes])
        wait_loaded(60, "the sink to load it")
    killed = diagnosis.killed_workers(recorded["backend"], [c.id])
    assert sorted(k.key for k in killed) == ["hog-7", "innocent-99"]
    for k in killed:
        assert [d.verdict.cause.value for d in k.deaths] == ["memory-limit", "memory-limit"]
        first, second = k.suspects
        assert (first.key, second.key) == ("hog-7", "innocent-99"), k.suspects
        assert sum(second.processing_s) > sum(first.processing_s)  # timing alone would say innocent
        assert first.prefix_death_rate == 1.0 and second.prefix_results == 10
        assert k.confidence == "medium" and "hog-7 is of a prefix" in k.summary


def test_failures_and_clusters_cut_nothing_at_120_columns(recorded):
    """The post-mortem of the recorded deaths as a person reads it (rich at 120
    columns): no header, address, count or identifier cut; the cluster the filter
    fixes said once, not in a column; the dead workers' addresses and causes whole."""
    data_dir = recorded["env"]["DASK_BLACKBOX__DATA_DIR"]

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args, "--cluster",
                              "deaths-test", "--data-dir", data_dir], env=recorded["env"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert max(map(len, out.stdout.splitlines())) <= 120
        assert "…" not in out.stdout
        return out.stdout

    failures = cli("failures")
    scope = panels.resolve(recorded["backend"], "deaths-test")
    dead = failure_view.failures(recorded["backend"], scope)["dead_workers"]
    assert dead
    for worker in dead:
        assert worker["worker"] in failures
        assert not worker["cause"] or str(worker["cause"]) in failures
    sections = [line for line in failures.splitlines() if line.startswith("== ")]
    assert all(not line.endswith("(0 rows)") or line.count("==") == 1 for line in sections)
    table_lines = [line for line in failures.splitlines() if not line.startswith(("== ", "    "))]
    assert not any(line.startswith("cluster_id ") for line in table_lines)

    clusters = cli("clusters")
    lines = clusters.splitlines()
    assert lines[0].startswith("cluster_name: deaths-test   cluster_id: ")
    assert recorded["cluster_id"] in lines[0]
    words = set(" ".join(lines[1:lines.index(next(x for x in lines if set(x) == {"─"}))]).split())
    for name in ("first_seen", "workers", "tasks", "errors", "producers", "envelopes"):
        assert name in words, name
