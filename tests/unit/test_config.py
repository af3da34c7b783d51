"""Configuration: defaults, environment overrides, and clear errors for bad values."""

import os
import subprocess
import sys

import dask.config
import pytest

from dask_blackbox import config
from dask_blackbox.config import ConfigError


def test_defaults_are_registered():
    assert config.get("kafka.topic-prefix") == "blackbox"
    assert config.get_seconds("producer.flush-interval") <= 0.1
    assert config.clickhouse_dsn().startswith("chdb://")


def test_environment_variables_override_defaults():
    env = {
        **os.environ,
        "DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS": "kafka-1:9093,kafka-2:9093",
        "DASK_BLACKBOX__CLICKHOUSE__DSN": "http://ch:8123",
    }
    out = subprocess.run(
        [sys.executable, "-c",
         "from dask_blackbox import config;"
         "print(config.bootstrap_servers(), config.clickhouse_dsn())"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout
    assert out.strip() == "['kafka-1:9093', 'kafka-2:9093'] http://ch:8123"


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("clickhouse.dsn", "mysql://x", "blackbox.clickhouse.dsn"),
        ("clickhouse.dsn", "http://:8123", "names no host"),
        ("kafka.bootstrap-servers", "no-port", "not host:port"),
        ("kafka.security-protocol", "TLS", "security-protocol"),
        ("producer.flush-interval", "soon", "not a duration"),
        ("kafka.compression", "brotli", "blackbox.kafka.compression"),
    ],
)
def test_bad_values_name_the_key(key, value, fragment):
    with dask.config.set({f"blackbox.{key}": value}):
        with pytest.raises(ConfigError, match=fragment):
            config.clickhouse_dsn()
            config.kafka_client_kwargs()
            config.compression()
            config.get_seconds("producer.flush-interval")


def test_sasl_needs_credentials():
    with dask.config.set({"blackbox.kafka.security-protocol": "SASL_PLAINTEXT",
                          "blackbox.kafka.sasl-mechanism": "PLAIN"}):
        with pytest.raises(ConfigError, match="sasl-username"):
            config.kafka_client_kwargs()
    with dask.config.set({"blackbox.kafka.security-protocol": "SASL_PLAINTEXT",
                          "blackbox.kafka.sasl-mechanism": "PLAIN",
                          "blackbox.kafka.sasl-username": "u",
                          "blackbox.kafka.sasl-password": "p"}):
        kw = config.kafka_client_kwargs()
        assert kw["sasl_plain_username"] == "u" and kw["sasl_mechanism"] == "PLAIN"


def test_existing_directories_are_made_private(tmp_path):
    """The data directory the sink and `up` use, and the chDB store, are 0700 even
    when they existed with a looser mode."""
    import stat

    from dask_blackbox import clickhouse
    from dask_blackbox.deploy.supervisor import prepare_data_dir

    data, store = tmp_path / "data", tmp_path / "data" / "clickhouse"
    for path in (data, store):
        path.mkdir(mode=0o755)
        path.chmod(0o755)
    with dask.config.set({"blackbox.data-dir": str(data)}):
        assert prepare_data_dir() == data
    clickhouse.check_writable(store, "blackbox.clickhouse.dsn")
    for path in (data, store):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
