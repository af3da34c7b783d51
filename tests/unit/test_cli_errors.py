"""Bad config and unreachable services give one clear line and a non-zero exit."""

import subprocess
import sys

import pytest

from dask_blackbox.deploy.brokers import free_port


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(out, *fragments):
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("dask-blackbox: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_unreachable_kafka(tmp_path):
    port = free_port()  # nothing listens there
    out = run_cli("up", "--kafka", f"127.0.0.1:{port}", "--data-dir", str(tmp_path))
    assert_one_line_error(out, "cannot reach Kafka", f"127.0.0.1:{port}")
    assert not (tmp_path / "up.json").exists()


def test_unwritable_data_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run_cli("up", "--data-dir", str(blocker / "data"))
    assert_one_line_error(out, "data directory", str(blocker / "data"), "not writable")


@pytest.mark.parametrize("dsn, fragment", [
    ("mysql://db:3306", "must start with one of"),
    ("http://:8123", "names no host"),
    ("http://host:port", "bad port"),
])
def test_malformed_dsn(tmp_path, dsn, fragment):
    for command in (["up"], ["query", "SELECT 1"]):
        out = run_cli(*command, "--clickhouse", dsn, "--data-dir", str(tmp_path))
        assert_one_line_error(out, "blackbox.clickhouse.dsn", dsn, fragment)


def test_bad_setting_names_the_key(tmp_path):
    out = run_cli("up", "--data-dir", str(tmp_path), "--set", "kafka.partitions=many")
    assert_one_line_error(out, "blackbox.kafka.partitions")


def test_usage_errors_exit_2():
    out = run_cli("story")
    assert out.returncode == 2 and "key" in out.stderr
    out = run_cli("spans", "--since", "yesterday-ish")
    assert out.returncode == 2 and "neither a duration" in out.stderr


def test_query_without_clickhouse(tmp_path):
    """Nothing recorded yet, or a ClickHouse server that does not answer: one line
    saying so (the password of the DSN is not in it)."""
    out = run_cli("query", "SELECT 1", "--data-dir", str(tmp_path))
    assert_one_line_error(out, "no chDB data at", "blackbox.clickhouse.dsn", "dask-blackbox up")
    port = free_port()  # nothing listens there
    out = run_cli("spans", "--clickhouse", f"http://user:pw0rd@127.0.0.1:{port}",
                  "--data-dir", str(tmp_path))
    assert_one_line_error(out, "cannot reach ClickHouse at", f"http://user:***@127.0.0.1:{port}")
    assert "pw0rd" not in out.stderr + out.stdout


def test_refused_statement_is_one_line(tmp_path):
    out = run_cli("query", "DROP TABLE blackbox.envelopes", "--data-dir", str(tmp_path),
                  "--clickhouse", f"chdb://{tmp_path / 'ch'}")
    # No data yet is found first; with data, test_read_only covers each refusal.
    assert_one_line_error(out, "no chDB data at")


def test_a_bad_alert_rule_stops_up_before_anything_starts(tmp_path):
    import os

    rules = repr([{"name": "oom", "when": "worker-died", "causes": ["oom"], "webhook": "http://h/x"}])
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "up", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "DASK_BLACKBOX__ALERTS__RULES": rules})
    assert_one_line_error(out, "blackbox.alerts.rules[0] (oom).causes", "memory-limit")
    assert not (tmp_path / "up.json").exists()
    # the alerter without rules has nothing to do, and says so
    assert_one_line_error(run_cli("alerts", "--data-dir", str(tmp_path)), "blackbox.alerts.rules is empty")
