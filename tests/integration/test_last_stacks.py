"""What each dead worker was doing, recorded: a real LocalCluster with nannies
(processes=True, a 400 MiB memory limit, the nanny terminating at 90%) on the real
local pipeline (Tansu, the sink on chDB), four workers killed one after the other:

- ``quiet``: a worker that never ran a task, SIGKILLed from outside: no samples;
- ``spin``: a worker running a planted pure-Python loop, SIGKILLed from outside once
  20 samples of its profile are in ClickHouse: its last profile cycles name the loop;
- ``memory``: a planted allocator that holds its memory a little below the nanny's
  kill until its nanny has read its stacks (py-spy), then allocates past the limit:
  the nanny terminates it, and its last stack names the allocator;
- ``gil``: a planted task holding the GIL (a C sleep through ``ctypes.PyDLL``) past
  worker-ttl: Dask's profiler is stopped with the rest, its nanny reads it
  from outside, and its last stack names the planted function, holding the GIL.

Each plant runs its harm once (a flag file): its retry elsewhere just returns. Every
wait is for a recorded fact (a process gone, a row loaded in ClickHouse), bounded,
never timed.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from distributed import Client, LocalCluster

from dask_blackbox import producers
from dask_blackbox.producers.nanny import STACKS_MEMORY_SHARE
from dask_blackbox.read import backends, diagnosis, panels, report
from dask_blackbox.read.views import diagnosis as diagnosis_view

from conftest import pipeline_settings
from recording_support import recorded_through_pipeline
from cluster_support import GIL_TTL, first_time, live_workers
from dask_blackbox.testing.polling import wait_for

pytestmark = pytest.mark.slow
LIMIT = 400 * 2**20
TERMINATE = 0.9
#: the allocator's RSS while it waits for its nanny: past the nanny's reading, short of its kill
HOLD_AT = int(LIMIT * TERMINATE * (1 + STACKS_MEMORY_SHARE) / 2)
#: seconds the planted GIL holder keeps the GIL (well past GIL_TTL)
GIL_S = 45
HERE = pathlib.Path(__file__).resolve().parent


def planted_spin(x):
    """A pure-Python loop until its worker is killed (the GIL is released as usual)."""
    if first_time("spin"):
        while True:
            n = 0
            for _ in range(10_000):
                n += 1
    return x


def planted_allocator(go: str) -> int:
    """Grow to HOLD_AT, wait there for ``go``, then allocate past the limit."""
    if not first_time("memory"):
        return 0
    hoard, me = [], psutil.Process()
    while me.memory_info().rss < HOLD_AT:
        hoard.append(bytearray(4 * 2**20))
    while not os.path.exists(go):
        time.sleep(0.05)
    while True:
        hoard.append(bytearray(16 * 2**20))
        time.sleep(0.02)
        if sum(map(len, hoard)) > 4 * LIMIT:  # the nanny never came: don't hang
            os._exit(1)


def planted_hold_gil(x):
    if first_time("gil"):
        time.sleep(0.3)
        ctypes.PyDLL(None).sleep(GIL_S)  # a C call that keeps the GIL: no answer, no heartbeat
    return x


def _set(name, value, dask_scheduler=None):
    setattr(dask_scheduler, name, value)


def _heartbeats_recent(dask_scheduler=None) -> bool:
    now = time.time()
    return all(now - ws.last_seen < 1.0 for ws in dask_scheduler.workers.values())


def _gone(client: Client, worker: str) -> bool:
    return worker not in live_workers(client)


def _pid(client: Client, worker: str) -> int:
    return client.run(os.getpid, workers=[worker])[worker]


def _loaded(sql: str, **parameters) -> bool:
    """Whether the live sink's ClickHouse has a row for ``sql`` (a count)."""
    backend = backends.running_sink()
    if backend is None:
        return False
    _, rows = backend.query(sql, parameters)
    return rows[0][0] > 0


def _profiled(worker: str, prefix: str, samples: int = 20) -> bool:
    """Whether ``samples`` of ``worker``'s profile of ``prefix`` are loaded."""
    return _loaded("SELECT sum(count) >= {n:UInt32} FROM profiles WHERE worker = {w:String} "
                   "AND prefix = {p:String}", n=samples, w=worker, p=prefix)


