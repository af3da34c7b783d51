"""Everything the processors know about one cluster, and how an envelope changes it.

:class:`ClusterState` applies envelopes in the order of their partition (one cluster
is always in one partition), skips duplicates, reports gaps, feeds scheduler
transitions, spans, worker digests and the scheduler's thread-count history
(LIFECYCLE ``total_nthreads``) into the :class:`~.span_state.SpanTree`, and closes
prefix partials (:mod:`.prefix_stats`). An event the tree refuses (a field of the
wrong type, a startstop that overflows, a span cycle) changes nothing and is
returned as a :class:`Rejection`, which the processor publishes as a dead letter; the
rest of the envelope is applied. It is plain Python: the faust app (:mod:`.app`)
decides when to checkpoint, publish and forget it.

Its persistent form is a set of *records* (``records()``/``from_records``), and the
records changed since the last checkpoint (``take_changes()``). Record format 2 (the
checkpoint parts carry the format, :mod:`.checkpoint`):

- ``"m"``: cluster meta, a mapping: ``name``, ``partition``, ``offset`` (the
  raw-topic offset of the latest message of the cluster read, duplicates included;
  -1 in records written before it existed), ``applied``, ``malformed_events``, ``closed_at``, ``producers`` (producer id -> ``[source, last
  seq]``), ``windows`` (:meth:`.prefix_stats.PrefixWindows.to_list`) and ``tree``
  (:meth:`.span_state.SpanTree.meta`: group mappings, the thread-count history);
- ``"s:<span_id>"``: one span, a mapping (:meth:`.span_state.Span.to_record`);
- ``"k:<key>"``: one live key, ``[group uid, nbytes]`` (``None`` once forgotten).

Format 1 (records written before formats existed) held spans and groups as
positional lists and no thread-count history; it is read and converted. A record
that cannot be read is skipped and reported (``ClusterState.problems``), never
guessed at; a meta record that cannot be read makes the whole state unreadable
(:class:`BadRecord`).

``applied`` counts the envelopes applied so far. A span snapshot's ``version`` is the
count at the last envelope that changed the span's tree: the state after ``n``
applied envelopes is always the same, so whenever and however often a span is
published (after a crash too), one version always comes with the same content.
"""

from __future__ import annotations

import logging
import math
import time
from typing import NamedTuple

from dask_blackbox.contract import (
    CAPTURE, LIFECYCLE, SPAN, TRANSITION, TRANSITION_RUN, WORKER_DIGESTS, InvalidEvent,
    packed_columns,
)

from .checkpoint import check_format as _check_format
from .prefix_stats import Partial, PartialKey, PrefixWindows, partial_record
from .sequencing import Gap, ProducerSequences
from .span_state import Rejected, Span, SpanTree

logger = logging.getLogger(__name__)

class Rejection(NamedTuple):
    """Event ``index`` (of kind ``kind``) of an envelope was not applied."""

    index: int
    kind: str
    field: str
    reason: str

    def describe(self) -> str:
        return f"event {self.index} ({self.kind}): {self.field}: {self.reason}"


class Applied(NamedTuple):
    """What applying one envelope produced."""

    gaps: list[Gap]
    closed: list[tuple[PartialKey, Partial]]
    rejected: list[Rejection]


#: The event kinds :meth:`ClusterState.apply` reads more of than ``kind`` and ``ts``.
APPLIED_KINDS = frozenset({TRANSITION, TRANSITION_RUN, CAPTURE, SPAN, WORKER_DIGESTS,
                           LIFECYCLE})

#: What applying a malformed event raises: each refuses the event (:func:`_refusal`).
_REFUSED = (InvalidEvent, KeyError, TypeError, ValueError, AttributeError, ArithmeticError)
#: The columns of a run or capture (``contract.packed_columns``) its transitions are
#: applied from.
_RUN_READ = ("ts", "key", "start", "finish", "group", "prefix", "span_id", "startstops",
             "nbytes")


