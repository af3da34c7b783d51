"""The continuous exporter's journal: a SQLite database in ``<data-dir>/exporter/``
that holds, in one place and under one transaction at a time, everything between
Kafka and the OTLP receiver. It is what makes the exporter survive a SIGKILL
without losing or repeating a span.

The protocol:

1. A batch of Kafka messages is **applied** in one transaction (:meth:`Journal.apply`):
   what it derives -- task spans and log records ready to send (the *outbox*),
   span snapshots, erred tasks and worker removals waiting for their span or run
   to end, each cluster's facts about its removals, per-prefix summaries beyond the
   cap -- and the partitions' next offsets.
   The Kafka offsets live here, not only in the consumer group: a message is read
   again after a crash exactly when its effects were not committed, so nothing is
   derived twice and nothing is skipped. (The consumer group's committed offsets
   follow, for lag monitoring.)
2. Finished spans (a cluster that ended, a span done and quiet) move from their
   tables to the outbox in one transaction (:meth:`Journal.finish_ready`).
3. The outbox is sent in order; an item leaves it (:meth:`Journal.done`) only after
   the receiver acknowledged it, or when the receiver refused it alone: then it is
   set aside (:meth:`Journal.set_aside`, table ``set_aside``, with the reason) so
   that nothing one item holds stops the items after it. A crash before that sends it again after the
   restart: the one window where a span can be sent twice is between the
   receiver's acknowledgement and that one transaction, and the span's id is
   deterministic (:mod:`.ids`), so a backend can tell it is the same span.

A worker's death is the rule of :mod:`dask_blackbox.causes`, as everywhere: the journal
keeps each running cluster's :class:`~dask_blackbox.death_facts.DeathFacts` (table
``death_facts``, fed every event of every source) and each removal (with the process id
and nanny its worker joined with), and classifies the removal when the run ends, or
earlier, once the cluster's events are
:data:`~dask_blackbox.death_facts.FACT_WINDOW_S` past it (its facts are then
forgotten); only a death becomes a ``dask.worker.death`` event of the run span
(:func:`.traces.death_event`), and each task its removal took out of processing a
``died`` span (:func:`.traces.died_span`): the journal keeps when each task of a running
cluster last entered processing (table ``processing``) and the tasks that left it
unfinished (``left_processing``) until their removal is classified.

Each transaction is durable when it returns (WAL, ``synchronous=FULL``). One exporter
owns a journal at a time (an exclusive ``flock`` on ``journal.lock``): a second one
on the same data directory is refused.
"""

from __future__ import annotations

import fcntl
import pathlib
import sqlite3
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgspec
import orjson

from dask_blackbox import config
from dask_blackbox.causes import Classified, Removal
from dask_blackbox.death_facts import FACT_WINDOW_S, DeathFacts

from . import traces
from .model import Item, SpanData, SpanEvent, decode, encode

_SCHEMA = """
CREATE TABLE IF NOT EXISTS offsets (topic TEXT, partition INTEGER, next_offset INTEGER,
                                    PRIMARY KEY (topic, partition));
CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT,
                                   item BLOB);
CREATE TABLE IF NOT EXISTS set_aside (seq INTEGER PRIMARY KEY, kind TEXT, item BLOB,
                                      reason TEXT, at REAL);
CREATE TABLE IF NOT EXISTS producers (producer_id TEXT PRIMARY KEY, last_seq INTEGER);
CREATE TABLE IF NOT EXISTS clusters (cluster_id TEXT PRIMARY KEY, name TEXT,
    first_ns INTEGER, last_ns INTEGER, closed_at REAL, touched REAL,
    task_spans INTEGER DEFAULT 0, ended INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS spans (cluster_id TEXT, span_id TEXT, version INTEGER,
    state BLOB, done INTEGER, touched REAL, exported INTEGER DEFAULT 0,
    PRIMARY KEY (cluster_id, span_id));
CREATE TABLE IF NOT EXISTS events (cluster_id TEXT, span_id TEXT, kind TEXT, event BLOB);
CREATE INDEX IF NOT EXISTS events_by_span ON events (cluster_id, span_id);
CREATE TABLE IF NOT EXISTS death_facts (cluster_id TEXT PRIMARY KEY, state BLOB);
CREATE TABLE IF NOT EXISTS processing (cluster_id TEXT, key TEXT, entered REAL,
    PRIMARY KEY (cluster_id, key));
CREATE TABLE IF NOT EXISTS left_processing (cluster_id TEXT, stimulus_id TEXT, task BLOB,
    left_at REAL);
CREATE INDEX IF NOT EXISTS left_by_stimulus ON left_processing (cluster_id, stimulus_id);
CREATE TABLE IF NOT EXISTS summaries (cluster_id TEXT, prefix TEXT, action TEXT,
    actions INTEGER, seconds REAL, first_ns INTEGER, last_ns INTEGER,
    PRIMARY KEY (cluster_id, prefix, action));
"""

