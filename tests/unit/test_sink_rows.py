"""Message conversion (sinks.batch): what becomes rows, what becomes a dead letter
with which reason, and that the column-at-a-time path and the event-by-event path
give the same rows."""

from __future__ import annotations

import math
import time

import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.tables import COLUMNS, Message

from sink_support import envelope, transition

NOW = time.time()


def message(value, topic=contract.RAW, offset=0) -> Message:
    raw = value if isinstance(value, bytes) else orjson.dumps(value)
    return Message(topic, f"t.{topic}", 0, offset, b"c1", raw, 1000)


def rows(batch: Batch, table: str) -> list[dict]:
    data = batch.tables[table]
    return [dict(zip(COLUMNS[table], values)) for values in zip(*data.columns)]


def dead(batch: Batch) -> list[str]:
    return [r["reason"] for r in rows(batch, "dead_letters")]


def test_an_envelope_becomes_rows_of_each_kind():
    t = NOW - 10
    events = [
        transition("('x-1', 0)", "waiting", "processing", t, worker="tcp://w:1", prefix="x",
                   group="x-1", span_id="s1"),
        transition("('x-1', 0)", "processing", "memory", t + 1, nbytes=80, typename="int",
                   startstops=[{"action": "compute", "start": t, "stop": t + 1},
                               {"action": "transfer", "start": t - 1, "stop": t, "source": "tcp://w:2"}]),
        {"kind": contract.LOG, "ts": t, "logger": "distributed.worker", "level": "INFO",
         "message": "hello", "process": 1234, "exc_text": None},
        {"kind": contract.EVENT, "ts": t, "topic": "runtimes", "msg": {"start": 1.5, "stop": 2}},
        {"kind": contract.WORKER_DIGESTS, "ts": t, "worker": "tcp://w:1",
         "digests": [["execute", "s1", "x", "thread-cpu", "seconds", 0.5]]},
        {"kind": contract.GRAPH, "ts": t, "client": "Client-1", "stimulus_id": "update-graph-1",
         "n_tasks": 3, "keys": ["('x-1', 0)"], "annotations": None,
         "tasks": [{"key": "('x-1', 0)", "prefix": "x", "group": "x-1", "span_id": "s1",
                    "dependencies": ["a", "b"]}]},
    ]
    batch = Batch()
    batch.add(message(envelope(events, seq=7)), NOW)
    assert dead(batch) == [] and batch.n_checked == 0  # the typed path takes every kind
    trans = rows(batch, "transitions")
    assert [(r["key"], r["start"], r["finish"], r["seq"], r["idx"]) for r in trans] == [
        ("('x-1', 0)", "waiting", "processing", 7, 0), ("('x-1', 0)", "processing", "memory", 7, 1)]
    assert trans[0]["nbytes"] is None and trans[1]["nbytes"] == 80
    assert trans[1]["startstops.action"] == ["compute", "transfer"]
    assert trans[1]["startstops.source"] == [None, "tcp://w:2"]  # None: '' (sinks.arrow)
    assert trans[1]["startstops.start"] == [t, t - 1]
    assert rows(batch, "logs")[0]["process"] == "1234"
    assert orjson.loads(rows(batch, "events")[0]["msg"]) == {"start": 1.5, "stop": 2}
    assert rows(batch, "worker_digests")[0]["value"] == 0.5
    assert rows(batch, "graphs")[0]["n_tasks"] == 3
    assert rows(batch, "graph_tasks")[0]["dependencies"] == ["a", "b"]
    env = rows(batch, "envelopes")[0]
    assert (env["n_events"], env["n_transitions"], env["n_memory"], env["seq"]) == (6, 2, 1, 7)


