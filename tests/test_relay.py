"""The scheduler's sender in a helper process (``producers.relay``): it publishes
exactly what Dask logged, as the thread sender does; a helper that dies is replaced
and what it held is reported dropped; one that keeps dying gives way to the thread
sender; and a helper whose scheduler was SIGKILLed still delivers what it held."""

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
import orjson
import pytest
from distributed import Client, LocalCluster

from dask_blackbox import producers
from dask_blackbox.contract import DROPS, EVENT, TRANSITION, expand_events
from dask_blackbox.producers.relay import (
    HELPER_GC_THRESHOLDS, MAX_DEATHS, PIPE_BYTES, RelayTransport, _Receiver, decode_frame,
    encode_frame, open_transport,
)
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import BUSY_ENVELOPE, SENDER_THREAD_PREFIX
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
    # a datetime goes out as it is (marshal cannot hold it: the frame is pickled)
    dask_scheduler.log_event("relay-odd", {"at": datetime.datetime(2026, 11, 23, 12, 0)})
    dask_scheduler.log_event("relay-odd", {"set": {3, 1, 2}, "nested": [(1, "a")]})


def _assert_ours_yield_on_wakeup(helper: int | None) -> None:
    """The recording's threads (and every thread of the helper) are SCHED_BATCH:
    they never preempt Dask's threads when they wake; Dask's own are left as they were.
    Every thread of the helper adds ``producer.helper-niceness`` (19 by default) to
    this process's; the recording's threads here keep this process's (they take its
    GIL)."""
    policies = {t.name: os.sched_getscheduler(t.native_id) for t in threading.enumerate()}
    ours = {name for name in policies if name.startswith(SENDER_THREAD_PREFIX)}
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
            stdin = cluster.scheduler.plugins["dask-blackbox"].transport._helper.process.stdin
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


def test_a_killed_helper_is_replaced_and_what_it_held_is_reported(bb_config, long_story):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST)
        assert client.submit(inc, 1, key="before").result() == 2
        wait_scheduler_delivered(client)
        first = scheduler_stats(client)
        os.kill(first["relay_pid"], signal.SIGSTOP)  # it takes rows and sends nothing
        held = client.map(inc, range(100), key=[f"held-{i}" for i in range(100)])
        assert sum(client.gather(held)) == sum(range(1, 101))
        time.sleep(0.5)  # 25 flush intervals: the rows are in the stopped helper's pipe
        os.kill(first["relay_pid"], signal.SIGKILL)
        wait_for(lambda: scheduler_stats(client)["relay_pid"] != first["relay_pid"], 30,
                 "a new helper")
        after = client.map(inc, range(50), key=[f"after-{i}" for i in range(50)])
        assert sum(client.gather(after)) == sum(range(1, 51))
        wait_scheduler_delivered(client)
        second = scheduler_stats(client)
        del held, after
    envelopes, events = published()
    assert second["sender"] == "process"
    wait_for(lambda: not _alive(second["relay_pid"]), 30, "the helper to exit")
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


def test_a_helper_that_keeps_dying_gives_way_to_the_thread_sender(bb_config, long_story):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST)
        pids = []
        for _ in range(MAX_DEATHS):
            # killed before its first status line, a helper counts as unable to start
            wait_for(lambda: scheduler_stats(client)["relay_ready"], 30, "the helper to start")
            stats = scheduler_stats(client)
            assert stats["sender"] == "process"
            pids.append(stats["relay_pid"])
            os.kill(stats["relay_pid"], signal.SIGKILL)
            wait_for(lambda: (s := scheduler_stats(client))["sender"] == "thread"
                     or s["relay_pid"] != pids[-1], 30, "the relay to notice")
        assert scheduler_stats(client)["sender"] == "thread"
        assert client.submit(inc, 41, key="after-fallback").result() == 42
        wait_scheduler_delivered(client)
        last = scheduler_stats(client)
    envelopes, events = published()
    assert len(set(pids)) == MAX_DEATHS and not any(_alive(p) for p in pids)
    seqs = seqs_by_producer(envelopes)[last["producer_id"]]
    assert seqs == list(range(len(seqs)))
    assert scheduler_transitions(events)["after-fallback"] == (
        story_until_close(cluster, events)["after-fallback"])


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


