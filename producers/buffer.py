"""The bounded buffer between a Dask process's hooks and the thread that drains it:
the only place that decides whether an item fits (the *room rule*) and that counts
what did not (the drops). Hooks offer items; one drain takes them and releases them
once they are delivered or given up.

The room rule: an item of ``item.weight`` bytes is accepted when the items buffered or
held number fewer than ``max_items`` and their weights plus its own stay within
``max_bytes``. Items taken and not released yet (*held*: being packed, in an envelope
that is retried) count against both limits, so an outage can
neither grow memory past them nor let newer items in behind dropped ones. An item that
does not fit is dropped (the newest, never the oldest) and counted: events, bytes, and
the times of the first and last drop not reported yet.

Threads: :meth:`offer`, the hot path, takes no lock. Several threads may offer (Dask's
event loop, a thread that logs): ``deque.append`` is atomic, and each counter has one
writing side (``_bytes_in`` the offering threads, whose ``+=`` on an int CPython's
thread switch does not interrupt; ``_held`` and ``_bytes_out`` the drain, under
:attr:`lock`). :meth:`take`, :meth:`release` and :attr:`accepted` share that lock, so
``accepted`` is exact whenever it is read.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate, repeat, starmap
from operator import attrgetter
from typing import Any, NamedTuple


#: The weight :meth:`Buffer.take` expects of an item (a transition's), sizing the
#: chunks it takes at a time.
TAKE_WEIGHT = 200
_weight = attrgetter("weight")


class DropCount(NamedTuple):
    """Drops not reported yet: how many, their weight, when the first and the last
    happened (``time.time()``)."""

    events: int
    bytes: int
    since: float
    until: float


class Taken(NamedTuple):
    """Items a drain took: they are held until released with their count and weight."""

    items: list
    weight: int


class Buffer:
    """A bounded FIFO of items, each with a ``weight`` attribute (module docstring)."""

    __slots__ = ("_items", "max_items", "max_bytes", "_bytes_in", "_bytes_out", "_held",
                 "_taken", "lock", "dropped_events", "dropped_bytes", "_reported",
                 "_first_drop", "_last_drop", "on_offer")

    def __init__(self, max_items: int, max_bytes: int):
        self._items: deque = deque()
        self.max_items = max_items  # 0 once closed
        self.max_bytes = max_bytes
        self._bytes_in = 0  # weight offered and accepted (offering threads)
        self._bytes_out = 0  # weight released (the drain)
        self._held = 0  # items taken, not released yet (the drain)
        self._taken = 0  # items taken so far (the drain)
        #: Shared by the drain's take/release and the readers of ``accepted``.
        self.lock = threading.Lock()
        self.dropped_events = 0
        self.dropped_bytes = 0
        self._reported = (0, 0)  # (events, bytes) of the drops reported or handed on
        self._first_drop: float | None = None  # of those not reported yet
        self._last_drop = 0.0
        self.on_offer: Any = None  # an idle drain's wake-up: the next kept item calls it

    def offer(self, item: Any) -> bool:
        """Buffer ``item``, or drop and count it when it does not fit: True if kept."""
        weight = item.weight
        if (len(self._items) + self._held < self.max_items
                and self._bytes_in - self._bytes_out + weight <= self.max_bytes):
            self._bytes_in += weight
            self._items.append(item)
            if self.on_offer is not None:  # the drain is idle: wake it, once
                wake, self.on_offer = self.on_offer, None
                if wake is not None:
                    wake()
            return True
        self.drop(weight)
        return False

    def drop(self, weight: int, n: int = 1) -> None:
        """Count ``n`` items of ``weight`` bytes in all that were not kept."""
        self.dropped_events += n
        self.dropped_bytes += weight
        self._last_drop = now = time.time()
        if self._first_drop is None:
            self._first_drop = now

    def take(self, max_items: int, max_weight: int) -> Taken:
        """The oldest items, up to ``max_items`` of them and until their weight
        reaches ``max_weight`` (at least one, if any): held until :meth:`release`."""
        items: list = []
        weight = 0
        buffered = self._items
        popleft = buffered.popleft
        with self.lock:
            # In chunks of as many items as would reach max_weight at TAKE_WEIGHT each,
            # popped and weighed in C; those past max_weight go back to the front
            # (offers append at the back meanwhile).
            # Counted held before they leave the buffer: the room never errs high.
            while buffered and len(items) < max_items and weight < max_weight:
                n = min(len(buffered), max_items - len(items),
                        (max_weight - weight) // TAKE_WEIGHT + 1)
                self._held += n
                chunk = list(starmap(popleft, repeat((), n)))
                weights = list(accumulate(map(_weight, chunk), initial=weight))
                keep = min(n, bisect_left(weights, max_weight))  # those taken before it
                if keep < n:
                    buffered.extendleft(reversed(chunk[keep:]))
                    self._held -= n - keep
                    del chunk[keep:]
                items += chunk
                weight = weights[keep]
            self._taken += len(items)
        return Taken(items, weight)

    def release(self, n: int, weight: int) -> None:
        """``n`` held items of ``weight`` bytes in all were delivered or given up."""
        with self.lock:
            self._held -= n
            self._bytes_out += weight

    def close(self) -> None:
        """Accept nothing more: later offers are dropped and counted."""
        self.max_items = 0

    def discard(self) -> int:
        """Give up every item still buffered (counted taken and released): how many."""
        with self.lock:
            n = len(self._items)
            self._bytes_out += sum(item.weight for item in self._items)
            self._items.clear()
            self._taken += n
            return n

    def unreported_drops(self) -> DropCount | None:
        """The drops counted since the last call (None if none), now reported."""
        events, nbytes = self.dropped_events, self.dropped_bytes
        if events == self._reported[0]:
            return None
        since = self._first_drop if self._first_drop is not None else self._last_drop
        count = DropCount(events - self._reported[0], nbytes - self._reported[1],
                          since, self._last_drop)
        self._reported = (events, nbytes)
        self._first_drop = None
        return count

    def add_drops(self, drops: DropCount) -> None:
        """Count drops that happened elsewhere (another buffer's): reported by
        :meth:`unreported_drops` as this buffer's own."""
        self.dropped_events += drops.events
        self.dropped_bytes += drops.bytes
        if self._first_drop is None:
            self._first_drop = drops.since
        self._last_drop = max(self._last_drop, drops.until)

    @property
    def accepted(self) -> int:
        """Items accepted so far, exactly."""
        with self.lock:
            return self._taken + len(self._items)

    @property
    def buffered(self) -> int:
        """Items buffered or held."""
        return len(self._items) + self._held

    @property
    def buffered_bytes(self) -> int:
        """The weight of the items buffered or held."""
        return self._bytes_in - self._bytes_out

    @property
    def waiting(self) -> int:
        """Items buffered and not taken yet."""
        return len(self._items)

    @property
    def released(self) -> int:
        """Items taken and released so far (delivered or given up)."""
        return self._taken - self._held
