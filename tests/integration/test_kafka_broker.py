"""`dask-blackbox up --broker kafka`: a real single-node Apache Kafka (KRaft) as the
local broker. Bad input (no Java, an old Java, no jars, a directory that is not Kafka,
a port in use, a corrupt data directory) is one line naming the problem and the fix,
exit 1, nothing left running. A real start creates the topics with retention and
segments that let retention act, refuses auto-creation, stops cleanly, and starts
again on its own data."""

from __future__ import annotations

import asyncio
import base64
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import psutil
import pytest

from dask_blackbox.deploy.brokers import kafka_home, new_cluster_id, port_open

from dask_blackbox.testing.kafka_reader import read_topic
from up_process import Up

KAFKA_HOME = kafka_home()
needs_kafka = pytest.mark.skipif(
    not KAFKA_HOME, reason="needs Kafka's jars (./run-tests caches them)")


def up_kafka(data_dir, *args, env_extra=None, timeout=120, broker="kafka"):
    env = {k: v for k, v in os.environ.items() if k != "DASK_BLACKBOX__LOCAL__KAFKA_HOME"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "dask_blackbox.cli", "up", "--broker", broker,
         "--data-dir", str(data_dir), "--timeout", "60", *args],
        capture_output=True, text=True, timeout=timeout, env=env)


def kafka_processes(data_dir) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if "kafka." in cmd and str(data_dir) in cmd:
            out.append(p)
    return out


def assert_refused(out, data_dir, *phrases):
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("dask-blackbox: error:")]
    assert len(errors) == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    for phrase in phrases:
        assert phrase in errors[0], (phrase, errors[0])
    assert not (data_dir / "up.json").exists()
    assert not kafka_processes(data_dir)


def test_no_kafka_home_says_how_to_get_kafka(tmp_path):
    # neither the setting nor jars where ./run-tests caches them
    out = up_kafka(tmp_path / "data", env_extra={"XDG_CACHE_HOME": str(tmp_path / "no-cache")})
    assert_refused(out, tmp_path / "data", "blackbox.local.kafka-home is not set",
                   "kafka.apache.org", "mvn -q -f infra/kafka/pom.xml")


def test_a_directory_that_is_not_kafka(tmp_path):
    (tmp_path / "notkafka" / "libs").mkdir(parents=True)
    (tmp_path / "notkafka" / "libs" / "something-1.0.jar").write_text("")
    out = up_kafka(tmp_path / "data", env_extra={
        "DASK_BLACKBOX__LOCAL__KAFKA_HOME": str(tmp_path / "notkafka")})
    assert_refused(out, tmp_path / "data", "not an Apache Kafka distribution",
                   "no kafka_2.13-*.jar", "blackbox.local.kafka-home")


@needs_kafka
def test_missing_jars_are_named(tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for jar in pathlib.Path(KAFKA_HOME).glob("**/kafka_2.13-*.jar"):
        shutil.copy(jar, partial)
    out = up_kafka(tmp_path / "data", env_extra={"DASK_BLACKBOX__LOCAL__KAFKA_HOME": str(partial)})
    assert_refused(out, tmp_path / "data", "lacks", "kafka-server-*.jar", "kafka-clients-*.jar",
                   "mvn -q -f infra/kafka/pom.xml")


@needs_kafka
def test_no_java(tmp_path):
    out = up_kafka(tmp_path / "data", "--set", f"local.java={tmp_path / 'no-java'}",
                   env_extra={"DASK_BLACKBOX__LOCAL__KAFKA_HOME": KAFKA_HOME})
    assert_refused(out, tmp_path / "data", "Java not found", "Java 17 or newer")


@needs_kafka
def test_java_older_than_17(tmp_path):
    # An executable that answers `-version` as Java 11 does.
    old = tmp_path / "java11"
    old.write_text('#!/bin/sh\necho \'openjdk version "11.0.22" 2024-01-16\' >&2\n')
    old.chmod(0o755)
    out = up_kafka(tmp_path / "data", "--set", f"local.java={old}",
                   env_extra={"DASK_BLACKBOX__LOCAL__KAFKA_HOME": KAFKA_HOME})
    assert_refused(out, tmp_path / "data", "Java 11", "needs Java 17 or newer")


@pytest.mark.parametrize("kind", ["tansu", pytest.param("kafka", marks=needs_kafka)])
def test_port_in_use(tmp_path, kind):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = up_kafka(tmp_path / "data", "--set", f"local.broker-port={port}", broker=kind,
                       env_extra={"DASK_BLACKBOX__LOCAL__KAFKA_HOME": KAFKA_HOME or ""})
    assert_refused(out, tmp_path / "data", f"port {port}", "in use",
                   "blackbox.local.broker-port")


@needs_kafka
def test_corrupt_data_directory(tmp_path):
    logs = tmp_path / "data" / "kafka" / "logs"
    logs.mkdir(parents=True)
    (logs / "meta.properties").write_bytes(b"\x00\x13garbage")
    out = up_kafka(tmp_path / "data", env_extra={"DASK_BLACKBOX__LOCAL__KAFKA_HOME": KAFKA_HOME})
    assert_refused(out, tmp_path / "data", "corrupt", str(logs), "remove")


async def _topic_configs(address: str, names: list[str]) -> dict[str, dict[str, str]]:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=[address])
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
        out = {}
        for response in responses:
            for resource in response.resources:
                _code, _msg, _type, name, entries = resource[:5]
                out[name] = {e[0]: e[1] for e in entries}
        return out
    finally:
        await admin.close()


