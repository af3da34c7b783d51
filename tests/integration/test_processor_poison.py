"""Input that used to crash-loop the processors, on a real running processor: each
bad case becomes a dead letter naming the message, the event, the field and the
reason, the processor keeps running, and a real workload recorded afterwards is
rebuilt equal to Dask's own spans. Bad records an older build saved to the changelog
are skipped with a dead letter on recovery. A cluster that goes silent without
closing is forgotten after ``idle-cluster-ttl``, its open spans published as they
stand.
"""

from __future__ import annotations

import asyncio
import uuid

import dask
import dask.array as da
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewTopic
from aiokafka.partitioner import murmur2
from distributed import Client, LocalCluster, span

from dask_blackbox import config, contract, kafka, producers
from dask_blackbox.testing.kafka_reader import read_json, read_records
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.processors import (
    FaustWorker, committed_clusters, contract_violations, converge, env_for,
    latest_snapshots, processor_settings,
)
from dask_blackbox.testing import replay

PARTITIONS = 2
IDLE_TTL = 8


def envelope(cid, seq, events, producer="sched-poison"):
    return {"schema": 1, "cluster_id": cid, "cluster_name": cid, "source": "scheduler",
            "producer_id": producer, "seq": seq, "sent_at": 1.0, "events": events}


def sp(span_id, parent_id, enqueued=100.0, name=None):
    return {"kind": "span", "ts": 100.0, "span_id": span_id,
            "name": name or [span_id], "parent_id": parent_id, "enqueued": enqueued}


def tr(key, start, finish, **extra):
    return {"kind": "transition", "ts": 101.0, "key": key, "start": start,
            "finish": finish, "group": "g-1", "prefix": "g", "span_id": "ok", **extra}


#: (name, events, (index, kind, field) of the event refused)
BAD_CASES = [
    ("overflowing startstop",
     [sp("ok", None), tr("t", "released", "waiting"), tr("t", "waiting", "processing"),
      tr("t", "processing", "memory", startstops=[
          {"action": "compute", "start": -1e308, "stop": 1e308}])],
     (3, "transition", "startstops[0]")),
    ("own parent", [sp("self", "self"), sp("fine", None)], (0, "span", "parent_id")),
    ("each other's parent", [sp("y", "z"), sp("z", "y")], (1, "span", "parent_id")),
    ("enqueued not a number", [sp("when", None, enqueued="yesterday")],
     (0, "span", "enqueued")),
]


def _partition(cid: str) -> int:
    return (murmur2(cid.encode()) & 0x7FFFFFFF) % PARTITIONS


def old_bad_checkpoint(cid: str) -> list[tuple[bytes, bytes]]:
    """A checkpoint as the build before record formats wrote it (format 1:
    positional rows), holding what that build let in: a span cycle, a span that is
    its own parent, a non-number enqueued; and one sound, still running span."""
    p = _partition(cid)
    agg = [{}, {}, 0, 0, 0.0, 0.0]
    running = [{"processing": 1}, {}, 0, 0, 0.0, 0.0]
    meta = {"name": cid, "partition": p, "applied": 1, "malformed_events": 0,
            "closed_at": None, "producers": {"sched-old": ["scheduler", 0]},
            "windows": [{}, []],
            "tree": {"next_group": 0, "unattributed": 0, "overflowed": False,
                     "groups": []}}
    part = [["m", meta],
            ["s:A", [["a"], "B", 1.0, ["B"], agg, [], 1]],
            ["s:B", [["b"], "A", 1.0, ["A"], agg, [], 1]],
            ["s:C", [["c"], "C", 1.0, ["C"], agg, [], 1]],
            ["s:D", [["d"], None, "yesterday", [], agg, [], 1]],
            ["s:E", [["e"], None, 1.0, [], running, [], 1]]]
    encoded = orjson.dumps(part)
    marker = {"epoch": 1, "partition": p, "base": None, "deltas": [[1, 1]],
              "base_bytes": 0, "delta_bytes": len(encoded)}
    return [(orjson.dumps([cid, "D", 1, 0]), encoded),
            (orjson.dumps([cid, "M"]), orjson.dumps(marker))]


async def seed_changelog(topic: str, messages, partition: int) -> None:
    admin = await kafka.connect_admin()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1,
                                            topic_configs={"cleanup.policy": "compact"})])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(**config.kafka_client_kwargs())
    await producer.start()
    try:
        for key, value in messages:
            await producer.send_and_wait(topic, value, key=key, partition=partition)
    finally:
        await producer.stop()


