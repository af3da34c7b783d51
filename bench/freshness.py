"""Freshness: from a transition happening on the scheduler to its row being queryable
in ClickHouse, under a steady real workload.

The local pipeline (Tansu, faust, sink on chDB) runs as in ``dask-blackbox up``; a
LocalCluster with the producers attached finishes one task every ``--interval``
seconds. A poller queries ClickHouse every ``--poll`` seconds for the tasks' 'memory'
transitions; a row's latency is the time the poller first saw it minus the
transition's timestamp (the scheduler's clock; same machine). The poll period bounds
the resolution.

``--broker kafka`` runs the pipeline on Apache Kafka (``blackbox.local.kafka-home``)
instead of Tansu.

Two routes, run alternately (A, B, A, B, ...; ``--runs`` each, a fresh pipeline per
run) so the machine's noise falls on both:

- **A**, the route before: producers flush every 100 ms (``blackbox.producer.flush-
  interval``);
- **B**, this checkout's defaults: every 50 ms while events trickle.

Both have the sink's batch rule: a batch closes ``batch-min-wait`` after its first
message once the sink has caught up, or as soon as the load before it ends.

With ``--baseline REV`` (a git revision, e.g. ``main``), route A is instead ``REV``'s
pipeline (the sink and processors started with ``REV``'s package first on their
``PYTHONPATH``; the producers, in this process, are this checkout's) with this
checkout's settings: an A/B of the pipeline's own part of freshness.

Each route's p50 and p95 are over the latencies of all its runs; each run's are printed
too, and where each run's latency went: from the transition to the Kafka record's
timestamp (the producer's send), on to the sink's batch beginning to load (its
``begin`` journal row: the broker, the fetch and the batch rule; and of that, the
time the batch before was still loading after the record was sent, and the rest; and,
when it was held, from that load's end to this batch's begin: the commit, this batch's
conversion and the event loop), on to the poller
seeing the row (the load of its table and the poll); and the whole batch's load (from
``begin`` to its ``loaded`` row, every table).

    python bench/freshness.py [--seconds 60] [--runs 2] [--quick] [--broker tansu|kafka]
                              [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import tempfile
import threading
import time
from unittest import mock

import dask.config
from distributed import Client, LocalCluster

from report import report


def inc(x):
    return x + 1


def pipeline_package(package: str | None):
    """The pipeline's children import ``package`` first (None: this checkout's): the
    environment they inherit, changed for the run and restored after it."""
    if package is None:
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {
        "PYTHONPATH": os.pathsep.join([package, os.environ.get("PYTHONPATH", "")])})


def record_times(cluster_id: str) -> dict[str, tuple[int, int, float]]:
    """Each 'fresh-' task's 'memory' transition: (partition, offset, Kafka timestamp in
    seconds) of the raw message that carried it, read back from the broker."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition

    from dask_blackbox import contract
    from dask_blackbox.config import KafkaSettings
    from dask_blackbox.stream_processors.envelopes import decode

    kafka = KafkaSettings.from_config()

    async def read() -> dict[str, tuple[int, int, float]]:
        reader = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=None,
                                  enable_auto_commit=False)
        await reader.start()
        try:
            topic = kafka.topic(contract.RAW)
            tps = [TopicPartition(topic, p) for p in range(kafka.partitions)]
            reader.assign(tps)
            await reader.seek_to_beginning(*tps)
            ends = await reader.end_offsets(tps)
            found: dict[str, tuple[int, int, float]] = {}
            while any([await reader.position(tp) < ends[tp] for tp in tps]):
                for tp, records in (await reader.getmany(timeout_ms=1000)).items():
                    for r in records:
                        envelope = decode(r.value, r.key)
                        if envelope["cluster_id"] != cluster_id:
                            continue
                        for ev in envelope["events"]:
                            if (ev.get("kind") == contract.TRANSITION and ev["finish"] == "memory"
                                    and str(ev["key"]).startswith("fresh-")):
                                found.setdefault(ev["key"], (tp.partition, r.offset,
                                                             r.timestamp / 1000))
            return found
        finally:
            await reader.stop()

    return asyncio.run(read())


def stages(backend, cluster_id: str, trans: dict[str, float], seen: dict[str, float]
           ) -> dict[str, list[float]]:
    """Per stage, each transition's seconds in it (see the module docstring)."""
    from dask_blackbox import contract
    from dask_blackbox.config import KafkaSettings

    records = record_times(cluster_id)
    _, rows = backend.query(
        "SELECT batch_id, state, partition, from_offset, next_offset, toFloat64(at) "
        "FROM sink_batches WHERE topic IN ({t:String}, '')",
        {"t": KafkaSettings.from_config().topic(contract.RAW)})
    loaded = {b: at for b, state, _, _, _, at in rows if state == "loaded"}
    order = sorted(loaded)
    before = {b: loaded[a] for a, b in zip(order, order[1:])}  # the batch before's end
    begun = [(p, lo, hi, at, loaded[b], before.get(b, 0.0)) for b, state, p, lo, hi, at in rows
             if state == "begin" and b in loaded]
    out: dict[str, list[float]] = {"send": [], "to batch": [], "held by the load before": [],
                                   "not held": [], "after the load before": [], "to seen": [],
                                   "batch load": []}
    for key, (partition, offset, created) in records.items():
        batch = next(((b, l, prev) for p, lo, hi, b, l, prev in begun
                      if p == partition and lo <= offset < hi), None)
        if batch is None or key not in seen or key not in trans:
            continue
        out["send"].append(created - trans[key])
        out["to batch"].append(batch[0] - created)
        held = max(0.0, min(batch[2], batch[0]) - created)
        out["held by the load before"].append(held)
        out["not held"].append(batch[0] - created - held)
        if held:  # commit of the batch before, this batch's Arrow tables, the loop
            out["after the load before"].append(batch[0] - batch[2])
        out["to seen"].append(seen[key] - batch[0])
        out["batch load"].append(batch[1] - batch[0])
    return {name: sorted(values) for name, values in out.items()}


