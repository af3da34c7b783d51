"""Columns of Python values to Arrow, typed after the ClickHouse columns they go to.

The sink inserts with clickhouse-connect's ``insert_arrow`` (Arrow IPC, encoded in C
and decoded by ClickHouse -- the same for chDB and an HTTP server). The Arrow type of
each column is derived from the ClickHouse column type read from ``system.columns``,
so the schema has one source of truth: the SQL. Time columns arrive as float seconds
(see sinks.tables) and become DateTime64 microseconds (or DateTime seconds) here, and
None in a text column becomes '', in bulk. A Coded column (a transition run's prefix,
group and span id, an envelope's values in a block) going to a LowCardinality(String)
column is sent as an Arrow dictionary array, as ClickHouse stores it, so that no
string is copied once per row; every other column as plain values.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dask_blackbox.sinks.tables import Coded, FlatLists, TableData

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


class Converter:
    """Python values to an Arrow array for one ClickHouse column type, in two steps:
    :meth:`raw` builds the array from a column of Python values -- a list, a
    ``range``, a :class:`~sinks.tables.Coded`, or for an Array type a
    :class:`~sinks.tables.FlatLists` -- with times as float seconds and None left as
    null; :meth:`finish` turns a raw array (or several concatenated) into what the
    column takes: times into timestamps, null into '' where the column is a plain
    String. Calling it does both."""

    def __init__(self, ch_type: str) -> None:
        self.ch_type = ch_type
        self.raw_type = _raw_type(ch_type)
        base = _base(ch_type)
        if "DateTime" in ch_type and base.startswith("Array(Array("):
            raise UnsupportedType(f"nested arrays of times are not supported: {ch_type}")
        self.element = Converter(base[6:-1]) if base.startswith("Array(") else None
        self.timestamps = None
        if base.startswith("DateTime64("):
            scale = int(_arguments(base[11:-1])[0])
            self.timestamps = (10.0 ** scale, pa.timestamp({3: "ms", 6: "us", 9: "ns"}[scale], "UTC"))
        elif base.startswith("DateTime"):
            self.timestamps = (1.0, pa.timestamp("s", "UTC"))
        # sinks.tables keeps None for '' in text columns; ClickHouse's String is not Nullable.
        self.empty = "" if self.raw_type == pa.string() and "Nullable(" not in ch_type else None
        #: A LowCardinality(String) column takes a Coded column as an Arrow dictionary
        #: array (its values, '' for None, and each row's index), as ClickHouse stores
        #: it: no string is copied per row, here or in ClickHouse.
        self.dictionary = self.empty is not None and ch_type.startswith("LowCardinality(")

    def __call__(self, values) -> pa.Array:
        return self.finish(self.raw(values))

    def raw(self, values) -> pa.Array:
        if isinstance(values, FlatLists):
            offsets = np.zeros(len(values.lengths) + 1, dtype=np.int32)
            np.cumsum(np.array(values.lengths, dtype=np.int32), out=offsets[1:])
            return pa.ListArray.from_arrays(pa.array(offsets), self.element.raw(values.values))
        if isinstance(values, Coded):  # each distinct value converted once
            if self.dictionary:
                return _dictionary_array(values)
            return pc.take(self.raw(values.values), pa.array(values.index, pa.int32()))
        if isinstance(values, range):
            values = np.arange(values.start, values.stop, values.step)
        return pa.array(values, type=self.raw_type)

    def concat(self, arrays: list[pa.Array]) -> pa.Array:
        """Raw arrays of this column (:meth:`raw`) as one; dictionary arrays (of Coded
        columns) and plain ones are joined as one dictionary array, whose dictionary
        is the distinct values of theirs."""
        if self.dictionary and not all(type(a) is pa.DictionaryArray for a in arrays) \
                and any(type(a) is pa.DictionaryArray for a in arrays):
            arrays = [a if type(a) is pa.DictionaryArray
                      else pc.dictionary_encode(pc.fill_null(a, "") if a.null_count else a)
                      for a in arrays]
        return pa.concat_arrays(arrays)

    def finish(self, array: pa.Array) -> pa.Array:
        if type(array) is pa.DictionaryArray:  # its dictionary is finished (no null)
            return array
        if self.element is not None:
            values = self.element.finish(array.values)
            return array if values is array.values else pa.ListArray.from_arrays(array.offsets, values)
        if self.empty is not None and array.null_count:
            return pc.fill_null(array, self.empty)
        if self.timestamps is not None:
            factor, unit = self.timestamps
            if factor == 1.0:
                ticks = pc.floor(array)
            else:
                ticks = pc.round(pc.multiply(array, factor))
            return pc.cast(pc.cast(ticks, pa.int64()), unit)
        return array


def _dictionary_array(values: Coded) -> pa.DictionaryArray:
    """``values`` as a dictionary array of distinct strings ('' for None). A Coded
    column's values need not be distinct (a capture's names table holds distinct
    (prefix, group, span id) triples: two groups of one prefix repeat the prefix),
    and ClickHouse refuses a dictionary with a value twice."""
    texts = ["" if v is None else v for v in values.values]
    index = np.asarray(values.index, np.int32)
    if len(set(texts)) < len(texts):
        first: dict[str, int] = {}
        remap = np.array([first.setdefault(t, len(first)) for t in texts], np.int32)
        texts, index = list(first), remap[index]
    return pa.DictionaryArray.from_arrays(pa.array(index, pa.int32()), pa.array(texts, pa.string()))


def converter(ch_type: str) -> Converter:
    """The :class:`Converter` for ``ch_type``."""
    return Converter(ch_type)


class ArrowChunk:
    """A chunk of a :class:`~sinks.tables.TableData` already made raw Arrow arrays
    (:meth:`Converter.raw`, one per column), so that its Python values need not be
    kept. :meth:`python` gives the columns back as Python values (lists, FlatLists
    for columns of lists), as the chunk held them."""

    __slots__ = ("arrays",)

    def __init__(self, arrays: list[pa.Array]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0]) if self.arrays else 0

    def python(self) -> list:
        return [_python(array) for array in self.arrays]


def _python(array: pa.Array):
    if pa.types.is_list(array.type):
        offsets = array.offsets.to_numpy()
        values = array.values.slice(offsets[0], offsets[-1] - offsets[0])
        return FlatLists(_python(values), np.diff(offsets).tolist())
    if pa.types.is_map(array.type):
        return [None if pairs is None else dict(pairs) for pairs in array.to_pylist()]
    return array.to_pylist()


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

    def table_of(self, data: TableData) -> pa.Table:
        """The Arrow table of a table's rows (see :class:`~sinks.tables.TableData`):
        each chunk's raw arrays, concatenated, then finished once."""
        chunks = data.chunks
        if len(chunks) == 1 and type(chunks[0]) is not ArrowChunk:
            return self.table(chunks[0])
        return pa.Table.from_arrays(
            [convert.finish(convert.concat([
                chunk.arrays[i] if type(chunk) is ArrowChunk else convert.raw(chunk[i])
                for chunk in chunks]))
             for i, convert in enumerate(self.converters)],
            names=self.columns,
        )

    def chunk(self, columns: list) -> ArrowChunk:
        """A block's columns as raw Arrow arrays; raises what Arrow raises for a
        value it cannot take (ValueError, TypeError, OverflowError)."""
        return ArrowChunk([convert.raw(values)
                           for convert, values in zip(self.converters, columns, strict=True)])


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
