"""The scheduler's sender in a helper process (``producers.relay``): it publishes
exactly what Dask logged, as the thread sender does; a helper that dies gives way to
the thread sender and what it held is reported dropped; and a helper whose scheduler
was SIGKILLed still delivers what it held."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import dask
import dask.array as da
import msgspec
import orjson
import pytest
from distributed import Client, LocalCluster

from dask_blackbox import producers
from dask_blackbox.contract import DROPS, EVENT, TRANSITION, expand_events
from dask_blackbox.producers.relay import (
    HELPER_GC_THRESHOLDS, PIPE_BYTES, Frame, Receiver, _decode_frame,
    _encode_frame, encodable,
)
from dask_blackbox.producers.rows import (
    EventItem, GraphEntry, GraphItem, Ready, RowMaker, TransitionItem,
)
from dask_blackbox.producers.sender import THREAD_PREFIX, encode_rows
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import Transport
from kafka_reader import read_records
from polling import wait_for
from producers_support import (
    FAST, offer_event, scheduler_stats, story_until_close,
    own_broker, published, scheduler_transitions,
    seqs_by_producer, wait_scheduler_delivered,
)


def inc(x):
    return x + 1


def div(x, y):
    return x / y


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not alive: it has exited, its parent has not reaped it yet
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _log_odd_events(dask_scheduler) -> None:
    # a datetime goes out as its ISO text, from either sender
    dask_scheduler.log_event("relay-odd", {"at": datetime.datetime(2026, 11, 23, 12, 0)})
    dask_scheduler.log_event("relay-odd", {"set": {3, 1, 2}, "nested": [(1, "a")]})


def _assert_ours_yield_on_wakeup(helper: int | None) -> None:
    """The recording's threads (and every thread of the helper) are SCHED_BATCH:
    they never preempt Dask's threads when they wake; Dask's own are left as they were.
    Every thread of the helper adds ``producer.helper-niceness`` (19 by default) to
    this process's; the recording's threads here keep this process's (they take its
    GIL)."""
    policies = {t.name: os.sched_getscheduler(t.native_id) for t in threading.enumerate()}
    ours = {name for name in policies if name.startswith(THREAD_PREFIX)}
    assert ours and {policies[name] for name in ours} == {os.SCHED_BATCH}, policies
    assert {policies[name] for name in set(policies) - ours} == {os.SCHED_OTHER}, policies
    if helper is not None:
        tasks = os.listdir(f"/proc/{helper}/task")
        assert len(tasks) > 1  # its main thread and the sender's
        assert {os.sched_getscheduler(int(tid)) for tid in tasks} == {os.SCHED_BATCH}
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in tasks} == {
            min(own + 19, 19)}
        assert {os.getpriority(os.PRIO_PROCESS, t.native_id)
                for t in threading.enumerate()} == {own}


@pytest.mark.parametrize("sender", ["process", "thread"])
def test_both_senders_publish_exactly_what_dask_logged(bb_config, long_story, sender):
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST, **{"producer.sender": sender})
        if sender == "process":  # the relay thread starts its helper
            wait_for(lambda: scheduler_stats(client)["relay_ready"], 60, "the helper")
        stats = scheduler_stats(client)
        assert stats["sender"] == sender
        helper = stats.get("relay_pid")
        assert (helper is not None and _alive(helper)) == (sender == "process")
        workers = set(cluster.scheduler.workers)
        _assert_ours_yield_on_wakeup(helper)
        if helper is not None:  # frames the helper has not read wait in the kernel
            stdin = cluster.scheduler.plugins["dask-blackbox"].transport.drain.helper.process.stdin
            assert fcntl.fcntl(stdin.fileno(), fcntl.F_GETPIPE_SZ) == PIPE_BYTES
        assert (da.ones((200, 200), chunks=20) + 1).sum().compute() == 80_000
        bad = client.submit(div, 1, 0, key="div-by-zero")
        with pytest.raises(ZeroDivisionError):
            bad.result()
        client.run_on_scheduler(_log_odd_events)
        dask_events = client.get_events("relay-odd")
        wait_scheduler_delivered(client)
        done = scheduler_stats(client)
    if helper is not None:  # the helper ends with its scheduler
        wait_for(lambda: not _alive(helper), 30, "the helper process to exit")
    envelopes, events = published()
    assert scheduler_transitions(events) == story_until_close(cluster, events)
    (erred,) = [e for e in events if e["kind"] == TRANSITION and e["key"] == "div-by-zero"
                and e["finish"] == "erred"]
    assert erred["exception"].startswith("ZeroDivisionError")
    memory = [e for e in events if e["kind"] == TRANSITION and e["finish"] == "memory"
              and e["_source"] == "scheduler"]
    assert memory and {e["worker"] for e in memory} <= workers
    assert all(isinstance(e["nbytes"], int) and e["startstops"] for e in memory)
    odd = [e for e in events if e["kind"] == EVENT and e["topic"] == "relay-odd"]
    assert [e["ts"] for e in odd] == [ts for ts, _ in dask_events]
    assert odd[0]["msg"] == {"at": "2026-11-23T12:00:00"}
    assert odd[1]["msg"] == {"set": [1, 2, 3], "nested": [[1, "a"]]}
    (seqs,) = [s for pid, s in seqs_by_producer(envelopes).items()
               if pid.startswith("scheduler-")]
    assert seqs == list(range(len(seqs)))
    assert done["dropped_events"] == 0 and done["build_errors"] == 0
    assert not [e for e in events if e["kind"] == DROPS]


def test_a_killed_helper_gives_way_to_the_thread_sender_and_what_it_held_is_reported(
        bb_config, long_story):
    """The helper is SIGKILLed while it holds rows it has not sent: the scheduler's
    process sends from its own thread from then on, under a new producer id; what the
    helper held is counted dropped, reported, and nothing else is lost."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST)
        assert client.submit(inc, 1, key="before").result() == 2
        wait_scheduler_delivered(client)
        first = scheduler_stats(client)
        assert first["sender"] == "process"
        os.kill(first["relay_pid"], signal.SIGSTOP)  # it takes rows and sends nothing
        held = client.map(inc, range(100), key=[f"held-{i}" for i in range(100)])
        assert sum(client.gather(held)) == sum(range(1, 101))
        time.sleep(0.5)  # 25 flush intervals: the rows are in the stopped helper's pipe
        os.kill(first["relay_pid"], signal.SIGKILL)
        wait_for(lambda: scheduler_stats(client)["sender"] == "thread", 30,
                 "the thread sender")
        after = client.map(inc, range(50), key=[f"after-{i}" for i in range(50)])
        assert sum(client.gather(after)) == sum(range(1, 51))
        wait_scheduler_delivered(client)
        second = scheduler_stats(client)
        del held, after
    envelopes, events = published()
    assert not _alive(first["relay_pid"])
    assert second["producer_id"] != first["producer_id"]
    assert second["abandoned"] > 0
    assert second["dropped_events"] == second["abandoned"]
    drops = [e for e in events if e["kind"] == DROPS and e["_producer"] == second["producer_id"]]
    assert sum(d["dropped_events"] for d in drops) == second["abandoned"]
    seqs = seqs_by_producer(envelopes)
    for producer in (first["producer_id"], second["producer_id"]):
        assert seqs[producer] == list(range(len(seqs[producer])))
    story = story_until_close(cluster, events)
    got = scheduler_transitions(events)
    for key in ["before"] + [f"after-{i}" for i in range(50)]:
        assert got[key] == story[key]


