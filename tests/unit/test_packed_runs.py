"""TRANSITION_RUN, the packed form of a producer's plain transitions: what the
producers encode unpacks to exactly the events they used to send, and both readers
(the sink's two paths, the processors) take a run as the events it stands for, at
its place, and refuse a malformed one as one event that says why."""

from __future__ import annotations

import time
from types import SimpleNamespace

import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.producers.rows import Ready, RowMaker, TransitionItem, run_event
from dask_blackbox.producers.sender import encode_rows
from dask_blackbox.sinks.batch import Batch, payload_of
from dask_blackbox.sinks.tables import COLUMNS
from dask_blackbox.stream_processors import envelopes
from dask_blackbox.stream_processors.cluster import ClusterState

from sink_support import envelope
from test_sink_rows import message, rows

NOW = time.time()


def run_of(*events: dict) -> dict:
    """The TRANSITION_RUN of plain transitions, written by hand from the contract."""
    names = list(dict.fromkeys((e["prefix"], e["group"], e["span_id"]) for e in events))
    run = {
        "kind": contract.TRANSITION_RUN, "ts": events[0]["ts"],
        "key": [e["key"] for e in events], "time": [e["ts"] for e in events],
        "start": [e["start"] for e in events], "finish": [e["finish"] for e in events],
        "stimulus_id": [e["stimulus_id"] for e in events],
        "names": [None if n == (None, None, None) else list(n) for n in names],
        "name": [names.index((e["prefix"], e["group"], e["span_id"])) for e in events],
    }
    for column in contract.RUN_OPTIONAL_COLUMNS:  # left out where all None
        if any(e.get(column) is not None for e in events):
            run[column] = [e.get(column) for e in events]
    return run


def plain(key: str, start: str, finish: str, ts: float, names=("x", "x-1", "S"), stimulus="s1"):
    """A transition as a run's events are: nothing besides the record's fields."""
    event = dict.fromkeys(("kind", *contract.fields(contract.Transition)[1:]))
    prefix, group, span_id = (None, None, None) if names is None else names
    event.update(kind=contract.TRANSITION, ts=ts, key=key, prefix=prefix, group=group,
                 span_id=span_id, start=start, finish=finish, stimulus_id=stimulus)
    return event


FIRST = [plain("a", "released", "waiting", NOW - 9),
         plain("('b', 1)", "waiting", "processing", NOW - 8, ("y", "y-2", None), None),
         plain("c", "memory", "forgotten", NOW - 7, None, "s2")]
SECOND = [plain("d", "waiting", "processing", NOW - 5), plain("e", "waiting", "processing", NOW - 4)]
MIDDLE = {**plain("('b', 1)", "processing", "memory", NOW - 6, ("y", "y-2", None), "s3"),
          "nbytes": 8, "worker": "tcp://w:1", "typename": "int", "thread": 140001,
          "startstops": [{"action": "compute", "start": NOW - 7, "stop": NOW - 6}]}
ERRED = {**plain("f", "processing", "erred", NOW - 3, ("f", "f-1", "S"), "s4"),
         "worker": "tcp://w:2", "exception": "ValueError: 1", "traceback": "  line 1\n",
         "cause": "f"}
LOG = {"kind": contract.LOG, "ts": NOW, "logger": "distributed", "level": "INFO",
       "message": "m", "process": 9, "exc_text": None, "worker": None, "key": None}


# ---------------------------------------------------------------- the contract


def test_a_run_unpacks_to_its_events_in_order_with_every_field():
    run = run_of(*FIRST)
    assert contract.unpack_run(run) == FIRST
    assert [list(e) for e in contract.unpack_run(run)] == [list(e) for e in FIRST]
    packed = [LOG, run, MIDDLE, run_of(*SECOND)]
    assert contract.expand_events(packed) == [LOG, *FIRST, MIDDLE, *SECOND]
    mixed = [*FIRST, MIDDLE, *SECOND, ERRED]  # with Dask's kwargs too: their columns
    run = run_of(*mixed)
    assert set(contract.RUN_OPTIONAL_COLUMNS) <= set(run) and "worker" not in run_of(*FIRST)
    assert contract.unpack_run(run) == mixed
    assert contract.unpack_run({**run, "cause": None}) == [{**e, "cause": None} for e in mixed]
    unpacked = [LOG, MIDDLE, {"kind": ["a list"], "ts": NOW}, "not an event"]
    assert contract.expand_events(unpacked) is unpacked


