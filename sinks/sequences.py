"""Envelopes loaded already: a producer's envelope that arrives again is not loaded
twice.

A producer numbers its envelopes 0, 1, 2, ... and sends one at a time
(``contract``); when a broker fails between storing an envelope and acknowledging it
(a broker or the active controller lost), the producer sends it again with the same
``seq``, and the raw topic holds it twice. The processors skip such duplicates
(stream_processors/sequencing.py); the sink does too, here: an envelope whose
``(cluster_id, producer_id, seq)`` is at or below the highest ``seq`` of that
producer already loaded, and that repeats the envelope loaded with that seq (or one
earlier in the batch), is dropped from the batch with every row made of it
(:meth:`Batch.drop_messages`), and counted.

What was loaded is remembered per producer in memory, and asked of ClickHouse (the
``envelopes`` table, by its sort key) for a producer this sink has not seen since it
started or since its partitions last changed (:meth:`Delivered.forget`). A producer
that restarts gets a new ``producer_id``, so its seq starting at 0 again is no
duplicate.
"""

from __future__ import annotations

import logging

from dask_blackbox.clickhouse import Target
from dask_blackbox.sinks.tables import COLUMNS, TableData

logger = logging.getLogger("sinks.sequences")

_CLUSTER, _PRODUCER, _SEQ = (COLUMNS["envelopes"].index(c) for c in ("cluster_id", "producer_id", "seq"))
#: What an envelope sent again repeats: its counts (its ``sent_at`` is new).
_COUNTS = tuple(COLUMNS["envelopes"].index(c)
                for c in ("n_events", "n_transitions", "n_memory", "n_erred"))

#: Producers remembered at most; past it the memory is cleared and asked again.
MAX_PRODUCERS = 200_000


def message_key(message) -> tuple[str, int, int]:
    """Where a message is: (Kafka topic, partition, offset)."""
    return message.kafka_topic, message.partition, message.offset


class Delivered:
    """The highest ``seq`` loaded of each producer this sink has met."""

    def __init__(self, client, target: Target) -> None:
        self.client = client
        self.target = target
        #: (cluster_id, producer_id) -> highest seq loaded (-1: none)
        self.last: dict[tuple[str, str], int] = {}

    def forget(self) -> None:
        """Ask ClickHouse again (the partitions this sink consumes changed: another
        sink may have loaded some producers' envelopes meanwhile)."""
        self.last.clear()

    def duplicates(self, envelopes: TableData) -> tuple[set[tuple[str, int, int]], dict]:
        """The messages of ``envelopes`` (a batch's rows of that table) holding an
        envelope loaded before, or earlier in the batch, and the highest seq per
        producer once the others are loaded. An envelope is one loaded before when
        its producer's seq has been reached (:attr:`last`) and the envelope loaded
        with that seq has the same counts (events, transitions, into memory, erred):
        a producer that broke the contract by numbering different envelopes alike
        loses nothing. May raise what a ClickHouse query raises (the loader retries)."""
        if not len(envelopes):
            return set(), {}
        columns = envelopes.columns
        producers = list(zip(columns[_CLUSTER], columns[_PRODUCER]))
        counts = list(zip(*(columns[i] for i in _COUNTS)))
        unknown = sorted(set(producers) - self.last.keys())
        if unknown:
            self._ask(unknown)
        candidates = {(*producer, seq) for producer, seq in zip(producers, columns[_SEQ])
                      if seq <= self.last[producer]}
        loaded = self._loaded(sorted(candidates)) if candidates else {}
        highest: dict = {}
        seen: dict = {}
        dropped = set()
        for producer, seq, count, (message, _) in zip(producers, columns[_SEQ], counts,
                                                      envelopes.refs):
            key = (*producer, seq)
            if seen.get(key) == count or loaded.get(key) == count:
                dropped.add(message_key(message))
                continue
            seen[key] = count
            highest[producer] = max(seq, highest.get(producer, self.last[producer]))
        return dropped, highest

    def loaded(self, highest: dict) -> None:
        """The batch whose :meth:`duplicates` gave ``highest`` is loaded."""
        if len(self.last) + len(highest) > MAX_PRODUCERS:
            self.last.clear()
        self.last.update(highest)

    def _ask(self, producers: list[tuple[str, str]]) -> None:
        rows = self.client.query(
            "SELECT cluster_id, producer_id, max(seq) FROM "
            f"{self.target.table('envelopes')} WHERE cluster_id IN {{c:Array(String)}} "
            "AND (cluster_id, producer_id) IN {p:Array(Tuple(String, String))} "
            "GROUP BY cluster_id, producer_id",
            parameters={"c": sorted({c for c, _ in producers}), "p": producers},
        ).result_rows
        found = {(c, p): int(seq) for c, p, seq in rows}
        for producer in producers:
            self.last[producer] = found.get(producer, -1)

    def _loaded(self, keys: list[tuple[str, str, int]]) -> dict[tuple, tuple]:
        """(cluster_id, producer_id, seq) -> the counts of the envelope loaded with it."""
        rows = self.client.query(
            "SELECT cluster_id, producer_id, seq, any(n_events), any(n_transitions), "
            f"any(n_memory), any(n_erred) FROM {self.target.table('envelopes')} "
            "WHERE cluster_id IN {c:Array(String)} "
            "AND (cluster_id, producer_id, seq) IN {k:Array(Tuple(String, String, UInt64))} "
            "GROUP BY cluster_id, producer_id, seq",
            parameters={"c": sorted({c for c, _, _ in keys}), "k": keys},
        ).result_rows
        return {(c, p, int(seq)): tuple(counts) for c, p, seq, *counts in rows}
