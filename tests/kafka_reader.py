"""Read a blackbox topic back from the broker, for assertions."""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import AIOKafkaConsumer

from dask_blackbox import config


async def _read(topic: str, idle: float, timeout: float) -> list:
    consumer = AIOKafkaConsumer(
        config.topic(topic),
        **config.kafka_client_kwargs(),
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    out = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_new = loop.time()
        while loop.time() < deadline and loop.time() - last_new < idle:
            batch = await consumer.getmany(timeout_ms=100)
            for records in batch.values():
                out.extend(records)
                last_new = loop.time()
    finally:
        await consumer.stop()
    return out


def read_records(topic: str, idle: float = 1.5, timeout: float = 60.0) -> list:
    """Every record of a contract topic (raw aiokafka ConsumerRecords), read until
    nothing new arrives for ``idle`` seconds."""
    return asyncio.run(_read(topic, idle, timeout))


def read_json(topic: str, idle: float = 1.5, timeout: float = 60.0) -> list[dict]:
    """Every record of a contract topic, orjson-decoded."""
    return [orjson.loads(r.value) for r in read_records(topic, idle, timeout)]