ORPHAN_SCRIPT = textwrap.dedent('''
    import json, sys, time
    from distributed import Client, LocalCluster
    from dask_blackbox import producers
    from dask_blackbox.contract import encode_key

    def inc(x):
        return x + 1

    def stats(dask_scheduler):
        return dask_scheduler.plugins["dask-blackbox"].transport.stats()

    if __name__ == "__main__":
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            producers.attach(client, **{
                "producer.flush-interval": "20ms", "producer.close-timeout": "120s",
                "producer.reconnect-backoff-max": "200ms"})
            while not client.run_on_scheduler(stats)["relay_ready"]:
                time.sleep(0.05)  # the relay thread starts its helper
            print(json.dumps({"relay_pid": client.run_on_scheduler(stats)["relay_pid"]}),
                  flush=True)
            sys.stdin.readline()  # the broker is stalled now
            keys = [f"orphaned-{i}" for i in range(100)]
            client.gather(client.map(inc, range(100), key=keys))
            time.sleep(1.0)  # 50 flush intervals: every row is with the helper
            story = [[encode_key(k), s, f, sid] for k, s, f, _, sid, _ in
                     cluster.scheduler.transition_log if str(k).startswith("orphaned-")]
            print(json.dumps({"story": story}), flush=True)
            time.sleep(3600)
''')


