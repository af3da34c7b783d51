"""The user's story, end to end: three clusters record at once; one of them dies of
KilledWorker. After every cluster has shut down, the CLI alone (queries on ClickHouse)
tells what Dask knew while the clusters were alive. On Tansu and on Apache Kafka."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import dask
import dask.array as da
import pytest
from distributed import Client, LocalCluster, span
from distributed.scheduler import KilledWorker

from dask_blackbox import producers
from dask_blackbox.deploy.supervisor import LocalPipeline, wait_drained

KILLER = "complex-computation-f970d1bd"


def exceed_memory(limit_bytes: int) -> int:
    """Grow until the nanny kills this worker for exceeding its memory budget, the
    way the task in the user's story did."""
    import logging

    logging.getLogger("distributed.worker").warning("about to load the whole partition")
    time.sleep(1.0)  # more than a metrics interval and a flush: the evidence leaves first
    hoard = []
    while True:
        hoard.append(bytearray(16 * 2**20))
        time.sleep(0.02)
        if len(hoard) * 16 * 2**20 > 4 * limit_bytes:  # the nanny never came: don't hang
            os._exit(1)


def cli_json(data_dir, *args):
    out = subprocess.run(
        [sys.executable, "-m", "dask_blackbox.cli", *args, "--format", "json",
         "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def sections(text: str) -> dict[str, list[dict]]:
    """Parse the JSON output of a command that prints titled result sets."""
    out, title, body = {}, None, []
    for line in text.splitlines() + ["# end"]:
        if line.startswith("# "):
            if title is not None:
                out[title] = json.loads("\n".join(body))
            title, body = line[2:], []
        else:
            body.append(line)
    return out


def span_truth(cluster: LocalCluster) -> dict[tuple, dict]:
    ext = cluster.scheduler.extensions["spans"]
    return {
        tuple(s.name): {
            "parent": tuple(s.parent.name) if s.parent else None,
            "nbytes": s.nbytes_total,
            "duration": s.duration,
            "tasks": sum(s.states.values()),
            "done": s.done,
            "states": {state: n for state, n in s.states.items() if n},
        }
        for s in ext.spans.values()
    }


@pytest.fixture
def pipeline(bb_config, tmp_path):
    local = LocalPipeline(kafka=bb_config["DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS"])
    local.start(progress=lambda m: None)
    try:
        yield local
    finally:
        local.stop(drain_timeout=0)


@pytest.mark.both_brokers
def test_killed_worker_post_mortem_from_queries_alone(pipeline, bb_config):
    data_dir = bb_config["DASK_BLACKBOX__DATA_DIR"]
    limit = 400 * 2**20
    settings = {"distributed.scheduler.allowed-failures": 1,
                "optimization.fuse.active": False}
    overrides = {"producer.metrics-interval": "200ms"}
    truth = {}
    with dask.config.set(settings):
        clusters = {
            name: LocalCluster(n_workers=2 if name == "etl-a" else 1, threads_per_worker=1,
                               processes=True, memory_limit=limit, dashboard_address=None)
            for name in ("etl-a", "etl-b", "etl-c")
        }
        clients = {name: Client(c, set_as_default=False) for name, c in clusters.items()}
        try:
            for name, client in clients.items():
                producers.attach(client, cluster_name=name, **overrides)
            with span("nightly"):
                doomed = clients["etl-a"].submit(exceed_memory, limit, key=KILLER)
            with span("etl"):
                with span("load"):
                    b = clients["etl-b"].persist(da.ones((800, 800), chunks=100) + 1)
                    c = clients["etl-c"].persist(da.arange(200_000, chunks=10_000) * 2)
                with span("reduce"):
                    assert clients["etl-b"].compute(b.sum()).result() == 2 * 800 * 800
                    assert clients["etl-c"].compute(c.sum()).result() == 200_000 * 199_999
            with pytest.raises(KilledWorker):
                doomed.result(timeout=120)
            del doomed, b, c
            for client in clients.values():
                client.close()
            # The clients' departure is part of the story too: the scheduler forgets
            # the task once nobody wants it. Read Dask's truth after that.
            scheduler_a = clusters["etl-a"].scheduler
            deadline = time.monotonic() + 30
            while scheduler_a.story(KILLER)[-1][2] != "forgotten":
                assert time.monotonic() < deadline, scheduler_a.story(KILLER)
                time.sleep(0.05)
            truth["story"] = [(s, f, stim) for _, s, f, _, stim, _ in scheduler_a.story(KILLER)]
            truth["dead"] = [
                (msg["worker"], msg["processing-tasks"])
                for _, msg in scheduler_a.get_events("all")
                if msg.get("action") == "remove-worker" and not msg["expected"]
            ]
            truth["spans"] = {name: span_truth(c) for name, c in clusters.items()}
        finally:
            for client in clients.values():
                client.close()
            for cluster in clusters.values():
                cluster.close()

    assert len(truth["dead"]) == 2  # allowed-failures=1: the second death is fatal
    assert wait_drained(timeout=120), "the pipeline did not drain"

    # Which task killed which workers, and in what order.
    report = sections(cli_json(data_dir, "failures", "--cluster", "etl-a"))
    dead = report["dead_workers"]
    assert [d["worker"] for d in dead] == [w for w, _ in truth["dead"]]
    killed_by = {(t["worker"], t["key"]) for t in report["dead_worker_tasks"]}
    assert killed_by == {(w, k) for w, keys in truth["dead"] for k in keys}
    assert {k for _, keys in truth["dead"] for k in keys} == {KILLER}
    erred = [t for t in report["erred_tasks"] if t["key"] == KILLER]
    assert len(erred) == 1 and "KilledWorker" in erred[0]["exception"]

    # Each dead worker's last metric samples and last log lines.
    for worker, _ in truth["dead"]:
        samples = [m for m in report["dead_worker_metrics"] if m["worker"] == worker]
        assert samples, f"no metric samples of {worker}"
        assert max(m["memory"] for m in samples) > 0
        lines = [entry["message"] for entry in report["dead_worker_logs"]
                 if entry["worker"] == worker]
        assert any("about to load the whole partition" in line for line in lines), lines

    # The task's story, as Scheduler.story told it.
    story = json.loads(cli_json(data_dir, "story", KILLER, "--cluster", "etl-a"))
    assert [(s["start"], s["finish"], s["stimulus_id"]) for s in story] == truth["story"]

    # The span it belonged to, with its state; and the other clusters' spans, complete.
    for name, expected in truth["spans"].items():
        rows = json.loads(cli_json(data_dir, "spans", "--cluster", name))
        got = {tuple(r["name"].strip().split(" / ")): r for r in rows}
        assert set(got) == set(expected), name
        for span_name, want in expected.items():
            row = got[span_name]
            assert row["tasks"] == want["tasks"], (name, span_name)
            assert row["nbytes"] == want["nbytes"], (name, span_name)
            assert row["task_s"] == pytest.approx(want["duration"], abs=1e-5), (name, span_name)
            assert bool(row["done"]) == want["done"], (name, span_name)
    [nightly] = json.loads(cli_json(
        data_dir, "query",
        "SELECT states FROM span_state FINAL WHERE has(name, 'nightly') AND cluster_id IN "
        "(SELECT cluster_id FROM clusters WHERE cluster_name = 'etl-a')"))
    states = {state: n for state, n in nightly["states"].items() if n}
    assert states == truth["spans"]["etl-a"][("nightly",)]["states"]
