"""What the exporters send, as named data: a finished span and a log record, in the
terms of OpenTelemetry's data model (ids as integers, times as nanoseconds since the
epoch, attributes as flat mappings of OpenTelemetry's attribute value types).

These are msgspec Structs so that the continuous exporter's journal stores them as
compact msgpack (:func:`encode`, :func:`decode`) and :mod:`.otlp` turns them into the
OpenTelemetry SDK's objects only when they are sent.
"""

from __future__ import annotations

from typing import Union

import msgspec

#: An attribute value OpenTelemetry accepts (a list holds values of one of these types).
Value = Union[str, bool, int, float, list]


class SpanEvent(msgspec.Struct, frozen=True):
    """An event of a span (an exception, a worker's death)."""

    name: str
    time_ns: int
    attributes: dict[str, Value] = {}


class SpanData(msgspec.Struct, frozen=True):
    """A finished span of a run's trace. ``trace_id`` is 32 hex digits (msgpack has
    no 128-bit integers); ``error``: the status description of a span whose status is
    ERROR (None: status UNSET)."""

    trace_id: str
    span_id: int
    parent_id: int | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Value] = {}
    events: list[SpanEvent] = []
    error: str | None = None


class LogData(msgspec.Struct, frozen=True):
    """A shipped log record, in the run's trace (``span_id``: the run's root span)."""

    trace_id: str
    span_id: int
    time_ns: int
    severity_text: str
    severity_number: int
    body: str
    logger: str
    attributes: dict[str, Value] = {}


class Resource(msgspec.Struct, frozen=True):
    """The resource of a run: the cluster (its attributes, see
    :func:`.traces.resource_attributes`)."""

    cluster_id: str
    attributes: dict[str, Value]


class Item(msgspec.Struct, frozen=True):
    """One journalled thing to send: a span or a log record, with its resource."""

    resource: Resource
    span: SpanData | None = None
    log: LogData | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Item)


def encode(item: Item) -> bytes:
    return _encoder.encode(item)


def decode(data: bytes) -> Item:
    return _decoder.decode(data)
