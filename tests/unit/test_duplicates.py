"""An envelope a producer sent twice (a broker lost between storing it and
acknowledging it) is loaded once: in the same batch, in a later one, and after the
sink restarted (sinks/sequences.py), on the sink's own Batch and Loader over chDB."""

from __future__ import annotations

import time

import clickhouse_connect
import orjson
import pytest

from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import Message

from sink_support import envelope, transition

TARGET = Target("blackbox", 90 * 86400)
T0 = time.time() - 600


def sent(producer: str, seq: int, offset: int) -> Message:
    """Envelope ``seq`` of ``producer``: three transitions of keys of its own, at
    Kafka offset ``offset``."""
    events = [transition(f"{producer}-{seq}-{i}", "processing", "memory", T0 + seq + i / 10,
                         prefix="p", worker="tcp://w:1") for i in range(3)]
    value = orjson.dumps(envelope(events, producer_id=producer, seq=seq))
    return Message("raw", "t.raw", 0, offset, b"c1", value, 1000)


def load(loader: Loader, messages: list[Message]) -> Batch:
    batch = Batch(loader.schemas)
    for m in messages:
        batch.add(m)
    assert loader.load(batch, {})
    return batch


@pytest.fixture
def client(tmp_path):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'ch'}")
    migrate(client, TARGET)
    yield client
    client.close()


def keys(client) -> list[tuple[str, int]]:
    return client.query("SELECT key, count() FROM blackbox.transitions GROUP BY key ORDER BY key"
                        ).result_rows


def test_an_envelope_sent_twice_is_loaded_once(client):
    loader = Loader(client, TARGET, "g")
    # seq 1 again in the same batch; then a batch with 0 and 2 again and a new 3.
    first = load(loader, [sent("p1", 0, 0), sent("p1", 1, 1), sent("p1", 1, 2), sent("p1", 2, 3)])
    assert first.positions == {("t.raw", 0): 4}  # the copy is committed with the batch
    load(loader, [sent("p1", 0, 4), sent("p1", 2, 5), sent("p1", 3, 6), sent("p2", 0, 7)])
    assert loader.duplicate_envelopes == 3
    # A new sink (after a crash, or another member of the group) asks ClickHouse.
    restarted = Loader(client, TARGET, "g")
    load(restarted, [sent("p1", 3, 8), sent("p1", 4, 9), sent("p2", 0, 10), sent("p2", 1, 11)])
    assert restarted.duplicate_envelopes == 2
    expected = sorted((f"{p}-{seq}-{i}", 1) for p, seqs in (("p1", range(5)), ("p2", range(2)))
                      for seq in seqs for i in range(3))
    assert keys(client) == expected
    envelopes = client.query("SELECT producer_id, seq, count() FROM blackbox.envelopes "
                             "GROUP BY producer_id, seq ORDER BY producer_id, seq").result_rows
    assert envelopes == [("p1", s, 1) for s in range(5)] + [("p2", s, 1) for s in range(2)]
    # The roll-ups count each transition once too.
    assert client.query("SELECT sum(into['memory']) FROM blackbox_rollups.task_minutes"
                        ).result_rows[0][0] == len(expected)


def test_a_new_producer_starting_at_zero_is_no_duplicate(client):
    """A producer that restarts gets a new id: its seq 0 loads."""
    loader = Loader(client, TARGET, "g")
    load(loader, [sent("p1", 0, 0), sent("p1", 1, 1)])
    load(loader, [sent("p1-restarted", 0, 2)])
    assert loader.duplicate_envelopes == 0
    assert len(keys(client)) == 9


def test_a_reused_seq_with_other_events_is_loaded(client):
    """Only an envelope that repeats the one loaded with its seq is a duplicate: a
    producer numbering different envelopes alike loses nothing."""
    loader = Loader(client, TARGET, "g")
    load(loader, [sent("p1", 0, 0)])
    other = orjson.loads(sent("p1", 0, 1).value)
    other["events"] = other["events"][:2]
    load(loader, [Message("raw", "t.raw", 0, 1, b"c1", orjson.dumps(other), 1000)])
    assert loader.duplicate_envelopes == 0
    assert [n for _, n in keys(client)] == [2, 2, 1]
