"""Columns of Python values to Arrow, typed after the ClickHouse columns they go to.

The sink inserts with clickhouse-connect's ``insert_arrow`` (Arrow IPC, encoded in C
and decoded by ClickHouse -- the same for chDB and an HTTP server). The Arrow type of
each column is derived from the ClickHouse column type read from ``system.columns``,
so the schema has one source of truth: the SQL. Time columns arrive as float seconds
(see sinks.tables) and become DateTime64 microseconds (or DateTime seconds) here, and
None in a text column becomes '', in bulk.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dask_blackbox.sinks.tables import FlatLists

_INTEGERS = {
    "Int8": pa.int8(), "Int16": pa.int16(), "Int32": pa.int32(), "Int64": pa.int64(),
    "UInt8": pa.uint8(), "UInt16": pa.uint16(), "UInt32": pa.uint32(), "UInt64": pa.uint64(),
}
_WRAPPER = re.compile(r"^(Nullable|LowCardinality)\((.*)\)$")


class UnsupportedType(TypeError):
    """A ClickHouse column type the sink does not know how to send."""


def _arguments(inner: str) -> list[str]:
    """Split ``K, V`` of ``Map(K, V)`` at top-level commas."""
    parts, depth, current = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        current += ch
    parts.append(current.strip())
    return parts


def _base(ch_type: str) -> str:
    while (match := _WRAPPER.match(ch_type)):
        ch_type = match.group(2)
    return ch_type


def _raw_type(ch_type: str) -> pa.DataType:
    """The Arrow type Python values are first built as (times as float seconds)."""
    base = _base(ch_type)
    if base == "String" or base.startswith("Enum"):
        return pa.string()
    if base in _INTEGERS:
        return _INTEGERS[base]
    if base == "Float64" or base.startswith("DateTime"):
        return pa.float64()
    if base == "Float32":
        return pa.float32()
    if base == "Bool":
        return pa.bool_()
    if base.startswith("Array("):
        return pa.list_(_raw_type(base[6:-1]))
    if base.startswith("Map("):
        key, value = _arguments(base[4:-1])
        if _base(value).startswith("DateTime"):
            raise UnsupportedType(f"maps of times are not supported: {ch_type}")
        return pa.map_(_raw_type(key), _raw_type(value))
    raise UnsupportedType(f"the sink cannot insert ClickHouse type {ch_type}")


def _finish(array: pa.Array, ch_type: str) -> pa.Array:
    """Turn float seconds into timestamps, wherever the type has times."""
    base = _base(ch_type)
    if base.startswith("DateTime64("):
        scale = int(_arguments(base[11:-1])[0])
        ticks = pc.round(pc.multiply(array, 10.0 ** scale))
        return pc.cast(pc.cast(ticks, pa.int64()), pa.timestamp({3: "ms", 6: "us", 9: "ns"}[scale], "UTC"))
    if base.startswith("DateTime"):
        return pc.cast(pc.cast(pc.floor(array), pa.int64()), pa.timestamp("s", "UTC"))
    if base.startswith("Array(") and _base(base[6:-1]).startswith("DateTime"):
        return pa.ListArray.from_arrays(array.offsets, _finish(array.values, base[6:-1]))
    return array


def converter(ch_type: str) -> Callable[[list], pa.Array]:
    """A function from a list of Python values (or, for an Array type, a
    :class:`~sinks.tables.FlatLists`) to an Arrow array for ``ch_type``."""
    raw = _raw_type(ch_type)
    needs_finish = "DateTime" in ch_type
    base = _base(ch_type)
    if needs_finish and base.startswith("Array(Array("):
        raise UnsupportedType(f"nested arrays of times are not supported: {ch_type}")
    element = converter(base[6:-1]) if base.startswith("Array(") else None
    # sinks.tables keeps None for '' in text columns; ClickHouse's String is not Nullable.
    empty = "" if raw == pa.string() and "Nullable(" not in ch_type else None

    def convert(values) -> pa.Array:
        if isinstance(values, FlatLists):
            offsets = np.zeros(len(values.lengths) + 1, dtype=np.int32)
            np.cumsum(np.array(values.lengths, dtype=np.int32), out=offsets[1:])
            return pa.ListArray.from_arrays(pa.array(offsets), element(values.values))
        array = pa.array(values, type=raw)
        if empty is not None and array.null_count:
            array = pc.fill_null(array, empty)
        return _finish(array, ch_type) if needs_finish else array

    return convert


class TableSchema:
    """The Arrow conversion of one table's insert columns, from ``system.columns``."""

    def __init__(self, name: str, columns: list[str], ch_types: dict[str, str]) -> None:
        missing = [c for c in [*columns, "_batch"] if c not in ch_types]
        if missing:
            raise UnsupportedType(
                f"table {name} lacks column(s) {', '.join(missing)}: is the schema migrated?"
            )
        self.name = name
        self.columns = columns
        self.converters = [converter(ch_types[c]) for c in columns]

    def table(self, columns: list) -> pa.Table:
        """The Arrow table of these columns (without ``_batch``)."""
        return pa.Table.from_arrays(
            [convert(values) for convert, values in zip(self.converters, columns, strict=True)],
            names=self.columns,
        )


def with_batch(table: pa.Table, batch_id: int) -> pa.Table:
    """``table`` with the ``_batch`` column every row of a sink batch carries."""
    return table.append_column("_batch", pa.array(np.full(table.num_rows, batch_id, dtype=np.uint64)))


def schemas(client, database: str, tables: dict[str, tuple[str, ...]]) -> dict[str, TableSchema]:
    """TableSchema per table, for the insert columns ``tables`` names."""
    rows = client.query(
        "SELECT table, name, type FROM system.columns WHERE database = {db:String}",
        parameters={"db": database},
    ).result_rows
    types: dict[str, dict[str, str]] = {}
    for table, name, ch_type in rows:
        types.setdefault(table.removesuffix("_local"), {})[name] = ch_type
    return {table: TableSchema(table, list(columns), types.get(table, {}))
            for table, columns in tables.items()}
