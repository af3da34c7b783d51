"""Shipping the records of the ``distributed`` loggers (contract kind ``LOG``).

One :class:`BlackboxLogHandler` per process sits on the ``distributed`` logger. Every
producer of the process registers its transport with :func:`install`; each record
goes to one of them only (the scheduler's if the process has a scheduler, else the
first worker's), so an in-process cluster does not ship a record once per worker.

The handler never recurses: records from the sender threads, from aiokafka and from
this package are ignored, and a record emitted while the handler is already
handling one on the same thread (e.g. a logging call made by a ``__str__``) is
skipped.
"""

from __future__ import annotations

import logging
import threading

from dask_blackbox.contract import LOG, Log
from dask_blackbox.producers.encode import cap_text
from dask_blackbox.producers.transport import SENDER_THREAD_PREFIX, Transport, ready

#: The logger whose records (and its children's) are shipped.
SHIPPED_LOGGER = "distributed"

#: Records of these loggers are never shipped (they may come from the transport).
_IGNORED_PREFIXES = ("aiokafka", "kafka", "dask_blackbox")

_LOCK = threading.Lock()  # guards installing/removing, never taken by emit


class BlackboxLogHandler(logging.Handler):
    """Buffers records on the first registered transport whose level they reach."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        # (is_worker, registration order, transport); replaced, never mutated, so
        # emit reads a consistent list without the lock.
        self.targets: tuple[tuple[bool, int, Transport], ...] = ()
        self._counter = 0
        self._local = threading.local()

    def add(self, transport: Transport) -> None:
        self._counter += 1
        entry = (transport.source != "scheduler", self._counter, transport)
        self.targets = tuple(sorted((*self.targets, entry), key=lambda e: e[:2]))

    def remove(self, transport: Transport) -> None:
        self.targets = tuple(e for e in self.targets if e[2] is not transport)

    def emit(self, record: logging.LogRecord) -> None:
        targets = self.targets
        if not targets or getattr(self._local, "busy", False):
            return
        if record.name.startswith(_IGNORED_PREFIXES):
            return
        if threading.current_thread().name.startswith(SENDER_THREAD_PREFIX):
            return
        transport = targets[0][2]
        if record.levelno < transport.settings.log_level:
            return
        self._local.busy = True
        try:
            max_chars = transport.settings.max_value_bytes
            try:
                message = cap_text(record.getMessage(), max_chars)
            except Exception as e:  # bad format arguments: ship what we can
                message = cap_text(f"{record.msg!r} (unformattable: {type(e).__name__})", max_chars)
            exc_text = None
            if record.exc_info:
                try:
                    exc_text = cap_text(logging.Formatter().formatException(record.exc_info), max_chars)
                except Exception:
                    exc_text = None
            elif record.exc_text:
                exc_text = cap_text(record.exc_text, max_chars)
            event: Log = {
                "kind": LOG,
                "ts": record.created,
                "logger": record.name,
                "level": record.levelname,
                "message": message,
                "process": record.process,
                "exc_text": exc_text,
            }
            transport.offer((ready, 200 + len(message) + len(exc_text or ""), event))
        except Exception:
            pass  # logging must never fail the caller; nothing to report it to safely
        finally:
            self._local.busy = False


_handler: BlackboxLogHandler | None = None


def install(transport: Transport) -> None:
    """Ship ``distributed`` records through ``transport`` (see module docstring)."""
    global _handler
    with _LOCK:
        if _handler is None:
            _handler = BlackboxLogHandler()
            logging.getLogger(SHIPPED_LOGGER).addHandler(_handler)
        _handler.add(transport)


def uninstall(transport: Transport) -> None:
    """Stop shipping through ``transport``; remove the handler when none is left."""
    global _handler
    with _LOCK:
        if _handler is None:
            return
        _handler.remove(transport)
        if not _handler.targets:
            logging.getLogger(SHIPPED_LOGGER).removeHandler(_handler)
            _handler = None
