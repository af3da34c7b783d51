"""Turning Kafka messages into ClickHouse rows.

A :class:`Batch` collects the messages the sink loads together. Each message is
decoded and converted as it is added: raw envelopes become a row of ``envelopes`` and
rows of one table per event kind, derived records (span state, prefix partials,
gaps, the processors' dead letters) one row each. Every value is checked on the way
(types, ranges, plausible timestamps), so what ClickHouse receives is well typed;
whatever fails a check becomes a ``dead_letters`` row naming the message, the event,
the field and the problem, and the rest of the message is still loaded.

A raw envelope takes one of two paths. The typed path decodes it with msgspec into
structs whose field types are the checks (``_KINDS``), so that decoding and checking
are one pass in C, and converts each kind's events a column at a time: this is what
makes the sink fast, and what producers' envelopes take. Anything irregular (a wrong
type, an unknown kind, a bad value) sends the whole envelope down the checked path
instead: decoded with orjson and converted event by event, value by value, to find
out which event is wrong and why. Both give the same rows for what both accept.

Rows are kept as columns (one Python list per column, in :data:`COLUMNS` order).
Times are kept as float seconds, and text columns hold None for the empty string; the
loader turns them into ClickHouse's DateTime64 and '' in bulk (sinks.arrow).

Each row keeps a reference to the message (and event) it came from, so a row
ClickHouse rejects can be dead-lettered precisely (see ``sinks.loader``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import sys
import time
import zlib
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import msgspec
import orjson

from dask_blackbox import contract

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
        "exception", "traceback", "cause",
    ),
    "graphs": (
        "cluster_id", "ts", "client", "stimulus_id", "n_tasks", "keys", "annotations",
    ),
    "graph_tasks": (
        "cluster_id", "key", "ts", "stimulus_id", "prefix", "task_group", "span_id",
        "dependencies",
    ),
    "events": ("cluster_id", "topic", "ts", "source", "seq", "idx", "msg"),
    "spans": ("cluster_id", "span_id", "name", "parent_id", "enqueued", "ts"),
    "lifecycle": (
        "cluster_id", "ts", "action", "worker", "client", "reason", "stimulus_id",
        "detail",
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
        "level", "message", "exc_text",
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
        "updated_at",
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

#: Columns held as :class:`FlatLists` (they hold one or more values per transition).
FLAT_LIST_COLUMNS = frozenset({"startstops.action", "startstops.start", "startstops.stop",
                               "startstops.source"})

#: Event times outside [2000-01-01, now + 1 day] come from a broken clock.
_EARLIEST = 946_684_800.0
_LATEST_AHEAD = 86_400.0
#: Any time must fit ClickHouse's DateTime64 (up to 2299) as microseconds.
_TIME_MAX = 1e10
#: Cap on a dead letter's payload text, as in the contract's DEAD_LETTER_FIELDS.
PAYLOAD_MAX = 64 * 1024

_NONE = type(None)


class Invalid(ValueError):
    """A value does not have the type or range its column needs; says which and why."""


class _Irregular(Exception):
    """A column of values needs a closer look, event by event."""


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


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


# ------------------------------------------------------------ one value at a time
# Each checker takes (value, field, now) and returns the value as its column stores
# it, or raises Invalid naming the field.


def _time(value, field, now=None):
    """Seconds since the epoch (float seconds are what time columns hold)."""
    if type(value) not in (float, int) or not math.isfinite(value) or not 0 <= value <= _TIME_MAX:
        raise Invalid(f"{field}: {value!r:.80} is not a time in seconds since the epoch")
    return value


def _event_time(value, field, now):
    """When an event happened: a time, and a plausible one."""
    _time(value, field)
    if not _EARLIEST <= value <= now + _LATEST_AHEAD:
        raise Invalid(
            f"{field}: {value!r} is not a plausible time (before 2000 or more than a day "
            "ahead of the sink's clock: a broken producer clock?)"
        )
    return value


def _text(value, field, now=None):
    """A string column: None stays None (''), numbers are written out, anything else is
    invalid."""
    if type(value) is str or value is None:
        return value
    if type(value) in (int, float):
        return repr(value)
    raise Invalid(f"{field}: expected a string, got {type(value).__name__}")


def _key(value, field, now=None):
    if type(value) is not str:
        raise Invalid(f"{field}: a key must be a string (contract.encode_key), got {value!r:.80}")
    return value


def _int_or_none(value, field, now=None):
    if value is None:
        return None
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise Invalid(f"{field}: {value!r:.80} is not an integer")
    return value


def _count_or_none(value, field, now=None):
    n = _int_or_none(value, field)
    if n is not None and not 0 <= n < 2**32:
        raise Invalid(f"{field}: {value!r} is not a count (0 <= n < 2**32)")
    return n


def _float_or_none(value, field, now=None):
    if value is None:
        return None
    if type(value) not in (float, int):
        raise Invalid(f"{field}: {value!r:.80} is not a number")
    return float(value)


def _required(check):
    """``check`` of a value that must be present: None is "missing"."""
    def required(value, field, now=None):
        if value is None:
            raise Invalid(f"{field}: missing")
        return check(value, field)
    return required


_int = _required(_int_or_none)
_count = _required(_count_or_none)
_float = _required(_float_or_none)


def _json_text(value, field, now=None):
    return _json(value)


def _list(value, field) -> list:
    if value is None:
        return []
    if type(value) is not list:
        raise Invalid(f"{field}: expected a list, got {type(value).__name__}")
    return value


def _keys(value, field, now=None):
    return [_key(k, field) for k in _list(value, field)]


def _name(value, field, now=None):
    """A span name: Dask's tuple of tags (a list on the wire; a string is one tag)."""
    if type(value) is str:
        return [value]
    return [_text(tag, field) for tag in _list(value, field)]


