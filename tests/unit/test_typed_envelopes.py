"""The processors' typed path: a version 3 envelope the typed decoder takes folds to
exactly the state the generic path (``contract.decode_envelope``, checked for depth)
folds it to, for every event kind, from envelopes the producers' packing builds; and
whatever the typed decoder refuses (wrong types, too deep, text that is no UTF-8, an
unknown field or kind) takes the generic path, which dead-letters or refuses it as it
always did."""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dask_blackbox import contract
from dask_blackbox.nesting import MAX_DEPTH
from dask_blackbox.producers.rows import (
    EventItem, GraphEntry, GraphItem, Ready, RowMaker, TransitionItem,
)
from dask_blackbox.producers.sender import Identity, envelope, pack_captured
from dask_blackbox.stream_processors import envelopes
from dask_blackbox.stream_processors.cluster import APPLIED_KINDS, ClusterState

from fuzz_support import mutated_bytes

NOW = time.time()
_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


class _Group:
    """What the producers read of a Dask TaskGroup."""

    def __init__(self, prefix: str, name: str, span_id: str | None):
        self.prefix = type("Prefix", (), {"name": prefix})()
        self.name, self.span_id = name, span_id


X, Y = _Group("x", "x-1", "S"), _Group("y", "y-2", "T")


def _carried(start: float, stop: float, nbytes: int = 8) -> bytes:
    """Dask's transition kwargs as the scheduler's hook encodes them."""
    return _encode(("tcp://w:1", nbytes, "int",
                    [{"action": "compute", "start": start, "stop": stop},
                     {"action": "transfer", "start": start - 0.5, "stop": start,
                      "source": "tcp://w:2"}], 7))


def _items(t: float) -> list:
    """A hook's items of every event kind: transitions (text and tuple keys, a task
    finishing with its startstops, an erred one, a forgotten one), and each other kind
    as the producers make it."""
    return [
        Ready({"kind": contract.LIFECYCLE, "ts": t - 10, "action": "scheduler_start",
               "worker": None, "client": None, "reason": None, "stimulus_id": None,
               "detail": {"address": "tcp://s:1"}, "total_nthreads": [[t - 10, 0], [t - 9, 2]]},
              100),
        Ready({"kind": contract.SPAN, "ts": t - 9, "span_id": "S", "name": ["bench"],
               "parent_id": None, "enqueued": t - 9}, 100),
        Ready({"kind": contract.SPAN, "ts": t - 9, "span_id": "T", "name": ["bench", "inner"],
               "parent_id": "S", "enqueued": t - 8.5}, 100),
        GraphItem(t - 8, "Client-1", "update-graph-1", 3, 3, 1, [("x-1", 0)],
                  {"retries": {("x-1", 0): 1}},
                  [GraphEntry(("x-1", 0), X, (), 0), GraphEntry("y-2", Y, (("x-1", 0),), 1),
                   GraphEntry("z", X, (), 0, ("x", "x-1", "S"))], 0, 1, 100),
        TransitionItem(("x-1", 0), "released", "waiting", "s1", t - 8, X),
        TransitionItem(("x-1", 0), "waiting", "processing", "s1", t - 7.5, X),
        TransitionItem(("x-1", 0), "processing", "memory", "s2", t - 7, X, None,
                       _carried(t - 7.4, t - 7.1)),
        TransitionItem("y-2", "released", "waiting", "s1", t - 7, Y),
        TransitionItem("y-2", "waiting", "processing", "s3", t - 6.5, Y),
        TransitionItem("y-2", "processing", "erred", "s4", t - 6, Y, None,
                       _encode(("tcp://w:2", None, None, None, 8)),
                       {"exception_text": "ValueError('y')", "traceback_text": "  line 1\n",
                        "cause": "y-2"}),
        EventItem(t - 6, "scheduler", {"action": "update-graph", "metrics": {"tasks": 3}}, 100),
        Ready({"kind": contract.WORKER_DIGESTS, "ts": t - 5, "worker": "tcp://w:1",
               "digests": [["execute", "S", "x", "thread-cpu", "seconds", 0.25],
                           ["execute", "T", "y", "thread-noncpu", "seconds", 1],
                           ["gather-dep", None, "x", "network", "bytes", 800]]}, 100),
        Ready({"kind": contract.SCHEDULER_METRICS, "ts": t - 5,
               "tasks_by_state": {"memory": 1, "erred": 1}, "n_workers": 2, "n_threads": 2,
               "memory": 1 << 20, "memory_managed": 8, "memory_unmanaged": 1 << 19,
               "memory_spilled": 0, "event_loop_interval": 0.02}, 100),
        Ready({"kind": contract.WORKER_METRICS, "ts": t - 5, "worker": "tcp://w:1",
               "memory": 1 << 20, "memory_managed": 8, "memory_unmanaged": 1 << 19,
               "memory_spilled": 0, "cpu": 12.5, "executing": 0, "ready": 0, "in_flight": 0,
               "event_loop_interval": 0.02, "gil_contention": None}, 100),
        Ready({"kind": contract.LOG, "ts": t - 4, "logger": "distributed.worker",
               "level": "WARNING", "message": "Compute Failed", "process": 9,
               "exc_text": None, "worker": "tcp://w:2", "key": "y-2"}, 100),
        Ready({"kind": contract.WORKER_EXIT, "ts": t - 3, "worker": "tcp://w:2", "pid": 12,
               "exitcode": -9, "signal": "SIGKILL", "memory": 1 << 20, "memory_peak": 1 << 21,
               "memory_limit": 1 << 30, "memory_terminate": 0.95, "host_memory": 1 << 33,
               "host_memory_available": 1 << 32, "nanny_status": "running", "starts": 1,
               "started": t - 10}, 100),
        Ready({"kind": contract.DROPS, "ts": t - 3, "dropped_events": 4, "dropped_bytes": 400,
               "since": t - 20, "until": t - 19}, 100),
        Ready({"kind": contract.PROFILE, "ts": t - 3, "worker": "tcp://w:1", "prefix": "x",
               "stacks": ["a.py:1:main;b.py:5:f", "a.py:1:main"], "counts": [7, 2]}, 100),
        Ready({"kind": contract.STACKS, "ts": t - 3, "worker": "tcp://w:2", "pid": 12,
               "reason": "unresponsive", "memory": 1 << 20, "memory_limit": 1 << 30,
               "silent": 3.5, "threads": ["MainThread", "Dask-Default-Threads-12-0"],
               "thread_ids": [12, 13], "stacks": ["a.py:3:main", "t.py:9:run;b.py:7:hold"],
               "active": [False, True], "gil": [False, True], "error": None}, 100),
        TransitionItem(("x-1", 0), "memory", "released", "s5", t - 2, X),
        TransitionItem(("x-1", 0), "released", "forgotten", "s5", t - 2, X),
        Ready({"kind": contract.LIFECYCLE, "ts": t - 1, "action": "worker_removed",
               "worker": "tcp://w:2", "client": None, "reason": "worker-close",
               "stimulus_id": "s6", "detail": None, "total_nthreads": [[t - 1, 1]]}, 100),
        Ready({"kind": contract.LIFECYCLE, "ts": t, "action": "scheduler_close",
               "worker": None, "client": None, "reason": None, "stimulus_id": None,
               "detail": None}, 100),
    ]


