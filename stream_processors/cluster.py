"""Everything the processors know about one cluster, and how an envelope changes it.

:class:`ClusterState` applies envelopes in the order of their partition (one cluster
is always in one partition), skips duplicates, reports gaps, feeds scheduler
transitions, spans and worker digests into the :class:`~.span_state.SpanTree`, and
closes prefix partials (:mod:`.prefix_stats`). It is plain Python: the faust app
(:mod:`.app`) decides when to checkpoint, publish and forget it.

Its persistent form is a set of *records* (``records()``/``from_records``), and the
records changed since the last checkpoint (``take_changes()``): ``"m"`` (cluster
meta: producers' last seq, live groups, open partials, ...), ``"s:<span_id>"`` (one
span) and ``"k:<key>"`` (one live key; ``None`` once forgotten).

``applied`` counts the envelopes applied so far. A span snapshot's ``version`` is the
count at the last envelope that changed the span's tree: the state after ``n``
applied envelopes is always the same, so whenever and however often a span is
published (after a crash too), one version always comes with the same content.
"""

from __future__ import annotations

import logging
import math
import time

from dask_blackbox.contract import LIFECYCLE, SPAN, TRANSITION, WORKER_DIGESTS

from .prefix_stats import Partial, PartialKey, PrefixWindows, partial_record
from .sequencing import Gap, ProducerSequences
from .span_state import SpanTree

logger = logging.getLogger(__name__)


class ClusterState:
    def __init__(self, cluster_id: str, window: float, max_keys: int):
        self.cluster_id = cluster_id
        self.cluster_name: str | None = None
        #: raw-topic partition the cluster's envelopes arrive on (None: not known yet)
        self.partition: int | None = None
        self.applied = 0
        self.malformed_events = 0
        #: ``ts`` of the cluster's scheduler_close lifecycle event, once applied
        self.closed_at: float | None = None
        #: processor wall clock when that event was applied (not persisted: after a
        #: restart it counts as just seen), which the finished-cluster TTL counts from
        self.close_seen: float | None = None
        self.sequences = ProducerSequences()
        self.tree = SpanTree(max_keys)
        self.windows = PrefixWindows(window)
        #: producer_id -> processor wall clock of its last applied envelope (not
        #: persisted: after a restart every producer counts as just seen)
        self.last_seen: dict[str, float] = {}

    # ------------------------------------------------------------------ apply

    def apply(
        self, envelope: dict
    ) -> tuple[list[Gap], list[tuple[PartialKey, Partial]]] | None:
        """Apply one valid envelope; return the gaps it reveals and the partials it
        closes, or None for a duplicate (which changes nothing)."""
        producer_id = envelope["producer_id"]
        source = envelope["source"]
        seq = envelope["seq"]
        admitted, gap = self.sequences.admit(producer_id, source, seq)
        if not admitted:
            return None
        self.applied += 1
        self.cluster_name = envelope["cluster_name"] or self.cluster_name
        self.last_seen[producer_id] = time.time()

        tree = self.tree
        tree.clock = self.applied
        partial = self.windows.partial
        # Worker-side transitions describe the workers' own state machines, not the
        # scheduler's TaskStates that spans and prefixes count.
        transition = tree.transition if source == "scheduler" else None
        latest = -math.inf
        closing = None
        for ev in envelope["events"]:
            try:
                ts = ev["ts"]
                if not isinstance(ts, (int, float)):
                    raise TypeError(f"ts is a {type(ts).__name__}, not a number")
                kind = ev["kind"]
                if kind == TRANSITION:
                    if transition is not None:
                        transition(ev, partial, producer_id, seq)
                elif kind == SPAN:
                    tree.span(ev)
                elif kind == WORKER_DIGESTS:
                    tree.digests(ev["digests"])
                elif kind == LIFECYCLE and ev.get("action") == "scheduler_close":
                    closing = ts
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                self._malformed(ev, e)
                continue
            if ts > latest:
                latest = ts

        tree.end_envelope()
        closed = self.windows.advance(producer_id, latest) if latest > -math.inf else []
        if closing is not None:
            self.closed_at = closing
            self.close_seen = time.time()
            closed += self.windows.close_all()
        return [gap] if gap else [], closed

    def _malformed(self, ev, error: Exception) -> None:
        if not self.malformed_events:
            logger.warning(
                "cluster %s: skipping malformed event %.200r (%s: %s); further ones "
                "are only counted", self.cluster_id, ev, type(error).__name__, error,
            )
        self.malformed_events += 1

    def close_idle(self, now: float, idle: float) -> list[tuple[PartialKey, Partial]]:
        """Close the partials of producers silent for more than ``idle`` seconds."""
        closed = []
        for producer_id, seen in self.last_seen.items():
            if now - seen > idle:
                closed += self.windows.close_producer(producer_id)
        return closed

    # --------------------------------------------------------------- outputs

    def partial_records(self, closed: list[tuple[PartialKey, Partial]]) -> list[dict]:
        return [partial_record(self.cluster_id, self.cluster_name, k, p) for k, p in closed]

    def snapshots(self, everything: bool = False) -> list[dict]:
        """SPAN_STATE records of the spans changed since the last call (with their
        ancestors, which roll them up), or of every span."""
        tree = self.tree
        changed = set(tree.spans) if everything else tree.unpublished
        if not changed:
            return []
        ids = tree.with_ancestors(changed)
        tree.unpublished = set()
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
            "applied": self.applied,
            "malformed_events": self.malformed_events,
            "closed_at": self.closed_at,
            "producers": self.sequences.last,
            "windows": self.windows.to_list(),
            "tree": self.tree.meta(),
        }

    def take_changes(self) -> dict[str, object]:
        """Records changed since the last call (``None``: record deleted)."""
        tree = self.tree
        changes: dict[str, object] = {"m": self._meta()}
        for sid in tree.dirty_spans:
            changes["s:" + sid] = tree.spans[sid].to_list()
        registry = tree.registry
        for key, existed in tree.dirty_keys.items():
            entry = registry.get(key)
            if entry is not None or existed:
                changes["k:" + key] = entry
        tree.dirty_spans = set()
        tree.dirty_keys = {}
        return changes

    def records(self) -> dict[str, object]:
        """Every record of the current state."""
        out: dict[str, object] = {"m": self._meta()}
        for sid, s in self.tree.spans.items():
            out["s:" + sid] = s.to_list()
        for key, entry in self.tree.registry.items():
            out["k:" + key] = entry
        return out

    @classmethod
    def from_records(
        cls, cluster_id: str, records: dict[str, object], window: float, max_keys: int
    ) -> ClusterState:
        state = cls(cluster_id, window, max_keys)
        meta = records["m"]
        state.cluster_name = meta["name"]
        state.partition = meta["partition"]
        state.applied = meta["applied"]
        state.malformed_events = meta["malformed_events"]
        state.closed_at = meta["closed_at"]
        state.sequences = ProducerSequences(meta["producers"])
        state.windows.load(meta["windows"])
        spans, registry = {}, {}
        for rk, value in records.items():
            if rk.startswith("s:"):
                spans[rk[2:]] = value
            elif rk.startswith("k:"):
                registry[rk[2:]] = value
        state.tree.load(meta["tree"], spans, registry)
        now = time.time()
        state.last_seen = {pid: now for pid in state.sequences.last}
        state.close_seen = now if state.closed_at is not None else None
        return state
