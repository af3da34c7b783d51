"""History that outlives its detail: the per-minute roll-ups ClickHouse's materialized
views keep (sinks/sql/008_rollups.sql) give the answers the raw rows give, exactly
once even when a batch is abandoned and loaded again, and still give them once the
raw rows have expired.

Real producers' messages (tests/data/sink_corpus.json, recorded from a LocalCluster)
under three cluster ids, loaded by the sink's own Batch and Loader into chDB in small
batches (a minute's rows come from several batches), one of them failing half way
because ClickHouse refuses a table (the loader abandons the attempt and loads it
again)."""

from __future__ import annotations

import json
import logging
import math
import pathlib
import threading
import time

import clickhouse_connect
import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.read import history, queries, report, views
from dask_blackbox.read.backends import DirectBackend
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import Message

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "data" / "sink_corpus.json"
CLUSTERS = ("rollup-a", "rollup-b", "rollup-c")
RAW_TABLES = ("transitions", "worker_metrics", "envelopes", "logs", "graphs", "graph_tasks",
              "events", "scheduler_metrics", "worker_digests")


def shifted(value, seconds: float):
    """``value`` with every time in it (a float between 2020 and 2030) moved by
    ``seconds``."""
    if type(value) is float and 1.58e9 < value < 1.9e9:
        return value + seconds
    if type(value) is list:
        return [shifted(v, seconds) for v in value]
    if type(value) is dict:
        return {k: shifted(v, seconds) for k, v in value.items()}
    return value


def messages() -> list[Message]:
    """The corpus's raw envelopes and derived records, once per cluster id, each copy
    spread over minutes (event i of envelope n 13 n + 20 i seconds later than
    recorded)."""
    corpus = json.loads(CORPUS.read_text())
    out, offset = [], 0
    for c, cluster_id in enumerate(CLUSTERS):
        for topic in (contract.RAW, contract.SPAN_STATE, contract.PREFIX_STATS):
            for n, text in enumerate(corpus[topic]):
                try:
                    decoded = orjson.loads(text)
                except orjson.JSONDecodeError:
                    continue  # the garbage message the corpus holds for dead letters
                if type(decoded) is not dict:
                    continue
                decoded = shifted(decoded, 100.0 * c)
                if topic == contract.RAW:
                    decoded["events"] = [shifted(e, 13.0 * n + 20.0 * i)
                                         for i, e in enumerate(decoded["events"])]
                    decoded = {**decoded, "cluster_id": cluster_id, "cluster_name": cluster_id,
                               "producer_id": decoded["producer_id"] + cluster_id}
                else:
                    decoded = {**decoded, "cluster_id": cluster_id}
                out.append(Message(topic, f"t.{topic}", 0, offset, cluster_id.encode(),
                                   orjson.dumps(decoded), 1000))
                offset += 1
    return out


def answers(backend, cluster_id: str, source: str) -> dict:
    bounds = history.bounds(backend, cluster_id, "raw")
    w = history.Window.around(cluster_id, *bounds, buckets=300)
    return {
        "bounds": history.bounds(backend, cluster_id, source),
        "finished": history.finished(backend, w, source),
        "state_moves": history.state_moves(backend, w, source),
        "worker_memory": history.worker_memory(backend, w, source),
        "prefix_totals": history.prefix_totals(backend, w, source),
        "worker_totals": history.worker_totals(backend, w, source),
    }


