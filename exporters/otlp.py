"""Sending spans and log records over OTLP with the OpenTelemetry Python SDK's own
exporters (HTTP/protobuf or gRPC, :attr:`~.settings.OtlpSettings.protocol`).

:class:`OtlpSender` turns :mod:`.model` data into the SDK's ``ReadableSpan`` and
``ReadableLogRecord`` (ids, times and attributes as they are: nothing is generated
here) and hands them to ``OTLPSpanExporter`` / ``OTLPLogExporter``, which retry
transient failures (connection errors, 429, 502-504, gRPC UNAVAILABLE...) with
exponential backoff within ``timeout``. A request that still fails raises
:class:`ExportFailed`, whose one-line message names the endpoint and the SDK's
reason (refused connection, HTTP status, gRPC code); retrying it later is the
caller's choice.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from urllib.parse import urlparse

from .model import Item, LogData, SpanData
from .settings import OtlpSettings

#: The instrumentation scope of every span: this package.
SCOPE = "dask_blackbox.exporters"
#: How the SDK's HTTP exporters report any failure; the reasons are elsewhere.
_GENERIC = ("Failed to export spans batch due to timeout", "Failed to export logs batch due to timeout")


class ExportFailed(ConnectionError):
    """The OTLP receiver did not take a request; the message says where and why."""


class _Reasons(logging.Handler):
    """Collects what the SDK's exporters log while one request is sent (they report
    failures by logging, and return only SUCCESS or FAILURE)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            try:
                self.messages.append(" ".join(record.getMessage().split()))
            except Exception:
                pass


class OtlpSender:
    """Exports spans (and log records) to one OTLP receiver."""

    def __init__(self, settings: OtlpSettings) -> None:
        self.settings = settings
        headers = dict(settings.headers) or None
        if settings.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            parsed = urlparse(settings.endpoint)
            target = f"{parsed.hostname}:{parsed.port or 4317}"
            insecure = parsed.scheme == "http"
            self.where = f"{settings.endpoint} (gRPC)"
            self.spans = OTLPSpanExporter(endpoint=target, insecure=insecure, headers=headers,
                                          timeout=settings.timeout)
            self.logs = OTLPLogExporter(endpoint=target, insecure=insecure, headers=headers,
                                        timeout=settings.timeout)
        else:
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.where = f"{settings.endpoint}/v1/traces"
            self.spans = OTLPSpanExporter(endpoint=f"{settings.endpoint}/v1/traces",
                                          headers=headers, timeout=settings.timeout)
            self.logs = OTLPLogExporter(endpoint=f"{settings.endpoint}/v1/logs",
                                        headers=headers, timeout=settings.timeout)
        self._resources: dict[str, object] = {}

    # ------------------------------------------------------------- conversion

    def _resource(self, item: Item):
        from opentelemetry.sdk.resources import Resource

        cached = self._resources.get(item.resource.cluster_id)
        if cached is None or cached[0] != item.resource.attributes:
            cached = (item.resource.attributes, Resource.create(item.resource.attributes))
            self._resources[item.resource.cluster_id] = cached
        return cached[1]

    @staticmethod
    def _readable_span(span: SpanData, resource):
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        trace_id = int(span.trace_id, 16)
        flags = TraceFlags(TraceFlags.SAMPLED)
        parent = (SpanContext(trace_id, span.parent_id, False, flags)
                  if span.parent_id is not None else None)
        return ReadableSpan(
            name=span.name,
            context=SpanContext(trace_id, span.span_id, False, flags),
            parent=parent, resource=resource, attributes=dict(span.attributes),
            events=[Event(e.name, dict(e.attributes), e.time_ns) for e in span.events],
            kind=SpanKind.INTERNAL,
            status=(Status(StatusCode.ERROR, span.error) if span.error is not None
                    else Status(StatusCode.UNSET)),
            start_time=span.start_ns, end_time=span.end_ns,
            instrumentation_scope=InstrumentationScope(SCOPE),
        )

    @staticmethod
    def _readable_log(log: LogData, resource):
        from opentelemetry import trace
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.sdk._logs import ReadableLogRecord
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        context = trace.set_span_in_context(NonRecordingSpan(SpanContext(
            int(log.trace_id, 16), log.span_id, False, TraceFlags(TraceFlags.SAMPLED))))
        record = LogRecord(timestamp=log.time_ns, observed_timestamp=log.time_ns,
                           context=context, severity_text=log.severity_text,
                           severity_number=SeverityNumber(log.severity_number), body=log.body,
                           attributes=dict(log.attributes))
        return ReadableLogRecord(log_record=record, resource=resource,
                                 instrumentation_scope=InstrumentationScope(log.logger or SCOPE))

    # ------------------------------------------------------------------ send

    def send(self, items: Sequence[Item]) -> None:
        """Export ``items`` (spans and log records, in requests of at most
        ``batch_max_spans``); ExportFailed when the receiver does not take one."""
        spans = [self._readable_span(i.span, self._resource(i)) for i in items if i.span is not None]
        logs = [self._readable_log(i.log, self._resource(i)) for i in items if i.log is not None]
        size = self.settings.batch_max_spans
        for start in range(0, len(spans), size):
            self._request(self.spans, spans[start:start + size], "spans")
        for start in range(0, len(logs), size):
            self._request(self.logs, logs[start:start + size], "log records")

    def _request(self, exporter, batch: list, what: str) -> None:
        reasons = _Reasons()
        sdk = logging.getLogger("opentelemetry.exporter")
        propagate = sdk.propagate
        sdk.addHandler(reasons)
        sdk.propagate = False  # the SDK's retry warnings: reported once, below
        try:
            result = exporter.export(batch)
        except Exception as e:  # an SDK bug or an encoding error: name it, never hang
            raise ExportFailed(f"cannot export {len(batch)} {what} to {self.where}: "
                               f"{type(e).__name__}: {e}") from e
        finally:
            sdk.removeHandler(reasons)
            sdk.propagate = propagate
        if getattr(result, "name", str(result)) != "SUCCESS":
            why = [m for m in reasons.messages if not m.startswith(_GENERIC)
                   and not m.startswith("Transient error")]
            reason = self._diagnose() or (why[-1] if why else (
                f"not acknowledged within blackbox.exporter.timeout={self.settings.timeout:g}s"))
            raise ExportFailed(f"the OTLP receiver at {self.where} did not take {len(batch)} "
                               f"{what}: {reason}")

    def _diagnose(self) -> str | None:
        """Why a request may have failed when the SDK does not say: nothing listens
        there, or nothing answers."""
        parsed = urlparse(self.settings.endpoint)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=2.0).close()
        except ConnectionRefusedError:
            return f"nothing listens at {parsed.hostname}:{port} (connection refused)"
        except OSError as e:
            return f"cannot connect to {parsed.hostname}:{port}: {e.strerror or e}"
        return None

    def close(self) -> None:
        for exporter in (self.spans, self.logs):
            try:
                exporter.shutdown()
            except Exception:
                pass