@pytest.fixture(scope="module")
def poisoned(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("poison")
    prefix = "x" + uuid.uuid4().hex[:10]
    settings = processor_settings(broker, prefix, PARTITIONS, snapshot_interval="200ms",
                                  idle_cluster_ttl=f"{IDLE_TTL}s")
    with dask.config.set(settings):
        asyncio.run(kafka.ensure_topics())
        changelog = f"app-{prefix}-cluster-state-changelog"
        asyncio.run(seed_changelog(changelog, old_bad_checkpoint("old-bad"),
                                   _partition("old-bad")))
        worker = FaustWorker(env_for(settings), tmp, "poison").start()
        try:
            wait_for(lambda: (s := worker.stats()) and s["adopted"] >= 1, 90,
                     "the old checkpoint recovered")
            yield worker, changelog
        finally:
            worker.stop()


def test_bad_changelog_records_are_skipped_with_dead_letters(poisoned):
    worker, changelog = poisoned
    dead = wait_for(lambda: [d for d in read_json(contract.DEAD_LETTER, idle=0.3)
                             if d["topic"] == changelog and len(
                                 [d for d in read_json(contract.DEAD_LETTER, idle=0.3)
                                  if d["topic"] == changelog]) >= 4], 30,
                    "dead letters of the bad records")
    assert contract_violations(contract.DEAD_LETTER, dead) == []
    by_record = {orjson.loads(d["payload"])[0]: d for d in dead}
    assert set(by_record) == {"s:A", "s:B", "s:C", "s:D"}, dead
    for rk in ("s:A", "s:B", "s:C"):
        assert "cluster old-bad" in by_record[rk]["reason"]
        assert "cycle" in by_record[rk]["reason"], by_record[rk]
    assert "enqueued must be a number" in by_record["s:D"]["reason"]
    assert all(d["key"] == '["old-bad","D",1,0]' and d["offset"] >= 0 for d in dead)
    # the sound parts were kept and published again
    snaps = wait_for(lambda: {s for (c, s) in latest_snapshots(
        read_json(contract.SPAN_STATE, idle=0.3)) if c == "old-bad"} >= set("ABCE"), 30,
        "snapshots of the recovered cluster")
    assert snaps


def test_bad_events_become_dead_letters_and_the_processor_goes_on(poisoned):
    worker, _ = poisoned
    pid = worker.proc.pid
    messages = [replay.encode(envelope("poison-1", seq, events))
                for seq, (_, events, _) in enumerate(BAD_CASES)]
    asyncio.run(replay.publish_raw(messages))
    raw = {r.offset: orjson.loads(r.value)["seq"]
           for r in read_records(contract.RAW, idle=0.3) if r.key == b"poison-1"}

    def mine():
        return [d for d in read_json(contract.DEAD_LETTER, idle=0.3)
                if d["key"] == "poison-1"]

    dead = wait_for(lambda: len(got := mine()) >= len(BAD_CASES) and got, 60,
                    "a dead letter per bad case")
    assert contract_violations(contract.DEAD_LETTER, dead) == []
    assert len(dead) == len(BAD_CASES)
    for d in dead:
        assert d["partition"] == _partition("poison-1")
        seq = raw[d["offset"]]  # the dead letter names the message ...
        name, _, (index, kind, field) = BAD_CASES[seq]
        # ... and the event, its field and the reason
        assert d["reason"].startswith(f"refused event {index} ({kind}): {field}: "), \
            (name, d["reason"])
        assert orjson.loads(d["payload"])["seq"] == seq
    reasons = " ".join(d["reason"] for d in dead)
    assert "overflows" in reasons and "own parent" in reasons
    assert "would be a cycle" in reasons and "not a number" in reasons

    # the rest of each envelope was applied, and nothing bad got in
    snaps = wait_for(lambda: {s: r for (c, s), r in latest_snapshots(
        read_json(contract.SPAN_STATE, idle=0.3)).items() if c == "poison-1"}
        if worker.stats()["rejected_events"] >= 4 else None, 30, "snapshots")
    assert snaps["ok"]["states"] == {"processing": 1}
    assert snaps["y"]["parent_id"] == "z"
    # a refused event changes nothing: those spans were never declared, and a span
    # is published only once declared (z is known only as y's parent)
    assert "self" not in snaps and "when" not in snaps and "z" not in snaps
    assert "fine" in snaps
    assert contract_violations(contract.SPAN_STATE, list(snaps.values())) == []
    assert worker.proc.poll() is None and worker.proc.pid == pid

    # a real workload recorded afterwards is rebuilt equal to Dask's
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0", silence_logs=50) as cluster, \
            Client(cluster) as client:
        cid = producers.attach(client)["cluster_id"]
        with dask.config.set({"optimization.fuse.active": False}), span("after poison"):
            da.ones((200, 200), chunks=50).sum().compute()
        truth, diffs = converge(client, cid)
    assert diffs == {}, diffs
    assert {tuple(s["name"]) for s in truth["spans"].values()} >= {("after poison",)}
    assert worker.stats()["dead_letters"] >= len(BAD_CASES) + 4
    assert worker.proc.poll() is None and worker.proc.pid == pid


def test_silent_clusters_are_forgotten_with_their_open_spans_published(poisoned):
    """poison-1 and old-bad never close: after idle-cluster-ttl they are forgotten
    (in memory and on the changelog), their producers with them, and their spans
    still running are published as they stand (done false)."""
    worker, _ = poisoned
    app_id = dask.config.get("blackbox.processors.app-id")
    wait_for(lambda: worker.stats()["expired_idle"] >= 2, 3 * IDLE_TTL + 30,
             "the silent clusters forgotten")
    wait_for(lambda: not {"poison-1", "old-bad"} & committed_clusters(app_id), 30,
             "their checkpoints deleted")
    assert worker.stats()["forgotten_producers"] >= 2
    snaps = latest_snapshots(read_json(contract.SPAN_STATE, idle=0.3))
    assert snaps[("poison-1", "ok")]["done"] is False
    assert snaps[("old-bad", "E")]["done"] is False
    assert snaps[("old-bad", "E")]["states"] == {"processing": 1}
    assert worker.proc.poll() is None
