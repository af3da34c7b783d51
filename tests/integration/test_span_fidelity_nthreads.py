"""Thread-count figures of spans against Dask's own, on a real LocalCluster whose
workers come and go while a span runs: ``nthreads_intervals``,
``active_cpu_seconds`` and the derived ``("execute", "N/A", "idle or other spans",
"seconds")`` entry of ``cumulative_worker_metrics``, for the span and its parent,
read from ``scheduler.extensions["spans"]`` while the cluster is alive."""

from __future__ import annotations

import asyncio
import time
import uuid

import dask
import pytest
from distributed import Client, LocalCluster, span, wait

from dask_blackbox import kafka, producers
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.processors import FaustWorker, converge, env_for, processor_settings
from cluster_support import live_workers


def nap(i):
    time.sleep(0.4)
    return i


@pytest.fixture
def processor(broker, tmp_path):
    prefix = "n" + uuid.uuid4().hex[:10]
    settings = processor_settings(broker, prefix, 1, snapshot_interval="200ms")
    with dask.config.set(settings):
        asyncio.run(kafka.ensure_topics())
        worker = FaustWorker(env_for(settings), tmp_path, "nthreads").start()
        try:
            wait_for(worker.stats, 60, "the processor up")
            yield worker
        finally:
            worker.stop()


def test_workers_joining_and_leaving_while_a_span_runs(processor):
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=":0", silence_logs=50) as cluster, \
            Client(cluster) as client:
        cid = producers.attach(client)["cluster_id"]
        with span("outer"), span("scaling"):
            # Worker 2 joins and leaves without computing anything of the span: what
            # a leaving worker had not reported yet is lost to Dask (its last
            # heartbeat never comes) but not to its producer, which is no thread
            # count question.
            first = client.map(nap, range(12), workers=[0])
            wait_for(lambda: sum(f.done() for f in first) >= 2, 30, "tasks running")
            cluster.scale(3)  # workers 1 and 2 join
            client.wait_for_workers(3, timeout=30)
            second = client.map(nap, range(12, 24), workers=[0, 1])
            wait_for(lambda: sum(f.done() for f in second) >= 2, 30, "worker 1 computing")
            cluster.scale(2)  # worker 2 leaves
            wait_for(lambda: len(live_workers(client)) == 2, 30,
                     "a worker gone")
            assert not all(f.done() for f in first + second), "the span ended too soon"
            wait(first + second)
        truth, diffs = converge(client, cid)
    assert diffs == {}, diffs
    scaling = next(s for s in truth["spans"].values() if s["name"] == ["outer", "scaling"])
    outer = next(s for s in truth["spans"].values() if s["name"] == ["outer"])
    # the test did what it says: the thread count changed while the span ran
    counts = [n for _, _, n in scaling["nthreads_intervals"]]
    assert counts[0] == 2 and 6 in counts and counts[-1] == 4, scaling["nthreads_intervals"]
    assert scaling["active_cpu_seconds"] > 0
    idle = {tuple(r[:-1]): r[-1] for r in scaling["cumulative_worker_metrics"]}
    assert ("execute", "N/A", "idle or other spans", "seconds") in idle
    assert outer["active_cpu_seconds"] >= scaling["active_cpu_seconds"]