MALFORMED = [
    ({"time": [NOW]}, "time: 1 values, key has 3"),
    ({"key": "abc"}, "key: expected a list, got str"),
    ({"key": [], "time": [], "start": [], "finish": [], "stimulus_id": [], "name": []},
     "key: a run of no events"),
    ({"names": [["x", "x-1"], None, ["y", "y-2", None]]}, "names: ['x', 'x-1'] is not"),
    ({"names": {"x": 1}}, "names: expected a list, got dict"),
    ({"name": [0, 7, 1]}, "name: expected indexes into names (0..2)"),
    ({"name": [0, True, 1]}, "name: expected indexes into names"),
    ({"name": [0, -1, 1]}, "name: expected indexes into names"),
    ({"worker": ["tcp://w:1"]}, "worker: 1 values, key has 3"),
    ({"nbytes": 8}, "nbytes: expected a list or null, got int"),
]


@pytest.mark.parametrize("change, reason", MALFORMED)
def test_a_malformed_run_names_its_problem_and_stays_packed(change, reason):
    bad = {**run_of(*FIRST), **change}
    with pytest.raises(contract.InvalidEvent) as e:
        contract.unpack_run(bad)
    assert str(e.value).startswith(reason)
    assert contract.expand_events([LOG, bad, run_of(*SECOND)]) == [LOG, bad, *SECOND]


# --------------------------------------------------------------- the producers


class Group:
    def __init__(self, prefix, name, span_id):
        self.prefix, self.name, self.span_id = SimpleNamespace(name=prefix), name, span_id


def _event(key, start, finish, stimulus_id, ts, names, **carried) -> dict:
    """The TRANSITION event a transition should be, written from the contract."""
    prefix, group, span_id = names or (None, None, None)
    event = dict.fromkeys(("kind", *contract.fields(contract.Transition)[1:]))
    event.update(kind=contract.TRANSITION, ts=ts, key=contract.encode_key(key), prefix=prefix,
                 group=group, span_id=span_id, start=start, finish=finish,
                 stimulus_id=stimulus_id, **carried)
    return event


def test_the_producers_runs_unpack_to_the_events_they_stand_for():
    maker = RowMaker(1000)
    groups = [Group("x", "x-1", "S"), Group("é", "é-2", None)]
    keys = ["a", ("x-1", 0, 1), 7, ("é", 2.5), "a\u20ac", ("x-1", 0, 1)]
    items = [TransitionItem(key, "waiting", "processing", None if i == 3 else f"s{i // 2}",
                            NOW + i / 3, None if i == 4 else groups[i % 2])
             for i, key in enumerate(keys)]
    expected = [_event(i.key, i.start, i.finish, i.stimulus_id, i.ts,
                       None if i.group is None else maker.names(i.group)) for i in items]
    rows, failed = maker.rows(items)
    assert not failed
    run = orjson.loads(orjson.dumps(run_event(rows)))
    assert run["kind"] == contract.TRANSITION_RUN and run["ts"] == items[0].ts
    assert len(run["names"]) == 3  # each group's names once, and the forgotten task's
    assert not set(contract.RUN_OPTIONAL_COLUMNS) & set(run)  # all None: left out
    assert contract.unpack_run(run) == orjson.loads(orjson.dumps(expected))
    # Transitions with Dask's kwargs among them: their columns too; an erred one's
    # error is read from Dask's kwargs as they are.
    startstops = [{"action": "compute", "start": NOW, "stop": NOW + 1}]
    carried = TransitionItem(("x-1", 0, 2), "processing", "memory", "s9", NOW + 3, groups[0],
                             None, ("tcp://w:1", 8, "int", startstops, 1234))
    error = {"exception_text": "ValueError: x", "traceback_text": "tb", "cause": ("x-1", 0, 2),
             "worker": "tcp://w:1", "thread": 99}
    erred = TransitionItem("e", "processing", "erred", "s9", NOW + 4, None, None,
                           ("tcp://w:1", None, None, None, 99), error)
    rows, _ = maker.rows([items[0], carried, items[1], erred])
    run = orjson.loads(orjson.dumps(run_event(rows)))
    assert set(run) >= {"worker", "nbytes", "typename", "startstops", "thread", "exception",
                        "traceback", "cause"}
    expected = [
        expected[0],
        _event(carried.key, "processing", "memory", "s9", NOW + 3, ("x", "x-1", "S"),
               worker="tcp://w:1", nbytes=8, typename="int", startstops=startstops, thread=1234),
        expected[1],
        _event("e", "processing", "erred", "s9", NOW + 4, None, worker="tcp://w:1", thread=99,
               exception="ValueError: x", traceback="tb", cause="('x-1', 0, 2)"),
    ]
    assert contract.unpack_run(run) == orjson.loads(orjson.dumps(expected))


