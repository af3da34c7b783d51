"""What a worker the nanny killed for memory held when it died, named after the
cluster is gone, against what Dask itself said while the worker lived.

One recorded run (module scope) on the real local pipeline (``LocalPipeline``: Tansu,
the sink on chDB) of a LocalCluster with nannies (processes=True, a 400 MiB memory
limit the nanny enforces at 90%, no spilling, no pausing, no active memory manager:
nothing moves a key but the plants), recording the workers' own transitions too.
Planted, one after the other:

- ``one``: worker A holds one large result (a 150 MiB numpy array the client keeps)
  and three small ones, then a task allocates past the limit there;
- ``many``: worker B holds 40 results of its own and 60 replicas of results computed
  on worker C (a task on B needed them), each 1 MiB, then the same allocation.

Every planted task is pinned to its worker (it is not computed again elsewhere once
the worker is gone); the allocating task dies on its first run only (a flag file), so
its retry, anywhere, finishes and records its own result's size.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from dask.utils import format_bytes, key_split
from distributed import Client, LocalCluster, wait

from dask_blackbox import producers
from dask_blackbox.read import diagnosis, held_memory, panels, report
from dask_blackbox.read.views import diagnosis as diagnosis_view
from dask_blackbox.testing.polling import wait_for

from cluster_support import first_time, live_workers
from conftest import pipeline_settings
from recording_support import recorded_through_pipeline, worker_env

pytestmark = pytest.mark.slow  # one recorded run of about a minute
LIMIT = 400 * 2**20
MiB = 2**20
BIG = 150 * MiB
HERE = pathlib.Path(__file__).resolve().parent
TESTS = (HERE, HERE.parent)


def large(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.uint8)


def small(i: int) -> bytes:
    return bytes([i % 256]) * MiB


def count(*parts) -> int:
    return len(parts)


def hog(name: str) -> int:
    """Allocate past the limit until the nanny terminates this process, the first
    time only."""
    if first_time(name):
        time.sleep(0.3)
        hoard = []
        while True:
            hoard.append(bytearray(16 * MiB))
            time.sleep(0.02)
            if len(hoard) * 16 * MiB > 4 * LIMIT:  # the nanny never came: don't hang
                os._exit(1)
    return 1


def in_memory(dask_worker=None) -> dict:
    """What Dask's worker state holds in memory: key -> its nbytes."""
    return {str(k): ts.nbytes for k, ts in dask_worker.state.tasks.items() if ts.state == "memory"}


