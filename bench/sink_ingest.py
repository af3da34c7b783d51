"""Sink ingest per core: envelope version 2 (JSON) against version 3 (MessagePack), the
same events.

Generates ``--transitions`` task transitions (default 10 million) in ``--clusters``
clusters (query_latency.py's realistic clusters: task stories, graphs in spans,
scheduler and worker metrics, logs, span snapshots, prefix partials) and encodes them
twice, the same events in the same envelopes:

- **A**: as version 2 producers sent them: the producers' own ``pack`` (each run of
  transitions one ``TRANSITION_RUN`` event), JSON envelopes of at most
  ``contract.MAX_ENVELOPE_BYTES``;
- **B**: as the producers send them: their own ``pack_captured`` (each run of
  transition items, as a hook offers them, one ``CAPTURE``), MessagePack envelopes.

The messages of each are written to a file once; then each route loads all of its own
into a fresh chDB directory through the sink's own code (``Batch`` + ``Loader``, a
batch loading in a thread while the next one is converted, as the consumer does), in a
process of its own: this checkout's sink, or for A the sink of ``--baseline`` (a git
revision, its ``dask_blackbox`` package rebuilt from ``git archive``) if given.

Runs alternate A, B, A, B, ... (``--runs`` each), so the machine's noise falls on
both. Per run: rows per CPU-second of the sink's own work (decoding, checking,
columns and Arrow, on the consumer's thread: what a sink process spends against a
ClickHouse server, *per core*), rows per CPU-second of the whole process with chDB in
it (ClickHouse's parsing, writing and background merging included, every thread),
and rows per second of wall clock.
Both routes must leave the same rows in every table, the page aggregates and roll-ups
among them (compared by a hash of each table's rows, ``_batch`` aside, and the
envelopes' ``n_bytes``: each encoding's size; an aggregate's rows merged and
finalized).

- ``--view-cost``: instead of A against B, B loaded with every materialized view on
  ``transitions`` (the page aggregates' and the roll-up's) and with none, alternating
  (``--runs`` each): the views' share of ClickHouse's CPU per row loaded is the
  difference. After each load with the views, each view's own cost: its query run
  again by itself over each batch's transitions (held in memory, one thread, merges
  stopped) into an empty copy of its table.

- **C**, for the record: what ClickHouse itself spends to parse the same raw envelopes
  and explode their transition runs into rows (a ``SELECT`` over the raw messages;
  no checks, no dead letters, no insert), per transition, beside B's conversion CPU
  per row: the measurement behind keeping the decoding in the sink.

    python bench/sink_ingest.py                 # 10M transitions, 2 runs per route
    python bench/sink_ingest.py --quick         # 500k transitions, 1 run per route
    python bench/sink_ingest.py --baseline REV  # A loaded by REV's sink
    python bench/sink_ingest.py --baseline REV --a-version 3  # both version 3: two sinks
    python bench/sink_ingest.py --view-cost --runs 3  # what each view costs per row
    python bench/sink_ingest.py --a-version 3 --alter codecs.sql  # B's tables altered

- ``--alter FILE``: SQL statements (``;``-separated, the migrations' single-node
  placeholders filled) run on B's database after migrating and before loading: a codec
  or a table setting under test, against A without it. Every run prints the bytes on
  disk per transition after its load (every table's active parts), and the tables
  that hold most of them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from report import report  # noqa: E402

TARGET, AIM = 300_000, 500_000
TOPICS = ("raw", "span-state", "prefix-stats")
#: The materialized views on transitions and the tables they fill (--view-cost).
VIEWS = {"blackbox.task_seconds_mv": "blackbox.task_seconds",
         "blackbox.stream_seconds_mv": "blackbox.stream_seconds",
         "blackbox.group_totals_mv": "blackbox.group_totals",
         "blackbox_rollups.task_minutes_mv": "blackbox_rollups.task_minutes"}
_HEAD = struct.Struct("<BIqqII")  # topic, partition, offset, timestamp, key and value lengths


# ------------------------------------------------------------------ generation


def _item(event: dict, encode) -> object:
    """The TransitionItem a hook offers for a TRANSITION event: Dask's kwargs as the
    MessagePack the hook makes of them, an erred one's error as the drain reads it."""
    from dask_blackbox import contract
    from dask_blackbox.producers.rows import TransitionItem

    carried = tuple(map(event.get, contract.TRANSITION_KWARGS))
    error = tuple(map(event.get, contract.CAPTURE_ERROR))
    return TransitionItem(
        event["key"], event["start"], event["finish"], event.get("stimulus_id"), event["ts"],
        None, (event.get("prefix"), event.get("group"), event.get("span_id")),
        None if carried.count(None) == len(carried) else encode(carried),
        None if error.count(None) == len(error) else error)


