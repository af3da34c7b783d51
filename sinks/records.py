"""Derived records to rows: one converter per derived topic.

The stream processors publish span snapshots, prefix partials, gaps and their own dead
letters (``contract.RECORDS``); each becomes one row of its table. A record lacking a
required field, or with a value of the wrong type, raises Invalid (the batch
dead-letters it with the reason). Fields added to the contract after a record was
published are simply missing from it: they load as empty (lists, maps) or 0.

As for events (sinks.events), what is read is checked against the contract at import:
every field read is declared for its record, and every declared field is read or
listed in :data:`NOT_STORED` with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from dask_blackbox import contract
from dask_blackbox.sinks import checks
from dask_blackbox.sinks.checks import Invalid

_cumulative_worker_metrics = checks.tuples(
    checks.text, checks.text, checks.text, checks.text, checks.float_,
    names=("context", "prefix", "activity", "unit", "value"))
_nthreads_intervals = checks.tuples(checks.time_, checks.time_, checks.count,
                                    names=("begin", "end", "nthreads"))


def _span_state(rec: dict, now: float):
    stop, updated_at = rec.get("stop"), rec.get("updated_at")
    yield "span_state", (
        checks.text(rec["cluster_id"], "cluster_id"),
        checks.text(rec.get("cluster_name"), "cluster_name"),
        checks.text(rec["span_id"], "span_id"), checks.name(rec.get("name"), "name"),
        checks.text(rec.get("parent_id"), "parent_id"), checks.int_(rec["version"], "version"),
        checks.time_(rec["enqueued"], "enqueued"), checks.time_(rec.get("start") or 0, "start"),
        checks.time_(now if stop is None else stop, "stop"),
        checks.float_(rec.get("duration") or 0, "duration"),
        checks.int_(rec.get("nbytes_total") or 0, "nbytes_total"),
        checks.mapping(checks.int_)(rec.get("states"), "states"),
        checks.mapping(checks.float_)(rec.get("all_durations"), "all_durations"),
        *_cumulative_worker_metrics(rec.get("cumulative_worker_metrics"),
                                    "cumulative_worker_metrics"),
        bool(rec.get("done")),
        checks.time_(now if updated_at is None else updated_at, "updated_at"),
        *_nthreads_intervals(rec.get("nthreads_intervals"), "nthreads_intervals"),
        checks.float_(rec.get("active_cpu_seconds") or 0, "active_cpu_seconds"),
    )


def _prefix_stats(rec: dict, now: float):
    yield "prefix_stats", (
        checks.text(rec["cluster_id"], "cluster_id"),
        checks.text(rec.get("cluster_name"), "cluster_name"),
        checks.text(rec["span_id"], "span_id"), checks.text(rec["prefix"], "prefix"),
        checks.time_(rec["window_start"], "window_start"),
        checks.text(rec["partial_id"], "partial_id"),
        checks.mapping(checks.count)(rec.get("finished"), "finished"),
        checks.mapping(checks.float_)(rec.get("durations"), "durations"),
        checks.int_(rec.get("nbytes") or 0, "nbytes"),
        checks.count(rec.get("n_erred") or 0, "n_erred"),
        checks.float_(rec.get("max_duration") or 0, "max_duration"),
    )


def _gap(rec: dict, now: float):
    missing_from = checks.int_(rec["missing_from"], "missing_from")
    missing_to = checks.int_(rec["missing_to"], "missing_to")
    if not 0 <= missing_from <= missing_to:
        raise Invalid(f"missing_from {missing_from} and missing_to {missing_to} are not a range")
    detected_at = rec.get("detected_at")
    yield "gaps", (
        checks.text(rec["cluster_id"], "cluster_id"), checks.text(rec["producer_id"], "producer_id"),
        checks.text(rec.get("source"), "source"), missing_from, missing_to,
        checks.time_(now if detected_at is None else detected_at, "detected_at"),
    )


def _processor_dead_letter(rec: dict, now: float):
    detected_at, offset = rec.get("detected_at"), rec.get("offset")
    payload = checks.text(rec.get("payload"), "payload") or ""
    yield "dead_letters", (
        "processor", checks.text(rec.get("topic"), "topic"),
        checks.count(rec.get("partition") or 0, "partition"),
        checks.int_(-1 if offset is None else offset, "offset"), checks.text(rec.get("key"), "key"),
        checks.text(rec["reason"], "reason"), payload[:contract.DEAD_LETTER_PAYLOAD_MAX],
        checks.time_(now if detected_at is None else detected_at, "detected_at"),
    )


@dataclasses.dataclass(frozen=True)
class RecordConverter:
    """A derived topic's conversion: the fields a record must have, the fields read,
    and a generator of (table, row) pairs from (record, now); raises Invalid."""

    required: tuple[str, ...]
    reads: tuple[str, ...]
    convert: Callable[[dict, float], Iterator[tuple[str, tuple]]]


#: Derived topic -> its conversion.
RECORD_CONVERTERS: dict[str, RecordConverter] = {
    contract.SPAN_STATE: RecordConverter(
        ("cluster_id", "span_id", "version", "enqueued"),
        ("cluster_id", "cluster_name", "span_id", "name", "parent_id", "version", "enqueued",
         "start", "stop", "duration", "nbytes_total", "states", "all_durations",
         "cumulative_worker_metrics", "done", "updated_at", "nthreads_intervals",
         "active_cpu_seconds"),
        _span_state),
    contract.PREFIX_STATS: RecordConverter(
        ("cluster_id", "span_id", "prefix", "window_start", "partial_id"),
        ("cluster_id", "cluster_name", "span_id", "prefix", "window_start", "partial_id",
         "finished", "durations", "nbytes", "n_erred", "max_duration"),
        _prefix_stats),
    contract.GAPS: RecordConverter(
        ("cluster_id", "producer_id", "missing_from", "missing_to"),
        ("cluster_id", "producer_id", "source", "missing_from", "missing_to", "detected_at"),
        _gap),
    contract.DEAD_LETTER: RecordConverter(
        ("reason",),
        ("topic", "partition", "offset", "key", "reason", "payload", "detected_at"),
        _processor_dead_letter),
}

#: Contract fields of derived records the sink does not store, with the reason.
NOT_STORED: dict[str, dict[str, str]] = {}


def check_against_contract() -> None:
    """Raise TypeError unless each converter reads its record's contract fields (less
    :data:`NOT_STORED`), and nothing else."""
    problems = []
    if set(RECORD_CONVERTERS) != set(contract.RECORDS):
        problems.append(f"topics loaded {sorted(RECORD_CONVERTERS)} != contract.RECORDS")
    for topic, conv in RECORD_CONVERTERS.items():
        declared = set(contract.fields(contract.RECORDS[topic]))
        skipped = set(NOT_STORED.get(topic, {}))
        extra = (set(conv.required) | set(conv.reads)) - declared
        if extra:
            problems.append(f"{topic}: {', '.join(sorted(extra))} read but not in the contract")
        missing = declared - set(conv.reads) - skipped
        if missing:
            problems.append(f"{topic}: contract field(s) {', '.join(sorted(missing))} are "
                            "neither loaded nor in sinks.records.NOT_STORED")
    if problems:
        raise TypeError("sinks.records disagrees with dask_blackbox.contract: " + "; ".join(problems))


check_against_contract()
