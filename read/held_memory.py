"""What a worker held in memory when it was removed: which keys, how many bytes, one
huge result or many small ones, from the recorded transitions.

A key is *held* by worker ``W`` from the moment it entered memory there until it left:

- it enters with the scheduler's ``X -> memory`` transition naming ``W`` (the task
  finished on ``W``; ``nbytes`` is the size ``W`` reported, Dask's ``TaskState.nbytes``),
  or with ``W``'s own ``X -> memory`` (a transfer's arrival, ``flight -> memory``;
  recorded with ``blackbox.producer.record.worker-transitions`` only);
- it leaves with the scheduler's ``memory -> Y`` (released, forgotten, erred: gone
  from every worker), with ``W``'s own ``memory -> Y``, or when the key enters memory
  anew elsewhere after leaving; and with ``W``'s removal, whose own transitions (the
  keys it alone held, released by the removal's stimulus) are not a leaving but what
  the death took with it.

So the keys held at a removal at ``T`` are those whose last such transition at or
before ``T`` (the removal's own excepted) is an entry into memory on ``W``. A key's
size is the ``nbytes`` of its latest scheduler ``X -> memory`` (a replica has the
size of its original); ``None`` ("unknown") where none was recorded: data scattered
to the worker, or a replica of a key whose computation is not in the record.
Without worker transitions, replicas a worker received are not counted
(:attr:`HeldMemory.replicas_recorded` says which). Spilled keys count as held (Dask's
``memory`` state holds them, on disk).

:func:`at_deaths` answers for many removals at once, in three statements whatever
their number (the named queries below), each aggregated in ClickHouse over the
(removal, key) pairs it concerns, a key's rows found by the transitions' sort key
(cluster_id, key, ts): no row per transition reaches Python.

Every time is float seconds since the epoch.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table

#: Keys shown per removal, largest first.
TOP_KEYS = 5
#: Prefixes shown per removal, most bytes first (the totals count every one).
TOP_PREFIXES = 10
#: The top key's share of the bytes held from which a removal is "one result".
ONE_RESULT_SHARE = 0.5

#: Each removal's number (1-based, as ClickHouse's arrays) for the rows it concerns.
_DEATHS = "range(1, length({{ws:Array(String)}}) + 1)"

#: The latest ``ts <= `` any removal's time, as the column's type.
_UNTIL = "toDateTime64(arrayMax({{ts:Array(Float64)}}), 6, 'UTC')"

#: A transition's place in its cluster's order, ``(ts, seq, idx)`` as one Int128 (the
#: microseconds above the 48 bits of seq and idx): argMax compares it as fast as a
#: number, where a tuple is compared field by field.
_ORDER = ("toInt128(toUnixTimestamp64Micro(t.ts)) * 281474976710656 "
          "+ toInt128(t.seq) * 65536 + t.idx")

#: The keys each removal's worker held at its removal: ``i`` (the removal), ``key``,
#: ``prefix``, ``size`` (its nbytes, NULL if not recorded). Each removal is paired with
#: the keys that entered memory on its own worker by its time (``pairs``), and each pair
#: reads that key's entries and leavings (the primary key's (cluster_id, key) prefix),
#: folded to the last by argMax.
_HELD = (
    "SELECT i, key, argMax(prefix, o) AS prefix, "
    "argMaxIf(nbytes, o, source = 'scheduler' AND finish = 'memory') AS size "
    "FROM (SELECT p.i AS i, t.key AS key, toString(t.prefix) AS prefix, t.nbytes AS nbytes, "
    "toString(t.source) AS source, toString(t.finish) AS finish, toString(t.worker) AS worker, "
    + _ORDER + " AS o "
    "FROM {transitions} AS t INNER JOIN (SELECT i, key FROM {transitions} "
    "ARRAY JOIN arrayFilter(i -> cluster_id = {{cs:Array(String)}}[i] "
    "AND worker = {{ws:Array(String)}}[i] AND toFloat64(ts) <= {{ts:Array(Float64)}}[i], "
    + _DEATHS + ") AS i "
    "WHERE cluster_id IN {{cs:Array(String)}} AND worker IN {{ws:Array(String)}} "
    "AND finish = 'memory' AND ts <= " + _UNTIL + " GROUP BY i, key) AS p ON t.key = p.key "
    "WHERE t.cluster_id IN {{cs:Array(String)}} AND (t.finish = 'memory' OR t.start = 'memory') "
    "AND t.ts <= " + _UNTIL + " AND t.cluster_id = {{cs:Array(String)}}[p.i] "
    "AND toFloat64(t.ts) <= {{ts:Array(Float64)}}[p.i] "
    "AND ((t.source = 'scheduler' AND t.stimulus_id != {{ss:Array(String)}}[p.i]) "
    "OR (t.source = 'worker' AND t.worker = {{ws:Array(String)}}[p.i]))) "
    "GROUP BY i, key "
    "HAVING argMax(finish = 'memory' AND worker = {{ws:Array(String)}}[i], o)"
)

#: Per removal: the keys held, their bytes (known sizes), how many of unknown size;
#: per prefix the same, most bytes first, then most keys, then by name (``{p:UInt32}``
#: prefixes); and its
#: ``{n:UInt32}`` largest keys (``(-size, key, prefix)``, -1 for an unknown size: the
#: largest of each prefix, then of those): ``i, keys, bytes, unknown, prefixes, top``.
HELD_TOTALS = (
    "SELECT i, sum(keys), sum(bytes), sum(unknown), "
    "arraySlice(arraySort(x -> (-x.3, -toInt64(x.2), x.1), "
    "groupArray((prefix, keys, bytes, unknown))), 1, {{p:UInt32}}), "
    "arraySlice(arraySort(arrayFlatten(groupArray(largest))), 1, {{n:UInt32}}) "
    "FROM (SELECT i, prefix, count() AS keys, sum(ifNull(size, 0)) AS bytes, "
    "countIf(size IS NULL) AS unknown, "
    "groupArraySorted({{n:UInt32}})((-ifNull(size, -1), key, prefix)) AS largest "
    "FROM (" + _HELD + ") GROUP BY i, prefix) GROUP BY i"
)

#: Per removal, the tasks processing on its worker when it was removed (released or
#: erred by the removal's stimulus) and each one's own result size where it reached
#: memory at some time (before or after, on any worker): ``i, key, prefix, size,
#: finished`` (how many times it reached memory; 0: never, so its size is unknown).
#: Each removal is paired with the keys its stimulus took from processing, and each
#: pair reads that key's scheduler transitions.
RUNNING_RESULTS = (
    "SELECT p.i, t.key, argMax(toString(t.prefix), t.ts), "
    "maxIf(t.nbytes, t.finish = 'memory'), countIf(t.finish = 'memory') "
    "FROM {transitions} AS t INNER JOIN (SELECT i, key FROM {transitions} "
    "ARRAY JOIN arrayFilter(i -> cluster_id = {{cs:Array(String)}}[i] "
    "AND stimulus_id = {{ss:Array(String)}}[i], " + _DEATHS + ") AS i "
    "WHERE cluster_id IN {{cs:Array(String)}} AND source = 'scheduler' AND start = 'processing' "
    "AND stimulus_id IN {{ss:Array(String)}} GROUP BY i, key) AS p ON t.key = p.key "
    "WHERE t.cluster_id IN {{cs:Array(String)}} AND t.source = 'scheduler' "
    "AND t.cluster_id = {{cs:Array(String)}}[p.i] "
    "GROUP BY p.i, t.key "
    "ORDER BY p.i, t.key"
)

#: Per removal: whether its cluster's scheduler transitions were recorded, and its
#: worker's own (worker-transitions): ``i, scheduler, worker``. Each side is a grouping
#: of the rows of one source alone (a few rows out), not of every row by (source, worker).
RECORDED = (
    "SELECT i, has((SELECT groupArray(cluster_id) FROM (SELECT toString(cluster_id) AS cluster_id "
    "FROM {transitions} WHERE cluster_id IN {{cs:Array(String)}} AND source = 'scheduler' "
    "GROUP BY cluster_id)), {{cs:Array(String)}}[i]), "
    "has((SELECT groupArray((cluster_id, worker)) FROM (SELECT toString(cluster_id) AS cluster_id, "
    "toString(worker) AS worker FROM {transitions} WHERE cluster_id IN {{cs:Array(String)}} "
    "AND source = 'worker' AND worker IN {{ws:Array(String)}} GROUP BY cluster_id, worker)), "
    "({{cs:Array(String)}}[i], {{ws:Array(String)}}[i])) "
    "FROM (SELECT arrayJoin(" + _DEATHS + ") AS i)"
)


class Removed(Protocol):
    """A worker's removal, as :class:`dask_blackbox.read.diagnosis.Death` names it."""

    cluster_id: str
    worker: str
    ts: float
    stimulus_id: str


