"""Sink ingest rate, bytes per transition on disk, and query latency at scale.

Generates ``--transitions`` task transitions (default 10 million) across
``--clusters`` clusters (default 100) with realistic shapes -- task stories of
released/waiting/(queued)/processing/memory/released/forgotten with an erred minority,
tuple and string keys, Dask's stimulus ids, compute/transfer startstops, graphs
submitted inside nested spans, and the matching scheduler and worker metrics, log
records, span snapshots and per-minute prefix partials -- and loads them through the
sink's own loading path (``sinks.batch.Batch`` + ``sinks.loader.Loader``, the code the
consumer runs per batch) into a fresh chDB directory. Then it prints:

- ingest: rows per second through the sink path (generation excluded), all tables and
  transitions alone;
- bytes per transition on disk (transitions table alone, and everything);
- median latency of ``story`` (one key, with and without --cluster), one cluster's
  span tree, and top prefixes over the last day across all clusters.

``--e2e N`` additionally loads N transitions end to end: a Tansu broker, the sink as a
subprocess (``python -m dask_blackbox.cli.sink``), the envelopes produced to Kafka as the
producers send them (zstd). Twice: produced while the sink runs, timed from the first
message produced to the last row loaded (the bench's producer shares the two cores);
and as a backlog in Kafka before the sink starts, timed from the first loaded batch to
the last (the sink's own rate: group formation and chDB start-up are not ingest). It
also prints the latency of ``story`` through the sink's query server.

    python bench/query_latency.py            # the full run (~8 min on 2 cores)
    python bench/query_latency.py --quick    # 200k transitions, 300k end to end
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import dask.config
import orjson

from dask_blackbox import config, contract, kafka
from dask_blackbox import clickhouse
from dask_blackbox.read import backends, queries
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.tables import Message
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.service import tune_gc
from dask_blackbox.testing.settings import dask_env

from report import report

PREFIXES = [  # (prefix, relative frequency, median compute seconds, key style)
    ("getitem", 30, 0.002, "tuple"), ("rechunk-merge", 12, 0.03, "tuple"),
    ("sum-partial", 10, 0.02, "tuple"), ("read-parquet", 9, 0.4, "tuple"),
    ("apply", 8, 0.08, "tuple"), ("assign", 6, 0.01, "tuple"),
    ("shuffle-transfer", 6, 0.05, "tuple"), ("inc", 5, 0.001, "str"),
    ("fit-partial", 4, 1.5, "str"), ("to-parquet", 4, 0.3, "tuple"),
    ("array-original", 3, 0.005, "tuple"), ("sum-aggregate", 2, 0.01, "tuple"),
    ("load-image", 1, 0.2, "str"),
]
SPAN_TREES = [
    ("nightly-etl", ["load", "clean", "aggregate", "write"]),
    ("train-model", ["features", "fit", "evaluate"]),
    ("adhoc", []),
    ("image-pipeline", ["decode", "resize"]),
]
TOPIC = "bench.raw"
ENVELOPE_EVENTS = 1000
MAX_EVENTS_BYTES = contract.MAX_ENVELOPE_BYTES - 1000  # room for the envelope's own fields
GRAPH_MAX_TASKS = 2000  # so that one graph event fits an envelope


def _token(rng: random.Random) -> str:
    return "%032x" % rng.getrandbits(128)


class ClusterRun:
    """Generates one cluster's envelopes (scheduler + workers) and derived records."""

    def __init__(self, index: int, n_transitions: int, start: float, rng: random.Random) -> None:
        self.rng = rng
        self.cluster_id = uuid.UUID(int=rng.getrandbits(128)).hex
        tree_name, children = SPAN_TREES[index % len(SPAN_TREES)]
        self.cluster_name = f"{tree_name}-{index % 10}"
        self.tree = (tree_name, children)
        self.n_workers = max(2, min(64, int(rng.lognormvariate(2.0, 0.7))))
        self.workers = [f"tcp://10.{index // 250}.{index % 250}.{w}:{40000 + w}" for w in range(self.n_workers)]
        self.threads = 4
        self.n_transitions = n_transitions
        self.start = start
        self.scheduler_events: list[dict] = []
        self.worker_events: dict[str, list[dict]] = {w: [] for w in self.workers}
        self.span_state: list[dict] = []
        self.prefix_partials: dict[tuple, dict] = {}

    # ------------------------------------------------------------- generation

    def generate(self) -> None:
        rng, t = self.rng, self.start
        sched = self.scheduler_events
        sched.append({"kind": contract.LIFECYCLE, "ts": t, "action": "scheduler_start"})
        for w in self.workers:
            sched.append({"kind": contract.LIFECYCLE, "ts": t, "action": "worker_added", "worker": w})
        root_name, children = self.tree
        root_id = str(uuid.UUID(int=rng.getrandbits(128)))
        spans = [(root_id, [root_name], "")] + [
            (str(uuid.UUID(int=rng.getrandbits(128))), [root_name, c], root_id) for c in children
        ]
        leaves = spans[1:] or spans
        emitted = 0
        leaf_index = 0
        while emitted < self.n_transitions:
            span_id, name, parent = leaves[leaf_index % len(leaves)]
            leaf_index += 1
            t, n = self._computation(t, span_id, min(self.n_transitions - emitted, rng.randint(2_000, 40_000)))
            emitted += n
            t += rng.expovariate(1 / 30)
        end = t
        for span_id, name, parent in spans:
            sched.append({"kind": contract.SPAN, "ts": self.start, "span_id": span_id, "name": name,
                          "parent_id": parent or None, "enqueued": self.start})
        self._metrics(self.start, end)
        for w in self.workers:
            sched.append({"kind": contract.LIFECYCLE, "ts": end, "action": "worker_removed", "worker": w,
                          "stimulus_id": f"remove-worker-{end}"})
        sched.append({"kind": contract.LIFECYCLE, "ts": end, "action": "scheduler_close"})
        sched.sort(key=lambda e: e["ts"])  # a producer sends events in the order they happen
        for events in [sched, *self.worker_events.values()]:
            for event in events:  # producers send every contract field, None when unknown
                for field in contract.EVENT_FIELDS[event["kind"]]:
                    event.setdefault(field, None)
        self._span_snapshots(spans, end)
        self.end = end

    def _computation(self, t: float, span_id: str, budget: int) -> tuple[float, int]:
        """One graph submission: a few task groups, each task's story."""
        rng = self.rng
        names, weights = zip(*[(p, w) for p, w, _, _ in PREFIXES])
        stimulus = f"update-graph-{t:.6f}"
        graph_tasks, emitted, keys = [], 0, []
        sched = self.scheduler_events
        slots = [t] * (self.n_workers * self.threads)
        while emitted < budget:
            prefix = rng.choices(names, weights)[0]
            _, _, median, style = next(p for p in PREFIXES if p[0] == prefix)
            group = f"{prefix}-{_token(rng)}"
            n_tasks = min(max(1, int(rng.lognormvariate(4.0, 1.2))), (budget - emitted) // 4 + 1)
            for i in range(n_tasks):
                key = str((group, i // 32, i % 32)) if style == "tuple" else f"{prefix}-{_token(rng)}"
                keys.append(key)
                graph_tasks.append({"key": key, "prefix": prefix, "group": group, "span_id": span_id,
                                    "dependencies": [keys[-2]] if len(keys) > 1 and i else []})
                emitted += self._task_story(key, prefix, group, span_id, t, stimulus, median, slots)
        sched.append({"kind": contract.GRAPH, "ts": t, "client": "Client-bench", "stimulus_id": stimulus,
                      "n_tasks": len(graph_tasks), "keys": keys[-1:], "tasks": graph_tasks[:GRAPH_MAX_TASKS],
                      "annotations": {"span": {"name": ["bench"], "ids": [span_id]}}})
        return max(slots), emitted

    def _task_story(self, key, prefix, group, span_id, t0, stimulus, median, slots) -> int:
        rng = self.rng
        slot = min(range(len(slots)), key=slots.__getitem__) if len(slots) < 64 else rng.randrange(len(slots))
        worker = self.workers[slot // self.threads]
        begin = max(slots[slot], t0) + rng.expovariate(1000)
        duration = rng.lognormvariate(0, 0.6) * median
        stop = begin + duration
        slots[slot] = stop
        common = {"kind": contract.TRANSITION, "key": key, "prefix": prefix, "group": group, "span_id": span_id}
        story = [
            dict(common, ts=t0 + 1e-5, start="released", finish="waiting", stimulus_id=stimulus),
        ]
        queued = rng.random() < 0.3
        if queued:
            story.append(dict(common, ts=t0 + 2e-5, start="waiting", finish="queued", stimulus_id=stimulus))
        story.append(dict(common, ts=begin - 1e-4, start="queued" if queued else "waiting", finish="processing",
                          stimulus_id=stimulus if not queued else f"task-finished-{begin - 1e-4:.6f}",
                          worker=worker))
        startstops = [{"action": "compute", "start": begin, "stop": stop}]
        if rng.random() < 0.2:
            startstops.insert(0, {"action": "transfer", "start": begin - 0.01, "stop": begin,
                                  "source": self.workers[rng.randrange(self.n_workers)]})
        erred = rng.random() < 0.002
        if erred:
            story.append(dict(common, ts=stop + 1e-4, start="processing", finish="erred",
                              stimulus_id=f"task-erred-{stop:.6f}", worker=worker, startstops=startstops,
                              exception="ValueError('bad row 17')", cause=key,
                              traceback='  File "etl.py", line 42, in clean\n    raise ValueError("bad row 17")\n'))
        else:
            nbytes = int(rng.lognormvariate(10, 2))
            story.append(dict(common, ts=stop + 1e-4, start="processing", finish="memory",
                              stimulus_id=f"task-finished-{stop:.6f}", worker=worker, nbytes=nbytes,
                              typename="numpy.ndarray" if prefix != "read-parquet" else "pandas.DataFrame",
                              startstops=startstops))
            release = stop + rng.expovariate(2)
            story.append(dict(common, ts=release, start="memory", finish="released",
                              stimulus_id=f"client-releases-keys-{release:.6f}"))
            story.append(dict(common, ts=release + 1e-5, start="released", finish="forgotten",
                              stimulus_id=f"client-releases-keys-{release:.6f}"))
        self.scheduler_events.extend(story)
        self._partial(span_id, prefix, stop, duration, startstops, erred, 0 if erred else story[-3].get("nbytes", 0))
        if rng.random() < 0.001:
            self.worker_events[worker].append({"kind": contract.LOG, "ts": stop, "logger": "distributed.worker",
                                               "level": "WARNING", "message": f"Long task {key} took {duration:.2f}s",
                                               "process": worker})
        return len(story)

    def _partial(self, span_id, prefix, ts, duration, startstops, erred, nbytes) -> None:
        window = int(ts // 60) * 60
        p = self.prefix_partials.setdefault((span_id, prefix, window), {
            "cluster_id": self.cluster_id, "cluster_name": self.cluster_name, "span_id": span_id,
            "prefix": prefix, "window_start": window,
            "partial_id": f"{self.cluster_id}:{span_id}:{prefix}:{window}",
            "finished": {}, "durations": {}, "nbytes": 0, "n_erred": 0, "max_duration": 0.0,
        })
        finish = "erred" if erred else "memory"
        p["finished"][finish] = p["finished"].get(finish, 0) + 1
        for ss in startstops:
            p["durations"][ss["action"]] = p["durations"].get(ss["action"], 0.0) + ss["stop"] - ss["start"]
        p["nbytes"] += nbytes
        p["n_erred"] += erred
        p["max_duration"] = max(p["max_duration"], duration)

    def _metrics(self, start: float, end: float) -> None:
        rng = self.rng
        t = start
        while t < end:
            self.scheduler_events.append({
                "kind": contract.SCHEDULER_METRICS, "ts": t, "tasks_by_state": {"memory": rng.randrange(1000),
                "processing": rng.randrange(100)}, "n_workers": self.n_workers,
                "n_threads": self.n_workers * self.threads, "memory": rng.randrange(2**34),
                "memory_managed": rng.randrange(2**33), "memory_unmanaged": rng.randrange(2**32),
                "memory_spilled": 0, "event_loop_interval": 0.02})
            for w in self.workers:
                self.worker_events[w].append({
                    "kind": contract.WORKER_METRICS, "ts": t + rng.random() / 10, "worker": w,
                    "memory": rng.randrange(2**32), "memory_managed": rng.randrange(2**31),
                    "memory_unmanaged": rng.randrange(2**30), "memory_spilled": 0,
                    "cpu": rng.random() * 400, "executing": rng.randrange(self.threads + 1),
                    "ready": rng.randrange(50), "in_flight": rng.randrange(5),
                    "event_loop_interval": 0.02, "gil_contention": rng.random() / 10})
            t += 1.0
        for w in self.workers:
            self.worker_events[w].sort(key=lambda e: e["ts"])

    def _span_snapshots(self, spans, end) -> None:
        partials = list(self.prefix_partials.values())
        for version, fraction in enumerate((0.5, 1.0)):
            for span_id, name, parent in spans:
                tree = {s for s, n, p in spans if s == span_id or p == span_id}
                mine = [p for p in partials if p["span_id"] in tree]
                durations: dict[str, float] = {}
                for p in mine:
                    for action, seconds in p["durations"].items():
                        durations[action] = durations.get(action, 0.0) + seconds * fraction
                self.span_state.append({
                    "cluster_id": self.cluster_id, "cluster_name": self.cluster_name, "span_id": span_id,
                    "name": name, "parent_id": parent or None, "version": version + 1,
                    "enqueued": self.start, "start": self.start + 0.1,
                    "stop": self.start + (end - self.start) * fraction,
                    "duration": sum(durations.values()), "nbytes_total": sum(p["nbytes"] for p in mine),
                    "states": {"memory": sum(p["finished"].get("memory", 0) for p in mine)},
                    "all_durations": durations,
                    "cumulative_worker_metrics": [["execute", p["prefix"], "thread-cpu", "seconds",
                                                   p["durations"].get("compute", 0.0)] for p in mine[:50]],
                    "done": fraction == 1.0, "updated_at": end})

    # ---------------------------------------------------------------- output

    def messages(self, offsets: dict) -> list[Message]:
        """Every Kafka message of this cluster, as the sink would receive them."""
        out = []
        key = self.cluster_id.encode()
        partition = int(self.cluster_id, 16) % 4

        def put(topic, value, ts):
            offset = offsets.get((topic, partition), 0)
            offsets[(topic, partition)] = offset + 1
            out.append(Message(topic, f"bench.{topic}", partition, offset, key, value, int(ts * 1000)))

        streams = [("scheduler", "sched-" + self.cluster_id, self.scheduler_events)] + [
            ("worker", f"worker-{self.cluster_id}-{i}", events) for i, events in enumerate(self.worker_events.values())
        ]
        for source, producer_id, events in streams:
            # Like a producer: envelopes of up to ENVELOPE_EVENTS events and at most
            # contract.MAX_ENVELOPE_BYTES, events in order.
            seq, chunk, size, last_ts = 0, [], 0, 0.0
            for event in events:
                encoded = orjson.dumps(event)
                if chunk and (len(chunk) == ENVELOPE_EVENTS or size + len(encoded) > MAX_EVENTS_BYTES):
                    put(contract.RAW, self._envelope(source, producer_id, seq, chunk), last_ts)
                    seq, chunk, size = seq + 1, [], 0
                chunk.append(encoded)
                size += len(encoded) + 1
                last_ts = event["ts"]
            if chunk:
                put(contract.RAW, self._envelope(source, producer_id, seq, chunk), last_ts)
        for record in self.span_state:
            put(contract.SPAN_STATE, orjson.dumps(record), record["updated_at"])
        for record in self.prefix_partials.values():
            put(contract.PREFIX_STATS, orjson.dumps(record), record["window_start"])
        return out


    def _envelope(self, source: str, producer_id: str, seq: int, events: list[bytes]) -> bytes:
        head = orjson.dumps({
            "schema": contract.SCHEMA_VERSION, "cluster_id": self.cluster_id,
            "cluster_name": self.cluster_name, "source": source, "producer_id": producer_id,
            "seq": seq, "sent_at": orjson.loads(events[-1])["ts"]})
        return head[:-1] + b',"events":[' + b",".join(events) + b"]}"


def generate(seed: int, index: int, n_clusters: int, per_cluster: int, now: float) -> ClusterRun:
    """Cluster ``index`` of ``n_clusters``: they started over the last two days, so
    "the last day" holds about half of them."""
    rng = random.Random(seed * 100_000 + index)
    run = ClusterRun(index, per_cluster, now - 2 * 86400 * (1 - index / n_clusters) - 3600, rng)
    run.generate()
    return run


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def disk_bytes(client, database: str, table: str | None = None) -> tuple[int, int]:
    where = "database = {db:String} AND active" + (" AND table = {t:String}" if table else "")
    rows = client.query(f"SELECT sum(bytes_on_disk), sum(rows) FROM system.parts WHERE {where}",
                        parameters={"db": database, "t": table or ""}).result_rows
    return int(rows[0][0] or 0), int(rows[0][1] or 0)


def in_process(args, directory: pathlib.Path) -> dict:
    target = Target("blackbox", 90 * 86400)
    client = clickhouse.open_client(f"chdb://{directory}")
    migrate(client, target)
    loader = Loader(client, target, "bench")
    per_cluster = args.transitions // args.clusters
    now = time.time()
    offsets: dict = {}
    sink_seconds = gen_seconds = sink_cpu = 0.0
    rows = transitions = 0
    samples = []  # (cluster name, key) for story lookups
    # Like the consumer: a batch loads in a thread while the next one is converted.
    pool = concurrent.futures.ThreadPoolExecutor(1)
    inflight = None
    batch, starts = Batch(), {}
    tune_gc()

    def hand_over(batch, starts):
        nonlocal inflight, rows, transitions
        loader.prepare(batch)
        if inflight is not None:
            inflight.result()
        inflight = pool.submit(loader.load, batch, starts)
        rows += batch.n_rows
        transitions += len(batch.tables["transitions"])

    print(f"generating and loading {per_cluster * args.clusters:,} transitions in {args.clusters} clusters...",
          flush=True)
    # Clusters are generated a tenth at a time (~1 GB of messages at 10 million), then
    # fed to the sink: fewer pauses of the pipeline for generation.
    chunk = max(1, args.clusters // 10)
    for first in range(0, args.clusters, chunk):
        t = time.perf_counter()
        gc.disable()  # generation is not what is measured; the sink's own GC settings apply below
        messages = []
        for index in range(first, min(first + chunk, args.clusters)):
            run = generate(args.seed, index, args.clusters, per_cluster, now)
            messages += run.messages(offsets)
            keys = [e["key"] for e in run.scheduler_events if e["kind"] == contract.TRANSITION]
            samples += [(run.cluster_name, run.cluster_id, k) for k in random.Random(index).sample(keys, 3)]
            del run, keys
        gc.enable()
        gen_seconds += time.perf_counter() - t
        t, cpu = time.perf_counter(), time.process_time()
        for message in messages:
            starts.setdefault((message.kafka_topic, message.partition), message.offset)
            batch.add(message)
            if batch.n_rows >= args.batch_rows:
                hand_over(batch, starts)
                starts, batch = {}, Batch()
        if inflight is not None:
            inflight.result()  # no loading in the background of the next generation
        sink_seconds += time.perf_counter() - t
        sink_cpu += time.process_time() - cpu
        del messages
        print(f"  {min(first + chunk, args.clusters)} clusters, {transitions:,} transitions loaded, "
              f"sink {rows / max(sink_seconds, 1e-9):,.0f} rows/s", flush=True)
    t, cpu = time.perf_counter(), time.process_time()
    if batch.n_messages:
        hand_over(batch, starts)
    inflight.result()
    pool.shutdown()
    sink_seconds += time.perf_counter() - t
    sink_cpu += time.process_time() - cpu
    result = {"rows": rows, "transitions": transitions, "sink_s": sink_seconds, "gen_s": gen_seconds,
              "sink_cpu_s": sink_cpu, "load": os.getloadavg()[0]}
    time.sleep(2)
    result["bytes_transitions"], _ = disk_bytes(client, "blackbox", "transitions")
    result["bytes_all"], _ = disk_bytes(client, "blackbox")
    t = time.perf_counter()
    client.command("OPTIMIZE TABLE blackbox.transitions FINAL")
    result["optimize_s"] = time.perf_counter() - t
    result["bytes_transitions_merged"], _ = disk_bytes(client, "blackbox", "transitions")

    backend = backends.DirectBackend(client, "blackbox")
    rng = random.Random(7)
    picks = [rng.choice(samples) for _ in range(args.repeat)]
    it = iter(picks * 3)
    story_rows = []

    def one_story(with_cluster=True):
        name, cid, key = next(it)
        _, rows_ = queries.story(backend, key, cluster=cid if with_cluster else None)
        story_rows.append(len(rows_))

    result["story_ms"] = median_ms(one_story, args.repeat)
    result["story_any_ms"] = median_ms(lambda: one_story(False), args.repeat)
    result["story_rows"] = statistics.median(story_rows)
    names = sorted({name for name, _, _ in samples})
    cids = sorted({cid for _, cid, _ in samples})
    tree_it = iter(cids * 3)
    result["tree_ms"] = median_ms(lambda: queries.spans(backend, tree=True, cluster=next(tree_it)), args.repeat)
    day = (now - 86400, now)
    result["prefixes_ms"] = median_ms(lambda: queries.prefixes(backend, since=day[0], until=day[1]), args.repeat)
    _, top = queries.prefixes(backend, since=day[0], until=day[1], limit=3)
    result["top"] = [(r[0], round(r[1]), r[7]) for r in top]
    result["sample_name"] = names[0]
    client.close()
    return result


def end_to_end(args, root: pathlib.Path) -> dict:
    """N transitions through Tansu and the sink subprocess, twice: produced while the
    sink runs (the bench's producer shares the two cores with broker and sink), and as
    a backlog the sink drains on its own."""
    from dask_blackbox.deploy.brokers import TansuBroker
    from aiokafka import AIOKafkaProducer

    broker = TansuBroker().start()
    port = broker.port
    clusters = max(1, args.e2e // 100_000)
    offsets: dict = {}
    payload = []
    for index in range(clusters):
        run = generate(args.seed + 1, index, clusters, args.e2e // clusters, time.time())
        payload += [(m.key, m.value) for m in run.messages(offsets) if m.topic == contract.RAW]
    sample_key = next(e["key"] for e in run.scheduler_events if e["kind"] == contract.TRANSITION)
    expected = sum(len(contract.expand_events(orjson.loads(v)["events"]))
                   for _, v in payload)
    sinks: list[subprocess.Popen] = []

    def settings(name: str) -> dict:
        return {"blackbox.kafka.bootstrap-servers": f"127.0.0.1:{port}",
                "blackbox.kafka.topic-prefix": name, "blackbox.data-dir": str(root / name),
                "blackbox.sink.group-id": f"bench-{name}"}

    def start_sink(name: str):
        env = {**os.environ, **dask_env(settings(name))}
        sink = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli.sink"], env=env,
                                stdout=subprocess.PIPE, stderr=open(root / f"{name}-sink.log", "wb"))
        sinks.append(sink)
        assert b"sink ready" in sink.stdout.readline(), (root / f"{name}-sink.log").read_text()
        return sink, backends.running_sink()

    def produce(messages):
        async def send():
            producer = AIOKafkaProducer(**config.kafka_producer_kwargs(), linger_ms=20,
                                        max_request_size=2**21)
            await producer.start()
            try:
                for key, value in messages:
                    await producer.send(config.topic(contract.RAW), value, key=key)
                await producer.flush()
            finally:
                await producer.stop()
        asyncio.run(send())

    def loaded(backend) -> tuple[int, int]:
        """(envelopes, events) loaded so far."""
        table = f"{backend.database}.envelopes"
        n, events = backend.query(f"SELECT count(), sum(n_events) FROM {table}")[1][0]
        return n, events

    def wait_loaded(backend) -> None:
        while loaded(backend)[0] < len(payload):
            time.sleep(0.05)

    try:
        # Live: warm up (the group forms, one message loads), then produce the rest.
        with dask.config.set(settings("live")):
            asyncio.run(kafka.ensure_topics())
            sink, backend = start_sink("live")
            produce(payload[:1])
            while loaded(backend)[0] < 1:
                time.sleep(0.1)
            t = time.perf_counter()
            produce(payload[1:])
            produced_s = time.perf_counter() - t
            wait_loaded(backend)
            live_s = time.perf_counter() - t
            story_remote = median_ms(lambda: queries.story(backend, sample_key), args.repeat)
            sink.terminate()
            sink.wait(60)
        # Backlog: everything is in Kafka before the sink starts; timed from the first
        # loaded batch (group formation and chDB start are not ingest) to the last.
        with dask.config.set(settings("drain")):
            asyncio.run(kafka.ensure_topics())
            produce(payload)
            sink, backend = start_sink("drain")
            while (first := loaded(backend))[0] == 0:
                time.sleep(0.02)
            t = time.perf_counter()
            wait_loaded(backend)
            drain_s = time.perf_counter() - t
            sink.terminate()
            sink.wait(60)
        return {"e2e_events": expected, "e2e_s": live_s, "e2e_produce_s": produced_s,
                "drain_events": expected - first[1], "drain_s": drain_s,
                "story_remote_ms": story_remote}
    finally:
        for sink in sinks:
            if sink.poll() is None:
                sink.kill()
        broker.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transitions", type=int, default=10_000_000)
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--batch-rows", type=int, default=100_000,
                        help="rows per sink batch (blackbox.sink.batch-max-rows)")
    parser.add_argument("--repeat", type=int, default=30, help="runs per latency median")
    parser.add_argument("--e2e", type=int, default=1_000_000,
                        help="also load this many transitions through Kafka and the sink process (0: skip)")
    parser.add_argument("--quick", action="store_true",
                        help="200k transitions in 10 clusters, 300k end to end: about a minute")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", help="keep the chDB directory here")
    args = parser.parse_args()
    if args.quick:
        args.transitions, args.clusters, args.repeat, args.e2e = 200_000, 10, 10, 300_000
    root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="bb-bench-"))
    try:
        r = in_process(args, root / "chdb")
        print()
        print(f"sink ingest, in-process batches of {args.batch_rows:,} rows: {r['rows']:,} rows "
              f"({r['transitions']:,} transitions) in {r['sink_s']:.1f}s; generation took "
              f"{r['gen_s']:.1f}s more; {r['rows'] / r['sink_cpu_s']:,.0f} rows per CPU-second (all "
              f"threads, 2 cores; load average {r['load']:.1f} at the end: other processes compete)")
        report("sink ingest, all tables (in-process)", round(r["rows"] / r["sink_s"]), "rows/s",
               100_000, better="higher")
        report("sink ingest, transitions alone (in-process)", round(r["transitions"] / r["sink_s"]),
               "transitions/s", 100_000, better="higher")
        print(f"disk: OPTIMIZE FINAL took {r['optimize_s']:.0f}s")
        report("bytes per transition on disk (transitions table)",
               round(r["bytes_transitions"] / r["transitions"], 1), "bytes", 60, 20)
        report("bytes per transition on disk (transitions table, merged)",
               round(r["bytes_transitions_merged"] / r["transitions"], 1), "bytes", 60, 20)
        report("bytes per transition on disk (all tables)", round(r["bytes_all"] / r["transitions"], 1),
               "bytes", 60, 20)
        print(f"story: {r['story_rows']:.0f} rows per key; top prefixes of the day: {r['top']}")
        report("story KEY --cluster ID (median)", round(r["story_ms"], 1), "ms", 100)
        report("story KEY, all clusters (median)", round(r["story_any_ms"], 1), "ms", 100)
        report("span tree of a cluster (median)", round(r["tree_ms"], 1), "ms", 200)
        report("top prefixes over a day, all clusters (median)", round(r["prefixes_ms"], 1), "ms", 1000)
        if args.e2e:
            e = end_to_end(args, root)
            print(f"end to end: {e['e2e_events']:,} events in {e['e2e_s']:.1f}s "
                  f"(producing them took {e['e2e_produce_s']:.1f}s of it)")
            report("sink ingest end to end through Kafka, produced meanwhile (sink process)",
                   round(e["e2e_events"] / e["e2e_s"]), "events/s", None, better="higher")
            print(f"backlog: {e['drain_events']:,} events after the first batch in {e['drain_s']:.1f}s")
            report("sink ingest end to end, draining a Kafka backlog (sink process)",
                   round(e["drain_events"] / e["drain_s"]), "events/s", 100_000, better="higher")
            report("story through the sink's query server (median)", round(e["story_remote_ms"], 1), "ms", 100)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