def _read_for(worker: str, reason: str, naming: str) -> bool:
    """Whether a nanny's reading of ``worker``'s stacks for ``reason``, a stack naming
    ``naming``, is loaded."""
    return _loaded("SELECT count() FROM stacks WHERE worker = {w:String} AND reason = {r:String} "
                   "AND position(stack, {f:String}) > 0", w=worker, r=reason, f=naming)


def _warm() -> None:
    """Run on every worker: this module imported (a first task's imports may hold the
    event loop for seconds, a stall of its own)."""


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("last-stacks")
    flags = root / "flags"
    flags.mkdir()
    os.environ["BLACKBOX_TEST_FLAGS"] = str(flags)
    settings, env = pipeline_settings(broker, "s" + uuid.uuid4().hex[:8], root / "data")
    out: dict = {"env": env, "victims": {}, "root": root}
    config = {**settings, "optimization.fuse.active": False,
              "distributed.scheduler.allowed-failures": 100,
              # checked every second; GIL_TTL only while the GIL is held
              "distributed.scheduler.worker-ttl": "1s",
              "distributed.deploy.lost-worker-timeout": "1h",
              "distributed.worker.memory.terminate": TERMINATE}
    with recorded_through_pipeline(broker, config, lambda: _record(out, root)) as backend:
        out["backend"] = backend
        yield out


def _record(out: dict, root: pathlib.Path) -> None:
    victims = out["victims"]
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, memory_limit=LIMIT,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        out["cluster_id"] = producers.attach(client, cluster_name="last-stacks-test", **{
            "producer.flush-interval": "20ms"})["cluster_id"]
        client.run_on_scheduler(_set, "worker_ttl", 3600)
        client.wait_for_workers(3, timeout=90)
        # 1. a worker that ran nothing, killed from outside
        victims["quiet"] = quiet = sorted(live_workers(client))[0]
        os.kill(_pid(client, quiet), signal.SIGKILL)
        wait_for(lambda: _gone(client, quiet), 60, "the quiet worker to leave")
        client.wait_for_workers(3, timeout=90)
        # 2. a pure-Python loop, killed from outside once its profile is loaded
        victims["spin"] = spin = sorted(live_workers(client))[0]
        pid = _pid(client, spin)
        future = client.submit(planted_spin, 1, key="planted-spin-0", workers=[spin],
                               allow_other_workers=True)
        wait_for(lambda: _profiled(spin, "planted-spin"), 90, "a profile cycle of the loop")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _gone(client, spin), 60, "the spinning worker to leave")
        assert future.result(timeout=90) == 1
        client.wait_for_workers(3, timeout=90)
        # 3. the allocator: held short of the kill until its nanny has read it
        victims["memory"] = hog = sorted(live_workers(client))[0]
        go = root / "go"
        future = client.submit(planted_allocator, str(go), key="planted-allocator-0",
                               workers=[hog], allow_other_workers=True)
        wait_for(lambda: _read_for(hog, "memory", "planted_allocator"), 90, "the nanny to read the allocator")
        go.write_text("")
        wait_for(lambda: _gone(client, hog), 60, "the nanny to kill the allocator")
        assert future.result(timeout=90) == 0
        client.wait_for_workers(3, timeout=90)
        # 4. the GIL held past worker-ttl
        client.run(_warm)
        wait_for(lambda: client.run_on_scheduler(_heartbeats_recent), 60, "every worker to heartbeat")
        victims["gil"] = stuck = sorted(live_workers(client))[0]
        client.run_on_scheduler(_set, "worker_ttl", GIL_TTL)
        future = client.submit(planted_hold_gil, 1, key="planted-gil-0", workers=[stuck],
                               allow_other_workers=True)
        wait_for(lambda: _gone(client, stuck), 90, "the scheduler to remove the stuck worker")
        client.run_on_scheduler(_set, "worker_ttl", 3600)
        wait_for(lambda: _read_for(stuck, "unresponsive", "planted_hold_gil"), 90,
                 "the nanny to read the stuck worker")
        assert future.result(timeout=90) == 1


def _last(recorded, plant: str) -> dict:
    dx = diagnosis.diagnose(recorded["backend"], ids=[recorded["cluster_id"]])
    (death,) = [d for d in dx["deaths"] if d["worker"] == recorded["victims"][plant]]
    return death


