"""A throwaway Tansu broker with the blackbox topics, for benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import dask.config

from dask_blackbox import kafka
from dask_blackbox.cli.tansu import start_broker


@contextlib.contextmanager
def local_broker(**settings):
    """Run the body against a fresh broker (one partition per topic, a unique topic
    prefix) with ``settings`` as extra Dask config."""
    proc, port = start_broker()
    try:
        with dask.config.set({
            "blackbox.kafka.bootstrap-servers": f"127.0.0.1:{port}",
            "blackbox.kafka.topic-prefix": "bench-" + uuid.uuid4().hex[:8],
            "blackbox.kafka.partitions": 1,
            **settings,
        }):
            asyncio.run(kafka.ensure_topics())
            yield
    finally:
        proc.kill()
        proc.wait()
