"""`dask-blackbox up`: starts the real pipeline (Tansu, faust, sink on chDB), serves
queries while it runs, and stops with nothing left behind. One `up` per data
directory (a lock), private directories, logs that rotate, readiness judged from this
run's output, and a warning when Tansu's memory grows. (Apache Kafka as the local
broker: tests/integration/test_kafka_broker.py.)"""

from __future__ import annotations

import json
import os
import re
import stat
import signal
import subprocess
import sys

import psutil
import pytest

from dask_blackbox.deploy.brokers import port_open
from dask_blackbox.deploy.supervisor import Child, PipelineError, lock_data_dir
from up_process import Up


def cli(*args, timeout=120, **kwargs):
    return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args],
                          capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture
def up(tmp_path):
    # Directories a careless umask left open to everyone: up makes them private.
    for path in (tmp_path / "data", tmp_path / "data" / "logs", tmp_path / "data" / "clickhouse"):
        path.mkdir(mode=0o755)
        path.chmod(0o755)
    # A threshold Tansu passes at once: the memory warning must come, once.
    running = Up(tmp_path / "data", "--set", "local.tansu-memory-warning=1KiB")
    try:
        running.wait_for("healthy in")
        yield running
    finally:
        running.stop()


def _sink_query_port(data_dir) -> int:
    url = json.loads((data_dir / "sink.json").read_text())["query_url"]
    return int(url.rsplit(":", 1)[1].split("/")[0])


def test_up_serves_queries_and_stops_with_nothing_left(up):
    data_dir = up.data_dir
    kafka_port = int(up.state()["kafka"].rsplit(":", 1)[1])
    query_port = _sink_query_port(data_dir)
    children = psutil.Process(up.proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert "tansu" in names and "dask_blackbox.stream_processors.app" in names and " sink" in names

    # While up runs, the sink owns the chDB directory: queries go through it.
    out = cli("query", "SELECT 1 AS one", "--format", "json", "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"one": 1}]
    status = cli("status", "--data-dir", str(data_dir))
    assert status.returncode == 0, status.stderr
    assert "consumer lag" in status.stdout and "rows per table" in status.stdout
    second = cli("up", "--data-dir", str(data_dir))
    assert second.returncode == 1 and "already runs" in second.stderr
    # Private: the data directory, its logs and the chDB store (0700), though they
    # existed with 0755.
    for path in (data_dir, data_dir / "logs", data_dir / "clickhouse"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    # Tansu's memory passed the threshold: one warning, in the output and the log.
    up.wait_for("tansu-memory-warning")
    assert "--broker kafka" in "".join(up.output)
    assert (data_dir / "logs" / "up.log").read_text().count("tansu-memory-warning") == 1

    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=120) == 0, "".join(up.output)
    assert "stopped" in "".join(up.output)
    assert "".join(up.output).count("tansu-memory-warning=") == 1
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, child
    assert not port_open("127.0.0.1", kafka_port)
    assert not port_open("127.0.0.1", query_port)
    assert not (data_dir / "up.json").exists()

    # With nothing running, the same command opens the chDB directory itself.
    out = cli("query", "SELECT 2 AS two", "--format", "csv", "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["two", "2"]


def test_children_die_with_a_killed_supervisor(up):
    children = psutil.Process(up.proc.pid).children(recursive=True)
    assert children
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphans left: {[' '.join(p.cmdline()) for p in alive]}"


def test_a_second_up_on_a_locked_data_dir_starts_nothing(tmp_path):
    """The lock, not up.json, decides: even before the first `up` wrote its run file."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    held = lock_data_dir(data_dir)
    try:
        out = cli("up", "--data-dir", str(data_dir), "--timeout", "20")
        assert out.returncode == 1
        assert "already runs" in out.stderr and str(os.getpid()) in out.stderr
        assert not (data_dir / "up.json").exists()
        with pytest.raises(PipelineError, match="already runs"):
            lock_data_dir(data_dir)
    finally:
        held.close()
    lock_data_dir(data_dir).close()  # released: the next `up` may start


def _spawn(tmp_path, name, script, max_bytes=10_000):
    import subprocess as sp

    proc = sp.Popen([sys.executable, "-c", script], stdout=sp.PIPE, stderr=sp.STDOUT)
    return Child(name, proc, tmp_path / f"{name}.log", max_bytes)


def test_readiness_is_judged_from_this_runs_output(tmp_path):
    ready = re.compile(r"\[\^Worker\]: Ready")
    log = tmp_path / "worker.log"
    log.write_text("[^Worker]: Ready\n")  # what a previous run left in the log
    quiet = _spawn(tmp_path, "worker", "import time; time.sleep(1)")
    seen = quiet.watch(ready)
    quiet.proc.wait()
    quiet._reader.join(5)
    assert not seen.is_set()
    assert log.read_text().startswith("[^Worker]: Ready")  # appended to, not truncated
    talks = _spawn(tmp_path, "worker", "print('[^Worker]: Ready', flush=True)")
    assert talks.watch(ready).wait(30)


def test_child_logs_rotate_by_size(tmp_path):
    child = _spawn(tmp_path, "chatty", "for i in range(5000): print(f'line {i:05d} ' + 'x' * 40)",
                   max_bytes=20_000)
    child.proc.wait()
    child._reader.join(10)
    files = sorted(p.name for p in tmp_path.glob("chatty.log*"))
    assert files == ["chatty.log", "chatty.log.1", "chatty.log.2"]  # two older files kept
    for name in files:
        assert (tmp_path / name).stat().st_size <= 20_000
    assert (tmp_path / "chatty.log").read_text().splitlines()[-1].startswith("line 04999")
    assert child.log_tail(1).startswith("line 04999")