def _mapping(number: Callable) -> Callable:
    def check(value, field, now=None):
        if value is None:
            return {}
        if type(value) is not dict:
            raise Invalid(f"{field}: expected an object, got {type(value).__name__}")
        return {_text(k, field): number(v, f"{field}[{k!r}]") for k, v in value.items()}
    return check


def _startstops(value, field, now=None):
    """Dask's startstops: four columns (action, start, stop, source) of lists."""
    actions, starts, stops, sources = [], [], [], []
    for ss in _list(value, field):
        if type(ss) is not dict:
            raise Invalid(f"{field}: each entry must be an object")
        actions.append(_text(ss.get("action"), f"{field}.action"))
        starts.append(_time(ss.get("start"), f"{field}.start"))
        stops.append(_time(ss.get("stop"), f"{field}.stop"))
        sources.append(_text(ss.get("source"), f"{field}.source"))
    return actions, starts, stops, sources


# --------------------------------------------------------- a column at a time
# The typed path: msgspec decodes a whole envelope into structs whose field types carry
# the checks above (types, ranges; see _TYPED), so what remains per column is at most
# one pass: '' for None, the upper bound of event times (which moves with the sink's
# clock), JSON text. Each takes the values of one field and returns the column, or
# raises _Irregular to send the message down the checked path.


def _col_as_is(values, now):
    return values


def _col_text_or_number(values, now):
    return [_text(v, "") for v in values]


def _col_event_time(values, now):
    if values and max(values) > now + _LATEST_AHEAD:
        raise _Irregular
    return values


def _col_json(values, now):
    return [_json(v) for v in values]


def _col_map(values, now):
    return [{} if v is None else v for v in values] if None in values else values


def _col_startstops(values, now):
    """Dask's startstops, all of an envelope's at once, kept flat with the row
    lengths: no list per row."""
    lists = [v or () for v in values] if None in values else values
    lengths = list(map(len, lists))
    entries = [s for entries in lists for s in entries]
    columns = zip(*map(msgspec.structs.astuple, entries)) if entries else ((),) * 4
    return [FlatLists(column, lengths) for column in columns]


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


@dataclasses.dataclass(frozen=True)
class Field:
    """A column (or, for startstops, several) taken from an event field."""

    name: str
    check: Callable     # one value: (value, field, now) -> stored value, or Invalid
    typed: Any          # the msgspec type that checks a value on the typed path
    column: Callable    # all values, typed: (values, now) -> column, or _Irregular
    width: int = 1


def _field(name: str, kind: str) -> Field:
    return Field(name, *_KINDS[kind])


_Time = Annotated[float, msgspec.Meta(ge=0, le=_TIME_MAX)]
_Count = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
_Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# Finite: the checked path's orjson refuses a number like 1e400, msgspec makes it inf.
_Number = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]


class _StartStop(msgspec.Struct, kw_only=True, gc=False):
    # In the order of the startstops.* columns (see _col_startstops).
    action: str | None = None
    start: _Time
    stop: _Time
    source: str | None = None


