"""The tables the sink writes, and how their rows are held before loading.

:data:`COLUMNS` names every table's insert columns in order (what sinks/sql creates;
the loader checks it against ClickHouse). Rows are kept as columns, one Python list
per column (:class:`TableData`); a column holding a list per row is a
:class:`FlatLists`. Times are float seconds and text columns hold None for the empty
string; sinks.arrow turns them into DateTime64 and '' in bulk.

Every row keeps a reference to the :class:`Message` (and event) it came from, so a
row ClickHouse rejects can be dead-lettered precisely (see ``sinks.loader``).
"""

from __future__ import annotations

import dataclasses

from dask_blackbox import contract

#: What Dask passes with a transition (contract.TRANSITION_KWARGS) after startstops:
#: each a column of its own, appended to ``transitions`` in order (new ones last).
LATER_KWARGS: tuple[str, ...] = contract.TRANSITION_KWARGS[
    contract.TRANSITION_KWARGS.index("startstops") + 1:]

#: Columns of every table the sink writes, in insert order, without ``_batch`` (added
#: by the loader). Must match sinks/sql: the loader checks it against ClickHouse.
COLUMNS: dict[str, tuple[str, ...]] = {
    "envelopes": (
        "cluster_id", "cluster_name", "source", "producer_id", "seq", "sent_at",
        "n_events", "n_bytes", "n_transitions", "n_memory", "n_erred", "partition",
        "offset",
    ),
    "transitions": (
        "cluster_id", "key", "ts", "start", "finish", "stimulus_id", "source", "seq",
        "idx", "prefix", "task_group", "span_id", "worker", "nbytes", "typename",
        "startstops.action", "startstops.start", "startstops.stop", "startstops.source",
        "exception", "traceback", "cause", *LATER_KWARGS,
    ),
    "graphs": (
        "cluster_id", "ts", "client", "stimulus_id", "n_tasks", "n_recorded", "n_keys",
        "keys", "annotations",
    ),
    "graph_tasks": (
        "cluster_id", "key", "ts", "stimulus_id", "prefix", "task_group", "span_id",
        "dependencies", "n_dependencies",
    ),
    "events": ("cluster_id", "topic", "ts", "source", "seq", "idx", "msg"),
    "spans": ("cluster_id", "span_id", "name", "parent_id", "enqueued", "ts"),
    "lifecycle": (
        "cluster_id", "ts", "action", "worker", "client", "reason", "stimulus_id",
        "detail", "total_nthreads.time", "total_nthreads.nthreads",
    ),
    "scheduler_metrics": (
        "cluster_id", "ts", "tasks_by_state", "n_workers", "n_threads", "memory",
        "memory_managed", "memory_unmanaged", "memory_spilled", "event_loop_interval",
    ),
    "worker_metrics": (
        "cluster_id", "worker", "producer_id", "ts", "memory", "memory_managed",
        "memory_unmanaged", "memory_spilled", "cpu", "executing", "ready", "in_flight",
        "event_loop_interval", "gil_contention",
    ),
    "worker_digests": (
        "cluster_id", "worker", "ts", "context", "span_id", "prefix", "activity", "unit",
        "value",
    ),
    "logs": (
        "cluster_id", "producer_id", "source", "process", "ts", "seq", "idx", "logger",
        "level", "message", "exc_text", "worker", "key",
    ),
    "worker_exits": (
        "cluster_id", "worker", "pid", "ts", "exitcode", "signal", "memory", "memory_peak",
        "memory_limit", "memory_terminate", "host_memory", "host_memory_available",
        "nanny_status", "starts", "started", "producer_id",
    ),
    "drops": (
        "cluster_id", "producer_id", "source", "ts", "dropped_events", "dropped_bytes",
        "since", "until",
    ),
    "span_state": (
        "cluster_id", "cluster_name", "span_id", "name", "parent_id", "version",
        "enqueued", "start", "stop", "duration", "nbytes_total", "states",
        "all_durations", "cumulative_worker_metrics.context",
        "cumulative_worker_metrics.prefix", "cumulative_worker_metrics.activity",
        "cumulative_worker_metrics.unit", "cumulative_worker_metrics.value", "done",
        "updated_at", "nthreads_intervals.begin", "nthreads_intervals.end",
        "nthreads_intervals.nthreads", "active_cpu_seconds",
    ),
    "prefix_stats": (
        "cluster_id", "cluster_name", "span_id", "prefix", "window_start", "partial_id",
        "finished", "durations", "nbytes", "n_erred", "max_duration",
    ),
    "gaps": (
        "cluster_id", "producer_id", "source", "missing_from", "missing_to",
        "detected_at",
    ),
    "dead_letters": (
        "origin", "topic", "partition", "offset", "key", "reason", "payload",
        "detected_at",
    ),
}

