"""The producers' buffer (producers.buffer): the room rule holds exactly, every drop
is of an item that did not fit, held items count until released, drops are reported
once, and ``accepted`` is exact while a drain takes."""

from __future__ import annotations

import random
import threading

from dask_blackbox.producers.buffer import Buffer, DropCount
from dask_blackbox.producers.rows import TRANSITION_WEIGHT, Ready, TransitionItem


def _item(rng: random.Random):
    if rng.random() < 0.5:  # a transition, as the scheduler's hot path offers it
        return TransitionItem("k", "released", "waiting", "s", 1.0)
    return Ready({"kind": "event"}, rng.choice([1, 50, TRANSITION_WEIGHT, 401, 1_000, 9_000,
                                                60_000]))


def test_the_limits_hold_exactly_and_every_drop_is_of_an_item_that_did_not_fit():
    buffer = Buffer(700, 200_000)
    rng = random.Random(15)
    held: list = []
    refused = 0
    for step in range(20_000):
        if rng.random() < 0.05 and buffer.waiting:  # a drain takes some, then releases
            taken = buffer.take(rng.randint(1, 50), rng.choice([1, 5_000, 1 << 30]))
            assert taken.items and taken.weight == sum(i.weight for i in taken.items)
            held.append(taken)
        if rng.random() < 0.04 and held:
            taken = held.pop(0)
            buffer.release(len(taken.items), taken.weight)
        item = _item(rng)
        items, weight = buffer.buffered, buffer.buffered_bytes
        if buffer.offer(item):
            assert items < 700 and weight + item.weight <= 200_000
        else:
            refused += 1
            assert items >= 700 or weight + item.weight > 200_000, (step, items, weight)
        assert buffer.buffered <= 700 and buffer.buffered_bytes <= 200_000
    assert refused > 100 and buffer.dropped_events == refused
    # held items count until released
    while held:
        taken = held.pop()
        buffer.release(len(taken.items), taken.weight)
    assert buffer.buffered == buffer.waiting


def test_drops_are_reported_once_with_their_span_of_time():
    buffer = Buffer(1, 10_000)
    assert buffer.offer(Ready({}, 10)) and not buffer.offer(Ready({}, 20))
    assert not buffer.offer(Ready({}, 30))
    first = buffer.unreported_drops()
    assert (first.events, first.bytes) == (2, 50) and first.since <= first.until
    assert buffer.unreported_drops() is None
    buffer.add_drops(DropCount(5, 500, 1.0, 2.0))  # counted outside the buffer, handed over
    assert buffer.unreported_drops() == DropCount(5, 500, 1.0, max(2.0, first.until))
    buffer.close()
    assert not buffer.offer(Ready({}, 1)) and buffer.unreported_drops().events == 1
    assert buffer.discard() == 1 and buffer.waiting == 0 and buffer.accepted == 1


def test_accepted_is_exact_while_a_drain_takes():
    buffer = Buffer(1_000_000, 1 << 40)
    n = 200_000
    for _ in range(n):
        buffer.offer(Ready({}, 1))
    seen: list[int] = []
    reading, done = threading.Event(), threading.Event()

    def read():
        while not done.is_set():
            seen.append(buffer.accepted)
            reading.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert reading.wait(30)  # the reader reads before and while the drain takes
    while buffer.waiting:
        taken = buffer.take(37, 1 << 30)
        buffer.release(len(taken.items), taken.weight)
    done.set()
    reader.join()
    assert seen and set(seen) == {n} and buffer.released == n


def test_an_idle_drains_wake_up_is_called_once_by_the_next_kept_item():
    buffer = Buffer(10, 1_000)
    calls: list[int] = []
    buffer.on_offer = lambda: calls.append(buffer.waiting)
    assert not buffer.offer(Ready({"kind": "event"}, 2_000))  # dropped: nothing to take
    assert calls == [] and buffer.on_offer is not None
    for _ in range(3):
        assert buffer.offer(Ready({"kind": "event"}, 10))
    assert calls == [1] and buffer.on_offer is None  # called once, the item already there
