"""A flood of small clusters through one stream processor: throughput and memory.

Many clusters at once is what a platform sees when a fleet of short jobs starts
together, or when a broker that was down hands over what piled up. The flood: N
clusters (``--clusters``, 10,000) of ``--per-cluster`` (10) valid envelopes each --
the scheduler's start and a span, tasks (released -> waiting -> processing ->
memory, with a compute startstop), a worker's digests, the scheduler's close --
interleaved (every cluster's first envelope, then every second, ...), so every
cluster is live at once. It is published to a fresh raw topic first; then one
``faust -A dask_blackbox.stream_processors.app worker`` (one process: one core) is
started and processes it as fast as it goes.

A/B in one run, so the machine's noise cancels: A is the flood; B the same number of
envelopes from ``--clusters / 100`` clusters (the cost per envelope when clusters are
few). After A, the sink (``dask-blackbox sink``) loads the flood and what the worker
derived from it into chDB, and ``dask-blackbox status`` is timed while it does (under
load) and once it is done. For each: envelopes per second of wall clock (first batch begun to last batch
done, from the worker's ``/blackbox/stats/``) and per second of the worker's CPU, the
worker's RSS (at the start of processing, at each quarter of the envelopes, at the
end), the clusters it held at the end, and what it refused past its bounds
(``processors.max-live-clusters``, ``max-live-keys-total``: dead letters).

    python bench/flood.py [--quick] [--clusters 10000] [--per-cluster 10] [--broker tansu|kafka] [--only A]
                          [--worker-python PATH]   # another checkout's processors, to compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import dask
import psutil


from dask_blackbox import contract, kafka
from dask_blackbox.deploy import brokers
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.testing import replay
from dask_blackbox.testing.processors import env_for, processor_settings
from report import report

TARGET, AIM = 5_000, 10_000


def cluster_envelopes(c: int, per_cluster: int, t0: float) -> list[dict]:
    """The ``per_cluster`` envelopes of small cluster number ``c``: start and a span,
    one task per envelope, a worker's digests, the close."""
    cid = f"flood-{c:06d}"
    seqs = {"scheduler": 0, "worker": 0}

    def envelope(source: str, events: list[dict], t: float) -> dict:
        e = {"schema": contract.SCHEMA_VERSION, "cluster_id": cid,
             "cluster_name": f"fleet-{c % 100}", "source": source,
             "producer_id": f"{source}-{c}", "seq": seqs[source], "sent_at": t,
             "events": events}
        seqs[source] += 1
        return e

    span_id = f"span-{c}"
    t = t0
    out = [envelope("scheduler", [
        {"kind": contract.LIFECYCLE, "ts": t, "action": "scheduler_start", "worker": None,
         "client": None, "reason": None, "stimulus_id": None, "detail": {},
         "total_nthreads": [[t, 2]]},
        {"kind": contract.SPAN, "ts": t, "span_id": span_id, "name": ["flood"],
         "parent_id": None, "enqueued": t},
    ], t)]
    for i in range(max(0, per_cluster - 3)):
        t += 0.05
        task = {"kind": contract.TRANSITION, "key": f"inc-{i}", "prefix": "inc",
                "group": f"inc-{i}", "span_id": span_id, "worker": None, "nbytes": None,
                "typename": None, "startstops": None, "exception": None, "traceback": None,
                "cause": None}
        out.append(envelope("scheduler", [
            {**task, "ts": t, "start": "released", "finish": "waiting", "stimulus_id": f"ug-{i}"},
            {**task, "ts": t + 0.001, "start": "waiting", "finish": "processing",
             "stimulus_id": f"ug-{i}"},
            {**task, "ts": t + 0.01, "start": "processing", "finish": "memory",
             "stimulus_id": f"tf-{i}", "worker": "tcp://w:1", "nbytes": 28, "typename": "int",
             "startstops": [{"action": "compute", "start": t + 0.002, "stop": t + 0.009}]},
        ], t))
    t += 0.05
    out.append(envelope("worker", [{"kind": contract.WORKER_DIGESTS, "ts": t, "digests": [
        ["execute", span_id, "inc", "thread-cpu", "seconds", 0.02]]}], t))
    out.append(envelope("scheduler", [
        {"kind": contract.LIFECYCLE, "ts": t + 0.01, "action": "scheduler_close", "worker": None,
         "client": None, "reason": None, "stimulus_id": None, "detail": {}}], t + 0.01))
    return out[:per_cluster] if per_cluster < 3 else out