#: Tables the sink writes (everything with a ``_batch`` column).
TABLES: tuple[str, ...] = tuple(COLUMNS)

#: The page aggregates (sinks/sql/006_page_aggregates.sql): ClickHouse's materialized
#: views fill them from the rows of the tables above as they are inserted, a row per
#: sink batch (``_batch``), so that an abandoned batch's aggregate rows are deleted
#: with it.
AGGREGATES: tuple[str, ...] = ("task_seconds", "stream_seconds", "group_totals", "digest_totals")

#: Columns held as :class:`FlatLists` (lists built a whole envelope at a time).
FLAT_LIST_COLUMNS = frozenset({
    "startstops.action", "startstops.start", "startstops.stop", "startstops.source",
    "total_nthreads.time", "total_nthreads.nthreads",
})


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """One Kafka record as the sink received it. ``topic`` is the contract topic
    (``contract.RAW``, ...), ``kafka_topic`` the full topic name."""

    topic: str
    kafka_topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: int  # Kafka's, milliseconds

    def key_text(self) -> str:
        return self.key.decode("utf-8", "replace") if self.key is not None else ""


#: Where a row came from: its message, and the event's index in it (None: the whole
#: message, or a derived record that is not in a list).
Ref = tuple[Message, "int | None"]


@dataclasses.dataclass(slots=True)
class Envelope:
    """What every event row of one envelope shares."""

    cluster_id: str
    source: str
    producer_id: str
    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """Several rows of one table at once, as columns (what a converter may yield
    instead of a row)."""

    columns: list[list]
    n_rows: int


class FlatLists:
    """A column of lists as one flat sequence of values and the length of each row's
    list (what Arrow's ListArray is made of)."""

    __slots__ = ("values", "lengths")

    def __init__(self, values: list, lengths: list[int]) -> None:
        self.values = values
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        start = 0
        for n in self.lengths:
            yield self.values[start:start + n]
            start += n

    def append(self, row: list) -> None:
        self.values.extend(row)
        self.lengths.append(len(row))

    def extend(self, rows) -> None:
        if isinstance(rows, FlatLists):
            self.values.extend(rows.values)
            self.lengths.extend(rows.lengths)
        else:
            for row in rows:
                self.append(row)

    def __getitem__(self, rows: slice) -> FlatLists:
        lo, hi, _ = rows.indices(len(self.lengths))
        start = sum(self.lengths[:lo])
        lengths = self.lengths[lo:hi]
        return FlatLists(self.values[start:start + sum(lengths)], lengths)


class TableData:
    """One table's rows as columns, each row with the (message, event index) it came
    from (event index None: the whole message). Rows appended one at a time wait in
    a list and join the columns in one transposition when the columns are read."""

    __slots__ = ("_columns", "_rows", "refs")

    def __init__(self, table: str) -> None:
        self._columns: list = [FlatLists([], []) if name in FLAT_LIST_COLUMNS else []
                               for name in COLUMNS[table]]
        self._rows: list[tuple] = []
        self.refs: list[Ref] = []

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def columns(self) -> list[list]:
        if self._rows:
            for column, values in zip(self._columns, zip(*self._rows), strict=True):
                column.extend(values)
            self._rows = []
        return self._columns

    def append(self, row: tuple, ref: Ref) -> None:
        if len(row) != len(self._columns):
            raise ValueError(f"a row of {len(row)} values for {len(self._columns)} columns")
        self._rows.append(row)
        self.refs.append(ref)

    def extend(self, columns: list[list], refs: list[Ref]) -> None:
        for column, values in zip(self.columns, columns, strict=True):
            column.extend(values)
        self.refs.extend(refs)
