"""The smaller ways one tenant could hold the others, on real processes:

- the sink's query server: a long query holds one reader, not every reader (each
  request runs on a chDB client of its own), and a result is bounded in bytes as well
  as rows (``blackbox.query.max-result-bytes``), so a reader cannot make the sink
  hold gigabytes;
- ``up --brokers 99`` is a one-line error before anything starts;
- an endpoint that is not a URL (``http://[::1``) is a one-line error.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from dask_blackbox.read import backends, queries

from conftest import subprocess_env
from sink_support import SinkProcess

#: Runs until max-execution-time stops it (a sum over many numbers, hashed).
LONG = "SELECT sum(sipHash64(number)) FROM numbers(1000000000000000)"  # ended by the limit


@pytest.fixture
def sink(bb_config):
    env = {**bb_config, "DASK_BLACKBOX__QUERY__MAX_EXECUTION_TIME": "30s",
           "DASK_BLACKBOX__QUERY__MAX_RESULT_BYTES": "8MiB"}
    process = SinkProcess(env)
    try:
        process.wait_ready()
        yield process, env
    finally:
        process.terminate()


def _query(env: dict, sql: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "query", sql],
                          env=subprocess_env(env), capture_output=True, text=True, timeout=120)


def test_a_long_query_holds_one_reader_not_all(sink):
    process, env = sink
    backend = backends.running_sink()  # bb_config points this process at it
    assert isinstance(backend, backends.RemoteBackend)
    outcome = {}

    def long_query():
        try:
            backend.query(LONG)
            outcome["long"] = "ran"
        except queries.QueryError as e:
            outcome["long"] = str(e)

    thread = threading.Thread(target=long_query, daemon=True)
    thread.start()
    try:
        thread.join(1.0)  # under way (it runs up to 30s)
        assert thread.is_alive(), outcome
        for i in range(3):  # others' queries are answered while it runs
            out = _query(env, f"SELECT {i} + 1 AS n")
            assert out.returncode == 0 and str(i + 1) in out.stdout, out.stderr
            assert thread.is_alive(), "the long query ended before the others were answered"
    finally:
        thread.join(60)
    assert "TIMEOUT_EXCEEDED" in outcome["long"], outcome


def test_a_result_is_bounded_in_bytes(sink):
    process, env = sink
    # 100 MB in 10k rows (not a constant: ClickHouse counts a constant column once)
    out = _query(env, "SELECT repeat(toString(number % 10), 10000) FROM numbers(10000)")
    assert out.returncode == 1 and "TOO_MANY_ROWS_OR_BYTES" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = _query(env, "SELECT repeat('x', 100) FROM numbers(1000)")
    assert out.returncode == 0
    assert process.proc.poll() is None


@pytest.mark.parametrize("brokers", ["99", "0"])
def test_up_refuses_a_local_cluster_too_large_to_run(tmp_path, brokers):
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "up", "--data-dir",
                          str(tmp_path / "data"), "--broker", "kafka", "--brokers", brokers],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"dask-blackbox: error: blackbox.local.brokers: {brokers} must be 1 to 5")
    assert not (tmp_path / "data" / "kafka-cluster").exists()


def test_an_endpoint_that_is_not_a_url_is_one_line(tmp_path):
    for endpoint in ("http://[::1", "http://127.0.0.1:notaport"):
        out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "exporter", "--set",
                              f"exporter.endpoint={endpoint}", "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out
        [line] = out.stderr.strip().splitlines()
        assert line.startswith("dask-blackbox exporter: error: blackbox.exporter.endpoint:"), line
        assert "is not a URL" in line and "Traceback" not in out.stderr
