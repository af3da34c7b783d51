"""Read a blackbox topic back from the broker, for assertions."""

from __future__ import annotations

import asyncio

import orjson

from dask_blackbox import config, kafka


def read_records(topic: str, idle: float = 1.5, timeout: float = 60.0) -> list:
    """Every record of a contract topic (raw aiokafka ConsumerRecords), read until
    nothing new arrives for ``idle`` seconds."""
    return asyncio.run(kafka.read_topic(config.topic(topic), idle, timeout))


def read_json(topic: str, idle: float = 1.5, timeout: float = 60.0) -> list[dict]:
    """Every record of a contract topic, orjson-decoded."""
    return [orjson.loads(r.value) for r in read_records(topic, idle, timeout)]