def test_a_sigkilled_schedulers_helper_still_delivers_what_it_held(tmp_path):
    """The broker stalls (SIGSTOP: it keeps its topics, and a restarted Tansu would
    start empty and acknowledge writes to topics it has not created yet, dropping
    them), the scheduler runs 100 tasks and is SIGKILLed; the broker resumes. The
    orphaned helper delivers every transition it held, in Dask's order, and exits."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    with own_broker("o" + uuid.uuid4().hex[:8]) as broker:
        broker.start()
        env = {**os.environ,
               "DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS": broker.address,
               "DASK_BLACKBOX__KAFKA__TOPIC_PREFIX": dask.config.get("blackbox.kafka.topic-prefix"),
               "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": "1000000"}
        proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, text=True)
        stalled = broker.local.proc
        try:
            helper = json.loads(proc.stdout.readline())["relay_pid"]
            stalled.send_signal(signal.SIGSTOP)
            proc.stdin.write("\n")
            proc.stdin.flush()
            story = json.loads(proc.stdout.readline())["story"]
            proc.kill()  # SIGKILL: no close, no flush in the scheduler's process
            proc.wait(30)
            assert len(story) >= 300
            assert _alive(helper)  # it outlives its scheduler, holding the rows
        finally:
            stalled.send_signal(signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
        wait_for(lambda: not _alive(helper), 120, "the helper to deliver and exit")
        envelopes, _ = published()
    # At least once: an envelope whose acknowledgement timed out while the broker
    # was stopped may be there twice; (producer_id, seq) says which (the contract).
    once = {(env["producer_id"], env["seq"]): env for env in envelopes}
    arrived = [[e["key"], e["start"], e["finish"], e["stimulus_id"]]
               for env in once.values() for e in expand_events(env["events"])
               if e["kind"] == TRANSITION and e["key"].startswith("orphaned-")]
    assert arrived == story


class Unpicklable:
    def __reduce__(self):
        raise TypeError("not this one")


class Prefix:
    name = "inc"


class Group:
    """What a row maker reads of a scheduler's TaskGroup."""

    prefix, name, span_id = Prefix(), "inc-abc", "s1"