def test_a_frame_keeps_dasks_order_and_survives_what_cannot_be_pickled():
    """A frame through encode/decode and the helper's receiver: rows come out in the
    order the Dask process buffered them; a datetime forces pickle's format; an
    unpicklable value is replaced (a record field by its text, an event by its
    sanitized form) or counted, never a crash."""
    settings = ProducerSettings.resolve({
        "kafka.bootstrap-servers": "127.0.0.1:1", "producer.close-timeout": "0s",
        "producer.sender": "process", "producer.flush-interval": "1h"})
    relay = RelayTransport(settings, "scheduler", cluster_id="c-frames", cluster_name="frames")
    try:
        names = ("inc", "inc-abc", "span-1")
        records = ["inc-1", "released", "waiting", "stim-1", 1.0,
                   ("inc", 2), "waiting", "processing", "stim-2", 2.0]
        others = [(1, (64, {"kind": "event", "ts": 1.5, "topic": "t",
                            "msg": {"at": datetime.datetime(2026, 1, 1)}})),
                  (3, (64, {"kind": "event", "ts": 3.0, "topic": "t", "msg": "last"}))]
        frame = (None, None, records, [names, names], others)
        data = relay._encoded(frame)
        assert data[:1] == b"P"  # the datetime: pickle's format
        plain = (None, None, records, [names, names], others[1:])
        assert encode_frame(plain)[:1] == b"M" and decode_frame(encode_frame(plain)) == plain

        receiver = _Receiver({"settings": settings, "source": "scheduler",
                              "producer_id": "scheduler-test", "cluster_id": None,
                              "cluster_name": None})
        receiver.apply(decode_frame(data))
        built = [item[0](item) for item in receiver.transport._buffer]
        events = expand_events(json.loads(receiver.transport._encode_events(built)))
        assert [e["ts"] for e in events] == [1.0, 1.5, 2.0, 3.0]
        assert events[0]["key"] == "inc-1" and events[2]["key"] == str(("inc", 2))
        assert events[0]["group"] == "inc-abc" and events[2]["span_id"] == "span-1"

        bad = (None, None, [Unpicklable(), "released", "waiting", "s", 4.0], [names],
               [(0, (64, {"kind": "event", "ts": 3.5, "topic": "t", "msg": Unpicklable()})),
                (2, None)])
        receiver.apply(decode_frame(relay._encoded(bad)))
        assert receiver.skipped == 1
        more = [item[0](item) for item in list(receiver.transport._buffer)[4:]]
        event, record = expand_events(json.loads(receiver.transport._encode_events(more)))
        assert event["msg"]["__type__"].endswith("Unpicklable")
        assert record["key"].startswith("<") or "Unpicklable" in record["key"]
        receiver.transport.close_blocking()
    finally:
        relay.close_blocking()


@pytest.mark.parametrize("busy_linger", [None, 60.0])
def test_after_a_busy_hand_over_the_relay_waits_busy_linger(bb_config, busy_linger):
    """The relay thread hands over every flush-interval; after a hand-over of
    BUSY_ENVELOPE items or more it waits ``busy_linger`` (LINGER by default, or
    flush-interval if longer) before the next. Close hands over the rest: every
    event delivered once, in order."""
    settings = ProducerSettings.resolve({"producer.flush-interval": "2s",
                                         "producer.sender": "process"})
    relay = RelayTransport(settings, "scheduler", cluster_id=f"c-relay-linger-{busy_linger}",
                           cluster_name="relay-linger", busy_linger=busy_linger)
    forwarded = lambda: relay._helper.forwarded if relay._helper else 0  # noqa: E731
    try:
        offer_event(relay, {"kind": "event", "ts": 0.0, "topic": "t", "msg": "first"})
        wait_for(lambda: forwarded() == 1, 30, "the first hand-over")
        for i in range(1, BUSY_ENVELOPE + 1):
            offer_event(relay, {"kind": "event", "ts": float(i), "topic": "t", "msg": "m"})
        wait_for(lambda: forwarded() == BUSY_ENVELOPE + 1, 30, "the busy hand-over")
        offer_event(relay, {"kind": "event", "ts": float(BUSY_ENVELOPE + 1), "topic": "t",
                            "msg": "after"})
        if busy_linger is None:
            wait_for(lambda: forwarded() == BUSY_ENVELOPE + 2, 30,
                     "the next hand-over, one flush-interval later")
        else:
            time.sleep(6.0)  # three flush-intervals, a tenth of busy_linger
            assert forwarded() == BUSY_ENVELOPE + 1
    finally:
        relay.close_blocking()
    assert relay.stats()["sent_events"] == BUSY_ENVELOPE + 2
    envelopes = [orjson.loads(r.value) for r in read_records("raw")]
    mine = [ev["ts"] for e in envelopes if e["producer_id"] == relay.producer_id
            for ev in e["events"]]
    assert mine == [float(i) for i in range(BUSY_ENVELOPE + 2)]


