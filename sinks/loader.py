"""Loading a :class:`~sinks.batch.Batch` into ClickHouse exactly once.

The protocol (the journal is ``sink_batches``, see sinks/sql/001_init.sql):

1. insert a ``begin`` journal row per (topic, partition) of the batch, with the
   committed position the batch starts from and the position after it;
2. insert each table's rows, every row tagged ``_batch = batch_id``;
3. insert the ``loaded`` journal row -- a one-part insert, hence atomic: the batch is
   in ClickHouse from this moment;
4. (the caller) commit the Kafka offsets.

:meth:`Loader.recover`, run before consuming partitions, repairs a crash at any point:
a batch with ``begin`` and no end is abandoned (its rows, whichever tables they had
reached, are deleted by ``_batch``, from the page aggregates and the roll-ups
ClickHouse made of them too, and the messages are read again, since they were never
committed); a batch that is ``loaded`` while the group's committed offset still
equals its ``from_offset`` died between 3 and 4, so the consumer seeks past it.
Nothing depends on Kafka offsets being stable across broker incarnations: rows are
found by batch id, and a journal entry is only trusted when the committed offset
matches it exactly.

On a ClickHouse cluster (``blackbox.clickhouse.cluster``) the tables are Distributed
over ReplicatedMergeTree: an insert returns once every shard has its rows, and each
insert carries a deduplication token (group, batch, table, rows) so that a block a
Distributed table sends to a second replica of a shard is stored once, the roll-ups
made of it too; deletions address every node (``ON CLUSTER``).

An envelope loaded before (a producer re-sent it after a broker failure) is not
loaded again: its rows are dropped from the batch (sinks.sequences).

While ClickHouse cannot take rows, :meth:`Loader.load` retries with exponential
backoff up to ``retry_backoff_max`` (``SinkSettings.retry_backoff_max``) -- abandoning the failed attempt
first, so an insert that half happened leaves nothing behind. Rows ClickHouse rejects
(:func:`dask_blackbox.clickhouse.is_rejection`) are isolated by splitting the insert in halves
and go to ``dead_letters`` with ClickHouse's message.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import random
import threading
import time

from dask_blackbox import clickhouse
from dask_blackbox.sinks import arrow
from dask_blackbox.sinks.batch import Batch, payload_of
from dask_blackbox.sinks.sequences import Delivered
from dask_blackbox.sinks.tables import AGGREGATES, COLUMNS, ROLLUPS, TABLES, Message, TableData
from dask_blackbox.clickhouse import Target

logger = logging.getLogger("sinks.loader")

TopicPartition = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A partition's part of a loaded batch, as the journal recorded it."""

    from_offset: int
    next_offset: int
    first_timestamp: int
    first_crc: int


class PausePoint:
    """The crash-test hook (``SinkSettings.pause_at``, from ``blackbox.sink.debug-pause-at:
    "<point>[:<n>]"``; points: sinks.settings.PAUSE_POINTS) makes the sink stop the
    n-th time it reaches ``<point>``, after writing ``<data-dir>/sink-paused-at-<point>``,
    so a test can SIGKILL it exactly there -- or let it go on by creating
    ``<data-dir>/sink-resume-at-<point>``. Unset (the default), :meth:`reached` only
    compares a string."""

    def __init__(self, pause_at: tuple[str, int] | None, marker_dir: pathlib.Path) -> None:
        self.point, self.remaining = pause_at if pause_at is not None else (None, 0)
        self.marker_dir = marker_dir

    def reached(self, point: str) -> None:
        if point != self.point:
            return
        self.remaining -= 1
        if self.remaining > 0:
            return
        marker = self.marker_dir / f"sink-paused-at-{point}"
        marker.write_text(str(os.getpid()))
        resume = self.marker_dir / f"sink-resume-at-{point}"
        logger.warning("paused at %s (blackbox.sink.debug-pause-at) until killed or %s exists",
                       point, resume)
        while not resume.exists():
            time.sleep(0.05)
        resume.unlink()
        self.point = None  # once
        logger.warning("resumed at %s", point)