#: Field kind -> (check, typed, column[, width]) of its Field. A typed value must be
#: one the check accepts unchanged, or the two paths would give different rows.
_KINDS: dict[str, tuple] = {
    "text": (_text, str | None, _col_as_is),
    "text|number": (_text, str | int | float | None, _col_text_or_number),
    "key": (_key, str, _col_as_is),
    "event_time": (_event_time, Annotated[float, msgspec.Meta(ge=_EARLIEST, le=_TIME_MAX)],
                   _col_event_time),
    "int?": (_int_or_none, _Int64 | None, _col_as_is),
    "count?": (_count_or_none, _Count | None, _col_as_is),
    "float?": (_float_or_none, _Number | None, _col_as_is),
    "json": (_json_text, Any, _col_json),
    "map:count": (_mapping(_count), dict[str, _Count] | None, _col_map),
    "startstops": (_startstops, list[_StartStop] | None, _col_startstops, 4),
}

#: Event kinds with one row per event: the table and, per column (or group of
#: columns), where it comes from: an event field, or ``"$<name>"`` for a value of the
#: envelope (cluster_id, source, producer_id, seq) or the event's index in it (idx).
EVENT_LAYOUTS: dict[str, tuple[str, tuple]] = {
    contract.TRANSITION: ("transitions", (
        "$cluster_id", _field("key", "key"), _field("ts", "event_time"), _field("start", "text"),
        _field("finish", "text"), _field("stimulus_id", "text"), "$source", "$seq", "$idx",
        _field("prefix", "text"), _field("group", "text"), _field("span_id", "text"), _field("worker", "text"),
        _field("nbytes", "int?"), _field("typename", "text"), _field("startstops", "startstops"),
        _field("exception", "text"), _field("traceback", "text"), _field("cause", "text"),
    )),
    contract.EVENT: ("events", (
        "$cluster_id", _field("topic", "text"), _field("ts", "event_time"), "$source", "$seq", "$idx",
        _field("msg", "json"),
    )),
    contract.LIFECYCLE: ("lifecycle", (
        "$cluster_id", _field("ts", "event_time"), _field("action", "text"), _field("worker", "text"),
        _field("client", "text"), _field("reason", "text"), _field("stimulus_id", "text"), _field("detail", "json"),
    )),
    contract.SCHEDULER_METRICS: ("scheduler_metrics", (
        "$cluster_id", _field("ts", "event_time"), _field("tasks_by_state", "map:count"),
        _field("n_workers", "count?"), _field("n_threads", "count?"), _field("memory", "int?"),
        _field("memory_managed", "int?"), _field("memory_unmanaged", "int?"),
        _field("memory_spilled", "int?"), _field("event_loop_interval", "float?"),
    )),
    contract.WORKER_METRICS: ("worker_metrics", (
        "$cluster_id", _field("worker", "text"), "$producer_id", _field("ts", "event_time"),
        _field("memory", "int?"), _field("memory_managed", "int?"), _field("memory_unmanaged", "int?"),
        _field("memory_spilled", "int?"), _field("cpu", "float?"), _field("executing", "count?"),
        _field("ready", "count?"), _field("in_flight", "count?"), _field("event_loop_interval", "float?"),
        _field("gil_contention", "float?"),
    )),
    contract.LOG: ("logs", (
        "$cluster_id", "$producer_id", "$source", _field("process", "text|number"), _field("ts", "event_time"),
        "$seq", "$idx", _field("logger", "text"), _field("level", "text"), _field("message", "text"),
        _field("exc_text", "text"),
    )),
}


#: The event fields each layout reads, in layout order (its typed struct's order).
_FIELDS = {kind: tuple(s.name for s in layout if not isinstance(s, str))
           for kind, (_, layout) in EVENT_LAYOUTS.items()}


@dataclasses.dataclass(slots=True)
class _Envelope:
    """What every event row of one envelope shares."""

    cluster_id: str
    source: str
    producer_id: str
    seq: int


# ------------------------------------------------- kinds with their own shape


_TASK_FIELDS = ("key", "prefix", "group", "span_id", "dependencies")
_task_fields = operator.itemgetter(*_TASK_FIELDS)


def _types(values) -> set:
    return set(map(type, values))


def _texts(values: list) -> list:
    """A column of text, or _Irregular."""
    if _types(values) <= {str, _NONE}:
        return values
    raise _Irregular


