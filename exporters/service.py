"""The continuous exporter: :func:`serve` runs it until SIGTERM or SIGINT
(``dask-blackbox exporter``; ``dask-blackbox up`` runs it when
``blackbox.exporter.endpoint`` is set).

It reads the raw and span-state topics from where its journal says it stopped
(:mod:`.journal`; the beginning for a new journal), every partition of both (one
exporter per pipeline: a second one on the same data directory is refused), and
commits the same offsets to its consumer group ``blackbox.exporter.group-id`` once
the journal has them, so ``dask-blackbox status`` and ``/metrics`` show its lag.
Three things go on at once:

- **reading**: each batch of messages is applied to the journal in one transaction
  (task spans and log records go to the outbox; span snapshots, errors and worker
  removals wait for their span or run to end); while the outbox holds
  ``backlog-max`` items or more, reading pauses (Kafka keeps the rest: the backlog
  stays within ``backlog-max`` plus what one Kafka message holds, and nothing else
  in the pipeline waits for the exporter);
- **finishing**: every half second, spans that finished (:meth:`.Journal.finish_ready`:
  clusters that ended, spans done and quiet) move to the outbox; quiet time counts
  only while reading (from the first fetch after start-up or a pause,
  :meth:`.Journal.reading`), so a restart or a full backlog never ends a run whose
  last messages Kafka still holds;
- **sending**: the outbox is sent in order, ``batch-max-spans`` items and
  ``batch-max-bytes`` bytes at a time, one signal a request (spans and log records
  are acknowledged apart: an accepted part is never sent again), and an item leaves
  it once the receiver acknowledged it. A request that fails (after the SDK's own
  retries within ``timeout``) is logged in one line and tried again after a wait
  that doubles each time up to ``retry-backoff-max``; one the receiver refuses as it
  is (too large, invalid) is split instead, and an item it refuses alone is set
  aside (journal table ``set_aside``, ``dask_blackbox_export_set_aside_total``, one
  line): no item stops the outbox. A receiver that answers 404 on ``/v1/logs``
  takes no logs: one line, and no log record goes to it from then on.

On start-up it prints one line ``exporter ready ...`` on stdout; a bad setting, an
unreachable Kafka or a journal owned by another exporter is a one-line error.
``/metrics`` (``metrics-port``): ``dask_blackbox_export_backlog``,
``dask_blackbox_exported_spans_total``, ``dask_blackbox_exported_logs_total``,
``dask_blackbox_export_failures_total``, ``dask_blackbox_export_set_aside_total``,
``dask_blackbox_export_summarised_total``,
``dask_blackbox_export_late_updates_total``, ``dask_blackbox_consumer_lag``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from prometheus_client import Counter, Gauge

from dask_blackbox import config, contract, kafka, metrics, runfiles

from .journal import Journal, Record
from .otlp import ExportFailed, OtlpSender
from .settings import ExporterSettings

logger = logging.getLogger("dask_blackbox.exporters")

#: Errors that stop the exporter at start-up with a one-line message.
START_ERRORS = (config.ConfigError, kafka.KafkaUnreachable)
_TOPICS = (contract.RAW, contract.SPAN_STATE)


class PausePoint:
    """``blackbox.exporter.debug-pause-at``: stop for good the n-th time a point is
    reached, leaving ``<journal dir>/paused-at-<point>`` (a crash test's signal to
    SIGKILL)."""

    def __init__(self, pause_at, directory) -> None:
        self.pause_at, self.directory, self.seen = pause_at, directory, 0

    async def reached(self, point: str) -> None:
        if self.pause_at is None or self.pause_at[0] != point:
            return
        self.seen += 1
        if self.seen == self.pause_at[1]:
            (self.directory / f"paused-at-{point}").write_text(str(os.getpid()))
            await asyncio.Event().wait()


class Exporter:
    """The running exporter (see the module docstring)."""

    def __init__(self, settings: ExporterSettings) -> None:
        self.s = settings
        self.journal = Journal(settings.journal_dir, settings.otlp.max_task_spans,
                               settings.otlp.logs)
        self.sender = OtlpSender(settings.otlp)
        self.topics = {settings.kafka.topic(t): t for t in _TOPICS}
        self.consumer = AIOKafkaConsumer(
            **settings.kafka.client_kwargs(), group_id=settings.group_id,
            enable_auto_commit=False, auto_offset_reset="earliest",
            max_partition_fetch_bytes=8 * 2**20, fetch_max_bytes=64 * 2**20)
        self.pause = PausePoint(settings.pause_at, settings.journal_dir)
        self._stop = asyncio.Event()
        self._paused = False
        self._reading = False  # fetching since the start or the last resume
        self._ends_asked = 0.0
        self._probe: AIOKafkaConsumer | None = None  # no group: asks for the partitions' ends
        self._beginnings: dict[tuple[str, int], int] = {}
        self.registry = metrics.registry()
        r = self.registry
        self.backlog = Gauge("dask_blackbox_export_backlog",
                             "Spans and log records journalled, not yet acknowledged by the receiver",
                             registry=r)
        self.exported = Counter("dask_blackbox_exported_spans", "Spans the receiver acknowledged",
                                registry=r)
        self.exported_logs = Counter("dask_blackbox_exported_logs",
                                     "Log records the receiver acknowledged", registry=r)
        self.failures = Counter("dask_blackbox_export_failures",
                                "Export requests the receiver did not take", registry=r)
        self.summarised = Counter("dask_blackbox_export_summarised",
                                  "Task actions beyond max-task-spans, summarised", registry=r)
        self.late = Counter("dask_blackbox_export_late_updates",
                            "Span snapshots that arrived after their span was exported", registry=r)
        self.set_aside = Counter("dask_blackbox_export_set_aside",
                                 "Items the receiver refused alone, set aside in the journal",
                                 registry=r)
        self.set_aside.inc(self.journal.set_aside_count())
        self.lag = Gauge(metrics.LAG, metrics.LAG_HELP, ["group", "topic"], registry=r)
        self.backlog.set_function(self.journal.backlog)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            await self.consumer.start()
        except (KafkaError, OSError) as e:
            raise kafka.KafkaUnreachable(
                f"cannot reach Kafka at {','.join(self.s.kafka.bootstrap_servers)} "
                f"(blackbox.kafka.bootstrap-servers): {e}") from None
        admin = await kafka.connect_admin(settings=self.s.kafka)
        try:
            described = await admin.describe_topics(list(self.topics))
        finally:
            await admin.close()
        partitions = [TopicPartition(t["topic"], p["partition"]) for t in described
                      if t["error_code"] == 0 for p in t["partitions"]]
        if not partitions:
            raise kafka.KafkaUnreachable(f"the topics {', '.join(self.topics)} do not exist "
                                         "(dask-blackbox topics creates them)")
        self.consumer.assign(partitions)
        done = self.journal.offsets()
        beginnings = await self.consumer.beginning_offsets(partitions)
        # one past each partition's last record (Tansu reports less: kafka.record_ends)
        self._probe = probe = AIOKafkaConsumer(**self.s.kafka.client_kwargs(), group_id=None,
                                               enable_auto_commit=False)
        await probe.start()
        ends = await kafka.record_ends(probe, await probe.end_offsets(partitions), beginnings)
        self._beginnings = {(tp.topic, tp.partition): o for tp, o in beginnings.items()}
        for tp in partitions:
            offset = done.get((tp.topic, tp.partition))
            if offset is None or offset < beginnings[tp]:
                self.consumer.seek(tp, beginnings[tp])
            elif offset > ends[tp]:
                logger.warning("%s[%d]: the journal is at offset %d, past the partition's end "
                               "%d (a new broker?); reading it from its beginning", tp.topic,
                               tp.partition, offset, ends[tp])
                self.consumer.seek(tp, beginnings[tp])
            else:
                self.consumer.seek(tp, offset)

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        await self.consumer.stop()
        if self._probe is not None:
            await asyncio.sleep(0)  # aiokafka: stop() before its group task ran raises CancelledError
            await self._probe.stop()
        self.sender.close()
        self.journal.close()

    # ----------------------------------------------------------------- work

    async def run(self) -> None:
        await asyncio.gather(self._read(), self._send(), self._finish())

    async def _read(self) -> None:
        while not self._stop.is_set():
            room = self._flow()
            fetched = await self.consumer.getmany(timeout_ms=200, max_records=min(500, room))
            if not self._paused and not self._reading:
                self.journal.reading()  # quiet time counts from the first fetch on
                self._reading = True
            records = []
            for tp, messages in fetched.items():
                topic = self.topics[tp.topic]
                for m in messages:
                    try:
                        value = contract.decode_envelope(m.value) if m.value else None
                    except contract.InvalidEnvelope:
                        value = None
                    records.append(Record(topic, tp.topic, tp.partition, m.offset, value))
            if records:
                applied = self.journal.apply(records)
                self.summarised.inc(applied.summarised)
                self.late.inc(applied.late)
                await self.pause.reached("after-journal")
                await self._commit()
            await self._measure_lag()

    def _flow(self) -> int:
        """Pause reading while the backlog is full, resume once it is not; returns how
        many messages to read at most (each may add many items: the backlog stays
        within ``backlog-max`` plus what one message holds)."""
        room = self.s.backlog_max - self.journal.backlog()
        full = room <= 0
        if full != self._paused:
            parts = list(self.consumer.assignment())
            (self.consumer.pause if full else self.consumer.resume)(*parts)
            self._paused = full
            self._reading = False
            logger.warning("export backlog %s (blackbox.exporter.backlog-max=%d): %s reading",
                           "full" if full else "below its bound", self.s.backlog_max,
                           "pausing" if full else "resuming")
        return max(room, 1)

    async def _commit(self) -> None:
        offsets = {TopicPartition(t, p): o for (t, p), o in self.journal.offsets().items()}
        try:
            await self.consumer.commit(offsets)
        except KafkaError as e:  # the journal has them; the group's copy is for monitoring
            logger.warning("could not commit offsets to group %s: %s", self.s.group_id, e)

    async def _measure_lag(self) -> None:
        """The lag gauge: from each partition's position (where nothing was read yet,
        its beginning). A paused partition is not fetched, so its high watermark
        stands still: while reading is paused the partitions' record ends are asked
        of the broker (at most once a second), and the gauge shows the lag growing."""
        ends = None
        if self._paused and self._probe is not None:
            if time.monotonic() - self._ends_asked < 1.0:
                return
            self._ends_asked = time.monotonic()
            parts = list(self.consumer.assignment())
            try:
                ends = await kafka.record_ends(self._probe, await self._probe.end_offsets(parts),
                                               await self._probe.beginning_offsets(parts))
            except KafkaError as e:
                logger.warning("could not ask the broker for the partitions' ends: %s", e)
                return
        positions = {**self._beginnings, **self.journal.offsets()}
        for topic, n in metrics.consumer_lag(self.consumer, positions, ends).items():
            self.lag.labels(self.s.group_id, topic).set(n)

    async def _finish(self) -> None:
        while not self._stop.is_set():
            if self._reading:  # a run ends after quiet time while reading, never while not
                self.journal.finish_ready(self.s.settle, self.s.idle_timeout, self.s.span_quiet)
            await asyncio.sleep(0.5)

    async def _send(self) -> None:
        """The outbox, oldest first, in requests of one signal within the item and
        byte caps. A request the receiver refuses as it is (:class:`ExportFailed`
        ``refused``) is split: half as many items next time, down to one; an item it
        refuses alone for what it holds (``bad``) is set aside. A receiver that takes
        no logs gets none from then on. Any other failure waits (doubling) and tries
        the same request again."""
        backoff = 0.0
        otlp = self.s.otlp
        limit = otlp.batch_max_spans
        while not self._stop.is_set():
            # the journal's msgpack is near the request's protobuf: a margin keeps a
            # request within the cap, which refuses (and so splits) one past it
            batch = self.journal.pending(limit, otlp.batch_max_bytes * 3 // 4)
            if not batch:
                await asyncio.sleep(0.1)
                continue
            items = [item for _, item in batch]
            try:
                await asyncio.to_thread(self.sender.send, items, False)
            except ExportFailed as e:
                self.failures.inc()
                if e.no_logs and items[0].log is not None:
                    dropped = self.journal.stop_logs()
                    logger.warning("%s: this receiver takes no logs; log records are not exported "
                                   "to it from now on (%d dropped from the journal; "
                                   "blackbox.exporter.logs=false says so)", e, dropped)
                    continue
                if e.refused and len(batch) > 1:
                    limit = max(1, len(batch) // 2)
                    logger.warning("%s; sending %d at a time", e, limit)
                    continue
                if e.bad:
                    seq = batch[0][0]
                    self.journal.set_aside(seq, str(e))
                    self.set_aside.inc()
                    logger.warning("%s; set aside (journal table set_aside, seq %d), the rest goes on",
                                   e, seq)
                    limit = otlp.batch_max_spans
                    continue
                backoff = min(max(backoff * 2, 0.5), self.s.retry_backoff_max)
                logger.warning("%s; %d items wait in the journal, retrying in %.1fs",
                               e, self.journal.backlog(), backoff)
                try:
                    await asyncio.wait_for(self._stop.wait(), backoff)
                except asyncio.TimeoutError:
                    pass
                continue
            backoff = 0.0
            limit = min(limit * 2, otlp.batch_max_spans)
            self.journal.done(seq for seq, _ in batch)
            n_logs = sum(1 for i in items if i.log is not None)
            self.exported.inc(len(items) - n_logs)
            self.exported_logs.inc(n_logs)
            await self.pause.reached("after-export")


async def serve() -> None:
    """Run the exporter until SIGTERM/SIGINT; raises one of START_ERRORS if it cannot
    start."""
    s = ExporterSettings.from_config()
    await kafka.ensure_topics(settings=s.kafka)
    exporter = Exporter(s)
    server = None
    try:
        await exporter.start()
        url = None
        if s.metrics_port is not None:
            server, url = metrics.serve(exporter.registry, s.metrics_host, s.metrics_port,
                                        "blackbox.exporter.metrics-port")
        runfiles.write(s.data_dir, runfiles.EXPORTER, {
            "pid": os.getpid(), "endpoint": config.display_url(s.otlp.endpoint),
            "journal": str(exporter.journal.path), "started_at": time.time(), "metrics_url": url})
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, exporter.stop)
        print(f"exporter ready: {exporter.sender.where} group={s.group_id} "
              f"topics={','.join(exporter.topics)} journal={exporter.journal.path} "
              f"metrics_url={url or '-'}", flush=True)
        await exporter.run()
    finally:
        runfiles.remove(s.data_dir, runfiles.EXPORTER)
        if server is not None:
            server.shutdown()
        await exporter.close()
