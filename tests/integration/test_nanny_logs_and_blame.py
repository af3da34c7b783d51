"""Whose lines and whose error, on a real cluster recorded by the real pipeline (Tansu,
the sink on chDB): a LocalCluster with nannies (processes=True), whose nannies share
the scheduler's process.

- ``blame``: a task raises and two tasks depend on it; Dask marks both erred with its
  exception (``TaskState.exception_blame``). The recorded failures name it as their
  cause, as the live scheduler does, and say "erred because <key> raised <exception>".
- ``nanny``: a worker is SIGKILLed; its nanny logs "Worker process <pid> was killed by
  signal 9". The line is among that worker's logs (what ``dask-blackbox logs --worker``
  reads), as the nanny's, and not among the scheduler's.
- Each nanny logs "Starting Nanny plugin dask-blackbox" before its plugin is set up (so
  before it has a transport): the line names that nanny's own worker, never the other's.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from distributed import Client, LocalCluster, wait

from dask_blackbox import producers
from dask_blackbox.read import panels, queries
from dask_blackbox.read.views import failures as failure_view

from conftest import pipeline_settings
from recording_support import recorded_through_pipeline
from dask_blackbox.testing.polling import wait_for
from cluster_support import live_workers

pytestmark = pytest.mark.slow


def boom() -> int:
    raise ZeroDivisionError("planted")


def inc(x: int) -> int:
    return x + 1


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("blame")
    settings, _ = pipeline_settings(broker, "k" + uuid.uuid4().hex[:8], root / "data")
    out: dict = {}
    with recorded_through_pipeline(broker, settings, lambda: _record(out)) as backend:
        out["backend"] = backend
        yield out


def _record(out: dict) -> None:
    # silence_logs=False: Dask's INFO lines, the nanny's among them, are emitted
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=False) as cluster, Client(cluster) as client:
        out["cluster_id"] = producers.attach(
            client, cluster_name="blame-and-nanny",
            **{"producer.flush-interval": "20ms"})["cluster_id"]
        out["attached"] = sorted(live_workers(client))
        root_future = client.submit(boom, key="raises-0")
        dependents = [client.submit(inc, root_future, key=f"dependent-{i}")
                      for i in range(2)]
        wait([root_future, *dependents])
        tasks = cluster.scheduler.tasks
        out["raised"] = root_future.key
        out["blame"] = {f.key: tasks[f.key].exception_blame.key for f in dependents}
        assert {f.status for f in dependents} == {"error"}

        doomed = sorted(live_workers(client))[0]
        pid = client.run(os.getpid, workers=[doomed])[doomed]
        os.kill(pid, signal.SIGKILL)
        out["doomed"], out["pid"] = doomed, pid
        wait_for(lambda: len(live_workers(client)) == 2
                 and doomed not in live_workers(client), 60,
                 "the nanny to restart its worker")


def test_an_erred_dependent_names_the_task_whose_error_it_inherited(recorded):
    backend = recorded["backend"]
    columns, rows = queries.failures(backend, cluster=recorded["cluster_id"])["erred_tasks"]
    erred = {r["key"]: r for r in (dict(zip(columns, row)) for row in rows)}
    raised = recorded["raised"]
    assert "ZeroDivisionError" in erred[raised]["exception"]
    assert erred[raised]["cause"] in ("", raised)  # it raised: Dask blames itself
    for key, blamed in recorded["blame"].items():
        assert blamed == raised
        assert erred[key]["cause"] == blamed, erred[key]
        assert erred[key]["exception"].startswith(f"erred because {blamed} raised "), erred[key]
        assert "ZeroDivisionError" in erred[key]["exception"]
    # the Failures panel shows the same
    scope = panels.resolve(backend, recorded["cluster_id"])
    shown = {t["key"]: t for t in failure_view.failures(backend, scope)["erred_tasks"]}
    assert shown["dependent-0"]["exception"].startswith(f"erred because {raised} raised ")


def test_a_nannys_lines_are_among_its_workers_logs(recorded):
    backend = recorded["backend"]
    line = f"Worker process {recorded['pid']} was killed by signal 9"
    cid = recorded["cluster_id"]
    columns, rows = queries.logs(backend, cluster=cid, worker=recorded["doomed"], text=line)
    found = [dict(zip(columns, row)) for row in rows]
    assert found, queries.logs(backend, cluster=cid, text=line)
    assert {(r["source"], r["worker"], r["logger"]) for r in found} == {
        ("nanny", recorded["doomed"], "distributed.nanny")}
    _, theirs = queries.logs(backend, cluster=cid, worker="scheduler", text=line)
    assert theirs == []


def test_a_nannys_line_from_before_its_plugin_names_its_own_worker(recorded):
    backend = recorded["backend"]
    line = "Starting Nanny plugin dask-blackbox"
    columns, rows = queries.logs(backend, cluster=recorded["cluster_id"], text=line)
    found = [dict(zip(columns, row)) for row in rows]
    assert sorted(r["worker"] for r in found) == recorded["attached"], found
