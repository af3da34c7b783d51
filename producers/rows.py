"""Items, rows and runs: the three shapes a record takes between a hook and the wire.

- An **item** is what a hook offers to the :class:`~producers.buffer.Buffer`, as cheap
  to make as the hot path needs: a :class:`TransitionItem`, an :class:`EventItem` (a
  ``log_event`` payload, not looked at yet), a :class:`GraphItem` (one part of a
  submitted graph, Dask's objects captured on the event loop), or a :class:`Ready`
  holding a finished event mapping. Its ``weight``, its estimated size in bytes, is
  what the buffer's limits count.
- A **row** is plain, named data the drain makes of an item: a :data:`TransitionRow`
  (the fields of :class:`~dask_blackbox.contract.Transition`, in its order: what version
  2 sent, and what a capture that cannot be encoded falls back to) or a :class:`Ready`
  (the event mapping of any other kind, typed by the contract). A row holds builtins
  only.
- A **run** is consecutive transition rows in columns, one ``TRANSITION_RUN`` event
  (:func:`run_event`, :data:`dask_blackbox.contract.PACKED`): what version 2 sent.
- A **capture** is consecutive transition items in columns, one ``CAPTURE`` event on
  the wire (:func:`capture_event`): what the hook captured, keys as Dask made them,
  Dask's kwargs as the MessagePack the hook encoded (``msgspec.Raw``). No row and no
  per-transition object is made of them in a Dask process: the sink and the
  processors make the rows.

Making rows runs in the drain, never on Dask's event loop: names of task groups and
the text of tuple keys are resolved there (a group's name, prefix and span id never
change once its tasks are runnable), a user's payload is sanitized there
(:func:`~producers.encode.sanitize`), an exception Dask passed pickled is read there.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Mapping
from typing import Any, cast

import msgspec
import orjson

from dask_blackbox.contract import (
    CAPTURE, CAPTURE_ERROR, EVENT, GRAPH, RUN_OPTIONAL_COLUMNS, TRANSITION_KWARGS,
    TRANSITION_RUN, Capture, Graph, GraphTask, StructuredEvent, Transition, TransitionRun,
    encode_key, fields,
)
from dask_blackbox.producers.encode import cap_text, sanitize

#: Estimated bytes of a transition item.
TRANSITION_WEIGHT = 200
#: Task-group names remembered by a row maker, and texts of tuple keys.
NAMES_CACHE = 4_096
KEY_TEXT_CACHE = 100_000
#: Distinct values listed per annotation in a graph's part 0.
MAX_ANNOTATION_VALUES = 20


class TransitionItem(msgspec.Struct, array_like=True, gc=False, tag=2):
    """A task transition as a hook offers it: the record's fields, the task's
    ``TaskGroup`` (scheduler) or its ``names`` (``(prefix, group, span_id)``; a worker's
    task has no group), what Dask passed as :data:`~dask_blackbox.contract.TRANSITION_KWARGS`
    in that order (``carried``: None when Dask passed none; the MessagePack of that
    tuple, so that Dask's containers, its ``startstops``, are not held across a
    hand-over where the collector would promote them to its oldest generation; the
    tuple if msgspec cannot encode it) and, for an erred transition, Dask's keyword
    arguments as they are (``error``; once read in the drain, the tuple of
    :data:`~dask_blackbox.contract.CAPTURE_ERROR`)."""

    key: Any
    start: Any
    finish: Any
    stimulus_id: Any
    ts: Any
    group: Any = None
    names: Any = None
    carried: Any = None
    error: Any = None
    weight: int = TRANSITION_WEIGHT


class EventItem(msgspec.Struct, gc=False):
    """A ``log_event`` as Dask stored it: ``msg`` may be any object."""

    ts: float
    topic: Any
    msg: Any
    weight: int


class GraphEntry(msgspec.Struct, array_like=True, gc=False):
    """A submitted task captured on the event loop: its key, ``TaskGroup`` (or, once
    resolved, its ``names``), its first dependencies' keys and how many it has (none of
    it kept in the collector's sight)."""

    key: Any
    group: Any
    dependencies: tuple
    n_dependencies: int
    names: Any = None


class GraphItem(msgspec.Struct, array_like=True, gc=False, tag=3):
    """Part ``part`` of ``parts`` of a graph submission (see contract ``Graph``)."""

    ts: float
    client: Any
    stimulus_id: Any
    n_tasks: int
    n_recorded: int
    n_keys: int
    keys: list
    annotations: Any  # Dask's {name: {key: value}} (part 0), or None
    entries: list[GraphEntry]
    part: int
    parts: int
    weight: int
    counted: Any = None  # the annotations' values counted, or None


