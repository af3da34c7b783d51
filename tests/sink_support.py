"""Helpers for the sink tests: contract envelopes, publishing them to the real broker,
and running the real sink (``python -m dask_blackbox.cli.sink``) as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import clickhouse_connect
import orjson
from aiokafka import AIOKafkaProducer

from dask_blackbox import config, contract, kafka
from dask_blackbox.read import backends
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import TABLES, Message

TOPICS = contract.TOPICS

from conftest import subprocess_env
from dask_blackbox.testing.kafka_reader import read_records
from dask_blackbox.testing.polling import wait_for


def envelope(events: list[dict], *, cluster_id: str = "c1", cluster_name: str = "test-cluster",
             source: str = "scheduler", producer_id: str = "p1", seq: int = 0,
             sent_at: float | None = None) -> dict:
    """A contract envelope (see dask_blackbox.contract)."""
    return {
        "schema": contract.SCHEMA_VERSION, "cluster_id": cluster_id, "cluster_name": cluster_name,
        "source": source, "producer_id": producer_id, "seq": seq,
        "sent_at": time.time() if sent_at is None else sent_at, "events": events,
    }


def transition(key: str, start: str, finish: str, ts: float, **fields) -> dict:
    return {"kind": contract.TRANSITION, "ts": ts, "key": key, "start": start, "finish": finish,
            "stimulus_id": fields.pop("stimulus_id", f"stim-{ts}"), **fields}


def workload(n_envelopes: int, events_per_envelope: int, *, clusters: int = 2,
             t0: float | None = None, producer: str = "prod") -> list[tuple[bytes, bytes]]:
    """(key, value) Kafka messages: envelopes of transitions, a log line and a
    structured event each, spread over ``clusters`` clusters, every key unique; each
    cluster's from producer ``<producer>-<cluster>``, numbered from seq 0 (the same
    producer and seq with the same counts is a re-sent envelope, loaded once)."""
    t0 = time.time() - 600 if t0 is None else t0
    out = []
    for i in range(n_envelopes):
        cluster = f"cluster-{i % clusters}"
        seq = i // clusters
        events = [
            transition(f"inc-{i}-{j}", "waiting", "processing" if j % 2 else "memory",
                       t0 + i + j / 1000, prefix="inc", group=f"inc-{i}", worker="tcp://w:1",
                       nbytes=8 if j % 2 == 0 else None)
            for j in range(events_per_envelope)
        ]
        events.append({"kind": contract.LOG, "ts": t0 + i, "logger": "distributed.worker",
                       "level": "INFO", "message": f"line {i}", "process": "tcp://w:1"})
        events.append({"kind": contract.EVENT, "ts": t0 + i, "topic": "custom", "msg": {"i": i}})
        env = envelope(events, cluster_id=cluster, cluster_name=f"name-{cluster}",
                       producer_id=f"{producer}-{cluster}", seq=seq, sent_at=t0 + i)
        out.append((cluster.encode(), orjson.dumps(env)))
    return out


async def _produce(topic: str, messages: list[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(**config.kafka_client_kwargs(), acks="all")
    await producer.start()
    try:
        for key, value in messages:
            await producer.send(topic, value, key=key)
        await producer.flush()
    finally:
        await producer.stop()


def produce(messages: list[tuple[bytes | None, bytes]], topic: str = contract.RAW) -> None:
    """Publish (key, value) messages to a contract topic of the current config."""
    asyncio.run(_produce(config.topic(topic), messages))


class SinkProcess:
    """The real sink in a subprocess, with the test's blackbox settings."""

    def __init__(self, bb_env: dict[str, str], **settings: str) -> None:
        env = subprocess_env(bb_env)
        env.update({"DASK_BLACKBOX__SINK__BATCH_MAX_WAIT": "200ms",
                    # Apache Kafka's smallest session timeout (group.min.session.timeout.ms)
                    "DASK_BLACKBOX__SINK__SESSION_TIMEOUT": "6s"})
        for key, value in settings.items():
            env["DASK_BLACKBOX__SINK__" + key.upper()] = value
        self.data_dir = pathlib.Path(bb_env["DASK_BLACKBOX__DATA_DIR"])
        self.log = self.data_dir.parent / f"sink-{uuid.uuid4().hex[:6]}.log"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dask_blackbox.cli.sink"], env=env,
            stdout=subprocess.PIPE, stderr=self._log_file,
        )

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Block until the sink printed its ready line; return it."""
        line = self.proc.stdout.readline().decode()
        if "sink ready" not in line:
            self.proc.wait(timeout)
            raise AssertionError(f"sink did not start (exit {self.proc.returncode}): {line}\n{self.stderr()}")
        return line

    def stderr(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def wait_paused(self, point: str, timeout: float = 60.0) -> None:
        marker = self.data_dir / f"sink-paused-at-{point}"
        wait_for(lambda: marker.exists() or self.proc.poll() is not None, timeout,
                 f"sink to pause at {point}", interval=0.1)
        assert self.proc.poll() is None, f"sink exited before pausing at {point}:\n{self.stderr()}"
        marker.unlink()

    def resume(self, point: str) -> None:
        """Let a sink paused at ``point`` go on."""
        (self.data_dir / f"sink-resume-at-{point}").touch()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log_file.close()

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        finally:
            self.kill()
        return code

    def backend(self) -> backends.RemoteBackend:
        backend = backends.running_sink()
        assert backend is not None, "the sink's query server is not reachable"
        return backend


def count(backend, table: str, final: bool = False) -> int:
    _, rows = backend.query(f"SELECT count() FROM {backend.database}.{table}{' FINAL' if final else ''}")
    return rows[0][0]


def chattr(paths: list[str], flag: str) -> None:
    """Set or clear the immutable attribute (``+i``/``-i``) on directories."""
    subprocess.run(["chattr", flag, *paths], check=True)


def can_chattr(directory: pathlib.Path) -> bool:
    """Whether this process may make a directory immutable here (root, ext4-like fs)."""
    probe = directory / "chattr-probe"
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["chattr", "-i", str(probe)], check=True)
        return ok and os.geteuid() == 0
    finally:
        probe.rmdir()


def lag() -> int:
    """Messages of the blackbox topics the sink's group has not committed yet (the
    ground's measure: partitions come from the broker's topic metadata, which real
    Kafka gives only to those who ask for it)."""
    per_topic = asyncio.run(kafka.consumer_lag(config.get("sink.group-id"),
                                               [config.topic(t) for t in TOPICS]))
    return sum(per_topic.values())


def wait_loaded(timeout: float = 120.0, what: str = "the sink to load everything") -> None:
    """Until the sink's group has committed every message, and still has half a
    second later (a producer's last envelopes may still be on their way)."""
    wait_for(lambda: lag() == 0 and (time.sleep(0.5) or lag() == 0), timeout, what)


def wait_consumed(sink: "SinkProcess", timeout: float = 90.0) -> None:
    """Until the sink's group has committed every message of every blackbox topic."""
    wait_for(lambda: lag() == 0 or sink.proc.poll() is not None, timeout,
             "the sink to commit everything", interval=0.3)
    assert sink.proc.poll() is None, f"the sink exited:\n{sink.stderr()}"


def topic_messages() -> list[Message]:
    """Every message of the blackbox topics, as the sink receives them."""
    out = []
    for topic in TOPICS:
        for r in read_records(topic, idle=0.5):
            out.append(Message(topic, r.topic, r.partition, r.offset, r.key,
                               r.value if r.value is not None else b"", r.timestamp))
    return out


#: Columns a reload legitimately changes: when the sink saw the problem.
VOLATILE = {"dead_letters": {"detected_at"}}
REPLACING = {"span_state", "prefix_stats", "gaps"}


#: The page aggregates ClickHouse's materialized views make of the rows
#: (sinks/sql/006_page_aggregates.sql, 009), merged over the sink batches (batches split
#: differently after a crash): equal when every row was aggregated exactly once.
AGGREGATE_DUMPS = {
    "task_seconds": "SELECT cluster_id, span_id, prefix, start, finish, second, sum(n), min(first_ts), "
                    "max(last_ts) FROM {db}.task_seconds GROUP BY ALL",
    "stream_seconds": "SELECT cluster_id, worker, second, action, prefix, span_id, sender, "
                      "round(sum(busy), 5), sum(started), sum(erred) FROM {db}.stream_seconds GROUP BY ALL",
    "group_totals": "SELECT cluster_id, span_id, task_group, day, uniqExactMerge(keys), uniqExactMerge(memory_keys), sum(memory), "
                    "sum(erred), round(sum(compute_s), 5), round(sum(transfer_s), 5), sum(nbytes), "
                    "min(first_start), max(last_stop) FROM {db}.group_totals GROUP BY ALL",
    "digest_totals": "SELECT cluster_id, worker, context, span_id, prefix, activity, unit, day, "
                     "round(sum(value), 5) FROM {db}.digest_totals GROUP BY ALL",
}


def dump(chdb_dir: pathlib.Path, database: str = "blackbox") -> dict[str, list[str]]:
    """Every row of every table the sink writes (replacing tables as FINAL), without
    _batch, as sorted reprs: equal dumps mean equal contents, duplicates included; and
    the page aggregates merged over the batches (:data:`AGGREGATE_DUMPS`)."""
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    try:
        out = {}
        for table in TABLES:
            excluded = ", ".join(["_batch", *sorted(VOLATILE.get(table, ()))])
            final = " FINAL" if table in REPLACING else ""
            result = client.query(f"SELECT * EXCEPT ({excluded}) FROM {database}.{table}{final}")
            out[table] = sorted(repr(row) for row in result.result_rows)
        for table, sql in AGGREGATE_DUMPS.items():
            out[table] = sorted(repr(row) for row in client.query(sql.format(db=database)).result_rows)
        return out
    finally:
        client.close()


@contextlib.contextmanager
def store(directory: pathlib.Path, group: str = "g"):
    """A chDB store in ``directory`` with the sink's schema: its client and the sink's
    own loader into it (``group``: the loader's consumer group); closed on exit."""
    client = clickhouse_connect.get_client(dsn=f"chdb://{directory}")
    try:
        target = Target("blackbox", 90 * 86400)
        migrate(client, target)
        yield client, Loader(client, target, group)
    finally:
        client.close()


@contextlib.contextmanager
def loaded(directory: pathlib.Path, messages: list[Message]):
    """:func:`store` with ``messages`` loaded in one batch of the loader's schemas:
    its client."""
    with store(directory) as (client, loader):
        batch = Batch(loader.schemas)
        for m in messages:
            batch.add(m)
        assert loader.load(batch, {})
        yield client


def reference_dump(messages: list[Message], directory: pathlib.Path, batch_rows: int = 10_000) -> dict:
    """What a crash-free sink leaves for ``messages``: the sink's own loader, in this
    process, into a fresh chDB directory."""
    with store(directory, "reference") as (client, loader):
        batch = Batch()
        for m in messages:
            batch.add(m)
            if batch.n_rows >= batch_rows:
                loader.load(batch, {})
                batch = Batch()
        if batch.n_messages:
            loader.load(batch, {})
    return dump(directory)


def assert_same_rows(actual: dict, expected: dict) -> None:
    for table in (*TABLES, *AGGREGATE_DUMPS):
        a, e = actual[table], expected[table]
        assert a == e, (f"{table}: {len(a)} rows, expected {len(e)}; extra "
                        f"{sorted(set(a) - set(e))[:3]}, missing {sorted(set(e) - set(a))[:3]}")