def test_a_worker_that_ran_nothing_says_no_samples(recorded):
    death = _last(recorded, "quiet")
    assert death["cause"] == "killed"
    last = death["last_stack"]
    assert last["source"] is None and last["line"].startswith("no samples: ")
    assert "loses up to its last ~3 s" in last["line"]


def test_a_killed_workers_last_profile_cycles_name_the_planted_loop(recorded):
    death = _last(recorded, "spin")
    assert death["cause"] == "killed"
    profile = death["last_stack"]["profile"]
    assert profile is not None and 1 <= profile["cycles"] <= 3
    (spin,) = [p for p in profile["prefixes"] if p["prefix"] == "planted-spin"]
    assert spin["innermost"][0]["function"] == "planted_spin" and spin["samples"] > 0
    if death["last_stack"]["source"] == "profile":
        assert "planted-spin planted_spin (test_last_stacks.py:" in death["last_stack"]["line"]


def test_a_worker_killed_for_memory_last_ran_the_planted_allocator(recorded):
    death = _last(recorded, "memory")
    assert death["cause"] == "memory-limit"
    last = death["last_stack"]
    assert last["source"] == "py-spy" and last["reading"]["reason"] == "memory"
    assert last["reading"]["memory"] > LIMIT * TERMINATE * STACKS_MEMORY_SHARE
    assert last["reading"]["ts"] <= death["ts"]
    (thread, *_) = last["reading"]["threads"]  # the task's thread, the allocator on its stack
    assert thread["task"] and "planted_allocator" in [f["function"] for f in thread["frames"]]
    assert "planted_allocator (test_last_stacks.py:" in last["line"]
    assert "memory" in last["line"] and "limit" in last["line"]


def test_a_worker_holding_the_gil_past_the_ttl_last_ran_the_planted_function(recorded):
    death = _last(recorded, "gil")
    assert death["cause"] == "unresponsive"
    last = death["last_stack"]
    assert last["source"] == "py-spy" and last["reading"]["reason"] == "unresponsive"
    (thread, *_) = last["reading"]["threads"]
    assert thread["gil"] and thread["frames"][0]["function"] == "planted_hold_gil"
    assert "holding the GIL: planted_hold_gil (test_last_stacks.py:" in last["line"]
    assert last["reading"]["silent"] >= 3.0


def test_why_prints_each_deaths_last_stack_below_its_verdict(recorded):
    data_dir = recorded["env"]["DASK_BLACKBOX__DATA_DIR"]
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "why", "--cluster",
                          "last-stacks-test", "--data-dir", data_dir], env={**os.environ, **recorded["env"]},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 120
    below = {}
    for i, line in enumerate(lines):
        for plant, worker in recorded["victims"].items():
            if line.startswith("[") and f"  {worker}  " in line:
                below[plant] = " ".join(part.strip() for part in lines[i + 1:i + 8])
    assert set(below) == set(recorded["victims"])
    assert "no samples: " in below["quiet"]
    assert "last stack (py-spy, memory " in below["memory"]
    assert "planted_allocator" in below["memory"]
    assert "holding the GIL: planted_hold_gil" in below["gil"]
    assert "planted_spin" in below["spin"]


def test_the_diagnosis_view_and_the_report_show_the_last_stacks(recorded, tmp_path):
    backend = recorded["backend"]
    scope = panels.resolve(backend, recorded["cluster_id"])
    panel = diagnosis_view.diagnosis_panel(backend, scope)
    lines = {d["worker"]: d["last_stack"]["line"] for d in panel["deaths"]}
    assert "planted_hold_gil" in lines[recorded["victims"]["gil"]]
    report.write_report(tmp_path / "r.html", recorded["cluster_id"], backend=backend)
    html = (tmp_path / "r.html").read_text()
    start = html.index('<div id="diagnosis"')
    panel_html = html[start:html.index('id="task-stream"')]
    assert panel_html.count('class="last-stack"') == len(panel["deaths"])
    assert panel_html.count('data-source="py-spy"') >= 2
    assert "planted_allocator" in panel_html and "planted_hold_gil" in panel_html
    assert "no samples: " in panel_html