class HeldKey(NamedTuple):
    """A key held at the removal, with its size (None: not recorded)."""

    key: str
    prefix: str
    nbytes: int | None


class PrefixHeld(NamedTuple):
    """The keys of one prefix held at the removal: how many, their known bytes, and
    how many of them are of unknown size."""

    prefix: str
    keys: int
    nbytes: int
    unknown: int


class Running(NamedTuple):
    """A task processing on the worker when it was removed, and its own result size
    where it reached memory at some time (None: it never did, or no size was
    recorded; ``finished`` says which)."""

    key: str
    prefix: str
    nbytes: int | None
    finished: int


class HeldMemory(NamedTuple):
    """What worker ``worker`` of ``cluster_id`` held when it was removed at ``ts``."""

    cluster_id: str
    worker: str
    ts: float
    #: keys held, the bytes of those whose size is known, and how many are not
    keys: int
    nbytes: int
    unknown: int
    #: the largest keys held (:data:`TOP_KEYS`), and per prefix (:data:`TOP_PREFIXES`)
    top: list[HeldKey]
    prefixes: list[PrefixHeld]
    #: the tasks processing on it at its removal, with their own result sizes
    running: list[Running]
    #: whether the scheduler's transitions were recorded (else nothing is known), and
    #: the worker's own (else replicas it received are not counted)
    recorded: bool
    replicas_recorded: bool

    @property
    def top_share(self) -> float | None:
        """The largest key's share of the bytes held (None when no size is known)."""
        if not self.top or self.top[0].nbytes is None or not self.nbytes:
            return None
        return self.top[0].nbytes / self.nbytes

    @property
    def shape(self) -> str:
        """``one result`` (the largest key holds at least :data:`ONE_RESULT_SHARE` of
        the bytes), ``many keys`` (none does), ``nothing`` (no key held), ``unknown``
        (no transition recorded, or no size known)."""
        if not self.recorded:
            return "unknown"
        if not self.keys:
            return "nothing"
        share = self.top_share
        if share is None:
            return "unknown"
        return "one result" if share >= ONE_RESULT_SHARE else "many keys"

    def lines(self) -> list[str]:
        """One or two lines: what it held (the largest keys, their prefixes), then
        the prefixes' totals and the tasks running at the removal with their own
        result sizes."""
        if not self.recorded:
            return ["held memory unknown: no task transition of this cluster was recorded"]
        if not self.keys:
            first = "held no key in memory (of the results recorded)"
        else:
            unknown = f", {self.unknown} of unknown size" if self.unknown else ""
            share = self.top_share
            shape = (f"; one result holds {share:.0%}" if self.shape == "one result"
                     else f"; many keys, the largest {share:.0%}" if share is not None else "")
            top = ", ".join(f"{k.key} {_size(k.nbytes)} (prefix {k.prefix})" for k in self.top[:3])
            first = (f"held {_size(self.nbytes)} in {self.keys} key{'s' * (self.keys != 1)}"
                     f"{unknown}{shape}: top {top}")
        if not self.replicas_recorded:
            first += " (replicas received not recorded)"
        second = []
        if len(self.prefixes) > 1:
            second.append("by prefix " + ", ".join(
                f"{p.prefix} {_size(p.nbytes)} in {p.keys}" for p in self.prefixes[:4]))
        for r in self.running:
            size = (_size(r.nbytes) if r.nbytes is not None
                    else "unknown (it never finished)" if not r.finished else "unknown (not recorded)")
            second.append(f"running {r.key}: its result {size}")
        return [first] + (["; ".join(second)] if second else [])

    def as_dict(self) -> dict:
        out = self._asdict()
        out.update(top=[k._asdict() for k in self.top], prefixes=[p._asdict() for p in self.prefixes],
                   running=[r._asdict() for r in self.running], top_share=self.top_share,
                   shape=self.shape, lines=self.lines())
        return out


