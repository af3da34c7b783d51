"""``dask-blackbox export otlp``: a recorded run (a real cluster, processors and sink:
tests/recording_support.py) exported to a real OpenTelemetry Collector (infra/otel)
over HTTP/protobuf and gRPC, and read back from what the collector received.

- the span tree is ``dask-blackbox spans --tree``: names, parents, durations to the
  microsecond, task counts, task seconds; one root, the run, naming the cluster;
- the task spans are the task stream's bars (worker, key, action, start, stop);
- erred tasks are exception events, the killed worker a death event with its cause
  ("killed"); the log records arrive as OTLP logs in the run's trace;
- the ids are deterministic (the gRPC export of a span is the same spans);
- a run larger than ``max-task-spans`` is capped, summarised per prefix, and says so;
- an unreachable or refusing receiver, or a bad endpoint, is a one-line error.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest

from dask_blackbox.exporters import ids
from dask_blackbox.read import panels, queries
from dask_blackbox.read.views import task_stream as streams

from conftest import subprocess_env
from recording_support import CLUSTER_NAME


def export(run, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "dask_blackbox.cli", "export", "otlp", "--cluster", CLUSTER_NAME,
         *args], env=subprocess_env(run["env"]), capture_output=True, text=True, timeout=timeout)


def by_kind(spans):
    tasks = [s for s in spans if "dask.task.action" in s["attributes"]
             and "dask.summary.actions" not in s["attributes"]]
    dask_spans = [s for s in spans if "dask.span.id" in s["attributes"]]
    roots = [s for s in spans if not s.get("parentSpanId")]
    return tasks, dask_spans, roots


def us(ns: str) -> int:
    assert int(ns) % 1000 == 0
    return int(ns) // 1000


@pytest.fixture(scope="module")
def http_export(recorded_run, tmp_path_factory):
    """The whole run exported over HTTP/protobuf to a collector; what it received."""
    from otel_support import Collector, collector_binary

    binary = collector_binary()
    if binary is None:
        pytest.skip("the OpenTelemetry Collector is not built: ./run-tests builds it")
    collector = Collector(binary, tmp_path_factory.mktemp("collector")).start()
    try:
        out = export(recorded_run, "--endpoint", collector.http_endpoint)
        assert out.returncode == 0, out.stderr
        collector.wait_spans(10)
        time.sleep(0.3)
        yield {"stdout": out.stdout, "spans": collector.spans(), "logs": collector.logs()}
    finally:
        collector.stop()


def test_the_span_tree_is_spans_tree(recorded_run, http_export):
    spans = http_export["spans"]
    cluster_id = recorded_run["cluster_id"]
    assert len({s["spanId"] for s in spans}) == len(spans)  # no span twice
    assert {s["traceId"] for s in spans} == {f"{ids.trace_id(cluster_id):032x}"}
    tasks, dask_spans, roots = by_kind(spans)
    [root] = roots
    assert root["name"] == f"run {CLUSTER_NAME}"
    assert root["resource"]["service.name"] == CLUSTER_NAME
    assert root["resource"]["service.instance.id"] == cluster_id
    assert root["resource"]["dask.cluster.id"] == cluster_id
    assert root["attributes"]["dask.task_spans.capped"] is False

    columns, rows = queries.spans(recorded_run["backend"], tree=True, cluster=cluster_id)
    tree = [dict(zip(columns, r)) for r in rows]
    assert {t["span_id"] for t in tree} == {s["attributes"]["dask.span.id"] for s in dask_spans}
    otel = {s["attributes"]["dask.span.id"]: s for s in dask_spans}
    span_of_otel_id = {s["spanId"]: s["attributes"]["dask.span.id"] for s in dask_spans}
    for t in tree:
        s = otel[t["span_id"]]
        assert s["name"] == t["name"].strip()
        parent = span_of_otel_id.get(s["parentSpanId"])
        if t["parent_id"]:
            assert parent == t["parent_id"], t["name"]
        else:
            assert s["parentSpanId"] == root["spanId"], t["name"]
        if t["elapsed_s"] is None:  # no task finished in memory (Dask's Span.start unset)
            assert us(s["startTimeUnixNano"]) == round(t["enqueued"].timestamp() * 1e6)
        else:
            assert (us(s["endTimeUnixNano"]) - us(s["startTimeUnixNano"])
                    == round(t["elapsed_s"] * 1e6)), t["name"]
        assert s["attributes"]["dask.span.tasks"] == t["tasks"]
        assert s["attributes"]["dask.span.task_seconds"] == pytest.approx(t["task_s"], abs=1e-9)
        assert s["attributes"]["dask.span.nbytes_total"] == t["nbytes"]
        for action, seconds in t["by_action"].items():
            assert s["attributes"][f"dask.span.seconds.{action}"] == pytest.approx(seconds)
    names = {s["name"] for s in dask_spans}
    assert {"etl", "load", "reduce", "failing"} <= names
    # every span and task span lies within the run
    for s in spans:
        assert int(root["startTimeUnixNano"]) <= int(s["startTimeUnixNano"])
        assert int(s["endTimeUnixNano"]) <= int(root["endTimeUnixNano"])


def test_task_spans_are_the_task_streams_bars(recorded_run, http_export):
    tasks, dask_spans, roots = by_kind(http_export["spans"])
    backend = recorded_run["backend"]
    scope = panels.resolve(backend, recorded_run["cluster_id"])
    stream = streams.task_stream(backend, scope, max_bars=10**6)
    assert stream["mode"] == "bars"
    # the tasks running when their worker died, hatched on the page, are spans too
    assert streams.DIED in {b["action"] for b in stream["bars"]}
    action = lambda b: "died" if b["action"] == streams.DIED else b["action"]  # noqa: E731
    bars = Counter((b["worker"], b["key"], action(b), round(b["start"] * 1e6),
                    round(b["stop"] * 1e6)) for b in stream["bars"])
    got = Counter((s["attributes"]["dask.worker.address"], s["attributes"]["dask.task.key"],
                   s["attributes"]["dask.task.action"], us(s["startTimeUnixNano"]),
                   us(s["endTimeUnixNano"])) for s in tasks)
    assert got == bars
    assert {a for _, _, a, _, _ in bars} >= {"compute", "transfer"}
    # a compute on the thread that ran it, as Dask's task stream draws it
    threads = Counter((b["worker"], b["key"], round(b["start"] * 1e6), b["thread"])
                      for b in stream["bars"] if b["action"] == "compute")
    assert None not in {t for *_, t in threads}
    assert Counter((s["attributes"]["dask.worker.address"], s["attributes"]["dask.task.key"],
                    us(s["startTimeUnixNano"]), s["attributes"].get("thread.id"))
                   for s in tasks if s["attributes"]["dask.task.action"] == "compute") == threads
    # each task span hangs under its task's Dask span
    by_id = {s["spanId"]: s for s in dask_spans + roots}
    for s in tasks:
        parent = by_id[s["parentSpanId"]]
        assert s["name"] == f"{s['attributes']['dask.task.action']} {s['attributes']['dask.task.prefix']}"
        if s["attributes"]["dask.task.prefix"] in ("random_sample", "transpose", "add", "sum"):
            assert parent["name"] in ("load", "reduce"), s["name"]


def test_errors_deaths_and_logs(recorded_run, http_export):
    spans = http_export["spans"]
    tasks, dask_spans, [root] = by_kind(spans)
    [failing] = [s for s in dask_spans if s["name"] == "failing"]
    errors = {e["attributes"]["dask.task.key"]: e for e in failing["events"] if e["name"] == "exception"}
    assert set(errors) == {"div-bad", "inc-after-bad"}
    assert "division by zero" in errors["div-bad"]["attributes"]["exception.message"]
    assert "ZeroDivisionError" in errors["div-bad"]["attributes"]["exception.stacktrace"] + \
        errors["div-bad"]["attributes"]["exception.type"]
    assert failing["status"].get("code") == 2  # STATUS_CODE_ERROR
    [bad] = [s for s in tasks if s["attributes"]["dask.task.key"] == "div-bad"]
    assert bad["status"].get("code") == 2
    deaths = [e for e in root["events"] if e["name"] == "dask.worker.death"]
    assert [d["attributes"]["dask.worker.address"] for d in deaths] == [recorded_run["doomed"]]
    assert deaths[0]["attributes"]["dask.worker.processing_tasks"] == 2
    # the tasks Dask said the worker was running as it was killed: a span each, an error
    died = [s for s in tasks if s["attributes"]["dask.task.action"] == "died"]
    assert sorted(s["attributes"]["dask.task.key"] for s in died) == recorded_run["running_at_death"]
    for s in died:
        assert s["attributes"]["dask.worker.address"] == recorded_run["doomed"]
        assert s["status"].get("code") == 2
        assert s["status"]["message"] == "running when its worker died: killed by the OS"
        assert us(s["endTimeUnixNano"]) <= us(deaths[0]["timeUnixNano"])
    # the planted SIGKILL, with the cause every page gives it (read.diagnosis)
    death = deaths[0]["attributes"]
    assert (death["dask.worker.death.cause"], death["dask.worker.death.cause_label"],
            death["dask.worker.death.confidence"]) == ("killed", "killed by the OS", "medium")
    # killed from outside at low memory: the words say it was not memory (unless the
    # machine itself was short of memory then)
    words = death["dask.worker.death.explanation"]
    assert (words.startswith("not memory: ") and "something outside Dask sent SIGKILL" in words
            or "host short of memory" in words), words
    logs = http_export["logs"]
    trace = f"{ids.trace_id(recorded_run['cluster_id']):032x}"
    assert logs and {log["traceId"] for log in logs} == {trace}
    held = [log for log in logs if "holds its worker" in log["body"]["stringValue"]]
    assert held and held[0]["severityText"] == "WARNING" and held[0]["severityNumber"] == 13
    assert held[0]["attributes"]["dask.process"] and held[0]["scope"] == "distributed.worker"


def test_grpc_export_of_a_span_is_the_same_spans(recorded_run, http_export, otel_collector):
    collector = otel_collector()
    out = export(recorded_run, "--span", "etl", "--endpoint", collector.grpc_endpoint,
                 "--protocol", "grpc", "--no-logs")
    assert out.returncode == 0, out.stderr
    got = collector.wait_spans(5)
    everything = {s["spanId"]: s for s in http_export["spans"]}
    tasks, dask_spans, roots = by_kind(got)
    assert {s["name"] for s in dask_spans} == {"etl", "load", "reduce"}
    for s in tasks + dask_spans:  # the same ids, times and attributes as over HTTP
        same = everything[s["spanId"]]
        for field in ("traceId", "parentSpanId", "name", "startTimeUnixNano", "endTimeUnixNano",
                      "attributes"):
            assert s[field] == same[field], field
    assert len(tasks) == sum(1 for s in by_kind(http_export["spans"])[0]
                             if everything[s["parentSpanId"]]["name"] in ("etl", "load", "reduce"))
    assert not collector.logs()


def test_a_run_too_large_is_capped_and_says_so(recorded_run, http_export, otel_collector):
    collector = otel_collector()
    out = export(recorded_run, "--endpoint", collector.http_endpoint, "--no-logs",
                 "--set", "exporter.max-task-spans=10")
    assert out.returncode == 0, out.stderr
    assert "summarised per prefix" in out.stdout and "max-task-spans=10" in out.stdout
    tasks, _, [root] = by_kind(collector.wait_spans(10))
    all_tasks = by_kind(http_export["spans"])[0]
    # the tasks running at the death are not capped: a few a death, always there
    died = [s for s in tasks if s["attributes"]["dask.task.action"] == "died"]
    assert len(died) == len(recorded_run["running_at_death"])
    tasks = [s for s in tasks if s not in died]
    all_tasks = [s for s in all_tasks if s["attributes"]["dask.task.action"] != "died"]
    assert len(tasks) == 10
    summaries = [s for s in collector.spans() if "dask.summary.actions" in s["attributes"]]
    assert sum(s["attributes"]["dask.summary.actions"] for s in summaries) == len(all_tasks) - 10
    assert root["attributes"]["dask.task_spans.capped"] is True
    assert root["attributes"]["dask.task_spans.summarised"] == len(all_tasks) - 10
    assert any(e["name"] == "dask.task_spans.capped" for e in root["events"])
    per_prefix = Counter()
    for s in all_tasks:
        per_prefix[(s["attributes"]["dask.task.prefix"], s["attributes"]["dask.task.action"])] += 1
    for s in tasks:
        per_prefix[(s["attributes"]["dask.task.prefix"], s["attributes"]["dask.task.action"])] -= 1
    assert {(s["attributes"]["dask.task.prefix"], s["attributes"]["dask.task.action"]):
            s["attributes"]["dask.summary.actions"] for s in summaries} == +per_prefix


def test_unreachable_refusing_and_bad_endpoints(recorded_run, otel_collector):
    from dask_blackbox.deploy.brokers import free_port

    port = free_port()  # nothing listens there
    began = time.monotonic()
    out = export(recorded_run, "--endpoint", f"http://127.0.0.1:{port}", "--no-logs",
                 "--set", "exporter.timeout=2s")
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"dask-blackbox: error: the OTLP receiver at http://127.0.0.1:{port}")
    assert line.endswith(f"nothing listens at 127.0.0.1:{port} (connection refused)")
    assert time.monotonic() - began < 30
    collector = otel_collector()
    out = export(recorded_run, "--endpoint", collector.http_endpoint + "/not-otlp", "--no-logs")
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert "404" in line and f"{collector.http_endpoint}/…" in line  # a path may hold a token
    assert not collector.spans()
    out = export(recorded_run, "--endpoint", "ftp://127.0.0.1:1")
    assert out.returncode == 1
    assert out.stderr.strip() == ("dask-blackbox: error: blackbox.exporter.endpoint: "
                                  "'ftp://127.0.0.1:1' is not an http:// or https:// URL with a "
                                  "host (e.g. http://127.0.0.1:4318)")
    out = export(recorded_run, "--endpoint", collector.http_endpoint, "--cluster", "nope")
    assert out.returncode == 1 and "nope" in out.stderr and len(out.stderr.strip().splitlines()) == 1