def encode_cluster(run, put, put_v3) -> int:
    """Call ``put(topic, partition, key, value, ts)`` for every message of ``run`` (a
    query_latency.py ClusterRun) as version 2 producers and the processors published
    them (raw envelopes packed by the producers' own ``pack``, then its span snapshots
    and prefix partials), and ``put_v3`` for each the same as the producers send it
    (the same events of each raw envelope, ``pack_captured``). Returns how many events
    the envelopes carry."""
    import msgspec

    from dask_blackbox import contract
    from dask_blackbox.producers.rows import Ready, RowMaker, TransitionRow
    from dask_blackbox.producers.sender import (
        BATCH_WEIGHT, Identity, envelope, pack, pack_captured,
    )

    encode = msgspec.msgpack.Encoder().encode
    maker = RowMaker(100_000)
    fields = contract.fields(contract.Transition)[1:]
    key = run.cluster_id.encode()
    partition = int(run.cluster_id, 16) % 4
    streams = [("scheduler", f"scheduler-{run.cluster_id}", run.scheduler_events)] + [
        ("worker", f"worker-{run.cluster_id}-{i}", events)
        for i, events in enumerate(run.worker_events.values())]
    n_events = 0
    for source, producer_id, events in streams:
        identity = Identity(source, run.cluster_id, run.cluster_name, producer_id)
        seq, rows, items, weight = 0, [], [], 0
        for i, event in enumerate(events):
            if event["kind"] == contract.TRANSITION:
                rows.append(TransitionRow(*(event.get(f) for f in fields)))
                items.append(_item(event, encode))
                weight += 200
            else:
                rows.append(Ready(event, 0))
                items.append(rows[-1])
                weight += 300
            if weight >= BATCH_WEIGHT or i == len(events) - 1:
                done = 0
                for body in pack(rows, 100_000):  # like a sender's take
                    head = json.dumps({
                        "schema": 2, "cluster_id": run.cluster_id,
                        "cluster_name": run.cluster_name, "source": source,
                        "producer_id": producer_id, "seq": seq, "sent_at": event["ts"],
                    }, separators=(",", ":")).encode()
                    put("raw", partition, key, head[:-1] + b',"events":' + body.events + b"}",
                        event["ts"])
                    # the same events in the same envelope, as the producers send them
                    entries, _ = maker.rows(items[done:done + body.n_rows], captured=True)
                    (captured,) = pack_captured(entries, maker)
                    put_v3("raw", partition, key,
                           envelope(identity, seq, captured.events, event["ts"]), event["ts"])
                    done += body.n_rows
                    seq += 1
                n_events += len(rows)
                rows, items, weight = [], [], 0
    for record in run.span_state:
        value = json.dumps(record).encode()
        put("span-state", partition, key, value, record["updated_at"])
        put_v3("span-state", partition, key, value, record["updated_at"])
    for record in run.prefix_partials.values():
        value = json.dumps(record).encode()
        put("prefix-stats", partition, key, value, record["window_start"])
        put_v3("prefix-stats", partition, key, value, record["window_start"])
    return n_events


