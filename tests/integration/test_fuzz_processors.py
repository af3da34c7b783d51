"""Fuzzing the processors' apply: mutated real messages never stop them.

The corpus is what real producers and the real stream processors published for a small
LocalCluster workload (tests/data/sink_corpus.json, recorded by tests/data/
record_sink_corpus.py). Hypothesis mutates those messages -- a value anywhere replaced
by any JSON value (deeply nested and beyond-64-bit ones included), a field dropped,
the bytes cut, flipped or padded -- and :class:`ProcessorFeed` drives each the way
:meth:`~dask_blackbox.stream_processors.processor.Processor.process` does, without
faust: ``envelopes.decode`` (or a dead letter), ``ClusterState.apply``, the dead
letters of refused events (``Processor._rejections``), the gap and partial records,
a checkpoint (``Journal.commit``) after every message, and every few messages a tick
(span snapshots, idle partials) and a recovery of the state from the changelog it
wrote. The derived records published on the derived topics are fed back as raw
messages too (a misrouted record must be a dead letter). For every message:

- nothing raises;
- the message is accounted for: applied (its refused events each a dead letter), a
  duplicate by ``seq``, or a dead letter whose reason says what is wrong;
- every record published (dead letters, gaps, partials, snapshots) satisfies its
  declaration in the contract and encodes as JSON;
- the state never holds a span cycle;
- the state recovered from its checkpoints is the state itself (same records, no
  problems).

Before a mutated message the corpus's ``seq`` is renumbered (one more than the
producer's last), so that mutated envelopes are applied rather than skipped as
duplicates. A few hundred examples per property in CI (``-m fuzz``); ``python
bench/fuzz.py --target processors`` is the long run (a million mutated messages).
"""

from __future__ import annotations

import json
import pathlib

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_blackbox import contract
from dask_blackbox.stream_processors import envelopes
from dask_blackbox.testing.processor_feed import ProcessorFeed, key_of, renumbered
from fuzz_support import as_version_1, dropped, json_values, mutated_bytes, nodes, replaced

pytestmark = pytest.mark.fuzz

CORPUS_FILE = pathlib.Path(__file__).resolve().parents[1] / "data" / "sink_corpus.json"
CORPUS: dict[str, list[bytes]] = {
    topic: [v.encode() for v in values]
    for topic, values in json.loads(CORPUS_FILE.read_text()).items()
}
#: The raw messages in publication order, and the derived records (fed as raw ones).
# (and those holding runs again, as a version-1 producer sent them: duplicates by seq
# for the processors, but mutated on their own)
RAW = CORPUS[contract.RAW] + as_version_1(CORPUS[contract.RAW])
DERIVED = [v for topic, values in CORPUS.items() if topic != contract.RAW for v in values]

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------ mutations

JSON_VALUES = json_values("transition", "span", "lifecycle", "worker_digests", "memory",
                          "processing", "scheduler_start", "scheduler_close", "compute")


@st.composite
def mutation(draw, value: bytes) -> bytes:
    """``value`` mutated once or a few times."""
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["replace", "replace", "replace", "swap", "drop",
                                    "deep", "bytes"]))
        try:
            decoded = orjson.loads(value)
        except orjson.JSONDecodeError:
            how = "bytes"
        if how != "bytes":
            paths = [p for p, _ in nodes(decoded)][1:]
            if not paths:
                continue
            path = draw(st.sampled_from(paths))
            if how == "drop":
                decoded = dropped(decoded, path)
            elif how == "deep":
                depth = draw(st.sampled_from([100, 255, 1_100, 5_000]))
                text = json.dumps(replaced(decoded, path, "\x00deep\x00")).encode()
                value = text.replace(b'"\\u0000deep\\u0000"', b"[" * depth + b"]" * depth)
                continue
            elif how == "swap":  # another node of the same message (ids, parents, keys)
                other = dict(nodes(decoded))[draw(st.sampled_from(paths))]
                decoded = replaced(decoded, path, other)
            else:
                decoded = replaced(decoded, path, draw(JSON_VALUES))
            # (json: orjson cannot write integers beyond 64 bits, which producers may)
            value = json.dumps(decoded, ensure_ascii=False, separators=(",", ":")).encode()
        else:
            value = mutated_bytes(draw, value)
    return value


# ----------------------------------------------------------------- properties


def test_the_corpus_applies_as_recorded():
    """The fuzzing starts from messages that apply: every raw envelope but the one
    garbage message the recording published on purpose, which is a dead letter; spans
    and partials come out; the derived records fed as raw messages are dead letters."""
    feed = ProcessorFeed(check_every=10)
    outcomes = [feed.add(key_of(v), v) for v in RAW]
    garbage = [i for i, v in enumerate(RAW) if b'"cluster_id"' not in v]
    assert outcomes.count("dead") == 1 and [outcomes[i] for i in garbage] == ["dead"]
    assert feed.counts["rejected_events"] == 0
    feed.expire()
    assert feed.counts["snapshots"] and feed.counts["partials"] and feed.counts["round_trips"]
    assert [feed.add(key_of(v), v) for v in DERIVED] == ["dead"] * len(DERIVED)


