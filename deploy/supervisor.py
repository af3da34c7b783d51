"""The local pipeline behind ``dask-blackbox up``: broker, stream processors and sink
as child processes of one supervisor.

The broker is Tansu (``blackbox.local.broker: tansu``, the default: in memory, nothing
to install) or Apache Kafka (``--broker kafka``: data under ``<data-dir>/kafka``,
applies retention; see :mod:`dask_blackbox.deploy.brokers`), unless ``--kafka`` names a
broker that runs elsewhere. The topics are created explicitly (never auto-created),
with the retention of ``blackbox.kafka.retention``.

One supervisor per data directory: ``up`` holds an exclusive ``flock`` on
``<data-dir>/up.lock`` for as long as it runs, so a second ``up`` on the same
directory fails at once, whatever the timing. While it runs it writes
``<data-dir>/up.json``, so other commands (``demo``, ``status``, ``query``, the query
commands, the producers) find the broker it started. The data directory, its
``logs/`` and the chDB store are readable by their owner only (0700: created so, and
an existing one's mode is fixed).

Children write to pipes the supervisor reads: each child's lines go to
``<data-dir>/logs/<child>.log``, rotated at ``blackbox.local.log-max-bytes`` (two older
files kept), and readiness is judged from the lines of this run only (never from a
previous run's log). Supervisor messages (the Tansu memory warning) also go to
``logs/up.log``. On Tansu, ``up`` warns once when the broker's memory passes
``blackbox.local.tansu-memory-warning``: Tansu keeps everything it ever received.

Children die with the supervisor (``PR_SET_PDEATHSIG``), so even a supervisor killed
with SIGKILL leaves no orphans. A clean stop drains first: the processors finish the
raw topic, the sink loads everything, and only then does the broker stop, so nothing
Kafka acknowledged is lost (the memory-only Tansu loses everything when it stops).

``up`` supervises (:meth:`LocalPipeline.run_until_signal`): a child that exits is
started again, after a backoff (:data:`RESTART_BACKOFF`: 1 s, doubling up to 30 s,
back to 1 s once a child ran a minute), with one line on stderr (and in
``logs/up.log``) when it died, how, and when it restarts, and one when it is ready
again. The broker and its port outlive a processor or sink restart, so what Kafka
acknowledged waits there: a restarted sink repairs and resumes its journal
(:mod:`dask_blackbox.sinks.loader`), a restarted faust worker rebuilds its clusters
from the changelog and reads again what it had not committed
(:mod:`dask_blackbox.stream_processors.processor`). A broker that exits is started
again on the same port and its topics created again (Tansu comes back empty: what
it held and the sink had not loaded is lost, and ``up`` says so). A stop always
drains what can be drained: a sink or processor down at that moment (waiting for its
restart) is started at once, and the drain waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import fcntl
import functools
import logging
import logging.handlers
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

import dask.config
from dask.utils import format_bytes

from dask_blackbox import config, kafka, runfiles
from dask_blackbox.contract import RAW, TOPICS
from dask_blackbox.deploy import brokers
from dask_blackbox.deploy.brokers import BrokerError, LocalBroker, free_port

#: Arguments of the two services, shared with infra/docker-compose.yml (a test checks
#: the compose file runs these): ``faust <PROCESSOR_ARGS> [global options] worker
#: [worker options]`` and ``dask-blackbox <SINK_ARGS>``.
PROCESSOR_ARGS = ("-A", "dask_blackbox.stream_processors.app")
SINK_ARGS = ("sink",)
#: The continuous OpenTelemetry exporter, run when blackbox.exporter.endpoint is set.
EXPORTER_ARGS = ("exporter",)
_EXPORTER_READY = re.compile(r"^exporter ready")

_FAUST_READY = re.compile(r"\[\^Worker\]: Ready")
_ALERTS_READY = re.compile(r"^dask-blackbox alerts: ready")


def alert_rules() -> tuple:
    """The alert rules configured (validated: a bad rule is a ConfigError naming it)."""
    from dask_blackbox.alerts.settings import AlertSettings, rules_configured

    return AlertSettings.from_config().rules if rules_configured() else ()
_PR_SET_PDEATHSIG = 1

#: Seconds before a dead child is started again: the first, the longest (each restart
#: doubles it), and how long a child must have run for the next death to count as a
#: first one again.
RESTART_BACKOFF = (1.0, 30.0, 60.0)


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


_private_dir = runfiles.private_dir


def prepare_data_dir() -> pathlib.Path:
    """Create the data directory (0700), or raise PipelineError saying why it can't be used."""
    path = config.data_dir()
    try:
        _private_dir(path)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise PipelineError(
            f"data directory {path} (blackbox.data-dir) is not writable: {e.strerror or e}"
        ) from None
    return path


