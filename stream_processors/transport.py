"""faust's Kafka transport, with a cheaper hand-over of each fetched message.

faust's consumer hands every message it fetches to the streams through
``await self.wait_first(callback(message), self.suspend_flow.wait())``: mode's
``Service.wait_first`` makes a task of the callback, of the flow's suspension and of
the consumer's stopped and crashed events, waits for the first to end and cancels
the rest -- four tasks and their cancellation for each message, about a sixth of a
worker's CPU under a flood of small envelopes. The callback puts the message on its
stream's queue, which, unless the queue is full, ends without ever suspending.

:class:`Consumer` runs the callback's first step itself. When it ends there, the
result is what ``wait_first`` would have returned (the callback won; faust's drain
loop ignores it either way) and no task was made. When it suspends (a full queue, a
held lock), what is left of it becomes the task that races the others exactly as in
faust, so a rebalance, a stop or a crash still interrupts a callback that waits.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

from faust.transport.drivers import aiokafka as driver
from mode.services import WaitResults


@types.coroutine
def _rest(coro: Any, awaiting: Any):
    """The rest of ``coro``, which suspended on ``awaiting``: wait for it as a task
    would, then go on (a cancellation while waiting is thrown into ``coro``)."""
    try:
        yield awaiting
    except BaseException as exc:  # noqa: BLE001  (handed to the coroutine, as a task does)
        try:
            awaiting = coro.throw(exc)
        except StopIteration as stop:
            return stop.value
        return (yield from _rest(coro, awaiting))
    return (yield from coro)


async def _finish(coro: Any, awaiting: Any) -> Any:
    return await _rest(coro, awaiting)


class Consumer(driver.Consumer):
    async def wait_first(self, *coros: Any, timeout: Any = None) -> WaitResults:
        first = coros[0] if coros else None
        if timeout is not None or not asyncio.iscoroutine(first):
            return await super().wait_first(*coros, timeout=timeout)
        try:
            awaiting = first.send(None)
        except BaseException as exc:
            for other in coros[1:]:  # never started: closed, not left to warn
                if asyncio.iscoroutine(other):
                    other.close()
            if isinstance(exc, StopIteration):
                return WaitResults([first], [exc.value], False)
            raise
        return await super().wait_first(_finish(first, awaiting), *coros[1:])


class Transport(driver.Transport):
    Consumer = Consumer