def _kill_by_memory(client: Client, worker: str, key: str) -> int:
    """Run the allocating task on ``worker`` until the nanny kills it; its retry's result."""
    future = client.submit(hog, key, key=key, workers=[worker], allow_other_workers=True)
    wait_for(lambda: worker not in live_workers(client), 90, f"{worker} to be killed", interval=0.1)
    assert future.result(timeout=90) == 1
    return client.nbytes(summary=False)[key]


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    flags = root / "flags"
    flags.mkdir()
    os.environ["BLACKBOX_TEST_FLAGS"] = str(flags)
    settings, bb_env = pipeline_settings(broker, "h" + uuid.uuid4().hex[:8], root / "data")
    env = worker_env(bb_env, *TESTS)
    config = {**settings, "optimization.fuse.active": False,
              "distributed.scheduler.allowed-failures": 100,
              "distributed.scheduler.active-memory-manager.start": False,
              "distributed.deploy.lost-worker-timeout": "1h",
              "distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
              "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.9}
    truth: dict = {"env": env}
    with recorded_through_pipeline(broker, config, lambda: _record(truth)) as backend:
        truth["backend"] = backend
        yield truth


def _record(truth: dict) -> None:
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, memory_limit=LIMIT,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        truth["cluster_id"] = producers.attach(client, cluster_name="held-test", **{
            "producer.flush-interval": "20ms", "producer.metrics-interval": "200ms",
            "producer.record.worker-transitions": True})["cluster_id"]
        a, b, c = sorted(live_workers(client))
        truth["workers"] = {"one": a, "many": b}
        # one: a large result and three small ones on A
        kept = [client.submit(large, BIG, key="big-result", workers=[a], allow_other_workers=False)]
        kept += [client.submit(small, i, key=f"own-{i}", workers=[a], allow_other_workers=False)
                 for i in range(3)]
        # many: 40 results of B's own, 60 replicas of C's
        parts = [client.submit(small, i, key=f"part-{i}", workers=[c], allow_other_workers=False)
                 for i in range(60)]
        wait(kept + parts)
        kept += parts + [client.submit(small, i, key=f"mine-{i}", workers=[b], allow_other_workers=False)
                         for i in range(40)]
        kept.append(client.submit(count, *parts, key="touch-parts", workers=[b], allow_other_workers=False))
        wait(kept)
        assert kept[-1].result() == 60
        # what Dask says while they live: each worker's keys in memory, the scheduler's sizes
        truth["held"] = {plant: client.run(in_memory, workers=[w])[w] for plant, w in truth["workers"].items()}
        truth["nbytes"] = client.nbytes(summary=False)
        truth["running"] = {plant: _kill_by_memory(client, w, f"hog-{plant}")
                            for plant, w in truth["workers"].items()}
        client.cancel(kept)


def _held(recorded) -> dict[str, held_memory.HeldMemory]:
    deaths = [d for d in diagnosis.deaths(recorded["backend"], [recorded["cluster_id"]]) if d.is_death]
    by_worker = {d.worker: d for d in deaths}
    workers = recorded["workers"]
    assert set(by_worker) == set(workers.values())
    assert {by_worker[w].verdict.cause.value for w in workers.values()} == {"memory-limit"}
    found = held_memory.at_deaths(recorded["backend"], [by_worker[w] for w in workers.values()], top=1000)
    return dict(zip(workers, found))


def test_the_keys_held_at_the_death_are_those_dask_held_with_its_sizes(recorded):
    for plant, held in _held(recorded).items():
        truth = recorded["held"][plant]
        assert {k.key: k.nbytes for k in held.top} == truth, plant
        assert (held.keys, held.nbytes, held.unknown) == (len(truth), sum(truth.values()), 0), plant
        assert held.recorded and held.replicas_recorded
        prefixes = {}
        for key, n in truth.items():
            keys, nbytes = prefixes.get(key_split(key), (0, 0))
            prefixes[key_split(key)] = (keys + 1, nbytes + n)
        assert {p.prefix: (p.keys, p.nbytes) for p in held.prefixes} == prefixes, plant


def test_one_huge_result_and_many_small_keys_are_told_apart(recorded):
    held = _held(recorded)
    one, many = held["one"], held["many"]
    # the planted array is the largest key, of the size Dask's scheduler gave it
    assert one.top[0].key == "big-result" and one.top[0].prefix == "big-result"
    assert one.top[0].nbytes == recorded["nbytes"]["big-result"] == BIG
    assert one.shape == "one result" and one.top_share > 0.9
    # B: its own 40, C's 60 it received, and the task that needed them
    assert many.keys == 101 and {p.prefix for p in many.prefixes} == {"mine", "part", "touch-parts"}
    assert many.shape == "many keys" and many.top_share < 0.02
    # the task running at each death, with the size its retry's result had
    for plant, h in held.items():
        assert [(r.key, r.nbytes) for r in h.running] == [(f"hog-{plant}", recorded["running"][plant])]


def test_why_the_view_and_the_report_show_it_below_each_death(recorded, tmp_path):
    backend, workers = recorded["backend"], recorded["workers"]
    data_dir = recorded["env"]["DASK_BLACKBOX__DATA_DIR"]
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "why", "--cluster", "held-test",
                          "--data-dir", data_dir], env=recorded["env"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 120
    text = " ".join(line.strip() for line in lines)
    one_total = sum(recorded["held"]["one"].values())
    assert (f"held {format_bytes(one_total)} in 4 keys; one result holds "
            f"{BIG / one_total:.0%}: top big-result {format_bytes(BIG)} (prefix big-result)") in text
    assert re.search(r"held [\d.]+ MiB in 101 keys; many keys, the largest 1%: top ", text), text
    assert "running hog-one: its result" in text and "running hog-many: its result" in text
    # below its death's verdict, before its evidence
    head = next(i for i, line in enumerate(lines) if line.startswith("[") and f"{workers['one']} died at" in line)
    assert "top big-result" in " ".join(line.strip() for line in lines[head + 1:head + 6])
    # the Diagnosis view and the report
    scope = panels.resolve(backend, recorded["cluster_id"])
    rows = {d["worker"]: d for d in diagnosis_view.diagnosis_panel(backend, scope)["deaths"]}
    assert rows[workers["one"]]["held_memory"]["top"][0]["key"] == "big-result"
    assert rows[workers["many"]]["held_memory"]["shape"] == "many keys"
    # next to the worker's own last word on its managed memory (Dask's sum of its data's sizes)
    for plant, w in workers.items():
        assert rows[w]["held_memory"]["nbytes"] == rows[w]["metrics"]["memory_managed"], plant
    report.write_report(tmp_path / "r.html", "held-test", backend=backend)
    html = (tmp_path / "r.html").read_text()
    assert re.search(r'class="held-memory" data-keys="4" data-nbytes="%d" data-shape="one result"\s+'
                     r'data-top="big-result"' % one_total, html)
    assert 'data-keys="101"' in html and 'data-shape="many keys"' in html
