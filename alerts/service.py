"""The alerter: ``dask-blackbox alerts`` (and a child of ``dask-blackbox up`` when
rules are configured).

It reads the raw topic in a consumer group of its own (``blackbox.alerts.group-id``),
feeds every envelope to the :class:`~dask_blackbox.alerts.watch.Watcher`, and
delivers each completed incident to its rule's target
(:mod:`~dask_blackbox.alerts.delivery`), once:

1. Incidents completed by a batch of messages go to the outbox, and the checkpoint
   (:mod:`~dask_blackbox.alerts.checkpoint`: offsets past that batch, the watcher's
   state, the outbox) is written before anything is sent. Only then are the offsets
   committed to Kafka (for lag; the checkpoint is what a restart reads).
2. Each outbox incident is delivered in a task of its own (a slow target delays
   only its own incidents); when it is delivered or given up, it leaves the outbox
   and its id is remembered, in a new checkpoint.
3. After a crash (SIGKILL at any instant) the alerter resumes from the checkpoint:
   messages after its offsets are read again and their incidents re-derived with
   the same ids; incidents already delivered are skipped by id; the outbox is
   delivered. The one window left is between a target's answer and the checkpoint
   that records it: such an incident is sent again with the same
   ``Idempotency-Key``, which a receiver that remembers keys drops.

Without a checkpoint or committed offsets, it starts at the end of the raw topic: it
alerts on what happens from its start, never on history. Messages that are not valid
envelopes are counted and skipped: nothing a message holds stops the alerter.
A target that fails every attempt gets one line naming it (``gave up on incident``)
and the alerter goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from dask_blackbox import contract, nesting
from dask_blackbox.alerts import delivery
from dask_blackbox.alerts.checkpoint import REMEMBERED, Checkpoint
from dask_blackbox.alerts.settings import AlertSettings
from dask_blackbox.alerts.watch import Incident, Watcher
from dask_blackbox.config import ConfigError

logger = logging.getLogger("dask_blackbox.alerts")

#: How long a read waits for messages, and so how often pending incidents are looked
#: at (seconds).
POLL_S = 0.1
#: The checkpoint is written at least this often while messages arrive (seconds),
#: and whenever an incident completes or is settled.
CHECKPOINT_S = 2.0
#: On SIGTERM, deliveries in flight get this long to finish (they stay in the
#: outbox otherwise, delivered at the next start).
STOP_GRACE_S = 10.0
READY_LINE = "dask-blackbox alerts: ready"


class Alerter(ConsumerRebalanceListener):
    """Raw topic -> watcher -> outbox -> targets (module docstring)."""

    def __init__(self, settings: AlertSettings):
        self.settings = settings
        self.rules = {r.name: r for r in settings.rules}
        self.watcher = Watcher(settings.rules, settings.evidence_wait)
        self.checkpoint = Checkpoint(settings.state_dir, settings.group_id)
        self.topic = settings.kafka.topic(contract.RAW)
        self.offsets: dict[int, int] = {}
        self.outbox: dict[str, Incident] = {}
        self.settled: dict[str, list] = {}  # id -> [at, delivered, reason]
        self.inflight: dict[str, asyncio.Task] = {}
        self.skipped = 0
        self._stop = asyncio.Event()
        self._saved_at = 0.0
        self._dirty = False
        self._pauses: dict[str, int] = {}
        self.consumer: AIOKafkaConsumer | None = None

    # ------------------------------------------------------------ checkpoint

    def restore(self, now: float) -> None:
        state = self.checkpoint.load()
        if state is None:
            return
        if state.get("topic") == self.topic:
            self.offsets = {int(p): int(o) for p, o in state.get("offsets", {}).items()}
        self.watcher.restore(state.get("watcher", {}))
        for c in self.watcher.clusters.values():  # evidence waits start again now
            c.pending = [p._replace(arrived=now) for p in c.pending]
            for item in c.killed:
                item[-1] = now
        self.outbox = {i[0]: Incident(*i) for i in state.get("outbox", [])}
        self.settled = state.get("settled", {})

    def save(self) -> None:
        """Write the checkpoint (synchronously: the watcher and the offsets are
        consistent with each other between two awaits)."""
        if len(self.settled) > REMEMBERED:
            newest = sorted(self.settled, key=lambda i: self.settled[i][0])[-REMEMBERED:]
            self.settled = {i: self.settled[i] for i in newest}
        self.checkpoint.save({"topic": self.topic, "offsets": self.offsets,
                              "watcher": self.watcher.state(),
                              "outbox": [list(i) for i in self.outbox.values()],
                              "settled": self.settled})
        self._saved_at = time.monotonic()
        self._dirty = False

    async def commit(self) -> None:
        if self.consumer is None or not self.offsets:
            return
        assigned = self.consumer.assignment()
        offsets = {TopicPartition(self.topic, p): o for p, o in self.offsets.items()
                   if TopicPartition(self.topic, p) in assigned}
        if offsets:
            with contextlib.suppress(Exception):  # informational: the checkpoint rules
                await self.consumer.commit(offsets)

    # ------------------------------------------------------------ rebalance

    async def on_partitions_revoked(self, revoked) -> None:
        pass

    async def on_partitions_assigned(self, assigned) -> None:
        for tp in assigned:
            if tp.partition in self.offsets:
                self.consumer.seek(tp, self.offsets[tp.partition])

    # ------------------------------------------------------------------ run

    async def run(self, ready=lambda line: print(line, flush=True)) -> None:
        self.checkpoint.lock()
        try:
            self.restore(time.time())
            session_ms = int(self.settings.session_timeout * 1000)
            self.consumer = AIOKafkaConsumer(
                **self.settings.kafka.client_kwargs(), group_id=self.settings.group_id,
                session_timeout_ms=session_ms, heartbeat_interval_ms=max(100, session_ms // 3),
                enable_auto_commit=False, auto_offset_reset="latest",
                fetch_max_wait_ms=int(POLL_S * 1000), max_partition_fetch_bytes=8 * 2**20)
            self.consumer.subscribe([self.topic], listener=self)
            await self.consumer.start()
            try:
                await self._wait_assigned()
                ready(f"{READY_LINE}: {len(self.rules)} rule(s) on {self.topic} "
                      f"(group {self.settings.group_id}, state {self.checkpoint.path})")
                for incident in list(self.outbox.values()):
                    self._send(incident)
                await self._loop()
                await self._drain()
            finally:
                with contextlib.suppress(Exception):
                    await self.consumer.stop()
        finally:
            self.checkpoint.unlock()

    async def _wait_assigned(self) -> None:
        while not self.consumer.assignment() and not self._stop.is_set():
            await self.consumer.getmany(timeout_ms=100, max_records=1)
            if self.consumer.assignment():
                break
        for tp in self.consumer.assignment():  # resolves "latest" now, not later
            await self.consumer.position(tp)

    def stop(self) -> None:
        self._stop.set()

    async def _loop(self) -> None:
        while not self._stop.is_set():
            batches = await self.consumer.getmany(timeout_ms=int(POLL_S * 1000), max_records=2000)
            now = time.time()
            for tp, records in batches.items():
                for record in records:
                    self._read(record.value, now)
                    self.offsets[tp.partition] = record.offset + 1
                    self._dirty = True
            self.watcher.tick(now)
            fresh = [i for i in self.watcher.take()
                     if i.id not in self.settled and i.id not in self.outbox]
            for incident in fresh:
                self.outbox[incident.id] = incident
            if fresh or (self._dirty and time.monotonic() - self._saved_at >= CHECKPOINT_S):
                self.save()
                await self.commit()
            if fresh:
                await self._pause("after-outbox")
                for incident in fresh:
                    self._send(incident)

    def _read(self, value: bytes | None, now: float) -> None:
        try:
            envelope = contract.validate_envelope(
                contract.decode_envelope(value or b"", nesting.MAX_DEPTH))
        except (contract.InvalidEnvelope, TypeError, RecursionError):
            self.skipped += 1
            return
        self.watcher.feed(envelope, now)

    # ------------------------------------------------------------- delivery

    def _send(self, incident: Incident) -> None:
        if incident.id in self.inflight:
            return
        rule = self.rules.get(incident.rule)
        if rule is None:  # the rule was removed from the config since
            logger.warning("incident %s of rule %s dropped: no such rule any more", incident.id,
                           incident.rule)
            self._settle(incident, False, "rule removed")
            return
        task = asyncio.create_task(self._deliver(incident, rule))
        self.inflight[incident.id] = task

    async def _deliver(self, incident: Incident, rule) -> None:
        s = self.settings
        try:
            try:
                outcome = await delivery.deliver(incident, rule, s.timeout, s.attempts,
                                                 s.retry_backoff_max)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never a traceback, never an incident failing at every start
                reason = delivery.printable(f"{type(e).__name__}: {e}")[:500]
                logger.error("rule %s: gave up on incident %s: %s: %s", rule.name, incident.id,
                             rule.target, reason)
                outcome = delivery.Outcome(False, 0, reason)
            if outcome.delivered:
                await self._pause("after-delivery")
            self._settle(incident, outcome.delivered, outcome.reason)
        finally:
            self.inflight.pop(incident.id, None)

    def _settle(self, incident: Incident, delivered: bool, reason: str) -> None:
        self.outbox.pop(incident.id, None)
        self.settled[incident.id] = [time.time(), delivered, reason]
        self.save()

    async def _drain(self) -> None:
        if self.inflight:
            await asyncio.wait(list(self.inflight.values()), timeout=STOP_GRACE_S)
        self.save()
        await self.commit()

    async def _pause(self, point: str) -> None:
        """The testing hook ``blackbox.alerts.debug-pause-at``: stop here for good the
        n-th time, after leaving a marker file (a crash test SIGKILLs the process)."""
        pause = self.settings.pause_at
        if pause is None or pause[0] != point:
            return
        self._pauses[point] = self._pauses.get(point, 0) + 1
        if self._pauses[point] != pause[1]:
            return
        (self.settings.state_dir / f"alerts-paused-at-{point}").write_text(str(time.time()))
        while True:
            await asyncio.sleep(3600)


def main(check: bool = False) -> int:
    """``dask-blackbox alerts [--check]``: run until SIGINT/SIGTERM (exit 0)."""
    settings = AlertSettings.from_config()
    if not settings.rules:
        raise ConfigError("blackbox.alerts.rules is empty: there is nothing to alert on "
                          "(see the alerts section of docs/configuration.md)")
    if check:
        for rule in settings.rules:
            print(f"{rule.name}: {rule.when} -> {rule.target}")
        return 0
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dask-blackbox alerts: %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    alerter = Alerter(settings)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, alerter.stop)
        await alerter.run()

    from dask_blackbox.alerts.checkpoint import CheckpointError
    from dask_blackbox.kafka import KafkaUnreachable

    from aiokafka.errors import KafkaConnectionError

    try:
        asyncio.run(serve())
    except (CheckpointError, KafkaUnreachable, KafkaConnectionError) as e:
        print(f"dask-blackbox: error: {e}", file=sys.stderr)
        return 1
    return 0
