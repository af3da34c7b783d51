"""Crash-consistent checkpoints of per-cluster state on a changelog topic.

A cluster's state is a set of records (``cluster.ClusterState.records``). Writing
all of them at every checkpoint would cost as much as the state (a cluster may have
a million live keys), so a checkpoint writes only the records that changed (a
*delta*), and now and then the whole state (a *base*) that replaces the deltas
before it. Messages on the changelog, all keyed ``[cluster_id, ...]`` (orjson):

- ``[c, "D", epoch, i]``: part ``i`` of the delta of checkpoint ``epoch``;
- ``[c, "B", slot, i]``: part ``i`` of a base, in slot 0 or 1 (alternating, so a new
  base never overwrites the one the current marker references);
- ``[c, "M"]``: the *marker*, written last: the epoch, the base ``[slot, parts]``
  and the list of deltas ``[[epoch, parts], ...]`` that make up the state, and
  (format 3) ``inline``: the records changed since the last base or delta part,
  ``[[record_key, value], ...]``, applied after them.

A small checkpoint is the marker alone: its changes join ``inline`` (which every
marker carries whole, as the previous marker is overwritten), until ``inline``
passes :data:`INLINE_BYTES`; then those changes are written as a delta part, and
``inline`` starts empty again. So the busy clusters of a flood cost one changelog
message per checkpoint, not two.

Parts are JSON objects ``{"format": F, "records": [[record_key, value], ...]}``
(``value`` null: record deleted), at most about :data:`PART_BYTES` each so every
message stays under broker limits. ``F`` is the format of the records
(:data:`FORMAT`, see :mod:`.cluster`); the marker carries it too. A part that is a
bare JSON array was written before formats existed: format 1. A format this build
does not know (:data:`FORMATS`) is refused (:class:`UnknownFormat`), never guessed
at; recovery hands every record on with the format of its part, since one state can
mix parts of two formats (deltas written after an upgrade on top of an older base).

A crash can cut the changelog anywhere, but one cluster's messages are all in one
partition, written in order, and the marker comes last: the state a marker describes
is always complete, and messages after the last marker (an interrupted checkpoint)
are garbage, ignored and deleted on recovery. Entries a marker no longer references
(old deltas, the previous base) are deleted (tombstones) right after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import orjson

#: Target size of one part (a checkpoint message).
PART_BYTES = 256 * 1024
#: Write a base once the deltas since the last one exceed this many bytes and the
#: size of that base, or once there are this many deltas.
COMPACT_MIN_BYTES = 1024 * 1024
COMPACT_MAX_DELTAS = 200
#: Changes carried in the marker at most (encoded); past it they become a delta part.
INLINE_BYTES = 8 * 1024

Message = tuple[bytes, "bytes | None"]


#: Record formats this build reads; it writes the last one. Format 3 records are
#: format 2's; a format 3 marker may carry records inline.
FORMATS = (1, 2, 3)
FORMAT = FORMATS[-1]


class CheckpointCorrupt(RuntimeError):
    """A marker references a changelog entry that is not there."""


class UnknownFormat(RuntimeError):
    """A checkpoint written in a format this build does not know."""


def check_format(fmt) -> None:
    """Raise :class:`UnknownFormat` unless this build reads record format ``fmt``."""
    if fmt not in FORMATS:
        raise UnknownFormat(
            f"checkpoint record format {fmt!r}; this build reads formats "
            f"{', '.join(map(str, FORMATS))} (a newer dask-blackbox wrote it: run that "
            "version, or delete the processors' changelog topic to start over)")


class Recovered(NamedTuple):
    """What :meth:`Journal.recover` found for one cluster."""

    #: None: nothing was ever committed
    journal: "Journal | None"
    #: record key -> (format, value)
    records: "dict[str, tuple[int, object]] | None"
    #: the raw partition the marker names
    partition: "int | None"
    #: keys of garbage entries to delete
    garbage: list[bytes]
    #: record key -> changelog key of the part it was read from
    origins: dict[str, bytes]


def entry_key(cluster_id: str, *path) -> bytes:
    return orjson.dumps([cluster_id, *path])


def parse_key(key: bytes) -> tuple[str, tuple]:
    """``(cluster_id, path)`` of a changelog key written by this module."""
    cluster_id, *path = orjson.loads(key)
    return cluster_id, tuple(path)


_PART_HEAD = b'{"format":%d,"records":[' % FORMAT


def _parts(records: Iterable[tuple[str, object]], part_bytes: int) -> list[bytes]:
    return _pack((orjson.dumps(item) for item in records), part_bytes)


def _pack(items: Iterable[bytes], part_bytes: int) -> list[bytes]:
    """Parts of about ``part_bytes`` holding the encoded ``[record_key, value]`` items."""
    parts: list[bytes] = []
    batch: list[bytes] = []
    size = 0
    for encoded in items:
        if batch and size + len(encoded) > part_bytes:
            parts.append(_PART_HEAD + b",".join(batch) + b"]}")
            batch, size = [], 0
        batch.append(encoded)
        size += len(encoded) + 1
    if batch:
        parts.append(_PART_HEAD + b",".join(batch) + b"]}")
    return parts


def _kept(encoded: bytes) -> bytes:
    """A copy of orjson's result, to keep for long: orjson shrinks the buffer it
    wrote in place, and thousands of such results kept while others come and go
    fragment the heap (ten times their size in RSS under a flood of clusters)."""
    return bytes(memoryview(encoded))


def read_part(raw: bytes) -> tuple[int, list]:
    """``(format, [[record_key, value], ...])`` of a part (:class:`UnknownFormat` for
    a format this build does not read)."""
    part = orjson.loads(raw)
    if isinstance(part, list):
        return 1, part
    fmt = part.get("format") if isinstance(part, dict) else None
    check_format(fmt)
    return fmt, part["records"]


class Journal:
    """Where one cluster's committed state lives on the changelog."""

    def __init__(self, cluster_id: str, part_bytes: int = PART_BYTES,
                 compact_min_bytes: int = COMPACT_MIN_BYTES,
                 compact_max_deltas: int = COMPACT_MAX_DELTAS,
                 inline_bytes: int = INLINE_BYTES):
        self.cluster_id = cluster_id
        self.part_bytes = part_bytes
        self.compact_min_bytes = compact_min_bytes
        self.compact_max_deltas = compact_max_deltas
        self.inline_bytes = inline_bytes
        #: record key -> ``[record_key, value]`` encoded, of the records changed
        #: since the last base or delta part (carried in the marker): each change is
        #: encoded once, not at every checkpoint that carries it on
        self.inline: dict[str, bytes] = {}
        self._head = b"[" + orjson.dumps(cluster_id) + b","
        self._marker_key = entry_key(cluster_id, "M")
        self.epoch = 0
        #: [slot, number of parts] of the current base, or None
        self.base: list | None = None
        #: [[epoch, number of parts], ...] applied on top of the base, in order
        self.deltas: list[list] = []
        self.base_bytes = 0
        self.delta_bytes = 0

    def _key(self, kind: str, a: int, b: int) -> bytes:
        """``entry_key(cluster_id, kind, a, b)``, without encoding the id again."""
        return self._head + b'"%s",%d,%d]' % (kind.encode(), a, b)

    def commit(
        self, changes: dict[str, object], records: Callable[[], dict[str, object]],
        partition: int, base: bool = False,
    ) -> list[Message]:
        """The changelog messages of the next checkpoint, in the order to send them:
        ``changes`` inline in the marker, as a delta, or ``records()`` as a new base
        (always if ``base``)."""
        self.epoch += 1
        out: list[Message] = []
        stale: list[bytes] = []
        inline = self.inline
        for item in changes.items():
            inline[item[0]] = _kept(orjson.dumps(item))
        pending = b"[" + b",".join(inline.values()) + b"]"
        if (
            base
            or self.delta_bytes + len(pending) > max(self.base_bytes, self.compact_min_bytes)
            or len(self.deltas) >= self.compact_max_deltas
        ):
            slot = 0 if self.base is None else 1 - self.base[0]
            parts = _parts(records().items(), self.part_bytes)
            out += [(self._key("B", slot, i), p) for i, p in enumerate(parts)]
            stale += self._referenced_parts()
            self.base = [slot, len(parts)]
            self.deltas = []
            self.base_bytes = sum(map(len, parts))
            self.delta_bytes = 0
            inline.clear()
        elif len(pending) > self.inline_bytes:
            parts = _pack(inline.values(), self.part_bytes)
            out += [(self._key("D", self.epoch, i), p) for i, p in enumerate(parts)]
            self.deltas.append([self.epoch, len(parts)])
            self.delta_bytes += sum(map(len, parts))
            inline.clear()
        out.append((self._marker_key, orjson.dumps({
            "format": FORMAT, "epoch": self.epoch, "partition": partition, "base": self.base,
            "deltas": self.deltas, "base_bytes": self.base_bytes,
            "delta_bytes": self.delta_bytes,
            "inline": orjson.Fragment(pending) if inline else [],
        })))
        out += [(k, None) for k in stale]
        return out

    def _referenced_parts(self) -> list[bytes]:
        c = self.cluster_id
        keys = []
        if self.base is not None:
            slot, n = self.base
            keys += [entry_key(c, "B", slot, i) for i in range(n)]
        for epoch, n in self.deltas:
            keys += [entry_key(c, "D", epoch, i) for i in range(n)]
        return keys

    def drop(self) -> list[Message]:
        """Tombstones that delete the cluster's state from the changelog."""
        return [(k, None) for k in self._referenced_parts()] + [
            (entry_key(self.cluster_id, "M"), None)
        ]

    @classmethod
    def recover(cls, cluster_id: str, entries: dict[tuple, bytes], **kwargs) -> Recovered:
        """Rebuild from the changelog entries of one cluster (``path -> value``).

        ``kwargs`` are the journal's size settings (see ``__init__``). Without a
        marker nothing was ever committed: the journal and records are None."""
        marker_raw = entries.get(("M",))
        if marker_raw is None:
            return Recovered(None, None, None,
                             [entry_key(cluster_id, *p) for p in entries], {})
        marker = orjson.loads(marker_raw)
        check_format(marker.get("format", 1))
        j = cls(cluster_id, **kwargs)
        j.epoch = marker["epoch"]
        j.base = marker["base"]
        j.deltas = marker["deltas"]
        j.base_bytes = marker["base_bytes"]
        j.delta_bytes = marker["delta_bytes"]
        inline = marker.get("inline") or []
        referenced = {("M",)}
        records: dict[str, tuple[int, object]] = {}
        origins: dict[str, bytes] = {}

        def read(path: tuple) -> tuple[int, list]:
            referenced.add(path)
            try:
                return read_part(entries[path])
            except KeyError:
                raise CheckpointCorrupt(
                    f"cluster {cluster_id}: checkpoint {j.epoch} references changelog "
                    f"entry {list(path)}, which is missing"
                ) from None

        parts = []
        if j.base is not None:
            slot, n = j.base
            parts += [("B", slot, i) for i in range(n)]
        for epoch, n in j.deltas:
            parts += [("D", epoch, i) for i in range(n)]
        for path in parts:
            fmt, items = read(path)
            origin = entry_key(cluster_id, *path)
            for rk, value in items:
                if value is None:
                    records.pop(rk, None)
                    origins.pop(rk, None)
                else:
                    records[rk] = (fmt, value)
                    origins[rk] = origin
        fmt = marker.get("format", 1)
        for rk, value in inline:
            # carried on by the next checkpoint's marker
            j.inline[rk] = _kept(orjson.dumps([rk, value]))
            if value is None:
                records.pop(rk, None)
                origins.pop(rk, None)
            else:
                records[rk] = (fmt, value)
                origins[rk] = j._marker_key
        garbage = [entry_key(cluster_id, *p) for p in entries if p not in referenced]
        return Recovered(j, records, marker["partition"], garbage, origins)