class MessageFile:
    """Messages written to a file as they are made (``put``), read back by
    :func:`read_messages`."""

    def __init__(self, path: pathlib.Path) -> None:
        self.out = open(path, "wb")
        self.offsets: dict = {}
        self.counts = {"messages": 0, "bytes": 0, "events": 0}

    def put(self, topic: str, partition: int, key: bytes, value: bytes, ts: float) -> None:
        offset = self.offsets.get((topic, partition), 0)
        self.offsets[(topic, partition)] = offset + 1
        self.out.write(_HEAD.pack(TOPICS.index(topic), partition, offset, int(ts * 1000),
                                  len(key), len(value)))
        self.out.write(key)
        self.out.write(value)
        self.counts["messages"] += 1
        self.counts["bytes"] += len(value)

    def close(self) -> dict:
        self.out.close()
        return self.counts


def generate(args, path: pathlib.Path, path_v3: pathlib.Path) -> tuple[dict, dict]:
    """Write every message of the run to ``path`` (version 2) and ``path_v3``; return
    the counts of each."""
    from query_latency import generate as cluster_run

    per_cluster = args.transitions // args.clusters
    now = time.time()
    out, out_v3 = MessageFile(path), MessageFile(path_v3)
    for index in range(args.clusters):
        run = cluster_run(args.seed, index, args.clusters, per_cluster, now)
        n = encode_cluster(run, out.put, out_v3.put)
        out.counts["events"] += n
        out_v3.counts["events"] += n
        del run
    return out.close(), out_v3.close()


def read_messages(path: pathlib.Path):
    """The messages of ``path`` as the sink's ``Message``s, one at a time."""
    from dask_blackbox.sinks.tables import Message

    with open(path, "rb") as f:
        while head := f.read(_HEAD.size):
            topic, partition, offset, ts, nkey, nvalue = _HEAD.unpack(head)
            key, value = f.read(nkey), f.read(nvalue)
            yield Message(TOPICS[topic], f"bench.{TOPICS[topic]}", partition, offset, key, value, ts)


# ----------------------------------------------------------------- a route


def table_columns(client, table: str) -> list[tuple[str, str]]:
    """(name, type) of each column of ``table`` (``database.name``), in the table's order."""
    database, name = table.split(".")
    return client.query("SELECT name, type FROM system.columns WHERE database = {d:String} "
                        "AND table = {t:String} ORDER BY position",
                        parameters={"d": database, "t": name}).result_rows


def view_costs(client) -> dict:
    """CPU seconds of each view's query by itself over the transitions just loaded,
    batch by batch, beyond counting the batch's rows (``--view-cost``)."""
    client.command("SYSTEM STOP MERGES")
    batches = [b for (b,) in client.query(
        "SELECT DISTINCT _batch FROM blackbox.transitions ORDER BY _batch").result_rows]
    for i, b in enumerate(batches):  # each batch's rows in memory, as a view is given them
        client.command(f"CREATE TABLE blackbox.bench_batch_{i} ENGINE = Memory "
                       f"AS SELECT * FROM blackbox.transitions WHERE _batch = {b}")

    def cpu(statement: str) -> float:
        t = time.process_time()
        for i in range(len(batches)):
            client.command(statement.replace("{source}", f"blackbox.bench_batch_{i}"),
                           settings={"max_threads": 1})
        return time.process_time() - t

    read = cpu("SELECT count() FROM {source}")
    costs = {}
    for view, table in VIEWS.items():
        database, name = view.split(".")
        (query,), = client.query("SELECT as_select FROM system.tables WHERE database = {d:String} "
                                 "AND name = {n:String}", parameters={"d": database, "n": name}).result_rows
        copy = f"{table}_bench_copy"
        client.command(f"CREATE TABLE {copy} AS {table}")
        columns = ", ".join(f"`{c}`" for c, _ in table_columns(client, table))
        costs[view] = cpu(f"INSERT INTO {copy} ({columns}) SELECT {columns} FROM ("
                          + query.replace(" FROM blackbox.transitions ", " FROM {source} ") + ")") - read
    return costs


