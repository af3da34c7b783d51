"""Shared fixtures: real brokers per test session, a fresh topic prefix and data
directory per test. Nothing here is mocked.

``broker`` is the ``host:port`` of a session broker: Tansu, unless the test is marked
``@pytest.mark.both_brokers``, which runs it twice, on Tansu and on Apache Kafka
(ids ``[tansu]`` / ``[kafka]``; fixtures built on ``broker``, such as ``bb_config``
and module-scoped recordings, follow). Each broker starts once per session, on first
use. Kafka needs ``DASK_BLACKBOX__LOCAL__KAFKA_HOME`` (``.ci/run`` fetches the jars
and sets it); without it the Kafka runs are skipped, saying how to get it. Its heap is
bounded (``DASK_BLACKBOX__LOCAL__KAFKA_HEAP``, default 384MiB here). Tests that run
brokers of their own (restarted, killed) take ``own_broker_factory``, or
:func:`broker_for` with ``broker_kind``.

Two tiers, by folder: ``tests/unit/`` (fast: no broker, cluster or pipeline) and
``tests/integration/`` (real processes; marked ``integration`` here). The support
modules they share stay at ``tests/``, importable by name from either.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import uuid

import dask.config
import pytest

from dask_blackbox import kafka
from dask_blackbox.deploy.brokers import MAVEN_COMMAND, BrokerError, TansuBroker
from dask_blackbox.testing.settings import dask_env

from broker_support import broker_for, kafka_home

BROKERS = ("tansu", "kafka")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "both_brokers: run the test on Tansu and on Apache Kafka "
        "(the `broker` fixture is parametrized)")


def pytest_generate_tests(metafunc):
    if not metafunc.definition.get_closest_marker("both_brokers"):
        return
    if "broker" in metafunc.fixturenames:
        metafunc.parametrize("broker", BROKERS, indirect=True, scope="session")
    elif "broker_kind" in metafunc.fixturenames:
        # A test that runs brokers of its own (own_broker_factory) asks for the kind.
        metafunc.parametrize("broker_kind", BROKERS, indirect=True)


@pytest.fixture(scope="session")
def tansu_broker():
    """``host:port`` of the session's Tansu broker."""
    with TansuBroker().start() as tansu:
        yield tansu.address


def _no_kafka(reason: str) -> None:
    """Without Kafka's jars a developer's run skips the Kafka half (saying how to get
    them); CI must run it, so there it is a failure, never a silent skip."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """``host:port`` of the session's Apache Kafka broker (KRaft, small heap)."""
    home = kafka_home()
    if not home:
        _no_kafka("Apache Kafka runs need DASK_BLACKBOX__LOCAL__KAFKA_HOME (jars: "
                    f"{MAVEN_COMMAND}; .ci/run does it)")
    data = tmp_path_factory.mktemp("kafka")
    broker = broker_for("kafka", data)
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
    """Which broker this test runs on: "tansu" or "kafka" (the kind of ``broker``,
    or, for a marked test that starts brokers of its own, its parameter). Kafka
    runs are skipped without DASK_BLACKBOX__LOCAL__KAFKA_HOME."""
    kind = getattr(request, "param", None)
    if kind is None:
        callspec = getattr(request.node, "callspec", None)
        kind = callspec.params.get("broker", "tansu") if callspec else "tansu"
    if kind == "kafka" and not kafka_home():
        _no_kafka("Apache Kafka runs need DASK_BLACKBOX__LOCAL__KAFKA_HOME (jars: "
                    f"{MAVEN_COMMAND}; .ci/run does it)")
    return kind


@pytest.fixture
def own_broker_factory(broker_kind, tmp_path):
    """Make restartable brokers of this test's kind on ports of the test's choosing:
    ``own_broker_factory(port=0)`` -> a :class:`~dask_blackbox.deploy.brokers.LocalBroker`
    (not started; ``start()``, ``kill()``, ``stop()``, ``start()`` again: a restarted
    Tansu is empty, a restarted Kafka keeps its data, see ``.persistent``). Every one
    is killed at the end of the test."""
    made = []

    def make(port: int = 0):
        broker = broker_for(broker_kind, tmp_path / f"broker-{len(made)}", port)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.kill()


