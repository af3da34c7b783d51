"""The continuous exporter on a recorder many teams share: what one team's cluster
sends never stops the export of anyone's. A real ``dask-blackbox exporter`` reads
envelopes planted on the session broker's raw topic and sends to the real
OpenTelemetry Collector of infra/otel with its default limits (its gRPC receiver
takes 4 MiB a request):

- log records at the producers' caps (16 KiB message, 16 KiB traceback), hundreds of
  them, and a task with a 100 KB key all reach the Collector over gRPC, each once:
  the exporter caps a request by bytes; with the cap raised over the Collector's
  limit, the requests the Collector refuses are split until they pass;
- an item bigger than any request the Collector takes is set aside (counted on
  /metrics, one line), and the items after it go;
- a receiver that takes traces only (404 on /v1/logs) gets every span once: one
  line says it takes no logs, and no log request follows;
- an endpoint's credentials, path and headers are printed nowhere (the ready line,
  the run file, failure lines), and an endpoint ending in ``/v1/traces`` is not
  doubled.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections import Counter

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from dask_blackbox import config, contract

from dask_blackbox.testing.polling import wait_for
from sink_support import envelope
from test_export_continuous import ExporterProcess

#: The producers' caps on a log record's message and traceback.
CAP = 16 * 1024


def _log(i: int, ts: float) -> dict:
    return {"kind": contract.LOG, "ts": ts, "logger": "distributed.worker", "level": "WARNING",
            "message": f"warning {i:04d} " + "m" * (CAP - 13), "process": "tcp://w:1",
            "exc_text": "t" * CAP}


def _task(key: str, ts: float) -> dict:
    return {"kind": contract.TRANSITION, "ts": ts, "key": key, "start": "processing",
            "finish": "memory", "stimulus_id": f"s-{ts}", "prefix": "inc", "worker": "tcp://w:1",
            "startstops": [{"action": "compute", "start": ts - 0.5, "stop": ts}]}


def plant(events: list[dict], per_envelope: int, cluster: str = "team-a", first_seq: int = 0) -> None:
    """``events`` on the raw topic, ``per_envelope`` to an envelope, in order, from
    the cluster's scheduler (envelope numbers from ``first_seq``)."""
    messages = []
    for seq, start in enumerate(range(0, len(events), per_envelope), first_seq):
        env = envelope(events[start:start + per_envelope], cluster_id=cluster,
                       cluster_name=cluster, producer_id=f"{cluster}-scheduler", seq=seq)
        messages.append((cluster.encode(), orjson.dumps(env)))

    async def send() -> None:
        producer = AIOKafkaProducer(**config.kafka_client_kwargs(), acks="all",
                                    max_request_size=16 * 2**20)
        await producer.start()
        try:
            for key, value in messages:
                await producer.send(config.topic(contract.RAW), value, key=key)
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(send())


def _bodies(collector) -> Counter:
    return Counter(l["body"]["stringValue"][:12] for l in collector.logs())


def _settings(collector, protocol: str, tmp_path, **more) -> dict:
    endpoint = collector.grpc_endpoint if protocol == "grpc" else collector.http_endpoint
    more.setdefault("endpoint", endpoint)
    return dict(protocol=protocol, group_id=f"exporter-{tmp_path.name}",
                timeout="3s", retry_backoff_max="1s", metrics_port=0, **more)


@pytest.mark.parametrize("batch_max_bytes", ["3MiB", "64MiB"])
def test_long_logs_over_grpc_pass_the_collectors_default_limit(bb_config, otel_collector,
                                                               tmp_path, batch_max_bytes):
    """400 log records at the caps are 13 MB, a 100 KB key one span: the default cap
    sends them within the Collector's 4 MiB; a cap raised to 64 MiB has the
    Collector refuse (RESOURCE_EXHAUSTED), and the refused requests are split."""
    collector = otel_collector()
    now = time.time() - 60
    events = [_log(i, now + i / 1000) for i in range(400)]
    events.insert(200, _task("k" * 100_000, now + 0.2))
    events.append(_task("small", now + 1))
    plant(events, per_envelope=20)
    exporter = ExporterProcess(bb_config, tmp_path / "data", tmp_path / "exporter.log",
                               **_settings(collector, "grpc", tmp_path,
                                           batch_max_bytes=batch_max_bytes))
    try:
        wait_for(lambda: sum(_bodies(collector).values()) >= 400 and len(collector.spans()) >= 2,
                 180, "every log record and both task spans at the Collector")
        wait_for(lambda: exporter.value("dask_blackbox_export_backlog") == 0, 60, "an empty backlog")
        bodies = _bodies(collector)
        assert bodies == Counter(f"warning {i:04d}" for i in range(400))  # each once
        spans = collector.spans()
        assert sorted(len(s["attributes"]["dask.task.key"]) for s in spans) == [5, 100_000]
        assert exporter.value("dask_blackbox_exported_logs_total") == 400
        assert exporter.value("dask_blackbox_export_set_aside_total") == 0
        log = (tmp_path / "exporter.log").read_text()
        if batch_max_bytes == "3MiB":
            assert exporter.value("dask_blackbox_export_failures_total") == 0, log
        else:
            assert "RESOURCE_EXHAUSTED" in log and "at a time" in log, log
        assert exporter.terminate() == 0
    finally:
        exporter.kill()