class Loader:
    """Loads batches for one consumer group into ``target`` through ``client``
    (whose schema must be migrated: the column types are read from it).

    Not thread-safe: one thread loads at a time (the client itself may be shared with
    readers).
    """

    def __init__(self, client, target: Target, group_id: str, *,
                 retry_backoff_max: float = 10.0, pause: PausePoint | None = None,
                 exclusive: bool = False) -> None:
        self.client = client
        self.target = target
        self.group_id = group_id
        #: whether this process alone writes the store (a chDB directory): no other
        #: sink's batches are in its journal (see :meth:`recover`)
        self.exclusive = exclusive
        self.retry_backoff_max = retry_backoff_max
        self.pause = pause or PausePoint(None, pathlib.Path("."))
        self.stopping = threading.Event()
        self.insert_settings: dict = {
            # Commit only once ClickHouse has the rows: no async buffering...
            "async_insert": 0,
            # ...and an event from a wrong clock must not fail a whole batch.
            "max_partitions_per_insert_block": 0,
        }
        if target.cluster:
            # A Distributed insert returns only after every shard has its rows...
            self.insert_settings["distributed_foreground_insert"] = 1
            # ...and a block a shard is sent twice (the Distributed table retrying on
            # another replica) is stored once, its roll-ups too: each insert carries
            # a token of its own (see _settings).
            self.insert_settings["insert_deduplicate"] = 1
            self.insert_settings["deduplicate_blocks_in_dependent_materialized_views"] = 1
        self.schemas = arrow.schemas(client, target.database, COLUMNS)
        #: rows loaded per table, dead letters among them, and the events the
        #: producers reported dropped in the drops rows loaded (read by sinks.metrics)
        self.rows_loaded: dict[str, int] = dict.fromkeys(COLUMNS, 0)
        self.dead_letters = 0
        self.dropped_events = 0
        #: envelopes not loaded because they were loaded before (sinks.sequences)
        self.duplicate_envelopes = 0
        self.delivered = Delivered(client, target)
        #: the journal's insert context, made (its columns' types read) at the first write
        self._journal_context = None
        self.batches = 0
        self._last_id = 0
        self._tag = random.getrandbits(12)

    # ----------------------------------------------------------------- journal

    def _next_batch_id(self) -> int:
        """Unique and increasing in this process: microseconds since the epoch in the
        high bits, a per-process random tag in the low 12 bits."""
        candidate = (time.time_ns() // 1000) << 12 | self._tag
        self._last_id = max(candidate, self._last_id + (1 << 12))
        return self._last_id

    def settings_for(self, token: str) -> dict:
        """The settings of one insert; in cluster mode with its deduplication token,
        unique to the insert (``token``: the batch, the table and the rows), so that
        ReplicatedMergeTree stores a block sent to two replicas of a shard once."""
        if not self.target.cluster:
            return self.insert_settings
        return {**self.insert_settings, "insert_deduplication_token": f"{self.group_id}:{token}"}

    def _journal(self, rows: list[list], token: str) -> None:
        context = self._journal_context
        if context is None:
            context = self._journal_context = self.client.create_insert_context(
                self.target.table("sink_batches"),
                ["group_id", "batch_id", "state", "topic", "partition",
                 "from_offset", "next_offset", "first_timestamp", "first_crc"])
        context.settings = self.settings_for(token)
        context.data = None  # an insert that failed may have left its rows in it
        self.client.insert(data=rows, context=context)

    def _end(self, batch_ids: list[int], state: str) -> None:
        self._journal([[self.group_id, b, state, "", 0, 0, 0, 0, 0] for b in batch_ids],
                      f"{batch_ids[0]}:{state}")

    # ----------------------------------------------------------------- recovery

    def recover(self, assigned: list[TopicPartition], committed: dict[TopicPartition, int],
                elsewhere: dict[TopicPartition, int] | None = None) -> dict[TopicPartition, Loaded]:
        """Repair what a crashed sink of this group left for the ``assigned``
        partitions: abandon open batches. Return, per partition whose committed offset
        equals the ``from_offset`` of its latest loaded batch, that batch's journal
        entry: if the message at ``from_offset`` still has the recorded fingerprint,
        the caller must seek to (and commit) ``next_offset`` instead of loading again.

        On a store of its own (:attr:`exclusive`) every open batch is this process's
        own: all are abandoned, whatever their partitions. And a batch it loaded but
        never committed on a partition another sink consumes now is abandoned too
        (``elsewhere``: the committed offsets of the partitions of :meth:`journaled`
        not assigned here), when the group's committed offset there is still that
        batch's start: the other sink loads those messages into its own store."""
        self.delivered.forget()  # another sink may have loaded their producers meanwhile
        table = self.target.table("sink_batches")
        if self.exclusive:
            open_ids = [row[0] for row in self.client.query(
                f"SELECT batch_id FROM {table} WHERE group_id = {{g:String}} GROUP BY batch_id "
                "HAVING countIf(state != 'begin') = 0", parameters={"g": self.group_id}).result_rows]
            handed = [batch_id for tp, (entry, batch_id) in self._latest(list(elsewhere or {})).items()
                      if elsewhere[tp] == entry[0]]
            if handed:
                logger.warning("%d batch(es) this sink loaded but never committed are on "
                               "partitions another sink consumes now: given up here",
                               len(set(handed)))
            open_ids = sorted(set(open_ids) | set(handed))
            if open_ids:
                self.abandon(open_ids)
        if not assigned:
            return {}
        tps = [(t, p) for t, p in assigned]
        if not self.exclusive:
            open_ids = [row[0] for row in self.client.query(
                f"SELECT batch_id FROM {table} "
                "WHERE group_id = {g:String} GROUP BY batch_id "
                "HAVING countIf(state != 'begin') = 0 "
                "AND hasAny(groupArrayIf((topic, partition), state = 'begin'), "
                "{tps:Array(Tuple(String, UInt32))})",
                parameters={"g": self.group_id, "tps": tps},
            ).result_rows]
            if open_ids:
                self.abandon(open_ids)
        return {
            tp: Loaded(*entry)
            for tp, (entry, _) in self._latest(tps).items()
            if committed.get(tp) == entry[0]
        }

    def _latest(self, tps: list) -> dict[tuple[str, int], tuple[tuple, int]]:
        """Per (topic, partition) of ``tps``: the journal entry (from_offset,
        next_offset, first_timestamp, first_crc) of its latest loaded batch that was
        not abandoned since, and that batch's id."""
        if not tps:
            return {}
        table = self.target.table("sink_batches")
        rows = self.client.query(
            "SELECT topic, partition, argMax(((from_offset, next_offset, first_timestamp, "
            f"first_crc), batch_id), batch_id) FROM {table} "
            "WHERE group_id = {g:String} AND state = 'begin' "
            "AND (topic, partition) IN {tps:Array(Tuple(String, UInt32))} "
            f"AND batch_id IN (SELECT batch_id FROM {table} "
            "WHERE group_id = {g:String} AND state = 'loaded') "
            f"AND batch_id NOT IN (SELECT batch_id FROM {table} "
            "WHERE group_id = {g:String} AND state = 'abandoned') "
            "GROUP BY topic, partition",
            parameters={"g": self.group_id, "tps": [(t, p) for t, p in tps]},
        ).result_rows
        return {(topic, partition): (tuple(entry), int(batch_id))
                for topic, partition, (entry, batch_id) in rows}

    def journaled(self) -> list[tuple[str, int]]:
        """Every (topic, partition) this group's journal names in this store."""
        return [tuple(row) for row in self.client.query(
            f"SELECT DISTINCT topic, partition FROM {self.target.table('sink_batches')} "
            "WHERE group_id = {g:String} AND state = 'begin'",
            parameters={"g": self.group_id}).result_rows]

    def abandon(self, batch_ids: list[int]) -> None:
        """Delete every row of ``batch_ids`` from every table, and from the page
        aggregates and the roll-ups ClickHouse made of them, and journal them as
        abandoned."""
        rollups = self.target.rollups
        for target, table in [*((self.target, t) for t in (*TABLES, *AGGREGATES)),
                              *((rollups, t) for t in ROLLUPS)]:
            params = {"ids": batch_ids}
            present = self.client.query(
                f"SELECT count() FROM {target.table(table)} WHERE _batch IN {{ids:Array(UInt64)}}",
                parameters=params,
            ).result_rows[0][0]
            if present:
                self.client.command(
                    f"DELETE FROM {target.storage_table(table)} WHERE _batch IN {{ids:Array(UInt64)}}",
                    parameters=params,
                )
                logger.warning("deleted %d rows of abandoned batch(es) from %s", present,
                               target.table(table))
        self._end(batch_ids, "abandoned")

    # -------------------------------------------------------------------- load

    def load(self, batch: Batch, starts: dict[TopicPartition, int]) -> int | None:
        """Load ``batch`` (whose partitions start at the committed positions
        ``starts``); retry while ClickHouse is unavailable. Returns its batch id, or
        None when :attr:`stopping` was set before the batch could be loaded (nothing of
        it is then left behind as loaded)."""
        backoff = 0.1
        failed: list[int] = []
        while True:
            batch_id = self._next_batch_id()
            try:
                if failed:
                    self.abandon(failed)
                    failed = []
                duplicates, highest = self.delivered.duplicates(batch.tables["envelopes"])
                if duplicates:
                    rows = batch.drop_messages(duplicates)
                    self.duplicate_envelopes += len(duplicates)
                    logger.warning("%d envelope(s) loaded before arrived again (a producer "
                                   "re-sent them); %d rows of them not loaded twice",
                                   len(duplicates), rows)
                self._load_once(batch, starts, batch_id)
                self.delivered.loaded(highest)
                return batch_id
            except clickhouse.UNAVAILABLE as e:
                if clickhouse.is_rejection(e):
                    raise  # a journal row was rejected: a bug, not the data's fault
                failed.append(batch_id)
                logger.warning(
                    "ClickHouse did not take batch %d (%d rows): %s; retrying in %.1fs",
                    batch_id, batch.n_rows, str(e).splitlines()[0][:300], backoff,
                )
            if self.stopping.wait(backoff):
                return None
            backoff = min(backoff * 2, self.retry_backoff_max)

    def _load_once(self, batch: Batch, starts: dict[TopicPartition, int], batch_id: int) -> None:
        self._journal([
            [self.group_id, batch_id, "begin", topic, partition,
             starts.get((topic, partition), -1), end, *batch.firsts[(topic, partition)]]
            for (topic, partition), end in sorted(batch.positions.items())
        ], f"{batch_id}:begin")
        self.pause.reached("after-begin")
        rejected: list[tuple[Message, int | None, str]] = []
        first = True
        for table in TABLES:
            data = batch.tables[table]
            if table != "dead_letters" and len(data):
                self._insert(table, data, batch_id, rejected, batch.arrow.get(table))
                if first:
                    self.pause.reached("between-tables")
                    first = False
        dead, prepared = batch.tables["dead_letters"], batch.arrow.get("dead_letters")
        if rejected:
            prepared = None
            dead = TableData("dead_letters")
            dead.extend(batch.tables["dead_letters"].columns, batch.tables["dead_letters"].refs)
            now = time.time()
            for message, event, reason in rejected:
                dead.append(("sink", message.kafka_topic, message.partition, message.offset,
                             message.key_text(), reason, payload_of(message, event), now),
                            (message, event))
        if len(dead):
            lost: list = []
            self._insert("dead_letters", dead, batch_id, lost, prepared)
            for message, event, reason in lost:
                logger.error(
                    "ClickHouse rejected a dead letter; it is only in this log: %s[%d]@%d "
                    "event %s: %s payload=%s", message.kafka_topic, message.partition,
                    message.offset, event, reason, payload_of(message, event),
                )
        self._end([batch_id], "loaded")
        self._count(batch, len(dead))
        self.pause.reached("after-load")

    def _count(self, batch: Batch, dead: int) -> None:
        for table, data in batch.tables.items():
            if table != "dead_letters":
                self.rows_loaded[table] += len(data)
        self.rows_loaded["dead_letters"] += dead
        self.dead_letters += dead
        drops = batch.tables["drops"]
        if len(drops):
            self.dropped_events += sum(drops.columns[COLUMNS["drops"].index("dropped_events")])
        self.batches += 1

    def prepare(self, batch: Batch) -> None:
        """Build the Arrow tables of ``batch`` now (Python work, which holds the GIL),
        so that :meth:`load` in another thread mostly waits on ClickHouse. Optional:
        load builds what is missing; a table whose values Arrow refuses is left to
        load, which finds the rows at fault."""
        for table, data in batch.tables.items():
            if len(data) and table not in batch.arrow:
                try:
                    batch.arrow[table] = self.schemas[table].table_of(data)
                except (ValueError, TypeError, OverflowError):
                    pass

    def _insert(self, table: str, data: TableData, batch_id: int,
                rejected: list[tuple[Message, int | None, str]], prepared=None) -> None:
        """Insert ``data`` (``prepared``: its Arrow table, if built); rows ClickHouse
        rejects are appended to ``rejected`` (with its message), found by splitting
        the insert in halves."""
        schema = self.schemas[table]
        pending = [(0, len(data))]
        while pending:
            lo, hi = pending.pop()
            try:
                if prepared is not None:
                    part = prepared.slice(lo, hi - lo)
                else:
                    part = schema.table([c[lo:hi] for c in data.columns])
                self.client.insert_arrow(self.target.table(table), arrow.with_batch(part, batch_id),
                                         settings=self.settings_for(f"{batch_id}:{table}:{lo}-{hi}"))
            except Exception as e:
                if not clickhouse.is_rejection(e):
                    raise
                if hi - lo == 1:
                    message, event = data.refs[lo]
                    reason = str(e).splitlines()[0][:2000] or type(e).__name__
                    rejected.append((message, event, f"ClickHouse rejected this {table} row: {reason}"))
                    logger.warning("ClickHouse rejected a %s row from %s[%d]@%d: %s", table,
                                   message.kafka_topic, message.partition, message.offset, reason)
                else:
                    mid = (lo + hi) // 2
                    pending += [(mid, hi), (lo, mid)]
