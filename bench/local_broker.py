"""A throwaway local broker (Tansu, or Apache Kafka with ``kind="kafka"``) with the
blackbox topics, for benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid

import dask.config

from dask_blackbox import kafka
from dask_blackbox.deploy import brokers


@contextlib.contextmanager
def local_broker(kind: str = "tansu", **settings):
    """Run the body against a fresh broker (one partition per topic, a unique topic
    prefix) with ``settings`` as extra Dask config. ``kind``: tansu or kafka (found
    through blackbox.local.kafka-home)."""
    with tempfile.TemporaryDirectory() as data_dir:
        broker = brokers.from_config(data_dir, kind).start(timeout=120)
        try:
            with dask.config.set({
                "blackbox.kafka.bootstrap-servers": broker.address,
                "blackbox.kafka.topic-prefix": "bench-" + uuid.uuid4().hex[:8],
                "blackbox.kafka.partitions": 1,
                **settings,
            }):
                asyncio.run(kafka.ensure_topics())
                yield broker
        finally:
            broker.kill()