def test_invalid_messages_are_dead_letters_with_the_contracts_reason():
    batch = Batch()
    batch.add(message(b"{not json", offset=1), NOW)
    batch.add(message({"schema": 99}, offset=2), NOW)
    batch.add(message(envelope([], seq=-1), offset=3), NOW)
    reasons = dead(batch)
    assert reasons[0].startswith("not JSON")
    assert reasons[1] == str(pytest.raises(contract.InvalidEnvelope, contract.validate_envelope,
                                           {"schema": 99}).value)
    assert "seq must be a non-negative integer" in reasons[2]
    assert [r["offset"] for r in rows(batch, "dead_letters")] == [1, 2, 3]
    assert rows(batch, "dead_letters")[0]["payload"] == "{not json"
    assert len(batch.tables["envelopes"]) == 0


@pytest.mark.parametrize("bad, reason", [
    ({"ts": 1.0}, "ts: 1.0 is not a plausible time"),
    ({"ts": NOW + 3 * 86400}, "is not a plausible time"),
    ({"ts": None}, "ts: None is not a time"),
    ({"key": ["x", 1]}, "key: a key must be a string"),
    ({"nbytes": "big"}, "nbytes: 'big' is not an integer"),
    ({"startstops": [{"action": "compute", "start": "soon", "stop": 1.0}]}, "startstops.start"),
    ({"worker": {"addr": 1}}, "worker: expected a string, got dict"),
])
def test_a_bad_event_is_dead_lettered_and_its_neighbours_loaded(bad, reason):
    good = [transition(f"k{i}", "waiting", "processing", NOW - 5 + i) for i in range(4)]
    events = good[:2] + [{**transition("bad", "waiting", "processing", NOW - 5), **bad}] + good[2:]
    batch = Batch()
    batch.add(message(envelope(events)), NOW)
    assert [r["key"] for r in rows(batch, "transitions")] == ["k0", "k1", "k2", "k3"]
    assert [r["idx"] for r in rows(batch, "transitions")] == [0, 1, 3, 4]
    [letter] = rows(batch, "dead_letters")
    assert letter["reason"].startswith("event 2: transition: ") and reason in letter["reason"]
    assert orjson.loads(letter["payload"])["key"] == events[2]["key"]


#: Events the typed path takes, and changes to one of them that it refuses (the
#: checked path then converts, or dead-letters, them).
REGULAR = [
    *(transition(f"('k', {i})", "processing", "memory", NOW - 9 + i, nbytes=i, worker=None,
                 startstops=[{"action": "compute", "start": NOW - 10, "stop": NOW - 9 + i}])
      for i in range(5)),
    {"kind": contract.LOG, "ts": NOW, "logger": "distributed", "level": "INFO", "message": "m",
     "process": 99, "exc_text": None},
    {"kind": contract.SCHEDULER_METRICS, "ts": NOW, "tasks_by_state": {"memory": 3}, "n_workers": 2,
     "n_threads": None, "memory": 10, "memory_managed": None, "memory_unmanaged": None,
     "memory_spilled": None, "event_loop_interval": 0.02},
]
IRREGULAR = [
    {"worker": 5},                  # a number where text goes: written out
    {"nbytes": 4.0},                # an integral float where an integer goes
    {"ts": 1.0},                    # not a plausible time: a dead letter
    {"startstops": [{"action": "compute", "start": "soon", "stop": NOW}]},
    {"kind": "future-kind"},        # a dead letter too
]


def test_both_conversion_paths_give_the_same_rows(monkeypatch):
    messages = [message(envelope(REGULAR), offset=0)]
    messages += [message(envelope([*REGULAR, {**REGULAR[0], **change}]), offset=i + 1)
                 for i, change in enumerate(IRREGULAR)]
    # An integer beyond 64 bits: orjson reads it as a float, msgspec as an int that
    # orjson cannot write back as JSON text.
    big = {"kind": contract.EVENT, "ts": NOW, "topic": "t", "msg": {"n": "BIG"}}
    messages.append(message(orjson.dumps(envelope([big])).replace(b'"BIG"', str(2**70).encode()),
                            offset=len(messages)))
    typed = Batch()
    for m in messages:
        typed.add(m, NOW)
    assert typed.n_checked == len(messages) - 1  # all but the first
    monkeypatch.setattr(Batch, "_add_typed", lambda self, message, now: False)
    checked = Batch()
    for m in messages:
        checked.add(m, NOW)
    assert checked.n_checked == len(messages)
    for table in COLUMNS:
        assert rows(typed, table) == rows(checked, table), table
    # What the checked path made of the irregular values:
    trans = rows(typed, "transitions")
    assert len(trans) == 5 * len(IRREGULAR) + 5 + 2  # two changes load, three are dead letters
    assert [t["worker"] for t in trans[5:11]] == [None] * 5 + ["5"]
    assert trans[16]["key"] == "('k', 0)" and type(trans[16]["nbytes"]) is int and trans[16]["nbytes"] == 4
    assert [r["process"] for r in rows(typed, "logs")][:1] == ["99"]
    assert orjson.loads(rows(typed, "events")[0]["msg"]) == {"n": float(2**70)}
    assert [r["reason"].split(":")[0] for r in rows(typed, "dead_letters")] == [
        "event 7", "event 7", "event 7"]