def test_the_sender_packs_each_run_at_its_place():
    maker = RowMaker(1000)
    group = Group("x", "x-1", "S")
    (a, b), _ = maker.rows([TransitionItem("a", "released", "waiting", "s", NOW, group),
                            TransitionItem("b", "released", "waiting", "s", NOW + 1)])
    other = Ready({"kind": contract.LOG, "ts": NOW}, 100)
    events = orjson.loads(encode_rows([a, other, a, b, other], 1000))
    assert [e["kind"] for e in events] == [contract.TRANSITION_RUN, contract.LOG,
                                           contract.TRANSITION_RUN, contract.LOG]
    expanded = contract.expand_events(events)
    assert [(e["kind"], e.get("key")) for e in expanded] == [
        (contract.TRANSITION, "a"), (contract.LOG, None), (contract.TRANSITION, "a"),
        (contract.TRANSITION, "b"), (contract.LOG, None)]
    # Text orjson cannot write (a lone surrogate, as a file name decoded with
    # surrogateescape makes) is escaped, in a run and in a user's text alike.
    (odd,), _ = maker.rows([TransitionItem("\ud800", "released", "waiting", "s", NOW)])
    [event] = contract.expand_events(orjson.loads(encode_rows([odd], 1000)))
    assert event["kind"] == contract.TRANSITION and event["start"] == "released"
    assert event["key"] == "\\ud800"
    log = Ready({"kind": contract.LOG, "ts": NOW, "message": "bad \udcff name"}, 100)
    assert orjson.loads(encode_rows([log], 1000))[0]["message"] == "bad \\udcff name"


# --------------------------------------------------------------------- the sink


def _sink_rows(values: list, monkeypatch, typed: bool) -> tuple[Batch, dict]:
    with monkeypatch.context() as m:
        if not typed:
            m.setattr(Batch, "_add_typed", lambda self, message, now: False)
        batch = Batch()
        for offset, value in enumerate(values):
            batch.add(message(value, offset=offset), NOW)
    return batch, {t: rows(batch, t) for t in COLUMNS}


@pytest.mark.parametrize("typed", [True, False], ids=["typed path", "checked path"])
def test_the_sink_loads_a_run_as_the_events_it_stands_for(monkeypatch, typed):
    packed = [envelope([LOG, run_of(*FIRST), MIDDLE, run_of(*SECOND)], seq=3, sent_at=NOW),
              envelope([run_of(*SECOND, ERRED, MIDDLE)], seq=4, sent_at=NOW)]
    expanded = [envelope([LOG, *FIRST, MIDDLE, *SECOND], seq=3, sent_at=NOW),
                envelope([*SECOND, ERRED, MIDDLE], seq=4, sent_at=NOW)]
    batch, got = _sink_rows(packed, monkeypatch, typed)
    _, want = _sink_rows(expanded, monkeypatch, True)
    assert batch.n_checked == (0 if typed else 2)
    assert got["dead_letters"] == []
    for table in COLUMNS:
        if table == "envelopes":
            for row in [*got[table], *want[table]]:
                del row["n_bytes"]
        assert sorted(got[table], key=repr) == sorted(want[table], key=repr), table
    trans = sorted(got["transitions"], key=lambda r: (r["seq"], r["idx"]))
    assert [(r["seq"], r["idx"], r["key"]) for r in trans] == [
        (3, 1, "a"), (3, 2, "('b', 1)"), (3, 3, "c"), (3, 4, "('b', 1)"), (3, 5, "d"),
        (3, 6, "e"), (4, 0, "d"), (4, 1, "e"), (4, 2, "f"), (4, 3, "('b', 1)")]
    assert [(e["n_events"], e["n_transitions"], e["n_erred"]) for e in got["envelopes"]] == [
        (7, 6, 0), (4, 4, 1)]
    assert trans[-2]["exception"] == "ValueError: 1" and trans[-1]["nbytes"] == 8


