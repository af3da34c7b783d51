"""Builders of the events both plugins publish, typed by the contract.

Every event a producer sends is written here or next to its hook as a literal of its
:mod:`dask_blackbox.contract` declaration (``Transition``, ``Lifecycle``, ...), in
the declaration's field order. A literal costs nothing at run time (a TypedDict
annotation is not checked when the program runs); a type checker and
``tests/test_producers.py`` hold the literals to the contract.

:class:`TransitionBuilder` is the one builder of ``TRANSITION`` events, for the
scheduler plugin and the worker plugin alike. It runs in the sender thread, never on
Dask's event loop: the plugins' ``transition`` hooks only offer a tuple
``(build, nbytes, key, start, finish, stimulus_id, kwargs, task, stamp)``, or, for a
transition whose kwargs hold no error (the scheduler's processing->memory), ``(build,
nbytes, key, start, finish, stimulus_id, worker, nbytes, typename, startstops, task,
stamp)`` with those values taken out of the kwargs (the dict is not held):

- ``task``: the scheduler's ``TaskGroup`` of the task (``prefix.name``, ``name``,
  ``span_id``), or the worker's ``TaskState`` (``prefix``, ``span_id``; no group), or
  None once the task is forgotten;
- ``stamp``: the ``Scheduler.transition_log`` record of the transition (its
  timestamp, index 5, is the one ``Scheduler.story`` shows) or a ``float`` time;
- ``kwargs``: what Dask passed with the transition (worker, nbytes, typename,
  startstops, exception/traceback text, cause); the worker passes nothing, and its
  events name the worker itself.
"""

from __future__ import annotations

import marshal
from collections.abc import Hashable
from itertools import compress, repeat, zip_longest
from operator import add, ne
from typing import Any

import orjson

from dask_blackbox.contract import (
    LIFECYCLE, RUN_OPTIONAL_COLUMNS, TRANSITION, TRANSITION_RUN, Lifecycle, Transition,
    TransitionRun, encode_key,
)
from dask_blackbox.producers.encode import cap_text

#: Encoded tuple keys remembered per builder (sender thread only).
KEY_TEXT_CACHE = 100_000
#: TaskGroups whose names are remembered per builder (sender thread only).
GROUP_CACHE = 4_096
#: Buffer weight of one scheduler transition (its encoded event is ~300-500 bytes).
TRANSITION_WEIGHT = 400

# Transitions as plain data (tuples of builtins: what a relay helper process gets):
#
# - GroupNames: ``(prefix, group, span_id)`` of the task, or None once it is
#   forgotten (a worker's task has no group: ``(prefix, None, span_id)``);
# - RecordRow: ``(key, start, finish, stimulus_id, ts, names)``, a transition that
#   carried nothing but what Dask's ``transition_log`` records;
# - TransitionRow: a RecordRow followed by ``worker, nbytes, typename,
#   startstops, exception, traceback, cause`` as the event will hold them
#   (exception and traceback already capped text, cause the encoded key).
#
# A transport packs consecutive rows of either kind into one TRANSITION_RUN
# (:class:`TransitionRuns`).

