"""Helpers for the producers' tests: reading what the producers published, a broker
of a test's own (to kill and restart), and waiting for the scheduler's deliveries."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections import defaultdict

import dask.config

from dask_blackbox import kafka
from dask_blackbox.contract import TRANSITION, expand_events, validate_envelope
from broker_support import broker_for
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.producers.rows import Ready
from dask_blackbox.producers.transport import Transport
from dask_blackbox.testing.kafka_reader import read_json
from dask_blackbox.testing.polling import wait_for


#: Producer overrides of the fault tests: quick flushes and reconnects, no metrics.
FAST = {
    "producer.flush-interval": "20ms",
    "producer.reconnect-backoff-max": "200ms",
    "producer.metrics-interval": "1h",
}


def published(idle: float = 1.5) -> tuple[list[dict], list[dict]]:
    """(envelopes, events) on the raw topic; every envelope is validated against the
    contract, its packed events expanded, and each event gets ``_source``/``_producer``
    from its envelope."""
    envelopes = [validate_envelope(e) for e in read_json("raw", idle=idle)]
    return envelopes, events_of(envelopes)


def events_of(envelopes: list[dict]) -> list[dict]:
    """The envelopes' events, packed ones expanded, each with ``_source``/``_producer``."""
    return [{**ev, "_source": env["source"], "_producer": env["producer_id"]}
            for env in envelopes for ev in expand_events(env["events"])]


def offer_event(transport: Transport, event: dict, nbytes: int = 256) -> None:
    """Buffer a finished event mapping on ``transport``, as the plugins' hooks do."""
    transport.offer(Ready(event, nbytes))


def seqs_by_producer(envelopes: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for env in envelopes:
        out[env["producer_id"]].append(env["seq"])
    return dict(out)


def scheduler_transitions(events: list[dict]) -> dict[str, list[tuple]]:
    """Published scheduler transitions per key: [(start, finish, stimulus_id), ...]."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for ev in events:
        if ev["kind"] == TRANSITION and ev["_source"] == "scheduler":
            out[ev["key"]].append((ev["start"], ev["finish"], ev["stimulus_id"]))
    return dict(out)


def story_by_key(transition_log) -> dict[str, list[tuple]]:
    """Scheduler.transition_log (what Scheduler.story reads) per encoded key."""
    from dask_blackbox.contract import encode_key

    out: dict[str, list[tuple]] = defaultdict(list)
    for key, start, finish, _recs, stimulus_id, _ts in transition_log:
        out[encode_key(key)].append((start, finish, stimulus_id))
    return dict(out)


class OwnBroker:
    """A local broker of the test's kind (Tansu or Apache Kafka) on a port of the
    test's choosing, which the test may kill and start again. A restarted Tansu is
    empty (memory only); a restarted Kafka keeps its data (``persistent``).

    Tansu 0.6.0 acknowledges a write to a topic it does not have and drops it, so
    between a restarted Tansu's first listening and :meth:`start`'s topic creation a
    client's write can vanish: a test that must not lose anything stalls the broker
    (SIGSTOP/SIGCONT on ``local.proc``) instead of restarting it."""

    def __init__(self, kind: str = "tansu") -> None:
        self.scratch = tempfile.mkdtemp(prefix="own-broker-")
        self.local = broker_for(kind, self.scratch, free_port())
        self.port = self.local.port
        self.persistent = self.local.persistent

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, create_topics: bool = True) -> None:
        self.local.start(timeout=120)
        if create_topics:
            asyncio.run(kafka.ensure_topics())

    def kill(self) -> None:
        self.local.kill()


@contextlib.contextmanager
def own_broker(topic_prefix: str, kind: str = "tansu"):
    """An :class:`OwnBroker` (not started) with dask config pointing at it."""
    broker = OwnBroker(kind)
    try:
        with dask.config.set({
            "blackbox.kafka.bootstrap-servers": broker.address,
            "blackbox.kafka.topic-prefix": topic_prefix,
            "blackbox.kafka.partitions": 1,
        }):
            yield broker
    finally:
        broker.kill()
        shutil.rmtree(broker.scratch, ignore_errors=True)


def story_until_close(cluster, events) -> dict:
    """:func:`story_by_key` of the cluster's ``transition_log`` up to the published
    ``scheduler_close``."""
    (close,) = [e["ts"] for e in events if e.get("action") == "scheduler_close"]
    return story_by_key(t for t in cluster.scheduler.transition_log if t[5] <= close)


def scheduler_stats(client) -> dict:
    """The scheduler producer's counters, from the client."""
    return client.run_on_scheduler(scheduler_plugin_stats)


def scheduler_plugin_stats(dask_scheduler) -> dict:
    """For ``client.run_on_scheduler``: the scheduler producer's counters."""
    return dask_scheduler.plugins["dask-blackbox"].transport.stats()


def _scheduler_delivered(target: int, dask_scheduler) -> bool:
    return dask_scheduler.plugins["dask-blackbox"].transport.delivered(target)


def wait_scheduler_delivered(client, timeout: float = 60.0) -> None:
    """Wait until the scheduler producer delivered every event it had accepted when
    called (polling adds events of its own: run_function logs, so "buffer empty"
    is no criterion)."""
    target = client.run_on_scheduler(scheduler_plugin_stats)["accepted_events"]
    wait_for(lambda: client.run_on_scheduler(_scheduler_delivered, target), timeout,
             f"delivery of the scheduler's first {target} events", interval=0.05)