def test_a_frame_keeps_dasks_order_and_makes_what_msgpack_cannot_hold_encodable():
    """Items through a frame and the helper's receiver come out in the order the Dask
    process buffered them, as the events the thread sender would send: a transition
    item goes as it is with its group's names (tuple, nested and bytes keys keep their
    text; Dask's kwargs as the JSON the scheduler's hook holds), any other item as its
    row; what msgpack cannot encode (a user's object, an integer past 64 bits in a key)
    goes as the JSON the thread sender makes of it."""
    settings = ProducerSettings.resolve({
        "kafka.bootstrap-servers": "127.0.0.1:1", "producer.close-timeout": "0s",
        "producer.flush-interval": "1h"})

    carried = ("tcp://w:1", 8, "numpy.ndarray",
               [{"action": "compute", "start": 2.0, "stop": 2.5}], 140)

    def items():
        return [
            TransitionItem("inc-1", "released", "waiting", "stim-1", 1.0, Group()),
            EventItem(1.5, "t", {"at": datetime.datetime(2026, 1, 1)}, 64),
            TransitionItem(("inc", 2), "waiting", "processing", "stim-2", 2.0, Group()),
            TransitionItem(("inc", (3, b"x"), 4.5), "processing", "memory", "stim-3", 2.5,
                           Group(), None, orjson.dumps(carried)),  # as the hook holds it
            TransitionItem(b"inc-5", "processing", "erred", "stim-4", 2.6, None, None,
                           carried[:1] + (None,) * 4, {"exception_text": "ValueError: 5"}),
            GraphItem(2.7, "client-1", "stim-5", 3, 2, 1, [("inc", 2)],
                      {"retries": {("inc", 2): 2, "inc-1": 2}, "at": {"inc-1": Unpicklable()}},
                      [GraphEntry("inc-1", Group(), (), 0),
                       GraphEntry(("inc", 2), Group(), ("inc-1", ("inc", (3, b"x"), 4.5)), 3)],
                      0, 1, 500),
            Ready({"kind": "event", "ts": 3.0, "topic": "t", "msg": "last"}, 64),
        ]

    maker = RowMaker(1000)
    rows, failed = maker.rows(items())
    assert not failed
    as_json = items()[3]
    as_objects = TransitionItem(*msgspec.structs.astuple(as_json))
    as_objects.carried = carried
    assert maker.make(as_json) == maker.make(as_objects)
    expected = json.loads(encode_rows(rows, 1000))
    portable, failed = maker.rows(items(), portable=True)
    assert not failed
    assert [type(p).__name__ for p in portable] == [
        "TransitionItem", "Ready", "TransitionItem", "TransitionItem", "TransitionRow",
        "GraphItem", "Ready"]
    receiver = Receiver({"settings": settings, "source": "scheduler",
                         "producer_id": "scheduler-test", "identity": (None, None)})
    receiver.apply(_encode_frame(Frame(portable)))
    handed = receiver.buffer.take(100, 1 << 30).items
    handed_rows, failed = receiver.sender.rows.rows(handed)
    assert not failed
    assert json.loads(encode_rows(handed_rows, 1000)) == expected
    events = expand_events(expected)
    assert [e["ts"] for e in events] == [1.0, 1.5, 2.0, 2.5, 2.6, 2.7, 3.0]
    graph = events[5]
    assert graph["keys"] == [str(("inc", 2))] and graph["annotations"]["retries"] == [
        {"value": 2, "n_tasks": 2}]
    assert graph["annotations"]["at"][0]["value"]["__type__"].endswith("Unpicklable")
    assert graph["tasks"][1]["dependencies"] == ["inc-1", str(("inc", (3, b"x"), 4.5))]
    assert graph["tasks"][1]["n_dependencies"] == 3 and graph["tasks"][0]["group"] == "inc-abc"
    assert events[2]["key"] == str(("inc", 2)) and events[0]["group"] == "inc-abc"
    assert events[3]["key"] == str(("inc", (3, b"x"), 4.5)) and events[3]["thread"] == 140
    assert events[4]["key"] == str(b"inc-5") and events[4]["exception"] == "ValueError: 5"
    assert events[1]["msg"] == {"at": "2026-01-01T00:00:00"}

    odd = Ready({"kind": "event", "ts": 4.0, "topic": "t", "msg": Unpicklable()}, 64)
    with pytest.raises(TypeError):
        _encode_frame(Frame([odd]))
    fixed = encodable(odd, maker)
    (event,) = _decode_frame(_encode_frame(Frame([fixed]))).rows
    assert event.event["msg"]["__type__"].endswith("Unpicklable")
    huge, = maker.rows([TransitionItem(("inc", 1 << 70), "released", "waiting", "s", 5.0,
                                       Group())], portable=True)[0]
    with pytest.raises(OverflowError):
        _encode_frame(Frame([huge]))
    (row,) = _decode_frame(_encode_frame(Frame([encodable(huge, maker)]))).rows
    assert row.key == str(("inc", 1 << 70)) and row.group == "inc-abc"
    assert encodable(portable[0], maker) is portable[0]
    receiver.sender.close(time.monotonic())