def assert_close(a, b, path="") -> None:
    """Equal, floats to 1e-9 relative (sums in another order)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_close(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """chDB with the corpus loaded in batches of about 150 rows; the batch holding
    the second cluster's first log records failed once (table `logs` detached) and
    was loaded again."""
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('rollups')}")
    try:
        _load_with_one_abandoned_batch(client)
        yield client
    finally:
        # chDB holds one store a process: an open one would refuse the next module's.
        client.close()


class _Refusals(logging.Handler):
    """Set once the loader has said ClickHouse did not take a batch."""

    def __init__(self):
        super().__init__()
        self.seen = threading.Event()

    def emit(self, record):
        if "did not take batch" in record.getMessage():
            self.seen.set()


def _load_with_one_abandoned_batch(client):
    target = Target("blackbox", 90 * 86400)
    migrate(client, target)
    loader = Loader(client, target, "rollups", retry_backoff_max=0.2)
    batches, batch = [], Batch()
    for m in messages():
        batch.add(m)
        if batch.n_rows >= 150:
            batches.append(batch)
            batch = Batch()
    batches.append(batch)
    faulty = next(i for i, b in enumerate(batches)
                  if len(b.tables["logs"]) and b.tables["envelopes"].columns[0][0] == CLUSTERS[1])
    for i, b in enumerate(batches):
        if i != faulty:
            assert loader.load(b, {})
            continue
        client.command("DETACH TABLE blackbox.logs")
        refusals = _Refusals()
        logging.getLogger("sinks.loader").addHandler(refusals)
        attempt = threading.Thread(target=loader.load, args=(b, {}))
        attempt.start()
        deadline = time.monotonic() + 60
        # Its transitions, and so their roll-ups, were inserted before `logs` failed.
        while not client.query("SELECT count() FROM blackbox_rollups.task_minutes "
                               "WHERE cluster_id = {c:String}",
                               parameters={"c": CLUSTERS[1]}).result_rows[0][0]:
            assert time.monotonic() < deadline, "the failing attempt inserted nothing"
            time.sleep(0.05)
        # The attempt fails once `logs` refuses it, however long the machine takes to get
        # there; only then does the table come back.
        assert refusals.seen.wait(120), "the attempt with `logs` detached never failed"
        client.command("ATTACH TABLE blackbox.logs")
        attempt.join(60)
        assert not attempt.is_alive()
    states = dict(client.query(
        "SELECT state, count() FROM blackbox.sink_batches WHERE topic = '' GROUP BY state").result_rows)
    assert states["loaded"] == len(batches) and states.get("abandoned", 0) >= 1, states


def test_rollups_give_the_raw_answers_after_an_abandoned_batch(loaded):
    backend = DirectBackend(loaded, "blackbox")
    for cluster_id in CLUSTERS:
        assert history.detail(backend, cluster_id).source == "raw"
        raw, rolled = answers(backend, cluster_id, "raw"), answers(backend, cluster_id, "rollups")
        assert raw["finished"] and raw["worker_memory"] and raw["prefix_totals"]
        assert_close(rolled, raw)
    # The three copies are the same recording: the same totals (the abandoned
    # attempt of the second one counted nothing twice).
    first = answers(backend, CLUSTERS[0], "rollups")
    assert len({m for _, m in first["finished"]}) > 3  # several minutes
    for other in CLUSTERS[1:]:
        assert_close(answers(backend, other, "rollups")["prefix_totals"], first["prefix_totals"])
    # Every transition into memory is in the roll-ups once.
    memory = loaded.query("SELECT count() FROM blackbox.transitions WHERE source = 'scheduler' "
                          "AND finish = 'memory'").result_rows[0][0]
    rolled = loaded.query("SELECT sum(into['memory']) FROM blackbox_rollups.task_minutes"
                          ).result_rows[0][0]
    assert rolled == memory > 0


def test_answers_outlive_the_raw_rows(loaded):
    backend = DirectBackend(loaded, "blackbox")
    before = {c: answers(backend, c, "raw") for c in CLUSTERS}
    columns, clusters_before = queries.clusters(backend)
    pages = {c: views.run_data(backend, c, slowness=False) for c in CLUSTERS[1:2]}
    assert {p["history"]["source"] for p in pages.values()} == {"raw"}
    for table in RAW_TABLES:  # what the retention TTL drops
        loaded.command(f"TRUNCATE TABLE blackbox.{table}")
    for cluster_id in CLUSTERS:
        found = history.detail(backend, cluster_id)
        assert found.source == "rollups" and found.raw_since is None
        assert "expired" in found.note
        bounds = history.bounds(backend, cluster_id, "rollups")
        w = history.Window.around(cluster_id, *bounds, buckets=300)
        assert history.finished(backend, w, "raw") == {}  # nothing raw is left
        after = {"bounds": bounds, "finished": history.finished(backend, w, "rollups"),
                 "state_moves": history.state_moves(backend, w, "rollups"),
                 "worker_memory": history.worker_memory(backend, w, "rollups"),
                 "prefix_totals": history.prefix_totals(backend, w, "rollups"),
                 "worker_totals": history.worker_totals(backend, w, "rollups")}
        assert_close(after, before[cluster_id])
    # `clusters` reads the roll-ups and the lifecycle: the same clusters with the same
    # numbers, found by name.
    # The Run page (and the report) answers from the roll-ups, and says so: the same
    # tasks finished per prefix, the memory of the same workers, a binned task stream.
    for cluster_id in pages:
        page = views.run_data(backend, cluster_id, slowness=False)
        raw = pages[cluster_id]
        assert page["history"]["source"] == "rollups" and "expired" in page["history"]["note"]
        assert page["summary"]["finished_in_memory"] == raw["summary"]["finished_in_memory"] > 0
        assert page["summary"]["erred"] == raw["summary"]["erred"]
        assert {p: (c["memory"], c["erred"]) for p, c in page["progress"]["counts"].items()} == \
            {p: (c["memory"], c["erred"]) for p, c in raw["progress"]["counts"].items()
             if c["memory"] + c["erred"]}
        assert set(page["memory"]["workers"]) == set(raw["memory"]["workers"])
        assert page["task_stream"]["mode"] == "binned" and page["task_stream"]["cells"]
        assert page["task_states"]["series"]
        html = report.render_run(page)
        assert "From the roll-ups" in html and "expired" in html
    after_columns, clusters_after = queries.clusters(backend)
    assert (after_columns, sorted(clusters_after)) == (columns, sorted(clusters_before))
    for cluster_id in CLUSTERS:
        assert queries.cluster_ids(backend, cluster_id) == [cluster_id]