def _envelope(seq: int, items: list | None = None, source: str = "scheduler") -> bytes:
    """A version 3 envelope as the producers pack and send it."""
    maker = RowMaker(1000)
    entries, failed = maker.rows(_items(NOW) if items is None else items, captured=True)
    assert not failed
    (body,) = pack_captured(entries, maker)
    return envelope(Identity(source, "c1", "c", f"{source}-p"), seq, body.events, NOW)


def _replaced(value: bytes, **changes) -> bytes:
    """``value`` decoded, its envelope fields changed (``events`` a function of them)."""
    decoded = _decode(value)
    if callable(changes.get("events")):
        changes["events"] = changes["events"](decoded["events"])
    return _encode({**decoded, **changes})


def _event(value: bytes, kind: str, **changes):
    """A function of an envelope's events: its first event of ``kind`` changed."""
    def change(events):
        i = next(i for i, ev in enumerate(events) if ev["kind"] == kind)
        return [*events[:i], {**events[i], **changes}, *events[i + 1:]]
    return change


def _outcome(values: list[bytes], typed: bool):
    """What a processor makes of ``values``, in order, through the typed path or the
    generic one alone: each message's dead letter reason or what applying it
    produced, then the state (its records, snapshots and last partials)."""
    state = ClusterState("c1", 5.0, 100_000)
    out: list = []
    for value in values:
        try:
            env = envelopes.decode(value, b"c1", expand=False, typed=typed)
        except contract.InvalidEnvelope as e:
            out.append(("dead letter", str(e)))
            continue
        n = envelopes.count_events(env["events"])
        applied = state.apply(env)
        out.append(None if applied is None else
                   (n, applied.gaps, state.partial_records(applied.closed), applied.rejected))
    snapshots = [{k: v for k, v in s.items() if k != "updated_at"}
                 for s in state.snapshots(final=True)]
    closed = state.partial_records(state.windows.close_all())
    return out, state.records(), snapshots, closed, state.malformed_events


def _typed(value: bytes) -> bool:
    """Whether the typed path takes ``value``: the events it does not apply hold
    only their kind and ts."""
    env = envelopes.decode(value, b"c1", expand=False)
    return any(set(ev) == {"kind", "ts"} for ev in env["events"]
               if ev["kind"] not in APPLIED_KINDS)


