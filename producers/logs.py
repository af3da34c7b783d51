"""Shipping log records (contract kind ``LOG``).

Which: ``blackbox.producer.loggers`` names loggers with a level (by default
``distributed`` at INFO and ``root``, every other logger, users' own included, at
WARNING). A record is shipped when it reaches the level of the most specific configured
logger its name falls under (and its logger emits it: levels are not changed here). A
:class:`LogHandler` sits on each configured logger (``distributed`` does not propagate
to the root when Dask configures its logging); only the most specific one's ships it.

Where: each producer of the process registers its transport (:func:`install`); a record
goes to one, the scheduler's if any, else the first worker's, else the nanny's, so an
in-process cluster ships it once. Its ``worker`` is the worker whose task thread logged
it, else that transport's worker (or nanny's worker); its ``key`` the thread's task.
A record of Dask's nanny (``distributed.nanny``) belongs to the nanny that logged it,
even where nannies share the scheduler's process (a ``LocalCluster``): it goes through
that nanny's transport (``source`` "nanny"), naming its worker. Which nanny is read off
the logging call's frames (the ``Nanny`` or its ``WorkerProcess`` as ``self``); with one
nanny in the process, that one. A nanny whose plugin is not set up yet has its records
shipped by the process's first transport, naming its worker all the same.

The handler never recurses: records of the recorder's own threads, of aiokafka and of
this package are ignored, and so is one emitted on a thread while it handles another
(a logging call in a ``__str__``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

from distributed.nanny import Nanny, WorkerProcess
from distributed.utils import thread_state

from dask_blackbox.contract import LOG, Log, encode_key
from dask_blackbox.producers.encode import cap_text
from dask_blackbox.producers.rows import Ready
from dask_blackbox.producers.sender import THREAD_PREFIX
from dask_blackbox.producers.transport import Transport

_IGNORED_PREFIXES = ("aiokafka", "kafka", "dask_blackbox")  # loggers the recorder uses
_ORDER = {"scheduler": 0, "worker": 1, "nanny": 2}  # whose transport ships first
_NANNY_LOGGER = "distributed.nanny"
_FRAMES = 12  # how far up a nanny's logging call its Nanny or WorkerProcess is looked for
_LOCK = threading.Lock()  # guards installing and removing, never taken by emit


class Target(NamedTuple):
    """A transport records are shipped through, and the worker it speaks for (its
    address, or a function giving it: a nanny's worker changes address on restart);
    ``nanny``, a nanny's: the ``Nanny`` whose records it ships."""

    transport: Transport
    worker: str | Callable[[], str | None] | None
    nanny: Any = None


class LogHandler(logging.Handler):
    """Ships the records of one configured logger (``name``) through the first target."""

    def __init__(self, name: str, level: int, loggers: tuple[tuple[str, int], ...]):
        super().__init__(logging.NOTSET)
        self.logger_name = name
        self.shipped_level = level
        self.loggers = loggers
        # replaced, never mutated: emit reads a consistent tuple without the lock
        self.targets: tuple[Target, ...] = ()
        self._local = threading.local()

    def owns(self, name: str) -> bool:
        """Whether this handler's logger is the most specific configured one for ``name``."""
        for configured, _ in self.loggers:
            if configured == "root" or name == configured or name.startswith(configured + "."):
                return configured == self.logger_name
        return False

    def emit(self, record: logging.LogRecord) -> None:
        targets = self.targets
        if (not targets or record.levelno < self.shipped_level
                or getattr(self._local, "busy", False)
                or record.name.startswith(_IGNORED_PREFIXES)
                or not self.owns(record.name)
                or threading.current_thread().name.startswith(THREAD_PREFIX)):
            return
        self._local.busy = True
        try:
            target, worker = targets[0], None
            if record.name == _NANNY_LOGGER or record.name.startswith(_NANNY_LOGGER + "."):
                target, worker = _nanny_target(targets, target)
            cap = target.transport.settings.max_value_bytes
            try:
                message = cap_text(record.getMessage(), cap)
            except Exception as e:  # bad format arguments: ship what we can
                message = cap_text(f"{record.msg!r} (unformattable: {type(e).__name__})", cap)
            exc_text = None
            if record.exc_info:
                with contextlib.suppress(Exception):
                    exc_text = cap_text(logging.Formatter().formatException(record.exc_info), cap)
            elif record.exc_text:
                exc_text = cap_text(record.exc_text, cap)
            key = getattr(thread_state, "key", None)
            if key is not None:  # a task thread
                state = getattr(thread_state, "execution_state", None) or {}
                worker = getattr(state.get("worker"), "address", None)
                key = encode_key(key)
            if worker is None:
                worker = target.worker() if callable(target.worker) else target.worker
            event: Log = {
                "kind": LOG, "ts": record.created, "logger": record.name,
                "level": record.levelname, "message": message, "process": record.process,
                "exc_text": exc_text, "worker": worker, "key": key,
            }
            target.transport.offer(Ready(event, 200 + len(message) + len(exc_text or "")))
            if record.levelno >= logging.WARNING:  # often a process's last word
                target.transport.hurry()
        except Exception:
            pass  # logging must never fail the caller; nothing to report it to safely
        finally:
            self._local.busy = False


def _nanny_target(targets: tuple[Target, ...], first: Target) -> tuple[Target, str | None]:
    """The target of the nanny that is logging, read off the frames up the stack (its
    ``Nanny``, or its ``WorkerProcess``, which calls the nanny's exit callback however
    the nanny's ``process`` stands while the process ends), and the worker's address
    that object knows. A nanny with no target of its own (its plugin not set up yet)
    has its records shipped by ``first``, naming its worker; frames that name no nanny:
    the only nanny's target, else ``first`` (None: its own worker)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        kind = type(owner)  # never ``isinstance``: a frame's ``self`` may be anyone's object
        if issubclass(kind, (Nanny, WorkerProcess)):
            nanny = (owner if issubclass(kind, Nanny)
                     else getattr(getattr(owner, "on_exit", None), "__self__", None))
            worker = getattr(owner, "worker_address", None)
            for t in targets:
                if t.nanny is not None and t.nanny is nanny:
                    return t, worker
            return first, worker
        frame = frame.f_back
    nannies = [t for t in targets if t.nanny is not None]
    return (nannies[0], None) if len(nannies) == 1 else (first, None)


_handlers: dict[str, LogHandler] = {}
_targets: tuple[Target, ...] = ()


def install(transport: Transport, worker: str | Callable[[], str | None] | None = None,
            nanny: Any = None) -> None:
    """Ship records through ``transport`` too, for ``worker`` (and ``nanny``, see
    :class:`Target`)."""
    global _targets
    with _LOCK:  # a stable sort: the first installed of a kind first
        _targets = tuple(sorted((*_targets, Target(transport, worker, nanny)),
                                key=lambda t: _ORDER.get(t.transport.source, 3)))
        loggers = transport.settings.loggers
        for name, level in loggers:
            if name not in _handlers:
                handler = _handlers[name] = LogHandler(name, level, loggers)
                logging.getLogger(name).addHandler(handler)
        for handler in _handlers.values():
            handler.targets = _targets


def uninstall(transport: Transport) -> None:
    """Stop shipping through ``transport``; remove the handlers when none is left."""
    global _targets
    with _LOCK:
        _targets = tuple(t for t in _targets if t.transport is not transport)
        for name, handler in list(_handlers.items()):
            handler.targets = _targets
            if not _targets:
                logging.getLogger(name).removeHandler(handler)
                del _handlers[name]
