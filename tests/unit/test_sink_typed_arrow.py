"""The sink's typed path against its checked path, on version 3 envelopes of every
event kind as the producers pack them: the same Arrow tables of every table (a large
capture's Coded columns, prefix, group, span id and the envelope's values, become
dictionary arrays on the typed path, joined with the smaller captures' plain ones),
the same rows in ClickHouse; and what the typed path refuses (a capture's shape, an
entry wider than the contract's, bytes cut short) takes the checked path, which
loads or dead-letters it as it always did, and is counted as checked."""

from __future__ import annotations

import clickhouse_connect
import msgspec
import pyarrow as pa
import pytest

from dask_blackbox import contract
from dask_blackbox.producers.rows import TransitionItem
from dask_blackbox.sinks import arrow
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import CHUNK_MIN_ROWS, COLUMNS, Message

from test_sink_rows import rows
from test_typed_envelopes import NOW, X, Y, _carried, _envelope, _event, _Group, _items, _replaced

Z = _Group("z", "z-3", None)  # a group in no span


def _long_capture(t: float, n: int) -> list:
    """A hook's ``n`` transitions, one capture of at least CHUNK_MIN_ROWS (made Arrow
    arrays as it is added): text and tuple keys of three groups (one in no span),
    Dask's kwargs on every fifth, and an erred one."""
    items: list = []
    for i in range(n):
        group = (X, Y, Z)[i % 3]
        key = (group.name, i) if i % 2 else f"{group.name}-{i}"
        if i % 5 == 4:
            items.append(TransitionItem(key, "processing", "memory", f"s{i}", t + i / 1000,
                                        group, None, _carried(t, t + 0.1, i)))
        else:
            items.append(TransitionItem(key, "released", "waiting", f"s{i}", t + i / 1000, group))
    items.append(TransitionItem(
        "y-9", "processing", "erred", "s-e", t + n / 1000, Y, None,
        msgspec.msgpack.encode(("tcp://w:2", None, None, None, 8)),
        {"exception_text": "ValueError('y')", "traceback_text": "  line 1\n", "cause": "y-9"}))
    return items


def _messages() -> list[Message]:
    values = [_envelope(0), _envelope(1, _long_capture(NOW - 30, CHUNK_MIN_ROWS + 100)),
              _envelope(2, _items(NOW + 20)), _envelope(0, source="worker")]
    return [Message(contract.RAW, "t.raw", 0, i, b"c1", v, 1000) for i, v in enumerate(values)]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('typed-ch')}")
    for database in ("typed", "checked"):
        migrate(client, Target(database, 90 * 86400))
    yield client
    client.close()


@pytest.fixture(scope="module")
def schemas(client):
    return arrow.schemas(client, "typed", COLUMNS)


def _batches(messages: list[Message], schemas, monkeypatch) -> tuple[Batch, Batch]:
    """``messages`` converted by the typed path (the checked one where it refuses),
    and by the checked path alone."""
    typed = Batch(schemas)
    for m in messages:
        typed.add(m, NOW)
    with monkeypatch.context() as patch:
        patch.setattr(Batch, "_add_typed", lambda self, message, now: False)
        checked = Batch(schemas)
        for m in messages:
            checked.add(m, NOW)
    return typed, checked


def _tables(batch: Batch, schemas) -> dict[str, pa.Table]:
    return {table: schemas[table].table_of(data) for table, data in batch.tables.items()
            if len(data)}


def _loaded(client, database: str, tables: dict[str, pa.Table]) -> dict:
    """Each table's rows once inserted: their count and a hash of them."""
    out = {}
    for table, data in tables.items():
        client.insert_arrow(f"{database}.{table}", arrow.with_batch(data, 1))
        columns = ", ".join(f"`{c}`" for c in COLUMNS[table])
        out[table] = client.query(f"SELECT count(), groupBitXor(cityHash64({columns})) "
                                  f"FROM {database}.{table}").result_rows[0]
    return out


