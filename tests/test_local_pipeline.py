"""`dask-blackbox up`: starts the real pipeline (Tansu, faust, sink on chDB), serves
queries while it runs, and stops with nothing left behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from dask_blackbox.cli.tansu import port_open


def cli(*args, timeout=120, **kwargs):
    return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args],
                          capture_output=True, text=True, timeout=timeout, **kwargs)


class Up:
    """A `dask-blackbox up` subprocess whose output lines can be awaited."""

    def __init__(self, data_dir, *extra):
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dask_blackbox.cli", "up", "--data-dir", str(data_dir), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, text, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if text in line:
                return line
        raise AssertionError(f"no {text!r} in up's output:\n{''.join(self.output)}")

    def state(self):
        return json.loads((self.data_dir / "up.json").read_text())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def up(tmp_path):
    running = Up(tmp_path / "data")
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

    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=120) == 0, "".join(up.output)
    assert "stopped" in "".join(up.output)
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