@pytest.mark.parametrize("change, reason", MALFORMED)
def test_the_sink_dead_letters_a_malformed_run_and_loads_the_rest(monkeypatch, change, reason):
    bad = {**run_of(*FIRST), **change}
    value = envelope([LOG, bad, run_of(*SECOND)], seq=5)
    batch, got = _sink_rows([value], monkeypatch, True)
    assert batch.n_checked == 1
    [letter] = got["dead_letters"]
    assert letter["reason"].startswith(f"event 1: {contract.TRANSITION_RUN}: {reason}")
    assert orjson.loads(letter["payload"]) == bad
    assert [(r["idx"], r["key"]) for r in got["transitions"]] == [(2, "d"), (3, "e")]
    assert len(got["logs"]) == 1
    # What the loader keeps of an event ClickHouse refuses: the expanded envelope's.
    assert orjson.loads(payload_of(message(value), 3))["key"] == "e"


def test_the_sink_checks_a_runs_values_as_those_of_its_events(monkeypatch):
    run = run_of(*FIRST)
    run["time"][1] = "soon"
    batch, got = _sink_rows([envelope([run])], monkeypatch, True)
    assert batch.n_checked == 1
    [letter] = got["dead_letters"]
    assert letter["reason"].startswith("event 1: transition: ts: ")
    assert [r["key"] for r in got["transitions"]] == ["a", "c"]


# --------------------------------------------------------------- the processors


def _applied(value: dict):
    state = ClusterState("c1", 60.0, 10_000)
    decoded = envelopes.decode(orjson.dumps(value), b"c1")
    return decoded, state, state.apply(decoded)


def test_the_processors_apply_a_run_as_its_events():
    packed = envelope([LOG, run_of(*FIRST), MIDDLE, run_of(*SECOND)], seq=0)
    expanded = envelope([LOG, *FIRST, MIDDLE, *SECOND], seq=0)
    decoded, state, applied = _applied(packed)
    assert decoded["events"] == expanded["events"]
    _, reference, want = _applied(expanded)
    assert (applied.gaps, applied.rejected) == (want.gaps, want.rejected) == ([], [])
    assert state.partial_records(applied.closed) == reference.partial_records(want.closed)
    assert state.records() == reference.records()


BAD_VALUES = [  # (event of FIRST, field, value): a run's events checked one by one
    (0, "ts", "soon"), (1, "key", 5), (2, "start", None), (0, "group", 7),
    (1, "prefix", 9), (0, "span_id", 3.5), (0, "ts", True)]


@pytest.mark.parametrize("source", ["scheduler", "worker"])
@pytest.mark.parametrize("bad", [None, *BAD_VALUES])
def test_the_processors_apply_a_packed_run_as_its_expanded_events(bad, source):
    """As the processors read it (runs left packed), a run changes the state, and
    refuses its bad events, exactly as its events expanded do."""
    first = [dict(e) for e in FIRST]
    middle = {**MIDDLE, "startstops": [{"action": "compute", "start": NOW - 7}]} if bad \
        else MIDDLE
    if bad is not None:
        i, field, value = bad
        first[i][field] = value
    events = [{**LOG, "ts": NOW - 20}, run_of(*first), run_of(middle), middle, run_of(*SECOND)]
    value = orjson.dumps(envelope(events, seq=0, source=source))
    packed, expanded = (envelopes.decode(value, b"c1", expand=expand)
                        for expand in (False, True))
    assert packed["events"] == events
    assert envelopes.count_events(packed["events"]) == len(expanded["events"])
    state, reference = ClusterState("c1", 60.0, 10_000), ClusterState("c1", 60.0, 10_000)
    applied, want = state.apply(packed), reference.apply(expanded)
    assert applied.rejected == want.rejected
    # a worker's transitions are not applied: only their ts is checked
    assert len(want.rejected) == (0 if bad is None else 3 if source == "scheduler"
                                  else int(bad[1] == "ts"))
    assert state.partial_records(applied.closed) == reference.partial_records(want.closed)
    assert state.partial_records(state.windows.close_all()) == \
        reference.partial_records(reference.windows.close_all())
    assert state.records() == reference.records()
    assert state.snapshots() == reference.snapshots()


@pytest.mark.parametrize("change, reason", MALFORMED[:2])
def test_the_processors_refuse_a_malformed_run_as_one_event(change, reason):
    bad = {**run_of(*FIRST), **change}
    _, state, applied = _applied(envelope([LOG, bad, run_of(*SECOND)], seq=0))
    [rejection] = applied.rejected
    assert (rejection.index, rejection.kind) == (1, contract.TRANSITION_RUN)
    assert f"{rejection.field}: {rejection.reason}".startswith(reason)
    assert state.malformed_events == 1
