"""One recorded run that the export, trace-file, Grafana and metrics tests share (a
session fixture in conftest: ``recorded_run``): a real LocalCluster (worker
processes, two threads each) with the producers attached, the real faust processors
and the real sink on the session's Tansu broker, topics of its own. The run has
nested spans, transfers between workers, a task that erred and one that erred
because of it, log records, and a worker SIGKILLed while it ran two tasks (a death
with tasks lost). When the fixture yields, the cluster is closed and the pipeline has
drained: ClickHouse holds the whole run, and the topics still hold every message
(the continuous exporter's tests read them from the start)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid

import dask
import dask.array as da
from distributed import Client, LocalCluster, span, wait

from dask_blackbox import kafka, producers
from dask_blackbox.deploy.supervisor import LocalPipeline, wait_drained
from dask_blackbox.read import backends

from conftest import pipeline_settings, subprocess_env
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.processors import FaustWorker
from sink_support import SinkProcess, wait_loaded
from cluster_support import live_workers

CLUSTER_NAME = "export-run"


@contextlib.contextmanager
def recorded_through_pipeline(broker: str, config: dict, record, processors: int = 0):
    """Under ``config``: the local pipeline (``LocalPipeline`` on ``broker``: the sink on
    chDB, ``processors`` faust workers) started, ``record()`` run, and everything it
    sent loaded; yields the running sink's backend, and stops the pipeline on exit."""
    with dask.config.set(config):
        pipeline = LocalPipeline(kafka=broker, processors=processors)
        pipeline.start(progress=lambda m: None)
        try:
            record()
            wait_loaded()
            yield backends.running_sink()
        finally:
            pipeline.stop(drain_timeout=0)


def worker_env(bb_env: dict, *paths) -> dict:
    """This process's environment with the pipeline's ``bb_env``, and ``paths`` first on
    PYTHONPATH: for worker processes started apart, which unpickle the tests' tasks."""
    return {**os.environ, **bb_env, "PYTHONPATH": os.pathsep.join(
        [*map(str, paths), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def inc(x):
    return x + 1


def div(x, y):
    return x / y


def hold(flag: str, x):
    """Runs until the file ``flag`` is gone (the test kills the worker first)."""
    logging.getLogger("distributed.worker").warning("task %d holds its worker", x)
    while os.path.exists(flag):
        time.sleep(0.05)
    return x


def record(broker: str, workdir) -> dict:
    """Record the run; returns its settings (``settings``, ``env``), the cluster id,
    the sink and faust processes (still running) and the number of erred tasks."""
    prefix = "x" + uuid.uuid4().hex[:10]
    settings, env = pipeline_settings(broker, prefix, workdir / "data")
    env = {**env, "DASK_BLACKBOX__SINK__METRICS_PORT": "0",
           "DASK_BLACKBOX__PROCESSORS__SNAPSHOT_INTERVAL": "200ms"}
    out: dict = {"settings": settings, "env": env, "prefix": prefix}
    with dask.config.set({**settings, "optimization.fuse.active": False}):
        asyncio.run(kafka.ensure_topics())
        sink = SinkProcess(env)
        faust = FaustWorker(subprocess_env(env), workdir, name="p").start()
        out.update(sink=sink, faust=faust)
        sink.wait_ready()
        wait_for(lambda: faust.stats() is not None, 60, "the faust worker's web page")
        flag = workdir / "holding"
        flag.write_text("")
        with LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            identity = producers.attach(client, cluster_name=CLUSTER_NAME, **{
                "producer.flush-interval": "20ms", "producer.metrics-interval": "200ms"})
            out["cluster_id"] = identity["cluster_id"]
            with span("etl"):
                with span("load"):
                    x = client.persist(da.random.random((120, 120), chunks=20))
                    wait(x)
                with span("reduce"):
                    (x + x.T).sum().compute()
            client.gather(client.map(inc, range(12)))
            with span("failing"):
                bad = client.submit(div, 1, 0, key="div-bad")
                after = client.submit(inc, bad, key="inc-after-bad")
                wait([bad, after])
            doomed = sorted(live_workers(client))[0]
            pid = client.run(os.getpid, workers=[doomed])[doomed]
            held = [client.submit(hold, str(flag), i, key=f"held-{i}", workers=[doomed],
                                  allow_other_workers=False) for i in range(2)]
            wait_for(lambda: len(client.processing(workers=[doomed])[doomed]) == 2, 30,
                     "both tasks on the doomed worker", interval=0.1)
            time.sleep(0.3)
            # what Dask says the worker is running as it is killed
            out["running_at_death"] = sorted(client.processing(workers=[doomed])[doomed])
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: doomed not in live_workers(client), 30,
                     "the scheduler to remove the killed worker", interval=0.1)
            # Its nanny starts another worker: the death was seen while the nanny ran.
            # (Closing the cluster at once could make the nanny's watch, every 0.1 s,
            # see the dead process only while closing: an expected end.)
            wait_for(lambda: len(live_workers(client)) == 2, 60,
                     "the nanny to restart the killed worker", interval=0.1)
            flag.unlink()
            client.cancel(held)  # pinned to the dead worker: they would wait forever
            out["doomed"] = doomed
            del x, bad, after, held
        assert wait_drained(timeout=90, settle=1.5), "the pipeline did not drain"
        out["backend"] = sink.backend()
    return out