def test_unknown_event_kinds_are_kept_as_dead_letters():
    batch = Batch()
    batch.add(message(envelope([{"kind": "future-kind", "ts": NOW}])), NOW)
    assert dead(batch) == ["event 0: unknown event kind 'future-kind'"]


def test_derived_records():
    batch = Batch()
    state = {"cluster_id": "c1", "span_id": "s1", "name": ["a", "b"], "parent_id": "s0", "version": 3,
             "enqueued": NOW - 5, "start": NOW - 4, "stop": NOW - 1, "duration": 2.5, "nbytes_total": 10,
             "states": {"memory": 2}, "all_durations": {"compute": 2.5}, "done": True, "updated_at": NOW,
             "cumulative_worker_metrics": [["execute", "x", "thread-cpu", "seconds", 1.0]]}
    batch.add(message(state, contract.SPAN_STATE), NOW)
    batch.add(message({"cluster_id": "c1", "span_id": "s1", "prefix": "x", "window_start": NOW - 60,
                       "partial_id": "p1", "finished": {"memory": 2}, "durations": {"compute": 1.5},
                       "nbytes": 5, "n_erred": 0, "max_duration": 1.0}, contract.PREFIX_STATS), NOW)
    batch.add(message({"cluster_id": "c1", "producer_id": "p", "source": "worker", "missing_from": 4,
                       "missing_to": 2, "detected_at": NOW}, contract.GAPS), NOW)
    batch.add(message({"topic": "t.raw", "partition": 1, "offset": 9, "key": "c1", "reason": "bad",
                       "payload": "x", "detected_at": NOW}, contract.DEAD_LETTER), NOW)
    assert rows(batch, "span_state")[0]["cumulative_worker_metrics.prefix"] == ["x"]
    assert rows(batch, "prefix_stats")[0]["durations"] == {"compute": 1.5}
    letters = rows(batch, "dead_letters")
    assert [(d["origin"], d["reason"]) for d in letters] == [
        ("sink", "gaps: missing_from 4 and missing_to 2 are not a range"), ("processor", "bad")]
    assert len(batch.tables["gaps"]) == 0
    assert batch.positions == {(f"t.{contract.SPAN_STATE}", 0): 1, (f"t.{contract.PREFIX_STATS}", 0): 1,
                               (f"t.{contract.GAPS}", 0): 1, (f"t.{contract.DEAD_LETTER}", 0): 1}
    assert math.isclose(rows(batch, "span_state")[0]["enqueued"], NOW - 5)


