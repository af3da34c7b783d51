"""Shared fixtures: real brokers per test session, a fresh topic prefix and data
directory per test. Nothing here is mocked.

``broker`` is the ``host:port`` of a session broker: Tansu, unless the test is marked
``@pytest.mark.both_brokers``, which runs it twice, on Tansu and on Apache Kafka
(ids ``[tansu]`` / ``[kafka]``; fixtures built on ``broker``, such as ``bb_config``
and module-scoped recordings, follow). Each broker starts once per session, on first
use. Kafka needs ``DASK_BLACKBOX__LOCAL__KAFKA_HOME`` (``.ci/run`` fetches the jars
and sets it); without it the Kafka runs are skipped, saying how to get it. Its heap is
bounded (``DASK_BLACKBOX__LOCAL__KAFKA_HEAP``, default 512MiB here).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import dask.config
import pytest

from dask_blackbox import config, kafka
from dask_blackbox.cli.brokers import MAVEN_COMMAND, BrokerError, KafkaBroker, TansuBroker

BROKERS = ("tansu", "kafka")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "both_brokers: run the test on Tansu and on Apache Kafka "
        "(the `broker` fixture is parametrized)")


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("both_brokers") and "broker" in metafunc.fixturenames:
        metafunc.parametrize("broker", BROKERS, indirect=True, scope="session")


@pytest.fixture(scope="session")
def tansu_broker():
    """``host:port`` of the session's Tansu broker."""
    with TansuBroker().start() as tansu:
        yield tansu.address


def kafka_home() -> str | None:
    return config.get("local.kafka-home")


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """``host:port`` of the session's Apache Kafka broker (KRaft, small heap)."""
    home = kafka_home()
    if not home:
        pytest.skip("Apache Kafka runs need DASK_BLACKBOX__LOCAL__KAFKA_HOME (jars: "
                    f"{MAVEN_COMMAND}; .ci/run does it)")
    data = tmp_path_factory.mktemp("kafka")
    broker = KafkaBroker(data, home=home, heap=os.environ.get(
        "DASK_BLACKBOX__LOCAL__KAFKA_HEAP", "512MiB"))
    try:
        broker.start(timeout=120, log=data / "broker.log")
    except BrokerError as e:
        pytest.fail(f"the session's Apache Kafka broker did not start: {e}")
    yield broker.address
    broker.stop()


@pytest.fixture(scope="session")
def broker(request):
    """``host:port`` of a broker that lives for the whole test session: Tansu, or
    each of Tansu and Kafka for tests marked ``both_brokers``."""
    kind = getattr(request, "param", "tansu")
    return request.getfixturevalue(f"{kind}_broker")


@pytest.fixture
def broker_kind(request) -> str:
    """Which broker ``broker`` is in this test: "tansu" or "kafka"."""
    callspec = getattr(request.node, "callspec", None)
    return callspec.params.get("broker", "tansu") if callspec else "tansu"


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
