"""The sender: drains a :class:`~producers.buffer.Buffer` into Kafka.

A :class:`Sender` thread runs its own asyncio loop (aiokafka's) in the Dask process. Each round it takes items worth about half
an envelope (:data:`BATCH_WEIGHT`), makes the rows of all but transitions, encodes them
(:func:`pack_captured`: each run of transition items one ``CAPTURE``, the other events as
the JSON of version 2 holds them) into MessagePack envelopes of version 3
(:data:`dask_blackbox.contract.ENVELOPE_FIELDS`) of at most
:data:`~dask_blackbox.contract.MAX_ENVELOPE_BYTES` and delivers them (:class:`KafkaLink`;
Kafka compresses each, ``blackbox.kafka.compression``). It keeps the CPU each part of that
costs its thread (``cpu_take``, ``cpu_encode``, ``cpu_send`` in :meth:`Sender.stats`). A full envelope leaves as soon as
there is enough for it, a partial one at most once per *linger* (:meth:`Drain.linger`),
or at once after :meth:`Drain.hurry` (a log record at WARNING or above: often the last
word of a process about to die); an idle sender sleeps until the buffer keeps an item,
which leaves at once.

Delivery semantics:

- ``seq`` starts at 0 and only a delivered envelope consumes it: a failed send is retried
  (same events, same ``seq``) after reconnecting with exponential backoff (up to
  ``reconnect-backoff-max``). A duplicate ``seq`` means a broker stored an envelope whose
  acknowledgement was lost; a gap, that envelopes were lost.
- A take's items are released (their room given back) once all its envelopes are delivered.
- The buffer's drops are reported by a ``DROPS`` event leading the next envelope after a
  delivery (alone if nothing else waits).
- Closing delivers what is buffered within ``close-timeout``; the rest is lost, counted
  (``lost_at_close``) and logged.
- An item no row can be made of (a bug) is counted (``build_errors``) and given up; an event
  that cannot be encoded is sanitized (:func:`~producers.encode.encode_event`), one that
  alone exceeds an envelope replaced by its description.
- The producer never creates topics: it sends to ``<prefix>.raw`` and retries until the
  broker accepts (``dask_blackbox.kafka.ensure_topics``, ``dask-blackbox up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from itertools import groupby
from typing import Any, NamedTuple, TypeVar

import msgspec
import orjson
from aiokafka import AIOKafkaProducer

from dask_blackbox.contract import DROPS, MAX_ENVELOPE_BYTES, SCHEMA_VERSION, Drops
from dask_blackbox.producers.buffer import Buffer
from dask_blackbox.producers.encode import describe, encode_event, type_name
from dask_blackbox.producers.rows import (
    Ready, RowMaker, TransitionItem, TransitionRow, capture_event, capture_of_rows, run_event,
)
from dask_blackbox.producers.settings import ProducerSettings

logger = logging.getLogger(__name__)

#: An envelope's bytes for its events: the rest (header fields, brackets) is under 1 KiB.
EVENTS_BUDGET = MAX_ENVELOPE_BYTES - 1024
#: The weight of one take: under the budget, so that an envelope is rarely split.
BATCH_WEIGHT = EVENTS_BUDGET // 2
#: A take of this many rows or more is busy: a stream of 1,000 rows a second or more at
#: the default 50 ms ``flush-interval``. The next take then waits ``BUSY_LINGER``, so a
#: busy stream goes in few large envelopes (what a send costs is mostly per envelope)
#: while a trickle keeps its freshness.
BUSY_ENVELOPE = 50
BUSY_LINGER = 0.5
#: Names of the recorder's threads start with this (the log handler skips them).
THREAD_PREFIX = "dask-blackbox-"
#: An idle sender sleeps until an item comes (``Buffer.on_offer``), or this long.
IDLE_WAIT = 1.0
#: How long one send or connect may take before it counts as failed.
REQUEST_TIMEOUT = 10.0
_FIRST_BACKOFF = 0.05


def new_producer_id(source: str) -> str:
    return f"{source}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class Identity:
    """Who sends: the cluster (known later on a preloaded worker) and the producer."""

    source: str
    cluster_id: str | None = None
    cluster_name: str | None = None
    producer_id: str = ""  # a new one if empty

    def __post_init__(self) -> None:
        self.producer_id = self.producer_id or new_producer_id(self.source)


class Body(NamedTuple):
    """An envelope's events (a JSON array), its rows, and the DROPS reports among them."""

    events: bytes
    n_rows: int
    n_drop_reports: int
    dropped_events: int  # the drops those report


