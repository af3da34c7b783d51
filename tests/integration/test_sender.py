"""The sender thread of a Dask process (``producers.sender``): it publishes exactly what
Dask logged, in version 3 envelopes; its threads never preempt Dask's; ``accepted_events``
counts each item once; an item no row can be made of is counted and given up."""

from __future__ import annotations

import datetime
import os
import threading

import dask.array as da
import pytest
from distributed import Client, LocalCluster

from dask_blackbox import contract, producers
from dask_blackbox.contract import DROPS, EVENT, TRANSITION
from dask_blackbox.producers.rows import EventItem, TransitionItem
from dask_blackbox.producers.sender import THREAD_PREFIX
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import Transport
from dask_blackbox.testing.kafka_reader import read_records
from dask_blackbox.testing.polling import wait_for
from producers_support import (
    FAST, scheduler_stats, story_until_close, published, scheduler_transitions,
    seqs_by_producer, wait_scheduler_delivered,
)


def div(x, y):
    return x / y


def _log_odd_events(dask_scheduler) -> None:
    # a datetime goes out as its ISO text, a set as a list, as version 2 sent them
    dask_scheduler.log_event("sender-odd", {"at": datetime.datetime(2026, 11, 23, 12, 0)})
    dask_scheduler.log_event("sender-odd", {"set": {3, 1, 2}, "nested": [(1, "a")]})


def test_the_sender_publishes_exactly_what_dask_logged(bb_config, long_story):
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST)
        workers = set(cluster.scheduler.workers)
        # the recording's threads are SCHED_BATCH: they never preempt Dask's when they wake
        policies = {t.name: os.sched_getscheduler(t.native_id) for t in threading.enumerate()}
        ours = {name for name in policies if name.startswith(THREAD_PREFIX)}
        assert ours and {policies[name] for name in ours} == {os.SCHED_BATCH}, policies
        assert {policies[name] for name in set(policies) - ours} == {os.SCHED_OTHER}
        assert (da.ones((200, 200), chunks=20) + 1).sum().compute() == 80_000
        bad = client.submit(div, 1, 0, key="div-by-zero")
        with pytest.raises(ZeroDivisionError):
            bad.result()
        client.run_on_scheduler(_log_odd_events)
        dask_events = client.get_events("sender-odd")
        wait_scheduler_delivered(client)
        done = scheduler_stats(client)
    envelopes, events = published()
    raw = [r.value for r in read_records(contract.RAW, idle=0.5)]
    assert raw and all(contract.is_msgpack(v) for v in raw)  # version 3 only
    assert {e["schema"] for e in envelopes} == {contract.SCHEMA_VERSION}
    assert scheduler_transitions(events) == story_until_close(cluster, events)
    (erred,) = [e for e in events if e["kind"] == TRANSITION and e["key"] == "div-by-zero"
                and e["finish"] == "erred"]
    assert erred["exception"].startswith("ZeroDivisionError")
    memory = [e for e in events if e["kind"] == TRANSITION and e["finish"] == "memory"
              and e["_source"] == "scheduler"]
    assert memory and {e["worker"] for e in memory} <= workers
    assert all(isinstance(e["nbytes"], int) and e["startstops"] for e in memory)
    odd = [e for e in events if e["kind"] == EVENT and e["topic"] == "sender-odd"]
    assert [e["ts"] for e in odd] == [ts for ts, _ in dask_events]
    assert odd[0]["msg"] == {"at": "2026-11-23T12:00:00"}
    assert odd[1]["msg"] == {"set": [1, 2, 3], "nested": [[1, "a"]]}
    (seqs,) = [s for pid, s in seqs_by_producer(envelopes).items()
               if pid.startswith("scheduler-")]
    assert seqs == list(range(len(seqs)))
    assert done["dropped_events"] == 0 and done["build_errors"] == 0
    assert done["cpu_take"] > 0 and done["cpu_encode"] > 0 and done["cpu_send"] > 0
    assert not [e for e in events if e["kind"] == DROPS]


def test_accepted_events_never_counts_an_item_twice(bb_config):
    """``accepted_events`` read while the sender makes rows of a batch it took (here:
    by every item's row maker, which runs in the middle of that batch) counts each
    item once, so a wait for the delivery of what was accepted ends."""
    settings = ProducerSettings.resolve(FAST)
    transport = Transport(settings, "scheduler", cluster_id="c-accepted",
                          cluster_name="accepted")
    n = 1_000
    seen: list[int] = []
    makers = transport.drain.rows._makers
    make_event = makers[EventItem]

    def counting(item):
        seen.append(transport.accepted_events)
        return make_event(item)

    makers[EventItem] = counting
    try:
        for i in range(n):  # before the sender's first take: one batch
            transport.offer(EventItem(float(i), "t", "m", 256))
        wait_for(lambda: len(seen) == n, 60, "every item made a row")
        assert max(seen) == n
        assert transport.accepted_events == n
        wait_for(lambda: transport.delivered(max(seen)), 60, "what was accepted delivered")
    finally:
        transport.close_blocking()
    assert transport.stats()["sent_events"] == n


def test_an_item_no_row_can_be_made_of_is_counted_and_given_up(bb_config):
    """A transition item whose row cannot be made (a bug: here one whose task group has
    no names) is counted in ``build_errors`` and given up, alone: the transitions
    captured with it are delivered, the sender goes on, and a wait for the delivery of
    what was accepted ends."""
    settings = ProducerSettings.resolve(FAST)
    transport = Transport(settings, "scheduler", cluster_id="c-unmade",
                          cluster_name="unmade")
    try:
        transport.offer(TransitionItem("unmade-1", "released", "waiting", "s", 1.0, object()))
        wait_for(lambda: transport.delivered(1), 60, "the item given up")
        assert transport.stats()["build_errors"] == 1
        assert transport.drain.thread.is_alive()
        transport.offer(EventItem(2.0, "t", "after", 64))
        wait_for(lambda: transport.delivered(2), 60, "the next item delivered")
        assert transport.stats()["sent_events"] == 1
        transport.offer(TransitionItem("made-1", "released", "waiting", "s", 3.0))
        transport.offer(TransitionItem("unmade-2", "released", "waiting", "s", 3.5, object()))
        transport.offer(TransitionItem("made-2", "waiting", "processing", "s", 4.0))
        wait_for(lambda: transport.delivered(5), 60, "the captured ones delivered")
        assert transport.stats()["build_errors"] == 2
        assert transport.stats()["sent_events"] == 3
    finally:
        transport.close_blocking()
    _, events = published()
    assert [e["key"] for e in events if e["kind"] == TRANSITION
            and e["_producer"] == transport.producer_id] == ["made-1", "made-2"]