@pytest.mark.parametrize("batch_max_bytes", ["3MiB", "64MiB"])
def test_an_item_no_request_can_hold_is_set_aside(bb_config, otel_collector, tmp_path,
                                                  batch_max_bytes):
    """A task whose key is 5 MB: over the exporter's cap (3 MiB) it is refused before
    it is sent, over the Collector's (cap 64 MiB) by the Collector; either way it is
    set aside, alone, and every span after it is exported."""
    collector = otel_collector()
    now = time.time() - 60
    events = [_task(f"before-{i}", now + i / 100) for i in range(5)]
    events.append(_task("h" * 5_000_000, now + 0.1))
    events += [_task(f"after-{i}", now + 0.2 + i / 100) for i in range(5)]
    plant(events, per_envelope=1)
    data = tmp_path / "data"
    exporter = ExporterProcess(bb_config, data, tmp_path / "exporter.log",
                               **_settings(collector, "grpc", tmp_path,
                                           batch_max_bytes=batch_max_bytes))
    try:
        wait_for(lambda: exporter.value("dask_blackbox_export_set_aside_total") == 1, 120,
                 "the huge span set aside")
        spans = collector.wait_spans(10)
        keys = Counter(s["attributes"]["dask.task.key"] for s in spans)
        assert keys == Counter([f"before-{i}" for i in range(5)] + [f"after-{i}" for i in range(5)])
        wait_for(lambda: exporter.value("dask_blackbox_export_backlog") == 0, 60, "an empty backlog")
        log = (tmp_path / "exporter.log").read_text()
        assert log.count("set aside") == 1, log
        [line] = [l for l in log.splitlines() if "set aside" in l]
        assert "hhhh" not in line and len(line) < 600
        db = sqlite3.connect(data / "exporter" / "journal.sqlite")
        [(kind, reason)] = db.execute("SELECT kind, reason FROM set_aside").fetchall()
        db.close()
        assert kind == "span" and ("batch-max-bytes" in reason or "RESOURCE_EXHAUSTED" in reason)
        assert exporter.terminate() == 0
    finally:
        exporter.kill()


def test_a_receiver_that_takes_no_logs_gets_every_span_once(bb_config, otel_collector, tmp_path):
    """A Collector with a traces pipeline only answers 404 on /v1/logs (as Jaeger
    does): spans and log records are acknowledged apart, so every span arrives once,
    and one line says the receiver takes no logs."""
    collector = otel_collector(signals=("traces",))
    now = time.time() - 60
    events = []
    for i in range(5):
        events += [_task(f"task-{i}", now + i), _log(i, now + i + 0.5)]
    plant(events, per_envelope=2)
    exporter = ExporterProcess(bb_config, tmp_path / "data", tmp_path / "exporter.log",
                               **_settings(collector, "http/protobuf", tmp_path))
    try:
        spans = collector.wait_spans(5)
        wait_for(lambda: exporter.value("dask_blackbox_export_backlog") == 0, 60, "an empty backlog")
        plant([_task("later", now + 10), _log(99, now + 10.5)], per_envelope=2, first_seq=5)
        spans = collector.wait_spans(6)
        wait_for(lambda: exporter.value("dask_blackbox_export_backlog") == 0, 60, "an empty backlog")
        keys = Counter(s["attributes"]["dask.task.key"] for s in spans)
        assert keys == Counter([f"task-{i}" for i in range(5)] + ["later"])  # each once
        log = (tmp_path / "exporter.log").read_text()
        assert log.count("takes no logs") == 1 and "404" in log, log
        assert exporter.value("dask_blackbox_export_failures_total") == 1
        assert exporter.value("dask_blackbox_exported_logs_total") == 0
        assert exporter.terminate() == 0
    finally:
        exporter.kill()


def test_an_endpoints_secrets_are_never_printed(bb_config, otel_collector, tmp_path):
    secret = "s3cr3t-Pa55"
    collector = otel_collector()
    endpoint = f"http://alice:{secret}@127.0.0.1:{collector.http_port}/v1/traces"
    now = time.time() - 60
    plant([_task("first", now)], per_envelope=1)
    data = tmp_path / "data"
    exporter = ExporterProcess(bb_config, data, tmp_path / "exporter.log",
                               **_settings(collector, "http/protobuf", tmp_path, logs="false",
                                           endpoint=endpoint,
                                           headers=repr({"authorization": f"Bearer {secret}"})))
    try:
        assert exporter.ready_line.startswith(
            f"exporter ready: http://127.0.0.1:{collector.http_port} "), exporter.ready_line
        spans = collector.wait_spans(1)  # /v1/traces was not doubled
        assert [s["attributes"]["dask.task.key"] for s in spans] == ["first"]
        collector.stop()
        plant([_task("second", now + 1)], per_envelope=1, first_seq=1)
        wait_for(lambda: exporter.value("dask_blackbox_export_failures_total") >= 2, 60,
                 "failed requests while the Collector is down")
        log = (tmp_path / "exporter.log").read_text()
        assert "did not take" in log
        printed = exporter.ready_line + log + (data / "exporter.json").read_text()
        assert secret not in printed and "alice" not in printed, printed
        assert exporter.terminate() == 0
    finally:
        exporter.kill()


def test_export_otlp_to_a_receiver_that_takes_no_logs(recorded_run, otel_collector):
    """``dask-blackbox export otlp`` of a recorded run to a receiver of traces only:
    the trace is exported, one line says the log records were not, exit 0."""
    from test_export_otlp import export

    collector = otel_collector(signals=("traces",))
    out = export(recorded_run, "--endpoint", collector.http_endpoint)
    assert out.returncode == 0, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "404" in line and "takes no logs" in line
    assert "and 0 log records" in out.stdout
    spans = collector.wait_spans(1)
    assert len({s["spanId"] for s in spans}) == len(spans) and not collector.logs()
    assert out.stdout.count(" spans ") == 1 and f"exported {len(spans)} spans" in out.stdout
