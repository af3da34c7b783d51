"""The sink's Kafka side: a consumer group over the raw and derived topics that hands
batches to the :class:`~sinks.loader.Loader` and commits offsets only after ClickHouse
has the rows.

It loads every contract topic (``contract.TOPICS``). A batch closes at
``SinkSettings.batch_max_rows`` rows or ``batch_max_wait`` seconds after its first
message, whichever comes first -- or sooner, ``batch_min_wait`` after its first
message, when the sink has caught up (its last fetch brought fewer records than it
asked for) and no batch is being loaded (a batch that waits for a load looks again
every ``batch_min_wait``): under a trickle a row is queryable soon, under load the
batch grows while the one before it loads. It is then loaded in a
thread and committed
while the next batch is read and converted (chDB releases the GIL while it inserts,
so the two overlap on two cores); a batch starts loading only once the previous one
is committed. The rebalance callbacks wait for the batch in flight, so a partition is
never revoked half way through a batch; messages read but not yet handed to loading
when partitions are revoked are dropped (they were not committed, so their new owner
reads them again), and so are records a fetch brought across the rebalance: every
assigned partition is then sought back to where its next batch starts, so none of
them is skipped. A commit the group refuses (this sink stalled past its session
timeout and its partitions went to another member, which reads them again from the
group's offsets) leaves a loaded batch: on a store of its own the sink deletes it at
once; on a shared store its journal entry makes the next owner skip it.

Starting (:meth:`SinkConsumer._prepare`, on every assignment): the committed offsets of
the assigned partitions are read at once, then :meth:`Loader.recover` repairs what a
crash left. A journal entry it returns (a batch loaded from the committed offset,
maybe never committed) is checked against the message at that offset, unless the
committed offset proves the check moot: a partition the group never committed on
this broker cannot hold a batch this broker's group loaded (every load starts from a
committed offset, the beginning being committed first), so its entry comes from
another broker incarnation and the partition is read from its beginning. The other
checks run side by side on one reader, bounded by :data:`CHECK_TIMEOUT` in all: the
message at the offset is found (its fingerprint decides) or is known to be absent
(the broker answered that partition's fetch with nothing there; not the same message)
at once, whatever the broker. :attr:`SinkConsumer.loading` is set once the first
assignment is prepared: from then on the sink loads.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from dask_blackbox import clickhouse, contract
from dask_blackbox.sinks.loader import Loaded, Loader
from dask_blackbox.sinks.settings import SinkSettings
from dask_blackbox.sinks.batch import Batch, fingerprint
from dask_blackbox.sinks.tables import Message

logger = logging.getLogger("sinks.consumer")

#: Longest time the journal checks of one assignment take together, in seconds; a
#: check not done by then counts as "not the same message" (read again).
CHECK_TIMEOUT = 10.0
#: Records asked of one fetch: converting them blocks the event loop. A fetch that
#: brings fewer means the sink has caught up.
FETCH_RECORDS = 100


class SinkConsumer(ConsumerRebalanceListener):
    """Consumes every blackbox topic in group ``settings.group_id`` into ``loader``."""

    def __init__(self, loader: Loader, settings: SinkSettings) -> None:
        self.loader = loader
        self.settings = settings
        self.max_rows = settings.batch_max_rows
        self.max_wait = settings.batch_max_wait
        self.min_wait = min(settings.batch_min_wait, settings.batch_max_wait)
        self.topics = {settings.kafka.topic(t): t for t in contract.TOPICS}
        session_ms = int(settings.session_timeout * 1000)
        self.consumer = AIOKafkaConsumer(
            **settings.kafka.client_kwargs(),
            group_id=settings.group_id,
            session_timeout_ms=session_ms,
            heartbeat_interval_ms=max(100, session_ms // 3),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # A batch is held until ClickHouse takes it; keep the group membership
            # meanwhile (heartbeats run on their own).
            max_poll_interval_ms=3_600_000,
            # Envelopes are up to ~1 MB: fetch several per partition per round trip
            # (Kafka's default of 1 MB per partition means one), at most 64 MB at once.
            max_partition_fetch_bytes=8 * 2**20,
            fetch_max_bytes=64 * 2**20,
        )
        self.committed: dict[tuple[str, int], int] = {}
        self.batches_loaded = 0
        self._lock = asyncio.Lock()
        self._generation = 0
        self._stop = asyncio.Event()
        self._inflight: asyncio.Task | None = None
        # Where the next batch of each partition starts: the committed offset, or the
        # end of the batch in flight.
        self._next_start: dict[tuple[str, int], int] = {}
        # The next offset wanted per partition. A fetch issued before a seek may still
        # deliver records from the old position; those are skipped.
        self._position: dict[tuple[str, int], int] = {}
        #: set once the first assignment is prepared (recovered): the sink loads
        self.loading = asyncio.Event()

    # ----------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.consumer.subscribe(list(self.topics), listener=self)
        await self.consumer.start()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the batch being loaded, if any; a batch
        waiting for ClickHouse is given up, uncommitted."""
        self._stop.set()
        self.loader.stopping.set()

    async def close(self) -> None:
        await self.consumer.stop()

    # ---------------------------------------------------------- rebalancing

    async def on_partitions_revoked(self, revoked) -> None:
        async with self._lock:
            await self._finish_inflight()
            self._generation += 1
            for tp in revoked:
                self.committed.pop((tp.topic, tp.partition), None)
            self._next_start = dict(self.committed)

    async def on_partitions_assigned(self, assigned) -> None:
        async with self._lock:
            self._generation += 1
            tps = sorted(assigned)
            if tps:
                await self._prepare(tps)
            self.loading.set()

    async def _prepare(self, tps: list[TopicPartition]) -> None:
        """Know each partition's committed offset (committing the beginning for a
        partition the group never committed, so every batch starts at a committed
        offset), then repair what a crash left (see Loader.recover and the module
        docstring)."""
        offsets = await asyncio.gather(*(self.consumer.committed(tp) for tp in tps))
        committed = dict(zip(tps, offsets))
        fresh = [tp for tp, offset in committed.items() if offset is None]
        if fresh:
            beginnings = await self.consumer.beginning_offsets(fresh)
            await self.consumer.commit(beginnings)
            committed.update(beginnings)
        positions = {(tp.topic, tp.partition): offset for tp, offset in committed.items()}
        elsewhere = None
        if self.loader.exclusive:  # this store's partitions another sink consumes now
            others = [TopicPartition(t, p) for t, p in
                      await self._retrying(self.loader.journaled) if (t, p) not in positions]
            offsets = await asyncio.gather(*(self.consumer.committed(tp) for tp in others))
            elsewhere = {(tp.topic, tp.partition): offset
                         for tp, offset in zip(others, offsets) if offset is not None}
        loaded = await self._retrying(self.loader.recover, list(positions), positions, elsewhere)
        moot = {(tp.topic, tp.partition) for tp in fresh} & set(loaded)
        for topic, partition in sorted(moot):
            logger.info(
                "%s[%d]: the journal's last loaded batch starts at offset %d, but the group "
                "never committed this partition on this broker (another broker incarnation): "
                "reading it from its beginning", topic, partition, loaded[(topic, partition)].from_offset)
        to_check = {TopicPartition(*key): entry for key, entry in loaded.items() if key not in moot}
        same = await self._same_messages(to_check) if to_check else {}
        for tp, entry in sorted(to_check.items()):
            topic, partition = tp.topic, tp.partition
            if same[tp]:
                logger.warning(
                    "%s[%d] offsets %d..%d were loaded but not committed before a crash; "
                    "committing them without loading again", topic, partition,
                    entry.from_offset, entry.next_offset - 1,
                )
                await self.consumer.commit({tp: entry.next_offset})
                positions[(topic, partition)] = entry.next_offset
                self.consumer.seek(tp, entry.next_offset)
            else:
                logger.warning(
                    "%s[%d]: the journal's last loaded batch starts at the committed offset "
                    "%d, but the message there is not the one it loaded (another broker "
                    "incarnation?); reading from the committed offset", topic, partition,
                    entry.from_offset,
                )
        self.committed.update(positions)
        self._next_start = dict(self.committed)
        self._position = dict(self.committed)

    async def _same_messages(self, entries: dict[TopicPartition, Loaded]) -> dict[TopicPartition, bool]:
        """Per partition, whether the first message at or after ``entry.from_offset``
        is the one the journal fingerprinted (and not another broker incarnation's).
        All partitions at once, on one group-less consumer (outside this consumer's
        rebalance), within :data:`CHECK_TIMEOUT`: a partition whose fetch the broker
        answered twice with nothing at that offset has no such message."""
        reader = AIOKafkaConsumer(**self.settings.kafka.client_kwargs(), group_id=None,
                                  enable_auto_commit=False, fetch_max_wait_ms=200)
        await reader.start()
        found: dict[TopicPartition, bool] = {}
        empty_rounds = dict.fromkeys(entries, 0)
        try:
            reader.assign(list(entries))
            for tp, entry in entries.items():
                reader.seek(tp, entry.from_offset)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CHECK_TIMEOUT
            while len(found) < len(entries) and loop.time() < deadline:
                pending = [tp for tp in entries if tp not in found]
                fetched = await reader.getmany(*pending, timeout_ms=300, max_records=1)
                for tp in pending:
                    records = fetched.get(tp)
                    if records:
                        message = fingerprint(self._message(records[0]))
                        found[tp] = message == (entries[tp].first_timestamp, entries[tp].first_crc)
                        reader.pause(tp)
                    elif reader.highwater(tp) is not None:
                        empty_rounds[tp] += 1
                        if empty_rounds[tp] >= 2:
                            found[tp] = False
                            reader.pause(tp)
        finally:
            await reader.stop()
        return {tp: found.get(tp, False) for tp in entries}

    async def _retrying(self, fn, *args):
        """Run blocking ``fn`` in a thread until it succeeds (ClickHouse may be down)."""
        backoff = 0.1
        while True:
            try:
                return await asyncio.to_thread(fn, *args)
            except clickhouse.UNAVAILABLE as e:
                logger.warning("ClickHouse: %s; retrying in %.1fs", str(e).splitlines()[0][:300], backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.retry_backoff_max)

    # ----------------------------------------------------------------- loop

    def _message(self, record) -> Message:
        return Message(
            self.topics[record.topic], record.topic, record.partition, record.offset,
            record.key, record.value if record.value is not None else b"", record.timestamp,
        )

    def _batch(self) -> Batch:
        return Batch(self.loader.schemas)

    async def run(self) -> None:
        """Consume and load until :meth:`stop`."""
        loop = asyncio.get_running_loop()
        batch, generation, deadline, first = self._batch(), self._generation, None, 0.0
        try:
            while not self._stop.is_set():
                timeout = 1.0 if deadline is None else max(0.0, deadline - loop.time())
                if deadline is not None and self._loading():
                    # A batch waits for the load in flight: look again every
                    # batch-min-wait, so that it can close as soon as that load ends
                    # rather than when the next record arrives.
                    timeout = min(timeout, self.min_wait)
                # Few messages per call: converting them blocks the event loop.
                fetched = await self.consumer.getmany(timeout_ms=int(timeout * 1000),
                                                      max_records=FETCH_RECORDS)
                # getmany does not suspend while it has prefetched records: let the
                # heartbeats, fetches and the commit of the batch in flight run.
                await asyncio.sleep(0)
                async with self._lock:
                    if generation != self._generation:
                        # A rebalance happened: these records may have been fetched
                        # from the new assignment's positions, which moved past them.
                        self._rewind()
                        batch, generation, deadline, first = self._batch(), self._generation, None, 0.0
                        continue
                    for tp, records in fetched.items():
                        wanted = (tp.topic, tp.partition)
                        for record in records:
                            if record.offset < self._position.get(wanted, 0):
                                continue
                            self._position[wanted] = record.offset + 1
                            batch.add(self._message(record))
                            if batch.n_rows >= self.max_rows:
                                await self._hand_over(batch)
                                batch, deadline = self._batch(), None
                    if batch.n_messages and deadline is None:
                        first = loop.time()
                        deadline = first + self.max_wait
                    # Caught up (the fetch brought less than it could) with nothing
                    # being loaded: the batch closes batch-min-wait after its first
                    # message, not batch-max-wait.
                    if deadline is not None and (
                            sum(map(len, fetched.values())) < FETCH_RECORDS
                            and not self._loading()):
                        deadline = min(deadline, first + self.min_wait)
                    if deadline is not None and loop.time() >= deadline:
                        await self._hand_over(batch)
                        batch, deadline = self._batch(), None
        finally:
            await self._finish_inflight()

    def _rewind(self) -> None:
        """Read every assigned partition again from where its next batch starts (the
        committed offset after a rebalance): records the consumer delivered but the
        loop dropped are fetched again."""
        for tp in self.consumer.assignment():
            offset = self._position.get((tp.topic, tp.partition))
            if offset is not None:
                self.consumer.seek(tp, offset)

    async def _commit(self, offsets: dict[TopicPartition, int]) -> bool | None:
        """Commit after a load; retry while the broker is unreachable. True once
        committed; False when the group rebalanced first (the group's offsets are still
        the batch's starts); None when the sink stops first."""
        backoff = 0.1
        while True:
            try:
                await self.consumer.commit(offsets)
                return True
            except (CommitFailedError, IllegalStateError) as e:
                logger.warning("could not commit after loading (%s)", e)
                return False
            except KafkaError as e:
                if self._stop.is_set():
                    return None
                logger.warning("commit failed (%s); retrying in %.1fs", e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.retry_backoff_max)

    async def _hand_over(self, batch: Batch) -> None:
        """Start loading ``batch`` once the batch before it is loaded and committed."""
        await self._finish_inflight()
        if self._stop.is_set():
            return  # not loaded, not committed: read again at the next start
        self.loader.prepare(batch)
        starts = {tp: self._next_start.get(tp, -1) for tp in batch.positions}
        self._next_start.update(batch.positions)
        # Submitted to the thread now: a task would only start once this coroutine
        # suspends, and getmany does not while it has prefetched records, so the next
        # batch would be converted before loading even began.
        loading = asyncio.get_running_loop().run_in_executor(None, self.loader.load, batch, starts)
        self._inflight = asyncio.create_task(self._commit_when_loaded(batch, loading))

    def _loading(self) -> bool:
        """Whether a batch is being loaded (or committed)."""
        return self._inflight is not None and not self._inflight.done()

    async def _finish_inflight(self) -> None:
        if self._inflight is not None:
            task, self._inflight = self._inflight, None
            await task

    async def _commit_when_loaded(self, batch: Batch, loading: asyncio.Future) -> None:
        batch_id = await loading
        if batch_id is None:
            return  # stopping while ClickHouse was unavailable: nothing committed
        offsets = {TopicPartition(t, p): offset for (t, p), offset in batch.positions.items()}
        committed = await self._commit(offsets)
        if committed is False and self.loader.exclusive:
            # The group moved on without this commit: whoever consumes these
            # partitions now loads the batch again from the group's offsets, into its
            # own store; this store gives its copy up. (On a shared store the batch's
            # journal entry makes the next owner skip it instead.)
            await asyncio.get_running_loop().run_in_executor(None, self.loader.abandon, [batch_id])
            logger.warning("batch %d given up: its partitions are read again from the "
                           "group's offsets", batch_id)
        if not committed:
            return
        self.committed.update(batch.positions)
        self.batches_loaded += 1
        self.loader.pause.reached("after-commit")
