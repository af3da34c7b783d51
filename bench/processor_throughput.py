"""Stream processor throughput: events per second, and per core.

1. Record: a real workload on a LocalCluster with the producers attached; its raw
   topic is read back from the broker (the recording).
2. A, the state logic alone: the recording is decoded and applied to fresh
   ``ClusterState``s in this process, checkpointing like a worker does.
3. B, end to end: ``--copies`` copies of the recording, each under a new cluster id
   and new producer ids (so they count as distinct clusters), are published to a
   fresh raw topic; then one ``faust -A dask_blackbox.stream_processors.app worker`` is started and
   processes them as fast as it goes. Measured from the moment its first batch began
   to the moment its last batch was done (its ``/blackbox/stats/``): events per
   second of wall clock, and per second of the worker process's CPU time (per core).

Faust's own cost is per raw message (one envelope carrying tens to hundreds of
events), which is why events per second can be far above messages per second.

``--broker kafka`` runs it on Apache Kafka (``blackbox.local.kafka-home``) instead
of Tansu.

End to end is an A/B: the worker of ``--baseline`` (a git revision, default ``main``;
its ``dask_blackbox`` rebuilt from ``git archive`` as bench/sink_ingest.py does, first
on the worker's PYTHONPATH) and this checkout's, alternating (A, B, A, B, ...;
``--runs`` each) on fresh topics holding the same copies; each route's figure is the
median of its runs, every run printed.

    python bench/processor_throughput.py [--quick] [--copies N] [--runs 2] [--baseline main] [--broker tansu|kafka]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import dask
import dask.array as da
import orjson
from distributed import Client, LocalCluster, span

from dask_blackbox import contract, producers
from dask_blackbox import kafka
from dask_blackbox.cli import brokers
from dask_blackbox.cli.brokers import free_port
from report import report
from dask_blackbox.stream_processors import envelopes
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # support modules import their neighbours
from tests import replay  # noqa: E402  (test/bench-only, not shipped)
from tests.processors_support import processor_settings  # noqa: E402
from dask_blackbox.stream_processors.checkpoint import Journal
from dask_blackbox.stream_processors.cluster import ClusterState

TARGET, AIM = 50_000, 200_000


def settings(broker: str, prefix: str) -> dict:
    return processor_settings(broker, prefix)


def record(broker: str, size: int) -> list[tuple[bytes, bytes]]:
    """Raw messages of a dask.array workload with ``size**2 / 2500`` input chunks."""
    with dask.config.set({**settings(broker, "rec" + uuid.uuid4().hex[:6]),
                          "optimization.fuse.active": False}):
        asyncio.run(kafka.ensure_topics())
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            producers.attach(client)
            with span("bench"):
                x = da.random.random((size, size), chunks=50)
                (x + x.T).mean(axis=0).sum().compute()
            time.sleep(2)  # final worker metrics
        return asyncio.run(replay.read_raw(idle=1.0))


def state_logic(recording: list[tuple[bytes, bytes]], copies: int) -> tuple[int, float]:
    """(events, CPU seconds) to decode and apply ``copies`` copies in this process."""
    n_events = 0
    began = time.process_time()
    for c in range(copies):
        cid = f"logic-{c}"
        state, journal = ClusterState(cid, 60.0, 10**6), Journal(cid)
        for i, (_, value) in enumerate(recording):
            envelope = envelopes.decode(value, None, expand=False)  # as the worker reads it
            state.apply(replay.renamed(envelope, cid, f"@{c}"))
            n_events += envelopes.count_events(envelope["events"])
            if i % 500 == 499:
                journal.commit(state.take_changes(), state.records, 0)
        journal.commit(state.take_changes(), state.records, 0)
        state.snapshots()
    return n_events, time.process_time() - began


def end_to_end(broker: str, recording: list[tuple[bytes, bytes]], copies: int,
               workdir: str, package: str | None = None) -> dict:
    prefix = "e2e" + uuid.uuid4().hex[:6]
    conf = settings(broker, prefix)
    source = [orjson.loads(v) for _, v in recording]
    with dask.config.set(conf):
        asyncio.run(kafka.ensure_topics())
        messages = [replay.encode(replay.renamed(e, f"copy-{c}", f"@{c}"))
                    for c in range(copies) for e in source]
        asyncio.run(replay.publish_raw(messages))
    env = {**os.environ, **{"DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v)
                            for k, v in conf.items()}}
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join([package, env.get("PYTHONPATH", "")])
    port = free_port()
    with open(os.path.join(workdir, "faust.log"), "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "faust", "-A", "dask_blackbox.stream_processors.app", "--datadir", os.path.join(workdir, "d"),
             "-l", "warn", "worker", "--web-port", str(port), "--web-host", "127.0.0.1"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
            cwd=workdir)  # not a checkout: python -m puts the working directory first
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                sys.exit(f"faust worker exited; see {workdir}/faust.log")
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/blackbox/stats/", timeout=2) as r:
                    stats = json.loads(r.read())
            except OSError:
                stats = None
            if stats and stats["envelopes"] >= len(messages):
                return {**stats, "messages": len(messages)}
            time.sleep(0.2)
        sys.exit("the faust worker did not finish within 10 minutes")
    finally:
        worker.terminate()
        worker.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload and fewer copies")
    parser.add_argument("--copies", type=int, help="copies replayed end to end")
    parser.add_argument("--runs", type=int, default=2, help="end-to-end runs of each route")
    parser.add_argument("--baseline", default="main", help="git revision of route A")
    parser.add_argument("--broker", choices=("tansu", "kafka"), default="tansu")
    args = parser.parse_args()
    size, copies = (1000, 6) if args.quick else (2000, 20)
    copies = args.copies or copies

    from sink_ingest import baseline_package

    broker_dir = tempfile.TemporaryDirectory()
    local = brokers.from_config(broker_dir.name, args.broker)
    local.start(timeout=120)
    try:
        broker = local.address
        recording = record(broker, size)
        n_events = sum(len(contract.expand_events(orjson.loads(v)["events"]))
                       for _, v in recording)
        print(f"recording: {len(recording)} envelopes, {n_events} events, "
              f"{sum(len(v) for _, v in recording) / 1e6:.1f} MB", flush=True)

        events, cpu = state_logic(recording, max(2, copies // 4))
        report("processor state logic (decode + apply + checkpoint), 1 core",
               round(events / cpu), "events/s", TARGET, AIM, better="higher")

        with tempfile.TemporaryDirectory() as base:
            package = str(baseline_package(args.baseline, pathlib.Path(base)))
            where = subprocess.run(
                [sys.executable, "-c", "import dask_blackbox.stream_processors.app as m; print(m.__file__)"],
                env={**os.environ, "PYTHONPATH": package}, capture_output=True, text=True,
                cwd=base).stdout
            if not where.startswith(package):
                sys.exit(f"route A would import {where.strip() or 'nothing'}, not the baseline")
            figures: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
            for n in range(args.runs):
                for route in ("A", "B"):
                    with tempfile.TemporaryDirectory() as workdir:
                        s = end_to_end(broker, recording, copies, workdir,
                                       package if route == "A" else None)
                    (wall0, cpu0), (wall1, cpu1) = s["first_began"], s["last_done"]
                    per_wall, per_core = s["events"] / (wall1 - wall0), s["events"] / (cpu1 - cpu0)
                    figures[route].append((per_wall, per_core))
                    print(f"run {n + 1} {route}: {s['envelopes']} envelopes, {s['events']} events "
                          f"in {wall1 - wall0:.2f}s wall, {cpu1 - cpu0:.2f}s CPU of the faust "
                          f"worker: {per_wall:.0f} events/s, {per_core:.0f} per core", flush=True)
        for route, name in (("A", f"baseline {args.baseline}"), ("B", "this checkout")):
            wall = statistics.median(w for w, _ in figures[route])
            core = statistics.median(c for _, c in figures[route])
            report(f"processor throughput end to end ({local.describe()} + 1 faust worker), "
                   f"{route}: {name}", round(wall), "events/s", None, better="higher")
            report(f"processor throughput end to end, per core of the faust worker, "
                   f"{route}: {name} (median of {args.runs})", round(core), "events/s/core",
                   200_000 if route == "B" else None, None, better="higher")
    finally:
        local.stop()
        broker_dir.cleanup()


if __name__ == "__main__":
    main()