def _refusal(index: int, kind, e: Exception) -> Rejection:
    """Why event ``index`` of kind ``kind`` was refused: the error applying it raised
    (one of :data:`_REFUSED`)."""
    if isinstance(e, InvalidEvent):  # a run's, or the tree's Rejected
        return Rejection(index, str(kind), e.field, e.reason)
    if isinstance(e, KeyError):
        return Rejection(index, str(kind), str(e.args[0]), "missing")
    return Rejection(index, str(kind), "?", f"{type(e).__name__}: {e}")


def _check_ts(ts) -> None:
    """Rejected unless ``ts`` is a number."""
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise Rejected("ts", f"{ts!r:.80} is a {type(ts).__name__}, not a number")


class BadRecord(ValueError):
    """A checkpoint record cannot be read; ``key`` is the record's key."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"record {key}: {reason}")
        self.key = key
        self.reason = reason


class ClusterState:
    def __init__(self, cluster_id: str, window: float, max_keys: int, budget=None):
        self.cluster_id = cluster_id
        self.cluster_name: str | None = None
        #: raw-topic partition the cluster's envelopes arrive on (None: not known yet)
        self.partition: int | None = None
        #: raw-topic offset of the latest message of the cluster read, applied or a
        #: duplicate (set by the processor): the cluster may be forgotten only once
        #: its consumer group has committed past it, or reading it again would
        #: start the cluster over
        self.last_offset = -1
        self.applied = 0
        self.malformed_events = 0
        #: ``ts`` of the cluster's scheduler_close lifecycle event, once applied
        self.closed_at: float | None = None
        #: processor wall clock when that event was applied (not persisted: after a
        #: restart it counts as just seen), which the finished-cluster TTL counts from
        self.close_seen: float | None = None
        self.sequences = ProducerSequences()
        #: ``budget``: the processor's :class:`~.bounds.KeyBudget`, shared by its clusters
        self.tree = SpanTree(max_keys, budget)
        self.windows = PrefixWindows(window)
        #: producer_id -> processor wall clock of its last applied envelope (not
        #: persisted: after a restart every producer counts as just seen)
        self.last_seen: dict[str, float] = {}
        #: processor wall clock of the last applied envelope (not persisted either),
        #: which the idle-cluster TTL counts from
        self.last_applied = time.time()
        #: (record key, reason) of records :meth:`from_records` skipped or repaired
        self.problems: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ apply

    def apply(self, envelope: dict) -> Applied | None:
        """Apply one valid envelope; return the gaps it reveals, the partials it
        closes and the events it refused, or None for a duplicate (which changes
        nothing).

        Its packed events may be expanded (``contract.expand_events``) or not: a
        :data:`~dask_blackbox.contract.TRANSITION_RUN` or
        :data:`~dask_blackbox.contract.CAPTURE` is applied as the events it stands
        for, each with its index in the expanded list, straight from its columns; one
        that cannot be unpacked is refused as one event."""
        producer_id = envelope["producer_id"]
        source = envelope["source"]
        seq = envelope["seq"]
        admitted, gap = self.sequences.admit(producer_id, source, seq)
        if not admitted:
            return None
        self.applied += 1
        name = envelope["cluster_name"]
        if isinstance(name, str) and name:
            self.cluster_name = name
        self.last_applied = now = time.time()
        self.last_seen[producer_id] = now

        tree = self.tree
        tree.clock = self.applied
        partial = self.windows.partial
        # Worker-side transitions describe the workers' own state machines, not the
        # scheduler's TaskStates that spans and prefixes count.
        transition = tree.transition_fields if source == "scheduler" else None
        latest = -math.inf
        closing = None
        rejected: list[Rejection] = []
        n = 0  # the index in the expanded list of the next event
        for ev in envelope["events"]:
            kind = ev["kind"]
            i = n
            n += 1
            if kind == TRANSITION_RUN or kind == CAPTURE:
                try:
                    columns = packed_columns(ev)
                except _REFUSED as e:
                    rejected.append(_refusal(i, kind, e))
                    continue
                n += len(columns["key"]) - 1  # run_shape checked: every column has one
                for i, (ts, key, start, finish, group, prefix, span_id, startstops,
                        nbytes) in enumerate(zip(*map(columns.__getitem__, _RUN_READ)), i):
                    try:
                        if type(ts) is not float:
                            _check_ts(ts)
                        if transition is not None:
                            transition(key, start, finish, group, prefix, span_id,
                                       startstops, nbytes, ts, partial, producer_id, seq)
                    except _REFUSED as e:
                        rejected.append(_refusal(i, TRANSITION, e))
                        continue
                    if ts > latest:
                        latest = ts
                continue
            try:
                ts = ev["ts"]
                if type(ts) is not float:
                    _check_ts(ts)
                if kind == TRANSITION:
                    if transition is not None:
                        transition(ev["key"], ev["start"], ev["finish"], ev.get("group"),
                                   ev.get("prefix"), ev.get("span_id"), ev.get("startstops"),
                                   ev.get("nbytes"), ts, partial, producer_id, seq)
                elif kind == SPAN:
                    tree.span(ev)
                elif kind == WORKER_DIGESTS:
                    tree.digests(ev["digests"])
                elif kind == LIFECYCLE:
                    action = ev.get("action")
                    if ev.get("total_nthreads") is not None:
                        tree.nthreads(ev["total_nthreads"], action == "scheduler_start")
                    if action == "scheduler_close":
                        closing = ts
            except _REFUSED as e:
                rejected.append(_refusal(i, kind, e))
                continue
            if ts > latest:
                latest = ts
        if rejected:
            self.malformed_events += len(rejected)

        tree.end_envelope()
        closed = self.windows.advance(producer_id, latest) if latest > -math.inf else []
        if closing is not None:
            self.closed_at = closing
            self.close_seen = time.time()
            closed += self.windows.close_all()
        return Applied([gap] if gap else [], closed, rejected)

    def close_idle(self, now: float, idle: float) -> list[tuple[PartialKey, Partial]]:
        """Close the partials of producers silent for more than ``idle`` seconds."""
        closed = []
        for producer_id, seen in self.last_seen.items():
            if now - seen > idle:
                closed += self.windows.close_producer(producer_id)
        return closed

    def forget_producers(self, now: float, ttl: float) -> tuple[list, list[str]]:
        """Forget producers silent for more than ``ttl`` seconds: their partials are
        closed (returned) and their entries dropped from every per-producer map
        (also their last ``seq``: one that comes back is a new producer, and its
        envelopes before the one that comes back count as a gap). Returns the closed
        partials and the producers forgotten."""
        gone = [p for p, seen in self.last_seen.items() if now - seen > ttl]
        closed = []
        for producer_id in gone:
            closed += self.windows.close_producer(producer_id)
            self.windows.forget(producer_id)
            self.sequences.forget(producer_id)
            del self.last_seen[producer_id]
        return closed, gone

    # --------------------------------------------------------------- outputs

    def partial_records(self, closed: list[tuple[PartialKey, Partial]]) -> list[dict]:
        return [partial_record(self.cluster_id, self.cluster_name, k, p) for k, p in closed]

    def snapshots(self, final: bool = False) -> list[dict]:
        """SPAN_STATE records of the spans changed since the last call (with their
        ancestors, which roll them up); ``final``: also of every span whose tree is
        not done (the cluster is being forgotten, they are published as they stand).
        Spans whose SPAN event has not been applied yet are not published."""
        tree = self.tree
        ids = tree.take_unpublished()
        if final:
            ids |= tree.open_spans()
        # A span is published once its SPAN event is known (a worker's digests or a
        # child may name it first): a snapshot always has a name and enqueued.
        spans = tree.spans
        ids = [sid for sid in ids if spans[sid].name is not None
               and spans[sid].enqueued is not None]
        if not ids:
            return []
        now = time.time()
        out = []
        for sid, (agg, metrics, changed_at) in tree.rollup(ids).items():
            rec = tree.snapshot(sid, agg, metrics, changed_at)
            rec.update(cluster_id=self.cluster_id, cluster_name=self.cluster_name,
                       updated_at=now)
            out.append(rec)
        return out

    # ----------------------------------------------------------- persistence

    def _meta(self) -> dict:
        return {
            "name": self.cluster_name,
            "partition": self.partition,
            "offset": self.last_offset,
            "applied": self.applied,
            "malformed_events": self.malformed_events,
            "closed_at": self.closed_at,
            "producers": self.sequences.last,
            "windows": self.windows.to_list(),
            "tree": self.tree.meta(),
        }

    def take_changes(self) -> dict[str, object]:
        """Records changed since the last call (``None``: record deleted)."""
        changes: dict[str, object] = {"m": self._meta()}
        spans, keys = self.tree.take_changed()
        for sid, s in spans.items():
            changes["s:" + sid] = s.to_record()
        for key, entry in keys.items():
            changes["k:" + key] = entry
        return changes

    def records(self) -> dict[str, object]:
        """Every record of the current state."""
        out: dict[str, object] = {"m": self._meta()}
        for sid, s in self.tree.spans.items():
            out["s:" + sid] = s.to_record()
        for key, entry in self.tree.registry.items():
            out["k:" + key] = entry
        return out

    @classmethod
    def from_records(
        cls, cluster_id: str, records: dict[str, tuple[int, object]], window: float,
        max_keys: int, budget=None,
    ) -> ClusterState:
        """The state the records (record key -> ``(format, value)``) describe.

        Span and key records that cannot be read are skipped, and span links that
        would make a cycle are cut; each is listed in ``problems``. A meta record
        that cannot be read raises :class:`BadRecord`."""
        state = cls(cluster_id, window, max_keys, budget)
        if "m" not in records:
            raise BadRecord("m", "the cluster meta record is missing")
        fmt, meta = records["m"]
        try:
            _check_format(fmt)
            state.cluster_name = meta["name"]
            state.partition = meta["partition"]
            state.last_offset = meta.get("offset", -1)
            if type(state.last_offset) is not int:
                raise ValueError(f"offset {state.last_offset!r:.40} is not an int")
            state.applied = meta["applied"]
            state.malformed_events = meta["malformed_events"]
            state.closed_at = meta["closed_at"]
            state.sequences = ProducerSequences(meta["producers"])
            state.windows.load(meta["windows"])
            tree_meta = meta["tree"]
        except (KeyError, TypeError, ValueError) as e:
            raise BadRecord("m", f"format {fmt}: {type(e).__name__}: {e}") from None
        spans: dict[str, Span] = {}
        registry: dict[str, list] = {}
        for rk, (fmt, value) in records.items():
            try:
                if rk.startswith("s:"):
                    _check_format(fmt)
                    read = Span.from_v1 if fmt == 1 else Span.from_record
                    spans[rk[2:]] = read(rk[2:], value)
                elif rk.startswith("k:"):
                    if (not isinstance(value, list) or len(value) != 2
                            or type(value[0]) is not int or type(value[1]) is not int):
                        raise ValueError(f"{value!r:.80} is not [group uid, nbytes]")
                    registry[rk[2:]] = value
            except (KeyError, TypeError, ValueError) as e:
                state.problems.append((rk, f"format {fmt}: skipped, {type(e).__name__}: {e}"))
        try:
            cut = state.tree.load(tree_meta, spans, registry, fmt=records["m"][0])
        except (KeyError, TypeError, ValueError) as e:
            raise BadRecord("m", f"tree: {type(e).__name__}: {e}") from None
        state.problems += [("s:" + sid, why) for sid, why in cut]
        now = time.time()
        state.last_seen = {pid: now for pid in state.sequences.last}
        state.close_seen = now if state.closed_at is not None else None
        return state

