"""The tests' OTLP receiver: the OpenTelemetry Collector of ``infra/otel`` (the OTLP
receiver, gRPC and HTTP, and the contrib file exporter), built by ./run-tests into
``~/.cache/dask-blackbox/otelcol-<version>/otelcol`` (or ``$DASK_BLACKBOX_OTELCOL``),
started on free loopback ports; what it received is read back from the JSON lines
its file exporter writes (OTLP/JSON: ids in hex, times in nanoseconds as strings)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import time

from dask_blackbox.deploy.brokers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSION = re.search(r'Version:\s*"([^"]+)"', (ROOT / "infra" / "otel" / "main.go").read_text())[1]
BUILD = "./run-tests builds it (go build in infra/otel)"


def collector_binary() -> pathlib.Path | None:
    configured = os.environ.get("DASK_BLACKBOX_OTELCOL")
    path = pathlib.Path(configured) if configured else (
        pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
        / "dask-blackbox" / f"otelcol-{VERSION}" / "otelcol")
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _value(v: dict):
    """An OTLP/JSON AnyValue as Python."""
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return v["boolValue"]
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def attributes(items: list | None) -> dict:
    return {a["key"]: _value(a["value"]) for a in items or ()}


class Collector:
    """One collector process; ``spans()`` / ``logs()`` read what it received so far."""

    def __init__(self, binary: pathlib.Path, workdir: pathlib.Path,
                 grpc_port: int | None = None, http_port: int | None = None,
                 signals: tuple[str, ...] = ("traces", "logs")) -> None:
        self.binary = binary
        #: the pipelines it runs: a Collector without "logs" answers 404 on /v1/logs
        self.signals = signals
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.out = workdir / "received.jsonl"
        self.log = workdir / "collector.log"
        self.proc: subprocess.Popen | None = None

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def start(self, timeout: float = 20.0) -> Collector:
        config = self.workdir / "collector.yaml"
        config.write_text(json.dumps({
            "receivers": {"otlp": {"protocols": {
                "grpc": {"endpoint": f"127.0.0.1:{self.grpc_port}"},
                "http": {"endpoint": f"127.0.0.1:{self.http_port}"}}}},
            "exporters": {"file": {"path": str(self.out), "flush_interval": "50ms"}},
            "service": {"telemetry": {"metrics": {"level": "none"}},
                        "pipelines": {signal: {"receivers": ["otlp"], "exporters": ["file"]}
                                      for signal in self.signals}},
        }))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(self.binary), "--config", str(config)],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        for port in (self.grpc_port, self.http_port):
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"the collector exited:\n{self.log.read_text()[-3000:]}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"the collector did not listen on {port}")
                    time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _lines(self) -> list[dict]:
        """Every complete line the file exporter wrote (one it is still writing, not
        yet ended by a newline, is left for the next read)."""
        if not self.out.exists():
            return []
        text = self.out.read_text()
        complete = text[:text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def spans(self) -> list[dict]:
        """Every span received: its OTLP/JSON fields, ``attributes`` and events'
        attributes as dicts, and ``resource`` (the resource's attributes)."""
        out = []
        for line in self._lines():
            for rs in line.get("resourceSpans", ()):
                resource = attributes(rs.get("resource", {}).get("attributes"))
                for ss in rs.get("scopeSpans", ()):
                    for span in ss.get("spans", ()):
                        span = dict(span)
                        span["attributes"] = attributes(span.get("attributes"))
                        span["events"] = [{**e, "attributes": attributes(e.get("attributes"))}
                                          for e in span.get("events", ())]
                        span["resource"] = resource
                        span["scope"] = ss.get("scope", {}).get("name")
                        out.append(span)
        return out

    def logs(self) -> list[dict]:
        out = []
        for line in self._lines():
            for rl in line.get("resourceLogs", ()):
                resource = attributes(rl.get("resource", {}).get("attributes"))
                for sl in rl.get("scopeLogs", ()):
                    for record in sl.get("logRecords", ()):
                        out.append({**record, "attributes": attributes(record.get("attributes")),
                                    "resource": resource, "scope": sl.get("scope", {}).get("name")})
        return out

    def wait_spans(self, n: int, timeout: float = 30.0) -> list[dict]:
        """Until at least ``n`` spans arrived and none more for a moment."""
        deadline = time.monotonic() + timeout
        seen, since = -1, time.monotonic()
        while True:
            spans = self.spans()
            if len(spans) != seen:
                seen, since = len(spans), time.monotonic()
            elif len(spans) >= n and time.monotonic() - since > 0.3:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(spans)} spans received, expected at least {n}")
            time.sleep(0.1)
