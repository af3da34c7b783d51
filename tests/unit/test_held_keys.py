"""What a removed worker held (read/held_memory.py) on chDB, from transitions loaded
through the sink's Loader: a key enters with the scheduler's ``-> memory`` on the
worker or the worker's own (a transfer's arrival), leaves with a release (the
scheduler's or the worker's) or a recomputation elsewhere, and the removal's own
releases are what it took with it; a size is the scheduler's nbytes, unknown where
none was recorded; the tasks running at the removal come with their own result size
where they ever finished."""

from __future__ import annotations

from typing import NamedTuple

import clickhouse_connect
import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.read import backends, held_memory
from dask_blackbox.sinks import schema
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.tables import Message

TARGET = schema.Target("blackbox", 90 * 86400)
T0 = 1_790_000_000.0
A, B = "tcp://a:1", "tcp://b:2"
MiB = 2**20
REMOVED = T0 + 100


class Removal(NamedTuple):
    cluster_id: str
    worker: str
    ts: float
    stimulus_id: str


def _t(key, ts, start, finish, stimulus, worker=None, nbytes=None) -> dict:
    return {"kind": contract.TRANSITION, "key": key, "prefix": key.rsplit("-", 1)[0], "group": None,
            "span_id": None, "ts": ts, "start": start, "finish": finish, "stimulus_id": stimulus,
            "worker": worker, "nbytes": nbytes, "typename": None, "startstops": None, "thread": None,
            "exception": None, "traceback": None, "cause": None}


def _computed(key, ts, worker, nbytes) -> list[dict]:
    return [_t(key, ts - 0.5, "waiting", "processing", "graph"),
            _t(key, ts, "processing", "memory", f"finished-{key}", worker, nbytes)]


def _scheduler() -> list[dict]:
    ev = _computed("big-1", T0 + 1, A, 150 * MiB)
    for j in range(10):
        ev += _computed(f"small-{j}", T0 + 2 + j, A, 1000)
        if j < 5:  # released by the client before the death
            ev.append(_t(f"small-{j}", T0 + 50, "memory", "released", "client-releases"))
    ev += _computed("other-1", T0 + 20, B, 2000) + _computed("other-2", T0 + 21, B, 3000)
    ev += _computed("again-1", T0 + 5, A, 4000)
    ev += [_t("again-1", T0 + 10, "memory", "released", "lost")] + _computed("again-1", T0 + 20, B, 4000)
    ev += _computed("late-1", T0 + 150, A, 9000)
    ev += [_t("hog-1", T0 + 90, "waiting", "processing", "graph"),
           _t("hog-2", T0 + 90, "waiting", "processing", "graph")]
    # the removal's own: what A alone held is released, what it ran goes back
    ev += [_t(k, REMOVED - 0.01, "memory", "released", "remove-A")
           for k in ["big-1", *(f"small-{j}" for j in range(5, 10))]]
    ev += [_t("hog-1", REMOVED - 0.01, "processing", "released", "remove-A"),
           _t("hog-2", REMOVED - 0.01, "processing", "released", "remove-A")]
    ev += _computed("hog-2", T0 + 120, B, 42)  # its retry finished elsewhere
    return ev


def _worker_a() -> list[dict]:
    """A's own transitions (worker-transitions): replicas it received, one it dropped,
    data scattered to it."""
    return [_t("other-1", T0 + 60, "flight", "memory", None, A),
            _t("other-2", T0 + 61, "flight", "memory", None, A),
            _t("other-2", T0 + 62, "memory", "released", None, A),
            _t("data-x", T0 + 63, "released", "memory", None, A)]


def _envelope(cluster: str, source: str, producer: str, events: list[dict]) -> bytes:
    return orjson.dumps({"schema": contract.SCHEMA_VERSION, "cluster_id": cluster, "cluster_name": cluster,
                         "source": source, "producer_id": producer, "seq": 0, "sent_at": T0 + 200,
                         "events": events})


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('held') / 'ch'}")
    schema.migrate(client, TARGET)
    batch = Batch()
    for offset, (cluster, source, producer, events) in enumerate((
            ("c-held", "scheduler", "p-s", _scheduler()), ("c-held", "worker", "p-a", _worker_a()),
            ("c-plain", "scheduler", "p-plain", _scheduler()))):
        batch.add(Message(contract.RAW, "t.raw", 0, offset, cluster.encode(),
                          _envelope(cluster, source, producer, events), 0))
    assert Loader(client, TARGET, "held").load(batch, {})
    yield backends.DirectBackend(client, "blackbox")
    client.close()