def _size(n: int | None) -> str:
    from dask.utils import format_bytes

    return format_bytes(n) if n is not None else "unknown"


#: The state of clusters' transitions an answer was read from: ``cluster_id, rows,
#: last batch`` (a cluster whose rows changed since is read again).
TRANSITIONS_STATE = (
    "SELECT toString(cluster_id), count(), max(_batch) FROM {transitions} "
    "WHERE cluster_id IN {{cs:Array(String)}} GROUP BY cluster_id"
)
#: Answers kept per backend (the most recently used).
CACHED_ANSWERS = 256
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def at_deaths(backend: Backend, removals: Sequence[Removed], top: int = TOP_KEYS,
              prefixes: int = TOP_PREFIXES) -> list[HeldMemory]:
    """What each removed worker held at its removal (:class:`HeldMemory`), in
    ``removals``' order: three statements, whatever their number.

    An answer is kept per backend and removal (:data:`CACHED_ANSWERS`), with the state
    of its cluster's transitions (:data:`TRANSITIONS_STATE`: their rows and last batch)
    it was read from; asked again, it is given again while that state holds (one
    statement for all the removals), and read again once it changed."""
    if not removals:
        return []
    tables = {"transitions": table(backend, "transitions")}
    clusters = sorted({r.cluster_id for r in removals})
    _, rows = backend.query(TRANSITIONS_STATE.format(**tables), {"cs": clusters})
    state = {c: (0, 0) for c in clusters} | {c: (n, batch) for c, n, batch in rows}
    asked = [(r.cluster_id, r.worker, float(r.ts), r.stimulus_id or "", top, prefixes)
             for r in removals]
    with _cache_lock:
        kept = _cache.setdefault(backend, OrderedDict())
        found = {}
        for key in asked:
            hit = kept.get(key)
            if hit is not None and hit[0] == state[key[0]]:
                kept.move_to_end(key)
                found[key] = hit[1]
    missing = [r for r, key in zip(removals, asked) if key not in found]
    if missing:
        read = _read(backend, missing, top, prefixes)
        with _cache_lock:
            for r, h in zip(missing, read):
                key = (r.cluster_id, r.worker, float(r.ts), r.stimulus_id or "", top, prefixes)
                found[key] = h
                kept[key] = (state[r.cluster_id], h)
                kept.move_to_end(key)
            while len(kept) > CACHED_ANSWERS:
                kept.popitem(last=False)
    return [_copy(found[key]) for key in asked]


