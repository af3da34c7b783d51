"""Version 3 envelopes (MessagePack, transitions as CAPTUREs) against version 2 (JSON,
TRANSITION_RUNs): a raw topic mixing both loads the same rows in the sink and rebuilds
the same spans and partials in the processors as the same recording in version 2 alone;
a malformed version 3 message (truncated, wrong lengths, wrong types, huge counts, too
deep) is a dead letter with a reason, never a crash."""

from __future__ import annotations

import asyncio
import time
import uuid

import dask
import dask.array as da
import msgspec
import pytest
from distributed import Client, LocalCluster, span
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import pipeline_settings
from dask_blackbox import contract, kafka, producers
from dask_blackbox.nesting import MAX_DEPTH
from dask_blackbox.producers.rows import Ready, RowMaker, TransitionItem
from dask_blackbox.producers.sender import Identity, envelope, pack_captured
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.tables import COLUMNS, Message
from dask_blackbox.stream_processors import envelopes as processor_envelopes
from dask_blackbox.stream_processors.cluster import ClusterState
from fuzz_support import mutated_bytes
from dask_blackbox.testing.kafka_reader import read_records
from producers_support import FAST, wait_scheduler_delivered
from dask_blackbox.testing.replay import as_version_2

NOW = time.time()
_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def div(x, y):
    return x / y


@pytest.fixture(scope="module")
def recording(broker, tmp_path_factory):
    """The raw topic of a real workload, the scheduler's and the workers' transitions
    recorded (tuple keys, an erred task, spans, log events), as the producers sent it."""
    settings_, _ = pipeline_settings(broker, "t" + uuid.uuid4().hex[:10],
                                     tmp_path_factory.mktemp("captures"))
    with dask.config.set(settings_):
        asyncio.run(kafka.ensure_topics())
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            producers.attach(client, **FAST, **{"producer.record.worker-transitions": True})
            with dask.config.set({"optimization.fuse.active": False}), span("captured"):
                assert (da.ones((120, 120), chunks=20) + 1).sum().compute() == 2 * 120 * 120
            with pytest.raises(ZeroDivisionError):
                client.submit(div, 1, 0, key=("div", 0)).result()
            client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.log_event(
                "captured", {"n": 1}))
            wait_scheduler_delivered(client)
        return [(r.key, r.value) for r in read_records(contract.RAW, idle=1.0)]


def _message(key, value, offset) -> Message:
    return Message(contract.RAW, "t.raw", 0, offset, key, value, 1000)


def _sink_rows(messages) -> tuple[dict[str, list], Batch]:
    batch = Batch()
    for offset, (key, value) in enumerate(messages):
        batch.add(_message(key, value, offset), NOW)
    out = {}
    for table, data in batch.tables.items():
        columns = [list(c) for c in data.columns]
        names = COLUMNS[table]
        if table == "envelopes":  # the message's size is its encoding's
            columns[names.index("n_bytes")] = [None] * len(columns[0])
        out[table] = sorted(map(repr, zip(*columns)))
    return out, batch


def _processed(messages) -> tuple[list, list, list]:
    """Snapshots (without their wall-clock ``updated_at``), partials and refusals of
    ``messages`` applied to ClusterStates, as a processor applies them."""
    states: dict[str, ClusterState] = {}
    partials, refused = [], []
    for key, value in messages:
        env = processor_envelopes.decode(value, key, expand=False)
        state = states.setdefault(env["cluster_id"], ClusterState(env["cluster_id"], 5.0, 100_000))
        applied = state.apply(env)
        if applied is not None:
            partials += state.partial_records(applied.closed)
            refused += applied.rejected
    snapshots = []
    for state in states.values():
        partials += state.partial_records(state.windows.close_all())
        snapshots += [{k: v for k, v in s.items() if k != "updated_at"}
                      for s in state.snapshots(final=True)]
    key = repr
    return sorted(snapshots, key=key), sorted(partials, key=key), refused


def test_the_producers_send_version_3_with_captures(recording):
    values = [v for _, v in recording]
    assert values and all(contract.is_msgpack(v) for v in values)
    decoded = [contract.validate_envelope(contract.decode_envelope(v)) for v in values]
    assert {e["schema"] for e in decoded} == {3}
    kinds = {ev["kind"] for e in decoded for ev in e["events"]}
    assert contract.CAPTURE in kinds and contract.TRANSITION_RUN not in kinds
    assert {e["source"] for e in decoded
            if any(ev["kind"] == contract.CAPTURE for ev in e["events"])} == {"scheduler", "worker"}
    # tuple keys travel as Dask made them, and read back as their text
    keys = [k for e in decoded for ev in e["events"] if ev["kind"] == contract.CAPTURE
            for k in ev["key"]]
    assert any(type(k) is list for k in keys)
    assert "('div', 0)" in {t["key"] for e in decoded for t in contract.expand_events(e["events"])
                            if t["kind"] == contract.TRANSITION}


def test_a_mixed_topic_loads_the_same_rows_as_version_2_alone(recording):
    version_2 = [(k, as_version_2(v)) for k, v in recording]
    assert not any(contract.is_msgpack(v) for _, v in version_2)
    mixed = [(k, v if i % 2 else w) for i, ((k, v), (_, w)) in
             enumerate(zip(recording, version_2))]
    expected, a = _sink_rows(version_2)
    for route in (mixed, recording):
        got, b = _sink_rows(route)
        assert got == expected
        assert b.n_checked == 0 and not got["dead_letters"]  # the typed path took every one
    assert len(expected["transitions"]) > 500
    erred = [r for r in expected["transitions"] if "ZeroDivisionError" in r]
    assert erred and "'erred'" in erred[0]