def flood(clusters: int, per_cluster: int) -> list[tuple[bytes, bytes]]:
    """(key, value) of every envelope, interleaved across clusters."""
    t0 = time.time() - 3600
    per = [cluster_envelopes(c, per_cluster, t0 + c * 1e-3) for c in range(clusters)]
    return [replay.encode(per[c][i]) for i in range(per_cluster) for c in range(clusters)]


def stats(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/blackbox/stats/", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


def sink_and_status(conf: dict, workdir: str, messages: int) -> dict:
    """Load everything with the sink; time `dask-blackbox status` meanwhile and after."""
    from dask_blackbox.deploy.supervisor import pipeline_lag

    conf = {**conf, "blackbox.data-dir": os.path.join(workdir, "sink-data"),
            "blackbox.sink.group-id": "sink-" + conf["blackbox.kafka.topic-prefix"]}
    env = env_for(conf)
    log = open(os.path.join(workdir, "sink.log"), "w")
    sink = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli", "sink"], env=env,
                            stdout=subprocess.PIPE, stderr=log)
    out: dict = {"status_s": []}
    try:
        ready = sink.stdout.readline().decode()
        if "sink ready" not in ready:
            sys.exit(f"the sink did not start; see {workdir}/sink.log")
        began = time.monotonic()

        def status() -> float:
            t = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "status",
                                   "--format", "json"], env=env, capture_output=True,
                                  text=True, timeout=600)
            if done.returncode != 0:
                sys.exit(f"status failed: {done.stderr}")
            return time.monotonic() - t

        with dask.config.set(conf):
            out["status_s"].append(status())  # under load: the sink loads meanwhile
            while True:
                lag = asyncio.run(pipeline_lag())[conf["blackbox.sink.group-id"]]
                if not any(lag.values()):
                    break
                time.sleep(0.5)
            out["load_s"] = time.monotonic() - began
            out["status_s"].append(status())  # loaded
        return out
    finally:
        sink.terminate()
        sink.wait(60)
        log.close()


