"""How fast the critical path of a big run is found, from ClickHouse.

Synthesises runs straight into chDB tables (``transitions`` and ``graph_tasks``, the
rows the sink writes for a real run): a dask.array-like graph -- ``load`` roots,
element-wise ``add`` (one dependency), ``mul`` (two: its chunk and the next, an
overlap), ``sub``, then a tree reduction ``sum`` with fan-in 8 -- on 32 workers,
each task's times following its dependencies' (compute durations log-normal per
prefix, scheduler and thread latencies exponential, roots leaving the scheduler's
queue as threads free up, a transfer before compute when a dependency lived on
another worker). Each task has the transitions Dask records: released -> waiting,
waiting -> processing (roots through queued), processing -> memory with its
startstops, memory -> released, released -> forgotten.

For each size (default 100k and 1M tasks) it loads two clusters: one with its graph
recorded and one without (the path then follows the scheduler's stimulus ids), and
measures :func:`dask_blackbox.read.critical_path.critical_path` on each, the median
of ``--repeat`` runs, wall clock and this process's CPU (chDB runs in it). It checks
the path found against the one the generator built (the chain of last-arriving
dependencies from the last task) and that the parts add up to the window.

    python bench/critical_path.py                  # 100k and 1M tasks
    python bench/critical_path.py --tasks 100000   # one size
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from report import report  # noqa: E402

from dask_blackbox import clickhouse  # noqa: E402
from dask_blackbox.read import backends, cost, panels  # noqa: E402
from dask_blackbox.read.critical_path import critical_path  # noqa: E402
from dask_blackbox.sinks.schema import Target, migrate  # noqa: E402

WORKERS = 32
THREADS = 4
FAN_IN = 8
#: median compute seconds per prefix
DURATIONS = {"load": 0.040, "add": 0.004, "mul": 0.006, "sub": 0.004, "sum": 0.002}


class Run:
    """A synthetic run: per task its key, prefix, dependencies (indexes), worker and
    times, built layer by layer so every time follows from the dependencies'."""

    def __init__(self, n_tasks: int, seed: int, t0: float, depth: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.t0 = t0
        roots = max(FAN_IN, int(n_tasks / (4 + 1 / (FAN_IN - 1))))
        self.keys: list[str] = []
        self.prefix: list[str] = []
        self.deps: list[np.ndarray] = []  # per layer: (n, k) indexes, -1 padded
        layers = []
        offset = 0

        def layer(prefix: str, n: int, deps: np.ndarray | None) -> tuple[int, int]:
            nonlocal offset
            token = f"{prefix}-{rng.integers(1 << 60):015x}"
            self.keys += [f"('{token}', {i})" for i in range(n)]
            self.prefix += [prefix] * n
            layers.append((prefix, offset, n, deps))
            offset += n
            return offset - n, n

        if depth:  # ``depth`` layers, each task on two of the layer before: a long path
            width = max(2, n_tasks // depth)
            ids = np.arange(width)
            start, n = layer("load", width, None)
            for i in range(depth - 1):
                start, n = layer(("add", "mul", "sub")[i % 3], width,
                                 np.stack([start + ids, start + (ids + 1) % width], axis=1))
            n = 1
        else:
            start, n = layer("load", roots, None)
            ids = np.arange(n)
            start, n = layer("add", roots, (start + ids)[:, None])
            start, n = layer("mul", roots, np.stack([start + ids, start + (ids + 1) % n], axis=1))
            start, n = layer("sub", roots, (start + ids)[:, None])
        while n > 1:
            m = -(-n // FAN_IN)
            d = np.full((m, FAN_IN), -1)
            for j in range(FAN_IN):
                src = np.arange(m) * FAN_IN + j
                d[:, j] = np.where(src < n, start + src, -1)
            start, n = layer("sum", m, d)
        self.n = offset
        self.layers = layers
        self.worker = rng.integers(0, WORKERS, self.n)
        self.begin = np.zeros(self.n)
        self.end = np.zeros(self.n)
        self.arrived = np.zeros(self.n)
        self.entered = np.zeros(self.n)
        self.transfer = np.zeros((self.n, 2))
        self.pred = np.full(self.n, -1)
        self.queued = np.zeros(self.n, dtype=bool)
        for prefix, first, n, deps in layers:
            sl = slice(first, first + n)
            dur = DURATIONS[prefix] * rng.lognormal(0, 0.3, n)
            if deps is None:
                # roots leave the queue as threads free up
                entered = t0 + 0.01 + (np.arange(n) // (WORKERS * THREADS)) * DURATIONS[prefix] \
                    + rng.exponential(0.002, n)
                self.queued[sl] = True
            else:
                arr = np.where(deps >= 0, self.arrived[np.maximum(deps, 0)], -np.inf)
                last = arr.argmax(axis=1)
                self.pred[sl] = deps[np.arange(n), last]
                entered = arr.max(axis=1) + rng.exponential(0.0005, n)
                remote = (self.worker[self.pred[sl]] != self.worker[sl])
                tr = np.where(remote, rng.exponential(0.003, n), 0.0)
                self.transfer[sl, 0] = np.where(remote, entered + 0.0002, 0.0)
                self.transfer[sl, 1] = np.where(remote, entered + 0.0002 + tr, 0.0)
                entered = entered
                dur = dur
            wait = rng.exponential(0.001, n)
            begin = np.maximum(entered + wait, self.transfer[sl, 1])
            self.entered[sl] = entered
            self.begin[sl] = begin
            self.end[sl] = begin + dur
            self.arrived[sl] = self.end[sl] + rng.exponential(0.0005, n) + 0.0001

    def truth(self) -> list[str]:
        """The chain of last-arriving dependencies, first task first."""
        i = int(self.end.argmax())
        out = []
        while i >= 0:
            out.append(self.keys[i])
            i = int(self.pred[i])
        return out[::-1]

    def transitions(self, cluster_id: str) -> pa.Table:
        n = self.n
        finished = [f"task-finished-{t:.6f}-{i}" for i, t in enumerate(self.arrived)]
        release = np.where(self.pred >= 0, self.pred, 0)
        stim_in = [finished[p] if p_ok else "update-graph-1"
                   for p, p_ok in zip(release.tolist(), (self.pred >= 0).tolist())]
        queued_stim = [finished[(i * 7919) % n] for i in range(n)]
        t_submit = np.full(n, self.t0)
        t_release = np.full(n, float(self.arrived.max()) + 0.5)
        rows_key, rows_ts, rows_start, rows_finish, rows_stim = [], [], [], [], []
        rows_ss_action, rows_ss_start, rows_ss_stop, rows_ss_source = [], [], [], []
        keys = self.keys
        for i in range(n):
            k = keys[i]
            q = self.queued[i]
            seq = [("released", "waiting", t_submit[i], "update-graph-1")]
            if q:
                seq += [("waiting", "queued", t_submit[i], "update-graph-1"),
                        ("queued", "processing", self.entered[i], queued_stim[i])]
            else:
                seq.append(("waiting", "processing", self.entered[i], stim_in[i]))
            seq += [("processing", "memory", self.arrived[i], finished[i]),
                    ("memory", "released", t_release[i], "client-releases-keys-1"),
                    ("released", "forgotten", t_release[i], "client-releases-keys-1")]
            for a, b, ts, stim in seq:
                rows_key.append(k)
                rows_ts.append(ts)
                rows_start.append(a)
                rows_finish.append(b)
                rows_stim.append(stim)
                if b == "memory":
                    actions, starts, stops, sources = ["compute"], [self.begin[i]], [self.end[i]], [""]
                    if self.transfer[i, 1] > 0:
                        actions.insert(0, "transfer")
                        starts.insert(0, self.transfer[i, 0])
                        stops.insert(0, self.transfer[i, 1])
                        sources.insert(0, f"tcp://w{self.worker[self.pred[i]]}")
                    rows_ss_action.append(actions)
                    rows_ss_start.append(starts)
                    rows_ss_stop.append(stops)
                    rows_ss_source.append(sources)
                else:
                    rows_ss_action.append([])
                    rows_ss_start.append([])
                    rows_ss_stop.append([])
                    rows_ss_source.append([])
        m = len(rows_key)
        prefix_of = np.repeat(np.array(self.prefix, dtype=object), [6 if q else 5 for q in self.queued])
        worker_of = np.repeat(np.array([f"tcp://w{w}" for w in self.worker], dtype=object),
                              [6 if q else 5 for q in self.queued])
        ts_type = pa.timestamp("us", tz="UTC")

        def times(values):
            return pa.array((np.asarray(values) * 1e6).astype("int64"), type=pa.int64()).cast(ts_type)

        def time_lists(values):
            flat = [t for v in values for t in v]
            offsets = np.cumsum([0] + [len(v) for v in values]).astype("int32")
            return pa.ListArray.from_arrays(pa.array(offsets), times(flat))

        finish = np.array(rows_finish, dtype=object)
        return pa.table({
            "cluster_id": pa.array([cluster_id] * m),
            "key": pa.array(rows_key),
            "ts": times(rows_ts),
            "start": pa.array(rows_start),
            "finish": pa.array(finish),
            "stimulus_id": pa.array(rows_stim),
            "source": pa.array(["scheduler"] * m),
            "seq": pa.array(np.arange(m, dtype=np.uint32) // 1000),
            "idx": pa.array((np.arange(m) % 1000).astype(np.uint16)),
            "prefix": pa.array(prefix_of),
            "task_group": pa.array(prefix_of),
            "span_id": pa.array(["span-1"] * m),
            "worker": pa.array(np.where(finish == "memory", worker_of, "")),
            "nbytes": pa.array(np.where(finish == "memory", 8000, None).tolist(), type=pa.int64()),
            "startstops.action": pa.array(rows_ss_action, type=pa.list_(pa.string())),
            "startstops.start": time_lists(rows_ss_start),
            "startstops.stop": time_lists(rows_ss_stop),
            "startstops.source": pa.array(rows_ss_source, type=pa.list_(pa.string())),
        })

    def extras(self, cluster_id: str) -> dict[str, pa.Table]:
        """The span, the workers' arrivals (with the thread history) and their
        fine performance metrics (one row per worker, second, prefix and activity):
        what the cost of the span is read from; and an envelope, which names the
        cluster for the Run page."""
        ts = pa.timestamp("us", tz="UTC")
        t = int(self.t0 * 1e6)
        workers = [f"tcp://w{w}" for w in range(WORKERS)]
        lifecycle = pa.table({
            "cluster_id": [cluster_id] * (WORKERS + 1),
            "ts": pa.array([t] * (WORKERS + 1)).cast(ts),
            "action": ["scheduler_start"] + ["worker_added"] * WORKERS,
            "worker": [""] + workers,
            "detail": ["{}"] + ['{"nthreads": %d}' % THREADS] * WORKERS,
            "total_nthreads.time": pa.array([[t - 1_000_000 + i for i in range(WORKERS + 1)]] + [[]] * WORKERS,
                                            type=pa.list_(pa.int64())).cast(pa.list_(ts)),
            "total_nthreads.nthreads": pa.array([[THREADS * i for i in range(WORKERS + 1)]] + [[]] * WORKERS,
                                                type=pa.list_(pa.uint32())),
        })
        spans = pa.table({"cluster_id": [cluster_id], "span_id": ["span-1"], "name": [["bench"]],
                          "parent_id": [""], "enqueued": pa.array([t]).cast(ts),
                          "ts": pa.array([t]).cast(ts)})
        rows = {"worker": [], "ts": [], "prefix": [], "activity": [], "value": []}
        second = np.floor(self.end - self.t0).astype(int)
        prefixes = np.array(self.prefix)
        busy = self.end - self.begin
        for w in range(WORKERS):
            mine = self.worker == w
            for p in DURATIONS:
                sel = mine & (prefixes == p)
                per_second = np.bincount(second[sel], weights=busy[sel])
                for sec in np.flatnonzero(per_second):
                    for activity, share in (("thread-cpu", 0.9), ("thread-noncpu", 0.08), ("other", 0.02)):
                        rows["worker"].append(workers[w])
                        rows["ts"].append(t + int(sec) * 1_000_000)
                        rows["prefix"].append(p)
                        rows["activity"].append(activity)
                        rows["value"].append(float(per_second[sec]) * share)
        m = len(rows["ts"])
        digests = pa.table({"cluster_id": [cluster_id] * m, "worker": rows["worker"],
                            "ts": pa.array(rows["ts"]).cast(ts), "context": ["execute"] * m,
                            "span_id": ["span-1"] * m, "prefix": rows["prefix"],
                            "activity": rows["activity"], "unit": ["seconds"] * m,
                            "value": rows["value"]})
        envelopes = pa.table({"cluster_id": [cluster_id], "cluster_name": [cluster_id],
                              "source": ["scheduler"], "producer_id": ["p"], "seq": pa.array([0], pa.uint64()),
                              "sent_at": pa.array([t]).cast(ts)})
        return {"lifecycle": lifecycle, "spans": spans, "worker_digests": digests,
                "envelopes": envelopes}

    def graph_tasks(self, cluster_id: str) -> pa.Table:
        deps: list[list[str]] = [[] for _ in range(self.n)]
        for _, first, n, d in self.layers:
            if d is None:
                continue
            for j, row in enumerate(d.tolist()):
                deps[first + j] = [self.keys[x] for x in row if x >= 0]
        ts = pa.array(np.full(self.n, int(self.t0 * 1e6))).cast(pa.timestamp("us", tz="UTC"))
        return pa.table({
            "cluster_id": pa.array([cluster_id] * self.n), "key": pa.array(self.keys),
            "ts": ts, "stimulus_id": pa.array(["update-graph-1"] * self.n),
            "prefix": pa.array(self.prefix), "task_group": pa.array(self.prefix),
            "span_id": pa.array(["span-1"] * self.n),
            "dependencies": pa.array(deps, type=pa.list_(pa.string())),
        })


def insert(client, name: str, data: pa.Table, chunk: int = 500_000) -> None:
    for i in range(0, data.num_rows, chunk):
        client.insert_arrow(f"blackbox.{name}", data.slice(i, chunk))


def median_s(fn, repeat: int):
    wall, cpu, result = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, action="append",
                        help="tasks in a synthesised run (repeatable; default 100000 and 1000000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per median")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", help="keep the chDB directory here")
    parser.add_argument("--depth", type=int, default=1000,
                        help="layers of the deep run (a 100k-task run whose path has this many links)")
    parser.add_argument("--quick", action="store_true", help="a 20k-task run only")
    args = parser.parse_args()
    sizes = args.tasks or ([20_000] if args.quick else [100_000, 1_000_000])
    root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="bb-cp-bench-"))
    client = clickhouse.open_client(f"chdb://{root / 'chdb'}")
    migrate(client, Target("blackbox", 90 * 86400))
    backend = backends.DirectBackend(client, "blackbox")
    try:
        for index, size in enumerate(sizes):
            label = f"{size // 1000}k" if size < 1_000_000 else f"{size / 1e6:g}M"
            t = time.perf_counter()
            run = Run(size, args.seed + index, time.time() - 86400 - 7200 * index)
            transitions = None
            for variant in ("graph", "actions"):
                cluster_id = f"bench-cp-{label}-{variant}"
                transitions = run.transitions(cluster_id)
                insert(client, "transitions", transitions)
                if variant == "graph":
                    insert(client, "graph_tasks", run.graph_tasks(cluster_id))
                    for name, rows in run.extras(cluster_id).items():
                        insert(client, name, rows)
            print(f"{label}: {run.n:,} tasks, {transitions.num_rows:,} transitions a cluster, "
                  f"synthesised and loaded in {time.perf_counter() - t:.0f}s", flush=True)
            del transitions
            truth = run.truth()
            for variant in ("graph", "actions"):
                cluster_id = f"bench-cp-{label}-{variant}"
                critical_path(backend, cluster_id)  # warm: first reads of each column's parts
                wall, cpu, path = median_s(lambda: critical_path(backend, cluster_id), args.repeat)
                found = [link.key for link in path.links]
                parts = sum(path.parts.values())
                print(f"  {variant}: {len(found)} links (basis {path.basis}); equals the "
                      f"synthesised path: {found == truth}; parts {parts:.6f} s of a "
                      f"{path.wall:.6f} s window; median of {args.repeat}: {wall:.2f} s wall, "
                      f"{cpu:.2f} s CPU; load average {os.getloadavg()[0]:.1f} on "
                      f"{os.cpu_count()} cores", flush=True)
                if found != truth:
                    print(f"    found {found[:3]}...{found[-3:]}\n    truth {truth[:3]}...{truth[-3:]}")
                bound = 10 if size >= 1_000_000 else 2
                report(f"critical path, {label}-task run, {variant} (median, wall)",
                       round(wall, 2), "s", bound)
                report(f"critical path, {label}-task run, {variant} (median, CPU)",
                       round(cpu, 2), "s", bound)
            cluster_id = f"bench-cp-{label}-graph"
            wall, cpu, found = median_s(lambda: cost.span_costs(backend, [cluster_id]), args.repeat)
            [span_cost] = found
            print(f"  cost of the span: cpu {span_cost.measures.cpu_s:.1f} s, busy "
                  f"{span_cost.measures.busy_s:.1f} s, moved {span_cost.measures.moved_bytes:,} B, "
                  f"memory {span_cost.measures.memory_byte_s / 2**30:.1f} GiB*s, offered "
                  f"{span_cost.offered_s:.1f} s, idle {span_cost.idle_s:.1f} s; median of "
                  f"{args.repeat}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
            report(f"span cost, {label}-task run (median, wall)", round(wall, 2), "s", None)
            # A/B: the Run page's data without and with these two panels
            without, _, _ = median_s(lambda: panels.run_data(backend, cluster_id, slowness=False),
                                     args.repeat)
            with_, _, _ = median_s(lambda: panels.run_data(backend, cluster_id, slowness=True),
                                   args.repeat)
            print(f"  Run page data without / with the critical path and cost panels: "
                  f"{without:.2f} / {with_:.2f} s (median of {args.repeat} each)", flush=True)
            report(f"Run page data with the critical path and cost, {label}-task run (median, wall)",
                   round(with_, 2), "s", None)
        if args.depth and not args.quick:
            size = 100_000
            run = Run(size, args.seed + 99, time.time() - 3 * 86400, depth=args.depth)
            cluster_id = "bench-cp-deep"
            insert(client, "transitions", run.transitions(cluster_id))
            insert(client, "graph_tasks", run.graph_tasks(cluster_id))
            truth = run.truth()
            critical_path(backend, cluster_id)
            wall, cpu, path = median_s(lambda: critical_path(backend, cluster_id), args.repeat)
            found = [link.key for link in path.links]
            print(f"deep: {run.n:,} tasks in {args.depth} layers: {len(found):,} links; equals the "
                  f"synthesised path: {found == truth}; median of {args.repeat}: {wall:.2f} s wall, "
                  f"{cpu:.2f} s CPU", flush=True)
            report(f"critical path, 100k-task run of {args.depth} layers (median, wall)",
                   round(wall, 2), "s", 2)
    finally:
        client.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