class TransitionBuilder:
    """Builds ``TRANSITION`` events from the items a ``transition`` hook offered.

    ``max_chars`` caps exception and traceback text; ``worker`` is the address of the
    worker whose own transitions this builds (None on the scheduler, where the
    worker comes with Dask's kwargs).
    """

    __slots__ = ("max_chars", "worker", "on_worker", "names", "_key_texts")

    def __init__(self, max_chars: int, worker: str | None = None):
        self.max_chars = max_chars
        self.worker = worker
        self.on_worker = worker is not None
        #: ``TaskGroup`` -> its :data:`GroupNames`, shared with the record encoder
        self.names = GroupNames()
        self._key_texts: dict[Hashable, str] = {}

    def build(self, item: tuple) -> Transition:
        """The event of an item a ``transition`` hook offered."""
        return self.event(self.row(item))

    def row(self, item: tuple) -> tuple:
        """The transition of an offered item as plain data, a :data:`TransitionRow`:
        what a relay helper process receives (:mod:`producers.relay`)."""
        task = item[-2]
        if task is None:
            names = None
        elif self.on_worker:  # a worker TaskState: its prefix is the name already
            names = (task.prefix, None, task.span_id)
        else:  # a scheduler TaskGroup
            names = self.names(task)
        if len(item) == 12:  # Dask's values already taken out of its kwargs
            _, _, key, start, finish, stimulus_id, worker, nbytes, typename, startstops, _, ts = item
            return (key, start, finish, stimulus_id, ts, names, worker, nbytes, typename,
                    startstops, None, None, None)
        _, _, key, start, finish, stimulus_id, kwargs, _, ts = item
        worker = self.worker
        nbytes = typename = startstops = exception = traceback = cause = None
        if kwargs:  # most transitions carry nothing: skip the lookups
            worker = kwargs.get("worker", worker)
            nbytes = kwargs.get("nbytes")
            typename = kwargs.get("typename")
            startstops = kwargs.get("startstops")
            if isinstance(text := kwargs.get("exception_text"), str):
                exception = cap_text(text, self.max_chars)
            elif (raised := kwargs.get("exception")) is not None:
                # The scheduler's own errors (KilledWorker) come pickled, without text.
                exception = cap_text(exception_text(raised), self.max_chars)
            if isinstance(text := kwargs.get("traceback_text"), str):
                traceback = cap_text(text, self.max_chars)
            if (blamed := kwargs.get("cause")) is not None:
                cause = encode_key(blamed)
        return (key, start, finish, stimulus_id, ts, names, worker, nbytes, typename,
                startstops, exception, traceback, cause)

    def event(self, row: tuple) -> Transition:
        """The ``TRANSITION`` event of a :data:`TransitionRow`."""
        (key, start, finish, stimulus_id, ts, names, worker, nbytes, typename,
         startstops, exception, traceback, cause) = row
        if type(key) is not str:
            key = self._key_texts.get(key) or self._key_text(key)
        prefix, group, span_id = _NO_NAMES if names is None else names
        event: Transition = {
            "kind": TRANSITION, "ts": ts, "key": key, "prefix": prefix, "group": group,
            "span_id": span_id, "start": start, "finish": finish,
            "stimulus_id": stimulus_id, "worker": worker, "nbytes": nbytes,
            "typename": typename, "startstops": startstops, "exception": exception,
            "traceback": traceback, "cause": cause,
        }
        return event

    def _key_text(self, key: Hashable) -> str:
        """encode_key of a non-str key missing from the cache, remembered: a key has
        several transitions and str() of a tuple costs more than the rest of the
        event."""
        cache = self._key_texts
        if len(cache) >= KEY_TEXT_CACHE:
            cache.clear()
        text = cache[key] = encode_key(key)
        return text


class GroupNames:
    """``TaskGroup`` -> ``(prefix, group, span_id)``, the :data:`GroupNames` of a
    scheduler task group, one tuple per group (at most :data:`GROUP_CACHE` kept);
    None -> None.

    The same tuple object is returned for a group every time, so that a pickle of
    many rows (:mod:`producers.relay`) holds it once. A group's name, prefix and
    span id never change once its tasks are runnable.
    """

    __slots__ = ("_cache", "lookup")

    def __init__(self) -> None:
        self._cache: dict[Any, tuple] = _NamesCache()
        #: ``lookup(group)``: its names, a C call unless they are not known yet
        #: (``list(map(lookup, groups))`` names many groups without a Python frame)
        self.lookup = self._cache.__getitem__

    def __call__(self, group: Any) -> tuple | None:
        return self.lookup(group)


class _NamesCache(dict):
    """The dict of a :class:`GroupNames`: a group missing is named and kept."""

    __slots__ = ()

    def __missing__(self, group: Any) -> tuple | None:
        if group is None:
            return None
        if len(self) >= GROUP_CACHE:
            self.clear()  # the same dict: the bound methods stay bound to it
        names = self[group] = (group.prefix.name, group.name, group.span_id)
        return names


