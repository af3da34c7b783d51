"""Fuzzing the sink's conversion: mutated real messages never stop it.

The corpus is what real producers and the real stream processors published for a small
LocalCluster workload (tests/data/sink_corpus.json; tests/data/record_sink_corpus.py
records it again). Hypothesis mutates those messages -- a value anywhere replaced by
any JSON value (deeply nested ones included), a field dropped, the bytes cut, flipped
or padded -- and drives each through :class:`~dask_blackbox.sinks.batch.Batch`. For
every message:

- ``Batch.add`` raises nothing;
- the message is accounted for: it has rows (an ``envelopes`` row for a raw envelope,
  a row of its table for a derived record) or a dead letter, and every event of a
  loaded envelope has rows or a dead letter of its own;
- the typed path and the checked path give the same rows;
- the rows convert to Arrow for the real ClickHouse column types (what the loader
  inserts), so ClickHouse receives well-typed columns.

A few hundred examples per property in CI (``-m fuzz``); bench/fuzz.py is the long
run (a million mutated messages).
"""

from __future__ import annotations

import json
import pathlib

import clickhouse_connect
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_blackbox import contract
from dask_blackbox.sinks import arrow
from dask_blackbox.sinks.batch import MAX_MESSAGE_BYTES, Batch
from dask_blackbox.nesting import MAX_DEPTH
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import COLUMNS, Message
from fuzz_support import as_version_1, dropped, json_values, mutated_bytes, nodes, replaced

pytestmark = pytest.mark.fuzz

CORPUS_FILE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sink_corpus.json"
CORPUS: dict[str, list[bytes]] = {
    topic: [v.encode() for v in values]
    for topic, values in json.loads(CORPUS_FILE.read_text()).items()
}
# and the envelopes that hold runs as a version-1 producer sent them (TRANSITION events)
CORPUS[contract.RAW] += as_version_1(CORPUS[contract.RAW])
SEEDS = [(topic, value) for topic, values in CORPUS.items() for value in values]
#: The sink's clock for every example: the corpus's own time, so its events are
#: plausible (the checks compare event times with the sink's clock).
NOW = max(orjson.loads(v)["sent_at"] for v in CORPUS[contract.RAW]
          if v.startswith(b"{") and b'"sent_at"' in v) + 60.0

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_the_corpus_is_real_and_loads_as_recorded():
    """The fuzzing starts from messages that load: every kind of event producers send
    and every derived topic they feed, on the typed path, without dead letters (but
    the one garbage message the recording published on purpose)."""
    batch = convert([(t, v) for t, v in SEEDS])
    kinds = {e["kind"] for v in CORPUS[contract.RAW] if v.startswith(b'{"schema":')
             and not v.startswith(b'{"schema": ') for e in orjson.loads(v)["events"]}
    assert kinds >= {contract.TRANSITION_RUN, contract.TRANSITION, contract.GRAPH, contract.SPAN,
                     contract.EVENT,
                     contract.LIFECYCLE, contract.SCHEDULER_METRICS, contract.WORKER_METRICS,
                     contract.WORKER_DIGESTS, contract.LOG}
    assert all(CORPUS[t] for t in (contract.SPAN_STATE, contract.PREFIX_STATS, contract.DEAD_LETTER))
    assert batch.n_checked == 0  # (the garbage message is not JSON: a dead letter at once)
    assert [r[0] for r in zip(*batch.tables["dead_letters"].columns)] == ["sink", "processor"]
    assert len(batch.tables["lifecycle"].columns[-1].values) > 0  # total_nthreads entries
    assert any(batch.tables["span_state"].columns[COLUMNS["span_state"].index(
        "nthreads_intervals.nthreads")])


# ------------------------------------------------------------------ mutations

JSON_VALUES = json_values()


def deep_text(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    """A corpus message, mutated once or a few times."""
    topic, value = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["replace", "replace", "replace", "drop", "deep", "bytes"]))
        try:
            decoded = orjson.loads(value)
        except orjson.JSONDecodeError:
            how = "bytes"
        if how in ("replace", "drop", "deep"):
            paths = [p for p, _ in nodes(decoded)]
            path = draw(st.sampled_from(paths if how != "drop" else paths[1:] or [()]))
            if how == "drop" and path:
                decoded = dropped(decoded, path)
            elif how == "deep":
                marker = "\x00deep\x00"
                text = json.dumps(replaced(decoded, path, marker)).encode()
                depth = draw(st.sampled_from([MAX_DEPTH, MAX_DEPTH + 1, 300, 2_000, 100_000]))
                value = text.replace(json.dumps(marker).encode(), deep_text(depth))
                continue
            else:
                decoded = replaced(decoded, path, draw(JSON_VALUES))
            # (json: orjson cannot write integers beyond 64 bits, which producers may)
            value = json.dumps(decoded, ensure_ascii=False, separators=(",", ":")).encode()
        else:
            value = mutated_bytes(draw, value)
    return topic, value


