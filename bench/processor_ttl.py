"""Processor memory with clusters killed without closing, before/after the idle TTL.

A real workload (a dask.array of 10,000 chunks persisted, so that many keys stay
live, and a reduction over it) is recorded once from a LocalCluster with the producers attached; its raw
stream is cut at 80% and its scheduler_close dropped: a cluster killed mid-run.
Then, for each variant, one ``faust -A dask_blackbox.stream_processors.app worker``
gets ``--rounds`` waves of ``--clusters`` such clusters (new cluster and producer ids
each), and its resident memory (VmRSS) is read after each wave was processed and
after waiting ``--wait`` seconds:

- A, ``idle-cluster-ttl: 1h`` (in effect no idle TTL, as before: a cluster killed
  without scheduler_close stays in memory for ever);
- B, ``idle-cluster-ttl: <--ttl>s``: silent clusters are forgotten.

One run of each variant; RSS in MiB. ``expired`` is the worker's count of clusters
forgotten for silence, ``clusters`` those still in memory.

    python bench/processor_ttl.py [--clusters 50] [--rounds 3] [--ttl 10]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import tempfile
import time
import uuid

import dask
import dask.array as da
from distributed import Client, LocalCluster, span, wait

from dask_blackbox import contract, kafka, producers
from dask_blackbox.deploy.brokers import TansuBroker
from dask_blackbox.testing import replay
from dask_blackbox.testing.processors import FaustWorker, env_for, processor_settings
from report import report


def settings(broker: str, prefix: str, ttl: float) -> dict:
    return processor_settings(broker, prefix, idle_cluster_ttl=f"{ttl}s")


def record(broker: str) -> list[dict]:
    """Envelopes of a killed cluster: a real workload's raw stream cut at 80%,
    without scheduler_close."""
    with dask.config.set({**settings(broker, "rec" + uuid.uuid4().hex[:6], 3600),
                          "optimization.fuse.active": False}):
        asyncio.run(kafka.ensure_topics())
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            producers.attach(client)
            with span("killed"):
                # 10,000 chunks held in memory: live keys the processors track
                x = da.random.random((2000, 2000), chunks=20).persist()
                wait(x)
                (x + 1).sum().compute()
            time.sleep(2)
        raw = asyncio.run(replay.read_raw(idle=1.0))
    envelopes = [contract.decode_envelope(v) for _, v in raw]
    cut = envelopes[: int(len(envelopes) * 0.8)]
    for e in cut:
        e["events"] = [ev for ev in e["events"]
                       if not (ev["kind"] == "lifecycle"
                               and ev.get("action") == "scheduler_close")]
    return cut


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def variant(broker: str, source: list[dict], ttl: float, clusters: int, rounds: int,
            wait_s: float, workdir: pathlib.Path, label: str) -> list[dict]:
    prefix = "ttl" + uuid.uuid4().hex[:6]
    conf = settings(broker, prefix, ttl)
    rows = []
    with dask.config.set(conf):
        asyncio.run(kafka.ensure_topics())
        worker = FaustWorker(env_for(conf), workdir, label).start()
        try:
            _stats(worker)
            time.sleep(3)
            rows.append({"when": "started", "rss": rss_mib(worker.proc.pid),
                         **_counts(worker)})
            sent = 0
            for r in range(rounds):
                messages = [replay.encode(replay.renamed(e, f"{label}-{r}-{c}", f"@{r}-{c}"))
                            for c in range(clusters) for e in source]
                sent += asyncio.run(replay.publish_raw(messages))
                while _stats(worker)["envelopes"] < sent:
                    time.sleep(0.5)
                rows.append({"when": f"wave {r + 1} processed",
                             "rss": rss_mib(worker.proc.pid), **_counts(worker)})
                time.sleep(wait_s)
                rows.append({"when": f"wave {r + 1} + {wait_s:.0f}s",
                             "rss": rss_mib(worker.proc.pid), **_counts(worker)})
        finally:
            worker.stop()
    return rows


def _stats(worker: FaustWorker) -> dict:
    """The worker's counters (its web server may be slow to answer while busy)."""
    while (s := worker.stats()) is None:
        time.sleep(0.5)
    return s


def _counts(worker: FaustWorker) -> dict:
    s = _stats(worker)
    return {"clusters": s["clusters"], "expired": s["expired_idle"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="10 clusters, 1 wave")
    args = parser.parse_args()
    if args.quick:
        args.clusters, args.rounds = 10, 1
    wait_s = args.ttl + 8  # the TTL, plus a few snapshot ticks
    tansu = TansuBroker().start()
    port = tansu.port
    broker = f"127.0.0.1:{port}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = record(broker)
            n_events = sum(len(contract.expand_events(e["events"])) for e in source)
            print(f"one killed cluster: {len(source)} envelopes, {n_events} events")
            results = {}
            for label, ttl in (("A-no-idle-ttl", 3600.0), ("B-idle-ttl", args.ttl)):
                results[label] = variant(broker, source, ttl, args.clusters, args.rounds,
                                         wait_s, pathlib.Path(tmp), label)
            print(f"\n{args.clusters} killed clusters per wave, {args.rounds} waves, "
                  f"idle-cluster-ttl B={args.ttl:g}s; RSS of the faust worker (1 run each)")
            print(f"{'when':<22}" + "".join(f"{k:>36}" for k in results))
            for i in range(len(results["A-no-idle-ttl"])):
                line = f"{results['A-no-idle-ttl'][i]['when']:<22}"
                for rows in results.values():
                    row = rows[i]
                    line += (f"{row['rss']:>12.1f} MiB  clusters {row['clusters']:>4}"
                             f"  expired {row['expired']:>4}")
                print(line)
            a, b = results["A-no-idle-ttl"][-1], results["B-idle-ttl"][-1]
            report("processor RSS, killed clusters, no idle TTL", round(a["rss"], 1),
                   "MiB", None)
            report("processor RSS, killed clusters, idle TTL", round(b["rss"], 1),
                   "MiB", None)
    finally:
        tansu.kill()


if __name__ == "__main__":
    main()
