"""Record the corpus the sink's fuzzing mutates: ``sink_corpus.json`` beside this file.

Runs a small workload on a real LocalCluster with the real producers attached, on a
Tansu broker of its own, with the real stream processors (faust) turning the raw topic
into derived records; then reads every topic back. One garbage message is published on
the raw topic too, so that the processors publish a dead letter of their own.

    python tests/data/record_sink_corpus.py        # about a minute

The file holds ``{"raw": [...], "span-state": [...], ...}``: each message's value as
text (UTF-8, as published), in publication order per topic. The fuzzing tier
(tests/unit/test_fuzz_sink.py) and bench/fuzz.py read it; run this again after a contract
change to record what producers send now.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import sys
import tempfile
import time
import uuid

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the support modules

import dask  # noqa: E402
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster, span, wait  # noqa: E402

from dask_blackbox import contract, kafka, producers  # noqa: E402
from dask_blackbox.deploy.brokers import TansuBroker, free_port  # noqa: E402
from dask_blackbox.testing.kafka_reader import read_records  # noqa: E402
from dask_blackbox.testing.processors import FaustWorker, env_for  # noqa: E402
from sink_support import produce  # noqa: E402

OUT = HERE / "sink_corpus.json"


def inc(x):
    return x + 1


def div(a, b):
    return a / b


def log_from_worker(i):
    logging.getLogger("distributed.worker").warning("corpus line %d", i)
    return i


def workload(client: Client) -> None:
    with span("etl"):
        with span("load"):
            x = da.random.random((60, 60), chunks=20)
        with span("transform"):
            (x + x.T).sum().compute()
    y = (da.ones((40, 40), chunks=20) * 2).persist()
    wait(y)
    client.gather(client.map(inc, range(10)))
    bad = client.submit(div, 1, 0, key="div-bad")
    wait([bad, client.submit(inc, bad, key="inc-dependent")])
    client.gather(client.map(log_from_worker, range(3)))
    client.log_event("custom-client", {"n": 1, "t": (1, 2), "d": {"a": [1, 2.5, None]}})


def main() -> None:
    port = free_port()
    tansu = TansuBroker(port).start()
    prefix = "corpus" + uuid.uuid4().hex[:6]
    settings = {"blackbox.kafka.bootstrap-servers": f"127.0.0.1:{port}",
                "blackbox.kafka.topic-prefix": prefix}
    faust = None
    try:
        with dask.config.set({**settings, "optimization.fuse.active": False}), \
                tempfile.TemporaryDirectory() as work:
            asyncio.run(kafka.ensure_topics())
            faust = FaustWorker(env_for({**settings, "blackbox.processors.app-id": prefix}),
                                pathlib.Path(work)).start()
            with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                              dashboard_address=":0") as cluster, Client(cluster) as client:
                producers.attach(client, **{"producer.flush-interval": "20ms",
                                            "producer.metrics-interval": "100ms"})
                workload(client)
                cluster.scale(3)
                client.wait_for_workers(3)
                time.sleep(1.0)
                producers.detach(client)
            produce([(b"garbage", b'{"schema": 1, "events": "not a list"')])
            deadline = time.time() + 120
            while time.time() < deadline:
                if read_records(contract.SPAN_STATE, idle=0.5) and \
                        read_records(contract.DEAD_LETTER, idle=0.5):
                    break
                time.sleep(2)
            time.sleep(3)  # the processors' last windows
            corpus = {topic: [r.value.decode() for r in read_records(topic, idle=1.0)]
                      for topic in contract.TOPICS}
    finally:
        if faust is not None:
            faust.stop()
        tansu.stop()
    OUT.write_text(json.dumps(corpus, indent=0) + "\n")
    print(OUT, {t: len(v) for t, v in corpus.items()},
          f"{OUT.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