def test_the_typed_decoder_nests_no_deeper_than_the_generic_path_decodes():
    assert envelopes.TYPED_DEPTH <= MAX_DEPTH


def test_a_typed_envelope_folds_to_the_state_the_generic_path_folds_it_to():
    values = [_envelope(0), _envelope(1, _items(NOW + 20)), _envelope(1),
              _envelope(3, _items(NOW + 40))]  # a duplicate, a gap
    decoded = _decode(values[0])
    kinds = {ev["kind"] for ev in decoded["events"]}
    assert kinds == set(contract.EVENTS) - {contract.TRANSITION} | {contract.CAPTURE}
    assert all(map(_typed, values))
    typed, generic = _outcome(values, True), _outcome(values, False)
    assert typed == generic
    out, records, snapshots, _, malformed = typed
    assert out[2] is None and out[3][1]  # the duplicate, the gap
    assert snapshots and any(o[2] for o in out if o) and not malformed and not out[0][3]
    assert out[0][0] == len(contract.expand_events(contract.decode_envelope(values[0])["events"]))


def test_a_workers_typed_envelope_folds_as_the_generic_path_folds_it():
    values = [_envelope(0, source="worker"), _envelope(1, _items(NOW + 20), source="worker")]
    assert all(map(_typed, values))
    assert _outcome(values, True) == _outcome(values, False)


def test_a_packed_run_and_a_single_transition_fold_as_on_the_generic_path():
    """Version 3 may carry version 2's packed and plain transitions too."""
    value = _envelope(0)
    decoded = contract.decode_envelope(value)
    (capture,) = [ev for ev in decoded["events"] if ev["kind"] == contract.CAPTURE][:1]
    transitions = contract.unpack(capture)
    run = {"kind": contract.TRANSITION_RUN, "ts": capture["ts"],
           **{c: capture[c] for c in ("start", "finish", "stimulus_id", "names", "name",
                                      "time")},
           "key": [t["key"] for t in transitions],
           **{c: [t[c] for t in transitions] for c in contract.RUN_OPTIONAL_COLUMNS}}
    assert contract.unpack_run(run) == transitions
    values = [_replaced(value, events=[run]), _replaced(value, seq=1, events=transitions)]
    assert [envelopes.decode(v, b"c1", expand=False)["events"] for v in values] == \
        [[run], transitions]
    assert _outcome(values, True) == _outcome(values, False)


def _deep(depth: int):
    value = None
    for _ in range(depth):
        value = [value]
    return value


BASE = _envelope(0)
#: How many transitions BASE's first capture holds.
_N = len(next(ev for ev in _decode(BASE)["events"] if ev["kind"] == contract.CAPTURE)["key"])
#: Messages the typed decoder refuses: (name, message, what the generic path makes
#: of it: a dead letter's reason, or how many events it refuses).
IRREGULAR = [
    ("a column value of the wrong type", _replaced(BASE, events=_event(
        BASE, contract.CAPTURE, start=[{"a": 1}, *["released"] * (_N - 1)])), 1),
    ("a ts that is no number", _replaced(BASE, events=_event(BASE, contract.SPAN, ts="soon")), 1),
    ("a ts that is a bool", _replaced(BASE, events=_event(BASE, contract.LOG, ts=True)), 1),
    ("a span name that is no list", _replaced(BASE, events=_event(BASE, contract.SPAN,
                                                                   name="bench")), 1),
    ("a span without its parent", _replaced(BASE, events=lambda evs: [
        {k: v for k, v in ev.items() if k != "parent_id"} for ev in evs]), 0),
    ("thread counts that are no counts", _replaced(BASE, events=_event(
        BASE, contract.LIFECYCLE, total_nthreads=[["t", 1]])), 1),
    ("a bytes key", _replaced(BASE, events=_event(BASE, contract.CAPTURE, key=[b"k"] * _N)),
     0),
    ("an unknown field", _replaced(BASE, events=_event(BASE, contract.LOG, extra=[1, 2])), 0),
    ("an unknown envelope field", _replaced(BASE, later={"a": 1}), 0),
    ("an unknown kind", _replaced(BASE, events=lambda evs: [
        *evs, {"kind": "later", "ts": NOW, "what": {"a": [1]}}]), 0),
    ("a sent_at that is no number", _replaced(BASE, sent_at="now"), 0),
    ("a value deeper than the typed decoder reads",
     _replaced(BASE, events=_event(BASE, contract.EVENT, msg=_deep(envelopes.NESTED_LEVELS + 1))),
     0),
    ("an event too deep", _replaced(BASE, events=_event(BASE, contract.EVENT,
                                                        msg=_deep(MAX_DEPTH))),
     f"nested {MAX_DEPTH + 3} deep"),
    ("an unknown field too deep", _replaced(BASE, events=_event(BASE, contract.LOG,
                                                                extra=_deep(MAX_DEPTH))),
     f"nested {MAX_DEPTH + 3} deep"),
    ("far too deep", _encode({**_decode(BASE), "events": None})[:-1] + b"\x91" * 5000 + b"\xc0",
     "nested more than"),
    ("an unread text that is no UTF-8",
     BASE.replace(_encode("Compute Failed"), _encode("Compute Failed")[:1] + b"\xff" * 14),
     "not MessagePack"),
    ("a negative seq", _replaced(BASE, seq=-1), "seq must be a non-negative integer"),
    ("a seq that is a bool", _replaced(BASE, seq=True), 0),
    ("an unknown schema", _replaced(BASE, schema=4), "unknown schema version 4"),
    ("an unknown source", _replaced(BASE, source="robot"), "unknown source 'robot'"),
    ("an empty producer id", _replaced(BASE, producer_id=""), "producer_id must be"),
    ("a cluster name that is no text", _replaced(BASE, cluster_name=5), "cluster_name must be"),
    ("keyed by another cluster", _replaced(BASE, cluster_id="c2"), "is not the envelope's"),
    ("truncated", BASE[:-20], "not MessagePack"),
    ("an event that is no map", _replaced(BASE, events=lambda evs: [*evs, [1]]),
     "is not an object with 'kind' and 'ts'"),
]
@pytest.mark.parametrize("name, value, generic", IRREGULAR, ids=[i[0] for i in IRREGULAR])
def test_what_the_typed_decoder_refuses_the_generic_path_decides(name, value, generic):
    assert envelopes._typed_envelope(value, b"c1") is None
    typed, reference = _outcome([value], True), _outcome([value], False)
    assert typed == reference
    (out,), _, _, _, malformed = typed
    if isinstance(generic, str):
        assert out[0] == "dead letter" and generic in out[1], out
    else:
        assert out[0] != "dead letter", out
        assert malformed == len(out[3]) == generic, out[3]


