"""Sending spans and log records over OTLP with the OpenTelemetry Python SDK's own
exporters (HTTP/protobuf or gRPC, :attr:`~.settings.OtlpSettings.protocol`).

:class:`OtlpSender` turns :mod:`.model` data into the SDK's ``ReadableSpan`` and
``ReadableLogRecord`` (ids, times and attributes as they are: nothing is generated
here) and hands them to ``OTLPSpanExporter`` / ``OTLPLogExporter``, which retry
transient failures (connection errors, 429, 502-504, gRPC UNAVAILABLE...) with
exponential backoff within ``timeout``. A request that still fails raises
:class:`ExportFailed`, whose one-line message names the endpoint (scheme, host and
port only: never its credentials or path) and the SDK's reason (refused connection,
HTTP status, gRPC code); retrying it later is the caller's choice.

A request carries one signal and at most ``batch_max_spans`` items and
``batch_max_bytes`` bytes of protobuf (measured before it is sent: a request over it
is refused here, as the receiver would refuse it). :class:`ExportFailed` says whether
the receiver *refused* the request as it is (a smaller one may pass: gRPC
RESOURCE_EXHAUSTED), whether for what it holds (*bad*: HTTP 400 or 413, gRPC
INVALID_ARGUMENT or a message over the receiver's size limit, or over the byte cap
here: sent again whole, it would be refused again), and whether the receiver *takes
no logs* (HTTP 404 on ``/v1/logs``, gRPC UNIMPLEMENTED for logs: a Jaeger takes
traces only).
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from dask_blackbox import config

from .model import Item, LogData, SpanData, Value
from .settings import OtlpSettings

if TYPE_CHECKING:  # the SDK is imported when a sender is made
    from opentelemetry.sdk._logs.export import LogRecordExporter
    from opentelemetry.sdk.resources import Resource as SdkResource
    from opentelemetry.sdk.trace.export import SpanExporter

#: The instrumentation scope of every span: this package.
SCOPE = "dask_blackbox.exporters"
#: How the SDK's HTTP exporters report any failure; the reasons are elsewhere.
_GENERIC = ("Failed to export spans batch due to timeout", "Failed to export logs batch due to timeout")


#: How a receiver refuses a request for what it holds (HTTP 400, 413; gRPC
#: INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for a message over its size limit): sent
#: again whole it is refused again, and an item refused so alone never goes.
_BAD_REQUEST = re.compile(r"batch code: (400|413)\b|error code: StatusCode\.INVALID_ARGUMENT\b"
                          r"|StatusCode\.RESOURCE_EXHAUSTED\b.*larger than max"
                          r"|exceeds max_request_size")
#: A refusal that a smaller request may pass (a receiver short of memory); an item
#: refused so alone waits and is tried again.
_TOO_MUCH = re.compile(r"error code: StatusCode\.RESOURCE_EXHAUSTED\b")


class ExportFailed(ConnectionError):
    """The OTLP receiver did not take a request; the message says where and why.
    ``refused``: the receiver answered and refused this request as it is (a smaller
    one may go); ``bad``: for what it holds (an item refused so alone never goes);
    ``no_logs``: the receiver takes no log records at all. A receiver that cannot be
    reached, times out, or refuses every request (401, 403, 503...) is none of these:
    the same request is tried again later."""

    def __init__(self, message: str, refused: bool = False, bad: bool = False,
                 no_logs: bool = False) -> None:
        super().__init__(message)
        self.refused, self.bad, self.no_logs = refused or bad, bad, no_logs


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
        self.spans: SpanExporter
        self.logs: LogRecordExporter
        if settings.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import (
                OTLPLogExporter as GrpcLogExporter,
            )
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )

            parsed = urlparse(settings.endpoint)
            target = f"{parsed.hostname}:{parsed.port or 4317}"
            insecure = parsed.scheme == "http"
            self.where = f"{config.display_url(settings.endpoint)} (gRPC)"
            self.spans = GrpcSpanExporter(endpoint=target, insecure=insecure, headers=headers,
                                          timeout=settings.timeout)
            self.logs = GrpcLogExporter(endpoint=target, insecure=insecure, headers=headers,
                                        timeout=settings.timeout)
        else:
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.where = config.display_url(settings.endpoint)
            self.spans = OTLPSpanExporter(endpoint=f"{settings.endpoint}/v1/traces",
                                          headers=headers, timeout=settings.timeout)
            self.logs = OTLPLogExporter(endpoint=f"{settings.endpoint}/v1/logs",
                                        headers=headers, timeout=settings.timeout)
        #: cluster id -> (its resource attributes, the SDK Resource made of them)
        self._resources: dict[str, tuple[dict[str, Value], SdkResource]] = {}

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

    def send(self, items: Sequence[Item], split: bool = True) -> None:
        """Export ``items`` (spans and log records, each signal in requests of at most
        ``batch_max_spans`` items and ``batch_max_bytes`` bytes); ExportFailed when the
        receiver does not take one (an item over the byte cap alone: *bad*). With
        ``split`` False, ``items`` over the byte cap are not split here but refused
        whole (the continuous exporter splits them itself, so that a request is
        acknowledged whole or not at all)."""
        from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        spans = [self._readable_span(i.span, self._resource(i)) for i in items if i.span is not None]
        logs = [self._readable_log(i.log, self._resource(i)) for i in items if i.log is not None]
        size = self.settings.batch_max_spans
        for start in range(0, len(spans), size):
            self._capped(self.spans, spans[start:start + size], "spans", encode_spans, split)
        for start in range(0, len(logs), size):
            self._capped(self.logs, logs[start:start + size], "log records", encode_logs, split)

    def _capped(self, exporter, batch: list, what: str, encode, split: bool) -> None:
        """Send ``batch`` in requests within the byte cap (halves, as often as needed)."""
        try:
            n_bytes = encode(batch).ByteSize()
        except Exception as e:  # an encoding error: name it
            raise ExportFailed(f"cannot encode {len(batch)} {what} for {self.where}: "
                               f"{type(e).__name__}: {e}", bad=True) from e
        cap = self.settings.batch_max_bytes
        if n_bytes > cap:
            if len(batch) == 1:
                raise ExportFailed(f"one of the {what} is {n_bytes} bytes, more than a request "
                                   f"holds (blackbox.exporter.batch-max-bytes={cap})", bad=True)
            if not split:
                raise ExportFailed(f"{len(batch)} {what} are {n_bytes} bytes, more than a "
                                   f"request holds (blackbox.exporter.batch-max-bytes={cap})",
                                   refused=True)
            half = len(batch) // 2
            self._capped(exporter, batch[:half], what, encode, split)
            self._capped(exporter, batch[half:], what, encode, split)
            return
        self._request(exporter, batch, what)

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
                               f"{type(e).__name__}: {config.redact(e)}") from e
        finally:
            sdk.removeHandler(reasons)
            sdk.propagate = propagate
        if getattr(result, "name", str(result)) != "SUCCESS":
            why = [m for m in reasons.messages if not m.startswith(_GENERIC)
                   and not m.startswith("Transient error")]
            said = " ".join(why)
            bad = bool(_BAD_REQUEST.search(said))
            refused = bad or bool(_TOO_MUCH.search(said))
            no_logs = exporter is self.logs and bool(
                re.search(r"batch code: 404\b", said) or "StatusCode.UNIMPLEMENTED" in said)
            reason = (None if refused else self._diagnose()) or (
                config.redact(why[-1]).replace(self.settings.endpoint, self.where)
                if why else (f"not acknowledged within "
                             f"blackbox.exporter.timeout={self.settings.timeout:g}s"))
            raise ExportFailed(f"the OTLP receiver at {self.where} did not take {len(batch)} "
                               f"{what}: {reason}", refused=refused, bad=bad, no_logs=no_logs)

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