@pytest.mark.parametrize("sender", ["process", "thread"])
def test_accepted_events_never_counts_an_item_twice(bb_config, sender):
    """``accepted_events`` read while the drain makes rows of a batch it took (here:
    by every item's row maker, which runs in the middle of that batch) counts each
    item once, so a wait for the delivery of what was accepted ends."""
    settings = ProducerSettings.resolve({**FAST, "producer.sender": sender})
    transport = Transport(settings, "scheduler", cluster_id=f"c-accepted-{sender}",
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
        for i in range(n):  # before the drain's first take: one batch
            transport.offer(EventItem(float(i), "t", "m", 256))
        wait_for(lambda: len(seen) == n, 60, "every item made a row")
        assert max(seen) == n
        assert transport.accepted_events == n
        wait_for(lambda: transport.delivered(max(seen)), 60, "what was accepted delivered")
    finally:
        transport.close_blocking()
    assert transport.stats()["sent_events"] == n


@pytest.mark.parametrize("sender", ["process", "thread"])
def test_an_item_no_row_can_be_made_of_is_counted_and_given_up(bb_config, sender):
    """An item whose row cannot be made (a bug: here a transition whose task group has
    no names) is counted in ``build_errors`` and given up; the drain goes on, and a
    wait for the delivery of what was accepted ends."""
    settings = ProducerSettings.resolve({**FAST, "producer.sender": sender})
    transport = Transport(settings, "scheduler", cluster_id=f"c-unmade-{sender}",
                          cluster_name="unmade")
    try:
        transport.offer(TransitionItem("unmade-1", "released", "waiting", "s", 1.0, object()))
        wait_for(lambda: transport.delivered(1), 60, "the item given up")
        assert transport.stats()["build_errors"] == 1
        assert transport.drain.thread.is_alive()
        transport.offer(EventItem(2.0, "t", "after", 64))
        wait_for(lambda: transport.delivered(2), 60, "the next item delivered")
        assert transport.stats()["sent_events"] == 1
    finally:
        transport.close_blocking()


def test_the_helper_collects_rarely_and_delivers_every_record(bb_config):
    """What the helper allocates per row is acyclic and short-lived (rows are not
    even tracked by the collector); it collects at HELPER_GC_THRESHOLDS, at most a few
    dozen young collections for 100,000 transitions, and still every one is delivered
    in order."""
    settings = ProducerSettings.resolve({**FAST, "producer.sender": "process"})
    transport = Transport(settings, "scheduler", cluster_id="c-relay-gc", cluster_name="relay-gc")
    n = 100_000
    try:
        wait_for(lambda: transport.stats()["relay_ready"], 60, "the helper")
        before = transport.stats()["relay_gc_collections"]
        for i in range(n):
            transport.offer(TransitionItem(("x-gc", i), "released", "waiting", f"s-{i}",
                                           float(i), None, ("x", "x-gc", "s")))
        wait_for(lambda: transport.delivered(transport.accepted_events), 120, "every record")
        after = transport.stats()["relay_gc_collections"]
    finally:
        transport.close_blocking()
    assert transport.stats()["sent_events"] == n and transport.stats()["dropped_events"] == 0
    young = after[0] - before[0]
    assert HELPER_GC_THRESHOLDS[0] >= 20_000
    assert before[0] > 0 and young <= 200, (before, after)  # counted, and rare
    envelopes = [orjson.loads(r.value) for r in read_records("raw")]
    mine = [ev for e in envelopes if e["producer_id"] == transport.producer_id
            for ev in expand_events(e["events"])]
    assert [ev["key"] for ev in mine] == [str(("x-gc", i)) for i in range(n)]