_events = msgspec.msgpack.Encoder()
_event = msgspec.msgpack.Decoder(SpanEvent)


class Record(NamedTuple):
    """A Kafka message for :meth:`Journal.apply`: its topic's contract name (raw or
    span-state), where it was, and its value decoded (None: not JSON)."""

    topic: str
    kafka_topic: str
    partition: int
    offset: int
    value: Any


class Applied(NamedTuple):
    """What :meth:`Journal.apply` did with a batch."""

    task_spans: int
    summarised: int
    logs: int
    late: int
    skipped: int


class JournalBusy(config.ConfigError):
    """Another exporter owns this journal."""


class Journal:
    """The journal in ``directory`` (created 0700)."""

    def __init__(self, directory: pathlib.Path, max_task_spans: int, logs: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = directory / "journal.sqlite"
        self._lock = open(directory / "journal.lock", "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise JournalBusy(f"another exporter owns the journal in {directory} "
                              "(blackbox.data-dir): one exporter per data directory") from None
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        self.max_task_spans = max_task_spans
        self.logs = logs

    def close(self) -> None:
        self.db.close()
        self._lock.close()

    # ----------------------------------------------------------------- reads

    def offsets(self) -> dict[tuple[str, int], int]:
        return {(t, p): o for t, p, o in self.db.execute("SELECT topic, partition, next_offset FROM offsets")}

    def backlog(self) -> int:
        """Items in the outbox (not yet acknowledged by the receiver)."""
        return self.db.execute("SELECT count() FROM outbox").fetchone()[0]

    def pending(self, limit: int, max_bytes: int | None = None) -> list[tuple[int, Item]]:
        """The oldest items of the outbox (at most ``limit``, all of one signal:
        spans or log records, so one request carries them; at most ``max_bytes`` of
        journalled items, and always the first), with their sequence numbers."""
        out: list[tuple[int, Item]] = []
        kind, total = None, 0
        for seq, item_kind, item in self.db.execute(
                "SELECT seq, kind, item FROM outbox ORDER BY seq LIMIT ?", (limit,)):
            if kind is not None and item_kind != kind:
                break
            total += len(item)
            if out and max_bytes is not None and total > max_bytes:
                break
            kind = item_kind
            out.append((seq, decode(item)))
        return out

    def set_aside_count(self) -> int:
        """Items the receiver refused alone, kept in table ``set_aside``."""
        return self.db.execute("SELECT count() FROM set_aside").fetchone()[0]

    # ---------------------------------------------------------------- writes

    def done(self, seqs: Iterable[int]) -> None:
        """The receiver acknowledged these items: forget them."""
        with self._transaction():
            self.db.executemany("DELETE FROM outbox WHERE seq = ?", [(s,) for s in seqs])

    def set_aside(self, seq: int, reason: str) -> None:
        """The receiver refused this item alone: move it out of the outbox, with why,
        so the items after it go."""
        with self._transaction():
            self.db.execute("INSERT OR REPLACE INTO set_aside (seq, kind, item, reason, at) "
                            "SELECT seq, kind, item, ?, ? FROM outbox WHERE seq = ?",
                            (reason, time.time(), seq))
            self.db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))

    def stop_logs(self) -> int:
        """The receiver takes no logs: journal none from now on, and forget those the
        outbox holds (returns how many)."""
        self.logs = False
        with self._transaction():
            return self.db.execute("DELETE FROM outbox WHERE kind = 'log'").rowcount

    def _transaction(self):
        db = self.db

        class _Tx:
            def __enter__(self):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, kind, value, tb):
                db.execute("COMMIT" if kind is None else "ROLLBACK")

        return _Tx()

    def _put(self, kind: str, item: Item) -> None:
        self.db.execute("INSERT INTO outbox (kind, item) VALUES (?, ?)", (kind, encode(item)))

    def apply(self, records: list[Record], now: float | None = None) -> Applied:
        """Apply a batch of Kafka messages and record their partitions' next offsets,
        in one transaction. Messages that are not what the contract says are skipped
        (the processors and the sink dead-letter them)."""
        now = time.time() if now is None else now
        counts = dict(task_spans=0, summarised=0, logs=0, late=0, skipped=0)
        facts: dict[str, DeathFacts] = {}  # the clusters' facts this batch touches
        with self._transaction():
            for r in records:
                try:
                    if r.topic == "raw":
                        self._apply_envelope(r.value, now, counts, facts)
                    else:
                        self._apply_span_state(r.value, now, counts)
                except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
                    counts["skipped"] += 1
                self.db.execute(
                    "INSERT INTO offsets VALUES (?, ?, ?) ON CONFLICT (topic, partition) "
                    "DO UPDATE SET next_offset = excluded.next_offset",
                    (r.kafka_topic, r.partition, r.offset + 1))
            for cluster_id, known in facts.items():
                self._keep_facts(cluster_id, known)
        return Applied(**counts)

    def _cluster(self, cluster_id: str, name: str | None, now: float) -> tuple:
        row = self.db.execute("SELECT name, task_spans, ended FROM clusters WHERE cluster_id = ?",
                              (cluster_id,)).fetchone()
        if row is None:
            self.db.execute("INSERT INTO clusters (cluster_id, name, touched) VALUES (?, ?, ?)",
                            (cluster_id, name or cluster_id, now))
            return name or cluster_id, 0, 0
        self.db.execute("UPDATE clusters SET touched = ?, name = coalesce(?, name) "
                        "WHERE cluster_id = ?", (now, name, cluster_id))
        return name or row[0], row[1], row[2]

    def _seen(self, cluster_id: str, *times_ns: int) -> None:
        lo, hi = min(times_ns), max(times_ns)
        self.db.execute("UPDATE clusters SET first_ns = min(coalesce(first_ns, ?), ?), "
                        "last_ns = max(coalesce(last_ns, ?), ?) WHERE cluster_id = ?",
                        (lo, lo, hi, hi, cluster_id))

    def _apply_envelope(self, env: Mapping, now: float, counts: dict,
                        facts: dict[str, DeathFacts]) -> None:
        from dask_blackbox import contract

        contract.validate_envelope(env)
        producer, seq = env["producer_id"], env["seq"]
        last = self.db.execute("SELECT last_seq FROM producers WHERE producer_id = ?",
                               (producer,)).fetchone()
        if last is not None and seq <= last[0]:
            counts["skipped"] += 1  # a producer's envelope seen before (a resend)
            return
        self.db.execute("INSERT INTO producers VALUES (?, ?) ON CONFLICT (producer_id) "
                        "DO UPDATE SET last_seq = excluded.last_seq", (producer, seq))
        cluster_id = env["cluster_id"]
        name, task_spans, ended = self._cluster(cluster_id, env.get("cluster_name"), now)
        resource = traces.resource(cluster_id, name)
        cap = traces.TaskCap(self.max_task_spans, task_spans)
        scheduler = env["source"] == "scheduler"
        known = None
        if not ended:
            known = facts.get(cluster_id)
            if known is None:
                known = facts[cluster_id] = self._facts(cluster_id)
            known.envelope(env["source"])
        for ev in contract.expand_events(env["events"]):
            try:
                self._apply_event(ev, cluster_id, resource, cap, scheduler and not ended,
                                  env["source"], counts, known)
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
                counts["skipped"] += 1  # an event the contract does not allow
        for (prefix, action), (n, seconds, first, last_ns) in cap.summaries.items():
            self.db.execute(
                "INSERT INTO summaries VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (cluster_id, prefix, action) DO UPDATE SET "
                "actions = actions + excluded.actions, seconds = seconds + excluded.seconds, "
                "first_ns = min(first_ns, excluded.first_ns), last_ns = max(last_ns, excluded.last_ns)",
                (cluster_id, prefix, action, n, seconds, first, last_ns))
            counts["summarised"] += n
        self.db.execute("UPDATE clusters SET task_spans = ? WHERE cluster_id = ?",
                        (cap.admitted, cluster_id))

    def _apply_event(self, ev: Mapping, cluster_id: str, resource, cap: traces.TaskCap,
                     live: bool, source: str, counts: dict, facts: DeathFacts | None) -> None:
        """One event of an envelope; ``live``: from the scheduler of a cluster whose
        run has not ended (a late event of an ended run sends its task spans, which
        stand on their own, and nothing that would wait for the run's end);
        ``facts``: the cluster's, None once its run ended."""
        from dask_blackbox import contract

        kind = ev.get("kind")
        if kind == contract.TRANSITION and source == "scheduler":
            for span in traces.task_spans(cluster_id, ev):
                self._seen(cluster_id, span.start_ns, span.end_ns)
                if cap.admit(span):
                    self._put("span", Item(resource, span=span))
                    counts["task_spans"] += 1
            if live:
                self._track_processing(cluster_id, ev)
            if ev.get("finish") == "erred":
                if live:
                    self._event(cluster_id, ev.get("span_id") or "", "exception",
                                traces.error_event(ev))
                else:
                    counts["late"] += 1
        elif kind == contract.LIFECYCLE:
            self._seen(cluster_id, traces.ns(ev["ts"]))
            removal = facts.lifecycle(ev) if facts is not None else None
            if removal is not None and live:
                self._event(cluster_id, "", "removal", list(removal))
            elif ev.get("action") == "scheduler_close":
                self.db.execute("UPDATE clusters SET closed_at = ? WHERE cluster_id = ?",
                                (ev["ts"], cluster_id))
        elif kind == contract.LOG and self.logs:
            self._put("log", Item(resource, log=traces.log_data(cluster_id, ev, source)))
            counts["logs"] += 1
        elif facts is not None:
            facts.read(ev)  # a nanny's record of a process's end, Dask's structured events

    def _track_processing(self, cluster_id: str, tr: Mapping) -> None:
        """Keep when a task entered processing; a task leaving it unfinished is kept
        with that time until the removal that may have caused it is classified."""
        start, finish, key = tr.get("start"), tr.get("finish"), tr["key"]
        if finish == "processing":
            self.db.execute("INSERT INTO processing VALUES (?, ?, ?) ON CONFLICT (cluster_id, "
                            "key) DO UPDATE SET entered = excluded.entered",
                            (cluster_id, key, float(tr["ts"])))
        elif start == "processing":
            row = self.db.execute("DELETE FROM processing WHERE cluster_id = ? AND key = ? "
                                  "RETURNING entered", (cluster_id, key)).fetchone()
            if row is not None and finish not in traces.FINISHED and tr.get("stimulus_id"):
                task = traces.LeftProcessing(key, tr.get("prefix") or "", tr.get("group") or "",
                                             tr.get("span_id") or None, tr["stimulus_id"],
                                             row[0], float(tr["ts"]))
                self.db.execute("INSERT INTO left_processing VALUES (?, ?, ?, ?)",
                                (cluster_id, task.stimulus_id, orjson.dumps(list(task)), task.left))

    def _facts(self, cluster_id: str) -> DeathFacts:
        """The facts kept of a cluster whose run has not ended."""
        row = self.db.execute("SELECT state FROM death_facts WHERE cluster_id = ?",
                              (cluster_id,)).fetchone()
        return (DeathFacts(cluster_id) if row is None
                else DeathFacts.from_state(cluster_id, orjson.loads(row[0])))

    def _keep_facts(self, cluster_id: str, facts: DeathFacts) -> None:
        """Classify the removals the cluster's events are FACT_WINDOW_S past (a death
        becomes its event), forget the facts older than that, and store the rest."""
        last_ns, = self.db.execute("SELECT last_ns FROM clusters WHERE cluster_id = ?",
                                   (cluster_id,)).fetchone()
        if last_ns is not None:
            horizon = last_ns / 1e9 - FACT_WINDOW_S
            self._classify_removals(cluster_id, facts, before=horizon)
            facts.prune(horizon)
            # a task that left processing well before any removal still waiting (a
            # steal, a cancellation) is no removal's
            self.db.execute("DELETE FROM left_processing WHERE cluster_id = ? AND left_at < ?",
                            (cluster_id, horizon - FACT_WINDOW_S))
        self.db.execute("INSERT INTO death_facts VALUES (?, ?) ON CONFLICT (cluster_id) "
                        "DO UPDATE SET state = excluded.state",
                        (cluster_id, orjson.dumps(facts.state())))

    def _classify_removals(self, cluster_id: str, facts: DeathFacts,
                           before: float | None = None) -> None:
        """Replace the cluster's removals (those before ``before``, event time; all
        when None) with the events of those that were deaths."""
        for rowid, blob in self.db.execute(
                "SELECT rowid, event FROM events WHERE cluster_id = ? AND span_id = '' "
                "AND kind = 'removal'", (cluster_id,)).fetchall():
            removal = Removal(*orjson.loads(blob))
            if before is not None and removal.ts >= before:
                continue
            death = Classified(removal, facts.verdict(removal))
            left = self.db.execute(
                "DELETE FROM left_processing WHERE cluster_id = ? AND stimulus_id = ? "
                "RETURNING task", (cluster_id, removal.stimulus_id)).fetchall()
            if death.is_death:
                self._event(cluster_id, "", "death", traces.death_event(death))
                self._died(cluster_id, death, [traces.LeftProcessing(*orjson.loads(t))
                                               for t, in left])
            self.db.execute("DELETE FROM events WHERE rowid = ?", (rowid,))

    def _died(self, cluster_id: str, death: Classified,
              left: list[traces.LeftProcessing]) -> None:
        """The spans of the tasks ``death`` took out of processing, to send."""
        if not left:
            return
        name, = self.db.execute("SELECT name FROM clusters WHERE cluster_id = ?",
                                (cluster_id,)).fetchone()
        resource = traces.resource(cluster_id, name)
        for span in traces.died_spans(cluster_id, sorted(left, key=lambda t: t.left), [death]):
            self._put("span", Item(resource, span=span))

    def _event(self, cluster_id: str, span_id: str, kind: str, event) -> None:
        blob = _events.encode(event) if isinstance(event, SpanEvent) else orjson.dumps(event)
        self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (cluster_id, span_id, kind, blob))

    def _apply_span_state(self, state: Mapping, now: float, counts: dict) -> None:
        cluster_id, span_id, version = state["cluster_id"], state["span_id"], int(state["version"])
        self._cluster(cluster_id, state.get("cluster_name"), now)
        row = self.db.execute("SELECT version, exported FROM spans WHERE cluster_id = ? "
                              "AND span_id = ?", (cluster_id, span_id)).fetchone()
        if row is not None and (row[1] or version <= row[0]):
            counts["late"] += bool(row[1] and version > row[0])
            return
        self.db.execute(
            "INSERT INTO spans (cluster_id, span_id, version, state, done, touched) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (cluster_id, span_id) DO UPDATE SET "
            "version = excluded.version, state = excluded.state, done = excluded.done, "
            "touched = excluded.touched",
            (cluster_id, span_id, version, orjson.dumps(state), int(bool(state.get("done"))), now))

    # ------------------------------------------------------------- finishing

    def reading(self, now: float | None = None) -> None:
        """Reading (re)starts at ``now``: the quiet time of every open cluster and
        unexported span (``settle``, ``idle-timeout``, ``span-quiet``) counts from then.
        Quiet time while nothing was read (a journal reopened after a restart, a reading
        paused by a full backlog) says nothing about what Kafka still holds of them."""
        now = time.time() if now is None else now
        with self._transaction():
            self.db.execute("UPDATE clusters SET touched = ? WHERE NOT ended AND touched < ?",
                            (now, now))
            self.db.execute("UPDATE spans SET touched = ? WHERE NOT exported AND touched < ?",
                            (now, now))

    def finish_ready(self, settle: float, idle_timeout: float, span_quiet: float | None,
                     now: float | None = None) -> int:
        """Move finished spans to the outbox, in one transaction: every span of a
        cluster that ended -- its scheduler closed and nothing of it arrived for
        ``settle`` seconds, or nothing at all for ``idle_timeout`` -- with its
        summaries and its run span; and every span whose tasks are all done and whose
        snapshot has not changed for ``span_quiet`` seconds. Returns how many."""
        now = time.time() if now is None else now
        moved = 0
        with self._transaction():
            ended = self.db.execute(
                "SELECT cluster_id, name, first_ns, last_ns, task_spans FROM clusters "
                "WHERE NOT ended AND ((closed_at IS NOT NULL AND ? - touched >= ?) "
                "OR ? - touched >= ?)", (now, settle, now, idle_timeout)).fetchall()
            for cluster_id, name, first_ns, last_ns, task_spans in ended:
                moved += self._finish_cluster(cluster_id, name, first_ns, last_ns, task_spans)
            # a span the processors described only after its run ended: on its own,
            # under the run span, once its snapshots settled
            for cluster_id, name, span_id, state in self.db.execute(
                    "SELECT s.cluster_id, c.name, s.span_id, s.state FROM spans AS s JOIN "
                    "clusters AS c USING (cluster_id) WHERE NOT s.exported AND c.ended "
                    "AND ? - s.touched >= ?", (now, settle)).fetchall():
                self._finish_span(cluster_id, name, span_id, orjson.loads(state))
                moved += 1
            if span_quiet is not None:
                for cluster_id, span_id, state in self.db.execute(
                        "SELECT s.cluster_id, s.span_id, s.state FROM spans AS s JOIN clusters AS c "
                        "USING (cluster_id) WHERE NOT s.exported AND s.done AND NOT c.ended "
                        "AND ? - s.touched >= ?", (now, span_quiet)).fetchall():
                    name = self.db.execute("SELECT name FROM clusters WHERE cluster_id = ?",
                                           (cluster_id,)).fetchone()[0]
                    self._finish_span(cluster_id, name, span_id, orjson.loads(state))
                    moved += 1
        return moved

    def _span_events(self, cluster_id: str, span_id: str) -> list[SpanEvent]:
        rows = self.db.execute("SELECT event FROM events WHERE cluster_id = ? AND span_id = ? "
                               "AND kind = 'exception'", (cluster_id, span_id)).fetchall()
        self.db.execute("DELETE FROM events WHERE cluster_id = ? AND span_id = ? AND kind = 'exception'",
                        (cluster_id, span_id))
        return [_event.decode(r[0]) for r in rows]

    def _finish_span(self, cluster_id: str, name: str, span_id: str, state: dict) -> SpanData:
        span = traces.dask_span(cluster_id, state, self._span_events(cluster_id, span_id))
        self._put("span", Item(traces.resource(cluster_id, name), span=span))
        self.db.execute("UPDATE spans SET exported = 1 WHERE cluster_id = ? AND span_id = ?",
                        (cluster_id, span_id))
        self._seen(cluster_id, span.start_ns, span.end_ns)
        return span

    def _finish_cluster(self, cluster_id: str, name: str, first_ns, last_ns,
                        task_spans: int) -> int:
        moved = 0
        resource = traces.resource(cluster_id, name)
        for span_id, state in self.db.execute(
                "SELECT span_id, state FROM spans WHERE cluster_id = ? AND NOT exported",
                (cluster_id,)).fetchall():
            self._finish_span(cluster_id, name, span_id, orjson.loads(state))
            moved += 1
        summaries = {(p, a): [n, s, f, l] for p, a, n, s, f, l in self.db.execute(
            "SELECT prefix, action, actions, seconds, first_ns, last_ns FROM summaries "
            "WHERE cluster_id = ?", (cluster_id,))}
        for span in traces.summary_spans(cluster_id, summaries):
            self._put("span", Item(resource, span=span))
            moved += 1
        # the run span: worker deaths, and the erred tasks of spans never described or
        # already exported
        closed = self.db.execute("SELECT closed_at FROM clusters WHERE cluster_id = ?",
                                 (cluster_id,)).fetchone()[0]
        self._classify_removals(cluster_id, self._facts(cluster_id))
        events = [_event.decode(blob) for blob, in self.db.execute(
            "SELECT event FROM events WHERE cluster_id = ?", (cluster_id,)).fetchall()]
        self.db.execute("DELETE FROM events WHERE cluster_id = ?", (cluster_id,))
        self.db.execute("DELETE FROM death_facts WHERE cluster_id = ?", (cluster_id,))
        self.db.execute("DELETE FROM processing WHERE cluster_id = ?", (cluster_id,))
        self.db.execute("DELETE FROM left_processing WHERE cluster_id = ?", (cluster_id,))
        first_ns, last_ns = self.db.execute("SELECT first_ns, last_ns FROM clusters WHERE "
                                            "cluster_id = ?", (cluster_id,)).fetchone()
        if first_ns is None:  # nothing with a time but logs: the run is its close
            first_ns = last_ns = traces.ns(closed if closed is not None else time.time())
        self._put("span", Item(resource, span=traces.run_span(
            cluster_id, name, first_ns or 0, last_ns or 0, events, self.max_task_spans,
            task_spans, sum(s[0] for s in summaries.values()))))
        self.db.execute("UPDATE clusters SET ended = 1 WHERE cluster_id = ?", (cluster_id,))
        # each exported span keeps its row, without its state: a later snapshot of it
        # is late, a span first described after the end is exported then
        self.db.execute("UPDATE spans SET state = NULL WHERE cluster_id = ?", (cluster_id,))
        self.db.execute("DELETE FROM summaries WHERE cluster_id = ?", (cluster_id,))
        return moved + 1