def test_the_keys_held_at_the_removal_and_their_sizes(backend):
    [held] = held_memory.at_deaths(backend, [Removal("c-held", A, REMOVED, "remove-A")])
    # big-1 and small-5..9 (released by the removal itself), the replica other-1 (the
    # scheduler's size), data-x (no size); not the released, dropped, recomputed or later
    assert held.keys == 8 and held.unknown == 1
    assert held.nbytes == 150 * MiB + 5 * 1000 + 2000
    assert [(k.key, k.nbytes) for k in held.top] == [
        ("big-1", 150 * MiB), ("other-1", 2000), ("small-5", 1000), ("small-6", 1000), ("small-7", 1000)]
    assert {p.prefix: (p.keys, p.nbytes, p.unknown) for p in held.prefixes} == {
        "big": (1, 150 * MiB, 0), "small": (5, 5000, 0), "other": (1, 2000, 0), "data": (1, 0, 1)}
    assert [p.prefix for p in held.prefixes][:3] == ["big", "small", "other"]
    assert held.shape == "one result" and held.top_share > 0.99
    assert held.recorded and held.replicas_recorded
    # what it ran: hog-1 never finished (unknown), hog-2's retry did elsewhere
    assert [(r.key, r.nbytes, r.finished) for r in held.running] == [("hog-1", None, 0), ("hog-2", 42, 1)]
    first, second = held.lines()
    assert first.startswith("held 150.01 MiB in 8 keys, 1 of unknown size; one result holds 100%: top big-1")
    assert "running hog-1: its result unknown (it never finished)" in second
    assert "running hog-2: its result 42 B" in second


def test_without_worker_transitions_replicas_are_not_counted_and_it_says_so(backend):
    held, other, none = held_memory.at_deaths(backend, [
        Removal("c-plain", A, REMOVED, "remove-A"), Removal("c-plain", B, T0 + 30, "remove-B"),
        Removal("c-none", A, REMOVED, "remove-A")])
    assert held.keys == 6 and held.unknown == 0 and held.nbytes == 150 * MiB + 5000
    assert held.recorded and not held.replicas_recorded
    assert "replicas received not recorded" in held.lines()[0]
    # B at T0 + 30: other-1, other-2 and again-1 (computed at T0 + 20), many keys
    assert (other.keys, other.nbytes, other.shape) == (3, 2000 + 3000 + 4000, "many keys")
    assert other.running == []
    # a cluster with no transitions recorded: unknown, not "nothing"
    assert none.shape == "unknown" and not none.recorded and none.keys == 0
    assert none.lines() == ["held memory unknown: no task transition of this cluster was recorded"]


def test_a_removal_before_any_result_held_nothing(backend):
    [held] = held_memory.at_deaths(backend, [Removal("c-held", A, T0 + 0.5, "early")])
    assert held.keys == 0 and held.shape == "nothing" and held.top == []
    assert held.lines()[0].startswith("held no key in memory")


class Counting:
    """The real backend, counting the statements it is asked."""

    def __init__(self, backend):
        self.backend, self.database, self.statements = backend, backend.database, 0

    def query(self, sql, parameters=None):
        self.statements += 1
        return self.backend.query(sql, parameters)


def _load(backend, offset: int, producer: str, events: list[dict]) -> None:
    batch = Batch()
    batch.add(Message(contract.RAW, "t.raw", 0, offset, b"c-grow",
                      _envelope("c-grow", "scheduler", producer, events), 0))
    client = backend.backend._reader._client  # the fixture's chDB client
    assert Loader(client, TARGET, "held").load(batch, {})


def test_an_answer_asked_again_is_kept_until_its_clusters_transitions_change(backend):
    counting = Counting(backend)
    removal = Removal("c-grow", A, REMOVED, "remove-A")
    _load(counting, 10, "p-grow-1", _scheduler())
    first = held_memory.at_deaths(counting, [removal])
    asked = counting.statements
    again = held_memory.at_deaths(counting, [removal])
    assert again == first and counting.statements == asked + 1  # the state, no reading
    again[0].top.clear()  # what a caller was given is its own
    assert held_memory.at_deaths(counting, [removal])[0].top == first[0].top
    # a result computed on A before the removal arrives late: read again, it is held
    _load(counting, 11, "p-grow-2", _computed("late-big-1", T0 + 3, A, 300 * MiB))
    [grown] = held_memory.at_deaths(counting, [removal])
    assert grown.keys == first[0].keys + 1 and grown.top[0].key == "late-big-1"
    assert grown.nbytes == first[0].nbytes + 300 * MiB