@pytest.mark.parametrize("sender", ["process", "thread"])
def test_accepted_events_never_counts_an_item_twice(bb_config, sender):
    """``accepted_events`` read while the sender takes a batch out of the buffer (here:
    by every item's builder, which runs in the middle of that batch) counts each item
    once, so a wait for the delivery of what was accepted ends. Before, the relay
    counted a whole hand-over taken before moving it, and a wait that read the count
    in between waited for items that did not exist, forever."""
    settings = ProducerSettings.resolve({**FAST, "producer.sender": sender})
    transport = open_transport(settings, "scheduler", cluster_id=f"c-accepted-{sender}",
                               cluster_name="accepted")
    n = 1_000
    seen: list[int] = []

    def build(item: tuple) -> dict:
        seen.append(transport.accepted_events)
        return {"kind": "event", "ts": float(item[2]), "topic": "t", "msg": "m"}

    try:
        for i in range(n):  # before the sender's first hand-over: one batch
            transport.offer((build, 256, i))
        wait_for(lambda: len(seen) == n, 60, "every item built")
        assert max(seen) == n
        assert transport.accepted_events == n
        wait_for(lambda: transport.delivered(max(seen)), 60, "what was accepted delivered")
    finally:
        transport.close_blocking()
    assert transport.stats()["sent_events"] == n


def test_the_helper_collects_rarely_and_delivers_every_record(bb_config):
    """What the helper allocates per record (its row, key, strings, float, buffer item)
    is acyclic and short-lived. At CPython's default thresholds (700, 10, 10) its
    collector ran 461 times for these records (session 19, with the defaults put
    back); at HELPER_GC_THRESHOLDS 14, and still every record is delivered in order."""
    settings = ProducerSettings.resolve({**FAST, "producer.sender": "process"})
    relay = RelayTransport(settings, "scheduler", cluster_id="c-relay-gc",
                           cluster_name="relay-gc")
    n = 100_000
    try:
        wait_for(lambda: relay.stats()["relay_ready"], 60, "the helper")
        before = relay.stats()["relay_gc_collections"]
        for i in range(n):
            # Dask's transition_log record: key, start, finish, recommendations,
            # stimulus_id, timestamp
            relay.push_transition((("x-gc", i), "released", "waiting", {}, f"s-{i}",
                                   float(i)), None)
        wait_for(lambda: relay.delivered(relay.accepted_events), 120, "every record")
        after = relay.stats()["relay_gc_collections"]
    finally:
        relay.close_blocking()
    assert relay.stats()["sent_events"] == n and relay.stats()["dropped_events"] == 0
    young = after[0] - before[0]
    # a few allocations a record: hundreds of collections at CPython's defaults;
    # at HELPER_GC_THRESHOLDS (20,000 allocations a young collection) a few dozen
    assert HELPER_GC_THRESHOLDS[0] >= 20_000
    assert 0 < young <= 200, (before, after)
    envelopes = [orjson.loads(r.value) for r in read_records("raw")]
    mine = [ev for e in envelopes if e["producer_id"] == relay.producer_id
            for ev in expand_events(e["events"])]
    assert [ev["key"] for ev in mine] == [str(("x-gc", i)) for i in range(n)]
