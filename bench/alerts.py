"""Alert latency: from the event that completes an incident reaching Kafka to the
webhook receiving the notification.

A Tansu broker, the alerter (``dask-blackbox alerts``, a subprocess, as ``up`` runs
it) with a worker-died and a killed-worker rule posting to a webhook on loopback
(``http.server``), and a producer publishing what the scheduler and the nannies send
when workers die, at ``--rate`` incidents a second, over a raw topic kept busy with
``--background`` transition events a second (a cluster at work):

- **nanny deaths**: a worker joins, the scheduler removes it, its nanny reports the
  process's end 0.1 s later. The incident is complete with the nanny's record.
- **KilledWorker**: the same, the removal carrying the task's erred transition.
- **no nanny**: the scheduler removes a worker whose nanny never reports (none):
  the alerter decides after ``blackbox.alerts.evidence-wait`` (2 s by default).

A latency is the webhook's arrival time minus the time the producer had the broker's
acknowledgement of the last message the incident needs (same machine, same clock).
Figures: p50, p95, max per kind, and the p95 of all against the 5 s target.

    python bench/alerts.py [--incidents 300] [--rate 5] [--background 2000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid


import orjson

from report import report


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def publish(producer, topic: str, envelope: dict) -> float:
    """Send one envelope; the time its acknowledgement came back."""
    await producer.send_and_wait(topic, orjson.dumps(envelope), key=envelope["cluster_id"].encode())
    return time.time()


async def background(producer, topic: str, per_second: int, stop: asyncio.Event) -> int:
    """Transition runs of a busy cluster, ``per_second`` transitions a second."""
    from dask_blackbox.testing.alerts import Cluster

    from dask_blackbox import contract

    busy = Cluster("busy")
    sent, n = 0, 200
    while not stop.is_set():
        t = time.time()
        run = {"kind": contract.TRANSITION_RUN, "ts": t, "key": [f"inc-{sent + i}" for i in range(n)],
               "time": [t] * n, "start": ["processing"] * n, "finish": ["memory"] * n,
               "stimulus_id": [f"task-finished-{t}"] * n, "names": [["inc", None, None]], "name": [0] * n}
        await producer.send(topic, orjson.dumps(busy.envelope([run])), key=busy.id.encode())
        sent += n
        await asyncio.sleep(n / per_second)
    return sent


async def drive(args, topic: str, bootstrap: str) -> dict[str, list[float]]:
    """Publish the incidents; return per kind the ack time of each incident's last
    message, by the incident's subject (worker or task key)."""
    from aiokafka import AIOKafkaProducer
    from dask_blackbox.testing.alerts import Cluster

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await producer.start()
    stop = asyncio.Event()
    busy = asyncio.create_task(background(producer, topic, args.background, stop)) if args.background else None
    acked: dict[str, dict[str, float]] = {"nanny death": {}, "KilledWorker": {}, "no nanny": {}}
    try:
        cluster = Cluster("bench")
        for i in range(args.incidents):
            kind = ("nanny death", "KilledWorker", "no nanny")[0 if i % 5 < 3 else 1 if i % 5 == 3 else 2]
            worker, pid = f"tcp://10.2.{i // 250}.{i % 250}:4000", 10_000 + i
            stimulus = f"handle-worker-cleanup-{time.time()}"
            await publish(producer, topic, cluster.envelope([cluster.added(
                worker, pid, None if kind == "no nanny" else "tcp://10.9.9.9:1")]))
            events = []
            key = f"task-{i}"
            if kind == "KilledWorker":
                events.append(cluster.transition(key, "processing", "erred", stimulus, worker=worker,
                                                  exception=f"KilledWorker: Attempted to run task {key!r}"))
            else:
                events.append(cluster.transition(key, "processing", "released", stimulus))
            events.append(cluster.removed(worker, stimulus))
            last = await publish(producer, topic, cluster.envelope(events))
            if kind != "no nanny":
                await asyncio.sleep(0.1)
                last = await publish(producer, topic, cluster.envelope(
                    [cluster.exited(worker, pid, -9)], "nanny"))
            acked[kind][key if kind == "KilledWorker" else worker] = last
            await asyncio.sleep(1.0 / args.rate)
    finally:
        stop.set()
        if busy is not None:
            print(f"background: {await busy:,} transitions", flush=True)
        await producer.stop()
    return acked