def tape_rows(data: bytes) -> list[tuple]:
    """The rows of the bytes a compiled hook's tape gave (``Tape.take``)."""
    return marshal.loads(data)[1]


def named_rows(rows: list[tuple], names: list) -> list[tuple]:
    """``tape_row`` of each of a tape's rows (:func:`tape_rows`) and its group's
    names (``names``, in order); a plain row's made in C."""
    out = list(map(add, rows, zip(names)))  # (*fields, names)
    lengths = list(map(len, rows))
    if lengths.count(5) != len(rows):  # carried rows: their names go in the middle
        for i in compress(range(len(rows)), map(ne, lengths, repeat(5))):
            out[i] = tape_row(rows[i], names[i])
    return out


def tape_row(fields: tuple, names: tuple | None) -> tuple:
    """The row of a transition the compiled hook wrote to its tape
    (``producers/_hotpath.c``) and its group's names: a :data:`RecordRow` from a
    plain row's five fields, a :data:`TransitionRow` from a carried row's nine
    (``key, start, finish, stimulus_id, ts, worker, nbytes, typename,
    startstops``)."""
    if len(fields) == 5:
        return (*fields, names)
    key, start, finish, stimulus_id, ts, worker, nbytes, typename, startstops = fields
    return (key, start, finish, stimulus_id, ts, names, worker, nbytes, typename,
            startstops, None, None, None)


class TransitionRuns:
    """Encodes consecutive transitions, each a :data:`RecordRow` or a
    :data:`TransitionRow`, to the JSON of one ``TRANSITION_RUN`` event
    (:class:`dask_blackbox.contract.TransitionRun`): their fields in columns, a column
    of the row's extra fields left out where all of them are None. The events a
    reader unpacks from it (``contract.unpack_run``) hold the same fields and values
    as :meth:`TransitionBuilder.event` of each row.

    The columns are made by C-level calls (a transposition, ``map``, one
    ``orjson.dumps``); per row in the interpreter there is only a key that is not a
    ``str`` (its text cached, shared with ``builder``)."""

    __slots__ = ("_builder",)

    def __init__(self, builder: TransitionBuilder) -> None:
        self._builder = builder

    def encode(self, rows: list[tuple]) -> bytes:
        """The JSON of the ``TRANSITION_RUN`` event of ``rows`` (at least one)."""
        keys, starts, finishes, stimulus_ids, times, names, *extras = zip_longest(*rows)
        if not all(map(str.__instancecheck__, keys)):  # isinstance(key, str), in C
            builder = self._builder
            texts, text = builder._key_texts.get, builder._key_text
            keys = [key if type(key) is str else (texts(key) or text(key)) for key in keys]
        distinct = list(dict.fromkeys(names))
        index = dict(zip(distinct, range(len(distinct))))
        run: TransitionRun = {
            "kind": TRANSITION_RUN, "ts": times[0], "key": keys, "time": times,
            "start": starts, "finish": finishes, "stimulus_id": stimulus_ids,
            "names": distinct, "name": list(map(index.__getitem__, names)),
        }
        n = len(keys)
        for column, values in zip(RUN_OPTIONAL_COLUMNS, extras):
            if values.count(None) != n:
                run[column] = values  # type: ignore[literal-required]
        return _dumps(run)


_NO_NAMES = (None, None, None)
_dumps = orjson.dumps


def lifecycle(
    ts: float,
    action: str,
    worker: str | None = None,
    client: str | None = None,
    reason: str | None = None,
    stimulus_id: str | None = None,
    detail: Any = None,
) -> Lifecycle:
    """A ``LIFECYCLE`` event (``total_nthreads`` is added by the caller where due)."""
    event: Lifecycle = {
        "kind": LIFECYCLE, "ts": ts, "action": action, "worker": worker,
        "client": client, "reason": reason, "stimulus_id": stimulus_id, "detail": detail,
    }
    return event


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
