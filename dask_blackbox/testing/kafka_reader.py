"""Read a blackbox topic back from the broker, for assertions."""

from __future__ import annotations

import asyncio

from dask_blackbox import config, contract


async def read_topic(topic: str, idle: float = 1.0, timeout: float = 120.0) -> list:
    """Every record of ``topic`` (a full name) from its beginning, as aiokafka
    ConsumerRecords in partition order, read until nothing new arrives for ``idle``
    seconds (or ``timeout`` passes). For replays, benchmarks and tests only."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic, **config.kafka_client_kwargs(), group_id=None,
        auto_offset_reset="earliest", enable_auto_commit=False,
    )
    await consumer.start()
    out = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_new = loop.time()
        while loop.time() < deadline and loop.time() - last_new < idle:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                out.extend(records)
                last_new = loop.time()
    finally:
        await consumer.stop()
    return out


def read_records(topic: str, idle: float = 1.5, timeout: float = 60.0) -> list:
    """Every record of a contract topic (raw aiokafka ConsumerRecords), read until
    nothing new arrives for ``idle`` seconds."""
    return asyncio.run(read_topic(config.topic(topic), idle, timeout))


def read_json(topic: str, idle: float = 1.5, timeout: float = 60.0) -> list[dict]:
    """Every record of a contract topic, decoded (``contract.decode_envelope``: JSON,
    or a MessagePack envelope)."""
    return [contract.decode_envelope(r.value) for r in read_records(topic, idle, timeout)]
