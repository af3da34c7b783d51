"""Many processors and many sinks: the rows are a single instance's.

The same recording (real producers' messages, tests/data/sink_corpus.json, under 16
cluster ids) goes through two pipelines on one Apache Kafka broker, on raw topics of
8 partitions: one faust worker and one sink; and two faust workers and two sinks in
their consumer groups, one of each SIGKILLed while they work and started again, then
a third of each joining (a rebalance). Each sink owns a chDB directory of its own
(no ClickHouse server runs here), so the doubled pipeline's history is the union of
its sinks' stores (sinks/loader.py: what a store of its own repairs at start).

What must hold: the union holds exactly the single pipeline's raw rows (every table,
duplicates counted: nothing loaded twice, nothing lost), the same spans with the same
final values, the same prefixes with the same totals, no gaps.
"""

from __future__ import annotations

import asyncio
import collections
import json
import pathlib
import time
import uuid

import clickhouse_connect
import dask
import orjson
import pytest
from aiokafka.errors import KafkaError

from dask_blackbox import contract, kafka
from dask_blackbox.deploy.supervisor import pipeline_lag, sink_drained_groups, wait_drained

from dask_blackbox.testing import replay
from conftest import pipeline_settings, subprocess_env
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.processors import FaustWorker
from dask_blackbox.testing.settings import dask_env
from sink_support import SinkProcess

pytestmark = pytest.mark.slow

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "data" / "sink_corpus.json"
CLUSTERS = 16
#: Seconds without a commit by any group, with messages left, after which a pipeline
#: is taken for stuck: far above a rebalance on a loaded machine (a session timeout
#: of 6 s, commits every few seconds).
STALLED = 120.0
RAW_TABLES = ("envelopes", "transitions", "graphs", "graph_tasks", "events", "spans",
              "lifecycle", "scheduler_metrics", "worker_metrics", "worker_digests", "logs",
              "worker_exits", "drops")


def recording() -> list[tuple[bytes, bytes]]:
    """The corpus's envelopes, once per cluster id (cluster by cluster)."""
    envelopes = []
    for text in json.loads(CORPUS.read_text())[contract.RAW]:
        try:
            decoded = orjson.loads(text)
        except orjson.JSONDecodeError:
            continue
        if type(decoded) is dict:
            envelopes.append(decoded)
    return [replay.encode(replay.renamed(e, f"scaled-{c:02d}", f"@{c}"))
            for c in range(CLUSTERS) for e in envelopes]


