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
from distributed.protocol import pickle

from dask_blackbox.contract import LIFECYCLE, TRANSITION, Lifecycle, Transition, encode_key
from dask_blackbox.producers.encode import cap_text

#: Encoded tuple keys remembered per builder (sender thread only).
KEY_TEXT_CACHE = 100_000
#: TaskGroups whose encoded names are remembered per encoder (sender thread only).
GROUP_CACHE = 4_096
#: Buffer weight of one scheduler transition (its encoded event is ~300-500 bytes).
TRANSITION_WEIGHT = 400

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

    __slots__ = ("max_chars", "worker", "on_worker", "_key_texts")

    def __init__(self, max_chars: int, worker: str | None = None):
        self.max_chars = max_chars
        self.worker = worker
        self.on_worker = worker is not None
        self._key_texts: dict[Hashable, str] = {}

    def build(self, item: tuple) -> Transition:
        _, _, key, start, finish, stimulus_id, kwargs, task, stamp = item
        if type(key) is not str:
            key = self._key_texts.get(key) or self._key_text(key)
        if task is None:
            prefix = group = span_id = None
        elif self.on_worker:  # a worker TaskState: its prefix is the name already
            prefix, group, span_id = task.prefix, None, task.span_id
        else:  # a scheduler TaskGroup
            prefix, group, span_id = task.prefix.name, task.name, task.span_id
        ts = stamp if type(stamp) is float else stamp[5]  # Transition.timestamp
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


class TransitionJSON:
    """Encodes a scheduler transition that carried nothing extra straight from
    Dask's ``transition_log`` record (``key, start, finish, recommendations,
    stimulus_id, timestamp``) and its ``TaskGroup`` to the JSON of its
    ``TRANSITION`` event: the same fields, order and values as
    :meth:`TransitionBuilder.build` encoded by orjson, without a mapping per event.
    Every value goes through ``orjson.dumps``; what repeats (a key's text, shared
    with ``builder``, a group's names, the states, the last stimulus id) is encoded
    once.
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

    def encode(self, record: tuple, group: Any) -> bytes:
        key, start, finish, _, stimulus_id, ts = record
        states = self._states
        if stimulus_id is not self._last_stimulus:
            self._last_stimulus = stimulus_id
            self._last_stimulus_json = _dumps(stimulus_id)
        return b"".join((
            _RECORD_HEAD, _dumps(ts),
            _RECORD_KEY, self._keys.get(key) or self._key_json(key),
            self._groups.get(group) or self._group_json(group),
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

    def _group_json(self, group: Any) -> bytes:
        if group is None:
            return b',"prefix":null,"group":null,"span_id":null'
        cache = self._groups
        if len(cache) >= GROUP_CACHE:
            cache.clear()
        encoded = cache[group] = b"".join((
            b',"prefix":', _dumps(group.prefix.name), b',"group":', _dumps(group.name),
            b',"span_id":', _dumps(group.span_id),
        ))
        return encoded

    def _state_json(self, state: Any) -> bytes:
        encoded = self._states[state] = _dumps(state)
        return encoded


_NOTHING = object()
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
            raised = pickle.loads(raised)
        if isinstance(raised, BaseException):
            return f"{type(raised).__name__}: {raised}"
    except Exception:  # unknown class, truncated pickle: say what it was instead
        pass
    size = f", {len(raised)} bytes" if isinstance(raised, bytes) else ""
    return f"<{type(raised).__name__}{size}>"
