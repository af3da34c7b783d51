"""Secrets given in config never come out: not on stdout or stderr of ``up``,
``status``, ``sink``, ``query`` or an error, and not in any file under the data
directory (run files, logs, the chDB store).

The real commands run as subprocesses with a ClickHouse DSN that carries a password
(``http://user:S3cretPw@127.0.0.1:<closed port>``) and a Kafka SASL password; every
output and every file is scanned for both.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from dask_blackbox import config
from dask_blackbox.deploy.brokers import free_port

from conftest import subprocess_env

DSN_PASSWORD = "S3cretPw"
SASL_PASSWORD = "K4fkaSecretPw"
SECRETS = (DSN_PASSWORD, SASL_PASSWORD)


def leaks(text: str | bytes) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [s for s in SECRETS if s.encode() in data]


def files_with_secrets(root: pathlib.Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if leaks(path.read_bytes()):
                    found.append(str(path))
            except OSError:
                pass
    return found


@pytest.fixture
def secret_env(bb_config, tmp_path):
    """The test's settings plus a password in the DSN (nothing listens on its port)
    and a SASL password."""
    return {**bb_config,
            "DASK_BLACKBOX__CLICKHOUSE__DSN": f"http://user:{DSN_PASSWORD}@127.0.0.1:{free_port()}",
            "DASK_BLACKBOX__KAFKA__SASL_USERNAME": "user",
            "DASK_BLACKBOX__KAFKA__SASL_PASSWORD": SASL_PASSWORD}


def run(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args],
                          env=subprocess_env(env), capture_output=True, text=True, timeout=timeout)


def assert_no_leak(out: subprocess.CompletedProcess, data_dir: pathlib.Path) -> None:
    assert not leaks(out.stdout), out.stdout
    assert not leaks(out.stderr), out.stderr
    assert not files_with_secrets(data_dir), files_with_secrets(data_dir)


def test_commands_and_their_errors_keep_secrets(secret_env):
    data_dir = pathlib.Path(secret_env["DASK_BLACKBOX__DATA_DIR"])
    for args in (["query", "SELECT 1"], ["spans"], ["status"], ["sink"], ["up", "--timeout", "90"]):
        out = run(secret_env, *args)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert "dask-blackbox" in out.stderr and "error" in out.stderr, (args, out.stderr)
        assert_no_leak(out, data_dir)
    # With SASL on, the Kafka side fails (the broker speaks PLAINTEXT): still no secret.
    sasl = {**secret_env, "DASK_BLACKBOX__KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "DASK_BLACKBOX__KAFKA__SASL_MECHANISM": "PLAIN"}
    for args in (["topics"], ["status"]):
        out = run(sasl, *args, timeout=120)
        assert out.returncode != 0, (args, out.stdout, out.stderr)
        assert_no_leak(out, data_dir)


@pytest.mark.parametrize("dsn", [
    f"http://user:{DSN_PASSWORD}@127.0.0.1:port",        # bad port
    f"mysql://user:{DSN_PASSWORD}@127.0.0.1:3306",       # wrong scheme
    f"http://user:{DSN_PASSWORD}@:8123",                 # no host
    f"http://user:{DSN_PASSWORD}@127.0.0.1:1?password={DSN_PASSWORD}x",
])
def test_malformed_dsn_errors_keep_the_password(tmp_path, dsn):
    for args in (["query", "SELECT 1", "--clickhouse", dsn], ["up", "--clickhouse", dsn],
                 ["status", "--clickhouse", dsn, "--kafka", f"127.0.0.1:{free_port()}"]):
        out = run({"DASK_BLACKBOX__DATA_DIR": str(tmp_path / "data")}, *args, timeout=120)
        assert out.returncode == 1, (args, out.stderr)
        assert out.stderr.startswith("dask-blackbox: error: "), out.stderr
        assert not leaks(out.stdout + out.stderr), out.stderr
    with pytest.raises(config.ConfigError) as raised:
        import dask.config
        with dask.config.set({"blackbox.clickhouse.dsn": dsn.replace("127.0.0.1:1?", "127.0.0.1:x?")}):
            config.clickhouse_dsn()
    assert not leaks(str(raised.value)) and "blackbox.clickhouse.dsn" in str(raised.value)


def test_a_running_pipeline_keeps_the_sasl_password(bb_config):
    """``up`` healthy (PLAINTEXT, so the configured SASL password is carried, not
    used), then stopped: its output, run files and logs hold no secret."""
    env = {**bb_config, "DASK_BLACKBOX__KAFKA__SASL_USERNAME": "user",
           "DASK_BLACKBOX__KAFKA__SASL_PASSWORD": SASL_PASSWORD}
    data_dir = pathlib.Path(env["DASK_BLACKBOX__DATA_DIR"])
    proc = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli", "up", "--timeout", "120"],
                            env=subprocess_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "healthy" in line:
                break
        assert any("healthy" in line for line in lines), "".join(lines) + proc.stderr.read()
        assert not files_with_secrets(data_dir), files_with_secrets(data_dir)
        for args in (["status"], ["query", "SELECT count() FROM blackbox.envelopes"]):
            out = run(env, *args, timeout=120)
            assert out.returncode == 0, (args, out.stderr)
            assert_no_leak(out, data_dir)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    assert not leaks("".join(lines) + rest + err), "".join(lines) + rest + err
    assert not files_with_secrets(data_dir), files_with_secrets(data_dir)


def test_one_redaction_function():
    from dask_blackbox import clickhouse

    assert clickhouse.redact is config.redact
    for text in (f"http://user:{DSN_PASSWORD}@host:8123/db",
                 f"http://u:{DSN_PASSWORD}@x@host:8123",
                 f"http://host:8123/?user=u&password={DSN_PASSWORD}&x=1",
                 f'{{"sasl_password": "{SASL_PASSWORD} with spaces"}}',
                 f"sasl-password: {SASL_PASSWORD}", f"token='{SASL_PASSWORD} x'"):
        assert not leaks(config.redact(text)), config.redact(text)
    assert config.redact("http://host:8123/db") == "http://host:8123/db"


@pytest.mark.parametrize("text", [
    f"pass={DSN_PASSWORD}&x=1",
    f"access_key={DSN_PASSWORD} region=eu",
    f"aws_secret_access_key = {DSN_PASSWORD}",
    f"secret_key: {DSN_PASSWORD}",
    f"password=two {DSN_PASSWORD} words host=db",
    f"http://host:8123/?user=u&password=a {DSN_PASSWORD}&x=1",
    f"http://user:with space {DSN_PASSWORD}@host:8123/db",
    f"http://user:line\n{DSN_PASSWORD}@host:8123/db",
    f'{{"password": "line\n{DSN_PASSWORD} \\"quoted\\" {SASL_PASSWORD}"}}',
    f"password: 'new\nline {DSN_PASSWORD}'",
    f"Authorization: Basic {DSN_PASSWORD}",
    f"authorization=Bearer {DSN_PASSWORD}",
    f'{{"Authorization": "Basic {DSN_PASSWORD}"}}',
])
def test_redact_hides_every_form(text):
    assert not leaks(config.redact(text)), config.redact(text)


def test_redact_keeps_what_is_no_secret():
    for text in ("bypass=1 compass=north", "host=db port=9000", "http://host:8123/db?x=1",
                 "access_key_id=AKIA1", "the tests pass"):
        assert config.redact(text) == text