class Ready(msgspec.Struct, array_like=True, gc=False, tag=1):
    """A finished event mapping (an item, and the row of every kind but
    transitions)."""

    event: Mapping[str, Any]
    weight: int


#: A transition as plain data: the fields of contract ``Transition`` but ``kind``.
TransitionRow = msgspec.defstruct(
    "TransitionRow", [(name, Any, None) for name in fields(Transition)[1:]],
    array_like=True, gc=False, tag=0, namespace={"weight": TRANSITION_WEIGHT})

_ROW_FIELDS = fields(Transition)[1:]
# A row is made positionally: Dask's kwargs right after stimulus_id, then the rest.
if _ROW_FIELDS[_ROW_FIELDS.index("stimulus_id") + 1:][:len(TRANSITION_KWARGS)] != TRANSITION_KWARGS:
    raise TypeError("contract.Transition: declare the DASK_KWARG fields right after stimulus_id")
_NOT_CARRIED = (None,) * len(TRANSITION_KWARGS)


class RowMaker:
    """Makes the rows of items (in the drain). ``max_chars`` caps exception and
    traceback text and a user's payload; ``worker`` is the address of the worker
    whose own transitions it makes (None on the scheduler)."""

    def __init__(self, max_chars: int, worker: str | None = None):
        self.max_chars = max_chars
        self.worker = worker
        #: what a worker's own transition carries: its address (Dask passes it nothing)
        self._worker_carried = (worker, *_NOT_CARRIED[1:])
        #: the same as a capture holds it
        self.worker_carried = msgspec.Raw(msgspec.msgpack.encode(self._worker_carried))
        #: ``(prefix, group, span_id)`` of a scheduler ``TaskGroup``.
        self.names = functools.lru_cache(NAMES_CACHE)(_group_names)
        #: :func:`~dask_blackbox.contract.encode_key` of a key.
        self.key_text = functools.lru_cache(KEY_TEXT_CACHE)(encode_key)
        self._makers = {TransitionItem: self.transition, EventItem: self.event,
                        GraphItem: self.graph, Ready: _as_is, TransitionRow: _as_is}

    def rows(self, items: list, captured: bool = False) -> tuple[list, list]:
        """The rows of ``items`` in order, and the items no row could be made of
        (a bug must not stop the drain: the caller counts them). ``captured``:
        transition items as they are (an erred one's error read), for
        :func:`capture_event`, the row of every other item."""
        if captured and _plain_transitions(items):  # a busy stream's take: as they are
            return items[:], []
        rows, failed = [], []
        makers = self._makers
        if captured:
            makers = {**makers, TransitionItem: self._captured, TransitionRow: _captured_row}
        for item in items:
            try:
                rows.append(makers[type(item)](item))
            except Exception:
                failed.append(item)
        return rows, failed

    def make(self, item: Any) -> Any:
        """The row of one item."""
        return self._makers[type(item)](item)

    def transition(self, item: Any) -> Any:
        group = item.group
        prefix, group_name, span_id = (item.names if group is None else self.names(group)) or _NO_NAMES
        key = item.key
        if type(key) is not str:
            key = self.text(key)
        carried = item.carried
        if carried is None:
            if self.worker is None and item.error is None:  # most transitions carry nothing
                return TransitionRow(item.ts, key, prefix, group_name, span_id, item.start,
                                     item.finish, item.stimulus_id)
            carried = self._worker_carried
        elif type(carried) is bytes:
            carried = _decode_carried(carried)
        error = () if item.error is None else self._error(item.error)
        return TransitionRow(item.ts, key, prefix, group_name, span_id, item.start, item.finish,
                             item.stimulus_id, *carried, *error)

    def text(self, key: Any) -> str:
        """:func:`~dask_blackbox.contract.encode_key` of a key (a tuple key that came
        through a pipe is a list)."""
        return key if type(key) is str else self.key_text(
            _tupled(key) if type(key) is list else key)

    def _captured(self, item: TransitionItem) -> TransitionItem:
        if item.error is not None:  # Dask's objects: read here
            item.error = self._error(item.error)
        return item

    def _error(self, kwargs: Any) -> tuple:
        if type(kwargs) is tuple:  # read already (captured)
            return kwargs
        cap = self.max_chars
        exception = traceback = cause = None
        if isinstance(text := kwargs.get("exception_text"), str):
            exception = cap_text(text, cap)
        elif (raised := kwargs.get("exception")) is not None:
            exception = cap_text(exception_text(raised), cap)  # KilledWorker: pickled
        if isinstance(text := kwargs.get("traceback_text"), str):
            traceback = cap_text(text, cap)
        if (blamed := kwargs.get("cause")) is not None:
            cause = encode_key(blamed)
        return exception, traceback, cause

    def event(self, item: EventItem) -> Ready:
        topic = item.topic if type(item.topic) is str else encode_key(item.topic)
        event: StructuredEvent = {"kind": EVENT, "ts": item.ts, "topic": topic,
                                  "msg": sanitize(item.msg, self.max_chars)[0]}
        return Ready(event, item.weight)

    def graph(self, item: GraphItem) -> Ready:
        text = self.text
        tasks: list[GraphTask] = []
        for entry in item.entries:
            prefix, group_name, span_id = entry.names or self.names(entry.group)
            shown = entry.dependencies
            task: GraphTask = {"key": text(entry.key), "prefix": prefix, "group": group_name,
                               "span_id": span_id, "dependencies": list(map(text, shown))}
            if entry.n_dependencies > len(shown):
                task["n_dependencies"] = entry.n_dependencies
            tasks.append(task)
        counted = item.counted
        if counted is None:
            counted = self._annotations(item.annotations)
        event: Graph = {
            "kind": GRAPH, "ts": item.ts, "client": item.client, "stimulus_id": item.stimulus_id,
            "n_tasks": item.n_tasks, "keys": list(map(text, item.keys)), "tasks": tasks,
            "annotations": counted,
            "n_keys": item.n_keys, "part": item.part, "parts": item.parts,
            "n_recorded": item.n_recorded,
        }
        return Ready(event, item.weight)

    def _annotations(self, annotations: dict | None) -> dict[str, list]:
        """``{annotation: [{"value", "n_tasks"}, ...]}``: each annotation's distinct
        values with how many tasks carry them, most frequent first (``{}`` for None)."""
        out = {}
        for name, per_key in (annotations or {}).items():
            counts: dict[Any, list] = {}
            for value in per_key.values():
                marker = _hashable(value)
                if marker in counts:
                    counts[marker][1] += 1
                else:
                    counts[marker] = [value, 1]
            ranked = sorted(counts.values(), key=lambda e: -e[1])[:MAX_ANNOTATION_VALUES]
            out[str(name)] = [{"value": sanitize(v, self.max_chars)[0], "n_tasks": n}
                              for v, n in ranked]
        return out


