"""Stream processor throughput: events per second, and per core.

1. Record: a real workload on a LocalCluster with the producers attached; its raw
   topic is read back from the broker (the recording, version 3 as the producers send
   it). Route A is the recording as version 2 sent it (``replay.as_version_2``: JSON,
   each capture the TRANSITION_RUN of its transitions), route B the recording itself.
2. The state logic alone: each route's recording is decoded and applied to fresh
   ``ClusterState``s in this process, checkpointing like a worker does.
3. End to end: ``--copies`` copies of each route's recording, each under a new cluster id
   and new producer ids (so they count as distinct clusters), are published to a
   fresh raw topic; then one ``faust -A dask_blackbox.stream_processors.app worker`` is started and
   processes them as fast as it goes. Measured from the moment its first batch began
   to the moment its last batch was done (its ``/blackbox/stats/``): events per
   second of wall clock, and per second of the worker process's CPU time (per core).

Faust's own cost is per raw message (one envelope carrying tens to hundreds of
events), which is why events per second can be far above messages per second.

``--broker kafka`` runs it on Apache Kafka (``blackbox.local.kafka-home``) instead
of Tansu.

End to end is an A/B: this checkout's worker, alternating (A, B, A, B, ...; ``--runs``
each) on fresh topics holding each route's copies; each route's figure is the median
of its runs, every run printed.

``--baseline REV`` makes it an A/B of two revisions on the same input: route A is the
recording itself (version 3, as B), read by the code of that git revision (its
``dask_blackbox`` rebuilt from ``git archive`` as bench/sink_ingest.py does, first on
the PYTHONPATH), B by this checkout's. Then the state logic runs in a process of its
own for each route, alternating as end to end does (``--runs`` each), so that both
parts compare the two revisions under the same load.

    python bench/processor_throughput.py [--quick] [--copies N] [--runs 2] [--baseline REV] [--broker tansu|kafka]
    python bench/processor_throughput.py --state-logic FILE --copies N  # one state-logic run, as JSON
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
import msgspec
from distributed import Client, LocalCluster, span

from dask_blackbox import contract, producers
from dask_blackbox import kafka
from dask_blackbox.deploy import brokers
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.stream_processors import envelopes
from dask_blackbox.stream_processors.checkpoint import Journal
from dask_blackbox.stream_processors.cluster import ClusterState
from dask_blackbox.testing import replay
from dask_blackbox.testing.processors import env_for, processor_settings
from report import report

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


def state_logic_child(path: str, copies: int) -> None:
    """One state-logic run of the recording in ``path`` (MessagePack ``[[key, value],
    ...]``) in this process, printed as JSON with where its processors came from."""
    recording = [tuple(m) for m in msgspec.msgpack.decode(pathlib.Path(path).read_bytes())]
    events, cpu = state_logic(recording, copies)
    print(json.dumps({"events": events, "cpu": cpu, "location": envelopes.__file__}))


def state_logic_run(path: str, copies: int, package: str | None) -> tuple[int, float]:
    """(events, CPU seconds) of :func:`state_logic_child` in a process of its own,
    importing ``package`` first (None: this checkout)."""
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join([package, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__, "--state-logic", path, "--copies",
                          str(copies)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the state logic failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if package is not None and not result["location"].startswith(package):
        sys.exit(f"route A imported {result['location']}, not the baseline")
    return result["events"], result["cpu"]


def end_to_end(broker: str, recording: list[tuple[bytes, bytes]], copies: int,
               workdir: str, package: str | None = None) -> dict:
    prefix = "e2e" + uuid.uuid4().hex[:6]
    conf = settings(broker, prefix)
    msgpack = contract.is_msgpack(recording[0][1])  # each copy in its recording's encoding
    source = [contract.decode_envelope(v) for _, v in recording]
    with dask.config.set(conf):
        asyncio.run(kafka.ensure_topics())
        messages = [replay.encode(replay.renamed(e, f"copy-{c}", f"@{c}"), msgpack)
                    for c in range(copies) for e in source]
        asyncio.run(replay.publish_raw(messages))
    env = env_for(conf)
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
    parser.add_argument("--baseline", default=None,
                        help="git revision whose worker reads route A (default: this checkout)")
    parser.add_argument("--broker", choices=("tansu", "kafka"), default="tansu")
    parser.add_argument("--state-logic", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.state_logic:
        return state_logic_child(args.state_logic, args.copies)
    size, copies = (1000, 6) if args.quick else (2000, 20)
    copies = args.copies or copies

    from sink_ingest import baseline_package

    broker_dir = tempfile.TemporaryDirectory()
    local = brokers.from_config(broker_dir.name, args.broker)
    local.start(timeout=120)
    try:
        broker = local.address
        recording = record(broker, size)
        a_version = 3 if args.baseline else 2
        recordings = {"A": recording if args.baseline else
                      [(k, replay.as_version_2(v)) for k, v in recording], "B": recording}
        n_events = sum(len(contract.expand_events(contract.decode_envelope(v)["events"]))
                       for _, v in recording)
        for route, r in recordings.items():
            print(f"recording {route} (version {a_version if route == 'A' else 3}): {len(r)} "
                  f"envelopes, {n_events} events, {sum(len(v) for _, v in r) / 1e6:.1f} MB",
                  flush=True)
        a_name = (f"version 3, the code of {args.baseline}" if args.baseline else "version 2")
        names = {"A": a_name, "B": "version 3"}

        with tempfile.TemporaryDirectory() as base:
            package = None
            if args.baseline:
                package = str(baseline_package(args.baseline, pathlib.Path(base)))
                where = subprocess.run(
                    [sys.executable, "-c", "import dask_blackbox.stream_processors.app as m; print(m.__file__)"],
                    env={**os.environ, "PYTHONPATH": package}, capture_output=True, text=True,
                    cwd=base).stdout
                if not where.startswith(package):
                    sys.exit(f"route A would import {where.strip() or 'nothing'}, not the baseline")

            logic_copies = max(2, copies // 4)
            if args.baseline:
                path = os.path.join(base, "recording.msgpack")
                pathlib.Path(path).write_bytes(msgspec.msgpack.encode(recording))
                logic: dict[str, list[float]] = {"A": [], "B": []}
                for n in range(args.runs):
                    for route in ("A", "B"):
                        events, cpu = state_logic_run(path, logic_copies,
                                                      package if route == "A" else None)
                        logic[route].append(events / cpu)
                        print(f"state logic run {n + 1} {route}: {events} events in {cpu:.2f}s "
                              f"CPU: {events / cpu:.0f} events/s", flush=True)
                for route in ("A", "B"):
                    report(f"processor state logic (decode + apply + checkpoint), 1 core, "
                           f"{route}: {names[route]} (median of {args.runs})",
                           round(statistics.median(logic[route])), "events/s",
                           TARGET if route == "B" else None, AIM if route == "B" else None,
                           better="higher")
            else:
                for route in ("A", "B"):
                    events, cpu = state_logic(recordings[route], logic_copies)
                    report(f"processor state logic (decode + apply + checkpoint), 1 core, "
                           f"{route}: {names[route]}", round(events / cpu), "events/s",
                           TARGET if route == "B" else None, AIM if route == "B" else None,
                           better="higher")

            figures: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
            for n in range(args.runs):
                for route in ("A", "B"):
                    with tempfile.TemporaryDirectory() as workdir:
                        s = end_to_end(broker, recordings[route], copies, workdir,
                                       package if route == "A" else None)
                    (wall0, cpu0), (wall1, cpu1) = s["first_began"], s["last_done"]
                    per_wall, per_core = s["events"] / (wall1 - wall0), s["events"] / (cpu1 - cpu0)
                    figures[route].append((per_wall, per_core))
                    print(f"run {n + 1} {route}: {s['envelopes']} envelopes, {s['events']} events "
                          f"in {wall1 - wall0:.2f}s wall, {cpu1 - cpu0:.2f}s CPU of the faust "
                          f"worker: {per_wall:.0f} events/s, {per_core:.0f} per core", flush=True)
        for route, name in names.items():
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
