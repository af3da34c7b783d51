"""One producer of a Dask process: the buffer its hooks offer to, and its drain.

A :class:`Transport` composes a :class:`~producers.buffer.Buffer` (the hooks' ``offer``) and
the :class:`~producers.sender.Sender` thread that drains it (``start``, ``close(deadline)``,
``delivered(accepted)``, ``stats()``, ``thread``). The sender runs in the Dask process: what
it does per transition (columns of the items, MessagePack) costs less than handing the items
to another process would.

Nothing is sent before the cluster's id is known; a preloaded worker or nanny learns it from
the scheduler. Transports not closed yet are flushed (within ``close-timeout``) at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import time
import weakref
from typing import Any

from dask_blackbox.producers.buffer import Buffer
from dask_blackbox.producers.rows import RowMaker
from dask_blackbox.producers.sender import Identity, Sender
from dask_blackbox.producers.settings import ProducerSettings


#: How long past ``close-timeout`` a blocking close waits for the sender's thread.
CLOSE_GRACE = 2.0  # seconds


class Transport:
    """A producer: ``offer(item)`` on the hot path, a drain in the background.

    ``worker`` is the address of the worker whose own transitions it records;
    ``scheduler``, an rpc to the scheduler to ask for the cluster's id (retrying until
    it answers) when ``cluster_id`` is not known (needs a running event loop)."""

    def __init__(self, settings: ProducerSettings, source: str, cluster_id: str | None = None,
                 cluster_name: str | None = None, worker: str | None = None,
                 scheduler: Any = None):
        self.settings = settings
        self.source = source
        self.buffer = buffer = Buffer(settings.buffer_max_events, settings.buffer_max_bytes)
        self.offer = buffer.offer  # the hot path (producers.buffer)
        self.identity = Identity(source, cluster_id, cluster_name)
        rows = RowMaker(settings.max_value_bytes, worker)
        self.drain = Sender(buffer, settings, self.identity, rows).start()
        self._learning: asyncio.Task | None = None
        if cluster_id is None and scheduler is not None:
            self._learning = asyncio.create_task(self._learn_identity(scheduler))
        _LIVE.add(self)

    def hurry(self) -> None:
        """Send what is buffered without waiting out the linger (:meth:`Drain.hurry`)."""
        self.drain.hurry()

    @property
    def producer_id(self) -> str:
        return self.identity.producer_id

    async def _learn_identity(self, scheduler: Any) -> None:
        delay = 0.1
        while True:
            try:
                info = await scheduler.identity()
                break
            except Exception:  # the scheduler may not be up yet
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.identity.cluster_name = self.identity.cluster_name or info["address"]
        self.identity.cluster_id = info["id"]

    @property
    def accepted_events(self) -> int:
        return self.buffer.accepted

    def delivered(self, accepted_events: int) -> bool:
        """Whether the first ``accepted_events`` accepted items were delivered, or will
        never be (given up): compare with an earlier :attr:`accepted_events`."""
        return self.drain.delivered(accepted_events)

    def stats(self) -> dict[str, Any]:
        """Counters, for tests, benchmarks and diagnostics."""
        buffer = self.buffer
        return {"producer_id": self.producer_id,
                "accepted_events": buffer.accepted, "buffered_events": buffer.buffered,
                "buffered_bytes": buffer.buffered_bytes, "max_events": buffer.max_items,
                "max_bytes": buffer.max_bytes, "dropped_events": buffer.dropped_events,
                "dropped_bytes": buffer.dropped_bytes, "sender": "thread", **self.drain.stats()}

    def close_deadline(self) -> float:
        """The ``time.monotonic()`` by which a close begun now has ended."""
        return time.monotonic() + self.settings.close_timeout + CLOSE_GRACE

    def begin_close(self) -> None:
        """Accept nothing more; the drain delivers what is buffered within
        ``close-timeout``, then stops."""
        _LIVE.discard(self)
        self.drain.close(time.monotonic() + self.settings.close_timeout)

    async def close(self) -> None:
        """:meth:`begin_close`, then wait for the drain without blocking the event loop."""
        if self._learning is not None:
            self._learning.cancel()
        self.begin_close()
        deadline = self.close_deadline()
        while self.drain.thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def close_blocking(self, deadline: float | None = None) -> None:
        """:meth:`close` for callers without an event loop (interpreter exit)."""
        self.begin_close()
        self.drain.thread.join(max((deadline or self.close_deadline()) - time.monotonic(), 0))


#: Transports not closed yet, flushed (bounded) at interpreter exit.
_LIVE: weakref.WeakSet[Transport] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    transports = list(_LIVE)
    for transport in transports:
        transport.begin_close()
    deadline = max((t.close_deadline() for t in transports), default=0.0)
    for transport in transports:
        transport.close_blocking(deadline)
