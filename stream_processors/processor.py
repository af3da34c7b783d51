"""The engine of one processor (faust worker): the states of the clusters in its
partitions, and the order in which it applies, publishes and checkpoints.

For each batch of raw messages (all from partitions this worker owns):

1. every message is decoded; a bad one becomes a dead letter, a good one is applied
   to its cluster's :class:`~.cluster.ClusterState`;
2. the gap records and closed prefix partials the batch produced are published, and
   the worker **waits until the broker has acknowledged them**;
3. every cluster the batch touched is checkpointed to the changelog
   (:mod:`.checkpoint`), and the worker waits until the broker has acknowledged the
   checkpoints before faust acks the batch (and later commits its offsets).

Everything the worker writes to Kafka goes through its :class:`~.outbox.Outbox`
(record batches per topic partition, on a producer of its own).

A crash anywhere leaves a checkpoint no later than what was published: the raw
messages after it are read again, their envelopes are applied again (those the
checkpoint already covers are duplicates by ``seq`` and skipped), and re-publish
exactly the records published before the crash (same ``partial_id``), never fewer.

A message that is not a valid envelope becomes one dead letter; so does every event
of a valid envelope that its cluster refuses (:class:`~.cluster.Rejection`: the
reason names the event, its kind and the field), and the rest is applied.

Every ``snapshot-interval`` (:meth:`Processor.tick`), the spans that changed are
published as snapshots (a snapshot lost in a crash is published again after the
restart, which re-publishes every span). A tick looks only at the clusters changed
since the previous one; once per ``ProcessorSettings.sweep_interval`` it sweeps every
cluster, for the time-driven work, so what a tick costs follows what arrives, not how
many clusters are held. At a sweep the partials of producers silent for a whole
window are closed, producers silent for ``idle-cluster-ttl`` are
forgotten by their cluster, and clusters are forgotten (their checkpoint deleted):
those whose scheduler_close this worker applied more than ``finished-cluster-ttl``
ago, and those none of whose producers sent anything for ``idle-cluster-ttl`` (a
cluster killed without closing), each only once the consumer group has committed the
raw offset past the cluster's latest message (``ClusterState.last_offset``,
checkpointed, duplicates included): a message of a forgotten cluster that is read
again (after a rebalance discarded a commit, say) would start the cluster over, and
publish its partials a second time under new ids. Producers are forgotten under the
same condition. Before such a cluster is forgotten, its spans are
published as they stand (every span whose tree is not done gets a last snapshot, its
``done`` false) and its open partials are closed, and the worker waits for the
broker to acknowledge them.

What a processor holds is bounded (:mod:`.bounds`): past
``processors.max-live-clusters`` a new cluster is refused (one dead letter per
cluster, its envelopes counted), past ``max-live-keys-total`` new task keys are not
tracked (counted).

After a rebalance (:meth:`Processor.on_recovered`), the clusters of the partitions
this worker owns are rebuilt from the changelog (:func:`read_changelog`). A record
that cannot be read, or a span link that would close a cycle, is skipped with a dead
letter (topic: the changelog; key: the changelog entry) instead of crashing every
restart; a cluster whose meta record cannot be read is dropped with a dead letter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Iterable

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError

from dask_blackbox import kafka
from dask_blackbox.config import KafkaSettings
from dask_blackbox.kafka import KafkaUnreachable
from dask_blackbox.contract import (
    DEAD_LETTER, GAPS, PREFIX_STATS, SPAN_STATE, InvalidEnvelope,
)

from . import envelopes
from .bounds import ClusterAdmission, KeyBudget
from .checkpoint import Journal, entry_key, parse_key
from .outbox import Outbox
from .cluster import BadRecord, ClusterState
from .settings import ProcessorSettings

logger = logging.getLogger(__name__)

#: Dead letters published for the refused events of one message, at most; the rest
#: are summed up in one more.
MAX_REJECTIONS_PER_MESSAGE = 10


class Processor:
    """``app`` is the faust app, ``raw_topic`` the raw topic's name, ``table`` the
    changelog-backed table (raw bytes keys and values) checkpoints go to, and
    ``outputs`` the faust topics by contract name (SPAN_STATE, PREFIX_STATS, GAPS,
    DEAD_LETTER)."""

    def __init__(self, app, settings: ProcessorSettings, raw_topic: str, table,
                 outputs: dict):
        self.app = app
        self.settings = settings
        self.raw_topic = raw_topic
        self.table = table
        self.outputs = outputs
        #: topic names: the outputs' by contract name, and the table's changelog
        self.output_names = {name: t.get_topic_name() for name, t in outputs.items()}
        self.changelog = table.changelog_topic.get_topic_name()
        #: derived records and checkpoints go out in batches (:mod:`.outbox`)
        self.outbox = Outbox(settings.kafka)
        self.clusters: dict[str, ClusterState] = {}
        self.journals: dict[str, Journal] = {}
        #: one batch, tick or recovery at a time: each runs apply-publish-checkpoint
        #: as a unit, and awaits in between
        self.lock = asyncio.Lock()
        self.counters = {"envelopes": 0, "events": 0, "duplicates": 0, "dead_letters": 0,
                         "gaps": 0, "partials": 0, "snapshots": 0, "adopted": 0,
                         "not_owned": 0, "rejected_events": 0, "expired_idle": 0,
                         "forgotten_producers": 0, "forget_postponed": 0,
                         "refused_clusters": 0, "refused_envelopes": 0}
        #: the bounds of what this processor holds (:mod:`.bounds`)
        self.keys = KeyBudget(settings.max_live_keys_total)
        self.admission = ClusterAdmission(settings.max_live_clusters)
        #: clusters changed (applied to, rebuilt) since the last tick
        self._dirty: set[str] = set()
        #: when the next tick looks at every cluster (see ProcessorSettings.sweep_interval)
        self._next_sweep = 0.0
        #: (wall clock, process CPU seconds) when the first batch of envelopes began,
        #: and when the latest one was done (for throughput measurements)
        self.first_began: tuple[float, float] | None = None
        self.last_done: tuple[float, float] | None = None

    # ------------------------------------------------------------- messages

    def _owned_partitions(self) -> set[int]:
        return {tp.partition for tp in self.app.consumer.assignment()
                if tp.topic == self.raw_topic}

    async def _publish(self, topic: str, key: str | None, record: dict) -> None:
        """Add a derived record to the outbox (on the broker once it is flushed)."""
        await self.outbox.add(self.output_names[topic], None if key is None else key.encode(),
                              orjson.dumps(record))

    async def process(self, events: Iterable) -> None:
        """Apply, publish and checkpoint one batch of raw-topic faust events."""
        began = (time.time(), time.process_time())
        async with self.lock:
            owned = self._owned_partitions()
            touched: dict[str, ClusterState] = {}
            n_envelopes = n_events = 0
            for event in events:
                msg = event.message
                if msg.partition not in owned:
                    # buffered before a rebalance took the partition away
                    self.counters["not_owned"] += 1
                    continue
                try:
                    # runs stay packed: ClusterState.apply reads their columns
                    envelope = envelopes.decode(msg.value, msg.key, expand=False)
                except InvalidEnvelope as e:
                    record = envelopes.dead_letter(msg.topic, msg.partition, msg.offset,
                                                   msg.key, msg.value, str(e))
                    await self._publish(DEAD_LETTER, record["key"], record)
                    self.counters["dead_letters"] += 1
                    continue
                cluster_id = envelope["cluster_id"]
                if cluster_id not in self.clusters:
                    admitted, first = self.admission.admit(cluster_id, len(self.clusters))
                    if not admitted:
                        await self._refuse(msg, cluster_id, first)
                        continue
                state = self._state(cluster_id, msg.partition)
                state.last_offset = msg.offset
                touched[state.cluster_id] = state  # a duplicate moves last_offset too
                n_envelopes += 1
                n_events += envelopes.count_events(envelope["events"])
                applied = state.apply(envelope)
                if applied is None:
                    self.counters["duplicates"] += 1
                    continue
                gaps, closed, rejected = applied
                if rejected:
                    for record in self._rejections(msg, rejected):
                        await self._publish(DEAD_LETTER, record["key"], record)
                    self.counters["rejected_events"] += len(rejected)
                    self.counters["dead_letters"] += min(
                        len(rejected), MAX_REJECTIONS_PER_MESSAGE + 1)
                for gap in gaps:
                    await self._publish(GAPS, state.cluster_id, gap.record(state.cluster_id))
                for record in state.partial_records(closed):
                    await self._publish(PREFIX_STATS, state.cluster_id, record)
                self.counters["gaps"] += len(gaps)
                self.counters["partials"] += len(closed)
            # Gaps, partials and dead letters are on the broker before the checkpoints
            # that count them as published, and the checkpoints before faust acks
            # (and later commits) the batch's offsets.
            await self.outbox.flush()
            for state in touched.values():
                await self._checkpoint(state)
            await self.outbox.flush()
            self._dirty.update(touched)
            if n_envelopes:
                self.counters["envelopes"] += n_envelopes
                self.counters["events"] += n_events
                self.first_began = self.first_began or began
                self.last_done = (time.time(), time.process_time())

    @staticmethod
    def _rejections(msg, rejected) -> list[dict]:
        """Dead letters for the events of ``msg`` its cluster refused."""
        reasons = [r.describe() for r in rejected[:MAX_REJECTIONS_PER_MESSAGE]]
        if len(rejected) > MAX_REJECTIONS_PER_MESSAGE:
            reasons.append(f"and {len(rejected) - MAX_REJECTIONS_PER_MESSAGE} more "
                           "refused events")
        return [envelopes.dead_letter(msg.topic, msg.partition, msg.offset, msg.key,
                                      msg.value, f"refused {reason}; the rest of the "
                                      "envelope was applied")
                for reason in reasons]

    async def _refuse(self, msg, cluster_id: str, first: bool) -> None:
        """Count an envelope of a refused cluster; the cluster's first one becomes a
        dead letter (:mod:`.bounds`)."""
        self.counters["refused_envelopes"] += 1
        if first:
            reason = self.admission.reason(cluster_id)
            record = envelopes.dead_letter(msg.topic, msg.partition, msg.offset, msg.key,
                                           msg.value, reason)
            await self._publish(DEAD_LETTER, record["key"], record)
            self.counters["dead_letters"] += 1
            self.counters["refused_clusters"] += 1
            logger.warning("%s", reason)

    def _state(self, cluster_id: str, partition: int) -> ClusterState:
        state = self.clusters.get(cluster_id)
        if state is None:
            state = self.clusters[cluster_id] = ClusterState(
                cluster_id, self.settings.prefix_window, self.settings.max_live_keys, self.keys)
            self.journals[cluster_id] = Journal(cluster_id)
        state.partition = partition
        return state

    async def _checkpoint(self, state: ClusterState) -> None:
        journal = self.journals[state.cluster_id]
        messages = journal.commit(state.take_changes(), state.records, state.partition)
        await self._write(state.partition, messages)

    async def _write(self, partition: int, messages) -> None:
        """Changelog messages, to the changelog partition of the cluster's raw one
        (on the broker once the outbox is flushed)."""
        add = self.outbox.add
        for key, value in messages:
            await add(self.changelog, key, value, partition)

    # ------------------------------------------------------------- periodic

    async def tick(self) -> None:
        """Publish changed spans; at a sweep also close idle producers' partials and
        forget producers and clusters past their TTLs."""
        async with self.lock:
            now = time.time()
            if now < self._next_sweep:
                # Between sweeps: only the clusters that changed, only their spans.
                for cluster_id in self._dirty:
                    state = self.clusters.get(cluster_id)
                    for record in state.snapshots() if state is not None else ():
                        await self._publish(SPAN_STATE, cluster_id, record)
                        self.counters["snapshots"] += 1
                self._dirty = set()
                await self.outbox.flush()
                return
            self._next_sweep = now + self.settings.sweep_interval
            self._dirty = set()
            await self._sweep(now)

    async def _sweep(self, now: float) -> None:
        """Every cluster: its changed spans, its producers' idle partials, and the
        TTLs of producers and of the cluster."""
        settings = self.settings
        touched, expired = [], []
        candidates = list(self.clusters.values())
        due = {s.cluster_id: s.partition for s in candidates if self._forgets(s, now)}
        committed = await self._committed(set(due.values())) if due else {}
        for state in candidates:
            idle, finished = self._past_ttls(state, now)
            may_forget = committed.get(state.partition, -1) > state.last_offset
            if not may_forget and state.cluster_id in due:
                # Its latest message may be read again (by this worker after a
                # rebalance, or by the partition's next owner): the cluster, or
                # a producer, forgotten now would start over from it, with new
                # partial ids and a gap. The next tick asks again.
                self.counters["forget_postponed"] += 1
                idle = finished = False
            for record in state.snapshots(final=idle and not finished):
                await self._publish(SPAN_STATE, state.cluster_id, record)
                self.counters["snapshots"] += 1
            closed = state.close_idle(now, settings.prefix_window)
            more, gone = (state.forget_producers(now, settings.idle_cluster_ttl)
                          if may_forget else ([], []))
            closed += more
            if idle or finished:
                closed += state.windows.close_all()
                expired.append(state)
            if closed:
                for record in state.partial_records(closed):
                    await self._publish(PREFIX_STATS, state.cluster_id, record)
                self.counters["partials"] += len(closed)
            if closed or gone:
                touched.append(state)
            self.counters["forgotten_producers"] += len(gone)
        # Snapshots and partials are on the broker before a checkpoint counts
        # them as published, or a cluster is forgotten.
        await self.outbox.flush()
        for state in touched:
            if state not in expired:
                await self._checkpoint(state)
        for state in expired:
            await self._forget(state.cluster_id)
            if state.close_seen is not None:
                logger.info("forgot cluster %s, closed %.0fs ago", state.cluster_id,
                            now - state.close_seen)
            else:
                self.counters["expired_idle"] += 1
                logger.info("forgot cluster %s, silent for %.0fs without closing",
                            state.cluster_id, now - state.last_applied)
        await self.outbox.flush()

    def _past_ttls(self, state: ClusterState, now: float) -> tuple[bool, bool]:
        """(silent past idle-cluster-ttl, closed past finished-cluster-ttl)"""
        settings = self.settings
        return (now - state.last_applied > settings.idle_cluster_ttl,
                state.close_seen is not None
                and now - state.close_seen > settings.finished_cluster_ttl)

    def _forgets(self, state: ClusterState, now: float) -> bool:
        """Whether this tick would forget the cluster or one of its producers."""
        ttl = self.settings.idle_cluster_ttl
        return (any(self._past_ttls(state, now))
                or any(now - seen > ttl for seen in state.last_seen.values()))

    async def _committed(self, partitions: set[int]) -> dict[int, int]:
        """The raw partitions' committed offsets (the group's: faust's consumer
        group id is the app id); {} when the broker cannot say."""
        try:
            return await kafka.committed_offsets(
                self.settings.app_id, self.raw_topic, sorted(partitions),
                settings=self.settings.kafka)
        except (KafkaError, KafkaUnreachable, asyncio.TimeoutError) as e:
            logger.warning("no cluster is forgotten this time: the committed offsets "
                           "of %s are unknown: %s", self.raw_topic, e)
            return {}

    async def _forget(self, cluster_id: str) -> None:
        state = self.clusters.pop(cluster_id)
        state.tree.release()
        self._dirty.discard(cluster_id)
        await self._write(state.partition, self.journals.pop(cluster_id).drop())

    # ------------------------------------------------------------- rebalance

    async def on_recovered(self) -> None:
        """Table recovery after a rebalance is complete: rebuild the state of every
        cluster in the partitions this worker now owns from the changelog.

        Everything is reloaded, retained partitions too: faust may skip the recovery
        callback of an intermediate generation, so a retained partition may have been
        processed by another worker in between.
        """
        async with self.lock:
            # Our own last checkpoints must be on the log before we read it.
            await self.outbox.flush()
            owned = self._owned_partitions()
            # faust's copy of the changelog is not used (see read_changelog)
            self.table.data.clear()
            topic = self.table.changelog_topic.get_topic_name()
            entries = await read_changelog(topic, owned, self.settings.kafka)
            by_cluster: dict[str, dict[tuple, bytes]] = defaultdict(dict)
            for key, (_, value) in entries.items():
                cid, path = parse_key(key)
                by_cluster[cid][path] = value
            for state in self.clusters.values():
                state.tree.release()
            self.clusters.clear()
            self.journals.clear()
            for i, (cid, found) in enumerate(by_cluster.items()):
                if i % 500 == 499:
                    await asyncio.sleep(0)  # heartbeats, fetches: thousands of clusters take a while
                rec = Journal.recover(cid, found)
                if rec.journal is None:
                    continue  # an interrupted first checkpoint; the next one overwrites it
                await self._write(rec.partition, [(k, None) for k in rec.garbage])
                try:
                    state = ClusterState.from_records(
                        cid, rec.records, self.settings.prefix_window,
                        self.settings.max_live_keys, self.keys)
                except BadRecord as e:
                    origin = rec.origins.get(e.key, entry_key(cid, "M"))
                    await self._recovery_dead_letter(
                        topic, rec.partition, entries, origin, e.key, rec.records,
                        f"cluster {cid}: {e}; the cluster's state is dropped")
                    await self._write(rec.partition, rec.journal.drop())
                    continue
                for rk, why in state.problems:
                    await self._recovery_dead_letter(
                        topic, rec.partition, entries,
                        rec.origins.get(rk, entry_key(cid, "M")), rk, rec.records,
                        f"cluster {cid}: record {rk}: {why}")
                state.partition = rec.partition
                # Whatever was published before a crash is published again.
                state.tree.republish_all()
                self.clusters[cid] = state
                self.journals[cid] = rec.journal
                if state.problems:
                    # the repaired state replaces the bad records on the changelog
                    await self._write(rec.partition, rec.journal.commit(
                        {}, state.records, rec.partition, base=True))
            await self.outbox.flush()
            self._dirty = set(self.clusters)  # every span is published again
            self.counters["adopted"] += len(self.clusters)
            logger.info("raw partitions %s: %d clusters rebuilt from the changelog",
                        sorted(owned), len(self.clusters))
            await self._rewind_uncommitted()

    async def _recovery_dead_letter(self, topic: str, partition: int, entries: dict,
                              origin: bytes, record_key: str, records: dict | None,
                              reason: str):
        offset = entries.get(origin, (-1, None))[0]
        value = (records or {}).get(record_key, (None, None))[1]
        record = envelopes.dead_letter(
            topic, partition, offset, origin, orjson.dumps([record_key, value]), reason)
        self.counters["dead_letters"] += 1
        logger.warning("changelog %s: %s", topic, reason)
        return await self._publish(DEAD_LETTER, record["key"], record)

    async def _rewind_uncommitted(self) -> None:
        """Start raw partitions without a committed offset from their beginning.

        During recovery the consumer may already have fetched (and faust discarded)
        messages of a raw partition; faust then seeks back to the committed offset,
        but aiokafka seeks only to a committed offset above 0, so a partition whose
        previous owner died before its first commit would silently skip them.
        """
        consumer = self.app.consumer
        committed = await consumer.seek_to_committed()
        fresh = [tp for tp, offset in committed.items()
                 if tp.topic == self.raw_topic and not (offset and offset > 0)]
        if fresh:
            for tp, offset in (await consumer.earliest_offsets(*fresh)).items():
                # A rebalance may have taken the partition away meanwhile (Apache
                # Kafka does it while a dead member's session expires): its next
                # owner rewinds it, this worker must not crash on it.
                if tp not in consumer.assignment():
                    continue
                try:
                    await consumer.seek(tp, offset)
                except IllegalStateError:
                    logger.info("raw partition %s was revoked while rewinding it", tp)

    # ------------------------------------------------------------- monitoring

    def stats(self) -> dict:
        """Counters since this worker started, the number of clusters in memory, and
        ``[wall clock, process CPU seconds]`` when the first batch of envelopes began
        and when the latest one was done. ``envelopes`` and ``events`` include
        duplicates; ``adopted`` counts clusters rebuilt from the changelog after
        rebalances; ``not_owned`` raw messages skipped because a rebalance had given
        their partition to another worker; ``rejected_events`` events refused by their
        cluster (each a dead letter, at most :data:`MAX_REJECTIONS_PER_MESSAGE` + 1 per
        message); ``expired_idle`` clusters forgotten for silence (idle-cluster-ttl)
        and ``forgotten_producers`` producers forgotten so; ``forget_postponed`` how
        many times a cluster past its TTL was kept because its latest raw message was
        not committed yet; ``refused_clusters`` and ``refused_envelopes`` the clusters
        refused past ``max-live-clusters`` and their envelopes, ``live_keys`` the task
        keys held and ``refused_keys`` those refused past ``max-live-keys-total``
        (:mod:`.bounds`)."""
        return {**self.counters, "clusters": len(self.clusters), "live_keys": self.keys.used,
                "refused_keys": self.keys.refused,
                "first_began": self.first_began, "last_done": self.last_done}


async def read_changelog(
    topic: str, partitions: Iterable[int], kafka: KafkaSettings
) -> dict[bytes, tuple[int, bytes]]:
    """The latest ``(offset, value)`` of every key of these changelog partitions,
    read to the end.

    faust's own table recovery stops at the partition's end offset as the broker
    reports it, and Tansu reports it wrong for batched writes (the base offset of
    the last batch, plus one), so the last records of a checkpoint could be missed.
    This reads until the reported end *and* until the broker has nothing more.
    """
    tps = [TopicPartition(topic, p) for p in partitions]
    if not tps:
        return {}
    consumer = AIOKafkaConsumer(
        **kafka.client_kwargs(), group_id=None, enable_auto_commit=False,
        max_partition_fetch_bytes=16 * 1024 * 1024, fetch_max_wait_ms=100,
    )
    await consumer.start()
    out: dict[bytes, tuple[int, bytes]] = {}
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        idle = 0
        while idle < 2:
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for r in records:
                    if r.value is None:
                        out.pop(r.key, None)
                    else:
                        out[r.key] = (r.offset, r.value)
            if batch:
                idle = 0
            elif all([await consumer.position(tp) >= ends[tp] for tp in tps]):
                idle += 1
    finally:
        await consumer.stop()
    return out
