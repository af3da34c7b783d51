"""The sender: drains a :class:`~producers.buffer.Buffer` into Kafka.

A :class:`Sender` thread runs its own asyncio loop (aiokafka's), in the Dask process or in a
relay's helper process (:mod:`producers.relay`). Each round it takes items worth about half
an envelope (:data:`BATCH_WEIGHT`), makes their rows, packs them (:func:`pack`) into
envelopes (:data:`dask_blackbox.contract.ENVELOPE_FIELDS`) of at most
:data:`~dask_blackbox.contract.MAX_ENVELOPE_BYTES` and delivers them (:class:`KafkaLink`;
Kafka compresses each, ``blackbox.kafka.compression``). A full envelope leaves as soon as
there is enough for it, a partial one at most once per *linger* (:meth:`Drain.linger`); an
idle sender sleeps until the buffer keeps an item, which leaves at once.

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
from typing import Any, NamedTuple

import orjson
from aiokafka import AIOKafkaProducer

from dask_blackbox.contract import DROPS, MAX_ENVELOPE_BYTES, SCHEMA_VERSION, Drops
from dask_blackbox.producers.buffer import Buffer
from dask_blackbox.producers.encode import describe, encode_event, type_name
from dask_blackbox.producers.rows import Ready, RowMaker, TransitionRow, run_event
from dask_blackbox.producers.settings import ProducerSettings

logger = logging.getLogger(__name__)

#: An envelope's bytes for its events: the rest (header fields, brackets) is under 1 KiB.
EVENTS_BUDGET = MAX_ENVELOPE_BYTES - 1024
#: The weight of one take: under the budget, so that an envelope is rarely split.
BATCH_WEIGHT = EVENTS_BUDGET // 2
BUSY_ENVELOPE = 200
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


def pack(rows: list, max_chars: int) -> list[Body]:
    """Rows as envelope bodies under the budget, in order (halved until they fit; a
    row that alone does not fit is replaced by its description)."""
    body = encode_rows(rows, max_chars)
    if len(body) > EVENTS_BUDGET and len(rows) > 1:
        half = len(rows) // 2
        return pack(rows[:half], max_chars) + pack(rows[half:], max_chars)
    if len(body) > EVENTS_BUDGET:
        row = rows[0]
        event = row.event if type(row) is Ready else {"kind": "transition", "ts": row.ts}
        logger.warning("dask-blackbox: a %s event of %d bytes exceeds an envelope; it is "
                       "replaced by its description", event.get("kind"), len(body))
        described = {"kind": event.get("kind"), "ts": event.get("ts"),
                     "__type__": type_name(event), "__size__": len(body)}
        body = b"[" + encode_event(described, max_chars) + b"]"
    reports = [row.event["dropped_events"] for row in rows
               if type(row) is Ready and row.event.get("kind") == DROPS]
    return [Body(body, len(rows), len(reports), sum(reports))]


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


class Drain:
    """What empties a buffer from a thread of its own (``_main``, named
    ``<source>-<role>``): a :class:`Sender` or a :class:`~producers.relay.Relay`."""

    role = "drain"

    def __init__(self, buffer: Buffer, settings: ProducerSettings, identity: Identity,
                 rows: RowMaker, busy_linger: float = BUSY_LINGER):
        self.buffer = buffer
        self.settings = settings
        self.identity = identity
        self.rows = rows
        self.busy_linger = max(busy_linger, settings.flush_interval)
        self.build_errors = 0  # items no row could be made of, given up
        self.closing = False
        self.close_deadline = float("inf")  # until close sets it
        self.thread = threading.Thread(target=self._main, daemon=True,
                                       name=f"{THREAD_PREFIX}{identity.source}-{self.role}")

    def start(self) -> Drain:
        self.thread.start()
        return self

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

    def make_rows(self, items: list, portable: bool = False) -> tuple[list, list]:
        """:meth:`RowMaker.rows`, counting the items no row could be made of."""
        rows, failed = self.rows.rows(items, portable)
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
                    if wait > 0 and not self.closing and buffer.buffered_bytes < BATCH_WEIGHT:
                        await self._sleep(wait)
                        continue
                    rows, taken = self._take()
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
                        pending.extend(pack(rows, self.settings.max_value_bytes))
                    except Exception:  # a bug must not stop the sender: counted, given up
                        self.build_failed(len(rows), rows[0])
                        continue
                    last_pack = time.monotonic()
                    linger = self.linger(len(rows))
                body = pending[0]
                timeout = min(REQUEST_TIMEOUT, max(self.close_deadline - time.monotonic(), 0.01))
                if await self.link.send(self._envelope(body.events), timeout):
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
        rows, _ = self.make_rows(taken.items)
        if self.next_seq and (drops := self.buffer.unreported_drops()) is not None:
            report: Drops = {"kind": DROPS, "ts": time.time(), "dropped_events": drops.events,
                             "dropped_bytes": drops.bytes, "since": drops.since,
                             "until": drops.until}
            rows.insert(0, Ready(report, 0))
        return rows, (len(taken.items), taken.weight)

    def _envelope(self, events: bytes) -> bytes:
        identity = self.identity
        header = orjson.dumps({
            "schema": SCHEMA_VERSION, "cluster_id": identity.cluster_id,
            "cluster_name": identity.cluster_name, "source": identity.source,
            "producer_id": identity.producer_id, "seq": self.next_seq, "sent_at": time.time()})
        return b"".join((header[:-1], b',"events":', events, b"}"))

    def stats(self) -> dict[str, Any]:
        return {"next_seq": self.next_seq, "sent_envelopes": self.sent_envelopes,
                "sent_events": self.sent_events, "sent_drop_reports": self.sent_drop_reports,
                "reported_drops": self.reported_drops, "build_errors": self.build_errors,
                "lost_at_close": self.lost_at_close, "connected": self.link.connected}


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
