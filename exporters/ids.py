"""Deterministic trace and span ids: the same run gives the same ids however often,
and from wherever (Kafka, as it happens, or ClickHouse, on demand), it is exported.

A run (one Dask cluster, by its scheduler's id) is one trace. Its ids are the leading
bytes of BLAKE2b digests of what names the span in the recording, so an export read
again after a crash carries the very ids it carried before, and a backend that
receives a span twice can tell. Times enter as whole microseconds
(:func:`micros`, rounding half to even, as the sink stores them), so a float read
from Kafka and the DateTime64(6) read from ClickHouse give one id.
"""

from __future__ import annotations

from hashlib import blake2b


def micros(seconds: float) -> int:
    """Seconds since the epoch as whole microseconds, rounded as the sink rounds."""
    return round(seconds * 1e6)


def _digest(size: int, *parts) -> int:
    h = blake2b(digest_size=size)
    for part in parts:
        h.update(str(part).encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    value = int.from_bytes(h.digest(), "big")
    return value or 1  # 0 is OpenTelemetry's "invalid id"


def trace_id(cluster_id: str) -> int:
    """The 128-bit trace id of a run."""
    return _digest(16, "trace", cluster_id)


def run_span_id(cluster_id: str) -> int:
    """The run's root span."""
    return _digest(8, "run", cluster_id)


def dask_span_id(cluster_id: str, span_id: str) -> int:
    """A Dask span (``distributed.spans.Span.id``)."""
    return _digest(8, "span", cluster_id, span_id)


def task_span_id(cluster_id: str, key: str, ts_us: int, index: int) -> int:
    """The ``index``-th action (Dask's ``startstops``) of the transition of ``key``
    at ``ts_us`` microseconds: one task span."""
    return _digest(8, "task", cluster_id, key, ts_us, index)


def summary_span_id(cluster_id: str, prefix: str, action: str) -> int:
    """The span summarising a prefix's actions beyond ``max-task-spans``."""
    return _digest(8, "summary", cluster_id, prefix, action)
