"""A stream processor fed by hand: raw messages applied, published and checkpointed
as :class:`~dask_blackbox.stream_processors.processor.Processor` does, without faust
or a broker, every output checked (tests/integration/test_fuzz_processors.py and
``python bench/fuzz.py --target processors`` drive it with mutated messages)."""

from __future__ import annotations

import types

import orjson

from dask_blackbox import contract
from dask_blackbox.contract import InvalidEnvelope
from dask_blackbox.stream_processors import envelopes
from dask_blackbox.stream_processors.checkpoint import Journal, parse_key
from dask_blackbox.stream_processors.cluster import ClusterState
from dask_blackbox.stream_processors.processor import Processor
from dask_blackbox.testing.processors import contract_violations

WINDOW = 60.0
MAX_KEYS = 10_000


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
            envelope = envelopes.decode(value, key, expand=False)  # as Processor reads it
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
        n_events = envelopes.count_events(envelope["events"])
        applied = state.apply(envelope)
        if applied is None:
            return "duplicate"
        gaps, closed, rejected = applied
        for r in rejected:
            assert isinstance(r.index, int) and 0 <= r.index < n_events, r
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
