"""``dask-blackbox exporter``, the continuous exporter, on the recorded run's topics
(tests/recording_support.py) and a real OpenTelemetry Collector (infra/otel):

- while the receiver is unreachable it retries with backoff, its backlog stays
  bounded (reading pauses, the lag stays in Kafka), and /metrics says so (the
  lag gauge is Kafka's own count);
- SIGKILLed mid-stream (after its third acknowledged request) and started again, it
  loses nothing and sends nothing twice: the collector ends up with exactly the trace
  ``dask-blackbox export otlp`` builds from ClickHouse (same ids, names, parents,
  times, attributes, events: the SIGKILLed worker's death with its cause, "killed")
  and every log record once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

import dask

from dask_blackbox import kafka, runfiles
from dask_blackbox.cli.export import run_trace
from dask_blackbox.exporters import traces
from dask_blackbox.read.runs import read_run

from conftest import subprocess_env
from dask_blackbox.testing.polling import wait_for


class ExporterProcess:
    def __init__(self, env: dict, data_dir, log, **settings) -> None:
        env = subprocess_env({**env, "DASK_BLACKBOX__DATA_DIR": str(data_dir)})
        for key, value in settings.items():
            env["DASK_BLACKBOX__EXPORTER__" + key.upper()] = str(value)
        self.data_dir = data_dir
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli", "exporter"],
                                     env=env, stdout=subprocess.PIPE, stderr=self.log)
        line = self.ready_line = self.proc.stdout.readline().decode()
        assert line.startswith("exporter ready"), (line, open(log).read()[-3000:])
        self.metrics_url = runfiles.read(data_dir, runfiles.EXPORTER)["metrics_url"]

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def value(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self.kill()


def test_unreachable_then_sigkill_mid_stream(recorded_run, otel_collector, tmp_path):
    run = recorded_run
    collector = otel_collector(start=False)  # not listening yet: unreachable
    data_dir = tmp_path / "exporter-data"
    settings = dict(endpoint=collector.http_endpoint, group_id=f"exporter-{run['prefix']}",
                    backlog_max=40, batch_max_spans=25, settle="1s", timeout="1s",
                    retry_backoff_max="1s", metrics_port=0)
    group = settings["group_id"]
    first = ExporterProcess(run["env"], data_dir, tmp_path / "exporter-1.log",
                            debug_pause_at="after-export:3", **settings)
    try:
        wait_for(lambda: first.value("dask_blackbox_export_failures_total") >= 2, 120,
                 "failed attempts while the receiver is down")
        backlog = first.value("dask_blackbox_export_backlog")
        assert 40 <= backlog < 40 + 500  # bounded: at most one message beyond backlog-max
        time.sleep(1.5)
        assert first.value("dask_blackbox_export_backlog") == backlog  # reading paused
        raw = run["settings"]["blackbox.kafka.topic-prefix"] + ".raw"
        # the gauge is Kafka's own count of what the group has not committed (how
        # much that is depends on how far reading got before the backlog filled)
        with dask.config.set(run["settings"]):
            behind = asyncio.run(kafka.consumer_lag(group, [raw]))[raw]
        assert first.value("dask_blackbox_consumer_lag", group=group, topic=raw) == behind
        assert first.proc.poll() is None
        log = (tmp_path / "exporter-1.log").read_text()
        assert "did not take" in log and "retrying in" in log

        collector.start()
        marker = data_dir / "exporter" / "paused-at-after-export"
        wait_for(marker.exists, 120, "three acknowledged requests")
        first.kill()
        before = collector.spans()
        assert before and len(before) + len(collector.logs()) >= 3  # three requests taken
    finally:
        first.kill()

    expected_run = read_run(run["backend"], run["cluster_id"])
    expected = {s.span_id: s for s in run_trace(run["backend"], expected_run, 10_000)}
    assert len(before) < len(expected)  # the kill came mid-stream

    second = ExporterProcess(run["env"], data_dir, tmp_path / "exporter-2.log", **settings)
    try:
        root_id = f"{[s for s in expected.values() if s.parent_id is None][0].span_id:016x}"
        wait_for(lambda: any(s["spanId"] == root_id for s in collector.spans()), 180,
                 "the run span (the cluster's end)")
        wait_for(lambda: second.value("dask_blackbox_export_backlog") == 0, 60, "an empty backlog")
        spans = collector.wait_spans(len(expected))
        counts = Counter(s["spanId"] for s in spans)
        assert [i for i, n in counts.items() if n > 1] == []  # nothing twice
        assert set(counts) == {f"{i:016x}" for i in expected}  # nothing lost, nothing else
        for s in spans:
            want = expected[int(s["spanId"], 16)]
            assert s["traceId"] == want.trace_id and s["name"] == want.name
            assert s.get("parentSpanId", "") == (f"{want.parent_id:016x}" if want.parent_id else "")
            assert (int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])) == (want.start_ns, want.end_ns)
            assert s["attributes"] == {k: v for k, v in want.attributes.items()}, want.name
            assert [(e["name"], e["timeUnixNano"], e["attributes"]) for e in s["events"]] == [
                (e.name, str(e.time_ns), e.attributes) for e in want.events], want.name
        [root] = [s for s in spans if s["spanId"] == root_id]
        deaths = [e["attributes"] for e in root["events"] if e["name"] == "dask.worker.death"]
        assert [(d["dask.worker.address"], d["dask.worker.death.cause"]) for d in deaths] == [
            (run["doomed"], "killed")]
        logs = collector.logs()
        assert len(logs) == len(expected_run.logs)
        assert Counter((l["timeUnixNano"], l["body"]["stringValue"]) for l in logs) == Counter(
            (str(traces.ns(l["ts"])), l["message"]) for l in expected_run.logs)
        assert second.value("dask_blackbox_consumer_lag", group=group,
                            topic=run["settings"]["blackbox.kafka.topic-prefix"] + ".raw") == 0
        assert second.terminate() == 0
    finally:
        second.kill()


_CLIENT = '''
from distributed import Client, LocalCluster, span

from dask_blackbox import producers


def inc(x):
    return x + 1


if __name__ == "__main__":
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, cluster_name="up-otel", **{"producer.flush-interval": "20ms"})
        with span("up-span"):
            assert sum(client.gather(client.map(inc, range(8)))) == 36
'''


def test_up_runs_the_exporter_when_an_endpoint_is_set(otel_collector, tmp_path):
    from up_process import Up

    collector = otel_collector()
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_BLACKBOX__")}
    up = Up(data_dir, "--set", f"exporter.endpoint={collector.grpc_endpoint}",
            "--set", "exporter.protocol=grpc", "--set", "exporter.settle=1s", env=env)
    try:
        up.wait_for("exporter   OpenTelemetry traces to")
        up.wait_for("healthy in")
        script = tmp_path / "client.py"
        script.write_text(_CLIENT)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=300, env={**env, "DASK_BLACKBOX__DATA_DIR": str(data_dir)})
        assert out.returncode == 0, out.stderr
        # on a loaded machine the processors' snapshot of up-span can trail the run's
        # end by more than the settle time: it still goes out, after the run span
        wanted = Counter({"run up-otel": 1, "up-span": 1, "compute inc": 8})

        def whole():
            names = Counter(s["name"] for s in collector.spans())
            return names if not wanted - names else None

        names = wait_for(whole, 120, "the run's trace")
        assert {k: names[k] for k in wanted} == wanted, names
        up.terminate()
        assert up.proc.returncode == 0, "".join(up.output)
        assert "exporter ready" in (data_dir / "logs" / "exporter.log").read_text()
    finally:
        up.stop()
