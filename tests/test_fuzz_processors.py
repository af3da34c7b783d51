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
import types

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_blackbox import contract
from dask_blackbox.contract import InvalidEnvelope
from dask_blackbox.stream_processors import envelopes
from dask_blackbox.stream_processors.checkpoint import Journal, parse_key
from dask_blackbox.stream_processors.cluster import ClusterState
from dask_blackbox.stream_processors.processor import Processor
from fuzz_support import as_version_1, dropped, json_values, mutated_bytes, nodes, replaced
from processors_support import contract_violations

pytestmark = pytest.mark.fuzz

CORPUS_FILE = pathlib.Path(__file__).with_name("data") / "sink_corpus.json"
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

WINDOW = 60.0
MAX_KEYS = 10_000


# ------------------------------------------------------------------- the feed


class ProcessorFeed:
    """Raw messages applied, published and checkpointed as :class:`Processor` does
    (one message per batch, one partition), checking every output.

    ``add`` returns ``"applied"``, ``"duplicate"`` or ``"dead"``; whatever the code
    under test raises propagates (a crash). ``check_every``: every so many messages,
    a tick (snapshots, idle partials) and a checkpoint round trip of every cluster.
    """

    def __init__(self, check_every: int = 25):
        self.check_every = check_every
        self.clusters: dict[str, ClusterState] = {}
        self.journals: dict[str, Journal] = {}
        #: cluster id -> changelog (entry key -> latest value), as compaction keeps it
        self.changelogs: dict[str, dict[bytes, bytes]] = {}
        self.n_messages = 0
        self.counts = {"applied": 0, "duplicate": 0, "dead": 0, "dead_letters": 0,
                       "rejected_events": 0, "gaps": 0, "partials": 0, "snapshots": 0,
                       "round_trips": 0}

    # -------------------------------------------------------------- messages

    def add(self, key: bytes | None, value: bytes) -> str:
        self.n_messages += 1
        offset = self.n_messages
        msg = types.SimpleNamespace(topic=contract.RAW, partition=0, offset=offset,
                                    key=key, value=value)
        try:
            envelope = envelopes.decode(value, key)
        except InvalidEnvelope as e:
            self._dead([envelopes.dead_letter(msg.topic, 0, offset, key, value, str(e))])
            outcome = "dead"
        else:
            outcome = self._apply(msg, envelope)
        self.counts[outcome] += 1
        if self.n_messages % self.check_every == 0:
            self.tick()
            self.round_trip()
        return outcome

    def _apply(self, msg, envelope: dict) -> str:
        cid = envelope["cluster_id"]
        state = self.clusters.get(cid)
        if state is None:
            state = self.clusters[cid] = ClusterState(cid, WINDOW, MAX_KEYS)
            self.journals[cid] = Journal(cid)
            self.changelogs[cid] = {}
        state.partition = msg.partition
        applied = state.apply(envelope)
        if applied is None:
            return "duplicate"
        gaps, closed, rejected = applied
        for r in rejected:
            assert isinstance(r.index, int) and 0 <= r.index < len(envelope["events"]), r
            assert r.field and r.reason, r
        if rejected:
            letters = Processor._rejections(msg, rejected)
            assert len(letters) == min(len(rejected), 11)
            self._dead(letters)
            self.counts["rejected_events"] += len(rejected)
        self._publish(contract.GAPS, [g.record(cid) for g in gaps])
        self._publish(contract.PREFIX_STATS, state.partial_records(closed))
        self._checkpoint(state)
        assert_no_cycle(state)
        return "applied"

    def _dead(self, records: list[dict]) -> None:
        for r in records:
            assert isinstance(r["reason"], str) and r["reason"].strip(), r
        self._publish(contract.DEAD_LETTER, records)
        self.counts["dead_letters"] += len(records)

    def _publish(self, topic: str, records: list[dict]) -> None:
        """What ``Processor._publish`` sends: each record encoded by orjson, and
        declared so in the contract."""
        if not records:
            return
        for r in records:
            orjson.dumps(r)
        problems = contract_violations(topic, records)
        assert not problems, problems[:3]
        key = {contract.GAPS: "gaps", contract.PREFIX_STATS: "partials",
               contract.SPAN_STATE: "snapshots"}.get(topic)
        if key:
            self.counts[key] += len(records)

    def _checkpoint(self, state: ClusterState) -> None:
        journal = self.journals[state.cluster_id]
        log = self.changelogs[state.cluster_id]
        for key, value in journal.commit(state.take_changes(), state.records,
                                         state.partition):
            if value is None:
                log.pop(key, None)
            else:
                log[key] = value

    # -------------------------------------------------------------- periodic

    def tick(self, final: bool = False) -> None:
        """What ``Processor.tick`` publishes: changed spans' snapshots (``final``: of
        every open span, as for a cluster about to be forgotten) and idle partials."""
        for state in self.clusters.values():
            self._publish(contract.SPAN_STATE, state.snapshots(final=final))
            closed = state.close_idle(state.last_applied + 2 * WINDOW, WINDOW)
            if final:
                closed += state.windows.close_all()
            self._publish(contract.PREFIX_STATS, state.partial_records(closed))
            if closed:
                self._checkpoint(state)
            assert_no_cycle(state)

    def round_trip(self) -> None:
        """Every cluster rebuilt from its changelog is the same state."""
        for cid, state in self.clusters.items():
            entries = {parse_key(k)[1]: v for k, v in self.changelogs[cid].items()}
            rec = Journal.recover(cid, entries)
            recovered = ClusterState.from_records(cid, rec.records, WINDOW, MAX_KEYS)
            assert not recovered.problems, recovered.problems[:3]
            assert recovered.records() == state.records(), cid
            assert_no_cycle(recovered)
            self.counts["round_trips"] += 1

    def expire(self) -> None:
        """Forget every cluster as the TTLs do: last snapshots and partials published."""
        self.tick(final=True)
        self.round_trip()
        for cid in list(self.clusters):
            self.clusters.pop(cid)
            self.journals.pop(cid).drop()
            self.changelogs.pop(cid)


def assert_no_cycle(state: ClusterState) -> None:
    spans = state.tree.spans
    done: set[str] = set()
    for sid in spans:
        path: set[str] = set()
        cur = sid
        while cur is not None and cur not in done:
            assert cur not in path, f"span cycle through {cur!r}"
            path.add(cur)
            s = spans.get(cur)
            cur = s.parent_id if s is not None else None
        done |= path


def key_of(value: bytes) -> bytes | None:
    """The key producers give a raw message: its cluster_id (None if it has none)."""
    try:
        cid = orjson.loads(value).get("cluster_id")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return cid.encode() if isinstance(cid, str) else None


def renumbered(value: bytes, seqs: dict[str, int]) -> bytes:
    """``value`` with its ``seq`` one more than the producer's last (``seqs``)."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError:
        return value
    if not isinstance(obj, dict) or not isinstance(obj.get("producer_id"), str):
        return value
    seq = seqs[obj["producer_id"]] = seqs.get(obj["producer_id"], -1) + 1
    return orjson.dumps({**obj, "seq": seq})


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