_NO_NAMES = (None, None, None)


def _group_names(group: Any) -> tuple:
    return group.prefix.name, group.name, group.span_id


def _as_is(row: Any) -> Any:
    return row


def _tupled(key: list) -> tuple:
    return tuple(_tupled(part) if type(part) is list else part for part in key)


def _hashable(value: Any) -> Any:
    """A hashable stand-in for an annotation value, equal for equal values."""
    with contextlib.suppress(TypeError):
        hash(value)
        return value
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except Exception:
        return id(value)


_astuple = msgspec.structs.astuple


def run_event(rows: list) -> TransitionRun:
    """The ``TRANSITION_RUN`` event of transition rows (at least one): their fields
    in columns, an optional column left out where all are None. A reader's
    ``contract.unpack_run`` gives back each row's TRANSITION event."""
    ts, keys, prefixes, groups, spans, starts, finishes, stimulus_ids, *optional = zip(
        *map(_astuple, rows))
    names = list(zip(prefixes, groups, spans))
    distinct = list(dict.fromkeys(names))
    index = dict(zip(distinct, range(len(distinct))))
    # the columns are tuples: they encode as the contract's arrays
    run = cast(TransitionRun, {
        "kind": TRANSITION_RUN, "ts": ts[0], "key": keys, "time": ts, "start": starts,
        "finish": finishes, "stimulus_id": stimulus_ids, "names": distinct,
        "name": list(map(index.__getitem__, names)),
    })
    n = len(keys)
    for column, values in zip(RUN_OPTIONAL_COLUMNS, optional):
        if values.count(None) != n:
            run[column] = values  # type: ignore[literal-required]
    return run


def exception_text(raised: Any) -> str:
    """``"Type: message"`` of an exception Dask passed as an object or pickled; a
    description of it if it cannot be read here (its class lives in user code)."""
    try:
        if isinstance(raised, bytes):
            from distributed.protocol import pickle  # only where Dask runs already

            raised = pickle.loads(raised)
        if isinstance(raised, BaseException):
            return f"{type(raised).__name__}: {raised}"
    except Exception:  # unknown class, truncated pickle: say what it was instead
        pass
    size = f", {len(raised)} bytes" if isinstance(raised, bytes) else ""
    return f"<{type(raised).__name__}{size}>"