def test_the_typed_path_gives_the_checked_paths_arrow_tables_and_rows(client, schemas,
                                                                      monkeypatch):
    messages = _messages()
    kinds = {ev["kind"] for ev in contract.decode_envelope(messages[0].value)["events"]}
    assert kinds == set(contract.EVENTS) - {contract.TRANSITION} | {contract.CAPTURE}
    typed, checked = _batches(messages, schemas, monkeypatch)
    assert typed.n_checked == 0 and checked.n_checked == len(messages)
    assert len(typed.tables["dead_letters"]) == 0
    typed_tables, checked_tables = _tables(typed, schemas), _tables(checked, schemas)
    assert set(typed_tables) == set(checked_tables)
    for table in typed_tables:
        assert typed_tables[table].to_pylist() == checked_tables[table].to_pylist(), table
    transitions = typed_tables["transitions"]
    assert transitions.num_rows > CHUNK_MIN_ROWS + 100
    # The large capture's Coded columns, joined with the small captures' rows.
    for column in ("cluster_id", "source", "prefix", "task_group", "span_id"):
        assert pa.types.is_dictionary(transitions.column(column).type), column
        assert not pa.types.is_dictionary(checked_tables["transitions"].column(column).type)
    assert {"x", "y", "z"} <= set(transitions.column("prefix").to_pylist())
    assert "" in transitions.column("span_id").to_pylist()  # Z's: no span
    assert _loaded(client, "typed", typed_tables) == _loaded(client, "checked", checked_tables)


def _refused() -> list[bytes]:
    value = _envelope(0)
    capture = next(ev for ev in contract.decode_envelope(value)["events"]
                   if ev["kind"] == contract.CAPTURE)
    n = len(capture["key"])
    wider = [None if e is None else [*e, "later"] for e in capture["kwargs"]]
    return [
        _replaced(value, events=_event(value, contract.CAPTURE, name=[99] * n)),
        _replaced(value, events=_event(value, contract.CAPTURE, time=capture["time"][1:])),
        _replaced(value, events=_event(value, contract.CAPTURE, kwargs=wider)),  # loads
        _replaced(value, events=_event(value, contract.CAPTURE, key=[["x", {"no": 1}]] * n)),
        value[:len(value) // 2],
    ]


def test_what_the_typed_path_refuses_is_loaded_or_dead_lettered_as_the_checked_path_does(
        schemas, monkeypatch):
    values = _refused()
    messages = [Message(contract.RAW, "t.raw", 0, i, b"c1", v, 1000) for i, v in enumerate(values)]
    typed, checked = _batches(messages, schemas, monkeypatch)
    assert typed.n_checked == checked.n_checked == len(values) - 1  # the cut one: not decoded
    for table in COLUMNS:
        assert rows(typed, table) == rows(checked, table), table
    letters = rows(typed, "dead_letters")
    reasons = [r["reason"] for r in letters]
    assert sorted({r["offset"] for r in letters}) == [0, 1, 3, 4]
    assert any("capture" in r and "name" in r for r in reasons)
    assert any("capture" in r and "time" in r for r in reasons)
    assert any("is not part of a Dask key" in r for r in reasons)
    # The wider kwargs: the contract reads their first values, as the checked path does.
    assert 2 in {r["offset"] for r in rows(typed, "envelopes")}


def test_a_capture_alone_whose_groups_share_a_prefix_and_a_span_loads(client, schemas,
                                                                      monkeypatch):
    """A batch of one large capture, its groups two of one prefix in one span and one in
    none: its dictionary arrays go to ClickHouse unjoined, each value once (ClickHouse
    refuses a dictionary holding a value twice), and load the checked path's rows."""
    groups = (_Group("x", "x-1", "S"), _Group("x", "x-2", "S"), _Group("w", "w-3", None))
    items = [TransitionItem(f"{groups[i % 3].name}-{i}", "released", "waiting", f"s{i}",
                            NOW + i / 1000, groups[i % 3]) for i in range(CHUNK_MIN_ROWS + 10)]
    messages = [Message(contract.RAW, "t.raw", 0, 0, b"c1", _envelope(3, items), 1000)]
    typed, checked = _batches(messages, schemas, monkeypatch)
    assert typed.n_checked == 0 and len(typed.tables["dead_letters"]) == 0
    typed_tables, checked_tables = _tables(typed, schemas), _tables(checked, schemas)
    prefix = typed_tables["transitions"].column("prefix")
    assert pa.types.is_dictionary(prefix.type)
    for chunk in prefix.chunks:
        assert len(set(chunk.dictionary.to_pylist())) == len(chunk.dictionary)
    assert typed_tables["transitions"].to_pylist() == checked_tables["transitions"].to_pylist()
    for database in ("typed", "checked"):
        client.command(f"TRUNCATE TABLE {database}.transitions")
    assert _loaded(client, "typed", {"transitions": typed_tables["transitions"]}) == \
        _loaded(client, "checked", {"transitions": checked_tables["transitions"]})