def encode_rows(rows: list, max_chars: int) -> bytes:
    """The JSON array of rows' events: each run of transition rows one
    ``TRANSITION_RUN``, each run of other rows with one orjson call. Never raises."""
    parts: list = []
    for kind, run in groupby(rows, type):
        if kind is TransitionRow:
            parts.append(encode_event(run_event(list(run)), EVENTS_BUDGET))
            continue
        events = [row.event for row in run]
        try:
            parts.append(memoryview(orjson.dumps(events, default=describe,
                                                 option=orjson.OPT_NON_STR_KEYS))[1:-1])
        except Exception:
            parts.append(b",".join(encode_event(e, max_chars) for e in events))
    return b"[" + b",".join(parts) + b"]"


def _fit(entries: list, encode: Any, encode_described: Any) -> list[Body]:
    """``entries`` as envelope bodies under the budget, in order: ``encode(entries)``
    gives a body and how many events it holds (none: no body), halved until it fits;
    an entry that alone does not fit is replaced by its description, which
    ``encode_described`` encodes."""
    body, n = encode(entries)
    if not n:
        return []
    if len(body) > EVENTS_BUDGET and len(entries) > 1:
        half = len(entries) // 2
        return (_fit(entries[:half], encode, encode_described)
                + _fit(entries[half:], encode, encode_described))
    if len(body) > EVENTS_BUDGET:
        entry = entries[0]
        event = entry.event if type(entry) is Ready else {"kind": "transition", "ts": entry.ts}
        logger.warning("dask-blackbox: a %s event of %d bytes exceeds an envelope; it is "
                       "replaced by its description", event.get("kind"), len(body))
        body = encode_described({"kind": event.get("kind"), "ts": event.get("ts"),
                                 "__type__": type_name(event), "__size__": len(body)})
    reports = [entry.event["dropped_events"] for entry in entries
               if type(entry) is Ready and entry.event.get("kind") == DROPS]
    return [Body(body, n, len(reports), sum(reports))]


def pack(rows: list, max_chars: int) -> list[Body]:
    """Rows as version 2 (JSON) envelope bodies under the budget (:func:`_fit`)."""
    return _fit(rows, lambda rows: (encode_rows(rows, max_chars), len(rows)),
                lambda described: b"[" + encode_event(described, max_chars) + b"]")


_encode = msgspec.msgpack.Encoder().encode
_Raw = msgspec.Raw
_thread_time = time.thread_time


def encode_captured(entries: list, maker: RowMaker, failed: Any = None) -> tuple[bytes, int]:
    """The MessagePack array of the events of ``entries`` (transition items and rows,
    ``RowMaker.rows(captured=True)``), and how many events it holds: each run of
    transition items one ``CAPTURE`` (:func:`~producers.rows.capture_event`; one whose
    values msgspec cannot encode as the capture of their rows,
    :func:`~producers.rows.capture_of_rows`), each run of other rows the events the
    JSON of version 2 holds (:func:`encode_rows`). A transition item no row can be
    made of (a bug) is left out and passed to ``failed(n, item)``. Never raises."""
    events: list = []
    n = 0
    for kind, group in groupby(entries, type):
        run: list = list(group)
        if kind is TransitionItem:
            try:  # encoded once, here: the envelope's array embeds the bytes
                capture: Any = _Raw(_encode(capture_event(run, maker)))
            except Exception:  # values msgspec cannot encode, or items no row is made of
                rows, bad = maker.rows(run)
                if bad and failed is not None:
                    failed(len(bad), bad[0])
                if not rows:
                    continue
                run = rows
                capture = capture_of_rows(rows, EVENTS_BUDGET)
            events.append(capture)
        else:
            events += orjson.loads(encode_rows(run, maker.max_chars))
        n += len(run)
    return _encode(events), n


