"""The named queries against what a real Dask cluster recorded: producers attached to
a LocalCluster (worker processes), the real sink subprocess loading a real Tansu
broker's topics into chDB, and Dask's own answers captured while the cluster lived.

- ``story KEY`` equals Scheduler.story for every key the scheduler transitioned;
- ``failures`` names the tasks a worker was running when it was SIGKILLed, as Dask's
  own remove-worker event lists them, its last metric samples and log lines, and
  the erred tasks with their exceptions -- after the cluster is gone;
- ``spans``, ``clusters``, ``gaps_and_drops``, ``table_counts`` describe the run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid

import dask.array as da
import dask.config
import pytest
from distributed import Client, LocalCluster, span, wait

from dask_blackbox import producers
from dask_blackbox import contract, kafka
from dask_blackbox.read import queries

from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.settings import dask_env
from sink_support import SinkProcess, wait_consumed
from cluster_support import live_workers


def inc(x):
    return x + 1


def div(x, y):
    return x / y


def block_until_released(flag: str, x):
    """Runs until the file ``flag`` disappears (the test kills the worker first)."""
    logging.getLogger("distributed.worker").warning("task %d blocks", x)
    while os.path.exists(flag):
        time.sleep(0.05)
    return x


def _own_story(dask_scheduler, keys):
    return {
        contract.encode_key(k): [(t[1], t[2], t[4], t[5]) for t in dask_scheduler.story(k) if t[0] == k]
        for k in keys
    }


def _erred(dask_scheduler):
    return {contract.encode_key(k): (ts.exception_text, contract.encode_key(ts.exception_blame.key))
            for k, ts in dask_scheduler.tasks.items() if ts.state == "erred"}


def reads_rows(i):
    from distributed.metrics import context_meter

    context_meter.digest_metric("rows-read", 100, "rows")
    return i


def _spans(dask_scheduler):
    return {s.id: (tuple(s.name), s.parent.id if s.parent else None)
            for s in dask_scheduler.extensions["spans"].spans.values()}


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    """One recorded run, loaded by the sink; Dask's own answers captured alive."""
    prefix = "q" + uuid.uuid4().hex[:10]
    data_dir = tmp_path_factory.mktemp("queries") / "data"
    settings = {
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": 2,
        "blackbox.data-dir": str(data_dir),
        "blackbox.sink.group-id": f"sink-{prefix}",
    }
    env = dask_env(settings)
    out: dict = {}
    with dask.config.set({**settings, "optimization.fuse.active": False}):
        asyncio.run(kafka.ensure_topics())
        sink = SinkProcess(env)
        try:
            sink.wait_ready()
            flag = data_dir / "running"
            flag.write_text("")
            with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                              dashboard_address=":0") as cluster, Client(cluster) as client:
                identity = producers.attach(client, cluster_name="queries-test", **{
                    "producer.flush-interval": "20ms", "producer.metrics-interval": "100ms"})
                out["cluster_id"] = identity["cluster_id"]
                with span("etl"):
                    with span("load"):
                        x = da.random.random((60, 60), chunks=20)
                    with span("reduce"):
                        x.sum().compute()
                client.gather(client.map(inc, range(10)))
                client.gather(client.map(reads_rows, range(6), key=[f"reads-rows-{i}" for i in range(6)]))
                time.sleep(0.3)  # the workers' digests are sampled every 100 ms
                bad = client.submit(div, 1, 0, key="div-bad")
                dependent = client.submit(inc, bad, key="inc-after-bad")
                wait([bad, dependent])
                doomed = sorted(live_workers(client))[0]
                pid = client.run(os.getpid, workers=[doomed])[doomed]
                # Two tasks pinned to the doomed worker (one thread): one runs, one waits.
                running = [client.submit(block_until_released, str(flag), i, key=f"blocked-{i}",
                                         workers=[doomed], allow_other_workers=False) for i in range(2)]
                wait_for(lambda: client.processing(workers=[doomed])[doomed], 30, "tasks on the worker",
                         interval=0.1)
                time.sleep(0.5)  # a few metric samples while it works
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: doomed not in live_workers(client), 30,
                         "the scheduler to remove the killed worker", interval=0.1)
                client.wait_for_workers(2, timeout=30)  # the nanny's replacement
                flag.unlink()
                out["doomed"] = doomed
                out["removals"] = [msg for _, msg in client.get_events("all")
                                   if msg.get("action") == "remove-worker" and msg.get("worker") == doomed]
                out["erred"] = client.run_on_scheduler(_erred)
                out["spans"] = client.run_on_scheduler(_spans)
                del running, x
            out["transition_log"] = list(cluster.scheduler.transition_log)
            keys = {t[0] for t in out["transition_log"]}
            out["stories"] = _own_story(cluster.scheduler, keys)
            wait_consumed(sink)
            out["backend"] = sink.backend()
            yield out
        finally:
            sink.terminate()


def test_the_nanny_recorded_how_the_killed_worker_ended(recorded):
    """The planted SIGKILL, as the killed worker's nanny saw it."""
    _, rows = recorded["backend"].query(
        "SELECT signal, exitcode, memory > 0, nanny_status FROM blackbox.worker_exits "
        "WHERE worker = {w:String}", {"w": recorded["doomed"]})
    assert rows == [("SIGKILL", -9, True, "running")]