def load_route(messages: pathlib.Path, directory: pathlib.Path, batch_rows: int,
               drop_views: tuple[str, ...] = (), measure_views: bool = False,
               alter: str | None = None) -> dict:
    """Load every message through the sink's code as it is importable here (the
    materialized views ``drop_views`` dropped after migrating; ``measure_views``: each
    view's :func:`view_costs` after the load); runs in a route's own process."""
    import concurrent.futures
    import inspect

    from dask_blackbox import clickhouse
    from dask_blackbox.sinks.batch import Batch
    from dask_blackbox.sinks.loader import Loader
    from dask_blackbox.sinks.schema import Target, migrate
    from dask_blackbox.sinks.service import tune_gc
    from dask_blackbox.sinks.tables import AGGREGATES, COLUMNS, ROLLUPS

    target = Target("blackbox", 90 * 86400)
    client = clickhouse.open_client(f"chdb://{directory}")
    migrate(client, target)
    for view in drop_views:
        client.command(f"DROP VIEW {view}")
    if alter:
        from dask_blackbox.sinks.schema import render, statements

        for statement in statements(render(pathlib.Path(alter).read_text(), target)):
            client.command(statement)
    loader = Loader(client, target, "bench")
    pool = concurrent.futures.ThreadPoolExecutor(1)
    # As the consumer of each route makes its batches.
    if "schemas" in inspect.signature(Batch).parameters:
        def new_batch():
            return Batch(loader.schemas)
    else:
        new_batch = Batch
    tune_gc()
    inflight = None
    rows = 0
    convert_cpu = 0.0

    def hand_over(batch: Batch, starts: dict) -> None:
        nonlocal inflight, rows
        loader.prepare(batch)
        if inflight is not None:
            inflight.result()
        inflight = pool.submit(loader.load, batch, starts)
        rows += batch.n_rows

    batch, starts = new_batch(), {}
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    for message in read_messages(messages):
        starts.setdefault((message.kafka_topic, message.partition), message.offset)
        batch.add(message)
        if batch.n_rows >= batch_rows:
            hand_over(batch, starts)
            batch, starts = new_batch(), {}
    if batch.n_messages:
        hand_over(batch, starts)
    convert_cpu = time.thread_time() - thread
    inflight.result()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    pool.shutdown()
    hashes = {}
    for table in COLUMNS:
        columns = ", ".join(f"`{c}`" for c in COLUMNS[table]
                            if (table, c) != ("envelopes", "n_bytes"))  # the encoding's size
        n, digest = client.query(
            f"SELECT count(), groupBitXor(cityHash64(tuple({columns}))) FROM blackbox.{table}").result_rows[0]
        hashes[table] = [int(n), int(digest or 0)]
    for table in [*(f"blackbox.{t}" for t in AGGREGATES), *(f"blackbox_rollups.{t}" for t in ROLLUPS)]:
        columns = ", ".join(f"finalizeAggregation(`{c}`)" if kind.startswith("AggregateFunction") else f"`{c}`"
                            for c, kind in table_columns(client, table) if c != "_batch")
        n, digest = client.query(
            f"SELECT count(), sum(cityHash64(tuple({columns}))) FROM {table} FINAL").result_rows[0]
        hashes[table] = [int(n), int(digest or 0)]
    disk = dict(client.query("SELECT concat(database, '.', table), sum(bytes_on_disk) FROM system.parts "
                             "WHERE active AND database LIKE 'blackbox%' GROUP BY 1").result_rows)
    views = view_costs(client) if measure_views else {}
    client.close()
    return {"rows": rows, "wall": wall, "cpu": cpu, "convert_cpu": convert_cpu,
            "batch_rows": batch_rows, "disk": {t: int(b) for t, b in disk.items()},
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tables": hashes, "views": views, "load": os.getloadavg()[0]}


def parse_in_clickhouse(messages: pathlib.Path, directory: pathlib.Path) -> dict:
    """Route C: the raw envelopes in a Memory table, then ClickHouse's own CPU to
    parse them and explode every transition run into its rows (no checks, no insert)."""
    import pyarrow as pa

    from dask_blackbox import clickhouse

    client = clickhouse.open_client(f"chdb://{directory}")
    client.command("CREATE TABLE raw_envelopes (value String) ENGINE = Memory")
    chunk: list[bytes] = []
    for message in read_messages(messages):
        if message.topic == "raw":
            chunk.append(message.value)
            if len(chunk) == 500:
                client.insert_arrow("raw_envelopes", pa.table({"value": pa.array(chunk, pa.binary())}))
                chunk = []
    if chunk:
        client.insert_arrow("raw_envelopes", pa.table({"value": pa.array(chunk, pa.binary())}))
    run_type = ("Tuple(kind String, key Array(String), time Array(Float64), start Array(String), "
                "finish Array(String), stimulus_id Array(Nullable(String)), "
                "names Array(Array(Nullable(String))), name Array(UInt32), "
                "worker Array(Nullable(String)), nbytes Array(Nullable(Int64)), "
                "typename Array(Nullable(String)), startstops Array(Array(Tuple(action String, "
                "start Float64, stop Float64, source Nullable(String)))), "
                "thread Array(Nullable(UInt64)), exception Array(Nullable(String)))")
    query = f"""
        SELECT count(), sum(length(key)), sum(length(prefix)), sum(length(actions))
        FROM (
            SELECT JSONExtract(value, 'Tuple(cluster_id String, source String, producer_id String,
                                             seq UInt64, events Array(String))') AS envelope,
                   arrayJoin(tupleElement(envelope, 'events')) AS event,
                   JSONExtract(event, '{run_type}') AS run,
                   arrayJoin(arrayEnumerate(tupleElement(run, 'key'))) AS i,
                   tupleElement(run, 'key')[i] AS key,
                   tupleElement(run, 'names')[tupleElement(run, 'name')[i] + 1][1] AS prefix,
                   tupleElement(run, 'startstops')[i].action AS actions
            FROM raw_envelopes
            WHERE tupleElement(run, 'kind') = 'transition_run'
        )"""
    cpu = time.process_time()
    n, *_ = client.query(query).result_rows[0]
    cpu = time.process_time() - cpu
    client.close()
    return {"transitions": int(n), "cpu": cpu}


# ----------------------------------------------------------------- the runs


def view_cost(args, work: pathlib.Path, messages: pathlib.Path) -> None:
    """B loaded with every view and with none, ``--runs`` rounds: the views' share of
    ClickHouse's CPU per row loaded (the median of the rounds' differences), and each
    view's own (:func:`view_costs`, the median of the rounds)."""
    every, none, views = [], [], {v: [] for v in VIEWS}
    for n in range(args.runs):
        for drop in ((), tuple(VIEWS)):
            r = run_child("B", args, work, messages, None, n, drop, measure_views=not drop)
            share = (r["cpu"] - r["convert_cpu"]) / r["rows"] * 1e6
            (none if drop else every).append(share)
            for view, cpu in r["views"].items():
                views[view].append(cpu / r["rows"] * 1e6)
            print(f"  run {n + 1}, {'no view' if drop else 'every view'}: ClickHouse {share:.2f} us per row"
                  + "".join(f", {v.split('.')[1]} {views[v][-1]:.3f}" for v in r["views"])
                  + f" ({r['rows']:,} rows, load average {r['load']:.1f})", flush=True)
    report("ClickHouse CPU per row loaded, every view", round(statistics.median(every), 2), "us", None)
    report("ClickHouse CPU per row loaded, the views (every view minus none)",
           round(statistics.median(a - b for a, b in zip(every, none)), 2), "us", None)
    for view, costs in views.items():
        report(f"ClickHouse CPU per row loaded, {view} by itself", round(statistics.median(costs), 3),
               "us", None)


def on_disk(r: dict) -> str:
    """A run's bytes on disk per transition loaded, in all and for its three biggest tables."""
    n = r["tables"]["transitions"][0]
    top = sorted(r["disk"].items(), key=lambda kv: -kv[1])[:3]
    return (f"disk {sum(r['disk'].values()) / n:.1f} bytes per transition ("
            + ", ".join(f"{t.split('.')[1]} {b / n:.1f}" for t, b in top) + ")")


def baseline_package(revision: str, into: pathlib.Path) -> pathlib.Path:
    """A ``dask_blackbox`` package of ``revision`` (its folders mapped as pyproject
    maps them), importable by putting the returned directory first on sys.path."""
    archive = into / "archive"
    archive.mkdir()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(archive)], input=tar, check=True)
    package = into / "pkg"
    shutil.copytree(archive / "dask_blackbox", package / "dask_blackbox")
    for name in ("producers", "stream_processors", "sinks", "exporters", "read", "cli"):
        if (archive / name).is_dir():
            shutil.copytree(archive / name, package / "dask_blackbox" / name)
    return package


