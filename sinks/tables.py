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

import bisect
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
    "profiles": ("cluster_id", "worker", "prefix", "ts", "stack", "count"),
    "stacks": (
        "cluster_id", "worker", "pid", "ts", "reason", "memory", "memory_limit", "silent",
        "error", "thread", "thread_id", "active", "gil", "stack", "producer_id",
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
#: The roll-ups (sinks/sql/008_rollups.sql), in the database ``<database>_rollups``,
#: filled and deleted the same way, and kept far longer than the raw rows.
ROLLUPS: tuple[str, ...] = ("task_minutes", "worker_minutes", "cluster_minutes")

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

    columns: list
    n_rows: int


class Coded:
    """A column of few distinct values, as those values and each row's index into
    them (a transition run's prefix, group and span id: its ``names`` and ``name``).
    Arrow takes it as it is; iterating gives the values."""

    __slots__ = ("values", "index")

    def __init__(self, values: list, index: list[int]) -> None:
        self.values = values
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self):
        return map(self.values.__getitem__, self.index)

    def __getitem__(self, rows: slice) -> Coded:
        return Coded(self.values, self.index[rows])


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


#: Blocks of fewer rows than this join the rows before them (a copy); larger ones are
#: kept as they came, a chunk each, and become Arrow arrays chunk by chunk.
CHUNK_MIN_ROWS = 512


class Refs:
    """Where each row of a table came from: the :data:`Ref` (message, event index)
    of row ``i`` is ``refs[i]``; iterating gives every row's in order. Kept as a
    segment per message (its rows' event indexes, a ``range`` for a run), not a
    tuple per row."""

    __slots__ = ("_starts", "_messages", "_events", "_open", "_n")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._messages: list[Message] = []
        self._events: list = []
        self._open = False  # whether the last segment is a list of this object's own
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        for message, events in zip(self._messages, self._events):
            for event in events:
                yield message, event

    def __getitem__(self, row: int) -> Ref:
        if row < 0:
            row += self._n
        if not 0 <= row < self._n:
            raise IndexError(row)
        k = bisect.bisect_right(self._starts, row) - 1
        return self._messages[k], self._events[k][row - self._starts[k]]

    def append(self, ref: Ref) -> None:
        message, event = ref
        if self._open and self._messages[-1] is message:
            self._events[-1].append(event)
        else:
            self._segment(message, [event])
            self._open = True
        self._n += 1

    def add(self, message: Message, events) -> None:
        """The rows of a block of ``message``: ``events`` holds each row's event index
        (a sequence, kept as it is)."""
        if len(events):
            self._segment(message, events)
            self._open = False
            self._n += len(events)

    def extend(self, refs) -> None:
        for ref in refs:
            self.append(ref)

    def _segment(self, message: Message, events) -> None:
        self._starts.append(self._n)
        self._messages.append(message)
        self._events.append(events)


class TableData:
    """One table's rows as columns, each row with the (message, event index) it came
    from (event index None: the whole message), in the order they were added.

    The columns are held in *chunks*: a large block (a transition run) is kept as the
    columns it came in (lists, :class:`FlatLists`, :class:`Coded`, a ``range``),
    never copied, or as the raw Arrow arrays the batch made of them at once (an
    object with a ``python()`` method giving its columns back: sinks.arrow's
    ArrowChunk); rows appended one at a time and small blocks are gathered into a
    chunk of this object's own (rows wait in a list and join it in one
    transposition). :attr:`chunks` gives them for conversion to Arrow;
    :attr:`columns` joins them into one chunk of lists and FlatLists."""

    __slots__ = ("table", "_chunks", "_own", "_rows", "refs")

    def __init__(self, table: str) -> None:
        self.table = table
        self._chunks: list[list] = []
        self._own = False  # whether the last chunk is this object's own (extendable)
        self._rows: list[tuple] = []
        self.refs = Refs()

    def __len__(self) -> int:
        return len(self.refs)

    def _empty(self) -> list:
        return [FlatLists([], []) if name in FLAT_LIST_COLUMNS else []
                for name in COLUMNS[self.table]]

    def _tail(self) -> list:
        """The last chunk, if it is this object's own; else a new one of its own."""
        if not self._own:
            self._chunks.append(self._empty())
            self._own = True
        return self._chunks[-1]

    def _flush_rows(self) -> None:
        if self._rows:
            rows, self._rows = self._rows, []
            for column, values in zip(self._tail(), zip(*rows), strict=True):
                column.extend(values)

    @property
    def chunks(self) -> list[list]:
        """The chunks of columns, in row order (at least one)."""
        self._flush_rows()
        if not self._chunks:
            self._tail()
        return self._chunks

    @property
    def columns(self) -> list[list]:
        """All rows' columns: lists, and FlatLists for columns of lists."""
        chunks = self.chunks
        if len(chunks) > 1 or not self._own:
            joined = self._empty()
            for chunk in chunks:
                if hasattr(chunk, "python"):
                    chunk = chunk.python()
                for column, values in zip(joined, chunk, strict=True):
                    column.extend(values)
            self._chunks, self._own = [joined], True
        return self._chunks[0]

    def append(self, row: tuple, ref: Ref) -> None:
        if len(row) != len(COLUMNS[self.table]):
            raise ValueError(f"a row of {len(row)} values for {len(COLUMNS[self.table])} columns")
        self._rows.append(row)
        self.refs.append(ref)

    def extend(self, columns: list, refs) -> None:
        """Add rows given as columns, with their references (any iterable of Ref)."""
        self._flush_rows()
        for column, values in zip(self._tail(), columns, strict=True):
            column.extend(values)
        self.refs.extend(refs)

    def add_block(self, columns: list, n_rows: int, message: Message, events,
                  chunk=None) -> None:
        """Add the ``n_rows`` rows of a block of ``message`` (``events``: each row's
        event index, a sequence), kept as a chunk of its own if it is large: ``chunk``
        (the block made Arrow arrays, see above), or else the columns as they are."""
        if len(columns) != len(COLUMNS[self.table]):
            raise ValueError(f"a block of {len(columns)} columns for {len(COLUMNS[self.table])}")
        self._flush_rows()
        if n_rows >= CHUNK_MIN_ROWS:
            self._chunks.append(columns if chunk is None else chunk)
            self._own = False
        else:
            for column, values in zip(self._tail(), columns):
                column.extend(values)
        self.refs.add(message, events)
