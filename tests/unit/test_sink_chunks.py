"""The blocks of a batch joined into chunks (sinks.tables.join_blocks,
TableData.gather): the joined columns hold the blocks' values in order, whatever each
column is (lists, tuples, ranges, Coded, FlatLists, a mix); and a batch whose
transitions cross the chunk size several times, with envelopes the typed path refuses
between them, gives the checked path's rows and Arrow tables, each row with its own
message and event."""

from __future__ import annotations

import clickhouse_connect
import numpy as np
import pytest

from dask_blackbox import contract
from dask_blackbox.sinks import arrow
from dask_blackbox.sinks import batch as batch_module
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import COLUMNS, Coded, FlatLists, Message, TableData, join_blocks

from test_sink_typed_arrow import _long_capture
from test_typed_envelopes import NOW, _envelope, _event, _replaced


def _values(column) -> list:
    if type(column) is np.ndarray:
        return column.tolist()
    return [list(v) for v in column] if isinstance(column, FlatLists) else list(column)


@pytest.mark.parametrize("parts", [
    [["a", None], ("b",), []],
    [range(3, 5), range(0, 2), range(7, 8)],
    [range(3, 5), [9, 1]],
    [Coded(["x", "y"], np.array([1, 0, 1], np.int32)), Coded(["x"], [0, 0]),
     Coded([None, "z"], np.array([1, 0], np.int32))],
    [Coded(["x", "y"], np.array([1, 0], np.int32)), ["z", None]],
    [FlatLists(["a", "b", "c"], [2, 0, 1]), FlatLists((), [0, 0]), FlatLists(["d"], [1])],
])
def test_joined_columns_hold_the_blocks_values_in_order(parts):
    (joined,) = join_blocks([[part] for part in parts])
    assert _values(joined) == [v for part in parts for v in _values(part)]


def test_joined_coded_columns_become_one_dictionary_of_distinct_values():
    convert = arrow.converter("LowCardinality(String)")
    joined, = join_blocks([[Coded(["x", None], np.array([0, 1, 0], np.int32))],
                           [Coded(["x", "y"], np.array([1, 0], np.int32))]])
    array = convert(joined)
    assert array.to_pylist() == ["x", "", "x", "y", "x"]
    assert sorted(array.dictionary.to_pylist()) == ["", "x", "y"]


def test_rows_added_after_gathered_blocks_come_after_them():
    data = TableData("profiles")
    m = Message(contract.RAW, "t.raw", 0, 7, b"c1", b"", 1000)
    block = [Coded(["c1"], np.zeros(2, np.int32)), ["w"] * 2, ["p"] * 2, [NOW] * 2,
             ["s1", "s2"], [1, 2]]
    assert data.gather(block, 2, m, [3, 4]) == 2
    data.append(("c1", "w", "p", NOW, "s3", 3), (m, 5))
    assert data.gather(block, 2, m, range(6, 8)) == 2
    assert [list(c) for c in data.columns][4] == ["s1", "s2", "s3", "s1", "s2"]
    assert [event for _, event in data.refs] == [3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('chunks-ch')}")
    migrate(client, Target("chunks", 90 * 86400))
    yield arrow.schemas(client, "chunks", COLUMNS)
    client.close()


def _messages() -> list[Message]:
    """Envelopes of long captures, every third one's capture a kwargs entry wider than
    the contract's (the typed path refuses it, the checked path loads it)."""
    values = []
    for seq in range(9):
        value = _envelope(seq, _long_capture(NOW - 60 + seq, 300 + 37 * seq))
        if seq % 3 == 1:
            capture = next(ev for ev in contract.decode_envelope(value)["events"]
                           if ev["kind"] == contract.CAPTURE)
            wider = [None if e is None else [*e, "later"] for e in capture["kwargs"]]
            value = _replaced(value, events=_event(value, contract.CAPTURE, kwargs=wider))
        values.append(value)
    return [Message(contract.RAW, "t.raw", 0, i, b"c1", v, 1000) for i, v in enumerate(values)]


def test_a_batch_crossing_the_chunk_size_gives_the_checked_paths_rows(schemas, monkeypatch):
    monkeypatch.setattr(batch_module, "CHUNK_ROWS", 700)
    messages = _messages()
    typed = Batch(schemas)
    for m in messages:
        typed.add(m, NOW)
    assert typed.n_checked == 3
    with monkeypatch.context() as patch:
        patch.setattr(Batch, "_add_typed", lambda self, message, now: False)
        checked = Batch(schemas)
        for m in messages:
            checked.add(m, NOW)
    data = typed.tables["transitions"]
    assert len(data) > 3 * 700
    assert sum(type(c) is arrow.ArrowChunk for c in data.chunks) >= 2
    for table in COLUMNS:
        if len(checked.tables[table]):
            assert schemas[table].table_of(typed.tables[table]).to_pylist() == \
                schemas[table].table_of(checked.tables[table]).to_pylist(), table
    # Each row's reference is its own envelope's event.
    columns = dict(zip(COLUMNS["transitions"], data.columns))
    seqs, idxs = columns["seq"], columns["idx"]
    assert [(m.offset, event) for m, event in data.refs] == list(zip(seqs, idxs))
