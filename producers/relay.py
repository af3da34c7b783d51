"""A sender in a helper process: what recording costs the Dask process is a hand-over.

Why. The sender thread of a :class:`~producers.transport.Transport` builds, encodes,
compresses and delivers every event inside the Dask process, holding the GIL that
Dask's event loop needs: about 7 % of a busy scheduler's CPU (see
``bench/scheduler_overhead.py``). A :class:`RelayTransport` has the same buffer and
the same hot path, but its thread only hands the items over, as plain data, to a
helper process (:func:`main` of this module, in an isolated interpreter). The helper
runs an ordinary thread-mode :class:`~producers.transport.Transport` under the same
producer id, which packs, encodes and delivers the same events the sender thread
would have, with the same ``seq``, retries, DROPS reports and close semantics (see
:mod:`producers.transport`). Under load its envelopes are larger: after a busy one
it lingers :data:`LINGER` instead of ``flush-interval`` (about 4 in 5 fewer
requests to the broker on issue #15's 43k-task graph).

``blackbox.producer.sender`` chooses: ``process`` (a helper), ``thread`` (the sender
in the Dask process), ``auto`` (a helper for the scheduler, a thread for workers,
which are many and rarely busy with transitions).

Hand-over, by the thread ``dask-blackbox-<source>-sender`` of the Dask process,
every ``flush-interval`` (after a hand-over of ``transport.BUSY_ENVELOPE`` items or
more, :data:`LINGER` if longer: under load, fewer wake-ups of the thread, each of
which takes the GIL from Dask's event loop) and when closing:

- a ``transition_log`` record's five fields (key, start, finish, stimulus_id,
  timestamp, as the transport buffers them), or the rows the compiled hook wrote to
  its tape (one ``bytes`` a frame, see :func:`~producers.events.tape_rows`), go with
  the names of their task groups (cached per ``TaskGroup``), a transition offered
  with Dask's kwargs a ``TransitionRow`` (see
  :mod:`producers.events`), any other item the event its builder returns, as
  ``(weight, event)``: a user's object is sanitized here and never leaves the Dask
  process;
- they go out in frames of at most :data:`FRAME_ITEMS` items, ``(drops, identity,
  records, names, others)`` (:meth:`_Receiver.apply` says what each holds), in
  ``marshal``'s format (or pickle's, see :func:`encode_frame`) behind a 4-byte
  little-endian length, one ``write`` to the helper's stdin. Records go as flat
  fields, so the hand-over leaves no object per record behind for the garbage
  collector. ``drops`` hands over the hot path's drop counts since the previous
  frame (the helper reports them in a DROPS event after its next delivery),
  ``identity`` a changed ``(cluster_id, cluster_name)``. If a frame cannot be
  pickled, a record field that cannot is replaced by its text and another row by
  its event passed through :func:`~producers.encode.sanitize`, or else by None,
  counted as a build error.

The helper writes status lines (JSON) to its stdout at most every
:data:`STATUS_INTERVAL` while anything changes: items done (delivered, or given up
as unbuildable or at close), delivered events and envelopes, DROPS reports, build
errors, ``next_seq``, whether it is connected, ``lost_at_close``, its CPU seconds.
The relay gives buffer room back for done items only, so
``buffer-max-events``/``buffer-max-bytes`` bound what the two processes hold
together, and :meth:`Transport.delivered` keeps its meaning.

Failures:

- The helper starts with ``sys.executable`` and this process's ``sys.path``. If it
  cannot start, exits before its first status line, or dies
  :data:`MAX_DEATHS` times within a minute, the relay logs a warning and becomes a
  thread-mode sender on the same buffer (what is buffered is kept).
- A helper that dies otherwise takes the items it held with it: they are counted
  as dropped (``abandoned`` too) and a DROPS event of the next helper reports
  them. The next helper has a new producer id, so no ``seq`` the dead one may have
  delivered is ever reused.
- The helper ignores SIGINT and SIGTERM: a Ctrl-C or a terminate of the process
  group reaches the Dask process, which closes the helper. At the end of its stdin
  (closed by the Dask process, or by its death) the helper delivers what it holds
  within ``close-timeout`` and exits: it outlives a killed Dask process by at most
  ``close-timeout``, and what it held is still delivered.
- Close: the relay hands over what is left, closes the helper's stdin, waits for
  its exit (``close-timeout`` plus a second) and takes ``lost_at_close`` from its
  last status.

The helper adds ``producer.helper-niceness`` (19 by default) to the Dask process's
niceness, so that on a busy machine Dask's own processes come first (at 19 it runs
mostly on CPU time they leave idle; see ``bench/scheduler_overhead.py``), and like
the relay and status threads it runs under ``SCHED_BATCH`` (Linux): waking up, none
of the recording's threads preempts a running thread of Dask's. The relay and status
threads keep the Dask process's niceness: they take its GIL, and a thread starved
while holding it would stall Dask's event loop. The helper's CPU is reported as
``relay_cpu_seconds`` in :meth:`stats`, its collector's collections per generation
as ``relay_gc_collections`` (it collects rarely: :data:`HELPER_GC_THRESHOLDS`). It
imports neither Dask's scheduler nor the pipeline's packages (37 MiB at start); what
it holds while behind is bounded by the buffer limits above, as Python objects
(about 180 MB measured while it trailed a 32k-task graph on a loaded machine).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import marshal
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from itertools import compress, islice, repeat
from operator import is_, is_not
from typing import Any

import orjson

try:
    import fcntl
except ImportError:  # not POSIX: the pipe keeps its size
    fcntl = None  # type: ignore[assignment]

from dask_blackbox.contract import encode_key
from dask_blackbox.producers.encode import sanitize
from dask_blackbox.producers.events import (
    TRANSITION_WEIGHT, TransitionBuilder, named_rows, tape_rows,
)
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import (
    BUSY_ENVELOPE, OS_THREAD_NAME, SENDER_THREAD_PREFIX, Transport, _name_os_thread,
    _yield_on_wakeup, new_producer_id, ready,
)

logger = logging.getLogger(__name__)

#: Most rows per frame (a frame of records is ~50 bytes a row).
FRAME_ITEMS = 20_000
#: The helper writes a status line at most this often (seconds) while anything changes.
STATUS_INTERVAL = 0.05
#: Helper deaths within :data:`_DEATH_WINDOW` seconds after which the relay sends
#: from its own thread instead.
MAX_DEATHS = 3
_DEATH_WINDOW = 60.0
#: After a busy envelope (``transport.BUSY_ENVELOPE`` events or more) the helper
#: packs the next partial one after this long (seconds; a full one at once), or
#: ``flush-interval`` if longer: under load, fewer and larger envelopes, each of
#: which costs the helper and the broker a request (see ``bench/relay_replay.py``).
#: After a hand-over of as many items, the relay thread waits as long.
LINGER = 0.5
#: The helper's input pipe's size (Linux; 64 KiB otherwise): the frames the helper
#: has not read yet wait there rather than in the relay thread's write, and a
#: killed Dask process's last frames are still read.
PIPE_BYTES = 1 << 20
#: The helper's collector thresholds (``gc.set_threshold``; CPython's default is
#: 700, 10, 10). Nearly all it allocates is acyclic and short-lived (a frame's rows,
#: their keys, strings and floats, the envelopes' parts): at 700, a collection
#: traverses the young rows every ~70 events and the older ones every ~700, about
#: 1 us an event of its ~5 (``bench/relay_replay.py collector``, session 19). The
#: cycles it does make (asyncio's futures and exceptions, aiokafka's) are still
#: collected, a few dozen times a minute under load instead of dozens a second.
HELPER_GC_THRESHOLDS = (20_000, 20, 20)
#: A helper's buffer limits: what the Dask process hands over is bounded there.
_UNBOUNDED = 1 << 62
_HEADER = struct.Struct("<I")
#: The helper's program: the Dask process's sys.path (argv[1], JSON), then main().
_HELPER_MAIN = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from dask_blackbox.producers.relay import main; main()")
_STATUS_FIELDS = ("sent_events", "sent_envelopes", "sent_drop_reports", "build_errors")


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value, protocol=5)
        return True
    except Exception:
        return False


def open_transport(settings: ProducerSettings, source: str, **kwargs: Any) -> Transport:
    """The transport ``blackbox.producer.sender`` asks for (see module docstring)."""
    in_process = settings.sender == "process" or (
        settings.sender == "auto" and source == "scheduler")
    return (RelayTransport if in_process else Transport)(settings, source, **kwargs)


class HelperFailed(Exception):
    """The helper process could not be started or used."""


class RelayTransport(Transport):
    """A :class:`~producers.transport.Transport` whose sender is a helper process
    (module docstring). The hot path and the buffer are the base class's."""

    #: A close waits for the helper's exit too (:meth:`_finish`).
    CLOSE_GRACE = 2.0

    def __init__(self, settings: ProducerSettings, source: str, **kwargs: Any):
        self._wake = threading.Event()
        self._lock = threading.Lock()  # the relay thread vs the status thread
        self._helper: _Helper | None = None
        self._deaths: deque[float] = deque()
        #: drops and identity last handed over
        self._drops_handed = (0, 0)
        self._identity_handed: tuple | None = None
        self._relay_cpu_before = 0.0  # CPU seconds of helpers that ended
        self.relay_pid: int | None = None
        self.in_process = True  # False once sending from this process's thread
        kwargs.setdefault("busy_linger", LINGER)
        super().__init__(settings, source, **kwargs)

    # ------------------------------------------------------------------ thread

    def _thread_main(self) -> None:
        _name_os_thread(OS_THREAD_NAME)
        _yield_on_wakeup()
        try:
            if self._relay():
                return
        except Exception:
            logger.exception("dask-blackbox %s: the relay to its helper process failed",
                             self.producer_id)
        self._send_here()

    def _relay(self) -> bool:
        """Hand over until closed (True), or False when the helper cannot be used."""
        try:
            self._start_helper()
        except HelperFailed as e:
            logger.warning("dask-blackbox %s: %s; sending from the %s process instead",
                           self.producer_id, e, self.source)
            return False
        flush_interval = linger = self.settings.flush_interval
        while True:
            closing = self._closing
            if not closing:
                self._wake.wait(linger)
                self._wake.clear()
                closing = self._closing
            helper = self._helper
            if helper.ended.is_set() and not self._replace_helper():
                return False
            try:
                handed = self._hand_over()
            except OSError:  # the helper's stdin is gone: it died
                self._helper.ended.wait(1.0)
                continue
            # Under load, fewer and larger frames: fewer wake-ups of this thread (each
            # takes the GIL from Dask's event loop) and of the helper.
            linger = self._busy_linger if handed >= BUSY_ENVELOPE else flush_interval
            if closing:
                self._finish()
                return True

    def _send_here(self) -> None:
        """Become a thread-mode sender on the same buffer (under a new producer id if
        a helper may have used the old one)."""
        helper = self._helper
        if helper is not None:
            helper.kill()
            self._abandon(helper)
            self._new_producer()
            # Drops handed over were the helpers' to report.
            self._reported_events, self._reported_bytes = self._drops_handed
            self._first_unreported_drop = None if (
                self.dropped_events == self._reported_events) else self._last_drop
        self.in_process = False
        self._helper = None
        super()._thread_main()

    def _begin_close(self) -> None:
        super()._begin_close()
        self._wake.set()

    # --------------------------------------------------------------- helper

    def _start_helper(self) -> None:
        helper = _Helper(self)
        self._helper = helper
        self.relay_pid = helper.process.pid
        try:
            helper.write_frame({
                "settings": self.settings, "source": self.source,
                "producer_id": self.producer_id, "cluster_id": self.cluster_id,
                "cluster_name": self.cluster_name,
            })
        except OSError as e:
            helper.kill()
            raise HelperFailed(f"its helper process exited at start ({e})") from e
        self._identity_handed = (self.cluster_id, self.cluster_name)
        helper.status_thread.start()

    def _replace_helper(self) -> bool:
        """After a helper's death: count what it held, start another (False: give up)."""
        old = self._helper
        code = old.process.poll()
        if not old.started:
            logger.warning("dask-blackbox %s: its helper process exited at start (code %s)",
                           self.producer_id, code)
            return False
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - _DEATH_WINDOW:
            self._deaths.popleft()
        lost = self._abandon(old)
        if len(self._deaths) >= MAX_DEATHS:
            logger.warning("dask-blackbox %s: its helper process died %d times within "
                           "%.0fs", self.producer_id, len(self._deaths), _DEATH_WINDOW)
            return False
        self._new_producer()
        logger.warning(
            "dask-blackbox: the helper process of %s died (code %s) with %d undelivered "
            "event(s), counted as dropped; a new one starts as %s",
            old.producer_id, code, lost, self.producer_id)
        try:
            self._start_helper()
        except HelperFailed as e:
            logger.warning("dask-blackbox %s: %s", self.producer_id, e)
            return False
        return True

    def _new_producer(self) -> None:
        """A new producer id, its ``seq`` from 0: a helper may have used the old."""
        self.producer_id = new_producer_id(self.source)
        self.next_seq = 0

    def _abandon(self, helper: _Helper) -> int:
        """Count the items ``helper`` held and did not finish as dropped; give their
        buffer room back. Twice for one helper counts nothing more."""
        helper.status_thread.join(1.0)
        with self._lock:
            lost = helper.forwarded - helper.done
            weight = sum(w for _, w in helper.batches)
            helper.batches.clear()
            helper.done = helper.forwarded
            self._held_events -= lost
            self._bytes_out += weight
            self.abandoned += lost
            self._relay_cpu_before += helper.cpu
            helper.cpu = 0.0
        if lost:
            now = time.time()
            self.add_drops(lost, weight, now, now)
        return lost

    def _finish(self) -> None:
        """Closing: end the helper's input and wait for it (close-timeout + 1 s)."""
        helper = self._helper
        helper.close_input()
        try:
            helper.process.wait(self.settings.close_timeout + 1.0)
        except subprocess.TimeoutExpired:
            logger.warning("dask-blackbox %s: its helper process did not finish within "
                           "close-timeout; stopped", self.producer_id)
            helper.kill()
        helper.status_thread.join(2.0)
        with self._lock:
            unfinished = helper.forwarded - helper.done
        self.lost_at_close = max(helper.lost_at_close, 0) + unfinished
        self._relay_cpu_before += helper.cpu
        helper.cpu = 0.0

    # ------------------------------------------------------------ hand-over

    def _hand_over(self) -> int:
        """Hand the buffer over, in frames; the number of items handed."""
        helper = self._helper
        items = 0
        first = True
        while first or self._buffer:
            first = False
            drops = None
            handed = (self.dropped_events, self.dropped_bytes)
            if handed != self._drops_handed:
                n = handed[0] - self._drops_handed[0]
                drops = (n, handed[1] - self._drops_handed[1],
                         self._first_unreported_drop or self._last_drop, self._last_drop)
                self._first_unreported_drop = None
                self._drops_handed = handed
            identity = None
            if (self.cluster_id, self.cluster_name) != self._identity_handed:
                identity = self._identity_handed = (self.cluster_id, self.cluster_name)
            rows, count, weight = self._take_rows(FRAME_ITEMS)
            if not count and drops is None and identity is None:
                return items
            items += count
            with self._lock:
                helper.forwarded += count
                helper.batches.append((helper.forwarded, weight))
            helper.write(self._encoded((drops, identity, *rows)))
        return items

    def _take_rows(self, limit: int) -> tuple[tuple[Any, list, list], int, int]:
        """Up to ``limit`` buffered items as rows (``records, names, others``, see
        :class:`_Receiver`), their count and their buffer weight. Counted held before
        they leave the buffer (the room errs on the safe side: every item is first
        counted a record, then the others are counted back), and taken with them,
        under the lock ``accepted_events`` reads with (see :mod:`producers.transport`).

        A record adds its group's names to ``names`` and its row to ``records``: as
        many rows of the compiled hook's tape (``marshal`` bytes, taken in one call),
        or else its five fields, as the transport buffered them, to a flat list. No
        object per record outlives the call, and records cost no Python-level loop
        here: the others (rare) are found by position, the groups named by a C-level
        lookup (a group met for the first time is named in Python)."""
        buffer = self._buffer
        k = min(len(buffer), limit)
        if not k:
            return ([], [], []), 0, 0
        with self._taking:
            with self._lock:  # the status thread gives held back
                self._held_events += k
                self._records_taken += TRANSITION_WEIGHT * k
            items = list(map(deque.popleft, repeat(buffer, k)))  # popped in C
            self._taken += k
        kinds = list(map(type, items))
        n_others = kinds.count(tuple)
        # The records' rows (or fields), buffered before their groups and in the same
        # order: taken at once, so that nothing below can leave them out of step.
        if self._tape is not None:
            records: Any = self._tape.take(k - n_others)
        else:
            records = list(map(deque.popleft, repeat(self._record_fields, 5 * (k - n_others))))
        builder = self._transitions
        groups = items if not n_others else list(
            compress(items, map(is_not, kinds, repeat(tuple))))
        names_of_records = list(map(builder.names.lookup, groups))
        others: list = []
        add_other = others.append
        transition_row, transition_build = builder.row, builder.build
        weight = TRANSITION_WEIGHT * len(names_of_records)
        for position in compress(range(k), map(is_, kinds, repeat(tuple))) if n_others else ():
            item = items[position]
            n = item[1]
            weight += n
            build = item[0]
            try:
                if build == transition_build:  # bound methods: equal, not identical
                    add_other((position, transition_row(item)))
                else:
                    add_other((position, (n, build(item))))
            except Exception:  # a bug in a builder must not stop the sender
                with self._lock:  # the status thread adds the helper's build errors
                    self._build_failed(item)
                # handed over as None: the helper counts it done at once, and its
                # room comes back with the rest of the frame's
                add_other((position, None))
        with self._lock:
            self._records_taken -= TRANSITION_WEIGHT * len(others)
        return (records, names_of_records, others), k, weight

    def _encoded(self, frame: tuple) -> bytes:
        """The frame's bytes (see :func:`encode_frame`). If it cannot be pickled, a
        record field that cannot be is replaced by its text (``encode_key``, what
        the event holds anyway), another row by its event passed through
        ``sanitize``, or else by None, counted as a build error."""
        try:
            return encode_frame(frame)
        except Exception:
            pass
        drops, identity, records, names, others = frame
        if type(records) is not bytes:  # a tape's rows are marshal bytes already
            records = [value if _pickles(value) else encode_key(value) for value in records]
        fixed = []
        for position, row in others:
            if not _pickles(row):
                try:
                    row = self._picklable(row)
                    pickle.dumps(row, protocol=5)
                except Exception:
                    with self._lock:  # already counted held: the helper counts it done
                        self._build_failed(("a row that cannot be pickled", None))
                    row = None
            fixed.append((position, row))
        return encode_frame((drops, identity, records, names, fixed))

    def _picklable(self, row: tuple) -> tuple:
        cap = self.settings.max_value_bytes
        event = self._transitions.event(row) if len(row) == 13 else row[1]
        weight = TRANSITION_WEIGHT if len(row) == 13 else row[0]
        return (weight, sanitize(event, cap)[0])

    # ------------------------------------------------------------ status in

    def _status(self, helper: _Helper, status: dict) -> None:
        """Apply a status line of ``helper`` (status thread)."""
        with self._lock:
            last = helper.last
            for field in _STATUS_FIELDS:
                value = status.get(field, 0)
                setattr(self, field, getattr(self, field) + value - last.get(field, 0))
                last[field] = value
            done = min(max(status.get("done", 0), helper.done), helper.forwarded)
            self._held_events -= done - helper.done
            helper.done = done
            batches = helper.batches
            while batches and batches[0][0] <= done:
                self._bytes_out += batches.popleft()[1]
        self.next_seq = status.get("next_seq", self.next_seq)
        self.connected = bool(status.get("connected"))
        helper.lost_at_close = status.get("lost_at_close", 0)
        helper.cpu = status.get("cpu", helper.cpu)
        helper.collections = status.get("gc", helper.collections)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        helper = self._helper
        out["sender"] = "process" if self.in_process else "thread"
        out["relay_pid"] = self.relay_pid
        out["relay_ready"] = helper is not None and helper.started
        out["relay_cpu_seconds"] = self._relay_cpu_before + (helper.cpu if helper else 0.0)
        out["relay_gc_collections"] = list(helper.collections) if helper else None
        return out