# ----------------------------------------------------------------- properties


def convert(messages, typed: bool = True) -> Batch:
    batch = Batch()
    if not typed:
        batch._add_typed = lambda message, now: False  # the checked path only
    for offset, (topic, value) in enumerate(messages):
        batch.add(Message(topic, f"fuzz.{topic}", 0, offset, b"k", value, 1), NOW)
    return batch


def accounted(batch: Batch, topic: str, value: bytes) -> None:
    """Every message has rows or a dead letter; so has every event of an envelope
    that loaded (a worker_digests event with no digest rows has none to have)."""
    refs = {table: data.refs for table, data in batch.tables.items()}
    whole = [m for table, r in refs.items() for m, e in r if e is None]
    per_event: dict[int, int] = {}
    for r in refs.values():
        for _, e in r:
            if e is not None:
                per_event[e] = per_event.get(e, 0) + 1
    assert whole or per_event, "a message left no row and no dead letter"
    if topic == contract.RAW and refs["envelopes"]:
        events = contract.expand_events(orjson.loads(value)["events"])
        for i, event in enumerate(events):
            if i not in per_event:
                assert event.get("kind") == contract.WORKER_DIGESTS and not event.get("digests"), i


@pytest.fixture(scope="module")
def arrow_schemas(tmp_path_factory):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('fuzz-ch')}")
    migrate(client, Target("blackbox", 90 * 86400))
    yield arrow.schemas(client, "blackbox", COLUMNS)
    client.close()


@FUZZ
@given(mutated())
def test_mutated_messages_are_converted_or_dead_lettered(arrow_schemas, message):
    topic, value = message
    typed = convert([message])
    accounted(typed, topic, value)
    checked = convert([message], typed=False)
    for table in COLUMNS:
        assert list(zip(*typed.tables[table].columns)) == list(zip(*checked.tables[table].columns)), table
        if len(typed.tables[table]):
            arrow_schemas[table].table(typed.tables[table].columns)  # raises if ill-typed


@FUZZ
@given(st.lists(mutated(), min_size=2, max_size=6), st.sampled_from(SEEDS))
def test_a_good_message_after_bad_ones_still_loads(arrow_schemas, bad, good):
    """Mutated messages before a good one in the same batch change nothing of the
    good one's rows."""
    alone = convert([good])
    after = convert([*bad, good])
    last = len(bad)
    for table in COLUMNS:
        mine = [i for i, (m, _) in enumerate(after.tables[table].refs) if m.offset == last]
        rows = list(zip(*after.tables[table].columns))
        expected = list(zip(*alone.tables[table].columns))
        if "offset" in COLUMNS[table]:  # the good message's offset differs: not compared
            at = COLUMNS[table].index("offset")
            rows = [r[:at] + r[at + 1:] for r in rows]
            expected = [r[:at] + r[at + 1:] for r in expected]
        assert [rows[i] for i in mine] == expected, table


def test_limits_are_checked_before_decoding():
    """Oversized and too deeply nested messages are dead letters naming the limit,
    whatever topic they come on; the payload is the raw text, cut to the cap."""
    head = orjson.dumps({"schema": 1, "events": []})
    big = head[:-1] + b',"pad":"' + b"x" * MAX_MESSAGE_BYTES + b'"}'
    deep = head.replace(b"[]", deep_text(MAX_DEPTH))  # in an object: MAX_DEPTH + 1 deep
    fine = head.replace(b"[]", deep_text(MAX_DEPTH - 1))  # MAX_DEPTH deep
    for topic in contract.TOPICS:
        batch = convert([(topic, big), (topic, deep), (topic, fine)])
        reasons = [r[5] for r in zip(*batch.tables["dead_letters"].columns)]
        assert reasons[0] == (f"a message of {len(big)} bytes; the sink decodes at most "
                              f"{MAX_MESSAGE_BYTES}")
        assert reasons[1] == (f"nested {MAX_DEPTH + 1} deep; the sink decodes at most "
                              f"{MAX_DEPTH} levels of arrays and objects")
        assert "levels of arrays" not in reasons[2]  # depth MAX_DEPTH decodes
        payloads = [r[6] for r in zip(*batch.tables["dead_letters"].columns)]
        assert len(payloads[0]) == contract.DEAD_LETTER_PAYLOAD_MAX
    # Brackets inside strings do not count.
    texty = orjson.dumps({"kind": "x", "s": "[" * 10 * MAX_DEPTH})
    batch = convert([(contract.GAPS, texty)])
    assert "levels of arrays" not in [r[5] for r in zip(*batch.tables["dead_letters"].columns)][0]
