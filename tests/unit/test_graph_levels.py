"""The task graph drawn by group and by prefix (read/graph.py), on chDB with rows loaded
through the sink's Loader: each node's tasks, erred share, edges weighted by the
dependencies between their tasks, and its worker, the one that ran most of its tasks,
the first address of those that ran as many (the same run always draws the same
colours; ClickHouse's approximate top-k broke such ties at random)."""

from __future__ import annotations

import clickhouse_connect
import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.read import backends, panels
from dask_blackbox.read.views import graph
from dask_blackbox.sinks import schema
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.tables import Message

TARGET = schema.Target("blackbox", 90 * 86400)
T0 = 1_790_000_000.0
A, B, C = "tcp://a:1", "tcp://b:2", "tcp://c:3"
#: group -> the workers that ran its tasks, one per task, in order
RAN = {
    "load-g": [B, A, B, A],        # a tie between a and b: a, the first address
    "inc-g": [C, B, C, C, B],      # c ran most
    "sum-g": [C, B],               # a tie between b and c: b
    # a ran most, seven other workers one task each
    "out-g": [A, A, A] + [f"tcp://w{i}:9" for i in range(7)],
}
ERRED = {"inc-g-3"}


def _envelope() -> dict:
    tasks, events = [], []
    previous: list[str] = []
    for n, (group, workers) in enumerate(RAN.items()):
        prefix = group.split("-")[0]
        keys = [f"{group}-{i}" for i in range(len(workers))]
        for i, (key, worker) in enumerate(zip(keys, workers)):
            deps = previous[i % len(previous):][:1] if previous else []
            tasks.append({"key": key, "prefix": prefix, "group": group, "span_id": "s",
                          "dependencies": deps})
            t = T0 + n * 10 + i
            base = {"kind": contract.TRANSITION, "key": key, "prefix": prefix, "group": group,
                    "span_id": "s", "worker": None, "nbytes": None, "typename": None,
                    "startstops": None, "exception": None, "traceback": None, "cause": None}
            events += [
                {**base, "ts": t, "start": "released", "finish": "waiting", "stimulus_id": "g"},
                {**base, "ts": t + 0.5, "start": "processing",
                 "finish": "erred" if key in ERRED else "memory", "stimulus_id": f"done-{key}",
                 "worker": worker, "nbytes": None if key in ERRED else 8,
                 "startstops": [{"action": "compute", "start": t + 0.1, "stop": t + 0.4}]},
            ]
        previous = keys
    graph_event = {"kind": contract.GRAPH, "ts": T0 - 1, "client": "client-1", "stimulus_id": "g",
                   "n_tasks": len(tasks), "keys": [tasks[-1]["key"]], "tasks": tasks,
                   "annotations": {}}
    return {"schema": contract.SCHEMA_VERSION, "cluster_id": "c-graph", "cluster_name": "graph",
            "source": "scheduler", "producer_id": "p-graph", "seq": 0, "sent_at": T0 + 100,
            "events": [graph_event, *events]}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('graph') / 'ch'}")
    schema.migrate(client, TARGET)
    batch = Batch()
    batch.add(Message(contract.RAW, "t.raw", 0, 0, b"c-graph", orjson.dumps(_envelope()), 0))
    assert Loader(client, TARGET, "graph").load(batch, {})
    yield backends.DirectBackend(client, "blackbox")
    client.close()


@pytest.mark.parametrize("max_nodes, level", [(5, "group"), (3, "prefix")])
def test_grouped_nodes_name_the_worker_that_ran_most(backend, max_nodes, level):
    scope = panels.resolve(backend, "c-graph")
    drawn = graph.graph(backend, scope, max_nodes=max_nodes)
    assert drawn["level"] == level and drawn["n_tasks"] == 21
    nodes = {n["id"]: n for n in drawn["nodes"]}
    name = (lambda group: group) if level == "group" else (lambda group: group.split("-")[0])
    assert set(nodes) == {name(g) for g in RAN}
    expected_worker = {"load-g": A, "inc-g": C, "sum-g": B, "out-g": A}
    for group, workers in RAN.items():
        node = nodes[name(group)]
        assert node["tasks"] == len(workers)
        assert node["worker"] == expected_worker[group], (group, node)
        assert node["state"] == ("erred" if group == "inc-g" else "memory")
    # Edges by the dependencies between the nodes' tasks: each task of a group on one
    # task of the group before it.
    edges = {(e["source"], e["target"]): e["weight"] for e in drawn["edges"]}
    assert edges == {(name("load-g"), name("inc-g")): 5, (name("inc-g"), name("sum-g")): 2,
                     (name("sum-g"), name("out-g")): 10}
    # The same run draws the same graph, whatever ClickHouse's threads do.
    assert graph.graph(backend, scope, max_nodes=max_nodes)["nodes"] == drawn["nodes"]