def run(broker: str, clusters: int, per_cluster: int, workdir: str, extra: dict,
        with_sink: bool = False, python: str = sys.executable) -> dict:
    """Publish the flood, then process it with one fresh faust worker."""
    prefix = "flood" + uuid.uuid4().hex[:6]
    conf = {**processor_settings(broker, prefix, 4), **extra}
    messages = flood(clusters, per_cluster)
    with dask.config.set(conf):
        asyncio.run(kafka.ensure_topics())
        asyncio.run(replay.publish_raw(messages))
    env = env_for(conf)
    port = free_port()
    log_path = os.path.join(workdir, f"faust-{prefix}.log")
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [python, "-m", "faust", "-A", "dask_blackbox.stream_processors.app", "--datadir",
             os.path.join(workdir, prefix), "-l", "info", "worker", "--web-port", str(port),
             "--web-host", "127.0.0.1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    process = psutil.Process(worker.pid)
    rss: dict[str, float] = {}
    quarters = [len(messages) * q // 4 for q in (1, 2, 3, 4)]
    peak = 0
    try:
        deadline = time.monotonic() + 1800
        s = None
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                sys.exit(f"faust worker exited; see {log_path}")
            s = stats(port) or s
            mem = process.memory_info().rss / 2**20
            peak = max(peak, mem)
            done = (s or {}).get("envelopes", 0) + (s or {}).get("dead_letters", 0)
            if s and s.get("first_began") and "start" not in rss:
                rss["start"] = mem
            for q, n in zip(("25%", "50%", "75%", "100%"), quarters):
                if done >= n and q not in rss:
                    rss[q] = mem
            if done >= len(messages):
                break
            time.sleep(0.25)
        else:
            sys.exit(f"the faust worker did not finish within 30 minutes; see {log_path}")
        time.sleep(3)
        rss["3s after"] = process.memory_info().rss / 2**20
        s = stats(port)
        result = {**s, "messages": len(messages), "rss": rss, "peak": max(peak, rss["3s after"])}
        if with_sink:
            result["sink"] = sink_and_status(conf, workdir, len(messages))
        return result
    finally:
        worker.terminate()
        worker.wait(60)


def _cpu(s: dict) -> float:
    return s["last_done"][1] - s["first_began"][1]


def show(label: str, clusters: int, s: dict) -> float:
    (wall0, cpu0), (wall1, cpu1) = s["first_began"], s["last_done"]
    wall, cpu = wall1 - wall0, cpu1 - cpu0
    rate = s["messages"] / wall
    print(f"{label}: {s['messages']} envelopes of {clusters} clusters in {wall:.1f}s wall, "
          f"{cpu:.1f}s CPU of the faust worker: {rate:.0f} envelopes/s, "
          f"{s['messages'] / cpu:.0f} per CPU second", flush=True)
    print("  RSS MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in s["rss"].items())
          + f", peak {s['peak']:.0f}; clusters held at the end {s['clusters']}; "
          f"dead letters {s['dead_letters']}, refused past the bounds "
          f"{s.get('refused_clusters', 0)} envelopes of new clusters, "
          f"{s.get('refused_keys', 0)} keys", flush=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 clusters")
    parser.add_argument("--clusters", type=int)
    parser.add_argument("--per-cluster", type=int, default=10)
    parser.add_argument("--broker", choices=("tansu", "kafka"), default="tansu")
    parser.add_argument("--only", choices=("A", "B"), help="run one side only")
    parser.add_argument("--no-sink", action="store_true", help="skip the sink and status step")
    parser.add_argument("--worker-python", default=sys.executable,
                        help="the Python that runs the faust worker (whose dask_blackbox it "
                             "imports): compare another checkout's processors")
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        metavar="KEY=VALUE", help="a blackbox.processors.* setting for both sides")
    args = parser.parse_args()
    args.clusters = args.clusters or (1_000 if args.quick else 10_000)
    extra = {}
    for item in args.settings:
        key, _, value = item.partition("=")
        extra[f"blackbox.{key.removeprefix('blackbox.')}"] = value
    broker_dir = tempfile.TemporaryDirectory()
    local = brokers.from_config(broker_dir.name, args.broker)
    local.start(timeout=120)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            rates = {}
            if args.only in (None, "A"):
                a = run(local.address, args.clusters, args.per_cluster, workdir, extra,
                        with_sink=not args.no_sink, python=args.worker_python)
                rates["A"] = show("A flood", args.clusters, a)
                if "sink" in a:
                    under, after = a["sink"]["status_s"]
                    print(f"  sink: loaded the flood and its derived records in "
                          f"{a['sink']['load_s']:.1f}s; `dask-blackbox status` answered in "
                          f"{under:.1f}s while it loaded, {after:.1f}s after", flush=True)
                    report("flood: `dask-blackbox status` while the sink loads", round(under, 1),
                           "s", 10, 3, better="lower")
                report(f"flood: {args.clusters} clusters through 1 faust worker "
                       f"({local.describe()}), per second of its CPU (one core)",
                       round(a["messages"] / _cpu(a)), "envelopes/s", TARGET, AIM, better="higher")
                report("flood: the same, per second of wall clock (the machine's load counts)",
                       round(rates["A"]), "envelopes/s", None, better="higher")
                grown = a["rss"]["100%"] / a["rss"]["25%"]
                report("flood: worker RSS at the end / at a quarter of the envelopes",
                       round(grown, 2), "x", 1.5, 1.2, better="lower")
            if args.only in (None, "B"):
                few = max(1, args.clusters // 100)
                b = run(local.address, few, args.clusters * args.per_cluster // few, workdir, extra,
                        python=args.worker_python)
                rates["B"] = show("B few clusters", few, b)
            if len(rates) == 2:
                report("flood: envelopes per CPU second, many clusters / few",
                       round((a["messages"] / _cpu(a)) / (b["messages"] / _cpu(b)), 2),
                       "x", 0.5, 0.8, better="higher")
    finally:
        local.stop()
        broker_dir.cleanup()


if __name__ == "__main__":
    main()
