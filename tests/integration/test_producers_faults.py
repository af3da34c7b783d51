"""Broker outages and a killed scheduler: Dask never notices, nothing acknowledged or
buffered is lost, and what is dropped is counted and reported.

Each outage test runs its own Tansu broker on a port of its choosing so it can kill
and restart it; Tansu is memory-only, so a restarted broker is empty and the test
recreates the topics (the producer never creates topics, see producers.sender).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import subprocess
import threading
import time
import uuid

import dask.array as da
import pytest
from distributed import Client, LocalCluster

from dask_blackbox import producers
from conftest import subprocess_env
from dask_blackbox.contract import (
    DROPS, EVENT, GRAPH, LOG, TRANSITION, WORKER_METRICS, encode_key,
)
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.producers.buffer import DropCount
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import Transport
from dask_blackbox.testing.polling import wait_for
from producers_support import (
    FAST, events_of, offer_event, scheduler_stats, story_until_close,
    own_broker, published, scheduler_transitions,
    seqs_by_producer, wait_scheduler_delivered,
)


def inc(x):
    return x + 1


def _no_plugin_failures(events) -> None:
    assert not [e for e in events if e["kind"] == LOG and "Plugin failed" in e["message"]]


@pytest.mark.both_brokers
def test_broker_down_at_start_then_up_loses_nothing(long_story, broker_kind):
    with own_broker("f" + uuid.uuid4().hex[:8], broker_kind) as broker:
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            producers.attach(client, **FAST)
            assert (da.ones((60, 60), chunks=10) + 1).sum().compute() == 7200
            stats = scheduler_stats(client)
            assert stats["sent_envelopes"] == 0 and stats["buffered_events"] > 100
            assert stats["dropped_events"] == 0
            broker.start()
            wait_scheduler_delivered(client)
        envelopes, events = published()
    (scheduler_seqs,) = [s for pid, s in seqs_by_producer(envelopes).items()
                         if pid.startswith("scheduler-")]
    assert scheduler_seqs == list(range(len(scheduler_seqs)))
    assert scheduler_transitions(events) == story_until_close(cluster, events)
    assert not [e for e in events if e["kind"] == DROPS]
    _no_plugin_failures(events)


def test_full_buffer_drops_newest_counts_and_reports(long_story):
    limits = {"producer.buffer-max-events": 150, "producer.buffer-max-bytes": "1MiB"}
    with own_broker("f" + uuid.uuid4().hex[:8]) as broker:
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            producers.attach(client, **FAST, **limits)
            future = client.compute((da.ones((80, 80), chunks=10) + 1).sum())
            samples = []
            while not future.done():
                samples.append(scheduler_stats(client))
            assert future.result() == 12800
            samples.append(before := scheduler_stats(client))
            for s in samples:  # the buffer never holds more than configured
                assert s["buffered_events"] <= 150 and s["buffered_bytes"] <= 2**20
            assert before["dropped_events"] > 0 and before["sent_envelopes"] == 0
            log_before = list(cluster.scheduler.transition_log)
            broker.start()
            wait_scheduler_delivered(client)
        envelopes, events = published()
    (seqs,) = [s for pid, s in seqs_by_producer(envelopes).items() if pid.startswith("scheduler-")]
    assert seqs == list(range(len(seqs)))  # drops are counted, they are not gaps
    # every drop is reported: a report holds the drops since the previous one, and
    # those the hot path counted after the sender's last take before the broker
    # came back go out in a later report
    drops = [e for e in events if e["kind"] == DROPS and e["_source"] == "scheduler"]
    assert drops and sum(d["dropped_events"] for d in drops) >= before["dropped_events"]
    assert all(d["dropped_events"] > 0 and d["dropped_bytes"] > 0
               and d["since"] <= d["until"] for d in drops)
    # the newest were dropped: of the transitions logged during the outage, those
    # published are the oldest ones, in Dask's order, without holes
    outage_end = log_before[-1][5]
    kept = [(e["key"], e["start"], e["finish"], e["stimulus_id"], e["ts"]) for e in events
            if e["kind"] == TRANSITION and e["_source"] == "scheduler" and e["ts"] <= outage_end]
    logged = [(encode_key(k), s, f, sid, ts) for k, s, f, _, sid, ts in log_before]
    assert kept and kept == logged[:len(kept)] and len(kept) < len(logged)
    _no_plugin_failures(events)


def test_drops_learned_after_the_last_delivery_go_out_alone():
    """A sender may learn of drops with nothing else to send, maybe in a take that
    holds nothing else: drops counted after the last delivery, with nothing to send behind them, are reported
    on their own, before close."""
    with own_broker("f" + uuid.uuid4().hex[:8]) as broker:
        broker.start()
        transport = Transport(ProducerSettings.resolve(FAST), "scheduler",
                              cluster_id="c-drops", cluster_name="x")
        offer_event(transport, {"kind": EVENT, "ts": 1.0, "topic": "t", "msg": "first"})
        sent = lambda: transport.stats()["sent_envelopes"]  # noqa: E731
        wait_for(lambda: sent() == 1, 60, "the first delivery")
        transport.buffer.add_drops(DropCount(23, 6_900, 2.0, 3.0))
        wait_for(lambda: sent() == 2, 60, "the report's delivery")
        asyncio.run(transport.close())
        envelopes, events = published()
    stats = transport.stats()
    assert stats["lost_at_close"] == 0 and stats["sent_drop_reports"] == 1
    assert [(e["dropped_events"], e["dropped_bytes"], e["since"], e["until"])
            for e in events if e["kind"] == DROPS] == [(23, 6_900, 2.0, 3.0)]
    assert [e["seq"] for e in envelopes] == [0, 1]


@pytest.mark.both_brokers
def test_broker_killed_mid_run_and_restarted(long_story, broker_kind):
    with own_broker("f" + uuid.uuid4().hex[:8], broker_kind) as broker:
        broker.start()
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            producers.attach(client, **FAST)
            assert client.submit(inc, 1, key="before-outage").result() == 2
            wait_scheduler_delivered(client)
            broker.kill()
            during = client.map(inc, range(50), key=[f"during-outage-{i}" for i in range(50)])
            assert sum(client.gather(during)) == sum(range(1, 51))
            broker.start()  # empty: topics are created again
            wait_scheduler_delivered(client)
            del during
            assert client.submit(inc, 2, key="after-outage").result() == 3
        envelopes, _ = published()  # what the broker holds after the restart
    # An envelope the killed broker had stored but not acknowledged is sent again, same
    # seq and events (the sender's delivery semantics): the same envelope twice, which
    # the sink loads once. Compare what is left once such copies are set aside.
    copies: dict[tuple, dict] = {}
    for envelope in envelopes:
        first = copies.setdefault((envelope["producer_id"], envelope["seq"]), envelope)
        assert first["events"] == envelope["events"], "two envelopes with one seq"
    envelopes = list(copies.values())
    (seqs,) = [s for pid, s in seqs_by_producer(envelopes).items() if pid.startswith("scheduler-")]
    if broker.persistent:  # Kafka kept what it had acknowledged: nothing is missing
        assert seqs == list(range(len(seqs)))
    else:  # a restarted Tansu is empty: what it holds is a run of seqs from then on
        assert seqs[0] > 0 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = events_of(envelopes)
    story = story_until_close(cluster, events)
    got = scheduler_transitions(events)
    for key in [f"during-outage-{i}" for i in range(50)] + ["after-outage"]:
        assert got[key] == story[key]
    assert not [e for e in events if e["kind"] == DROPS]
    _no_plugin_failures(events)


def _inc_slowly(x):
    time.sleep(0.002)
    return x + 1


def _logged_transitions(dask_scheduler) -> list:
    return [(encode_key(k), s, f, sid, ts) for k, s, f, _, sid, ts in dask_scheduler.transition_log]


def test_sigkilled_scheduler_loses_at_most_its_last_flush(bb_config):
    """A preloaded scheduler process is SIGKILLed while busy: every transition it had
    logged 2 s earlier (40 flush intervals) had arrived; a preloaded worker learned
    the cluster id from the scheduler."""
    port = free_port()
    env = subprocess_env({
        **bb_config,
        "DASK_BLACKBOX__PRODUCER__FLUSH_INTERVAL": "50ms",
        "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": "1000000",
        # the functions this test runs on the cluster live in this module, which
        # imports the support modules one folder up
        "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                       os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]),
    })
    address = f"tcp://127.0.0.1:{port}"
    procs = [subprocess.Popen(
        ["dask", "scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--no-dashboard", "--preload", "dask_blackbox.producers.scheduler"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )]
    client = None
    try:
        procs.append(subprocess.Popen(
            ["dask", "worker", address, "--nthreads", "1", "--no-nanny",
             "--no-dashboard", "--preload", "dask_blackbox.producers.worker"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
        client = Client(address, timeout=60)
        client.wait_for_workers(1, timeout=60)
        cluster_id = client.scheduler_info()["id"]
        busy = client.map(_inc_slowly, range(3000))  # keeps it busy through the kill
        wait_for(lambda: sum(f.done() for f in busy) > 100, 30, "work under way", interval=0.05)
        snapshot = client.run_on_scheduler(_logged_transitions)
        time.sleep(2.0)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(30)
    finally:
        for proc in procs[1:]:
            proc.kill()
            proc.wait(30)
        procs[0].kill()
        if client is not None:
            client.close(timeout=5)
    envelopes, events = published()
    arrived = {(e["key"], e["start"], e["finish"], e["stimulus_id"], e["ts"])
               for e in events if e["kind"] == TRANSITION and e["_source"] == "scheduler"}
    assert len(snapshot) > 300
    assert set(snapshot) <= arrived
    assert len(arrived) > len(snapshot)  # and it kept publishing after the snapshot
    assert {e["cluster_id"] for e in envelopes} == {cluster_id}
    assert any(e["kind"] == WORKER_METRICS for e in events if e["_source"] == "worker")
    assert "scheduler_close" not in {e.get("action") for e in events}


# ------------------------------------------------------- users' hostile events


class RaisingOffset(datetime.tzinfo):
    """A tzinfo whose every method raises: orjson used to crash (SIGSEGV) on it."""

    def utcoffset(self, dt):
        raise RuntimeError("utcoffset refused")

    def dst(self, dt):
        raise RuntimeError("dst refused")

    def tzname(self, dt):
        raise RuntimeError("tzname refused")


class ClassRaises:
    """isinstance() on this raises (it reads __class__ when the type does not match)."""

    @property
    def __class__(self):
        raise RuntimeError("__class__ refused")


class SlowAttributes:
    """Every missing attribute takes a while; records the threads that asked."""

    askers: list[int] = []

    def __getattr__(self, name):
        SlowAttributes.askers.append(threading.get_ident())
        time.sleep(0.5)
        raise AttributeError(name)


class ItemsRaise(dict):
    def items(self):
        raise RuntimeError("items refused")

    def __iter__(self):
        raise RuntimeError("iter refused")


def _loop_thread(dask_scheduler) -> int:
    return threading.get_ident()


def _alive(dask_scheduler) -> str:
    return dask_scheduler.status.name


_BAD_TIME = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=RaisingOffset())


def _hostile_cases() -> dict:
    return {
        "bad-datetime": _BAD_TIME,
        "bad-datetime-nested": {"when": _BAD_TIME, "n": 1},
        "bad-time": datetime.time(7, 8, 9, tzinfo=RaisingOffset()),
        "class-raises": ClassRaises(),
        "class-raises-nested": [1, ClassRaises()],
        "slow-attributes": SlowAttributes(),
        "slow-attributes-nested": {"x": SlowAttributes()},
        "dict-subclass": ItemsRaise(a=1),
        "aware-utc": datetime.datetime(2024, 5, 6, tzinfo=datetime.timezone.utc),
    }


def _log_hostile_cases(dask_scheduler) -> list[str]:
    """User code on the scheduler (a plugin, a preload, run_on_scheduler) logging
    objects Client.log_event would refuse; runs on the event loop."""
    cases = _hostile_cases()
    for topic, msg in cases.items():
        dask_scheduler.log_event(topic, msg)
    return sorted(cases)


def test_hostile_user_events_cannot_hurt_the_scheduler(bb_config):
    """log_event with objects that crash the JSON encoder (a tzinfo whose utcoffset
    raises), raise on __class__ or stall on attribute access, from user code on the
    scheduler and, for what pickles, from a client (ToPickle, over TCP): the scheduler keeps running,
    none of their code runs on its event loop, and each event is recorded,
    described."""
    from distributed.protocol.serialize import ToPickle

    SlowAttributes.askers.clear()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp",
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST)
        cases = client.run_on_scheduler(_log_hostile_cases)
        client.log_event("client-bad-datetime", ToPickle(_BAD_TIME))
        assert client.submit(inc, 41, key="after-hostile").result() == 42
        assert client.run_on_scheduler(_alive) == "running"
        loop_thread = client.run_on_scheduler(_loop_thread)
        wait_scheduler_delivered(client)
        stats = scheduler_stats(client)
    assert loop_thread not in SlowAttributes.askers
    assert stats["build_errors"] == 0
    envelopes, events = published()
    msgs = {e["topic"]: e["msg"] for e in events if e["kind"] == EVENT}
    assert set(cases) <= set(msgs)
    described = {"__type__": "datetime.datetime", "__size__": msgs["bad-datetime"]["__size__"],
                 "__text__": "2024-05-06T07:08:09"}
    assert msgs["bad-datetime"] == described
    assert msgs["bad-datetime-nested"] == {"when": described, "n": 1}
    assert msgs["client-bad-datetime"] == described
    assert msgs["bad-time"]["__type__"] == "datetime.time"
    assert msgs["bad-time"]["__text__"] == "07:08:09"
    assert msgs["class-raises"]["__type__"].endswith("ClassRaises")
    assert msgs["class-raises-nested"][0] == 1
    assert msgs["class-raises-nested"][1]["__type__"].endswith("ClassRaises")
    assert msgs["slow-attributes"]["__type__"].endswith("SlowAttributes")
    assert msgs["slow-attributes-nested"]["x"]["__type__"].endswith("SlowAttributes")
    assert msgs["dict-subclass"] == {"a": 1}  # read as the dict it is, not its items()
    assert msgs["aware-utc"] == "2024-05-06T00:00:00+00:00"
    assert scheduler_transitions(events)["after-hostile"]
    _no_plugin_failures(events)


def test_graph_max_tasks_zero_sends_counts_without_tasks(bb_config):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST, **{"producer.graph-max-tasks": 0})
        assert sum(client.gather(client.map(inc, range(7), key=[f"g-{i}" for i in range(7)]))) == 28
        wait_scheduler_delivered(client)
    _, events = published()
    (graph,) = [e for e in events if e["kind"] == GRAPH]
    assert graph["tasks"] == [] and graph["keys"] == []
    assert graph["n_tasks"] == 7 and graph["n_keys"] == 7