def run_child(route: str, args, work: pathlib.Path, messages: pathlib.Path,
              package: pathlib.Path | None, n: int, drop_views: tuple[str, ...] = (),
              measure_views: bool = False) -> dict:
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(package), env.get("PYTHONPATH", "")])
    directory = work / f"chdb-{route}-{n}"
    out = subprocess.run(
        [sys.executable, __file__, "--child", route, "--messages", str(messages),
         "--directory", str(directory),
         *(["--batch-rows", str(args.batch_rows)] if args.batch_rows else []),
         *(["--drop-views", ",".join(drop_views)] if drop_views else []),
         *(["--view-cost"] if measure_views else []),
         *(["--alter", str(pathlib.Path(args.alter).resolve())] if args.alter and route == "B" else [])],
        env=env, capture_output=True, text=True, cwd=work)
    shutil.rmtree(directory, ignore_errors=True)
    if out.returncode != 0:
        sys.exit(f"route {route} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "location" in result and package is not None and not result["location"].startswith(str(package)):
        sys.exit(f"route {route} imported {result['location']}, not the baseline")
    return result


def child(args) -> None:
    import dask_blackbox

    directory = pathlib.Path(args.directory)
    if args.batch_rows is None:
        from dask_blackbox import config

        args.batch_rows = config.get_int("sink.batch-max-rows")
    if args.child == "C":
        result = parse_in_clickhouse(pathlib.Path(args.messages), directory)
    else:
        result = load_route(pathlib.Path(args.messages), directory, args.batch_rows,
                            tuple(filter(None, (args.drop_views or "").split(","))), args.view_cost,
                            args.alter)
    result["location"] = dask_blackbox.__file__
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transitions", type=int, default=10_000_000)
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--runs", type=int, default=2, help="runs of each route (alternating)")
    parser.add_argument("--batch-rows", type=int,
                        help="rows per sink batch (default: each route's own "
                             "blackbox.sink.batch-max-rows)")
    parser.add_argument("--baseline", default=None,
                        help="git revision whose sink loads route A (default: this checkout)")
    parser.add_argument("--a-version", type=int, choices=(2, 3), default=2,
                        help="the envelope version route A reads (3: the same recording as "
                             "B, the sink of --baseline against this checkout's)")
    parser.add_argument("--quick", action="store_true", help="500k transitions, 1 run per route")
    parser.add_argument("--view-cost", action="store_true",
                        help="B with the views on transitions and without: their cost, and each one's")
    parser.add_argument("--alter", help="SQL run on B's database after migrating (a codec "
                        "or setting under test)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--messages", help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    parser.add_argument("--drop-views", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.transitions, args.clusters, args.runs = 500_000, 10, 1
    random.seed(args.seed)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bb-sink-ingest-"))
    try:
        package = baseline_package(args.baseline, work) if args.baseline else None
        files = {"A": work / "messages-v2.bin", "B": work / "messages-v3.bin"}
        t = time.perf_counter()
        counts = dict(zip(files, generate(args, files["A"], files["B"])))
        for route, c in counts.items():
            print(f"{route}: {c['events']:,} events in {c['messages']:,} messages "
                  f"({c['bytes'] / 1e6:,.0f} MB, version {2 if route == 'A' else 3})", flush=True)
        if args.a_version == 3:
            print("A reads B's messages (version 3)", flush=True)
            files["A"] = files["B"]
        print(f"generated in {time.perf_counter() - t:.0f}s", flush=True)
        if args.view_cost:
            view_cost(args, work, files["B"])
            return
        results: dict[str, list[dict]] = {"A": [], "B": []}
        for n in range(args.runs):
            for route in ("A", "B"):
                r = run_child(route, args, work, files[route], package if route == "A" else None, n)
                results[route].append(r)
                print(f"  {route} run {n + 1}: batches of {r['batch_rows']:,} rows: "
                      f"{r['rows']:,} rows in {r['wall']:.1f}s wall, "
                      f"{r['cpu']:.1f}s CPU ({r['convert_cpu']:.1f}s converting): "
                      f"{r['rows'] / r['wall']:,.0f} rows/s, {r['rows'] / r['cpu']:,.0f} rows/s "
                      f"per core, ClickHouse {(r['cpu'] - r['convert_cpu']) / r['rows'] * 1e6:.2f} us "
                      f"per row; {on_disk(r)}; peak RSS {r['rss_mb']:,.0f} MB "
                      f"(load average {r['load']:.1f})", flush=True)
        a, b = results["A"][0]["tables"], results["B"][0]["tables"]
        differ = [t for t in a if a[t] != b.get(t)]
        if differ:
            sys.exit(f"the routes loaded different rows in {', '.join(differ)}: "
                     f"{ {t: (a[t], b.get(t)) for t in differ} }")
        print("both routes loaded the same rows in every table", flush=True)
        c = run_child("C", args, work, work / "messages-v2.bin", None, 0)

        def med(route: str, f) -> float:
            return statistics.median(f(r) for r in results[route])

        rows = results["B"][0]["rows"]
        a_name = ("version 2 (JSON)" if args.a_version == 2 else "version 3 (MessagePack captures)") \
            + (f", the sink of {args.baseline}" if args.baseline else "")
        for route, name in (("A", a_name), ("B", "version 3 (MessagePack captures)")):
            # The sink's own work per row (decode, check, columns, Arrow: the consumer's
            # thread), what a sink process spends against a ClickHouse server.
            report(f"sink ingest per core, the sink's own work, {name}",
                   round(med(route, lambda r: r["rows"] / r["convert_cpu"])), "rows/s/core",
                   TARGET if route == "B" else None, AIM if route == "B" else None,
                   better="higher")
            report(f"sink ingest per core with chDB in the process (its parsing, writing and "
                   f"merging included), {name}",
                   round(med(route, lambda r: r["rows"] / r["cpu"])), "rows/s/core", None,
                   better="higher")
            report(f"sink ingest wall clock, {name} (2 cores)",
                   round(med(route, lambda r: r["rows"] / r["wall"])), "rows/s", None,
                   better="higher")
        for route, name in (("A", f"version {args.a_version}"
                                    + (f", the sink of {args.baseline}" if args.baseline else "")),
                            ("B", "version 3")):
            report(f"sink conversion CPU per row, {name} (decode, check, columns, Arrow)",
                   round(med(route, lambda r: r["convert_cpu"] / r["rows"] * 1e6), 2), "us", None)
            report(f"sink loading CPU per row, {name} (chDB parses Arrow, writes parts)",
                   round(med(route, lambda r: (r["cpu"] - r["convert_cpu"]) / r["rows"] * 1e6), 2),
                   "us", None)
        report("ClickHouse parsing the envelopes instead (explode transition runs, no checks)",
               round(c["cpu"] / c["transitions"] * 1e6, 2), "us per transition", None)
        print(f"(route C exploded {c['transitions']:,} transitions; {rows:,} rows loaded "
              "in all tables by A and B)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