def pack_captured(entries: list, maker: RowMaker, failed: Any = None) -> list[Body]:
    """:func:`pack` for version 3: ``entries`` as MessagePack envelope bodies under the
    budget (:func:`_fit`; none for entries that all failed, see
    :func:`encode_captured`)."""
    return _fit(entries, lambda entries: encode_captured(entries, maker, failed),
                lambda described: _encode([orjson.loads(encode_event(described,
                                                                     maker.max_chars))]))


def envelope(identity: Identity, seq: int, events: bytes, sent_at: float | None = None) -> bytes:
    """A version 3 envelope: the MessagePack map of the header and ``events`` (a
    MessagePack array, :func:`encode_captured`), sent now (or at ``sent_at``)."""
    header = _encode({
        "schema": SCHEMA_VERSION, "cluster_id": identity.cluster_id,
        "cluster_name": identity.cluster_name, "source": identity.source,
        "producer_id": identity.producer_id, "seq": seq,
        "sent_at": time.time() if sent_at is None else sent_at})
    # a fixmap of 7 entries (0x87) becomes one of 8, "events" last
    return b"".join((b"\x88", header[1:], _EVENTS_KEY, events))


_EVENTS_KEY = _encode("events")


class KafkaLink:
    """The aiokafka producer of one sender, recreated after any failure."""

    def __init__(self, settings: ProducerSettings, identity: Identity):
        self.settings = settings
        self.identity = identity
        self.kwargs = settings.kafka.producer_kwargs()
        self.producer: AIOKafkaProducer | None = None
        self.failing_since: float | None = None
        self.connected = False

    async def send(self, envelope: bytes, timeout: float) -> bool:
        """Deliver one envelope (acks=all); False after any failure, logged once per outage."""
        identity = self.identity
        try:
            if self.producer is None:
                self.producer = AIOKafkaProducer(
                    **self.kwargs, client_id=identity.producer_id, acks="all", linger_ms=0,
                    request_timeout_ms=int(REQUEST_TIMEOUT * 1000),
                    max_request_size=MAX_ENVELOPE_BYTES + 100_000,
                    enable_idempotence=self.settings.kafka.idempotence)
                await asyncio.wait_for(self.producer.start(), timeout)
            if identity.cluster_id is None:
                raise RuntimeError("no cluster id to key the envelope by yet")
            queued = await asyncio.wait_for(self.producer.send(
                self.settings.raw_topic, envelope, key=identity.cluster_id.encode()), timeout)
            await asyncio.wait_for(queued, timeout)
        except Exception as e:
            self.connected = False
            if self.failing_since is None:
                self.failing_since = time.time()
                logger.warning("dask-blackbox %s cannot deliver to Kafka topic %s (%s: %s); "
                               "buffering and retrying", identity.producer_id,
                               self.settings.raw_topic, type(e).__name__, e)
            await self.stop()
            return False
        self.connected = True
        if self.failing_since is not None:
            logger.info("dask-blackbox %s delivers to Kafka again after %.1fs",
                        identity.producer_id, time.time() - self.failing_since)
            self.failing_since = None
        return True

    async def stop(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), 2.0)


_D = TypeVar("_D", bound="Drain")