LOCK = "up.lock"


def lock_data_dir(data: pathlib.Path) -> TextIO:
    """Hold the exclusive lock of one ``up`` on ``data`` (an open file; the lock goes
    when it is closed or the process dies), or PipelineError if another holds it."""
    f = open(data / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise PipelineError(
            f"a pipeline already runs on {data} (pid {holder}); "
            "stop it first or use another --data-dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


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


class Child:
    """A child process whose output the supervisor reads: into a size-rotated log
    file, and into memory (the last lines, and the patterns seen in this run)."""

    def __init__(self, name: str, proc: subprocess.Popen, log: pathlib.Path,
                 max_bytes: int, restarts: int = 0) -> None:
        self.name, self.proc, self.log = name, proc, log
        #: when it was started (monotonic), and how many children of this name
        #: died and were replaced before it
        self.began, self.restarts = time.monotonic(), restarts
        self.recent: collections.deque[str] = collections.deque(maxlen=200)
        self._watches: list[tuple[re.Pattern, threading.Event]] = []
        self._seen: dict[re.Pattern, threading.Event] = {}
        self._lock = threading.Lock()
        self._handler = logging.handlers.RotatingFileHandler(
            log, maxBytes=max_bytes, backupCount=2, encoding="utf-8", delay=True)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._reader = threading.Thread(target=self._pump, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None, "a child's output is a pipe (stdout=PIPE)"
        for raw in stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self.recent.append(line)
                watches = list(self._watches)
            for pattern, seen in watches:
                if not seen.is_set() and pattern.search(line):
                    seen.set()
            self._handler.emit(logging.makeLogRecord({"msg": line, "args": None}))
        stdout.close()
        self._handler.close()

    def watch(self, pattern: re.Pattern) -> threading.Event:
        """An event set once a line of this run's output matches ``pattern``."""
        seen = threading.Event()
        with self._lock:
            if any(pattern.search(line) for line in self.recent):
                seen.set()
            self._watches.append((pattern, seen))
        return seen

    def seen(self, pattern: re.Pattern) -> bool:
        """Whether a line of this run's output matched ``pattern`` (watched from the
        first call on, and in the lines kept from before it)."""
        if pattern not in self._seen:
            self._seen[pattern] = self.watch(pattern)
        return self._seen[pattern].is_set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines this child printed in this run."""
        if not self.alive():
            self._reader.join(2)
        with self._lock:
            return "\n".join(list(self.recent)[-lines:])


@dataclass(frozen=True)
class Recipe:
    """How to start one child, again after it died: its ``command`` and ``env``
    (called at each start), and ``ready``: whether a started child serves."""

    name: str
    command: Callable[[], list[str]]
    env: Callable[[], dict[str, str] | None] | None = None
    ready: Callable[[Child], bool] | None = None


def describe_exit(code: int | None) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL``."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class LocalPipeline:
    """Broker (unless ``kafka`` names one; ``broker``: tansu or kafka, default
    ``blackbox.local.broker``), ``processors`` faust workers and a sink."""

    kafka: str | None = None
    processors: int = 1
    broker: str | None = None
    #: brokers of the local Kafka (None: ``blackbox.local.brokers``); more than one is
    #: a KafkaCluster, each node a child ``broker-<id>``
    brokers: int | None = None
    children: list[Child] = field(default_factory=list)
    started: float = 0.0
    local_broker: LocalBroker | None = None
    #: the open ``up.lock`` whose flock this supervisor holds
    _lock: TextIO | None = None
    _log: logging.Logger | None = None
    _memory_warned: bool = False
    _sigterm: int | None = None
    #: the SIGTERM handler ours replaced, restored when stopping (None: none to restore)
    _previous_sigterm: Callable[[int, FrameType | None], Any] | int | signal.Handlers | None = None
    _starting: bool = False
    _data: pathlib.Path | None = None
    #: how to start each child again, by name
    _recipes: dict = field(default_factory=dict)
    #: dead children: name -> when it starts again (monotonic)
    _due: dict = field(default_factory=dict)
    #: name -> the backoff before its next restart
    _backoff: dict = field(default_factory=dict)
    #: names of restarted children not yet seen ready
    _unready: set = field(default_factory=set)
    #: the local broker process of each broker child, by the child's name
    _broker_nodes: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 60.0, progress=print) -> None:
        """Start every part and wait until each is healthy; PipelineError otherwise
        (after stopping whatever did start)."""
        self.started = time.monotonic()
        self._catch_sigterm()
        try:
            data = self._data = prepare_data_dir()
            config.clickhouse_dsn()  # a malformed DSN fails here, before anything starts
            alert_rules()  # and so does a bad alert rule
            self._max_bytes = config.get_bytes("local.log-max-bytes")
            self._lock = lock_data_dir(data)
        except BaseException:
            self._release_sigterm()
            raise
        try:
            _private_dir(data / "logs")
            self._log = _supervisor_log(data / "logs" / "up.log", self._max_bytes)
            if (chdb := config.chdb_path(config.clickhouse_dsn())) is not None:
                _private_dir(chdb)
            self._start_broker(data, progress)
            asyncio.run(kafka.ensure_topics(timeout=30))
            self._write_state(data)
            # Sink and processors start side by side; each spends most of its start
            # joining its consumer group.
            sink = self._start(Recipe(
                "sink", lambda: [sys.executable, "-m", "dask_blackbox.cli", *SINK_ARGS],
                ready=_sink_loading))
            workers = self._spawn_processors(data)
            # The sink describes itself in sink.json; ready means it loads.
            self._wait(sink, timeout, lambda: _sink_loading(sink))
            progress("sink       ready, ClickHouse at")
            progress(f"             {config.redact(config.clickhouse_dsn())}")
            for w in workers:
                self._wait(w, timeout, lambda w=w: _faust_ready(w))
            progress(f"processors {self.processors} faust worker(s) ready "
                     f"(app {config.get('processors.app-id')})")
            if config.get("exporter.endpoint", None):
                exporter = self._start(Recipe(
                    "exporter", lambda: [sys.executable, "-m", "dask_blackbox.cli", *EXPORTER_ARGS],
                    ready=_exporter_ready))
                self._wait(exporter, timeout, lambda: _exporter_ready(exporter))
                progress(f"exporter   OpenTelemetry traces to "
                         f"{config.display_url(config.get('exporter.endpoint'))}")
            if alert_rules():  # the alerter, when there is something to alert on
                alerts = self._start(Recipe(
                    "alerts", lambda: [sys.executable, "-m", "dask_blackbox.cli", "alerts"],
                    ready=_alerts_ready))
                self._wait(alerts, timeout, lambda: _alerts_ready(alerts))
                progress(f"alerts     {len(alert_rules())} rule(s), log {alerts.log}")
            self._starting = False
        except BaseException:
            self.stop(drain_timeout=0)
            raise

    def _catch_sigterm(self) -> None:
        # From the first moment: a SIGTERM while starting stops what started (no
        # orphans, no half-started broker); one right after the start (before
        # run_until_signal) still drains and stops cleanly.
        self._starting = True
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum, frame):
            self._sigterm = signum
            if self._starting:
                raise PipelineError("stopped by SIGTERM while starting")

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _release_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _start(self, recipe: Recipe, restarts: int = 0) -> Child:
        """Start the child ``recipe`` describes (replacing a dead one of its name)."""
        self._recipes[recipe.name] = recipe
        env = recipe.env() if recipe.env is not None else None
        assert self._data is not None, "children start once start() prepared the data directory"
        proc = subprocess.Popen(
            recipe.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env or child_env(),
            preexec_fn=_detach_and_die_with_parent,
        )
        child = Child(recipe.name, proc, self._data / "logs" / f"{recipe.name}.log",
                      self._max_bytes, restarts)
        for i, old in enumerate(self.children):
            if old.name == recipe.name:
                self.children[i] = child
                break
        else:
            self.children.append(child)
        return child

    def _start_broker(self, data: pathlib.Path, progress) -> None:
        if self.kafka:
            dask.config.set({"blackbox.kafka.bootstrap-servers": self.kafka})
            progress(f"kafka      {config.bootstrap_servers()[0]}")
            return
        try:
            broker = self.local_broker = brokers.from_config(data, self.broker, size=self.brokers)
            broker.prepare()
            nodes = {"broker": broker}
            if isinstance(broker, brokers.KafkaCluster):
                nodes = {f"broker-{node.node_id}": node for node in broker.nodes}
                # Every topic replicated on 3 brokers; acks=all waits for 2.
                dask.config.set({"blackbox.kafka.replication-factor": broker.quorum.replicas,
                                 "blackbox.kafka.min-insync-replicas": broker.quorum.min_insync})
            started = [(node, self._start(Recipe(name, node.command, node.env)))
                       for name, node in nodes.items()]
            self._broker_nodes = nodes
            for node, child in started:
                node.wait_ready(child.proc, timeout=90, log_tail=lambda c=child: c.log_tail(60))
        except BrokerError as e:
            raise PipelineError(str(e)) from None
        dask.config.set({"blackbox.kafka.bootstrap-servers": broker.address})
        where = f", data in {broker.data_dir}" if broker.persistent else ", in memory"
        progress(f"kafka      {broker.address} (local {broker.describe()} broker{where})")

    def _spawn_processors(self, data: pathlib.Path) -> list[Child]:
        workers = []
        for i in range(self.processors):
            _private_dir(data / "faust")
            workdir = data / "faust" / f"worker-{i}"
            _private_dir(workdir)
            workers.append(self._start(Recipe(
                f"processor-{i}", functools.partial(_processor_command, workdir),
                ready=_faust_ready)))
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
            "kafka": ",".join(config.bootstrap_servers()),
            "broker": self.local_broker.kind if self.local_broker else "external",
            "topic_prefix": config.get("kafka.topic-prefix"),
            "clickhouse": config.redact(config.clickhouse_dsn()),
            "started_at": time.time(),
        }
        runfiles.write(data, runfiles.UP, state)

    def broker_child(self) -> Child | None:
        return next((c for c in self.children if c.name == "broker"), None)

    def check_broker_memory(self, progress=print) -> bool:
        """On Tansu, warn once (``progress`` and logs/up.log) when the broker's RSS
        passes ``blackbox.local.tansu-memory-warning``. Returns whether it warned now."""
        child = self.broker_child()
        if (self._memory_warned or child is None
                or self.local_broker is None or self.local_broker.kind != "tansu"):
            return False
        try:
            import psutil

            rss = psutil.Process(child.proc.pid).memory_info().rss
        except Exception:
            return False
        limit = config.get_bytes("local.tansu-memory-warning")
        if rss < limit:
            return False
        self._memory_warned = True
        message = (
            f"warning: the Tansu broker uses {format_bytes(rss)} (more than "
            f"blackbox.local.tansu-memory-warning={format_bytes(limit)}): Tansu keeps "
            "everything it ever received until it stops. For long runs use Apache Kafka, "
            "which applies retention: `dask-blackbox up --broker kafka` (or set "
            "blackbox.local.broker: kafka; needs Java 17+ and blackbox.local.kafka-home)"
        )
        progress(message)
        if self._log is not None:
            self._log.warning(message)
        return True

    # ------------------------------------------------------------------- run
    def run_until_signal(self) -> int:
        """Serve until SIGINT/SIGTERM (then 0), supervising: a child that dies is
        started again (see the module docstring)."""
        def on_signal(signum, frame):
            self._sigterm = signum

        # One flag, set by this handler or by start's (a SIGTERM right after the
        # start): a signal is never lost between the two.
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        next_memory_check = 0.0
        try:
            while self._sigterm is None:
                self.supervise(self._say)
                if time.monotonic() >= next_memory_check:
                    self.check_broker_memory(
                        lambda m: print(f"dask-blackbox: {m}", file=sys.stderr, flush=True))
                    next_memory_check = time.monotonic() + 5.0
                time.sleep(0.2)
            return 0
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _say(self, message: str) -> None:
        """One line on stderr and in logs/up.log."""
        print(f"dask-blackbox: {message}", file=sys.stderr, flush=True)
        if self._log is not None:
            self._log.warning(message)

    def supervise(self, say=print) -> None:
        """One round of supervision: note the children that died (``say`` one line
        each, with the backoff before their restart), start those whose backoff
        passed, and ``say`` when a restarted one is ready."""
        now = time.monotonic()
        for child in list(self.children):
            name = child.name
            if not child.alive() and name not in self._due:
                first, longest, steady = RESTART_BACKOFF
                ran = now - child.began
                backoff = first if ran >= steady else min(longest, self._backoff.get(name, first / 2) * 2)
                self._backoff[name] = backoff
                self._due[name] = now + backoff
                self._unready.discard(name)
                lost = (" (Tansu keeps nothing: what it held and the sink had not loaded is "
                        "lost)" if name == "broker" and self.local_broker is not None
                        and not self.local_broker.persistent else "")
                say(f"{name} {describe_exit(child.proc.returncode)} after {ran:.0f}s{lost}; "
                    f"restarting it in {backoff:.0f}s (restart {child.restarts + 1}; its log: "
                    f"{child.log})")
            elif name in self._due and now >= self._due[name]:
                self._restart(child, say)
            elif name in self._unready and child.alive():
                recipe = self._recipes[name]
                if recipe.ready is None or recipe.ready(child):
                    self._unready.discard(name)
                    say(f"{name} ready again (pid {child.proc.pid}, restart {child.restarts})")

    def _restart(self, dead: Child, say) -> Child:
        del self._due[dead.name]
        child = self._start(self._recipes[dead.name], dead.restarts + 1)
        if dead.name in self._broker_nodes:
            try:
                self._broker_nodes[dead.name].wait_ready(child.proc, timeout=90,
                                                         log_tail=lambda: child.log_tail(60))
                asyncio.run(kafka.ensure_topics(timeout=30))
            except (BrokerError, kafka.KafkaUnreachable) as e:
                say(f"broker did not come back: {e}")
                return child  # its death is noted next round
        say(f"{dead.name} restarted (pid {child.proc.pid})")
        self._unready.add(dead.name)
        return child

    def _revive_for_drain(self, timeout: float, progress) -> None:
        """Start at once every sink or processor that is down (waiting for its
        restart), and wait (up to ``timeout``) until each is ready: a drain needs
        them."""
        nodes = [c for c in self.children if c.name in self._broker_nodes]
        if nodes and not any(c.alive() for c in nodes):
            return
        revived = []
        for child in list(self.children):
            if child.name not in self._broker_nodes and not child.alive():
                self._due.pop(child.name, None)
                progress(f"{child.name} is down; starting it to drain")
                revived.append(self._start(self._recipes[child.name], child.restarts + 1))
        deadline = time.monotonic() + timeout
        for child in revived:
            ready = self._recipes[child.name].ready
            while ready is not None and child.alive() and not ready(child) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)

    # ------------------------------------------------------------------ stop
    def stop(self, drain_timeout: float = 30.0, progress=lambda msg: None) -> bool:
        """Drain (bounded), then stop processors, sink and broker in that order.
        Returns whether the pipeline was fully drained."""
        drained = True
        if drain_timeout:
            self._revive_for_drain(drain_timeout, progress)
        running = {c.name: c for c in self.children if c.alive()}
        if drain_timeout and self._broker_nodes and not set(self._broker_nodes) & set(running):
            progress("the broker is gone: nothing left to drain")
            drained = False
        elif drain_timeout and "sink" in running:
            progress("draining: waiting until the sink has loaded everything")
            drained = wait_drained(drain_timeout)
        for child in self.children:
            if child.name.startswith("processor"):
                _terminate(child)
        if drain_timeout and "sink" in running:
            # Snapshots the processors published while stopping must be loaded too.
            drained = wait_drained(drain_timeout, settle=0.5) and drained
        for name in ("exporter", "alerts", "sink"):
            for child in self.children:
                if child.name == name:
                    _terminate(child, timeout=15.0)
        nodes = [c for c in self.children if c.name in self._broker_nodes]
        for child in nodes:  # every broker at once: none waits for another to go
            if child.alive():
                child.proc.terminate()
        for child in nodes:
            # Kafka's clean shutdown closes its logs (no recovery next start).
            _terminate(child, timeout=60.0)
        for child in self.children:
            child._reader.join(5)
        runfiles.remove(config.data_dir(), runfiles.UP)
        if self._log is not None:
            for handler in self._log.handlers:
                handler.close()
            self._log.handlers.clear()
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None
        self._release_sigterm()
        return drained


def _supervisor_log(path: pathlib.Path, max_bytes: int) -> logging.Logger:
    log = logging.getLogger(f"dask_blackbox.up.{id(path)}")
    log.propagate = False
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=2,
                                                   encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return log


def _processor_command(workdir: pathlib.Path) -> list[str]:
    """The command of a faust worker keeping its state in ``workdir``."""
    return [
        sys.executable, "-m", "faust", *PROCESSOR_ARGS,
        "--datadir", str(workdir), "-l", "info",
        # a fresh web port at each start: the old one may linger
        "worker", "--web-bind", "127.0.0.1", "--web-host", "127.0.0.1",
        "--web-port", str(free_port()),
    ]


def _terminate(child: Child, timeout: float = 15.0) -> None:
    brokers.terminate(child.proc, timeout)


def _sink_loading(child: Child) -> bool:
    """The sink ``child`` wrote sink.json and loads (its partitions prepared)."""
    info = runfiles.read(config.data_dir(), runfiles.SINK) or {}
    return info.get("pid") == child.proc.pid and info.get("loading") is True


def _faust_ready(child: Child) -> bool:
    """The faust worker ``child`` printed its Ready line in this run."""
    return child.seen(_FAUST_READY)


def _exporter_ready(child: Child) -> bool:
    """The exporter ``child`` printed its ready line in this run."""
    return child.seen(_EXPORTER_READY)


def _alerts_ready(child: Child) -> bool:
    """The alerter ``child`` printed its ready line in this run."""
    return child.seen(_ALERTS_READY)