def measure(args, seconds: float, settings: dict, package: str | None = None
            ) -> tuple[list[float], dict[str, list[float]]]:
    """Latencies (seconds) of one run on a fresh local pipeline with ``settings``
    (its children importing ``package`` first, if given), and their stages."""
    from dask_blackbox import producers
    from dask_blackbox.deploy.supervisor import LocalPipeline
    from dask_blackbox.read import queries

    with tempfile.TemporaryDirectory() as data_dir, pipeline_package(package), \
            dask.config.set({"blackbox.data-dir": data_dir, **settings}):
        pipeline = LocalPipeline(broker=args.broker)
        pipeline.start(progress=lambda m: None)
        try:
            with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                              dashboard_address=None) as cluster, Client(cluster) as client:
                cluster_id = producers.attach(client, cluster_name="freshness")["cluster_id"]
                backend = queries.connect()
                seen: dict[str, float] = {}
                trans: dict[str, float] = {}
                latencies: list[float] = []
                stop = threading.Event()

                def poll():
                    while not stop.is_set():
                        _, rows = backend.query(
                            "SELECT key, toFloat64(ts) FROM transitions "
                            "WHERE cluster_id = {c:String} AND finish = 'memory' "
                            "AND startsWith(key, 'fresh-')",
                            {"c": cluster_id},
                        )
                        now = time.time()
                        for key, ts in rows:
                            if key not in seen:
                                seen[key] = now
                                trans[key] = ts
                                latencies.append(now - ts)
                        stop.wait(args.poll)

                poller = threading.Thread(target=poll, daemon=True)
                poller.start()
                futures, i, t_end = [], 0, time.monotonic() + seconds
                while time.monotonic() < t_end:
                    futures.append(client.submit(inc, i, key=f"fresh-{i}"))
                    i += 1
                    time.sleep(args.interval)
                client.gather(futures)
                deadline = time.monotonic() + 30
                while len(seen) < i and time.monotonic() < deadline:
                    time.sleep(0.1)
                stop.set()
                poller.join()
                parts = stages(backend, cluster_id, trans, seen)
        finally:
            pipeline.stop(drain_timeout=0)
    if len(latencies) < i:
        raise SystemExit(f"only {len(latencies)} of {i} transitions became queryable in time")
    return sorted(latencies), parts


def quantiles(latencies: list[float]) -> tuple[float, float]:
    """(p50, p95) of sorted ``latencies``."""
    return statistics.median(latencies), latencies[int(0.95 * (len(latencies) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=0.05, help="between tasks")
    parser.add_argument("--poll", type=float, default=0.05, help="between ClickHouse polls")
    parser.add_argument("--runs", type=int, default=2, help="runs of each route (alternating)")
    parser.add_argument("--quick", action="store_true", help="15 seconds, 1 run per route")
    parser.add_argument("--broker", choices=("tansu", "kafka"), default="tansu")
    parser.add_argument("--baseline", help="route A: this git revision's pipeline")
    args = parser.parse_args()
    seconds = 15.0 if args.quick else args.seconds
    runs = 1 if args.quick else args.runs

    import dask_blackbox  # noqa: F401  (its defaults into dask.config)

    with tempfile.TemporaryDirectory() as base:
        if args.baseline:
            from sink_ingest import baseline_package

            package = str(baseline_package(args.baseline, pathlib.Path(base)))
            routes = {"A": (f"the pipeline of {args.baseline}", {}, package),
                      "B": ("this checkout", {}, None)}
        else:
            routes = {"A": ("producers flush every 100 ms",
                            {"blackbox.producer.flush-interval": "100ms"}, None),
                      "B": ("this checkout (flush-interval "
                            f"{dask.config.get('blackbox.producer.flush-interval')})", {}, None)}
        run_routes(args, seconds, runs, routes)


def run_routes(args, seconds: float, runs: int, routes: dict) -> None:
    pooled: dict[str, list[float]] = {"A": [], "B": []}
    for n in range(runs):
        for route, (name, settings, package) in routes.items():
            latencies, parts = measure(args, seconds, settings, package)
            pooled[route] += latencies
            p50, p95 = quantiles(latencies)
            print(f"run {n + 1} {route}: {len(latencies)} transitions over {seconds:.0f}s; "
                  f"p50 {p50:.3f}s  p95 {p95:.3f}s  max {latencies[-1]:.3f}s; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            print("  stages p50/p95/max (s): " + ", ".join(
                f"{name} " + ("/".join(f"{v:.3f}" for v in (*quantiles(values), values[-1]))
                              if values else "-") for name, values in parts.items()), flush=True)
    print(f"poll period {args.poll * 1000:.0f} ms; {runs} run(s) per route")
    for route, (name, _, _) in routes.items():
        p50, p95 = quantiles(sorted(pooled[route]))
        label = f"{args.broker}, {route}: {name}"
        report(f"freshness p50 (transition -> queryable), {label}", round(p50, 3), "s",
               target=None)
        report(f"freshness p95 (transition -> queryable), {label}", round(p95, 3), "s",
               target=0.5 if route == "B" else None, aim=None)


if __name__ == "__main__":
    main()