async def _send_to_missing_topic(address: str) -> Exception | None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=[address], request_timeout_ms=5000)
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait("no-such-topic", b"x"), 15)
    except Exception as e:  # noqa: BLE001 - any refusal will do; success is the failure
        return e
    finally:
        await producer.stop()
    return None


async def _topics(address: str) -> list[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=[address])
    await admin.start()
    try:
        return await admin.list_topics()
    finally:
        await admin.close()


@needs_kafka
def test_up_on_kafka_topics_retention_clean_stop_and_restart(tmp_path):
    data_dir = tmp_path / "data"
    first = Up(data_dir, "--broker", "kafka", "--set", "kafka.retention=2m",
               "--set", "local.kafka-heap=384MiB")
    try:
        first.wait_for("healthy in", timeout=180)
        state = first.state()
        assert state["broker"] == "kafka"
        address = state["kafka"]
        children = psutil.Process(first.proc.pid).children(recursive=True)
        assert any("kafka.Kafka" in " ".join(c.cmdline()) for c in children)
        cluster_id = (data_dir / "kafka" / "logs" / "meta.properties").read_text()

        names = [f"blackbox.{t}" for t in ("raw", "span-state")]
        configs = asyncio.run(_topic_configs(address, names))
        for name in names:
            assert configs[name]["retention.ms"] == "120000"
            assert configs[name]["segment.ms"] == "30000"  # a quarter of the retention
            assert int(configs[name]["segment.bytes"]) == 64 * 2**20
        assert asyncio.run(_send_to_missing_topic(address)) is not None
        assert "no-such-topic" not in asyncio.run(_topics(address))

        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=120) == 0, "".join(first.output)
        for child in children:
            assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, child
        assert not port_open("127.0.0.1", int(address.rsplit(":", 1)[1]))
        assert not kafka_processes(data_dir)
    finally:
        first.stop()

    # Again on the same data: not formatted again, the topics are still there.
    again = Up(data_dir, "--broker", "kafka")
    try:
        again.wait_for("healthy in", timeout=180)
        assert (data_dir / "kafka" / "logs" / "meta.properties").read_text() == cluster_id
        assert set(names) <= set(asyncio.run(_topics(again.state()["kafka"])))
    finally:
        again.stop()
    gone, alive = psutil.wait_procs(kafka_processes(data_dir), timeout=30)
    assert not alive


async def _produce_one(topic: str) -> None:
    from aiokafka import AIOKafkaProducer

    from dask_blackbox import config

    producer = AIOKafkaProducer(**config.kafka_client_kwargs())
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"before the restart")
    finally:
        await producer.stop()


@pytest.mark.both_brokers
def test_own_broker_restarts_on_its_port(own_broker_factory, broker_kind):
    """The restartable broker the fault tests use: killed (as a crash) and started
    again on the same port; Kafka keeps what it acknowledged, Tansu starts empty."""
    import dask.config

    from dask_blackbox import config, kafka

    broker = own_broker_factory()
    with dask.config.set({"blackbox.kafka.bootstrap-servers": broker.address,
                          "blackbox.kafka.topic-prefix": "own",
                          "blackbox.kafka.partitions": 1}):
        broker.start(timeout=120)
        asyncio.run(kafka.ensure_topics())
        asyncio.run(_produce_one(config.topic("raw")))
        broker.kill()
        assert not port_open("127.0.0.1", broker.port)
        broker.start(timeout=120)
        assert port_open("127.0.0.1", broker.port)
        asyncio.run(kafka.ensure_topics())
        values = [r.value for r in asyncio.run(read_topic(config.topic("raw"), idle=2))]
    assert broker.persistent == (broker_kind == "kafka")
    assert values == ([b"before the restart"] if broker.persistent else [])


def test_kraft_cluster_ids_are_never_read_as_options():
    """kafka-storage's argument parser reads an id starting with "-" as an option:
    1 random id in 64 made the session's Kafka fail to format its storage."""
    ids = [new_cluster_id() for _ in range(5000)]
    assert not [i for i in ids if i.startswith("-")]
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)
    assert len(set(ids)) == len(ids)