def pipeline_settings(broker: str, prefix: str, data_dir) -> tuple[dict, dict[str, str]]:
    """Settings for a pipeline of its own on ``broker``: topics under ``prefix``, its
    own consumer groups and data directory; and the same as ``DASK_BLACKBOX__*``
    environment variables for subprocesses (faust workers, the sink, the CLI)."""
    settings = {
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": 2,
        "blackbox.data-dir": str(data_dir),
        "blackbox.processors.app-id": f"app-{prefix}",
        "blackbox.sink.group-id": f"sink-{prefix}",
        "blackbox.alerts.group-id": f"alerts-{prefix}",
    }
    return settings, dask_env(settings)


@pytest.fixture
def bb_config(broker, tmp_path):
    """Point dask-blackbox at the session broker with topics of its own, and at a
    fresh data directory. Yields the settings as ``DASK_BLACKBOX__*`` environment
    variables for subprocesses (faust workers, the sink, the CLI)."""
    settings, env = pipeline_settings(broker, "t" + uuid.uuid4().hex[:10], tmp_path / "data")
    with dask.config.set(settings):
        asyncio.run(kafka.ensure_topics())
        yield env


@pytest.fixture
def long_story():
    """Dask keeps a transition_log long enough for every test's whole story."""
    with dask.config.set({"distributed.admin.low-level-log-length": 1_000_000}):
        yield


def subprocess_env(bb_env: dict[str, str]) -> dict[str, str]:
    """os.environ plus the test's blackbox settings, for child processes."""
    return {**os.environ, **bb_env}


@pytest.fixture(scope="session")
def recorded_run(broker, tmp_path_factory):
    """One real run, recorded and loaded, shared by the export, trace-file, Grafana
    and metrics tests (see tests/recording_support.py): a dict with ``cluster_id``,
    ``backend`` (the sink's query server), ``settings``/``env`` (its pipeline's
    topics, groups and data dir), ``sink`` and ``faust`` (still running)."""
    from recording_support import record

    workdir = tmp_path_factory.mktemp("recorded-run")
    run = {}
    try:
        run = record(broker, workdir)
        yield run
    finally:
        for name in ("faust", "sink"):
            proc = run.get(name)
            if proc is not None:
                proc.stop() if name == "faust" else proc.terminate()


@pytest.fixture
def otel_collector(tmp_path):
    """Start OpenTelemetry Collectors (infra/otel: OTLP receiver, file exporter) on
    free loopback ports: ``otel_collector()`` -> a started
    :class:`otel_support.Collector` (``http_endpoint``, ``grpc_endpoint``,
    ``spans()``, ``logs()``); ``otel_collector(start=False, http_port=P)`` one to
    start later, ``signals=("traces",)`` one without a logs pipeline. Each is
    stopped at the end of the test. Without the built collector the test is skipped
    (CI: fails), saying how to build it."""
    from otel_support import BUILD, Collector, collector_binary

    binary = collector_binary()
    if binary is None:
        reason = f"the OpenTelemetry Collector is not built: {BUILD}"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    made = []

    def make(start: bool = True, **options):
        collector = Collector(binary, tmp_path / f"collector-{len(made)}", **options)
        made.append(collector)
        return collector.start() if start else collector

    yield make
    for collector in made:
        collector.stop()


UNIT = pathlib.Path(__file__).resolve().parent / "unit"
#: What a unit test may not ask for: a broker (and with it a pipeline or a cluster).
NOT_UNIT = frozenset({"broker", "tansu_broker", "kafka_broker", "broker_kind",
                      "own_broker_factory", "bb_config", "recorded_run", "otel_collector"})


def pytest_collection_modifyitems(items):
    """The folder is the tier. tests/unit/ is the fast one (``python -m pytest -m "not
    integration"``): no broker, cluster or pipeline, real chDB and files only. Every
    other test (tests/integration/, or a new module not yet filed) is ``integration``:
    it runs real processes (a broker, faust, the sink, Dask clusters). A unit test that
    asks for a broker, or is marked slow, stops the collection, naming it."""
    misfiled = []
    for item in items:
        if UNIT not in item.path.parents:
            item.add_marker(pytest.mark.integration)
            continue
        wants = NOT_UNIT & set(getattr(item, "fixturenames", ()))
        if wants or item.get_closest_marker("slow"):
            misfiled.append(f"{item.nodeid} ({', '.join(sorted(wants)) or 'slow'})")
    if misfiled:
        raise pytest.UsageError("tests/unit/ is the fast tier; move these to tests/integration/: "
                                + "; ".join(misfiled))


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (tests/ui_support.py), one a module."""
    from ui_support import chromium

    with chromium() as b:
        yield b