@pytest.mark.parametrize("kind, changes", [
    (contract.WORKER_DIGESTS, {"digests": [["execute", "S"]]}),
    (contract.LIFECYCLE, {"total_nthreads": [[NOW, 1, 2]]}),
    (contract.SPAN, {"span_id": ""}),
], ids=["digests rows of another width", "thread counts of another width", "no span id"])
def test_what_the_typed_decoder_takes_and_the_state_refuses_is_refused_as_before(kind, changes):
    value = _replaced(BASE, events=_event(BASE, kind, **changes))
    assert envelopes._typed_envelope(value, b"c1") is not None
    typed = _outcome([value], True)
    assert typed == _outcome([value], False)
    assert typed[-1] == len(typed[0][0][3]) == 1


def test_a_shallow_unknown_field_is_read_as_the_generic_path_reads_it():
    value = _replaced(BASE, events=_event(BASE, contract.SPAN, later=1))
    assert envelopes._typed_envelope(value, b"c1") is None
    assert _outcome([value], True) == _outcome([value], False) == _outcome([BASE], False)


SAMPLES = [BASE, _envelope(1, _items(NOW + 20), source="worker")]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_mutated_message_gives_what_the_generic_path_gives(data):
    """Truncated, a bit flipped, bytes inserted: the typed path and the generic path
    dead-letter it for the same reason, or refuse the same events and fold the rest to
    the same state; neither raises."""
    value = mutated_bytes(data.draw, data.draw(st.sampled_from(SAMPLES)))
    assert _outcome([value], True) == _outcome([value], False)


@pytest.mark.parametrize("field, value", [("seq", 5), ("source", "worker"), ("events", []),
                                          ("events", [{"kind": "span", "ts": NOW, "kind ": 1}])])
def test_a_field_given_twice_is_read_as_the_generic_path_reads_it(field, value):
    """(MessagePack allows a key twice in a map: the last one holds.)"""
    assert BASE[0] == 0x88  # a fixmap of the 8 envelope fields
    twice = b"\x89" + BASE[1:] + _encode(field) + _encode(value)
    assert contract.decode_envelope(twice)[field] == value
    assert _outcome([twice], True) == _outcome([twice], False)


def test_an_event_kind_given_twice_takes_the_generic_path():
    event = b"\x83" + b"".join(map(_encode, ("kind", "span", "ts", NOW, "kind", "drops")))
    value = _encode({**_decode(BASE), "events": None})[:-1] + b"\x91" + event
    assert contract.decode_envelope(value)["events"] == [{"kind": "drops", "ts": NOW}]
    assert envelopes._typed_envelope(value, b"c1") is None
    assert _outcome([value], True) == _outcome([value], False)