def _graph_task_columns(tasks: list) -> list:
    """The tasks of a graph event as columns (key, prefix, group, span_id,
    dependencies); raises Invalid naming the first bad task."""
    if _types(tasks) <= {dict}:
        try:
            keys, prefixes, groups, spans, dependencies = (list(c) for c in zip(*map(_task_fields, tasks)))
            lists = dependencies if _types(dependencies) <= {list} else [d or [] for d in dependencies]
            if _types(keys) <= {str} and _types([d for ds in lists for d in ds]) <= {str}:
                return [keys, _texts(prefixes), _texts(groups), _texts(spans), lists]
        except (KeyError, _Irregular, TypeError):
            pass
    rows = []
    for task in tasks:  # find the bad task, and say what is wrong with it
        if type(task) is not dict:
            raise Invalid("tasks: each entry must be an object")
        rows.append((_key(task.get("key"), "tasks.key"), _text(task.get("prefix"), "tasks.prefix"),
                     _text(task.get("group"), "tasks.group"), _text(task.get("span_id"), "tasks.span_id"),
                     _keys(task.get("dependencies"), "tasks.dependencies")))
    return [list(c) for c in zip(*rows)] if rows else [[] for _ in _TASK_FIELDS]


def _graph(env: _Envelope, ev: dict, now: float):
    """A graph event: one ``graphs`` row, and a block of ``graph_tasks`` columns."""
    ts = _event_time(ev["ts"], "ts", now)
    stimulus_id = _text(ev.get("stimulus_id"), "stimulus_id")
    tasks = _list(ev.get("tasks"), "tasks")
    key, prefix, group, span_id, dependencies = _graph_task_columns(tasks)
    n_tasks = ev.get("n_tasks")
    yield "graphs", (
        env.cluster_id, ts, _text(ev.get("client"), "client"), stimulus_id,
        _count(len(tasks) if n_tasks is None else n_tasks, "n_tasks"),
        _keys(ev.get("keys"), "keys"), _json(ev.get("annotations")),
    )
    n = len(tasks)
    yield "graph_tasks", _Block([[env.cluster_id] * n, key, [ts] * n, [stimulus_id] * n,
                                 prefix, group, span_id, dependencies], n)


def _span(env: _Envelope, ev: dict, now: float):
    ts = _event_time(ev["ts"], "ts", now)
    enqueued = ev.get("enqueued")
    yield "spans", (
        env.cluster_id, _text(ev.get("span_id"), "span_id"), _name(ev.get("name"), "name"),
        _text(ev.get("parent_id"), "parent_id"),
        ts if enqueued is None else _time(enqueued, "enqueued"), ts,
    )


def _worker_digests(env: _Envelope, ev: dict, now: float):
    ts = _event_time(ev["ts"], "ts", now)
    worker = _text(ev.get("worker"), "worker")
    rows = []
    for row in _list(ev.get("digests"), "digests"):
        if type(row) is not list or len(row) != len(contract.DIGEST_ROW):
            raise Invalid(f"digests: each row must be a list {list(contract.DIGEST_ROW)}")
        context, span_id, prefix, activity, unit, value = row
        rows.append((
            env.cluster_id, worker, ts, _text(context, "context"), _text(span_id, "span_id"),
            _text(prefix, "prefix"), _text(activity, "activity"), _text(unit, "unit"),
            _float(value, "value"),
        ))
    for row in rows:
        yield "worker_digests", row