def test_new_contract_fields_load_and_are_empty_when_missing():
    """Lifecycle.total_nthreads and SpanState.nthreads_intervals/active_cpu_seconds
    (migration 002): loaded on both paths; absent (older producers, processors), they
    load as empty lists and 0."""
    t = NOW - 10
    with_history = {"kind": contract.LIFECYCLE, "ts": t, "action": "worker_added",
                    "worker": "tcp://w:1", "client": None, "reason": None, "stimulus_id": None,
                    "detail": {}, "total_nthreads": [[t - 1, 2], [t, 3]]}
    older = {k: v for k, v in with_history.items() if k != "total_nthreads"}
    bad = {**with_history, "total_nthreads": [[t, 3, 4]]}
    for typed in (True, False):
        batch = Batch()
        if not typed:
            batch._add_typed = lambda message, now: False
        batch.add(message(envelope([with_history, older, bad])), NOW)
        life = rows(batch, "lifecycle")
        assert [(r["total_nthreads.time"], r["total_nthreads.nthreads"]) for r in life] == [
            ([t - 1, t], [2, 3]), ([], [])]
        assert dead(batch) == [f"event 2: lifecycle: total_nthreads: each entry must be a list "
                               f"[time, nthreads], got {[t, 3, 4]!r}"]
    batch = Batch()
    batch.add(message(envelope([with_history, older])), NOW)
    assert batch.n_checked == 0 and len(batch.tables["lifecycle"]) == 2  # the typed path
    state = {"cluster_id": "c1", "span_id": "s1", "version": 1, "enqueued": NOW - 5,
             "nthreads_intervals": [[NOW - 5, NOW - 4, 2], [NOW - 4, NOW - 3, 3]],
             "active_cpu_seconds": 5.0}
    batch = Batch()
    batch.add(message(state, contract.SPAN_STATE), NOW)
    older_state = {k: v for k, v in state.items() if k not in ("nthreads_intervals", "active_cpu_seconds")}
    batch.add(message(older_state, contract.SPAN_STATE, offset=1), NOW)
    assert [(r["nthreads_intervals.begin"], r["nthreads_intervals.nthreads"], r["active_cpu_seconds"])
            for r in rows(batch, "span_state")] == [([NOW - 5, NOW - 4], [2, 3], 5.0), ([], [], 0.0)]


def test_the_sinks_layouts_are_checked_against_the_contract(monkeypatch):
    """A contract field the sink neither loads nor declares not stored, or one whose
    declared type the sink's column kind cannot hold, fails at import (here: the
    checks run again on a changed contract)."""
    from dask_blackbox.sinks import events, records

    events.check_against_contract()
    records.check_against_contract()

    class NewField(contract.Lifecycle, total=False):
        gpu_count: int

    monkeypatch.setitem(contract.EVENTS, contract.LIFECYCLE, NewField)
    with pytest.raises(TypeError, match=r"lifecycle: contract field\(s\) gpu_count are neither "
                                        "loaded nor in sinks.events.NOT_STORED"):
        events.check_against_contract()

    class Retyped(contract.Transition):
        nbytes: str  # the sink stores an Int64

    monkeypatch.setitem(contract.EVENTS, contract.LIFECYCLE, contract.Lifecycle)
    monkeypatch.setitem(contract.EVENTS, contract.TRANSITION, Retyped)
    with pytest.raises(TypeError, match=r"transition.nbytes: kind 'int\?' does not store"):
        events.check_against_contract()

    class NewState(contract.SpanState):
        gpu_seconds: float

    monkeypatch.setitem(contract.RECORDS, contract.SPAN_STATE, NewState)
    with pytest.raises(TypeError, match=r"span-state: contract field\(s\) gpu_seconds are neither"):
        records.check_against_contract()


def test_the_query_servers_answer_keeps_times_of_every_wrapped_type():
    """A time crosses the query server as ISO text and comes back a datetime, also
    when its column is a roll-up's SimpleAggregateFunction (``max(last_seen)`` of the
    clusters view) or Nullable/LowCardinality."""
    import datetime

    from dask_blackbox.read import server

    t = datetime.datetime(2026, 11, 26, 19, 15, 46, 404295, tzinfo=datetime.timezone.utc)
    types = ["SimpleAggregateFunction(max, DateTime64(6, 'UTC'))", "Nullable(DateTime64(6, 'UTC'))",
             "SimpleAggregateFunction(sum, UInt64)", "LowCardinality(String)"]
    body = server.encode_result(["last_seen", "maybe", "n", "name"], types, [[t, None, 3, "x"]])
    columns, rows = server.decode_result(body)
    assert columns == ["last_seen", "maybe", "n", "name"]
    assert rows == [(t, None, 3, "x")]