class Drain:
    """What empties a buffer from a thread of its own (``_main``, named
    ``<source>-<role>``): the :class:`Sender`."""

    role = "drain"

    def __init__(self, buffer: Buffer, settings: ProducerSettings, identity: Identity,
                 rows: RowMaker, busy_linger: float = BUSY_LINGER):
        self.buffer = buffer
        self.settings = settings
        self.identity = identity
        self.rows = rows
        self.busy_linger = max(busy_linger, settings.flush_interval)
        self.build_errors = 0  # items no row could be made of, given up
        self.urgent = False  # an item came that must not wait out the linger (hurry)
        self.closing = False
        self.close_deadline = float("inf")  # until close sets it
        self.thread = threading.Thread(target=self._main, daemon=True,
                                       name=f"{THREAD_PREFIX}{identity.source}-{self.role}")

    def start(self: _D) -> _D:
        self.thread.start()
        return self

    def _main(self) -> None:
        """Empty the buffer until closed (the thread's body)."""
        raise NotImplementedError

    def wake(self) -> None:
        """End the drain's wait for items (any thread): items came, or it closes."""
        raise NotImplementedError

    def hurry(self) -> None:
        """Take what is buffered now, not after the linger (any thread): an item came
        that is often a process's last word (a log record at WARNING or above)."""
        self.urgent = True
        self.wake()

    def stats(self) -> dict[str, Any]:
        """What this drain delivered, dropped and gave up, by name."""
        raise NotImplementedError

    def close(self, deadline: float) -> None:
        """Deliver what is buffered until ``deadline`` (``time.monotonic()``), then
        stop (any thread; returns at once)."""
        if not self.closing:
            self.close_deadline = deadline
            self.closing = True
            self.buffer.close()
        self.wake()

    def delivered(self, accepted: int) -> bool:
        """Whether the first ``accepted`` items accepted were delivered or given up."""
        s = self.stats()
        return (s["sent_events"] - s["sent_drop_reports"] + s["build_errors"]
                + s.get("abandoned", 0) >= accepted)

    def linger(self, n_rows: int) -> float:
        """How long the next partial batch waits after one of ``n_rows`` rows:
        ``flush-interval``, or after a busy one (:data:`BUSY_ENVELOPE` rows or more)
        ``busy_linger`` (by default :data:`BUSY_LINGER`) if longer."""
        return self.busy_linger if n_rows >= BUSY_ENVELOPE else self.settings.flush_interval

    def make_rows(self, items: list, captured: bool = False) -> tuple[list, list]:
        """:meth:`RowMaker.rows`, counting the items no row could be made of."""
        rows, failed = self.rows.rows(items, captured)
        if failed:
            self.build_failed(len(failed), failed[0])
        return rows, failed

    def build_failed(self, n: int, example: Any) -> None:
        """Count ``n`` items no row could be made of (logged at first, then rarely)."""
        before = self.build_errors
        self.build_errors += n
        if before < 3 or before // 10_000 != self.build_errors // 10_000:
            logger.error("dask-blackbox could not make a row of a %s (%d so far)",
                         type(example).__name__, self.build_errors)