class Pipeline:
    """A pipeline of its own (topics, groups) on ``broker``: faust workers and sinks,
    each sink with a data directory (and chDB store) of its own."""

    def __init__(self, broker: str, workdir: pathlib.Path, name: str) -> None:
        self.prefix = name + uuid.uuid4().hex[:6]
        self.workdir = workdir
        self.settings, env = pipeline_settings(broker, self.prefix, workdir / "data")
        extra = {"blackbox.kafka.partitions": 8, "blackbox.processors.session-timeout": "6s",
                 "blackbox.processors.snapshot-interval": "300ms",
                 "blackbox.sink.session-timeout": "6s"}
        self.settings.update(extra)
        self.env = {**env, **dask_env(extra)}
        self.faust: dict[str, FaustWorker] = {}
        self.sinks: dict[str, SinkProcess] = {}
        self._started: set[int] = set()

    def config(self):
        return dask.config.set(self.settings)

    def publish(self, messages) -> None:
        with self.config():
            asyncio.run(kafka.ensure_topics())
            asyncio.run(replay.publish_raw(messages))

    def store(self, name: str) -> pathlib.Path:
        return self.workdir / f"sink-{name}" / "clickhouse"

    def start_sink(self, name: str) -> SinkProcess:
        env = {**self.env, "DASK_BLACKBOX__DATA_DIR": str(self.workdir / f"sink-{name}")}
        sink = self.sinks[name] = SinkProcess(env)
        return sink

    def start_faust(self, name: str) -> FaustWorker:
        worker = self.faust[name] = FaustWorker(subprocess_env(self.env), self.workdir, name=name)
        return worker.start()

    def ready(self) -> None:
        for sink in self.sinks.values():
            if id(sink) not in self._started:
                sink.wait_ready()
                self._started.add(id(sink))
        for worker in self.faust.values():
            wait_for(lambda w=worker: w.stats() is not None, 90, "a faust worker's web page")

    def drain(self) -> None:
        """Wait until every group has committed everything, for as long as some group
        keeps committing: a machine slow to rebalance drains late, a group that stops
        committing with messages left never does (the processors or sinks lost them)."""
        with self.config():
            seen, moved = None, time.monotonic()
            deadline = moved + 900.0  # and a pipeline that never settles fails too
            while not wait_drained(timeout=10.0, settle=2.0):
                try:
                    now = asyncio.run(self.partition_lag())
                except KafkaError as e:  # no coordinator yet, say: no commit seen either
                    now = seen if seen is not None else repr(e)
                if now != seen and time.monotonic() < deadline:
                    seen, moved = now, time.monotonic()
                elif time.monotonic() - moved > STALLED or time.monotonic() > deadline:
                    lag = asyncio.run(pipeline_lag())
                    workers = {name: (w.stats() if w.proc.poll() is None else "exited")
                               for name, w in self.faust.items()}
                    tails = "\n".join(f"--- faust {name}:\n{w.tail(30)}" for name, w in self.faust.items())
                    raise AssertionError(
                        f"{self.prefix} did not drain: no commit for {time.monotonic() - moved:.0f}s "
                        f"with {lag} left; committed and end per partition: {now}; "
                        f"processors: {workers}\n{tails}")

    async def partition_lag(self) -> dict:
        """Each group's committed offsets and the ends, per partition of the topics it reads."""
        from aiokafka import AIOKafkaConsumer, TopicPartition
        settings = kafka.KafkaSettings.from_config()
        admin = await kafka.connect_admin(10, settings)
        consumer = AIOKafkaConsumer(**settings.client_kwargs(), group_id=None)
        await consumer.start()
        try:
            out = {}
            for group, topics in sink_drained_groups().items():
                tps = [TopicPartition(t["topic"], p["partition"])
                       for t in await admin.describe_topics(topics) if t["error_code"] == 0
                       for p in t["partitions"]]
                end = await consumer.end_offsets(tps)
                committed = await admin.list_consumer_group_offsets(group, partitions=tps)
                out[group] = {f"{tp.topic}[{tp.partition}]": (
                    getattr(committed.get(tp), "offset", None), end[tp]) for tp in tps}
            return out
        finally:
            await asyncio.sleep(0)  # aiokafka: stop() before its group task ran raises CancelledError
            await consumer.stop()
            await admin.close()

    def stop(self) -> None:
        for worker in self.faust.values():
            worker.stop()
        for sink in self.sinks.values():
            if sink.proc.poll() is None:
                sink.terminate()

    def history(self) -> dict:
        """Raw rows (sorted reprs, _batch aside), spans' final values and prefixes'
        totals of every store together."""
        raw = collections.defaultdict(list)
        spans, partials, loaded = {}, {}, {}
        for name in self.sinks:
            client = clickhouse_connect.get_client(dsn=f"chdb://{self.store(name)}")
            try:
                for table in RAW_TABLES:
                    rows = client.query(f"SELECT * EXCEPT (_batch) FROM blackbox.{table}").result_rows
                    raw[table] += [repr(r) for r in rows]
                    loaded[name] = loaded.get(name, 0) + len(rows)
                for cluster_id, span_id, version, *values in client.query(
                        "SELECT cluster_id, span_id, version, name, parent_id, enqueued, start, "
                        "stop, duration, nbytes_total, states, all_durations, done "
                        "FROM blackbox.span_state FINAL").result_rows:
                    if (cluster_id, span_id) not in spans or spans[(cluster_id, span_id)][0] < version:
                        spans[(cluster_id, span_id)] = (version, values)
                for partial_id, *values in client.query(
                        "SELECT partial_id, cluster_id, span_id, prefix, finished, durations, "
                        "nbytes, n_erred, max_duration FROM blackbox.prefix_stats FINAL").result_rows:
                    partials[partial_id] = values  # a partial loaded by two sinks counts once
                gaps = client.query("SELECT count() FROM blackbox.gaps").result_rows[0][0]
                assert gaps == 0, f"{name}: {gaps} gaps"
            finally:
                client.close()
        totals: dict = {}
        for cluster_id, span_id, prefix, finished, durations, nbytes, erred, longest in partials.values():
            t = totals.setdefault((cluster_id, span_id, prefix), [collections.Counter(),
                                                                   collections.Counter(), 0, 0, 0.0])
            t[0].update(finished)
            t[1].update({k: round(v * 1e6) for k, v in durations.items()})
            t[2] += nbytes
            t[3] += erred
            t[4] = max(t[4], longest)
        return {"raw": {t: sorted(rows) for t, rows in raw.items()}, "loaded": loaded,
                "spans": {k: v for k, (_, v) in spans.items()},
                "prefixes": {k: (dict(a), dict(b), c, d, e) for k, (a, b, c, d, e) in totals.items()}}


def test_doubled_stages_with_kills_and_a_joiner_load_what_one_instance_loads(kafka_broker,
                                                                             tmp_path):
    messages = recording()
    n = len(messages) // 3  # in order: a producer's envelopes in its seq order
    thirds = [messages[:n], messages[n:2 * n], messages[2 * n:]]
    single = Pipeline(kafka_broker, tmp_path / "single", "one")
    doubled = Pipeline(kafka_broker, tmp_path / "doubled", "two")
    try:
        single.publish(messages)
        doubled.publish(thirds[0])
        single.start_sink("a"), single.start_faust("p1")
        for name in ("a", "b"):
            doubled.start_sink(name)
        for name in ("p1", "p2"):
            doubled.start_faust(name)
        single.ready()
        doubled.ready()
        # Killed while they work, started again with their stores and state.
        wait_for(lambda: (doubled.faust["p1"].stats() or {}).get("envelopes", 0) > 0, 60,
                 "the first processor at work")
        doubled.faust["p1"].kill()
        doubled.sinks["a"].kill()
        doubled.publish(thirds[1])
        doubled.start_faust("p1"), doubled.start_sink("a")
        doubled.ready()
        # A third of each joins: the groups rebalance.
        doubled.start_faust("p3"), doubled.start_sink("c")
        doubled.ready()
        doubled.publish(thirds[2])
        single.drain()
        doubled.drain()
        time.sleep(1.0)
    finally:
        single.stop()
        doubled.stop()
    one, many = single.history(), doubled.history()
    for table in RAW_TABLES:
        assert many["raw"][table] == one["raw"][table], (
            f"{table}: {len(many['raw'][table])} rows in the doubled pipeline's stores, "
            f"{len(one['raw'][table])} in the single one's")
    assert len(one["raw"]["transitions"]) > 1000
    assert many["spans"] == one["spans"] and len(one["spans"]) >= CLUSTERS
    assert many["prefixes"] == one["prefixes"] and one["prefixes"]
    # The doubled pipeline's rows are spread over its sinks' stores.
    assert sum(n > 0 for n in many["loaded"].values()) >= 2, many["loaded"]
