"""Graphs of any size up to graph-max-tasks are recorded whole: a 50,001-task graph
travels in parts under an envelope's size and loads as one ``graphs`` row and a
``graph_tasks`` row per task, each with exactly the dependencies Dask's scheduler
held (a task with more than the listed cap says how many it has); past the setting,
the ``graphs`` row says how many were recorded."""

from __future__ import annotations

import time

import pytest
from distributed import Client, LocalCluster

from dask_blackbox import producers
from dask_blackbox.contract import GRAPH, MAX_ENVELOPE_BYTES, RAW, encode_key
from dask_blackbox.producers.scheduler import GRAPH_MAX_DEPENDENCIES
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.tables import COLUMNS, Message
from dask_blackbox.testing.kafka_reader import read_records
from producers_support import FAST, published, wait_scheduler_delivered

N = 50_000


def inc(x):
    return x + 1


def total(*xs):
    return sum(xs)


def _graph_of(dask_scheduler) -> dict:
    """What the scheduler holds of the graph: each task's dependencies."""
    return {encode_key(k): sorted(encode_key(d.key) for d in ts.dependencies)
            for k, ts in dask_scheduler.tasks.items()}


def _loaded(records) -> dict[str, list[tuple]]:
    batch = Batch()
    for r in records:
        batch.add(Message(RAW, r.topic, r.partition, r.offset, r.key, r.value, r.timestamp),
                  time.time())
    assert len(batch.tables["dead_letters"]) == 0
    return {table: list(zip(*batch.tables[table].columns)) for table in ("graphs", "graph_tasks")}


@pytest.mark.slow
def test_a_50k_task_graph_is_recorded_whole_in_parts(bb_config):
    # No worker: the graph waits on the scheduler as submitted, nothing runs.
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        producers.attach(client, **FAST, **{"producer.graph-max-tasks": 60_000})
        leaves = client.map(inc, range(N), key=[f"leaf-{i}" for i in range(N)])
        root = client.submit(total, *leaves, key="root")
        deadline = time.monotonic() + 120
        while len(cluster.scheduler.tasks) < N + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        truth = client.run_on_scheduler(_graph_of)
        wait_scheduler_delivered(client, timeout=120)
    records = [r for r in read_records("raw") if r.value]
    assert all(len(r.value) <= MAX_ENVELOPE_BYTES for r in records)
    _, events = published()
    parts = [e for e in events if e["kind"] == GRAPH and e["n_tasks"] == N]
    leaf_parts = sorted(parts, key=lambda e: e["part"])
    assert len(leaf_parts) > 1 and [e["part"] for e in leaf_parts] == list(range(len(leaf_parts)))
    assert {e["parts"] for e in leaf_parts} == {len(leaf_parts)}

    loaded = _loaded(records)
    graph_tasks = {row[COLUMNS["graph_tasks"].index("key")]: row for row in loaded["graph_tasks"]}
    dependencies = COLUMNS["graph_tasks"].index("dependencies")
    n_dependencies = COLUMNS["graph_tasks"].index("n_dependencies")
    assert set(graph_tasks) == set(truth) and len(truth) == N + 1
    for key, deps in truth.items():
        recorded = graph_tasks[key]
        assert recorded[n_dependencies] == len(deps), key
        if len(deps) <= GRAPH_MAX_DEPENDENCIES:
            assert sorted(recorded[dependencies]) == deps, key
        else:  # the root: its first dependencies listed, the count true
            assert len(recorded[dependencies]) == GRAPH_MAX_DEPENDENCIES
            assert set(recorded[dependencies]) <= set(deps)
    graphs = [dict(zip(COLUMNS["graphs"], row)) for row in loaded["graphs"]]
    (leaf_graph,) = [g for g in graphs if g["n_tasks"] == N]
    assert leaf_graph["n_recorded"] == N and leaf_graph["n_keys"] == N
    assert len(leaf_graph["keys"]) == 1_000  # the keys the client asked for: capped, counted


def test_past_graph_max_tasks_the_graphs_row_says_how_many_were_recorded(bb_config):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        producers.attach(client, **FAST, **{"producer.graph-max-tasks": 5})
        assert sum(client.gather(client.map(inc, range(12)))) == sum(range(1, 13))
        wait_scheduler_delivered(client)
    records = read_records("raw")
    loaded = _loaded(records)
    (graph,) = [dict(zip(COLUMNS["graphs"], row)) for row in loaded["graphs"]]
    assert (graph["n_tasks"], graph["n_recorded"], graph["n_keys"]) == (12, 5, 12)
    assert len(loaded["graph_tasks"]) == 5 and len(graph["keys"]) == 5
