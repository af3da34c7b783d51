"""Shared fixtures: a real Tansu broker per test session, a fresh topic prefix and
data directory per test. Nothing here is mocked."""

from __future__ import annotations

import asyncio
import os
import uuid

import dask.config
import pytest

from dask_blackbox import kafka
from dask_blackbox.cli.tansu import start_broker


@pytest.fixture(scope="session")
def broker():
    """``host:port`` of a Tansu broker that lives for the whole test session."""
    proc, port = start_broker()
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


@pytest.fixture
def bb_config(broker, tmp_path):
    """Point dask-blackbox at the session broker with topics of its own, and at a
    fresh data directory. Yields the settings as ``DASK_BLACKBOX__*`` environment
    variables for subprocesses (faust workers, the sink, the CLI)."""
    prefix = "t" + uuid.uuid4().hex[:10]
    settings = {
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": 2,
        "blackbox.data-dir": str(tmp_path / "data"),
        "blackbox.processors.app-id": f"app-{prefix}",
        "blackbox.sink.group-id": f"sink-{prefix}",
    }
    env = {
        "DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v)
        for k, v in settings.items()
    }
    with dask.config.set(settings):
        asyncio.run(kafka.ensure_topics())
        yield env


def subprocess_env(bb_env: dict[str, str]) -> dict[str, str]:
    """os.environ plus the test's blackbox settings, for child processes."""
    return {**os.environ, **bb_env}
