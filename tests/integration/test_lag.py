"""Consumer lag as the ground measures it (``dask_blackbox.kafka.consumer_lag``, what
``wait_drained`` and the tests' ``wait_consumed`` wait on), on both brokers: a
partition ends one past its last record, also where Tansu reports less."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from dask_blackbox import config, kafka
from dask_blackbox.contract import RAW


async def _publish_and_commit(group: str, topic: str, committed: int) -> list[int]:
    """One record, then a batch of four, to partition 0 of ``topic``; ``group``
    commits ``committed`` there. The offsets the broker acknowledged."""
    client = config.KafkaSettings.from_config().client_kwargs()
    producer = AIOKafkaProducer(**client, linger_ms=200)
    await producer.start()
    try:
        first = await (await producer.send(topic, b"alone", partition=0))
        # sent together within the linger: one batch of four records
        sent = [await producer.send(topic, b"batched-%d" % i, partition=0) for i in range(4)]
        batch = [await f for f in sent]
    finally:
        await producer.stop()
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(**client, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: committed})
    finally:
        await consumer.stop()
    return [first.offset] + [m.offset for m in batch]


@pytest.mark.both_brokers
def test_lag_counts_every_record_of_the_last_batch(bb_config):
    """Five records, the last four in one batch; the group committed offset 2 (it
    consumed the first two): three are left, on Tansu too, which reports the
    partition's end as the last batch's base offset plus one (2 here)."""
    topic = config.topic(RAW)
    group = "lag-" + topic
    offsets = asyncio.run(_publish_and_commit(group, topic, committed=2))
    assert offsets == [0, 1, 2, 3, 4]
    lag = asyncio.run(kafka.consumer_lag(group, [topic]))
    assert lag == {topic: 3}
    # a group that never committed counts from the first record
    assert asyncio.run(kafka.consumer_lag("never-" + group, [topic])) == {topic: 5}