class _Helper:
    """One helper process, its pipes and its status thread."""

    def __init__(self, relay: RelayTransport):
        self.relay = relay
        self.producer_id = relay.producer_id
        self.forwarded = 0  # rows written (or being written) to it
        self.done = 0  # of those, finished by it
        self.batches: deque[tuple[int, int]] = deque()  # (forwarded after, weight)
        self.last: dict[str, int] = {}  # its counters in its last status
        self.lost_at_close = 0
        self.cpu = 0.0
        self.collections: list[int] = [0, 0, 0]  # its collector's, per generation
        self.started = False  # it wrote its first status line
        self.ended = threading.Event()  # its stdout ended
        # Isolated (-I): the helper imports what this process imports, from this
        # process's sys.path (the current directory as an absolute path where it
        # has ''), never a module that shadows ours from wherever it was started.
        path = [os.path.abspath(p) for p in sys.path]
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", _HELPER_MAIN, json.dumps(path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
            )
        except OSError as e:
            raise HelperFailed(f"cannot start its helper process ({e})") from e
        try:  # frames wait in the kernel while the helper is behind (Linux)
            fcntl.fcntl(self.process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (AttributeError, OSError):  # elsewhere, or above pipe-max-size: as is
            pass
        self.status_thread = threading.Thread(
            target=self._read_status, daemon=True,
            name=f"{SENDER_THREAD_PREFIX}{relay.source}-relay-status",
        )

    def write_frame(self, payload: Any) -> None:
        self.write(encode_frame(payload))

    def write(self, data: bytes) -> None:
        stdin = self.process.stdin
        stdin.write(_HEADER.pack(len(data)))
        stdin.write(data)
        stdin.flush()

    def close_input(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.close_input()

    def _read_status(self) -> None:
        _yield_on_wakeup()
        try:
            for line in self.process.stdout:
                try:
                    status = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                self.started = True
                self.relay._status(self, status)
        except Exception:
            logger.exception("dask-blackbox: reading its helper's status failed")
        finally:
            self.ended.set()
            self.relay._wake.set()


# ---------------------------------------------------------------- the helper


def _read_exact(fd: int, n: int) -> bytes | None:
    parts = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def encode_frame(payload: Any) -> bytes:
    """``b"M"`` and the ``marshal`` of ``payload`` (twice as fast as pickle for rows
    of builtins), or ``b"P"`` and its pickle if it holds other types."""
    try:
        return b"M" + marshal.dumps(payload)
    except ValueError:  # a type marshal does not know (datetime, a subclass...)
        return b"P" + pickle.dumps(payload, protocol=5)


def decode_frame(data: bytes) -> Any:
    body = memoryview(data)[1:]
    return marshal.loads(body) if data[:1] == b"M" else pickle.loads(body)


def _read_frame(fd: int) -> Any:
    """The next frame's payload; :data:`_END` at the end of the input."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return _END
    body = _read_exact(fd, _HEADER.unpack(header)[0])
    return _END if body is None else decode_frame(body)


_END = object()


class _Receiver:
    """The helper's side: rows in, offered to its own transport."""

    def __init__(self, hello: dict):
        settings = dataclasses.replace(
            hello["settings"], buffer_max_events=_UNBOUNDED, buffer_max_bytes=_UNBOUNDED)
        self.transport = Transport(
            settings, hello["source"], hello["cluster_id"], hello["cluster_name"],
            transition_builder=TransitionBuilder(settings.max_value_bytes), producer_id=hello["producer_id"],
            busy_linger=LINGER,
        )
        self._last_status: bytes | None = None
        self.skipped = 0  # rows the relay could not hand over: done at once

    def apply(self, frame: tuple) -> None:
        """Offer a frame's rows to the transport, in the Dask process's order.

        A frame is ``(drops, identity, records, names, others)``: ``records`` holds
        five fields (key, start, finish, stimulus_id, ts) per transition record, or
        the bytes of their rows the compiled hook's tape gave
        (:func:`~producers.events.tape_rows`), and ``names`` its group's names;
        ``others`` is ``[(position, row)]`` for the other
        items, ``position`` being the item's place in the frame, ``row`` a
        ``TransitionRow``, ``(weight, event)``, or None for an item the relay could
        not hand over (counted there, done here at once)."""
        drops, identity, records, names, others = frame
        t = self.transport
        if identity is not None:
            t.set_identity(*identity)
        if drops is not None:
            t.add_drops(*drops)
        # Appended as Transport.offer would, without its per-item checks: the
        # helper's buffer is unbounded (the Dask process bounds what it hands over),
        # and its weight is added once per frame, before the items are visible.
        t._bytes_in += TRANSITION_WEIGHT * len(names) + sum(
            TRANSITION_WEIGHT if len(row) == 13 else row[0]
            for _, row in others if row is not None)
        # Each transition goes as its row (a RecordRow, or the TransitionRow of one
        # with Dask's kwargs), which the transport packs into runs with its
        # neighbours; the records' rows and items are made in C, a run at a time.
        buffer = t._buffer
        append = buffer.append
        if type(records) is bytes:  # rows of the compiled hook's tape
            rows: Any = iter(named_rows(tape_rows(records), names))
        else:
            rows = zip(records[0::5], records[1::5], records[2::5], records[3::5],
                       records[4::5], names)
        items = zip(repeat(ready), repeat(TRANSITION_WEIGHT), rows)
        before = 0  # records put before the next other item
        for other, (position, row) in enumerate(others):
            if position - other > before:  # the records before it
                buffer.extend(islice(items, position - other - before))
                before = position - other
            if row is None:
                self.skipped += 1
            elif len(row) == 13:
                append((ready, TRANSITION_WEIGHT, row))
            else:
                append((ready, row[0], row[1]))
        buffer.extend(items)
        t.nudge()  # it packs now, or once its linger has passed since its last pack

    def status(self, force: bool = False) -> bytes | None:
        """The status line, if it changed (or ``force``)."""
        t = self.transport
        taken = t._taken  # read before held: done never errs high
        done = taken - t._held_events + self.skipped
        status = {
            "done": done, "sent_events": t.sent_events, "sent_envelopes": t.sent_envelopes,
            "sent_drop_reports": t.sent_drop_reports, "build_errors": t.build_errors,
            "next_seq": t.next_seq, "connected": t.connected,
            "lost_at_close": t.lost_at_close,
        }
        line = orjson.dumps(status)
        if line == self._last_status and not force:
            return None
        self._last_status = line
        status["cpu"] = time.process_time()
        status["gc"] = [s["collections"] for s in gc.get_stats()]
        return orjson.dumps(status) + b"\n"


def main() -> None:
    """The helper process (module docstring): frames from stdin, status to stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format="%(asctime)s - dask-blackbox relay %(process)d - %(levelname)s - %(message)s")
    for handler in logging.root.handlers:  # aiokafka's retries are demoted to DEBUG
        handler.setLevel(logging.WARNING)
    stdin = sys.stdin.fileno()
    out = sys.stdout.buffer
    hello = _read_frame(stdin)
    if hello is _END:
        return
    try:
        os.nice(hello["settings"].helper_niceness)
    except OSError:
        pass
    _yield_on_wakeup()  # before any thread starts: they inherit it and the niceness
    receiver = _Receiver(hello)
    gc.freeze()  # what importing and starting made is never traversed again
    gc.set_threshold(*HELPER_GC_THRESHOLDS)
    out.write(receiver.status(force=True))
    out.flush()
    selector = selectors.DefaultSelector()
    selector.register(stdin, selectors.EVENT_READ)
    next_status = 0.0
    try:
        while True:
            if selector.select(STATUS_INTERVAL):
                frame = _read_frame(stdin)
                if frame is _END:
                    break
                receiver.apply(frame)
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_INTERVAL
                line = receiver.status()
                if line is not None:
                    out.write(line)
                    out.flush()
    except BrokenPipeError:  # the Dask process is gone: deliver what is held
        pass
    t = receiver.transport
    t.close_blocking(time.monotonic() + t.settings.close_timeout + 0.5)
    try:
        out.write(receiver.status(force=True))
        out.flush()
    except (BrokenPipeError, ValueError):
        pass


if __name__ == "__main__":
    main()
