"""What a processor writes to Kafka -- derived records and its changelog -- in batches.

A processor writes a few messages for every envelope it reads (a checkpoint, a span
snapshot, sometimes a partial), thousands a second under load. Handed one by one to
faust (a future, a pending message and a callback each) or to a producer's
``send`` (a future each, and a wait whenever its partition's batch is full), they
cost more than the processing. :class:`Outbox` instead builds one record batch per
topic partition (aiokafka's ``create_batch``) and sends each whole
(``send_batch``), on a producer of its own with the blackbox Kafka settings
(compression included).

:meth:`Outbox.add` only appends; :meth:`Outbox.flush` sends what was added and
returns once the broker acknowledged all of it (raising what the broker or the
client raised). Order is kept per topic partition: batches are sent in the order
they were filled. A message with no partition goes where Kafka's default partitioner
puts its key (murmur2), so derived records land where the producers' raw ones and
faust's would.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

from dask_blackbox.config import KafkaSettings

#: Largest record batch, uncompressed (a compressed one stays far below the 1 MB
#: brokers take by default).
MAX_BATCH_BYTES = 512 * 1024


class Outbox:
    """Batched writes to Kafka for one processor (see the module docstring)."""

    def __init__(self, kafka: KafkaSettings, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self._kafka = kafka
        self._max_batch_bytes = max_batch_bytes
        self._producer: AIOKafkaProducer | None = None  # made in the event loop, at start
        self._open: dict[tuple[str, int], object] = {}
        self._sent: list[asyncio.Future] = []
        self._partitions: dict[str, int] = {}
        #: (number of partitions, key) -> the key's partition (murmur2 is slow)
        self._by_key: dict[tuple[int, bytes], int] = {}
        self._started = False

    async def start(self) -> None:
        if not self._started:
            self._producer = AIOKafkaProducer(
                **self._kafka.producer_kwargs(), acks="all",
                max_batch_size=self._max_batch_bytes,
                max_request_size=4 * self._max_batch_bytes, linger_ms=0)
            await self._producer.start()
            self._started = True

    async def stop(self) -> None:
        """Send and wait for what was added, then close the producer."""
        if self._started:
            try:
                await self.flush()
            finally:
                self._started = False
                await self._producer.stop()

    async def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (asked once)."""
        n = self._partitions.get(topic)
        if n is None:
            await self.start()
            n = self._partitions[topic] = len(await self._producer.partitions_for(topic))
        return n

    async def add(self, topic: str, key: bytes | None, value: bytes | None,
                  partition: int | None = None) -> None:
        """Append one message to its partition's batch (sent by :meth:`flush`, or
        now if the batch is full)."""
        if partition is None:
            partition = self._by_key.get((self._partitions.get(topic), key))
            if partition is None:
                partition = await self._partition_of(topic, key)
        tp = (topic, partition)
        batch = self._open.get(tp)
        if batch is None:
            await self.start()
            batch = self._open[tp] = self._producer.create_batch()
        if batch.append(key=key, value=value, timestamp=None) is None:
            await self._send(tp)
            batch = self._open[tp] = self._producer.create_batch()
            if batch.append(key=key, value=value, timestamp=None) is None:
                raise ValueError(f"a message of {len(value or b'')} bytes for {topic} is "
                                 f"larger than a batch ({MAX_BATCH_BYTES} bytes)")

    async def _partition_of(self, topic: str, key: bytes | None) -> int:
        n = await self.partitions(topic)
        if key is None:
            return 0
        cached = self._by_key.get((n, key))
        if cached is None:
            if len(self._by_key) > 100_000:
                self._by_key.clear()
            cached = self._by_key[(n, key)] = (murmur2(key) & 0x7FFFFFFF) % n
        return cached

    async def _send(self, tp: tuple[str, int]) -> None:
        batch = self._open.pop(tp)
        batch.close()
        self._sent.append(await self._producer.send_batch(batch, tp[0], partition=tp[1]))

    async def flush(self) -> None:
        """Send every open batch, and wait until the broker acknowledged everything
        added so far."""
        for tp in list(self._open):
            await self._send(tp)
        sent, self._sent = self._sent, []
        if sent:
            await asyncio.gather(*sent)