def test_a_mixed_topic_rebuilds_the_same_spans_and_partials(recording):
    version_2 = [(k, as_version_2(v)) for k, v in recording]
    mixed = [(k, w if i % 2 else v) for i, ((k, v), (_, w)) in
             enumerate(zip(recording, version_2))]
    snapshots, partials, refused = _processed(version_2)
    assert snapshots and partials and not refused
    assert any(tuple(s["name"]) == ("captured",) for s in snapshots)
    for route in (mixed, recording):
        assert _processed(route) == (snapshots, partials, [])


# ------------------------------------------------------------------ malformed


class _Group:
    def __init__(self, prefix: str, name: str, span_id: str):
        self.prefix = type("Prefix", (), {"name": prefix})()
        self.name, self.span_id = name, span_id


def _v3(events: list | None = None, seq: int = 0) -> bytes:
    """A version 3 envelope made by the producers' encoder (``events``: replace its
    decoded events with these)."""
    group = _Group("x", "x-1", "S")
    carried = _encode(("tcp://w:1", 8, "int", [{"action": "compute", "start": NOW - 2,
                                                 "stop": NOW - 1}], 7))
    items = [TransitionItem(("x-1", 0), "released", "waiting", "s1", NOW - 3, group),
             TransitionItem(("x-1", 0), "processing", "memory", "s2", NOW - 1, group, None,
                            carried),
             Ready({"kind": contract.LOG, "ts": NOW - 1, "logger": "l", "level": "INFO",
                    "message": "m", "process": 1, "exc_text": None, "worker": None,
                    "key": None}, 100)]
    maker = RowMaker(1000)
    entries, _ = maker.rows(items, captured=True)
    (body,) = pack_captured(entries, maker)
    value = envelope(Identity("scheduler", "c1", "c"), seq, body.events)
    if events is None:
        return value
    return _encode({**_decode(value), "events": events})


def _capture(**changes) -> dict:
    (capture,) = [e for e in _decode(_v3())["events"] if e["kind"] == contract.CAPTURE]
    return {**capture, **changes}


def _deep(depth: int):
    value = None
    for _ in range(depth):
        value = [value]
    return value


MALFORMED = [
    ("truncated", _v3()[:40], "not MessagePack"),
    ("truncated in a capture", _v3()[:len(_v3()) - 30], "not MessagePack"),
    ("a column of another length", _v3([_capture(start=["released"])]), "start: 1 values"),
    ("kwargs of another length", _v3([_capture(kwargs=[None])]), "kwargs: 1 values"),
    ("kwargs entries too short", _v3([_capture(kwargs=[None, ["tcp://w:1"]])]),
     "kwargs: expected arrays of 5 values"),
    ("a name out of range", _v3([_capture(name=[0, 9])]), "name: expected indexes"),
    ("a key that is no Dask key", _v3([_capture(key=[{"a": 1}, "b"])]), "is not a Dask key"),
    ("a start that is no text", _v3([_capture(start=[{"a": 1}, "released"])]), "start"),
    ("names that are no names", _v3([_capture(names=[["x"]])]), "names:"),
    ("a huge count", _v3()[:-60] + b"\xdd\xff\xff\xff\xff", "not MessagePack"),
    # (a kind of no known shape: the typed path, whose decoder guards its own depth,
    # leaves the message to the checked path, which counts)
    ("too deep", _v3([{"kind": "unknown", "ts": NOW, "msg": _deep(MAX_DEPTH + 5)}]),
     f"nested {MAX_DEPTH + 8} deep"),  # the envelope, events, the event, 105 arrays
    # (deeper than msgspec encodes: the envelope's bytes, events last, written here)
    ("far too deep", _encode({**_decode(_v3()), "events": None})[:-1] + b"\x91" * 5000
     + b"\xc0", "nested more than"),
]


@pytest.mark.parametrize("name, value, reason", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_version_3_message_is_a_dead_letter_with_its_reason(name, value, reason):
    batch = Batch()
    batch.add(_message(b"c1", value, 0), NOW)
    data = batch.tables["dead_letters"]
    reasons = [dict(zip(COLUMNS["dead_letters"], r))["reason"] for r in zip(*data.columns)]
    assert reasons and reason in reasons[0], reasons
    # the processors: refused as a message, or the event refused, the rest applied
    try:
        env = processor_envelopes.decode(value, b"c1", expand=False)
    except contract.InvalidEnvelope as e:
        letter = processor_envelopes.dead_letter("t.raw", 0, 0, b"c1", value, str(e))
        assert letter["payload"] and letter["reason"]
        return
    applied = ClusterState("c1", 5.0, 1000).apply(env)
    assert applied is not None


def test_the_version_3_message_itself_loads():
    rows, batch = _sink_rows([(b"c1", _v3())])
    assert not rows["dead_letters"] and batch.n_checked == 0
    assert len(rows["transitions"]) == 2 and len(rows["logs"]) == 1


SAMPLES = [_v3(), _v3([_capture(error=[None, ["ValueError: x", "tb", "('x-1', 0)"]])])]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_mutated_version_3_message_never_stops_a_reader(data):
    value = data.draw(st.sampled_from(SAMPLES))
    mutated = mutated_bytes(data.draw, value)
    batch = Batch()
    batch.add(_message(b"c1", mutated, 0), NOW)  # never raises
    assert batch.tables["envelopes"] or batch.tables["dead_letters"]
    try:
        env = processor_envelopes.decode(mutated, b"c1", expand=False)
    except contract.InvalidEnvelope:
        return
    ClusterState("c1", 5.0, 1000).apply(env)  # refuses what it cannot apply, never raises