class Sender(Drain):
    """Drains ``buffer`` into Kafka from a thread of its own (module docstring)."""

    role = "sender"

    def __init__(self, buffer: Buffer, settings: ProducerSettings, identity: Identity,
                 rows: RowMaker, busy_linger: float = BUSY_LINGER):
        super().__init__(buffer, settings, identity, rows, busy_linger)
        self.next_seq = 0
        self.sent_envelopes = 0
        self.sent_events = 0  # rows delivered, DROPS reports included
        self.sent_drop_reports = 0
        self.reported_drops = 0  # drops the delivered DROPS reports counted
        self.lost_at_close = 0
        self.link = KafkaLink(settings, identity)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken = asyncio.Event()  # set by wake, cleared by the sleep it ends
        #: CPU seconds of this thread: taking items (and making the rows of all but
        #: transitions), encoding envelopes, sending them (aiokafka's work included)
        self.cpu_take = self.cpu_encode = self.cpu_send = 0.0

    def wake(self) -> None:
        """End the sender's sleep, or its next one (any thread): items came, or it closes."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended
                loop.call_soon_threadsafe(self._woken.set)

    def _main(self) -> None:
        yield_on_wakeup()
        try:
            asyncio.run(self._run())
        except Exception:
            logger.exception("dask-blackbox sender %s stopped on an error",
                             self.identity.producer_id)

    async def _sleep(self, seconds: float) -> None:
        seconds = min(seconds, self.close_deadline - time.monotonic())
        if seconds > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), seconds)
        self._woken.clear()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        buffer, identity = self.buffer, self.identity
        flush = linger = self.settings.flush_interval
        pending: deque[Body] = deque()  # the bodies of the current take, in order
        taken = (0, 0)  # its items and weight, released once all are delivered
        last_pack = 0.0
        backoff = _FIRST_BACKOFF
        try:
            while True:
                if not pending:
                    if taken[0]:
                        buffer.release(*taken)
                        taken = (0, 0)
                    if identity.cluster_id is None:  # nothing is sendable yet
                        if time.monotonic() >= self.close_deadline:
                            return
                        await self._sleep(flush)
                        continue
                    wait = last_pack + linger - time.monotonic()
                    if (wait > 0 and not self.closing and not self.urgent
                            and buffer.buffered_bytes < BATCH_WEIGHT):
                        await self._sleep(wait)
                        continue
                    self.urgent = False  # before the take: a later hurry counts again
                    t0 = _thread_time()
                    rows, taken = self._take()
                    t1 = _thread_time()
                    self.cpu_take += t1 - t0
                    if not rows:
                        if taken[0]:
                            continue  # only failed items: released above
                        if self.closing:
                            return
                        buffer.on_offer = self.wake  # then checked: no offer goes unseen
                        if not buffer.waiting:
                            await self._sleep(IDLE_WAIT)
                        continue
                    try:
                        pending.extend(pack_captured(rows, self.rows, self.build_failed))
                    except Exception:  # a bug must not stop the sender: counted, given up
                        self.build_failed(len(rows), rows[0])
                        continue
                    finally:
                        self.cpu_encode += _thread_time() - t1
                    last_pack = time.monotonic()
                    linger = self.linger(len(rows))
                    if not pending:  # all given up
                        continue
                body = pending[0]
                timeout = min(REQUEST_TIMEOUT, max(self.close_deadline - time.monotonic(), 0.01))
                t0 = _thread_time()
                sent = await self.link.send(envelope(identity, self.next_seq, body.events),
                                            timeout)
                self.cpu_send += _thread_time() - t0
                if sent:
                    pending.popleft()
                    self.next_seq += 1
                    self.sent_envelopes += 1
                    self.sent_events += body.n_rows
                    self.sent_drop_reports += body.n_drop_reports
                    self.reported_drops += body.dropped_events
                    backoff = _FIRST_BACKOFF
                elif time.monotonic() >= self.close_deadline:
                    return
                else:
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, self.settings.reconnect_backoff_max)
        finally:
            lost = sum(body.n_rows - body.n_drop_reports for body in pending)
            if taken[0]:
                buffer.release(*taken)
            lost += buffer.discard()
            if lost:
                self.lost_at_close = lost
                logger.warning("dask-blackbox %s closed with %d undelivered event(s): Kafka "
                               "at %s was not reachable within close-timeout",
                               identity.producer_id, lost,
                               ",".join(self.link.kwargs["bootstrap_servers"]))
            await self.link.stop()

    def _take(self) -> tuple[list, tuple[int, int]]:
        """The rows of the next items (a DROPS report first once a delivery has
        succeeded), and the items' count and weight."""
        taken = self.buffer.take(1 << 30, BATCH_WEIGHT)
        rows, _ = self.make_rows(taken.items, captured=True)
        if self.next_seq and (drops := self.buffer.unreported_drops()) is not None:
            report: Drops = {"kind": DROPS, "ts": time.time(), "dropped_events": drops.events,
                             "dropped_bytes": drops.bytes, "since": drops.since,
                             "until": drops.until}
            rows.insert(0, Ready(report, 0))
        return rows, (len(taken.items), taken.weight)

    def stats(self) -> dict[str, Any]:
        return {"next_seq": self.next_seq, "sent_envelopes": self.sent_envelopes,
                "sent_events": self.sent_events, "sent_drop_reports": self.sent_drop_reports,
                "reported_drops": self.reported_drops, "build_errors": self.build_errors,
                "lost_at_close": self.lost_at_close, "connected": self.link.connected,
                "cpu_take": self.cpu_take, "cpu_encode": self.cpu_encode,
                "cpu_send": self.cpu_send}


def yield_on_wakeup() -> None:
    """Put the calling thread (and the threads it starts) under ``SCHED_BATCH``
    (Linux): its CPU share is what its niceness gives, but waking up it never
    preempts a running thread of Dask's (the recorder's threads wake often)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def _demote_sender_noise(record: logging.LogRecord) -> bool:
    """aiokafka logs every failed connection attempt at ERROR; on the recorder's threads
    those records become DEBUG (:class:`KafkaLink` reports an outage once)."""
    if record.levelno < logging.CRITICAL and threading.current_thread().name.startswith(
            THREAD_PREFIX):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return True


for _name in ("aiokafka", "aiokafka.client", "aiokafka.conn", "aiokafka.cluster",
              "aiokafka.producer.producer", "aiokafka.producer.sender"):
    logging.getLogger(_name).addFilter(_demote_sender_noise)