_decode_carried = msgspec.msgpack.Decoder().decode
_ROW_KWARGS = operator.attrgetter(*TRANSITION_KWARGS)
_ROW_ERROR = operator.attrgetter(*CAPTURE_ERROR)


def _plain_transitions(items: list) -> bool:
    """Whether ``items`` are all transition items and none erred (looked at in C)."""
    n = len(items)
    return (list(map(type, items)).count(TransitionItem) == n
            and list(map(_ITEM["error"], items)).count(None) == n)


def _captured_row(row: Any) -> TransitionItem:
    """A transition row (offered as a row) as the item it was made of."""
    carried = _ROW_KWARGS(row)
    error = _ROW_ERROR(row)
    return TransitionItem(row.key, row.start, row.finish, row.stimulus_id, row.ts, None,
                          (row.prefix, row.group, row.span_id),
                          None if carried.count(None) == len(carried) else carried,
                          None if error.count(None) == len(error) else error)


_Raw = msgspec.Raw
_encode = msgspec.msgpack.Encoder().encode
_ITEM = {name: operator.attrgetter(name) for name in (
    "key", "start", "finish", "stimulus_id", "ts", "group", "names", "carried", "error")}


def capture_event(items: list, maker: RowMaker) -> Capture:
    """The ``CAPTURE`` event of transition items (at least one; an erred one's error
    read, ``RowMaker.rows(captured=True)``): their fields in columns (an attribute a
    column at a time, in C), ``names`` once per distinct task group, ``kwargs`` and
    ``error`` left out where all are None. A reader's ``contract.capture_columns``
    gives back the columns of their rows."""
    keys, starts, finishes, stimulus_ids, times, groups, carried, errors = (
        list(map(_ITEM[name], items)) for name in (
            "key", "start", "finish", "stimulus_id", "ts", "group", "carried", "error"))
    distinct = dict.fromkeys(groups)
    if None not in distinct:  # the scheduler's: a group's names, once per capture
        names_of = maker.names
        table = [names_of(g) for g in distinct]
        index = dict(zip(distinct, range(len(distinct))))
        name = list(map(index.__getitem__, groups))
    else:  # a worker's names (or a row's), or forgotten tasks
        names_of = maker.names
        names = [names_of(g) if g is not None else tuple(n or _NO_NAMES)
                 for g, n in zip(groups, map(_ITEM["names"], items))]
        table = list(dict.fromkeys(names))
        index = dict(zip(table, range(len(table))))
        name = list(map(index.__getitem__, names))
    capture: Capture = {
        "kind": CAPTURE, "ts": times[0], "time": times, "key": keys, "start": starts,
        "finish": finishes, "stimulus_id": stimulus_ids, "names": cast(Any, table), "name": name,
    }
    n = len(items)
    if maker.worker is not None:  # a worker's own transitions carry its address
        worker = maker.worker_carried
        capture["kwargs"] = cast(Any, [worker if c is None else _Raw(c) if type(c) is bytes
                                       else c for c in carried])
    elif carried.count(None) != n:
        capture["kwargs"] = cast(Any, [c if c is None else _Raw(c) if type(c) is bytes else c
                                       for c in carried])
    if errors.count(None) != n:
        capture["error"] = errors
    return capture


def capture_of_rows(rows: list, max_chars: int) -> Capture:
    """The ``CAPTURE`` of transition rows, every value as the JSON of their run holds
    it (keys as text): what is sent when a capture of items cannot be encoded."""
    from dask_blackbox.producers.encode import encode_event  # (no cycle at import)

    run = orjson.loads(encode_event(run_event(rows), max_chars))
    n = len(run["key"])
    capture: Capture = {"kind": CAPTURE, "ts": run["ts"], "time": run["time"],
                        "key": run["key"], "start": run["start"], "finish": run["finish"],
                        "stimulus_id": run["stimulus_id"], "names": run["names"],
                        "name": run["name"]}
    blank = [None] * n
    for column, fields_ in (("kwargs", TRANSITION_KWARGS), ("error", CAPTURE_ERROR)):
        values = [run.get(f) or blank for f in fields_]
        entries = [None if entry.count(None) == len(entry) else list(entry)
                   for entry in zip(*values)]
        if entries.count(None) != n:
            capture[column] = entries  # type: ignore[literal-required]
    return capture
