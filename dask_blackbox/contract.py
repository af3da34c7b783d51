"""The wire contract between producers, stream processors and sinks.

This is the only module the three layers share. It names the Kafka topics, defines
the batch envelope every raw message carries, the event kinds and their fields, and
the derived records the processors publish. Nothing here does I/O, and nothing here
imports a layer.

Every raw Kafka message is one *envelope*, an orjson-encoded mapping::

    {"schema": 1, "cluster_id": "...", "cluster_name": "...", "source": "scheduler",
     "producer_id": "...", "seq": 17, "sent_at": 1700000000.123, "events": [...]}

``seq`` starts at 0 and increases by exactly one per envelope a producer sends, so a
gap seen downstream means envelopes were lost, never reordered (messages are keyed by
``cluster_id`` and a producer has a single in-flight sender). Every event is a mapping
with at least ``kind`` and ``ts`` (seconds since the epoch, the producer's clock).

Which fields each kind carries is listed in :data:`EVENT_FIELDS`; ``None`` means
"unknown here", never an error. Readers must ignore fields they don't know, so adding
an optional field does not bump :data:`SCHEMA_VERSION`; removing or re-typing one does.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Final

SCHEMA_VERSION: Final = 1

#: The envelope's fields, all required.
ENVELOPE_FIELDS: Final = (
    "schema",
    "cluster_id",
    "cluster_name",
    "source",
    "producer_id",
    "seq",
    "sent_at",
    "events",
)

#: Who sent an envelope.
SOURCES: Final = frozenset({"scheduler", "worker", "client"})

#: Largest encoded envelope a producer sends and a processor accepts. Kafka's default
#: message.max.bytes is 1 MiB; staying under it keeps every broker default valid.
MAX_ENVELOPE_BYTES: Final = 900_000


# --------------------------------------------------------------------------- topics

#: Raw topic: every producer envelope, keyed by cluster_id.
RAW: Final = "raw"
#: Derived topic: versioned span snapshots (one record per changed span), keyed by
#: cluster_id. A later version of the same (cluster_id, span_id) supersedes earlier ones.
SPAN_STATE: Final = "span-state"
#: Derived topic: additive per-(cluster, span, prefix, window) partials.
PREFIX_STATS: Final = "prefix-stats"
#: Derived topic: sequence gaps detected per producer.
GAPS: Final = "gaps"
#: Messages on the raw topic that are not valid envelopes, with the reason.
DEAD_LETTER: Final = "dead-letter"

TOPICS: Final = (RAW, SPAN_STATE, PREFIX_STATS, GAPS, DEAD_LETTER)


def topic_name(prefix: str, topic: str) -> str:
    """Full Kafka topic name, e.g. ``topic_name("blackbox", RAW) == "blackbox.raw"``."""
    if topic not in TOPICS:
        raise ValueError(f"unknown blackbox topic {topic!r}; expected one of {TOPICS}")
    return f"{prefix}.{topic}" if prefix else topic


# --------------------------------------------------------------------------- events

#: A scheduler task transition, one per call of ``SchedulerPlugin.transition``
#: (worker-side transitions, when enabled, use the same kind with ``source="worker"``).
#: ``prefix``/``group``/``span_id`` are those of the TaskState at the time of the
#: transition, ``None`` once the task is forgotten. ``startstops`` is a list of
#: ``{"action", "start", "stop"}`` (plus ``"source"`` for transfers) exactly as Dask
#: passed it; ``exception``/``traceback`` are text.
TRANSITION: Final = "transition"
#: A graph submission (``SchedulerPlugin.update_graph``). ``tasks`` lists up to
#: ``blackbox.producer.graph-max-tasks`` entries ``{"key", "prefix", "group",
#: "span_id", "dependencies"}``; ``n_tasks`` is the true count. ``keys`` (the keys
#: the client wants) is capped the same way; optional ``n_keys`` is their true count.
#: ``annotations`` maps each annotation name (span, retries, resources, ...) to its
#: distinct values ``[{"value", "n_tasks"}, ...]``, most frequent first.
GRAPH: Final = "graph"
#: A span as it appears in ``scheduler.extensions["spans"]``.
SPAN: Final = "span"
#: A structured event (``log_event``) on any topic, including users' own.
EVENT: Final = "event"
#: Cluster lifecycle: worker/client added or removed, restart, close.
LIFECYCLE: Final = "lifecycle"
#: Periodic scheduler metrics.
SCHEDULER_METRICS: Final = "scheduler_metrics"
#: Periodic worker metrics.
WORKER_METRICS: Final = "worker_metrics"
#: Deltas of ``Worker.digests_total`` since the previous sample.
WORKER_DIGESTS: Final = "worker_digests"
#: A logging record.
LOG: Final = "log"
#: Envelopes a producer dropped because its buffer was full, published once the broker
#: is reachable again: ``{"dropped_events", "dropped_bytes", "since", "until"}``.
DROPS: Final = "drops"

#: Fields each event kind carries besides ``kind`` and ``ts``.
EVENT_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    TRANSITION: (
        "key", "prefix", "group", "span_id", "start", "finish", "stimulus_id",
        "worker", "nbytes", "typename", "startstops", "exception", "traceback",
        "cause",
    ),
    GRAPH: ("client", "stimulus_id", "n_tasks", "keys", "tasks", "annotations", "n_keys"),
    SPAN: ("span_id", "name", "parent_id", "enqueued"),
    EVENT: ("topic", "msg"),
    LIFECYCLE: ("action", "worker", "client", "reason", "stimulus_id", "detail"),
    SCHEDULER_METRICS: (
        "tasks_by_state", "n_workers", "n_threads", "memory", "memory_managed",
        "memory_unmanaged", "memory_spilled", "event_loop_interval",
    ),
    WORKER_METRICS: (
        "worker", "memory", "memory_managed", "memory_unmanaged", "memory_spilled",
        "cpu", "executing", "ready", "in_flight", "event_loop_interval",
        "gil_contention",
    ),
    WORKER_DIGESTS: ("worker", "digests"),
    LOG: ("logger", "level", "message", "process", "exc_text"),
    DROPS: ("dropped_events", "dropped_bytes", "since", "until"),
}

#: ``LIFECYCLE.action`` values.
LIFECYCLE_ACTIONS: Final = frozenset(
    {"worker_added", "worker_removed", "client_added", "client_removed", "restart",
     "scheduler_start", "scheduler_close"}
)

#: ``WORKER_DIGESTS.digests`` is a list of ``[context, span_id, prefix, activity, unit,
#: value]`` rows, the keys of ``Worker.digests_total`` that have a span (the same keys
#: ``SpansWorkerExtension.heartbeat`` apportions), with the increase since last sample.
DIGEST_ROW: Final = ("context", "span_id", "prefix", "activity", "unit", "value")


# ----------------------------------------------------------------- derived records

#: A span snapshot on SPAN_STATE. Values are those of ``distributed.spans.Span`` for the
#: span *tree* rooted at ``span_id`` (a parent rolls up its children), as the
#: processors have rebuilt them. ``version`` increases per (cluster_id, span_id); a
#: consumer keeps the highest. ``states``/``all_durations`` are ``{name: number}``;
#: ``cumulative_worker_metrics`` is a list of ``[context, prefix, activity, unit,
#: value]`` rows (Dask's key tuple with the span id removed).
SPAN_STATE_FIELDS: Final = (
    "cluster_id", "cluster_name", "span_id", "name", "parent_id", "version",
    "enqueued", "start", "stop", "duration", "nbytes_total", "states",
    "all_durations", "cumulative_worker_metrics", "done", "updated_at",
)

#: A prefix partial on PREFIX_STATS for (cluster_id, span_id, prefix, window_start),
#: window_start being the start of a 1-minute tumbling window of the transition ``ts``.
#: ``partial_id`` identifies the partial uniquely and deterministically (same input,
#: same id), so a replayed partial can be recognised and not counted twice.
#: ``finished`` counts transitions by finish state, ``durations`` sums startstop
#: seconds by action (compute, transfer, ...), ``max_duration`` is the longest single
#: compute in the window.
PREFIX_STATS_FIELDS: Final = (
    "cluster_id", "cluster_name", "span_id", "prefix", "window_start", "partial_id",
    "finished", "durations", "nbytes", "n_erred", "max_duration",
)

#: A gap on GAPS: envelopes ``missing_from``..``missing_to`` (inclusive) of a producer
#: never arrived.
GAP_FIELDS: Final = (
    "cluster_id", "producer_id", "source", "missing_from", "missing_to",
    "detected_at",
)

#: A dead letter on DEAD_LETTER. ``payload`` is the raw message, decoded as UTF-8 with
#: replacement and cut to 64 KiB; ``reason`` says what is wrong with it.
DEAD_LETTER_FIELDS: Final = (
    "topic", "partition", "offset", "key", "reason", "payload", "detected_at",
)


# ------------------------------------------------------------------------- helpers


def encode_key(key: Hashable) -> str:
    """The text form of a Dask key used on the wire and in ClickHouse.

    ``str`` keys are themselves; tuple keys such as ``("x-abc", 0, 1)`` become
    ``str(key)``, the form the dashboard shows.
    """
    return key if isinstance(key, str) else str(key)


class InvalidEnvelope(ValueError):
    """A raw message is not a valid envelope; the message says why."""


def validate_envelope(obj: Any) -> dict:
    """Check a decoded raw message against the contract and return it.

    Raises :class:`InvalidEnvelope` naming the first problem found.
    """
    if not isinstance(obj, dict):
        raise InvalidEnvelope(f"envelope is a {type(obj).__name__}, not an object")
    missing = [f for f in ENVELOPE_FIELDS if f not in obj]
    if missing:
        raise InvalidEnvelope(f"envelope lacks field(s) {', '.join(missing)}")
    if obj["schema"] != SCHEMA_VERSION:
        raise InvalidEnvelope(
            f"unknown schema version {obj['schema']!r}; this build reads {SCHEMA_VERSION}"
        )
    if not isinstance(obj["seq"], int) or obj["seq"] < 0:
        raise InvalidEnvelope(f"seq must be a non-negative integer, got {obj['seq']!r}")
    if not isinstance(obj["events"], list):
        raise InvalidEnvelope("events must be a list")
    for field in ("cluster_id", "producer_id", "source"):
        if not isinstance(obj[field], str) or not obj[field]:
            raise InvalidEnvelope(f"{field} must be a non-empty string")
    for i, ev in enumerate(obj["events"]):
        if not isinstance(ev, dict) or "kind" not in ev or "ts" not in ev:
            raise InvalidEnvelope(f"event {i} is not an object with 'kind' and 'ts'")
    return obj
