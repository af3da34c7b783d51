"""`dask-blackbox up` as a subprocess whose output lines can be awaited (tests of the
local pipeline, of attach() finding it, of Apache Kafka as its broker)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time


class Up:
    """A `dask-blackbox up` subprocess whose output lines can be awaited."""

    def __init__(self, data_dir, *extra, env=None):
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dask_blackbox.cli", "up", "--data-dir", str(data_dir), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
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
        """SIGKILL: the supervisor's children die with it (PR_SET_PDEATHSIG)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self, timeout: float = 60):
        """SIGTERM: a clean stop (drain first), SIGKILL if it takes too long."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop()
