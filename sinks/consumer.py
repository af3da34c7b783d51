"""The sink's Kafka side: a consumer group over the raw and derived topics that hands
batches to the :class:`~sinks.loader.Loader` and commits offsets only after ClickHouse
has the rows.

It loads every contract topic (``contract.TOPICS``). A batch closes at
``SinkSettings.batch_max_rows`` rows or ``batch_max_wait`` seconds after its first
message, whichever comes first. It is then loaded in a thread and committed
while the next batch is read and converted (chDB releases the GIL while it inserts,
so the two overlap on two cores); a batch starts loading only once the previous one
is committed. The rebalance callbacks wait for the batch in flight, so a partition is
never revoked half way through a batch; messages read but not yet handed to loading
when partitions are revoked are dropped (they were not committed, so their new owner
reads them again).
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


class SinkConsumer(ConsumerRebalanceListener):
    """Consumes every blackbox topic in group ``settings.group_id`` into ``loader``."""

    def __init__(self, loader: Loader, settings: SinkSettings) -> None:
        self.loader = loader
        self.settings = settings
        self.max_rows = settings.batch_max_rows
        self.max_wait = settings.batch_max_wait
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

    async def _prepare(self, tps: list[TopicPartition]) -> None:
        """Know each partition's committed offset (committing the beginning for a
        partition the group never committed, so every batch starts at a committed
        offset), then repair what a crash left (see Loader.recover)."""
        committed = {tp: await self.consumer.committed(tp) for tp in tps}
        fresh = [tp for tp, offset in committed.items() if offset is None]
        if fresh:
            beginnings = await self.consumer.beginning_offsets(fresh)
            await self.consumer.commit(beginnings)
            committed.update(beginnings)
        positions = {(tp.topic, tp.partition): offset for tp, offset in committed.items()}
        loaded = await self._retrying(self.loader.recover, list(positions), positions)
        for (topic, partition), entry in loaded.items():
            tp = TopicPartition(topic, partition)
            if await self._same_message_at(tp, entry):
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

    async def _same_message_at(self, tp: TopicPartition, entry: Loaded) -> bool:
        """Whether the first message at or after ``entry.from_offset`` is the one the
        journal fingerprinted (and not another broker incarnation's). Read with a
        separate group-less consumer, outside this consumer's rebalance."""
        reader = AIOKafkaConsumer(**self.settings.kafka.client_kwargs(), group_id=None,
                                  enable_auto_commit=False)
        await reader.start()
        try:
            reader.assign([tp])
            reader.seek(tp, entry.from_offset)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10.0
            while loop.time() < deadline:
                records = (await reader.getmany(tp, timeout_ms=500, max_records=1)).get(tp)
                if records:
                    found = fingerprint(self._message(records[0]))
                    return found == (entry.first_timestamp, entry.first_crc)
            return False
        finally:
            await reader.stop()

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

    async def run(self) -> None:
        """Consume and load until :meth:`stop`."""
        loop = asyncio.get_running_loop()
        batch, generation, deadline = Batch(), self._generation, None
        try:
            while not self._stop.is_set():
                timeout = 1.0 if deadline is None else max(0.0, deadline - loop.time())
                # Few messages per call: converting them blocks the event loop.
                fetched = await self.consumer.getmany(timeout_ms=int(timeout * 1000), max_records=100)
                # getmany does not suspend while it has prefetched records: let the
                # heartbeats, fetches and the commit of the batch in flight run.
                await asyncio.sleep(0)
                async with self._lock:
                    if generation != self._generation:
                        # A rebalance happened: positions went back to committed offsets.
                        batch, generation, deadline = Batch(), self._generation, None
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
                                batch, deadline = Batch(), None
                    if batch.n_messages and deadline is None:
                        deadline = loop.time() + self.max_wait
                    if deadline is not None and loop.time() >= deadline:
                        await self._hand_over(batch)
                        batch, deadline = Batch(), None
        finally:
            await self._finish_inflight()

    async def _commit(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commit after a load; retry while the broker is unreachable. False when the
        group rebalanced (or the sink stops) first: the rows are loaded and journalled,
        and whoever consumes these partitions next finds the journal entry and skips
        them."""
        backoff = 0.1
        while True:
            try:
                await self.consumer.commit(offsets)
                return True
            except (CommitFailedError, IllegalStateError) as e:
                logger.warning("could not commit after loading (%s); the journal covers it", e)
                return False
            except KafkaError as e:
                if self._stop.is_set():
                    return False
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

    async def _finish_inflight(self) -> None:
        if self._inflight is not None:
            task, self._inflight = self._inflight, None
            await task

    async def _commit_when_loaded(self, batch: Batch, loading: asyncio.Future) -> None:
        if not await loading:
            return  # stopping while ClickHouse was unavailable: nothing committed
        offsets = {TopicPartition(t, p): offset for (t, p), offset in batch.positions.items()}
        if not await self._commit(offsets):
            return
        self.committed.update(batch.positions)
        self.batches_loaded += 1
        self.loader.pause.reached("after-commit")