def test_metrics_show_what_tasks_digested(recorded):
    """A task's own context_meter.digest_metric(label, value, unit) is recorded and
    queryable: six tasks reported 100 rows each."""
    columns, rows = queries.metrics(recorded["backend"], context="execute", cluster="queries-test")
    found = [dict(zip(columns, row)) for row in rows if row[columns.index("activity")] == "rows-read"]
    assert [(f["prefix"], f["unit"], f["total"]) for f in found] == [("reads-rows", "rows", 600.0)]
    # Dask's own contexts are there too, not only the span-keyed ones
    columns, rows = queries.metrics(recorded["backend"], cluster="queries-test", limit=1000)
    assert {"execute", "get-data", "gather-dep"} <= {row[0] for row in rows}


def test_story_equals_scheduler_story_for_every_key(recorded):
    backend = recorded["backend"]
    stories = recorded["stories"]
    assert len(stories) > 30
    assert any(k.startswith("('random_sample") for k in stories)  # tuple keys too
    for key, expected in stories.items():
        columns, rows = queries.story(backend, key, cluster="queries-test")
        assert columns[:5] == ["key", "start", "finish", "stimulus_id", "ts"]
        got = [(start, finish, stimulus_id) for _, start, finish, stimulus_id, *_ in rows]
        assert got == [(s, f, stim) for s, f, stim, _ in expected], key
        for row, (*_, ts) in zip(rows, expected):
            assert abs(row[4] - ts) <= 1e-6  # stored to the microsecond
        assert {row[0] for row in rows} == {key}


def test_failures_after_the_cluster_is_gone(recorded):
    backend = recorded["backend"]
    report = queries.failures(backend, cluster=recorded["cluster_id"])
    assert list(report) == ["erred_tasks", "dead_workers", "dead_worker_tasks",
                            "dead_worker_metrics", "dead_worker_logs"]
    columns, erred = report["erred_tasks"]
    by_key = {row[columns.index("key")]: row for row in erred}
    assert set(by_key) == set(recorded["erred"]) == {"div-bad", "inc-after-bad"}
    for key, (exception, blame) in recorded["erred"].items():
        # the key Dask blames; a dependent's exception is the one it inherited, said so
        assert by_key[key][columns.index("cause")] == blame
        if blame == key:
            assert by_key[key][columns.index("exception")] == (exception or "")
        else:
            inherited = recorded["erred"][blame][0]
            assert by_key[key][columns.index("exception")] == (
                f"erred because {blame} raised {inherited}")
    assert "division by zero" in by_key["div-bad"][columns.index("exception")]
    assert by_key["div-bad"][columns.index("cause")] == "div-bad"

    columns, dead = report["dead_workers"]
    [row] = dead  # the workers the cluster's shutdown removed were idle
    [removal] = recorded["removals"]
    assert removal["expected"] is False and row[columns.index("expected")] is False
    expected_tasks = {contract.encode_key(k) for k in removal["processing-tasks"]}
    assert expected_tasks == {"blocked-0", "blocked-1"}
    tasks = {r[2] for r in report["dead_worker_tasks"][1] if r[1] == recorded["doomed"]}
    assert tasks == expected_tasks
    assert row[columns.index("tasks_running")] == 2

    removed_at = row[columns.index("removed_at")]
    columns, samples = report["dead_worker_metrics"]
    mine = [dict(zip(columns, r)) for r in samples if r[1] == recorded["doomed"]]
    assert 1 <= len(mine) <= 5
    assert [m["ts"] for m in mine] == sorted(m["ts"] for m in mine)
    assert all(m["ts"] <= removed_at for m in mine)
    assert mine[-1]["executing"] == 1  # its last sample: running blocked-0

    columns, lines = report["dead_worker_logs"]
    mine = [r[columns.index("message")] for r in lines if r[1] == recorded["doomed"]]
    assert "task 0 blocks" in mine and len(mine) <= 20


def test_spans_tree_clusters_and_status(recorded):
    backend = recorded["backend"]
    columns, rows = queries.spans(backend, tree=True, cluster="queries-test")
    dask_spans = recorded["spans"]
    assert {r[columns.index("span_id")] for r in rows} == set(dask_spans)
    depth = {r[columns.index("span_id")]: r[columns.index("depth")] for r in rows}
    for span_id, (name, parent) in dask_spans.items():
        assert depth[span_id] == len(name) - 1
        row = next(r for r in rows if r[columns.index("span_id")] == span_id)
        assert row[columns.index("name")] == "  " * (len(name) - 1) + name[-1]
        assert row[columns.index("parent_id")] == (parent or "")
    order = [r[columns.index("span_id")] for r in rows]
    for span_id, (_, parent) in dask_spans.items():
        if parent:
            assert order.index(parent) < order.index(span_id)  # parents first

    columns, clusters = queries.clusters(backend)
    [cluster] = [r for r in clusters if r[1] == recorded["cluster_id"]]
    assert cluster[0] == "queries-test"
    assert cluster[columns.index("errors")] == 2
    assert cluster[columns.index("workers")] >= 3  # two, and the nanny's replacement
    assert cluster[columns.index("workers_removed")] >= 2
    with pytest.raises(queries.UnknownCluster, match="no recorded cluster is named 'nope'"):
        queries.story(backend, "x", cluster="nope")

    columns, producers_ = queries.gaps_and_drops(backend, cluster="queries-test")
    assert {r[columns.index("source")] for r in producers_} == {"scheduler", "worker", "nanny"}
    assert all(r[columns.index("missing")] == 0 for r in producers_)
    counts = dict(queries.table_counts(backend)[1])
    assert counts["transitions"] == sum(len(s) for s in recorded["stories"].values())
    assert counts["dead_letters"] == 0
