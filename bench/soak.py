"""Soak: ten clusters' worth of producers for a fixed time through the local pipeline.

1. Record: a real LocalCluster with the producers attached runs a mixed workload
   (arrays, a dataframe groupby, nested spans, futures, a failing task) for
   ``--record`` seconds; its raw envelopes are read back from the broker.
2. Replay: ten replayers send the recording at its real pace, each looping it under
   a new cluster id per loop (every loop ends with the recording's scheduler_close),
   so the pipeline sees ten clusters that keep starting, working and finishing.
3. Meanwhile the RSS of the broker, the faust worker and the sink is sampled, and the
   size of the broker's data directory (Apache Kafka; Tansu keeps all in memory).

Prints events in and rows out per kind (they must be equal) and each process's
memory, and the broker's disk, at the start, middle and end of the run.

``--broker kafka`` runs the pipeline on Apache Kafka (``blackbox.local.kafka-home``)
with a short topic retention (``--retention``, default 60s): its memory and disk must
level off (middle -> end growth at most 1.25x), while Tansu keeps everything.

    python bench/soak.py [--seconds 300] [--quick] [--broker tansu|kafka] [--retention 60s]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pathlib
import tempfile
import threading
import time
import uuid

import dask.config
import orjson
import psutil

from report import report

#: Event kind -> (table, how many rows one event makes)
ROWS_PER_EVENT = {
    "transition": ("transitions", lambda e: 1),
    "event": ("events", lambda e: 1),
    "lifecycle": ("lifecycle", lambda e: 1),
    "scheduler_metrics": ("scheduler_metrics", lambda e: 1),
    "worker_metrics": ("worker_metrics", lambda e: 1),
    "log": ("logs", lambda e: 1),
    "graph": ("graphs", lambda e: 1),
    "span": ("spans", lambda e: 1),
    "drops": ("drops", lambda e: 1),
    "worker_digests": ("worker_digests", lambda e: len(e["digests"])),
}


def record(seconds: float) -> list[tuple[float, dict]]:
    """Run a real workload with the producers attached; return its envelopes with
    their send offsets from the first one."""
    import dask
    import dask.array as da
    import pandas as pd
    from distributed import Client, LocalCluster, span

    from dask_blackbox import producers

    def boom(x):
        raise ValueError(x)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        producers.attach(client, cluster_name="soak-recording")
        t_end = time.monotonic() + seconds
        i = 0
        with dask.config.set({"optimization.fuse.active": False}):
            while time.monotonic() < t_end:
                with span("soak", f"round {i % 3}"):
                    da.random.random((400, 400), chunks=100).sum().compute()
                    frame = pd.DataFrame({"k": [j % 5 for j in range(2000)], "v": range(2000)})
                    import dask.dataframe as dd
                    dd.from_pandas(frame, npartitions=4).groupby("k").v.sum().compute()
                    client.gather(client.map(lambda x: x + 1, range(20), key=[f"inc-{i}-{j}" for j in range(20)]))
                    try:
                        client.submit(boom, i, key=f"boom-{i}").result()
                    except ValueError:
                        pass
                i += 1
                time.sleep(0.5)
    return _read_raw()


def _read_raw() -> list[tuple[float, dict]]:
    from dask_blackbox.testing.replay import read_raw

    from dask_blackbox import contract

    envelopes = sorted((contract.decode_envelope(value) for _, value in asyncio.run(read_raw(idle=3))),
                       key=lambda e: e["sent_at"])
    t0 = envelopes[0]["sent_at"]
    return [(e["sent_at"] - t0, e) for e in envelopes]


async def replay(recording, replayers: int, seconds: float) -> collections.Counter:
    """Send the recording ``replayers`` times in parallel, looped, at its pace."""
    from aiokafka import AIOKafkaProducer

    from dask_blackbox import config, contract

    producer = AIOKafkaProducer(**config.kafka_producer_kwargs(), linger_ms=5,
                                max_request_size=2**20)
    await producer.start()
    sent = collections.Counter()
    deadline = time.monotonic() + seconds
    topic = config.topic("raw")

    async def one(n: int) -> None:
        loop = 0
        while time.monotonic() < deadline:
            cluster_id = f"soak-{n}-{loop}-{uuid.uuid4().hex[:6]}"
            start = time.monotonic()
            for offset, envelope in recording:
                delay = start + offset - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                copy = {**envelope, "cluster_id": cluster_id, "cluster_name": f"soak-{n}",
                        "producer_id": f"{envelope['producer_id']}-{cluster_id}",
                        "sent_at": time.time()}
                await producer.send(topic, orjson.dumps(copy), key=cluster_id.encode())
                for event in contract.expand_events(envelope["events"]):
                    if event["kind"] in ROWS_PER_EVENT:
                        table, rows = ROWS_PER_EVENT[event["kind"]]
                        sent[table] += rows(event)
            loop += 1
        sent["loops"] += loop

    try:
        await asyncio.gather(*(one(n) for n in range(replayers)))
        await producer.flush()
    finally:
        await producer.stop()
    return sent


def dir_size(path: pathlib.Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_blocks * 512 if p.is_file() else 0
        except OSError:  # deleted by retention meanwhile
            pass
    return total


def sample_memory(pipeline, stop: threading.Event, every: float, out: list,
                  broker_dir: pathlib.Path | None = None) -> None:
    procs = {c.name: psutil.Process(c.proc.pid) for c in pipeline.children}
    t0 = time.monotonic()
    while not stop.wait(every):
        sample = {name: p.memory_info().rss for name, p in procs.items() if p.is_running()}
        if broker_dir is not None:
            sample["broker disk"] = dir_size(broker_dir)
        out.append((time.monotonic() - t0, sample))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--record", type=float, default=20.0)
    parser.add_argument("--clusters", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="60 s replay, 10 s recording")
    parser.add_argument("--broker", choices=("tansu", "kafka"), default="tansu")
    parser.add_argument("--retention", default="60s",
                        help="topic retention on --broker kafka (default 60s)")
    args = parser.parse_args()
    seconds, rec_seconds = (60.0, 10.0) if args.quick else (args.seconds, args.record)

    from dask_blackbox.cli.demo import quiet_dask_console
    from dask_blackbox.deploy.supervisor import LocalPipeline, wait_drained
    from dask_blackbox import contract
    from dask_blackbox.read import queries

    quiet_dask_console()  # the recording's failing tasks fail on purpose
    with tempfile.TemporaryDirectory() as data_dir:
        dask.config.set({"blackbox.data-dir": data_dir,
                         # finished clusters leave the processors' memory soon
                         "blackbox.processors.finished-cluster-ttl": "15s"})
        if args.broker == "kafka":
            dask.config.set({"blackbox.kafka.retention": args.retention})
        pipeline = LocalPipeline(broker=args.broker)
        began = time.monotonic()
        pipeline.start(progress=lambda m: print(m, flush=True))
        print(f"pipeline on {args.broker} healthy in {time.monotonic() - began:.1f}s", flush=True)
        broker_dir = (pathlib.Path(data_dir) / "kafka") if args.broker == "kafka" else None
        try:
            recording = record(rec_seconds)
            n_events = sum(len(contract.expand_events(e["events"])) for _, e in recording)
            span_s = recording[-1][0]
            print(f"recorded {len(recording)} envelopes, {n_events} events over {span_s:.1f}s "
                  f"({n_events / max(span_s, 1e-9):.0f} events/s per cluster)", flush=True)
            samples: list = []
            stop = threading.Event()
            sampler = threading.Thread(target=sample_memory, args=(pipeline, stop, 2.0, samples, broker_dir))
            sampler.start()
            t0 = time.monotonic()
            sent = asyncio.run(replay(recording, args.clusters, seconds))
            drained = wait_drained(timeout=300)
            print(f"replayed {sent.pop('loops')} cluster lifetimes in "
                  f"{time.monotonic() - t0:.0f}s; drained: {drained}", flush=True)
            stop.set()
            sampler.join()
            backend = queries.connect()
            got = {}
            for table in sorted(sent):
                _, [[n]] = backend.query(
                    f"SELECT count() FROM {table} WHERE startsWith(cluster_id, 'soak-') "
                    "AND NOT startsWith(cluster_id, 'soak-recording')")
                got[table] = n
        finally:
            pipeline.stop(drain_timeout=0)

    print(f"\n{'table':<20}{'events in':>12}{'rows out':>12}")
    for table in sorted(sent):
        print(f"{table:<20}{sent[table]:>12}{got[table]:>12}")
    events_in, rows_out = sum(sent.values()), sum(got.values())
    print(f"{'total':<20}{events_in:>12}{rows_out:>12}  "
          f"{'EQUAL' if events_in == rows_out else 'NOT EQUAL'}")
    thirds = [samples[: max(1, len(samples) // 10)],
              samples[len(samples) // 2 - len(samples) // 20: len(samples) // 2 + len(samples) // 20 + 1],
              samples[-max(1, len(samples) // 10):]]
    print(f"\non {args.broker}"
          + (f" (retention {args.retention})" if args.broker == "kafka" else "")
          + f"; {len(samples)} samples, one per 2 s")
    print("peak RSS / disk (MiB) at the start / middle / end of the run (10% windows)")
    for name in samples[0][1]:
        peaks = [max(s[1].get(name, 0) for s in window) / 2**20 for window in thirds]
        print(f"  {name:<14}" + " / ".join(f"{p:7.1f}" for p in peaks))
        if name != "broker" and name != "broker disk":
            report(f"soak {name} RSS growth, middle -> end", peaks[2] / peaks[1], "x",
                   target=1.25, aim=1.1)
        elif args.broker == "kafka":
            what = "RSS" if name == "broker" else "data directory"
            report(f"soak Kafka broker {what} growth, middle -> end",
                   peaks[2] / max(peaks[1], 1e-9), "x", target=1.25, aim=1.1)
    report("soak rows out / events in", rows_out / max(events_in, 1), "ratio",
           target=1.0, better="higher")


if __name__ == "__main__":
    main()