def _arrivals(hook) -> dict[str, float]:
    """Subject (a KilledWorker's task key, a dead worker's address) -> when its
    incident first arrived (the worker-died incidents of a KilledWorker's last death
    are counted under the worker; the KilledWorker under the task)."""
    arrived: dict[str, float] = {}
    for r in list(hook.received):
        p = r["payload"]
        subject = p.get("key") if p["kind"] == "killed-worker" else p.get("worker")
        arrived.setdefault(subject, r["at"])
    return arrived


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--incidents", type=int, default=300)
    parser.add_argument("--rate", type=float, default=5.0, help="incidents a second")
    parser.add_argument("--background", type=int, default=2000, help="transitions a second besides")
    parser.add_argument("--quick", action="store_true", help="60 incidents")
    args = parser.parse_args()
    if args.quick:
        args.incidents = 60

    import dask.config
    from dask_blackbox.testing.alerts import Webhook

    from dask_blackbox import kafka
    from dask_blackbox.alerts.service import READY_LINE
    from dask_blackbox.deploy.brokers import TansuBroker

    hook = Webhook()
    with TansuBroker().start() as tansu, tempfile.TemporaryDirectory() as data:
        prefix = "bench" + uuid.uuid4().hex[:6]
        rules = [{"name": "deaths", "when": "worker-died", "webhook": hook.url},
                 {"name": "kw", "when": "killed-worker", "webhook": hook.url}]
        settings = {"blackbox.kafka.bootstrap-servers": tansu.address,
                    "blackbox.kafka.topic-prefix": prefix, "blackbox.data-dir": data}
        with dask.config.set(settings):
            asyncio.run(kafka.ensure_topics())
            topic = f"{prefix}.raw"
        env = {**os.environ, "DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS": tansu.address,
               "DASK_BLACKBOX__KAFKA__TOPIC_PREFIX": prefix, "DASK_BLACKBOX__DATA_DIR": data,
               "DASK_BLACKBOX__ALERTS__RULES": repr(rules)}
        alerter = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli", "alerts"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = alerter.stdout.readline().decode()
            if not line.startswith(READY_LINE):
                raise SystemExit(f"the alerter did not start: {line}{alerter.stderr.read().decode()}")
            acked = asyncio.run(drive(args, topic, tansu.address))
            expected = sum(map(len, acked.values()))
            subjects = {s for sent in acked.values() for s in sent}
            deadline = time.time() + 30
            while not subjects <= set(_arrivals(hook)) and time.time() < deadline:
                time.sleep(0.2)
        finally:
            alerter.terminate()
            alerter.wait(30)
            hook.close()
    arrived = _arrivals(hook)
    every = []
    print(f"{'kind':<14} {'n':>5} {'p50 s':>8} {'p95 s':>8} {'max s':>8}  missing")
    for kind, sent in acked.items():
        lat = [arrived[s] - t for s, t in sent.items() if s in arrived]
        every += lat
        missing = len(sent) - len(lat)
        if lat:
            print(f"{kind:<14} {len(lat):>5} {statistics.median(lat):8.3f} {percentile(lat, 0.95):8.3f} "
                  f"{max(lat):8.3f}  {missing}")
            report(f"alert latency p95, {kind}", round(percentile(lat, 0.95), 3), "s", None)
        if missing:
            print(f"MISSING {missing} {kind} incidents", flush=True)
    duplicates = len(hook.received) - len({r['key'] for r in hook.received})
    print(f"webhook posts {len(hook.received)}, distinct incidents {len(hook.received) - duplicates}")
    report("alert latency p95, every incident", round(percentile(every, 0.95), 3), "s", 5.0, 1.0)
    report("alerts lost", expected - len(every), "incidents", 0)


if __name__ == "__main__":
    main()