def _copy(h: HeldMemory) -> HeldMemory:
    """``h`` with lists of its own (a caller may change what it was given)."""
    return h._replace(top=list(h.top), prefixes=list(h.prefixes), running=list(h.running))


def _read(backend: Backend, removals: Sequence[Removed], top: int, prefixes: int) -> list[HeldMemory]:
    """:func:`at_deaths` read from the transitions, no answer kept."""
    tables = {"transitions": table(backend, "transitions")}
    p = {"cs": [r.cluster_id for r in removals], "ws": [r.worker for r in removals],
         "ts": [float(r.ts) for r in removals], "ss": [r.stimulus_id or "" for r in removals]}
    _, totals = backend.query(HELD_TOTALS.format(**tables), {**p, "n": top, "p": prefixes})
    _, running = backend.query(RUNNING_RESULTS.format(**tables),
                               {"cs": p["cs"], "ws": p["ws"], "ss": p["ss"]})
    _, recorded = backend.query(RECORDED.format(**tables), {"cs": p["cs"], "ws": p["ws"]})
    n = len(removals)
    total: list[tuple] = [(0, 0, 0, [])] * n
    tops: list[list[HeldKey]] = [[] for _ in range(n)]
    for i, keys, nbytes, unknown, by_prefix, largest in totals:
        total[i - 1] = (keys, nbytes, unknown, [PrefixHeld(*x) for x in by_prefix])
        tops[i - 1] = [HeldKey(key, prefix, None if v > 0 else -v) for v, key, prefix in largest]
    runs: list[list[Running]] = [[] for _ in range(n)]
    for i, key, prefix, size, finished in running:
        runs[i - 1].append(Running(key, prefix, size, finished))
    sources = [(False, False)] * n
    for i, scheduler, worker in recorded:
        sources[i - 1] = (bool(scheduler), bool(worker))
    return [HeldMemory(r.cluster_id, r.worker, float(r.ts), *total[j][:3], tops[j], total[j][3], runs[j],
                       *sources[j])
            for j, r in enumerate(removals)]


def held_memory(backend: Backend, removal: Removed, top: int = TOP_KEYS) -> HeldMemory:
    """What one removed worker held at its removal (:func:`at_deaths`)."""
    return at_deaths(backend, [removal], top)[0]


__all__ = ["HeldKey", "HeldMemory", "PrefixHeld", "Removed", "Running", "at_deaths", "held_memory",
           "HELD_TOTALS", "RUNNING_RESULTS", "RECORDED", "TRANSITIONS_STATE"]
