"""A real Kafka cluster that loses brokers while Dask clusters record.

Three Apache Kafka brokers (KRaft, each broker and controller, on loopback: the
same jars as the single broker; deploy/brokers.py KafkaCluster), topics with
replication factor 3 and min.insync.replicas 2, producers with acks=all and
idempotence; the real faust processors and the real sink on it. The same workload
runs twice on real LocalClusters: once with every broker up, once while one broker
is stopped, then the active controller (no quorum, no in-sync pair: nothing can be
written), then both are brought back.

What must hold: every transition Dask logged arrives exactly once (ClickHouse's rows
of each run are Dask's own transition log, field by field: no row lost, none twice),
what the producers could not deliver meanwhile was held in their bounded buffer
(nothing reported dropped, no gap) -- envelopes a producer sent twice because an
acknowledgement was lost are loaded once (sinks/sequences.py; in the runs seen, a few
per run) --, and the faulted run's rows match the fault-free
run's: the same keys in the same final states, the same spans with Dask's task
counts, the same prefixes with the same numbers of tasks.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid

import dask
import pytest
from aiokafka import AIOKafkaProducer
from distributed import Client, LocalCluster, span

from dask_blackbox import kafka, producers
from dask_blackbox.deploy.brokers import BrokerError, KafkaCluster
from dask_blackbox.deploy.supervisor import wait_drained

from broker_support import kafka_home
from conftest import _no_kafka, pipeline_settings, subprocess_env
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.processors import FaustWorker, dask_truth
from dask_blackbox.testing.settings import dask_env
from sink_support import SinkProcess

pytestmark = pytest.mark.slow

ROUNDS, PER_ROUND = 60, 12


def inc(x):
    return x + 1


def workload(client: Client, pace: float) -> None:
    """The same keys every time: ROUNDS rounds of PER_ROUND tasks in two spans,
    ``pace`` seconds apart."""
    for r in range(ROUNDS):
        with span("cluster-test", "odd" if r % 2 else "even"):
            futures = client.map(inc, range(PER_ROUND), key=[f"inc-{r}-{i}" for i in range(PER_ROUND)])
            total = client.submit(sum, futures, key=f"sum-{r}")
            assert total.result() == sum(range(1, PER_ROUND + 1))
        del futures, total
        time.sleep(pace)


def transition_log(dask_scheduler) -> list[tuple]:
    return [(key, start, finish, stimulus_id)
            for key, start, finish, _, stimulus_id, _ in dask_scheduler.transition_log]


def record(name: str, faults=None) -> dict:
    """Run the workload on a LocalCluster with the producers attached; ``faults``
    (a function) runs in a thread meanwhile. Returns the cluster id and Dask's truth,
    read while the cluster is alive."""
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        cluster_id = producers.attach(client, cluster_name=name, **{
            "producer.flush-interval": "50ms", "producer.metrics-interval": "500ms"})["cluster_id"]
        thread = threading.Thread(target=faults, daemon=True) if faults else None
        if thread:
            thread.start()
        workload(client, pace=0.3)
        if thread:
            thread.join(180)
            assert not thread.is_alive(), "the faults did not finish"
        truth = {"transitions": client.run_on_scheduler(transition_log),
                 **client.run_on_scheduler(dask_truth)}
    return {"cluster_id": cluster_id, **truth}


@pytest.fixture(scope="module")
def three_brokers(tmp_path_factory):
    if not kafka_home():
        _no_kafka("the Kafka cluster test needs Apache Kafka's jars "
                  "(DASK_BLACKBOX__LOCAL__KAFKA_HOME; ./run-tests caches them)")
    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-cluster"), 3, home=kafka_home(),
                           heap="256MiB")
    try:
        cluster.start(timeout=120)
    except BrokerError as e:
        pytest.fail(f"the three Kafka brokers did not start: {e}")
    yield cluster
    cluster.stop(timeout=10)


async def refused(address: str, topic: str) -> bool:
    """Whether an acks=all write of one message fails within 5 seconds."""
    producer = AIOKafkaProducer(bootstrap_servers=address.split(","), acks="all",
                                request_timeout_ms=3000)
    try:
        await asyncio.wait_for(producer.start(), 5)
        await asyncio.wait_for(producer.send_and_wait(topic, b"probe"), 5)
        return False
    except Exception:
        return True
    finally:
        try:
            await asyncio.wait_for(producer.stop(), 5)
        except Exception:
            pass


# Three KRaft nodes, two outages, a cluster and the pipeline on 2 cores: bounded by its
# own waits, never by the suite's default timeout on a slow machine.
@pytest.mark.timeout(1200)
def test_rows_arrive_exactly_once_through_broker_and_controller_loss(three_brokers, tmp_path):
    cluster = three_brokers
    prefix = "k" + uuid.uuid4().hex[:8]
    settings, env = pipeline_settings(cluster.address, prefix, tmp_path / "data")
    extra = {"blackbox.kafka.replication-factor": 3, "blackbox.kafka.min-insync-replicas": 2,
             "blackbox.kafka.idempotence": True,
             "blackbox.processors.snapshot-interval": "300ms"}
    settings.update(extra)
    env.update(dask_env(extra))
    events: list[str] = []

    def faults():
        time.sleep(3)
        controller = cluster.active_controller()
        follower = next(n.node_id for n in cluster.nodes if n.node_id != controller)
        cluster.stop_node(follower)
        events.append(f"stopped broker {follower}")
        time.sleep(4)
        controller = cluster.active_controller()
        cluster.stop_node(controller)
        events.append(f"stopped the active controller {controller}")
        events.append("writes refused" if asyncio.run(refused(cluster.address, f"{prefix}.raw"))
                      else "writes still accepted")
        time.sleep(6)
        cluster.start_node(follower)
        cluster.start_node(controller)
        events.append("both back")

    # Dask keeps every transition in its log (by default the last 1,000).
    with dask.config.set({**settings, "optimization.fuse.active": False,
                          "distributed.admin.low-level-log-length": 100_000}):
        asyncio.run(kafka.ensure_topics())
        sink = SinkProcess(env)
        faust = FaustWorker(subprocess_env(env), tmp_path, name="p").start()
        try:
            sink.wait_ready()
            wait_for(lambda: faust.stats() is not None, 90, "the faust worker's web page")
            clean = record("fault-free")
            faulted = record("faulted", faults)
            assert events[:2] and events[-1] == "both back", events
            assert "writes refused" in events, events  # the outage was real
            assert wait_drained(timeout=120, settle=2.0), "the pipeline did not drain"
            backend = sink.backend()
            for run in (clean, faulted):
                # Every transition Dask logged, once: ClickHouse's rows are its log.
                _, rows = backend.query(
                    "SELECT key, start, finish, stimulus_id FROM transitions "
                    "WHERE cluster_id = {c:String} AND source = 'scheduler'",
                    {"c": run["cluster_id"]})
                recorded = collections.Counter(map(tuple, rows))
                logged = collections.Counter(run["transitions"])
                assert recorded == logged, (
                    f"{sum((logged - recorded).values())} transitions lost, "
                    f"{sum((recorded - logged).values())} loaded twice ({events})")
                _, lost = backend.query(
                    "SELECT (SELECT count() FROM gaps FINAL WHERE cluster_id = {c:String}), "
                    "(SELECT sum(dropped_events) FROM drops WHERE cluster_id = {c:String})",
                    {"c": run["cluster_id"]})
                assert tuple(lost[0]) in ((0, 0), (0, None)), lost
            # The faulted run's rows, field by field, are the fault-free run's.
            for query in (
                    # every key's final state and how many times it reached memory
                    "SELECT key, argMax(finish, (ts, seq, idx)), countIf(finish = 'memory') "
                    "FROM transitions WHERE cluster_id = {c:String} AND source = 'scheduler' "
                    "GROUP BY key ORDER BY key",
                    # spans with the processors' task counts
                    "SELECT arrayStringConcat(name, '/'), states['memory'], done "
                    "FROM span_state FINAL WHERE cluster_id = {c:String} ORDER BY 1",
                    # prefixes, from the processors' partials
                    "SELECT prefix, sum(finished['memory']), sum(n_erred) FROM prefix_stats FINAL "
                    "WHERE cluster_id = {c:String} GROUP BY prefix ORDER BY prefix",
                    # what each kind of table holds
                    "SELECT (SELECT count() FROM graphs WHERE cluster_id = {c:String}), "
                    "(SELECT count() FROM spans WHERE cluster_id = {c:String}), "
                    "(SELECT countIf(action = 'worker_added') FROM lifecycle "
                    "WHERE cluster_id = {c:String})"):
                answers = [backend.query(query, {"c": run["cluster_id"]})[1]
                           for run in (clean, faulted)]
                assert answers[0] == answers[1] and answers[0], (query, answers)
            # ...and the spans are Dask's own.
            for run in (clean, faulted):
                _, rows = backend.query(
                    "SELECT arrayStringConcat(name, '/'), states, done FROM span_state FINAL "
                    "WHERE cluster_id = {c:String}", {"c": run["cluster_id"]})
                recorded = {name: ({k: v for k, v in states.items() if v}, done)
                            for name, states, done in rows}
                assert recorded == {"/".join(s["name"]): (s["states"], s["done"])
                                    for s in run["spans"].values()}
        finally:
            faust.stop()
            sink.terminate()