@FUZZ
@given(st.data())
def test_mutated_messages_are_applied_or_dead_lettered(data):
    """The corpus in order, some of its messages mutated (after a renumbering of their
    ``seq``), and a derived record or a mutated one now and then."""
    feed = ProcessorFeed(check_every=7)
    seqs: dict[str, int] = {}
    for value in RAW:
        key = key_of(value)
        if data.draw(st.integers(0, 3)) == 0:
            value = data.draw(mutation(renumbered(value, seqs)))
            if data.draw(st.integers(0, 9)) == 0:
                key = None
        elif b'"seq"' in value:
            value = renumbered(value, seqs)
        if data.draw(st.integers(0, 19)) == 0:
            derived = data.draw(st.sampled_from(DERIVED))
            feed.add(key_of(derived), data.draw(mutation(derived)))
        assert feed.add(key, value) in ("applied", "duplicate", "dead")
    feed.expire()


@FUZZ
@given(st.lists(st.sampled_from(RAW), min_size=1, max_size=6), st.data())
def test_a_mutated_message_on_a_cluster_state_anywhere(picks, data):
    """Mutated envelopes applied to a cluster state at a random point of the corpus
    (so transitions meet tasks, spans meet their parents), then the rest of the
    corpus still applies."""
    feed = ProcessorFeed(check_every=3)
    seqs: dict[str, int] = {}
    at = data.draw(st.integers(0, len(RAW)))
    for value in RAW[:at]:
        feed.add(key_of(value), renumbered(value, seqs))
    for value in picks:
        feed.add(key_of(value), data.draw(mutation(renumbered(value, seqs))))
    for value in RAW[at:]:
        feed.add(key_of(value), renumbered(value, seqs))
    feed.expire()


# ---------------------------------------------------- crashes the fuzzer found


def _envelope(events, seq=0, **fields) -> bytes:
    return orjson.dumps({"schema": 1, "cluster_id": "c1", "cluster_name": "one",
                         "source": "scheduler", "producer_id": "sched-1", "seq": seq,
                         "sent_at": 0.0, "events": events, **fields})


def test_too_deep_a_message_is_a_dead_letter_naming_the_limit():
    """Found by bench/fuzz.py: a ``seq`` nested 1,000 deep decoded, then the
    envelope check's ``repr`` of it raised RecursionError out of ``decode``. Nesting
    is bounded before decoding; brackets inside strings do not count."""
    limit = envelopes.MAX_DEPTH
    deep = b"[" * 1_000 + b"]" * 1_000
    feed = ProcessorFeed()
    for value in (_envelope([]).replace(b'"seq":0', b'"seq":' + deep),
                  _envelope([{"kind": "span", "ts": 1.0, "span_id": "S", "name": "x"}])
                  .replace(b'"x"', deep),
                  b"[" * limit + b"]" * limit + b" " + b"[" * 5_000):
        assert feed.add(b"c1", value) == "dead"
    assert feed.counts["dead_letters"] == 3
    fine = _envelope([{"kind": "span", "ts": 1.0, "span_id": "S", "name": ["x"],
                       "parent_id": None, "enqueued": 1.0, "note": "[" * 10 * limit}])
    assert feed.add(b"c1", fine) == "applied"
    just = _envelope([]).replace(b'"events":[]', b'"events":[],"x":'
                                 + b"[" * (limit - 1) + b"]" * (limit - 1))
    assert feed.add(b"c1", just.replace(b'"seq":0', b'"seq":1')) == "applied"
    too = _envelope([], seq=2).replace(b'"events":[]', b'"events":[],"x":'
                                        + b"[" * limit + b"]" * limit)
    letters = []
    feed._dead = letters.extend
    assert feed.add(b"c1", too) == "dead"
    assert letters[0]["reason"] == (f"nested {limit + 1} deep; the processors decode at "
                                    f"most {limit} levels of arrays and objects")


def test_a_new_task_group_without_a_prefix_is_refused():
    """Found by the fuzzing tier: a transition naming a new group but no prefix made a
    group without one, and its partials went out with ``prefix`` null (the contract
    says a string). The event is refused, naming the field; the rest applies, and
    a later transition of the group with its prefix is counted."""
    def tr(key, prefix, ts):
        return {"kind": "transition", "ts": ts, "key": key, "start": "released",
                "finish": "waiting", "group": "inc-1", "prefix": prefix, "span_id": None}
    feed = ProcessorFeed()
    letters = []
    dead = feed._dead
    feed._dead = lambda records: (letters.extend(records), dead(records))
    assert feed.add(b"c1", _envelope([tr("a", None, 1.0), tr("b", "inc", 2.0)])) == "applied"
    assert [r["reason"] for r in letters] == [
        "refused event 0 (transition): prefix: null for the first task of group "
        "'inc-1'; the rest of the envelope was applied"]
    state = feed.clusters["c1"]
    assert set(state.tree.registry) == {"b"}
    feed.expire()
    assert feed.counts["partials"] == 1
