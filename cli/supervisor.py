"""The local pipeline behind ``dask-blackbox up``: broker, stream processors and sink
as child processes of one supervisor.

The supervisor writes ``<data-dir>/up.json`` while it runs, so other commands
(``demo``, ``status``, ``query``, the query commands) find the broker it started.
Children die with the supervisor (``PR_SET_PDEATHSIG``), so even a supervisor killed
with SIGKILL leaves no orphans. A clean stop drains first: the processors finish the
raw topic, the sink loads everything, and only then does the memory-only broker stop,
so nothing Kafka acknowledged is lost.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import dask.config

from dask_blackbox import config, kafka, runfiles
from dask_blackbox.contract import RAW, TOPICS
from dask_blackbox.cli.tansu import broker_command, free_port, port_open

#: Arguments of the two services, shared with infra/docker-compose.yml (a test checks
#: the compose file runs these): ``faust <PROCESSOR_ARGS> [global options] worker
#: [worker options]`` and ``dask-blackbox <SINK_ARGS>``.
PROCESSOR_ARGS = ("-A", "dask_blackbox.stream_processors.app")
SINK_ARGS = ("sink",)

_FAUST_READY = re.compile(r"\[\^Worker\]: Ready")
_PR_SET_PDEATHSIG = 1


class PipelineError(RuntimeError):
    """The local pipeline could not start or stopped unexpectedly; the message says which part."""


def _detach_and_die_with_parent() -> None:
    # Runs in the child between fork and exec. Its own process group: a Ctrl-C in the
    # terminal (SIGINT to the foreground group) reaches only the supervisor, which
    # drains before it stops anything; a broker stopped first would lose what Kafka
    # acknowledged. PDEATHSIG: the kernel SIGTERMs the child when the supervisor dies,
    # however it dies.
    os.setpgid(0, 0)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def prepare_data_dir() -> pathlib.Path:
    """Create the data directory, or raise PipelineError saying why it can't be used."""
    path = config.data_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise PipelineError(
            f"data directory {path} (blackbox.data-dir) is not writable: {e.strerror or e}"
        ) from None
    return path


def running_pipeline() -> dict | None:
    """The state of a live ``up`` using this data directory, or None."""
    return runfiles.read(config.data_dir(), runfiles.UP)


def use_running_pipeline() -> dict | None:
    """Point this process's config at the broker of a live ``up``, if there is one
    and the user did not name a broker explicitly."""
    state = running_pipeline()
    if state is not None:
        dask.config.set({"blackbox.kafka.bootstrap-servers": state["kafka"],
                         "blackbox.kafka.topic-prefix": state["topic_prefix"]})
    return state


def child_env() -> dict[str, str]:
    """The environment of a child: ours, plus our resolved ``blackbox`` config, so
    flags given to the supervisor reach the children."""
    return {
        **os.environ,
        "DASK_INTERNAL_INHERIT_CONFIG": dask.config.serialize(
            {"blackbox": dask.config.get("blackbox")}
        ),
    }


def sink_drained_groups() -> dict[str, list[str]]:
    """Consumer group -> topics it must have fully consumed for the pipeline to be
    drained."""
    return {
        str(config.get("processors.app-id")): [config.topic(RAW)],
        str(config.get("sink.group-id")): [config.topic(t) for t in TOPICS],
    }


async def pipeline_lag() -> dict[str, dict[str, int]]:
    """Uncommitted messages per consumer group and topic."""
    return {
        group: await kafka.consumer_lag(group, topics)
        for group, topics in sink_drained_groups().items()
    }