def _drops(env: _Envelope, ev: dict, now: float):
    ts = _event_time(ev["ts"], "ts", now)
    since, until = ev.get("since"), ev.get("until")
    yield "drops", (
        env.cluster_id, env.producer_id, env.source, ts,
        _count(ev.get("dropped_events") or 0, "dropped_events"),
        _count(ev.get("dropped_bytes") or 0, "dropped_bytes"),
        ts if since is None else _time(since, "since"),
        ts if until is None else _time(until, "until"),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Block:
    """Several rows of one table at once, as columns (what a converter may yield
    instead of a row)."""

    columns: list[list]
    n_rows: int


#: Event kinds converted event by event: kind -> generator of (table, row or _Block).
EVENT_CONVERTERS: dict[str, Callable] = {
    contract.GRAPH: _graph,
    contract.SPAN: _span,
    contract.WORKER_DIGESTS: _worker_digests,
    contract.DROPS: _drops,
}


# ------------------------------------------------------------ derived records


def _span_state(rec: dict, now: float):
    columns: list[list] = [[], [], [], [], []]
    for row in _list(rec.get("cumulative_worker_metrics"), "cumulative_worker_metrics"):
        if type(row) is not list or len(row) != 5:
            raise Invalid("cumulative_worker_metrics: each row must be "
                          "[context, prefix, activity, unit, value]")
        for i, field in enumerate(("context", "prefix", "activity", "unit")):
            columns[i].append(_text(row[i], field))
        columns[4].append(_float(row[4], "value"))
    stop, updated_at = rec.get("stop"), rec.get("updated_at")
    yield "span_state", (
        _text(rec["cluster_id"], "cluster_id"), _text(rec.get("cluster_name"), "cluster_name"),
        _text(rec["span_id"], "span_id"), _name(rec.get("name"), "name"),
        _text(rec.get("parent_id"), "parent_id"), _int(rec["version"], "version"),
        _time(rec["enqueued"], "enqueued"), _time(rec.get("start") or 0, "start"),
        _time(now if stop is None else stop, "stop"), _float(rec.get("duration") or 0, "duration"),
        _int(rec.get("nbytes_total") or 0, "nbytes_total"),
        _mapping(_int)(rec.get("states"), "states"),
        _mapping(_float)(rec.get("all_durations"), "all_durations"),
        *columns, bool(rec.get("done")),
        _time(now if updated_at is None else updated_at, "updated_at"),
    )


def _prefix_stats(rec: dict, now: float):
    yield "prefix_stats", (
        _text(rec["cluster_id"], "cluster_id"), _text(rec.get("cluster_name"), "cluster_name"),
        _text(rec["span_id"], "span_id"), _text(rec["prefix"], "prefix"),
        _time(rec["window_start"], "window_start"), _text(rec["partial_id"], "partial_id"),
        _mapping(_count)(rec.get("finished"), "finished"),
        _mapping(_float)(rec.get("durations"), "durations"),
        _int(rec.get("nbytes") or 0, "nbytes"), _count(rec.get("n_erred") or 0, "n_erred"),
        _float(rec.get("max_duration") or 0, "max_duration"),
    )


def _gap(rec: dict, now: float):
    missing_from, missing_to = _int(rec["missing_from"], "missing_from"), _int(rec["missing_to"], "missing_to")
    if not 0 <= missing_from <= missing_to:
        raise Invalid(f"missing_from {missing_from} and missing_to {missing_to} are not a range")
    detected_at = rec.get("detected_at")
    yield "gaps", (
        _text(rec["cluster_id"], "cluster_id"), _text(rec["producer_id"], "producer_id"),
        _text(rec.get("source"), "source"), missing_from, missing_to,
        _time(now if detected_at is None else detected_at, "detected_at"),
    )


def _processor_dead_letter(rec: dict, now: float):
    detected_at, offset = rec.get("detected_at"), rec.get("offset")
    yield "dead_letters", (
        "processor", _text(rec.get("topic"), "topic"), _count(rec.get("partition") or 0, "partition"),
        _int(-1 if offset is None else offset, "offset"), _text(rec.get("key"), "key"),
        _text(rec["reason"], "reason"), (_text(rec.get("payload"), "payload") or "")[:PAYLOAD_MAX],
        _time(now if detected_at is None else detected_at, "detected_at"),
    )


#: Derived topic -> (required fields, generator of (table, row) pairs).
RECORD_CONVERTERS: dict[str, tuple[tuple[str, ...], Callable]] = {
    contract.SPAN_STATE: (("cluster_id", "span_id", "version", "enqueued"), _span_state),
    contract.PREFIX_STATS: (
        ("cluster_id", "span_id", "prefix", "window_start", "partial_id"), _prefix_stats,
    ),
    contract.GAPS: (("cluster_id", "producer_id", "missing_from", "missing_to"), _gap),
    contract.DEAD_LETTER: (("reason",), _processor_dead_letter),
}


# ------------------------------------------------------------ the typed envelope


def _optional(field: Field) -> bool:
    """Whether an event may leave ``field`` out (its check accepts None)."""
    try:
        field.check(None, field.name, 0.0)
    except Invalid:
        return False
    return True


def _event_struct(kind: str) -> type:
    """The msgspec struct of one event kind, tagged by ``kind``. The fields of kinds
    in EVENT_LAYOUTS are typed; the other kinds' converters check their own fields,
    which take any JSON value here. Every kind has ``ts``, as the contract says."""
    if kind in EVENT_LAYOUTS:  # fields in _FIELDS order, which _typed_columns relies on
        fields = [(f.name, f.typed, None) if _optional(f) else (f.name, f.typed)
                  for f in EVENT_LAYOUTS[kind][1] if isinstance(f, Field)]
    else:
        fields = [("ts", Any), *((name, Any, None) for name in contract.EVENT_FIELDS[kind])]
    return msgspec.defstruct(f"Typed_{kind}", fields, tag_field="kind", tag=kind, kw_only=True,
                             gc=False)


#: Struct type -> event kind, for every kind the sink loads.
_STRUCT_KINDS: dict[type, str] = {_event_struct(kind): kind
                                  for kind in (*EVENT_LAYOUTS, *EVENT_CONVERTERS)}
_TypedEvent = Union[tuple(_STRUCT_KINDS)]
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class _TypedEnvelope(msgspec.Struct, gc=False):
    """An envelope as contract.validate_envelope accepts it, each event of a known
    kind and typed."""

    schema: Literal[contract.SCHEMA_VERSION]
    cluster_id: _NonEmpty
    cluster_name: str
    source: _NonEmpty
    producer_id: _NonEmpty
    seq: _Count
    sent_at: _Time
    events: list[_TypedEvent]


_decode_envelope = msgspec.json.Decoder(_TypedEnvelope).decode
_FINISH = COLUMNS["transitions"].index("finish")


def _envelope_column(source: str, env: _Envelope, indexes: list[int]) -> list:
    """The column of an EVENT_LAYOUTS ``"$<name>"`` source for events ``indexes``."""
    if source == "$idx":
        return indexes
    return [getattr(env, source[1:])] * len(indexes)


def _typed_columns(kind: str, env: _Envelope, events: list, indexes: list[int], now: float) -> list:
    """The columns (EVENT_LAYOUTS order) of typed ``events`` of a kind, at ``indexes``
    in their envelope; raises _Irregular if a column needs the checked path."""
    layout = EVENT_LAYOUTS[kind][1]
    # One C-level call per event, and one transposition for all of them.
    by_field = dict(zip(_FIELDS[kind], zip(*map(msgspec.structs.astuple, events))))
    columns = []
    for source in layout:
        if isinstance(source, str):
            columns.append(_envelope_column(source, env, indexes))
        elif source.width == 1:
            columns.append(source.column(by_field[source.name], now))
        else:
            columns.extend(source.column(by_field[source.name], now))
    return columns


# ----------------------------------------------------------------------- batch


class TableData:
    """One table's rows as columns, each row with the (message, event index) it came
    from (event index None: the whole message). Rows appended one at a time wait in
    a list and join the columns in one transposition when the columns are read."""

    __slots__ = ("_columns", "_rows", "refs")

    def __init__(self, table: str) -> None:
        self._columns: list = [FlatLists([], []) if name in FLAT_LIST_COLUMNS else []
                               for name in COLUMNS[table]]
        self._rows: list[tuple] = []
        self.refs: list[tuple[Message, int | None]] = []

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def columns(self) -> list[list]:
        if self._rows:
            for column, values in zip(self._columns, zip(*self._rows), strict=True):
                column.extend(values)
            self._rows = []
        return self._columns

    def append(self, row: tuple, ref: tuple[Message, int | None]) -> None:
        if len(row) != len(self._columns):
            raise ValueError(f"a row of {len(row)} values for {len(self._columns)} columns")
        self._rows.append(row)
        self.refs.append(ref)

    def extend(self, columns: list[list], refs: list[tuple[Message, int | None]]) -> None:
        for column, values in zip(self.columns, columns, strict=True):
            column.extend(values)
        self.refs.extend(refs)


class Batch:
    """Messages the sink loads and commits together, already converted to rows.

    ``positions`` maps ``(kafka_topic, partition)`` to the offset after the last
    message added: what gets committed once the batch is loaded. ``firsts`` holds the
    Kafka timestamp and value CRC-32 of each partition's first message: the
    fingerprint that tells one broker incarnation's offsets from another's.
    """

    def __init__(self) -> None:
        self.tables: dict[str, TableData] = {name: TableData(name) for name in COLUMNS}
        #: Arrow tables built ahead of loading, per table (see Loader.prepare).
        self.arrow: dict = {}
        self.positions: dict[tuple[str, int], int] = {}
        self.firsts: dict[tuple[str, int], tuple[int, int]] = {}
        self.n_messages = 0
        #: Raw messages the typed path refused, converted event by event instead.
        self.n_checked = 0

    @property
    def n_rows(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def add(self, message: Message, now: float | None = None) -> None:
        """Convert ``message`` into rows (or dead letters) of this batch."""
        now = time.time() if now is None else now
        self.n_messages += 1
        tp = (message.kafka_topic, message.partition)
        if tp not in self.firsts:
            self.firsts[tp] = fingerprint(message)
        self.positions[tp] = message.offset + 1
        if message.topic == contract.RAW and self._add_typed(message, now):
            return
        try:
            decoded = orjson.loads(message.value)
        except orjson.JSONDecodeError as e:
            self.dead_letter(message, None, f"not JSON: {e}", now)
            return
        if message.topic == contract.RAW:
            self.n_checked += 1
            self._add_envelope(message, decoded, now)
        else:
            self._add_records(message, decoded, now)

    def dead_letter(self, message: Message, event: int | None, reason: str, now: float,
                    payload: str | None = None) -> None:
        """Record that ``message`` (or its event number ``event``) cannot be loaded."""
        if payload is None:
            payload = message.value.decode("utf-8", "replace")
        self.tables["dead_letters"].append((
            "sink", message.kafka_topic, message.partition, message.offset, message.key_text(),
            reason if event is None else f"event {event}: {reason}", payload[:PAYLOAD_MAX], now,
        ), (message, event))

    # ------------------------------------------------------------- typed path

    def _add_typed(self, message: Message, now: float) -> bool:
        """Add the rows of a raw message whose every value has its type, a column at a
        time. False, with nothing added, when anything in it is irregular (a wrong
        type, an unknown kind, not JSON, ...): the checked path finds out what."""
        try:
            wire = _decode_envelope(message.value)
            env = _Envelope(wire.cluster_id, wire.source, wire.producer_id, wire.seq)
            converted = list(self._typed_rows(message, env, wire.events, now))
        # (ValidationError is a DecodeError. JSONEncodeError: msgspec reads integers of
        # any size, which orjson cannot write back; orjson reads them as floats.)
        except (msgspec.DecodeError, _Irregular, Invalid, orjson.JSONEncodeError):
            return False
        finishes: Any = ()
        for table, data, refs in converted:
            self._put(table, data, refs)
            if table == "transitions" and type(data) is _Block:
                finishes = data.columns[_FINISH]
        self._add_envelope_row(message, env, wire.cluster_name, wire.sent_at, len(wire.events),
                               finishes)
        return True

    @staticmethod
    def _typed_rows(message: Message, env: _Envelope, events: list, now: float):
        """(table, row or _Block, ref or refs) of typed ``events``, a kind at a time."""
        kinds = list(map(type, events))
        distinct = set(kinds)
        for struct in distinct:
            kind = _STRUCT_KINDS[struct]
            if len(distinct) == 1:
                indexes, selected = list(range(len(events))), events
            else:
                mask = list(map(operator.is_, kinds, itertools.repeat(struct)))
                indexes = list(itertools.compress(range(len(events)), mask))
                selected = list(itertools.compress(events, mask))
            if kind in EVENT_LAYOUTS:
                columns = _typed_columns(kind, env, selected, indexes, now)
                yield (EVENT_LAYOUTS[kind][0], _Block(columns, len(indexes)),
                       list(zip(itertools.repeat(message), indexes)))
                continue
            for idx, event in zip(indexes, selected):
                yield from _converted(kind, message, env, msgspec.structs.asdict(event), idx, now)

    def _put(self, table: str, data, refs) -> None:
        """Add a row (``refs``: its reference) or a _Block (a reference per row)."""
        if type(data) is _Block:
            self.tables[table].extend(data.columns, refs)
        else:
            self.tables[table].append(data, refs)

    def _add_envelope_row(self, message: Message, env: _Envelope, cluster_name: str,
                          sent_at: float, n_events: int, finishes) -> None:
        self.tables["envelopes"].append((
            env.cluster_id, cluster_name, env.source, env.producer_id, env.seq, sent_at,
            n_events, len(message.value), len(finishes),
            finishes.count("memory"), finishes.count("erred"), message.partition, message.offset,
        ), (message, None))

    # ----------------------------------------------------------- checked path

    def _add_envelope(self, message: Message, decoded: Any, now: float) -> None:
        """An envelope event by event: what cannot be loaded becomes a dead letter
        that says why, and the rest is loaded."""
        try:
            envelope = contract.validate_envelope(decoded)
            env = _Envelope(envelope["cluster_id"], envelope["source"], envelope["producer_id"],
                            _count(envelope["seq"], "seq"))
            sent_at = _time(envelope["sent_at"], "sent_at")
            cluster_name = _text(envelope["cluster_name"], "cluster_name")
        except (contract.InvalidEnvelope, Invalid) as e:
            self.dead_letter(message, None, str(e), now)
            return
        events = envelope["events"]
        finishes = []
        for idx, event in enumerate(events):
            kind = event["kind"]
            if kind == contract.TRANSITION:
                finishes.append(event.get("finish"))
            if kind in EVENT_LAYOUTS:
                table, layout = EVENT_LAYOUTS[kind]
                try:
                    row = _layout_row(layout, env, event, idx, now)
                except Invalid as e:
                    self.dead_letter(message, idx, f"{kind}: {e}", now, _json(event))
                    continue
                self.tables[table].append(row, (message, idx))
            elif kind in EVENT_CONVERTERS:
                self._add_converted(kind, message, env, events, idx, now)
            else:
                self.dead_letter(message, idx, f"unknown event kind {kind!r}", now, _json(event))
        self._add_envelope_row(message, env, cluster_name, sent_at, len(events), finishes)

    def _add_converted(self, kind: str, message: Message, env: _Envelope, events: list,
                       idx: int, now: float) -> None:
        try:
            converted = list(_converted(kind, message, env, events[idx], idx, now))
        except Invalid as e:
            self.dead_letter(message, idx, f"{kind}: {e}", now, _json(events[idx]))
            return
        for table, data, refs in converted:
            self._put(table, data, refs)

    def _add_records(self, message: Message, decoded: Any, now: float) -> None:
        required, convert = RECORD_CONVERTERS[message.topic]
        records = decoded if type(decoded) is list else [decoded]
        for i, record in enumerate(records):
            event = i if type(decoded) is list else None
            if type(record) is not dict:
                self.dead_letter(message, event, f"a {message.topic} record must be an object", now)
                continue
            try:
                missing = [f for f in required if record.get(f) is None]
                if missing:
                    raise Invalid(f"lacks field(s) {', '.join(missing)}")
                converted = list(convert(record, now))
            except Invalid as e:
                self.dead_letter(message, event, f"{message.topic}: {e}", now)
                continue
            for table, row in converted:
                self.tables[table].append(row, (message, event))


def _converted(kind: str, message: Message, env: _Envelope, event: dict, idx: int, now: float):
    """(table, row or _Block, reference or references) of event ``idx`` of a kind in
    EVENT_CONVERTERS; raises Invalid."""
    ref = (message, idx)
    for table, row in EVENT_CONVERTERS[kind](env, event, now):
        yield table, row, ([ref] * row.n_rows if type(row) is _Block else ref)


def _layout_row(layout: tuple, env: _Envelope, event: dict, idx: int, now: float) -> tuple:
    """One event of a kind in EVENT_LAYOUTS, value by value (the slow path, which names
    the field at fault)."""
    row = []
    for source in layout:
        if isinstance(source, str):
            row.append(idx if source == "$idx" else getattr(env, source[1:]))
        elif source.width == 1:
            row.append(source.check(event.get(source.name), source.name, now))
        else:
            row.extend(source.check(event.get(source.name), source.name, now))
    return tuple(row)


def fingerprint(message: Message) -> tuple[int, int]:
    """(Kafka timestamp, CRC-32 of the value): what identifies a message beyond its
    offset, which a new broker incarnation reuses."""
    return message.timestamp, zlib.crc32(message.value)


def payload_of(message: Message, event: int | None) -> str:
    """The text to keep in a dead letter for ``message`` / its event ``event``."""
    if event is not None:
        try:
            decoded = orjson.loads(message.value)
            items = decoded["events"] if type(decoded) is dict else decoded
            return _json(items[event])[:PAYLOAD_MAX]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            pass
    return message.value.decode("utf-8", "replace")[:PAYLOAD_MAX]
