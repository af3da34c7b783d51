"""Builders of the events both plugins publish, typed by the contract.

Every event a producer sends is written here or next to its hook as a literal of its
:mod:`dask_blackbox.contract` declaration (``Transition``, ``Lifecycle``, ...), in
the declaration's field order. A literal costs nothing at run time (a TypedDict
annotation is not checked when the program runs); a type checker and
``tests/test_producers.py`` hold the literals to the contract.

:class:`TransitionBuilder` is the one builder of ``TRANSITION`` events, for the
scheduler plugin and the worker plugin alike. It runs in the sender thread, never on
Dask's event loop: the plugins' ``transition`` hooks only offer a tuple
``(build, nbytes, key, start, finish, stimulus_id, kwargs, task, stamp)``:

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

from collections.abc import Hashable
from typing import Any

import orjson

from dask_blackbox.contract import LIFECYCLE, TRANSITION, Lifecycle, Transition, encode_key
from dask_blackbox.producers.encode import cap_text

#: Encoded tuple keys remembered per builder (sender thread only).
KEY_TEXT_CACHE = 100_000
#: TaskGroups whose encoded names are remembered per encoder (sender thread only).
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

#: The JSON of a TRANSITION event that carried nothing but what Dask's
#: ``transition_log`` records, in the contract's field order, around its values.
_RECORD_HEAD = b'{"kind":' + orjson.dumps(TRANSITION) + b',"ts":'
_RECORD_KEY = b',"key":'
_RECORD_START = b',"start":'
_RECORD_FINISH = b',"finish":'
_RECORD_STIMULUS = b',"stimulus_id":'
_RECORD_TAIL = (b',"worker":null,"nbytes":null,"typename":null,"startstops":null,'
                b'"exception":null,"traceback":null,"cause":null}')


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
        _, _, key, start, finish, stimulus_id, kwargs, task, ts = item
        if task is None:
            names = None
        elif self.on_worker:  # a worker TaskState: its prefix is the name already
            names = (task.prefix, None, task.span_id)
        else:  # a scheduler TaskGroup
            names = self.names(task)
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
    scheduler task group, one tuple per group (at most :data:`GROUP_CACHE` kept).

    The same tuple object is returned for a group every time, so that a pickle of
    many rows (:mod:`producers.relay`) holds it once. A group's name, prefix and
    span id never change once its tasks are runnable.
    """

    __slots__ = ("_cache", "cached")

    def __init__(self) -> None:
        self._cache: dict[Any, tuple] = {}
        #: ``cached(group)``: its names if known already, else None (a C call)
        self.cached = self._cache.get

    def __call__(self, group: Any) -> tuple | None:
        if group is None:
            return None
        names = self._cache.get(group)
        if names is None:
            if len(self._cache) >= GROUP_CACHE:
                self._cache.clear()  # the same dict: ``cached`` stays bound to it
            names = self._cache[group] = (group.prefix.name, group.name, group.span_id)
        return names


class TransitionJSON:
    """Encodes a scheduler transition that carried nothing extra straight to the
    JSON of its ``TRANSITION`` event: the same fields, order and values as
    :meth:`TransitionBuilder.event` encoded by orjson, without a mapping per event.

    Its input is a :data:`RecordRow` (:meth:`encode_row`, in a relay helper
    process) or the fields of Dask's ``transition_log`` record that a transport
    buffers (key, start, finish, stimulus_id, timestamp) with the task's
    ``TaskGroup`` (:meth:`encode`, in a sender thread). Every value goes through
    ``orjson.dumps``; what repeats (a key's text, shared with ``builder``, a group's
    names, the states, the last stimulus id) is encoded once.
    """

    __slots__ = ("_builder", "_keys", "_groups", "_states", "_last_stimulus",
                 "_last_stimulus_json")

    def __init__(self, builder: TransitionBuilder) -> None:
        self._builder = builder
        self._keys: dict[Hashable, bytes] = {}
        self._groups: dict[Any, bytes] = {}
        self._states: dict[str, bytes] = {}
        self._last_stimulus: Any = _NOTHING
        self._last_stimulus_json = b"null"

    def encode(self, key: Hashable, start: str, finish: str, stimulus_id: str,
               ts: float, group: Any) -> bytes:
        """The JSON of a ``transition_log`` record's fields and the task's
        ``TaskGroup``."""
        return self.encode_row(
            (key, start, finish, stimulus_id, ts, self._builder.names(group)))

    def encode_row(self, row: tuple) -> bytes:
        """The JSON of a :data:`RecordRow`."""
        key, start, finish, stimulus_id, ts, names = row
        states = self._states
        if stimulus_id != self._last_stimulus:
            self._last_stimulus = stimulus_id
            self._last_stimulus_json = _dumps(stimulus_id)
        return b"".join((
            _RECORD_HEAD, _dumps(ts),
            _RECORD_KEY, self._keys.get(key) or self._key_json(key),
            self._groups.get(names) or self._group_json(names),
            _RECORD_START, states.get(start) or self._state_json(start),
            _RECORD_FINISH, states.get(finish) or self._state_json(finish),
            _RECORD_STIMULUS, self._last_stimulus_json,
            _RECORD_TAIL,
        ))

    def _key_json(self, key: Hashable) -> bytes:
        cache = self._keys
        if len(cache) >= KEY_TEXT_CACHE:
            cache.clear()
        builder = self._builder
        text = key if type(key) is str else (builder._key_texts.get(key)
                                             or builder._key_text(key))
        encoded = cache[key] = _dumps(text)
        return encoded

    def _group_json(self, names: tuple | None) -> bytes:
        if names is None:
            return b',"prefix":null,"group":null,"span_id":null'
        cache = self._groups
        if len(cache) >= GROUP_CACHE:
            cache.clear()
        prefix, group, span_id = names
        encoded = cache[names] = b"".join((
            b',"prefix":', _dumps(prefix), b',"group":', _dumps(group),
            b',"span_id":', _dumps(span_id),
        ))
        return encoded

    def _state_json(self, state: Any) -> bytes:
        encoded = self._states[state] = _dumps(state)
        return encoded


_NOTHING = object()
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