def wait_drained(timeout: float, settle: float = 1.0) -> bool:
    """Block until every group has committed everything, twice ``settle`` apart
    (derived records produced meanwhile must be loaded too). False on timeout."""
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        try:
            lag = asyncio.run(pipeline_lag())
        except kafka.KafkaUnreachable:
            return False
        if all(v == 0 for topics in lag.values() for v in topics.values()):
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= settle:
                return True
        else:
            quiet_since = None
        time.sleep(0.25)
    return False


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: pathlib.Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalPipeline:
    """Broker (unless ``kafka`` names one), ``processors`` faust workers and a sink."""

    kafka: str | None = None
    processors: int = 1
    children: list[Child] = field(default_factory=list)
    started: float = 0.0

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 60.0, progress=print) -> None:
        """Start every part and wait until each is healthy; PipelineError otherwise
        (after stopping whatever did start)."""
        self.started = time.monotonic()
        data = prepare_data_dir()
        config.clickhouse_dsn()  # a malformed DSN fails here, before anything starts
        if (other := running_pipeline()) is not None:
            raise PipelineError(
                f"a pipeline already runs on {data} (pid {other['pid']}); "
                "stop it first or use another --data-dir"
            )
        (data / "logs").mkdir(exist_ok=True)
        try:
            self._start_broker(data)
            progress(f"kafka      {config.bootstrap_servers()[0]}"
                     + ("" if self.kafka else " (local Tansu broker)"))
            asyncio.run(kafka.ensure_topics(timeout=10))
            self._write_state(data)
            # Sink and processors start side by side; each spends most of its start
            # joining its consumer group.
            sink = self._spawn("sink", [sys.executable, "-m", "dask_blackbox.cli", *SINK_ARGS], data)
            workers = self._spawn_processors(data)
            # The sink describes itself in this file once it serves queries.
            self._wait(sink, timeout, lambda: (runfiles.read(data, runfiles.SINK) or {}).get("pid")
                       == sink.proc.pid)
            progress(f"sink       ready, ClickHouse at {config.clickhouse_dsn()}")
            for w in workers:
                self._wait(w, timeout, lambda w=w: bool(_FAUST_READY.search(w.log_tail(400))))
            progress(f"processors {self.processors} faust worker(s) ready "
                     f"(app {config.get('processors.app-id')})")
        except BaseException:
            self.stop(drain_timeout=0)
            raise

    def _spawn(self, name: str, cmd: list[str], data: pathlib.Path) -> Child:
        log = data / "logs" / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=child_env(), preexec_fn=_detach_and_die_with_parent,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def _start_broker(self, data: pathlib.Path) -> None:
        if self.kafka:
            dask.config.set({"blackbox.kafka.bootstrap-servers": self.kafka})
            return
        port = free_port()
        broker = self._spawn("broker", broker_command(port), data)
        deadline = time.monotonic() + 20
        while not port_open("127.0.0.1", port):
            self._check_alive(broker)
            if time.monotonic() > deadline:
                raise PipelineError(f"the Tansu broker did not listen on port {port}")
            time.sleep(0.02)
        dask.config.set({"blackbox.kafka.bootstrap-servers": f"127.0.0.1:{port}"})

    def _spawn_processors(self, data: pathlib.Path) -> list[Child]:
        workers = []
        for i in range(self.processors):
            workdir = data / "faust" / f"worker-{i}"
            workdir.mkdir(parents=True, exist_ok=True)
            workers.append(self._spawn(f"processor-{i}", [
                sys.executable, "-m", "faust", *PROCESSOR_ARGS,
                "--datadir", str(workdir), "-l", "info",
                "worker", "--web-host", "127.0.0.1", "--web-port", str(free_port()),
            ], data))
        return workers

    def _wait(self, child: Child, timeout: float, ready) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self._check_alive(child)
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"{child.name} was not ready within {timeout:.0f}s; its log "
                    f"({child.log}) ends:\n{child.log_tail()}"
                )
            time.sleep(0.1)

    @staticmethod
    def _check_alive(child: Child) -> None:
        if not child.alive():
            raise PipelineError(
                f"{child.name} exited with code {child.proc.returncode}; its log "
                f"({child.log}) ends:\n{child.log_tail()}"
            )

    def _write_state(self, data: pathlib.Path) -> None:
        state = {
            "pid": os.getpid(),
            "kafka": config.bootstrap_servers()[0],
            "topic_prefix": config.get("kafka.topic-prefix"),
            "clickhouse": config.clickhouse_dsn(),
            "started_at": time.time(),
        }
        runfiles.write(data, runfiles.UP, state)

    # ------------------------------------------------------------------- run
    def failed_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def run_until_signal(self) -> int:
        """Serve until SIGINT/SIGTERM (exit 0) or until a child dies (exit 1)."""
        stop = {"signal": None}

        def on_signal(signum, frame):
            stop["signal"] = signum

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while stop["signal"] is None:
                dead = self.failed_child()
                if dead is not None:
                    print(f"dask-blackbox: error: {dead.name} exited with code "
                          f"{dead.proc.returncode}; see {dead.log}", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            return 0
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # ------------------------------------------------------------------ stop
    def stop(self, drain_timeout: float = 30.0, progress=lambda msg: None) -> bool:
        """Drain (bounded), then stop processors, sink and broker in that order.
        Returns whether the pipeline was fully drained."""
        drained = True
        running = {c.name: c for c in self.children if c.alive()}
        if drain_timeout and "sink" in running:
            progress("draining: waiting until the sink has loaded everything")
            drained = wait_drained(drain_timeout)
        for child in self.children:
            if child.name.startswith("processor"):
                _terminate(child)
        if drain_timeout and "sink" in running:
            # Snapshots the processors published while stopping must be loaded too.
            drained = wait_drained(drain_timeout, settle=0.5) and drained
        for name in ("sink", "broker"):
            for child in self.children:
                if child.name == name:
                    _terminate(child)
        runfiles.remove(config.data_dir(), runfiles.UP)
        return drained


def _terminate(child: Child, timeout: float = 15.0) -> None:
    if child.alive():
        child.proc.terminate()
        try:
            child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
