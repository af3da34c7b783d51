"""The processors' faust transport: its consumer hands a message to the streams
without a task when the hand-over does not wait, and races a hand-over that waits
against the flow's suspension exactly as faust does (stream_processors/transport.py).

Real faust consumers and asyncio queues (what faust's stream channels are); no broker
is contacted.
"""

from __future__ import annotations

import asyncio

import faust
import pytest

from dask_blackbox.stream_processors.transport import Consumer, Transport


async def _noop(*args) -> None:
    return None


def _consumer() -> Consumer:
    app = faust.App("transport-test", broker="kafka://127.0.0.1:1", store="memory://")
    return Transport(app.conf.broker_consumer, app).create_consumer(
        callback=_noop, on_partitions_revoked=_noop, on_partitions_assigned=_noop)


class Tasks:
    """Counts the tasks the running loop makes."""

    def __init__(self) -> None:
        self.made = 0

    def __call__(self, loop, coro, **kwargs):
        self.made += 1
        return asyncio.Task(coro, loop=loop, **kwargs)


def full_queue() -> asyncio.Queue:
    """A stream's queue with no room: its one place holds "m1"."""
    queue = asyncio.Queue(maxsize=1)
    queue.put_nowait("m1")
    return queue


def soon(action) -> asyncio.Future:
    """Run ``action()`` (a coroutine function) 50 ms from now."""
    async def later():
        await asyncio.sleep(0.05)
        return await action()
    return asyncio.ensure_future(later())


def run(test) -> None:
    async def main():
        tasks = Tasks()
        asyncio.get_running_loop().set_task_factory(tasks)
        await test(_consumer(), tasks)
    asyncio.run(main())


def test_the_processors_app_uses_it():
    from dask_blackbox.stream_processors.app import app
    assert isinstance(app.transport, Transport)
    assert app.transport.Consumer is Consumer


def test_a_hand_over_that_does_not_wait_makes_no_task():
    async def test(consumer, tasks):
        queue = asyncio.Queue(maxsize=2)
        got = await consumer.wait_first(queue.put("m1"), consumer.suspend_flow.wait())
        assert (got.results, got.stopped) == ([None], False)
        assert tasks.made == 0  # faust's own wait_first makes four
        assert list(queue._queue) == ["m1"]
    run(test)


def test_a_waiting_hand_over_finishes_when_the_stream_makes_room():
    async def test(consumer, tasks):
        queue = full_queue()
        reader = soon(queue.get)
        got = await consumer.wait_first(queue.put("m2"), consumer.suspend_flow.wait())
        assert await reader == "m1"
        assert got.stopped is False
        assert list(queue._queue) == ["m2"]
    run(test)


def test_a_waiting_hand_over_is_interrupted_by_a_suspended_flow():
    async def test(consumer, tasks):
        queue = full_queue()
        cancelled = []

        async def put(item):
            try:
                await queue.put(item)
            except asyncio.CancelledError:
                cancelled.append(item)
                raise

        async def rebalance():
            consumer.suspend_flow.set()

        soon(rebalance)
        await consumer.wait_first(put("m2"), consumer.suspend_flow.wait())
        await asyncio.sleep(0)
        assert cancelled == ["m2"]  # the callback saw the cancellation, as in faust
        assert list(queue._queue) == ["m1"]
        assert await queue.get() == "m1"
        queue.put_nowait("m3")  # no putter was left waiting
        assert list(queue._queue) == ["m3"]
    run(test)


def test_a_callback_error_propagates_before_and_after_waiting():
    async def test(consumer, tasks):
        async def fails_at_once():
            raise ValueError("at once")

        async def fails_later():
            await asyncio.sleep(0.01)
            raise ValueError("later")

        with pytest.raises(ValueError, match="at once"):
            await consumer.wait_first(fails_at_once(), consumer.suspend_flow.wait())
        with pytest.raises(ValueError, match="later"):
            await consumer.wait_first(fails_later(), consumer.suspend_flow.wait())
    run(test)


def test_a_stopping_consumer_interrupts_a_waiting_hand_over():
    async def test(consumer, tasks):
        queue = full_queue()

        async def stop():
            consumer._stopped.set()

        soon(stop)
        got = await consumer.wait_first(queue.put("m2"), consumer.suspend_flow.wait())
        assert got.stopped is True
        assert list(queue._queue) == ["m1"]
    run(test)
