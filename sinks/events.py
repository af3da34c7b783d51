"""Raw events to rows: one table (or two) per event kind.

Most kinds are one row per event, described by a layout (:data:`EVENT_LAYOUTS`): per
column, an event field with its kind (sinks.typed) or a value of the envelope. Those
are converted a column at a time on the typed path (:func:`typed_columns`) and event
by event on the checked path (:func:`layout_row`), with the same result. The other
kinds (graphs with their tasks, spans, worker digests, drops, profiles, stacks) have a converter of
their own (:data:`EVENT_CONVERTERS`), which checks its event field by field.

What is read is checked against the contract at import (:func:`check_against_contract`):
every field a layout or converter reads is declared for its kind in
``contract.EVENTS`` with a type the field's kind accepts, and every declared field is
either read or listed in :data:`NOT_STORED` with the reason.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from dask_blackbox import contract
from dask_blackbox.sinks import checks, typed
from dask_blackbox.sinks.checks import Invalid
from dask_blackbox.sinks.tables import CHUNK_MIN_ROWS, LATER_KWARGS, Block, Coded, Envelope
from dask_blackbox.sinks.typed import Field, Irregular, field

#: Event kinds with one row per event: the table and, per column (or group of
#: columns), where it comes from: an event field, or ``"$<name>"`` for a value of the
#: envelope (cluster_id, source, producer_id, seq) or the event's index in it (idx).
EVENT_LAYOUTS: dict[str, tuple[str, tuple]] = {
    contract.TRANSITION: ("transitions", (
        "$cluster_id", field("key", "key"), field("ts", "event_time"), field("start", "text"),
        field("finish", "text"), field("stimulus_id", "text"), "$source", "$seq", "$idx",
        field("prefix", "text"), field("group", "text"), field("span_id", "text"),
        field("worker", "text"), field("nbytes", "int?"), field("typename", "text"),
        field("startstops", "startstops"), field("exception", "text"),
        field("traceback", "text"), field("cause", "text"),
        *(field(name, typed.KIND_OF_TYPE[contract.field_types(contract.Transition)[name]])
          for name in LATER_KWARGS),
    )),
    contract.EVENT: ("events", (
        "$cluster_id", field("topic", "text"), field("ts", "event_time"), "$source", "$seq",
        "$idx", field("msg", "json"),
    )),
    contract.LIFECYCLE: ("lifecycle", (
        "$cluster_id", field("ts", "event_time"), field("action", "text"),
        field("worker", "text"), field("client", "text"), field("reason", "text"),
        field("stimulus_id", "text"), field("detail", "json"),
        field("total_nthreads", "[time, count]"),
    )),
    contract.SCHEDULER_METRICS: ("scheduler_metrics", (
        "$cluster_id", field("ts", "event_time"), field("tasks_by_state", "map:count"),
        field("n_workers", "count?"), field("n_threads", "count?"), field("memory", "int?"),
        field("memory_managed", "int?"), field("memory_unmanaged", "int?"),
        field("memory_spilled", "int?"), field("event_loop_interval", "float?"),
    )),
    contract.WORKER_METRICS: ("worker_metrics", (
        "$cluster_id", field("worker", "text"), "$producer_id", field("ts", "event_time"),
        field("memory", "int?"), field("memory_managed", "int?"),
        field("memory_unmanaged", "int?"), field("memory_spilled", "int?"),
        field("cpu", "float?"), field("executing", "count?"), field("ready", "count?"),
        field("in_flight", "count?"), field("event_loop_interval", "float?"),
        field("gil_contention", "float?"),
    )),
    contract.LOG: ("logs", (
        "$cluster_id", "$producer_id", "$source", field("process", "text|number"),
        field("ts", "event_time"), "$seq", "$idx", field("logger", "text"),
        field("level", "text"), field("message", "text"), field("exc_text", "text"),
        field("worker", "text"), field("key", "text"),
    )),
    contract.WORKER_EXIT: ("worker_exits", (
        "$cluster_id", field("worker", "text"), field("pid", "count?"),
        field("ts", "event_time"), field("exitcode", "int?"), field("signal", "text"),
        field("memory", "int?"), field("memory_peak", "int?"), field("memory_limit", "int?"),
        field("memory_terminate", "float?"), field("host_memory", "int?"),
        field("host_memory_available", "int?"), field("nanny_status", "text"),
        field("starts", "count?"), field("started", "time?"), "$producer_id",
    )),
}

#: The typed fields of each layout, in layout order (its typed struct's order).
FIELDS: dict[str, tuple[Field, ...]] = {
    kind: tuple(s for s in layout if isinstance(s, Field))
    for kind, (_, layout) in EVENT_LAYOUTS.items()
}
_FIELD_NAMES = {kind: tuple(f.name for f in fields) for kind, fields in FIELDS.items()}


# ------------------------------------------------- kinds with their own shape

#: A graph task's fields every entry has (key, prefix, group, span_id, dependencies).
_TASK_FIELDS = tuple(f for f in contract.fields(contract.GraphTask)
                     if f in contract.GraphTask.__required_keys__)
_task_fields = operator.itemgetter(*_TASK_FIELDS)
_NONE = type(None)


def _types(values) -> set:
    return set(map(type, values))


def _texts(values: list) -> list:
    """A column of text, or Irregular."""
    if _types(values) <= {str, _NONE}:
        return values
    raise Irregular


def _graph_task_columns(tasks: list) -> list:
    """The tasks of a graph event as columns (key, prefix, group, span_id,
    dependencies, n_dependencies: the true count where the listed ones were capped);
    raises Invalid naming the first bad task."""
    if _types(tasks) <= {dict}:
        try:
            keys, prefixes, groups, spans, dependencies = (
                list(c) for c in zip(*map(_task_fields, tasks))) if tasks else ([],) * 5
            lists = dependencies if _types(dependencies) <= {list} else [d or [] for d in dependencies]
            if _types(keys) <= {str} and _types([d for ds in lists for d in ds]) <= {str}:
                counts = [t.get("n_dependencies") or len(ds) for t, ds in zip(tasks, lists)]
                if _types(counts) <= {int}:
                    return [keys, _texts(prefixes), _texts(groups), _texts(spans), lists,
                            counts]
        except (KeyError, Irregular, TypeError):
            pass
    rows = []
    for i, task in enumerate(tasks):  # find the bad task, and say what is wrong with it
        if type(task) is not dict:
            raise Invalid(f"tasks[{i}]: each entry must be an object")
        rows.append((checks.key(task.get("key"), f"tasks[{i}].key"),
                     checks.text(task.get("prefix"), f"tasks[{i}].prefix"),
                     checks.text(task.get("group"), f"tasks[{i}].group"),
                     checks.text(task.get("span_id"), f"tasks[{i}].span_id"),
                     checks.keys(task.get("dependencies"), f"tasks[{i}].dependencies")))
        rows[-1] += (checks.count(task.get("n_dependencies") or len(rows[-1][4]),
                                  f"tasks[{i}].n_dependencies"),)
    return [list(c) for c in zip(*rows)] if rows else [[] for _ in range(6)]


def _graph(env: Envelope, ev: dict, now: float):
    """A graph event (one part of a submission): its part 0 (or the only one) is the
    ``graphs`` row; every part adds a block of ``graph_tasks`` columns (none when it
    lists no tasks: graph-max-tasks 0)."""
    ts = checks.event_time(ev.get("ts"), "ts", now)
    stimulus_id = checks.text(ev.get("stimulus_id"), "stimulus_id")
    tasks = checks.list_(ev.get("tasks"), "tasks")
    key, prefix, group, span_id, dependencies, n_dependencies = _graph_task_columns(tasks)
    part = checks.count(ev.get("part") or 0, "part")
    checks.count(ev.get("parts") or 1, "parts")
    if part == 0:
        keys = checks.keys(ev.get("keys"), "keys")
        n_tasks = checks.count(len(tasks) if ev.get("n_tasks") is None else ev["n_tasks"],
                               "n_tasks")
        n_recorded, n_keys = ev.get("n_recorded"), ev.get("n_keys")
        yield "graphs", (
            env.cluster_id, ts, checks.text(ev.get("client"), "client"), stimulus_id, n_tasks,
            checks.count(len(tasks) if n_recorded is None else n_recorded, "n_recorded"),
            checks.count(len(keys) if n_keys is None else n_keys, "n_keys"),
            keys, checks.json_text(ev.get("annotations")),
        )
    n = len(tasks)
    if n:
        yield "graph_tasks", Block([[env.cluster_id] * n, key, [ts] * n, [stimulus_id] * n,
                                    prefix, group, span_id, dependencies, n_dependencies], n)


def _span(env: Envelope, ev: dict, now: float):
    ts = checks.event_time(ev.get("ts"), "ts", now)
    enqueued = ev.get("enqueued")
    yield "spans", (
        env.cluster_id, checks.text(ev.get("span_id"), "span_id"),
        checks.name(ev.get("name"), "name"), checks.text(ev.get("parent_id"), "parent_id"),
        ts if enqueued is None else checks.time_(enqueued, "enqueued"), ts,
    )


def _worker_digests(env: Envelope, ev: dict, now: float):
    ts = checks.event_time(ev.get("ts"), "ts", now)
    worker = checks.text(ev.get("worker"), "worker")
    rows = []
    for i, row in enumerate(checks.list_(ev.get("digests"), "digests")):
        if type(row) is not list or len(row) != len(contract.DIGEST_ROW):
            raise Invalid(f"digests[{i}]: each row must be a list {list(contract.DIGEST_ROW)}")
        context, span_id, prefix, activity, unit, value = row
        rows.append((
            env.cluster_id, worker, ts, checks.text(context, "context"),
            checks.text(span_id, "span_id"), checks.text(prefix, "prefix"),
            checks.text(activity, "activity"), checks.text(unit, "unit"),
            checks.float_(value, "value"),
        ))
    for row in rows:
        yield "worker_digests", row


def _drops(env: Envelope, ev: dict, now: float):
    ts = checks.event_time(ev.get("ts"), "ts", now)
    since, until = ev.get("since"), ev.get("until")
    yield "drops", (
        env.cluster_id, env.producer_id, env.source, ts,
        checks.count(ev.get("dropped_events") or 0, "dropped_events"),
        checks.count(ev.get("dropped_bytes") or 0, "dropped_bytes"),
        ts if since is None else checks.time_(since, "since"),
        ts if until is None else checks.time_(until, "until"),
    )


def _profile(env: Envelope, ev: dict, now: float):
    """A profile cycle of one prefix: a ``profiles`` row per stack (none for none)."""
    ts = checks.event_time(ev.get("ts"), "ts", now)
    worker = checks.text(ev.get("worker"), "worker")
    prefix = checks.text(ev.get("prefix"), "prefix")
    stacks = checks.list_(ev.get("stacks"), "stacks")
    counts = checks.list_(ev.get("counts"), "counts")
    if len(stacks) != len(counts):
        raise Invalid(f"stacks and counts: {len(stacks)} stacks for {len(counts)} counts")
    if not _types(stacks) <= {str}:
        stacks = [checks.required(checks.text)(s, f"stacks[{i}]") for i, s in enumerate(stacks)]
    if not _types(counts) <= {int} or (counts and not 0 <= min(counts) <= max(counts) < 2**32):
        counts = [checks.count(c, f"counts[{i}]") for i, c in enumerate(counts)]
    n = len(stacks)
    if n:
        yield "profiles", Block([[env.cluster_id] * n, [worker] * n, [prefix] * n, [ts] * n,
                                 stacks, counts], n)


def _stacks(env: Envelope, ev: dict, now: float):
    """A nanny's reading of its worker process's threads: a ``stacks`` row per thread
    (one without a thread, holding the error, when it read none)."""
    ts = checks.event_time(ev.get("ts"), "ts", now)
    head = (env.cluster_id, checks.text(ev.get("worker"), "worker"),
            checks.count(ev.get("pid"), "pid"), ts,
            checks.required(checks.text)(ev.get("reason"), "reason"),
            checks.int_or_none(ev.get("memory"), "memory"),
            checks.int_or_none(ev.get("memory_limit"), "memory_limit"),
            checks.float_or_none(ev.get("silent"), "silent"),
            checks.text(ev.get("error"), "error"))
    columns = [checks.list_(ev.get(name), name)
               for name in ("threads", "thread_ids", "stacks", "active", "gil")]
    n = len(columns[0])
    if any(len(c) != n for c in columns):
        raise Invalid(f"threads, thread_ids, stacks, active, gil: lengths "
                      f"{[len(c) for c in columns]} differ")
    threads, ids, stacks, active, gil = columns
    for i in range(n):
        if type(active[i]) is not bool or type(gil[i]) is not bool:
            raise Invalid(f"active[{i}], gil[{i}]: each must be true or false")
        if not 0 <= checks.int_(ids[i], f"thread_ids[{i}]") < 2**64:
            raise Invalid(f"thread_ids[{i}]: {ids[i]!r} is not a thread id")
        yield "stacks", (*head, checks.text(threads[i], f"threads[{i}]"), ids[i],
                         int(active[i]), int(gil[i]),
                         checks.required(checks.text)(stacks[i], f"stacks[{i}]"),
                         env.producer_id)
    if not n:
        yield "stacks", (*head, None, 0, 0, 0, None, env.producer_id)


@dataclasses.dataclass(frozen=True)
class Converter:
    """An event kind's own conversion: the contract fields it reads, and a generator
    of (table, row or Block) pairs from (envelope, event, now); raises Invalid."""

    reads: tuple[str, ...]
    convert: Callable[[Envelope, dict, float], Iterator[tuple[str, Any]]]


#: Event kinds converted event by event, by a converter of their own.
EVENT_CONVERTERS: dict[str, Converter] = {
    contract.GRAPH: Converter(("ts", "client", "stimulus_id", "n_tasks", "keys", "tasks",
                               "annotations", "n_keys", "part", "parts", "n_recorded"),
                              _graph),
    contract.SPAN: Converter(("ts", "span_id", "name", "parent_id", "enqueued"), _span),
    contract.WORKER_DIGESTS: Converter(("ts", "worker", "digests"), _worker_digests),
    contract.DROPS: Converter(("ts", "dropped_events", "dropped_bytes", "since", "until"),
                              _drops),
    contract.PROFILE: Converter(("ts", "worker", "prefix", "stacks", "counts"), _profile),
    contract.STACKS: Converter(("ts", "worker", "pid", "reason", "memory", "memory_limit",
                                "silent", "threads", "thread_ids", "stacks", "active", "gil",
                                "error"), _stacks),
}

#: Contract fields the sink does not store, per event kind, with the reason.
#: (``kind`` is never stored as such: it picks the table.)
NOT_STORED: dict[str, dict[str, str]] = {}


def check_against_contract() -> None:
    """Raise TypeError unless the layouts and converters read exactly the contract's
    event fields (less :data:`NOT_STORED`), with kinds that accept their types."""
    problems = []
    kinds = {*EVENT_LAYOUTS, *EVENT_CONVERTERS}
    if kinds != set(contract.EVENTS):
        problems.append(f"kinds loaded {sorted(kinds)} != contract.EVENTS {sorted(contract.EVENTS)}")
    for kind in sorted(kinds & set(contract.EVENTS)):
        declared = contract.field_types(contract.EVENTS[kind])
        if kind in EVENT_LAYOUTS:
            read = [f.name for f in FIELDS[kind]]
            for f in FIELDS[kind]:
                if f.name in declared and declared[f.name] not in typed.ACCEPTS[f.kind]:
                    problems.append(f"{kind}.{f.name}: kind {f.kind!r} does not store the "
                                    f"contract's {declared[f.name]}")
        else:
            read = list(EVENT_CONVERTERS[kind].reads)
        skipped = NOT_STORED.get(kind, {})
        for name in read:
            if name not in declared:
                problems.append(f"{kind}.{name} is read but not declared in the contract")
            if name in skipped:
                problems.append(f"{kind}.{name} is read and also in NOT_STORED")
        for name in skipped:
            if name not in declared:
                problems.append(f"{kind}.{name} is in NOT_STORED but not in the contract")
        unread = set(declared) - set(read) - set(skipped) - {"kind"}
        if unread:
            problems.append(f"{kind}: contract field(s) {', '.join(sorted(unread))} are neither "
                            "loaded nor in sinks.events.NOT_STORED")
    if problems:
        raise TypeError("sinks.events disagrees with dask_blackbox.contract: " + "; ".join(problems))


check_against_contract()


# ------------------------------------------------------------- the two paths

#: The typed struct of a TRANSITION_RUN (its values typed as TRANSITION's fields).
RUN_STRUCT = typed.run_struct(FIELDS[contract.TRANSITION])
#: The typed struct of a CAPTURE (the same).
CAPTURE_STRUCT = typed.capture_struct(FIELDS[contract.TRANSITION])
#: The typed structs of packed events.
PACKED_STRUCTS = (RUN_STRUCT, CAPTURE_STRUCT)
#: Decode and type a whole envelope, JSON or MessagePack; the event kind of each event
#: struct.
decode_envelope, decode_msgpack_envelope, STRUCT_KINDS = typed.envelope_decoder(
    FIELDS, EVENT_CONVERTERS, {contract.TRANSITION_RUN: RUN_STRUCT,
                               contract.CAPTURE: CAPTURE_STRUCT})
#: The typed struct of a TRANSITION event.
TRANSITION_STRUCT = next(s for s, kind in STRUCT_KINDS.items() if kind == contract.TRANSITION)


def _envelope_column(source: str, env: Envelope, indexes: Sequence[int]):
    """The column of a layout's ``"$<name>"`` source for events ``indexes``: the
    indexes themselves, or the envelope's value for each (a Coded column of one
    value for a block from CHUNK_MIN_ROWS rows)."""
    if source == "$idx":
        return indexes
    value = getattr(env, source[1:])
    if len(indexes) >= CHUNK_MIN_ROWS:
        return Coded([value], np.zeros(len(indexes), np.int32))
    return [value] * len(indexes)


def typed_columns(kind: str, env: Envelope, events: list, indexes: list[int], now: float) -> list:
    """The columns (layout order) of typed ``events`` of a kind, at ``indexes`` in
    their envelope; raises Irregular if a column needs the checked path."""
    # One C-level call per event, and one transposition for all of them.
    by_field = dict(zip(_FIELD_NAMES[kind], zip(*map(msgspec.structs.astuple, events))))
    return _columns(kind, env, by_field, indexes, now)


def _packed_length(packed) -> int:
    return len(packed.key)


_NO_NAMES = (None, None, None)
_KWARGS_NONE = (None,) * len(contract.TRANSITION_KWARGS)
_ERROR_NONE = (None,) * len(contract.CAPTURE_ERROR)


def _common_shape(packed) -> tuple[int, list]:
    """``contract._common_shape`` of a typed run or capture, less what its struct's
    types already checked (every column a list, each names entry three values or
    null, each name an integer from 0): its length and its names table; raises
    Irregular."""
    n = len(packed.key)
    if not n or not (len(packed.time) == len(packed.start) == len(packed.finish)
                     == len(packed.stimulus_id) == len(packed.name) == n):
        raise Irregular
    names = packed.names
    if None in names:
        names = [_NO_NAMES if entry is None else entry for entry in names]
    if max(packed.name) >= len(names):
        raise Irregular
    return n, names


def _entries(values: list | None, none: tuple, n: int) -> list:
    """``contract._entries`` of a typed capture's ``kwargs`` or ``error`` (each entry
    a tuple of exactly its width, or null): a column per position."""
    if values is None:
        return [[None] * n] * len(none)
    if len(values) != n:
        raise Irregular
    if None in values:
        values = [none if entry is None else entry for entry in values]
    return [list(column) for column in zip(*values)]


def _shape(packed) -> tuple[int, list, list, dict]:
    """(n, names table, key texts, optional columns) of a typed run or capture, as
    ``contract.run_shape``/``capture_shape`` find them (checking only what the struct's
    types leave to check); raises Irregular if its shape is wrong."""
    n, names = _common_shape(packed)
    if type(packed) is CAPTURE_STRUCT:
        try:
            keys = contract.key_texts(packed.key)
        except contract.InvalidEvent as e:
            raise Irregular(str(e)) from None
        optional = dict(zip(contract.TRANSITION_KWARGS, _entries(packed.kwargs, _KWARGS_NONE, n)))
        optional.update(zip(contract.CAPTURE_ERROR, _entries(packed.error, _ERROR_NONE, n)))
        return n, names, keys, optional
    optional = {}
    for column in contract.RUN_OPTIONAL_COLUMNS:
        values = getattr(packed, column)
        if values is not None and len(values) != n:
            raise Irregular
        optional[column] = values
    return n, names, packed.key, optional


def transition_blocks(env: Envelope, structs: list, indexes: list[int], runs: list,
                      firsts: list[int], now: float) -> list[tuple[list, Sequence[int]]]:
    """The ``transitions`` blocks of an envelope: (columns in layout order, the
    rows' indexes in the expanded envelope) of typed TRANSITION events (``structs``
    at ``indexes``) and of the events typed TRANSITION_RUNs and CAPTUREs stand for
    (``runs``, the first of each at ``firsts``). Without single events, a block per
    run, its columns the run's own lists (prefix, group and span id
    :class:`~sinks.tables.Coded` from its names; a capture's keys as text, its kwargs
    and error spread into their fields); with them, one block in the envelope's
    order. Raises Irregular if a run's shape is wrong (``contract.run_shape``,
    ``contract.capture_shape``) or a column needs the checked path."""
    if not structs:
        blocks = []
        for run, first in zip(runs, firsts):
            n, names, keys, optional = _shape(run)
            by_field = {"ts": run.time, "key": keys, "start": run.start,
                        "finish": run.finish, "stimulus_id": run.stimulus_id}
            index = np.array(run.name, np.int32)  # checked by the shape: in range
            for position, name in enumerate(("prefix", "group", "span_id")):
                by_field[name] = Coded([entry[position] for entry in names], index)
            for name, values in optional.items():
                by_field[name] = [None] * n if values is None else values
            rows = range(first, first + n)
            blocks.append((_columns(contract.TRANSITION, env, by_field, rows, now), rows))
        return blocks
    names = _FIELD_NAMES[contract.TRANSITION]
    by_field: dict[str, list] = {name: [] for name in names}
    for name, values in zip(names, zip(*map(msgspec.structs.astuple, structs))):
        by_field[name] += values
    indexes = list(indexes)
    for run, first in zip(runs, firsts):
        n, table, keys, optional = _shape(run)
        prefix, group, span_id = zip(*map(table.__getitem__, run.name))
        columns = {"ts": run.time, "key": keys, "prefix": prefix, "group": group,
                   "span_id": span_id, "start": run.start, "finish": run.finish,
                   "stimulus_id": run.stimulus_id}
        for name, values in optional.items():
            columns[name] = [None] * n if values is None else values
        for name, values in columns.items():
            by_field[name] += values
        indexes += range(first, first + n)
    if runs:  # interleaved: in the envelope's order
        order = sorted(range(len(indexes)), key=indexes.__getitem__)
        by_field = {name: list(map(values.__getitem__, order)) for name, values in by_field.items()}
        indexes = list(map(indexes.__getitem__, order))
    return [(_columns(contract.TRANSITION, env, by_field, indexes, now), indexes)]


def _columns(kind: str, env: Envelope, by_field: dict, indexes: list[int], now: float) -> list:
    """A layout's columns from its typed fields' values (``by_field``)."""
    layout = EVENT_LAYOUTS[kind][1]
    columns = []
    for source in layout:
        if isinstance(source, str):
            columns.append(_envelope_column(source, env, indexes))
        elif source.width == 1:
            columns.append(source.column(by_field[source.name], now))
        else:
            columns.extend(source.column(by_field[source.name], now))
    return columns


def layout_row(layout: tuple, env: Envelope, event: dict, idx: int, now: float) -> tuple:
    """One event of a kind in EVENT_LAYOUTS, value by value (the checked path, which
    names the field at fault)."""
    row = []
    for source in layout:
        if isinstance(source, str):
            row.append(idx if source == "$idx" else getattr(env, source[1:]))
        elif source.width == 1:
            row.append(source.check(event.get(source.name), source.name, now))
        else:
            row.extend(source.check(event.get(source.name), source.name, now))
    return tuple(row)
