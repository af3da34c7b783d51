"""A bounded buffer filled by Dask's event loop and drained by a sender thread.

The hot path appends to a ``collections.deque``: no I/O, no lock, no encoding.
Everything else happens in a daemon thread running its own asyncio loop with an
aiokafka producer, so the Dask event loop never waits on Kafka or on encoding.

Two kinds of buffer items, one order:

- tuples ``(build, nbytes, *payload)`` (:meth:`Transport.offer`, which also bumps two
  counters): the sender calls ``build(item)`` to get the event mapping; ``nbytes``
  is the producer's cheap estimate of the item's weight;
- a scheduler transition that carried nothing but what Dask's own
  ``Scheduler.transition_log`` records (the common case, ~4 in 5): the task's
  ``TaskGroup`` (any item that is not a tuple), its record's five fields (key, start,
  finish, stimulus_id, timestamp: :data:`RECORD_FIELDS`) appended first to a second
  deque read in lockstep (:meth:`Transport.push_transition`). It weighs
  :data:`~producers.events.TRANSITION_WEIGHT`. The sender makes it a row of plain
  data (:data:`~producers.events.RecordRow`), and an offered transition (built by
  the transport's ``transition_builder``) its
  :data:`~producers.events.TransitionRow`; each run of consecutive rows is encoded
  as one ``TRANSITION_RUN`` event (:class:`~producers.events.TransitionRuns`, see
  :data:`dask_blackbox.contract.PACKED`), without a mapping per transition.
  Not the record itself: Dask keeps a record (a tuple and its recommendations dict)
  for ``distributed.admin.low-level-log-length`` transitions only; held by the
  buffer for a linger, records outlived young collections and were promoted to the
  oldest generation, whose growth triggers the garbage collector's full collections
  (one more per 200k-task graph, about 2 s of the scheduler's CPU; see
  ``bench/scheduler_overhead.py``). The fields are objects the task already holds
  (its key), strings and a float: nothing the collector tracks.
  Where the scheduler's compiled hook runs (:meth:`Transport.use_tape`), a record's
  row is not in that deque but in a ``producers._hotpath.Tape``, as bytes: the
  record's five fields, or, for a transition with Dask's kwargs but no error
  (processing->memory), nine, its worker, nbytes, typename and startstops too (see
  :func:`~producers.events.tape_row`); its group in the buffer keeps its place, and
  the sender takes as many rows as it takes groups.

The sender packs events into envelopes (:data:`dask_blackbox.contract.ENVELOPE_FIELDS`)
of at most :data:`~dask_blackbox.contract.MAX_ENVELOPE_BYTES`, encoding each run of
mappings with one orjson call and each run of transitions as one packed event.
``blackbox.producer.buffer-max-bytes`` counts each record as ``TRANSITION_WEIGHT``
and every buffered item as at least that much (a cheap upper bound: the hot path compares ``len(buffer)`` plus the items the sender
holds with a precomputed :attr:`Transport.room` and updates no counter). A partial
envelope leaves at most once per *linger*, a full one as soon as it is full. The
linger is ``flush-interval``, or, after a busy envelope (:data:`BUSY_ENVELOPE`
events or more), the transport's ``busy_linger`` if longer (a relay helper's, see
:mod:`producers.relay`): under load, fewer and larger envelopes. After an idle spell
(no envelope for a linger) the first items leave at once. Kafka compresses each
envelope on the way (``blackbox.kafka.compression``, zstd by default).

Delivery semantics:

- ``seq`` starts at 0 and is consumed only by a delivered envelope: an envelope whose
  send fails is retried, same bytes and same ``seq``, after reconnecting with
  exponential backoff (up to ``reconnect-backoff-max``). A duplicate ``seq`` is
  possible if a broker stored an envelope but its acknowledgement was lost; a gap
  means envelopes were genuinely lost (dropped at close, process killed).
- When the buffer is full the *newest* items are dropped and counted; once a delivery
  succeeds again, a :data:`~dask_blackbox.contract.DROPS` event with the counts since
  the last report leads the next envelope (goes alone if nothing else waits). Every
  drop counted before close is in a report (each holds the drops since the previous).
- :meth:`Transport.close` drains the buffer within ``close-timeout``; what cannot be
  delivered by then is lost, counted (``lost_at_close``) and logged.
- Memory: the buffer's limits, plus at most one packed envelope being retried
  (``MAX_ENVELOPE_BYTES``) and the built events put back for the next envelope.
- ``accepted_events`` (items buffered so far) is exact whenever it is read: the
  sender counts the items it takes and takes them out of the buffer under a lock
  that only readers of ``accepted_events`` share (never the hot path), so a wait
  for the delivery of everything accepted so far (:meth:`Transport.delivered`)
  ends. Read while an item was counted taken and still buffered, it counted that
  item twice, and such a wait never ended (a 200k-task benchmark run: 8,210 items
  of a hand-over in progress).
- The producer never creates topics: it sends to ``<prefix>.raw`` and retries until
  the broker accepts (create topics with ``dask_blackbox.kafka.ensure_topics`` or
  ``dask-blackbox up``; a broker with topic auto-creation creates it with its default
  partition count).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import operator
import os
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from itertools import compress, groupby, repeat
from operator import is_not
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer

from dask_blackbox.contract import DROPS, MAX_ENVELOPE_BYTES, SCHEMA_VERSION, TRANSITION, Drops
from dask_blackbox.producers.encode import describe, encode_event, type_name
from dask_blackbox.producers.events import (
    TRANSITION_WEIGHT, TransitionBuilder, TransitionRuns, named_rows, tape_rows,
)
from dask_blackbox.producers.settings import ProducerSettings

logger = logging.getLogger(__name__)

#: What the buffer keeps of a ``Scheduler.transition_log`` record (``key, start,
#: finish, recommendations, stimulus_id, timestamp``): key, start, finish,
#: stimulus_id, timestamp.
RECORD_FIELDS = operator.itemgetter(0, 1, 2, 4, 5)
#: Bytes of an envelope besides its events (header fields, brackets), rounded up.
_ENVELOPE_OVERHEAD = 1024
_EVENTS_BUDGET = MAX_ENVELOPE_BYTES - _ENVELOPE_OVERHEAD
#: Estimated weight of the events packed per envelope before encoding: under the
#: budget, so that an envelope rarely has to be split after encoding.
_BATCH_ESTIMATE = _EVENTS_BUDGET // 2
#: An envelope of at least this many events is busy: the next one lingers
#: ``busy_linger`` (:class:`Transport`) rather than ``flush-interval``.
BUSY_ENVELOPE = 200
#: Estimated weight of an event already built (put back after a split, or DROPS).
_CARRIED_WEIGHT = 500
#: A record's estimated share of an envelope, in a TRANSITION_RUN (~60-110 bytes).
_RECORD_ESTIMATE = 120
#: A record row's TransitionRow fields after its RecordRow's (none of them known).
_NO_EXTRAS = (None,) * 7

_FIRST_BACKOFF = 0.05
#: Names of sender threads start with this (the log handler ignores their records).
SENDER_THREAD_PREFIX = "dask-blackbox-"
#: The sender thread's name for the OS (``/proc/<pid>/task/<tid>/comm``, top -H,
#: py-spy): at most 15 characters.
OS_THREAD_NAME = "blackbox-sender"
#: How long one send or connect may take before it counts as failed.
_REQUEST_TIMEOUT = 10.0


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` for the OS too (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:  # no libc prctl: the OS name stays the process's
        pass


def _yield_on_wakeup() -> None:
    """Put the calling thread (and the threads it starts) under ``SCHED_BATCH``
    (Linux; elsewhere nothing): its share of CPU is what its niceness gives, but
    waking up it never preempts the thread that is running. The recording's threads
    wake often (every flush-interval, every status line); on a machine the workload
    fills, each preemption of Dask's event loop costs it more than the few
    microseconds the woken thread runs (see ``bench/scheduler_overhead.py``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: scheduled as before
        pass


def new_producer_id(source: str) -> str:
    """A producer id, unique to one sender: ``<source>-<uuid4 hex>``."""
    return f"{source}-{uuid.uuid4().hex}"


def ready(item: tuple) -> dict:
    """Builder of an item whose payload is the finished event: ``(ready, n, event)``."""
    return item[2]


class Transport:
    """One producer: buffer, sender thread and Kafka connection.

    ``source`` is ``"scheduler"`` or ``"worker"``; ``transition_builder`` is the
    builder of its transitions, whose key texts the encoder of transition records
    shares. ``cluster_id``/``cluster_name`` may be set later with
    :meth:`set_identity`; nothing is sent before they are known.
    """

    def __init__(
        self,
        settings: ProducerSettings,
        source: str,
        cluster_id: str | None = None,
        cluster_name: str | None = None,
        transition_builder: TransitionBuilder | None = None,
        producer_id: str | None = None,
        busy_linger: float | None = None,
    ):
        self.settings = settings
        self.source = source
        self.producer_id = producer_id or new_producer_id(source)
        self.cluster_id = cluster_id
        self.cluster_name = cluster_name
        self._kafka_kwargs = settings.kafka.producer_kwargs()

        self._buffer: deque[tuple] = deque()
        # Encoder of runs of transitions (sender thread only), sharing the key texts
        # of the builder of the transitions offered with Dask's kwargs.
        self._transitions = transition_builder or TransitionBuilder(settings.max_value_bytes)
        self._encode_run = TransitionRuns(self._transitions).encode
        #: RECORD_FIELDS of the transition records in the buffer, five per record,
        #: in their order
        self._record_fields: deque = deque()
        #: Where the records' rows are instead, if the scheduler's compiled hook
        #: writes them (a ``_hotpath.Tape``, one row per group in the buffer, in
        #: order; set before the first record): see :meth:`use_tape`.
        self._tape: Any = None
        self._max_events = settings.buffer_max_events
        self._max_bytes = settings.buffer_max_bytes
        # bytes_in is written only by the producing thread(s), bytes_out and
        # records_taken only by the sender: the buffer's weight without a lock.
        self._bytes_in = 0  # weight of offered items
        self._bytes_out = 0  # weight of delivered (or unbuildable) items
        self._records_taken = 0  # weight of transition records taken by the sender
        self._taken = 0  # items taken from the buffer by the sender
        #: Held by the sender while it counts items taken and takes them out of the
        #: buffer, and by accepted_events: never by the hot path.
        self._taking = threading.Lock()
        # Items taken from the buffer but not delivered yet (packed, in carry or in the
        # envelope being retried): they still count against the buffer's limits, so
        # an outage can neither grow memory past them nor let newer items in behind
        # dropped ones.
        self._held_events = 0

        self.dropped_events = 0
        self.dropped_bytes = 0
        self._first_unreported_drop: float | None = None
        self._last_drop = 0.0
        self._reported_events = 0
        self._reported_bytes = 0

        self.next_seq = 0
        self.sent_envelopes = 0
        self.sent_events = 0  # delivered, DROPS reports included
        self.sent_drop_reports = 0
        self.lost_at_close = 0
        self.build_errors = 0
        #: accepted items given up without a delivery attempt (see producers.relay)
        self.abandoned = 0
        self.connected = False

        #: The hot path accepts a record while ``len(buffer) + held < room``. Written
        #: only by the producing side; what the sender does (take, release) never
        #: makes the true room smaller, so a stale value errs on the safe side and
        #: is recomputed (:meth:`push_transition`) when it runs out.
        self.room = self._compute_room()

        self._closing = False
        #: the linger after a busy envelope (see _sender), never below flush-interval
        self._busy_linger = max(busy_linger or 0.0, settings.flush_interval)
        self._close_deadline = float("inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None  # what _sleep waits on
        self._thread = threading.Thread(
            target=self._thread_main, name=f"{SENDER_THREAD_PREFIX}{source}-sender", daemon=True
        )
        self._thread.start()
        _LIVE.add(self)

    # ------------------------------------------------------------ producing side

    def offer(self, item: tuple) -> None:
        """Buffer ``item`` (``(build, nbytes, *payload)``), or drop and count it when
        the buffer is full.

        Fast case: an item of ``k`` = ceil(nbytes / TRANSITION_WEIGHT) record weights
        fits if ``len(buffer) + held + k - 1 < room`` (both limits, as for a record),
        and takes ``k`` from the room, which stays a lower bound. Otherwise the limits
        are checked exactly, and the room is recomputed after an accepted item."""
        n = item[1]
        k = -(-n // TRANSITION_WEIGHT) or 1
        if len(self._buffer) + self._held_events + k - 1 < self.room:
            self._bytes_in += n
            self._buffer.append(item)
            self.room -= k
            return
        if len(self._buffer) + self._held_events < self._max_events and (
            self.buffered_bytes + n <= self._max_bytes
        ):
            self._bytes_in += n
            self._buffer.append(item)
            self.room = self._compute_room()
        else:
            self.drop(n)

    def push_transition(self, record: tuple, group: Any) -> None:
        """Buffer a ``Scheduler.transition_log`` record (its :data:`RECORD_FIELDS`)
        and the task's TaskGroup, or drop and count it when the buffer is full. The
        scheduler plugin inlines the fast case (``len(buffer) + held < room``: the
        fields, then the group) and calls this only when the room it saw ran out."""
        self.room = room = self._compute_room()
        if len(self._buffer) + self._held_events < room:
            # The fields first: the sender takes them once it sees the group.
            self._record_fields.extend(RECORD_FIELDS(record))
            self._buffer.append(group)
        else:
            self.drop(TRANSITION_WEIGHT)

    def use_tape(self, tape: Any) -> None:
        """Take the rows of the records in the buffer from ``tape`` (a
        ``producers._hotpath.Tape``) rather than from the fields deque: the
        scheduler's compiled hook writes a record's row there (a plain row, or a
        carried one, see :func:`~producers.events.tape_row`), then buffers its group.
        Called before any record is buffered; nothing may then push fields."""
        if self._record_fields or self._buffer:
            raise RuntimeError("use_tape() on a transport that has buffered items already")
        self._tape = tape

    def drop(self, nbytes: int) -> None:
        """Count an item the full buffer did not take."""
        self.dropped_events += 1
        self.dropped_bytes += nbytes
        self._last_drop = now = time.time()
        if self._first_unreported_drop is None:
            self._first_unreported_drop = now

    def add_drops(self, n: int, nbytes: int, since: float, until: float) -> None:
        """Count drops that happened before this transport (a relay's hot path, see
        :mod:`producers.relay`): reported as its own, after its next delivery."""
        self.dropped_events += n
        self.dropped_bytes += nbytes
        if self._first_unreported_drop is None:
            self._first_unreported_drop = since
        self._last_drop = max(self._last_drop, until)

    def _compute_room(self) -> int:
        """The ``len(buffer) + held`` below which one more transition record fits
        both limits (the weight of what is buffered besides the records in the
        buffer, plus :data:`TRANSITION_WEIGHT` per buffered item, see
        :attr:`buffered_bytes`)."""
        rest = self._bytes_in + self._records_taken - self._bytes_out
        return max(min(self._max_events,
                       (self._max_bytes - rest) // TRANSITION_WEIGHT + self._held_events), 0)

    @property
    def accepted_events(self) -> int:
        """Items buffered so far, exactly (see the module docstring)."""
        with self._taking:
            return self._taken + len(self._buffer)

    def set_identity(self, cluster_id: str, cluster_name: str) -> None:
        self.cluster_name = cluster_name
        self.cluster_id = cluster_id

    @property
    def buffered_events(self) -> int:
        return len(self._buffer) + self._held_events

    @property
    def buffered_bytes(self) -> int:
        """The buffer's weight, an upper bound: every item still in the buffer counts
        :data:`TRANSITION_WEIGHT` more than its own estimate, records nothing else."""
        return (self._bytes_in + self._records_taken - self._bytes_out
                + TRANSITION_WEIGHT * len(self._buffer))

    @property
    def sender_alive(self) -> bool:
        return self._thread.is_alive()

    def delivered(self, accepted_events: int) -> bool:
        """Whether the first ``accepted_events`` accepted events have been delivered,
        or will never be (unbuildable, given up): compare with an earlier
        ``stats()["accepted_events"]``."""
        return (self.sent_events - self.sent_drop_reports + self.build_errors
                + self.abandoned >= accepted_events)

    def nudge(self) -> None:
        """Items were buffered by another way than the hot path (a relay helper's
        frame, see :mod:`producers.relay`): the sender reconsiders its linger now,
        not at its next wake-up, and packs at once if it lingered long enough
        (thread-safe)."""
        self._wake_sender()

    def _wake_sender(self) -> None:
        """Cut the sender's sleep short, from any thread."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._cut_sleep)
            except RuntimeError:  # the sender's loop already ended
                pass

    def stats(self) -> dict[str, Any]:
        """Counters, for tests and diagnostics."""
        return {
            "producer_id": self.producer_id,
            "buffered_events": self.buffered_events,
            "buffered_bytes": self.buffered_bytes,
            "max_events": self.settings.buffer_max_events,
            "max_bytes": self.settings.buffer_max_bytes,
            "dropped_events": self.dropped_events,
            "dropped_bytes": self.dropped_bytes,
            "next_seq": self.next_seq,
            "sent_envelopes": self.sent_envelopes,
            "accepted_events": self.accepted_events,
            "sent_events": self.sent_events,
            "sent_drop_reports": self.sent_drop_reports,
            "lost_at_close": self.lost_at_close,
            "build_errors": self.build_errors,
            "abandoned": self.abandoned,
            "sender_cpu_seconds": self._sender_cpu_seconds(),
            "sender": "thread",
            "connected": self.connected,
        }

    def _sender_cpu_seconds(self) -> float | None:
        """CPU time the sender thread used so far (None where the OS can't say)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError, TypeError):
            return None

    # ----------------------------------------------------------------- closing

    #: Seconds a close waits for the sender beyond ``close-timeout``.
    CLOSE_GRACE = 1.0

    def close_deadline(self) -> float:
        """The ``time.monotonic()`` by which a close begun now has ended."""
        return time.monotonic() + self.settings.close_timeout + self.CLOSE_GRACE

    async def close(self) -> None:
        """Deliver what is buffered within ``close-timeout``, then stop the sender.
        Awaitable from the Dask event loop without blocking it."""
        self._begin_close()
        deadline = self.close_deadline()
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def close_blocking(self, deadline: float | None = None) -> None:
        """:meth:`close` for callers without an event loop (interpreter exit); waits
        until ``deadline`` (``time.monotonic()``) if given."""
        self._begin_close()
        if deadline is None:
            deadline = self.close_deadline()
        self._thread.join(max(deadline - time.monotonic(), 0))

    def _begin_close(self) -> None:
        if self._closing:
            return
        self._close_deadline = time.monotonic() + self.settings.close_timeout
        self._closing = True
        # Later offers are dropped: nothing drains the buffer after the sender stops.
        self._max_events = 0
        self.room = 0
        _LIVE.discard(self)
        self._wake_sender()

    def _cut_sleep(self) -> None:
        if self._waiter is not None:
            _resolve(self._waiter)

    # ------------------------------------------------------------ sender thread

    def _thread_main(self) -> None:
        _name_os_thread(OS_THREAD_NAME)
        _yield_on_wakeup()
        try:
            asyncio.run(self._sender())
        except Exception:
            logger.exception("dask-blackbox sender %s stopped on an error", self.producer_id)

    async def _sender(self) -> None:
        self._loop = asyncio.get_running_loop()
        kafka = _KafkaLink(self)
        # built events not yet packed, with their buffer weight (None: not from the
        # buffer, like a DROPS report)
        carry: deque[tuple[dict, int | None]] = deque()
        envelope: tuple[bytes, int, list] | None = None  # (encoded, events, weights)
        backoff = _FIRST_BACKOFF
        flush_interval = linger = self.settings.flush_interval
        last_pack = 0.0
        try:
            while True:
                if envelope is None and self.cluster_id is not None:
                    # Linger: a partial envelope at most once per linger, a full one
                    # as soon as there is enough for it (few envelopes, each event
                    # waits at most about one linger).
                    wait = last_pack + linger - time.monotonic()
                    if wait > 0 and not self._closing and (
                            self.buffered_bytes < _BATCH_ESTIMATE):
                        await self._sleep(wait)
                        continue
                    now = time.monotonic()
                    envelope = self._pack(carry)
                    if envelope is not None:  # an idle spell ends with a pack at once
                        last_pack = now
                        linger = (self._busy_linger if envelope[1] >= BUSY_ENVELOPE
                                  else flush_interval)
                if envelope is None and self.next_seq and (
                        self.dropped_events != self._reported_events):
                    # Drops counted after the last delivery with nothing to send
                    # behind them (a relay's helper learns of its hot path's drops
                    # with a frame, maybe an empty one): reported on their own.
                    self._report_drops(carry)
                    continue
                if envelope is None:
                    # Nothing left to send (or, without an identity yet, nothing
                    # sendable): a closing sender is done, or out of time.
                    if self._closing and (
                        self.cluster_id is not None
                        or time.monotonic() >= self._close_deadline
                    ):
                        return
                    await self._sleep(flush_interval)
                    continue
                if await kafka.send(envelope[0]):
                    self.next_seq += 1
                    self.sent_envelopes += 1
                    self.sent_events += envelope[1]
                    self._release(envelope[2])
                    envelope = None
                    backoff = _FIRST_BACKOFF
                    self._report_drops(carry)
                elif self._closing and time.monotonic() >= self._close_deadline:
                    return
                else:
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, self.settings.reconnect_backoff_max)
        finally:
            lost = len(self._buffer) + len(carry) + (envelope[1] if envelope else 0)
            # Whatever was not delivered is gone now (and counted below).
            with self._taking:
                self._taken += len(self._buffer)
                self._buffer.clear()
            self._record_fields.clear()
            if self._tape is not None:
                self._tape.clear()
            self._held_events = 0
            self._bytes_out = self._bytes_in + self._records_taken
            if lost:
                self.lost_at_close = lost
                logger.warning(
                    "dask-blackbox %s closed with %d undelivered event(s): "
                    "Kafka at %s was not reachable within close-timeout",
                    self.producer_id, lost,
                    ",".join(self._kafka_kwargs["bootstrap_servers"]),
                )
            await kafka.stop()

    async def _sleep(self, seconds: float) -> None:
        """Sleep; :meth:`close` cuts a sleep short once, never a closing one."""
        if self._closing:
            await asyncio.sleep(max(min(seconds, self._close_deadline - time.monotonic()), 0))
            return
        # A bare future and a timer: one loop wake-up per sleep (wait_for on an
        # Event costs a task and three), and each wake-up takes the GIL from Dask.
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(seconds, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _pack(self, carry: deque) -> tuple[bytes, int, list] | None:
        """The next envelope, its event count and its events' buffer weights, or None
        if nothing is waiting.

        Built events are taken from ``carry``, then items from the buffer are built,
        until their estimated weight reaches :data:`_BATCH_ESTIMATE`; the batch is
        encoded with a single orjson call. If the result exceeds the envelope
        budget, the second half goes back to ``carry`` (order kept) until it fits.
        """
        events: list[dict] = []
        weights: list[int | None] = []
        weight = 0
        while carry and weight < _BATCH_ESTIMATE:
            event, w = carry.popleft()
            events.append(event)
            weights.append(w)
            weight += _CARRIED_WEIGHT
        # The sender's inner loops, once per event: locals only. Only this thread
        # takes from the buffer, so the items counted here exist. First the items
        # are taken, each counted held (and a record's weight taken) before it
        # leaves the buffer, so that the hot path's room never errs on the unsafe
        # side, and all counted taken with the last of them, under the lock
        # accepted_events reads with; then they are built.
        buffer = self._buffer
        popleft, field = buffer.popleft, self._record_fields.popleft
        taken: list = []
        take = taken.append
        with self._taking:
            for _ in range(len(buffer)):
                if weight >= _BATCH_ESTIMATE:
                    break
                item = buffer[0]
                self._held_events += 1
                if type(item) is not tuple:  # a transition record's group
                    self._records_taken += TRANSITION_WEIGHT
                    weight += _RECORD_ESTIMATE
                else:
                    weight += item[1]
                popleft()
                take(item)
            self._taken += len(taken)
        add_event, add_weight = events.append, weights.append
        transitions = self._transitions
        names = transitions.names
        transition_build, transition_row = transitions.build, transitions.row
        if self._tape is not None:  # the records' rows, as many as groups were taken
            groups = list(compress(taken, map(is_not, map(type, taken), repeat(tuple))))
            fields = tape_rows(self._tape.take(len(groups)))
            try:
                rows_taken = iter(named_rows(fields, list(map(names.lookup, groups))))
            except Exception:  # a bug in the names: each record is a build error
                rows_taken = repeat(None)
        for item in taken:
            if type(item) is not tuple:  # a transition record's group
                # its RecordRow: the fields, in RECORD_FIELDS order, and the names
                # (or the tape's row: a RecordRow, or a TransitionRow)
                try:
                    if self._tape is not None:
                        if (row := next(rows_taken)) is None:
                            raise ValueError("no names for a record of the tape")
                        add_event(row)
                        add_weight(TRANSITION_WEIGHT)
                        continue
                    row = (field(), field(), field(), field(), field())
                    add_event((*row, names(item)))
                except Exception:  # a bug in the names must not stop the sender
                    self._build_failed((names,))
                    self._release([TRANSITION_WEIGHT])
                    continue
                add_weight(TRANSITION_WEIGHT)
                continue
            n = item[1]
            build = item[0]
            try:  # a transition as its TransitionRow, packed with the records around it
                add_event(transition_row(item) if build == transition_build else build(item))
            except Exception:  # a bug in a builder must not stop the sender
                self._build_failed(item)
                self._release([n])
                continue
            add_weight(n)
        if not events:
            return None
        body = self._encode_events(events)
        while len(body) > _EVENTS_BUDGET and len(events) > 1:
            half = len(events) // 2
            carry.extendleft(reversed(list(zip(events[half:], weights[half:]))))
            del events[half:], weights[half:]
            body = self._encode_events(events)
        if len(body) > _EVENTS_BUDGET:
            event = events[0]
            if type(event) is tuple:  # a transition's row that alone fills an envelope
                event = {"kind": TRANSITION, "ts": event[4]}
            logger.warning(
                "dask-blackbox: a %s event of %d bytes exceeds an envelope; it is "
                "replaced by its description", event.get("kind"), len(body),
            )
            body = self._encode_events([{
                "kind": event.get("kind"), "ts": event.get("ts"),
                "__type__": type_name(event), "__size__": len(body),
            }])
        header = orjson.dumps(
            {
                "schema": SCHEMA_VERSION,
                "cluster_id": self.cluster_id,
                "cluster_name": self.cluster_name,
                "source": self.source,
                "producer_id": self.producer_id,
                "seq": self.next_seq,
                "sent_at": time.time(),
            }
        )
        return b"".join((header[:-1], b',"events":', body, b"}")), len(events), weights

    def _encode_events(self, events: list) -> bytes:
        """The JSON array of ``events``: mappings and transition records
        (:data:`~producers.events.RecordRow` tuples), in order. Each run of mappings
        is encoded with one orjson call (:meth:`_encode_mappings`), each run of
        records as one ``TRANSITION_RUN`` event (:class:`~producers.events.TransitionRuns`):
        an event a reader expands back to them, at its place."""
        parts: list = []
        for kind, run in groupby(events, type):
            run = list(run)
            if kind is tuple:
                try:
                    parts.append(self._encode_run(run))
                    continue
                except Exception:  # a bug in the encoder must not lose the records
                    self._build_failed((self._encode_run,))
                    run = list(map(self._record_event, run))
            parts.append(memoryview(self._encode_mappings(run))[1:-1])
        return b"[" + b",".join(parts) + b"]"

    def _record_event(self, row: tuple) -> dict:
        """The TRANSITION event of a RecordRow or TransitionRow, or only its kind and
        time if even that cannot be built (a reader then names what it lacks)."""
        try:
            return self._transitions.event(row if len(row) == 13 else (*row, *_NO_EXTRAS))
        except Exception:
            return {"kind": TRANSITION, "ts": row[4]}

    def _encode_mappings(self, events: list[dict]) -> bytes:
        """The JSON array of ``events``: one orjson call, values it cannot encode
        described; per event with :func:`encode_event`'s fallbacks if that fails."""
        try:
            return orjson.dumps(events, default=describe, option=orjson.OPT_NON_STR_KEYS)
        except Exception:
            max_bytes = self.settings.max_value_bytes
            return b"[" + b",".join(encode_event(e, max_bytes) for e in events) + b"]"

    def _build_failed(self, item: tuple) -> None:
        self.build_errors += 1
        if self.build_errors <= 3 or self.build_errors % 10_000 == 0:
            logger.exception(
                "dask-blackbox could not build an event with %s (%d so far)",
                item[0], self.build_errors,
            )

    def _report_drops(self, carry: deque[dict]) -> None:
        """After a delivery: put a DROPS event with the drops not reported yet first."""
        dropped, dropped_bytes = self.dropped_events, self.dropped_bytes
        if dropped == self._reported_events:
            return
        since = self._first_unreported_drop
        self._first_unreported_drop = None
        event: Drops = {
            "kind": DROPS,
            "ts": time.time(),
            "dropped_events": dropped - self._reported_events,
            "dropped_bytes": dropped_bytes - self._reported_bytes,
            "since": since if since is not None else self._last_drop,
            "until": self._last_drop,
        }
        self._reported_events, self._reported_bytes = dropped, dropped_bytes
        self.sent_drop_reports += 1  # counted now; it leads the next envelope
        carry.appendleft((event, None))

    def _release(self, weights: list[int | None]) -> None:
        """Give back the buffer room of delivered (or unbuildable) items."""
        from_buffer = [w for w in weights if w is not None]
        self._bytes_out += sum(from_buffer)
        self._held_events -= len(from_buffer)


class _KafkaLink:
    """The aiokafka producer of one transport, recreated after any failure."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.producer: AIOKafkaProducer | None = None
        self.key: bytes | None = None
        self.failing_since: float | None = None

    async def send(self, envelope: bytes) -> bool:
        """Deliver one envelope (acks=all); False after any failure, logged once per
        outage."""
        t = self.transport
        timeout = _REQUEST_TIMEOUT
        if t._closing:
            timeout = max(min(timeout, t._close_deadline - time.monotonic()), 0.01)
        try:
            if self.producer is None:
                self.producer = AIOKafkaProducer(
                    **t._kafka_kwargs,
                    client_id=t.producer_id,
                    acks="all",
                    linger_ms=0,
                    request_timeout_ms=int(_REQUEST_TIMEOUT * 1000),
                    max_request_size=MAX_ENVELOPE_BYTES + 100_000,
                )
                await asyncio.wait_for(self.producer.start(), timeout)
            if self.key is None:
                self.key = t.cluster_id.encode()
            # send() returns once the batch is queued (aiokafka bounds that wait by
            # request_timeout_ms; a closing sender by its deadline too), then the
            # acknowledgement is awaited: wait_for on a future needs no extra task,
            # so fewer loop wake-ups, each of which takes the GIL from Dask.
            queued = self.producer.send(t.settings.raw_topic, envelope, key=self.key)
            acked = await (asyncio.wait_for(queued, timeout) if t._closing else queued)
            await asyncio.wait_for(acked, timeout)
        except Exception as e:
            t.connected = False
            if self.failing_since is None:
                self.failing_since = time.time()
                logger.warning(
                    "dask-blackbox %s cannot deliver to Kafka topic %s (%s: %s); "
                    "buffering and retrying",
                    t.producer_id, t.settings.raw_topic, type(e).__name__, e,
                )
            await self.stop()
            return False
        t.connected = True
        if self.failing_since is not None:
            logger.info(
                "dask-blackbox %s delivers to Kafka again after %.1fs",
                t.producer_id, time.time() - self.failing_since,
            )
            self.failing_since = None
        return True

    async def stop(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            try:
                await asyncio.wait_for(producer.stop(), 2.0)
            except Exception:
                pass


class _DemoteSenderNoise(logging.Filter):
    """aiokafka logs every failed connection attempt at ERROR; on our sender threads
    those records become DEBUG, since :class:`_KafkaLink` reports an outage once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.CRITICAL and threading.current_thread().name.startswith(
            SENDER_THREAD_PREFIX
        ):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_AIOKAFKA_LOGGERS = ("aiokafka", "aiokafka.client", "aiokafka.conn", "aiokafka.cluster",
                     "aiokafka.producer.producer", "aiokafka.producer.sender")
for _name in _AIOKAFKA_LOGGERS:
    logging.getLogger(_name).addFilter(_DemoteSenderNoise())


#: Transports not closed yet, flushed (bounded) at interpreter exit.
_LIVE: weakref.WeakSet[Transport] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    transports = list(_LIVE)
    for transport in transports:
        transport._begin_close()
    deadline = max((t.close_deadline() for t in transports), default=0.0)
    for transport in transports:
        transport.close_blocking(deadline)
