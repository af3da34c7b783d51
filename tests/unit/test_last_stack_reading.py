"""What a dead worker was doing (read/last_stacks.py), from rows the sink's own Batch
and Loader put into chDB: the nanny's py-spy reading when there is one (the thread
holding the GIL first), else the worker's last profile cycles per prefix, else "no
samples" and why; and how ``why`` prints it below the verdict."""

from __future__ import annotations

import time
from types import SimpleNamespace

import clickhouse_connect
import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.cli.diagnose import render_why
from dask_blackbox.read import backends, last_stacks
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import Message

from sink_support import envelope

NOW = time.time()
T0 = NOW - 100
TASK = ("/py/threading.py:1002:Thread._bootstrap;"
        "/site-packages/distributed/worker.py:2950:apply_function")


def _profile(worker: str, prefix: str, ts: float, stacks: dict) -> dict:
    return {"kind": contract.PROFILE, "ts": ts, "worker": worker, "prefix": prefix,
            "stacks": list(stacks), "counts": list(stacks.values())}


def _stacks(worker: str, pid: int, ts: float, threads: list[tuple], **changes) -> dict:
    return {"kind": contract.STACKS, "ts": ts, "worker": worker, "pid": pid,
            "reason": "unresponsive", "memory": None, "memory_limit": None, "silent": 3.5,
            "threads": [t[0] for t in threads], "thread_ids": list(range(len(threads))),
            "stacks": [t[1] for t in threads], "active": [t[2] for t in threads],
            "gil": [t[3] for t in threads], "error": None, **changes}


EVENTS = [
    # w1: profile cycles; the last three before its removal at T0 + 10 count
    _profile("tcp://w1:1", "old", T0 + 1, {"a.py:1:old_work": 50}),
    *[_profile("tcp://w1:1", "spin", T0 + t, {f"{TASK};/job/x.py:5:planted_spin": 9,
                                               f"{TASK};/job/x.py:9:helper": 1})
      for t in (5, 6, 7)],
    _profile("tcp://w1:1", "", T0 + 7, {"a.py:1:everything": 100}),
    _profile("tcp://w1:1", "spin", T0 + 30, {"a.py:1:after_its_removal": 100}),
    # w2: a profile and a py-spy reading: the reading tells, the thread holding the GIL first
    _profile("tcp://w2:1", "gil", T0 + 5, {"a.py:1:before_the_hang": 5}),
    # an earlier stall of the same process (a first task's imports): not what it died of
    _stacks("tcp://w2:1", 22, T0 + 2, [
        ("MainThread", "/job/x.py:1:<module>;<frozen importlib._bootstrap>:1:_find_and_load",
         True, True)]),
    _stacks("tcp://w2:1", 22, T0 + 8, [
        ("MainThread", "/py/asyncio.py:1:run_forever;/py/selectors.py:9:select", False, False),
        ("Dask-Default-Threads-22-0", f"{TASK};/job/x.py:20:outer;/job/x.py:30:planted_hold",
         False, True),
        ("Dask-Default-Threads-22-1", "/py/threading.py:1:_bootstrap;/py/queue.py:5:get",
         False, False)]),
    # w3: a reading that failed, and no profile
    _stacks("tcp://w3:1", 33, T0 + 8, [], error="py-spy: the process ended"),
]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('ch') / 'ch'}")
    target = Target("blackbox", 90 * 86400)
    migrate(client, target)
    loader = Loader(client, target, "g")
    batch = Batch(loader.schemas)
    batch.add(Message(contract.RAW, "t.raw", 0, 0, b"c1",
                      orjson.dumps(envelope(EVENTS, source="nanny")), 1000))
    assert loader.load(batch, {})
    yield backends.DirectBackend(client, "blackbox")
    client.close()


def _death(worker: str, pid: int | None, cluster: str = "c1") -> SimpleNamespace:
    return SimpleNamespace(cluster_id=cluster, worker=worker, pid=pid, ts=T0 + 10, added=T0)


def test_a_workers_last_profile_cycles_name_its_prefix_and_hottest_innermost_frames(backend):
    (last,) = last_stacks.of_deaths(backend, [_death("tcp://w1:1", 11)])
    assert last.source == "profile" and last.reading is None
    p = last.profile
    assert p["cycles"] == 3 and (p["since"], p["until"]) == pytest.approx((T0 + 5, T0 + 7))
    (spin,) = p["prefixes"]  # not the older prefix, nor the worker-wide profile
    assert spin["prefix"] == "spin" and spin["samples"] == 30
    assert [(f["function"], f["samples"]) for f in spin["innermost"]] == [
        ("planted_spin", 27), ("helper", 3)]
    assert last.line.startswith("last stack (Dask's profile, 3 cycle(s) ending 3.0 s before its removal): "
                                "spin planted_spin (x.py:5) x27, helper (x.py:9) x3")
    assert "loses up to its last ~3 s" in last.line


def test_the_nannys_reading_tells_first_the_thread_holding_the_gil(backend):
    (last,) = last_stacks.of_deaths(backend, [_death("tcp://w2:1", 22)])
    assert last.source == "py-spy" and last.profile is not None
    threads = last.reading["threads"]
    assert [t["name"] for t in threads] == ["Dask-Default-Threads-22-0"]  # the idle ones left out
    assert [f["function"] for f in threads[0]["frames"][:2]] == ["planted_hold", "outer"]
    assert last.line == ("last stack (py-spy, its event loop silent 3.5 s): thread "
                         "Dask-Default-Threads-22-0, holding the GIL: planted_hold (x.py:30) < "
                         "outer (x.py:20) < apply_function (worker.py:2950)")


def test_a_worker_with_nothing_recorded_says_no_samples_and_why(backend):
    failed, unknown, unprofiled = last_stacks.of_deaths(backend, [
        _death("tcp://w3:1", 33), _death("tcp://w4:1", None), _death("tcp://w1:1", 11, "c2")])
    for last in (failed, unknown, unprofiled):
        assert last.source is None and last.line.startswith("no samples: ")
    assert "could not read its stacks (py-spy: the process ended)" in failed.line
    assert "loses up to its last ~3 s" in unknown.line and "read no stacks" in unknown.line
    assert "recorded no profile" in unprofiled.line
    # a pid that is not the reading's is another process
    (other,) = last_stacks.of_deaths(backend, [_death("tcp://w2:1", 99)])
    assert other.source == "profile"


def test_why_prints_the_last_stack_below_each_deaths_verdict(backend):
    (last,) = last_stacks.of_deaths(backend, [_death("tcp://w2:1", 22)])
    death = {"cluster_id": "c1", "worker": "tcp://w2:1", "ts": T0 + 10, "label": "unresponsive",
             "confidence": "high", "explanation": "removed after worker-ttl", "tasks": [],
             "timeline": [], "last_stack": last.as_dict()}
    text = render_why({"deaths": [death], "expected": [], "killed_workers": []}, {}, 120)
    lines = text.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("[1] "))
    assert lines[verdict + 1].startswith("      last stack (py-spy, its event loop silent 3.5 s)")
    assert "planted_hold" in " ".join(lines[verdict + 1:verdict + 3])
    assert all(len(line) <= 120 for line in lines)
