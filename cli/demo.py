"""``dask-blackbox demo``: record two real Dask clusters and show what ClickHouse knows.

Cluster ``demo-alice`` runs the nested ``span()`` example of Dask's spans
documentation; cluster ``demo-bob`` runs a dask.array reduction, a dask.dataframe
groupby and one task that raises. Both shut down before anything is queried: what is
printed comes from ClickHouse alone, as it would in a post-mortem.
"""

from __future__ import annotations

import logging
import time
import warnings

import dask
import dask.array as da
import dask.dataframe as dd
import pandas as pd
from distributed import Client, LocalCluster, span

from dask_blackbox import config
from dask_blackbox.cli.formatting import working
from dask_blackbox.deploy.supervisor import LocalPipeline, wait_drained


class DemoFailure(Exception):
    """Raised on purpose by the demo's failing task."""


def failing_task(x):
    raise DemoFailure(f"the demo's failing task got {x}")


def _frame() -> dd.DataFrame:
    pdf = pd.DataFrame({"name": [f"user-{i % 7}" for i in range(20_000)],
                        "x": [float(i % 101) for i in range(20_000)]})
    return dd.from_pandas(pdf, npartitions=8)


def alice(client: Client) -> None:
    """The nested-span example from the Dask spans documentation. Each stage is
    persisted inside its own span: dask.dataframe builds its graph lazily, so tasks
    belong to the spans that are open when they are computed."""
    with span("Alice's workflow"):
        with span("data load"):
            df = _frame().persist()
        with span("ML preprocessing"):
            df = df.assign(y=df.x * 2 + 1).persist()
        with span("Model training"):
            df.groupby("name").y.mean().compute()


def bob(client: Client) -> str:
    """Array reduction, dataframe groupby and a failing task; returns the failed key."""
    with span("array reduction"):
        da.random.random((2_000, 2_000), chunks=(250, 250)).sum().compute()
    with span("dataframe groupby"):
        _frame().groupby("name").x.sum().compute()
    future = client.submit(failing_task, 42, key="failing_task-demo")
    try:
        future.result()
    except DemoFailure:
        pass
    return future.key


def quiet_dask_console() -> None:
    # The failing task fails on purpose: keep its "Compute Failed" off the console.
    # Records still reach the blackbox log handler, which has its own level.
    # A filter, not a level: starting a cluster resets the handler's level.
    for handler in logging.getLogger("distributed").handlers:
        handler.addFilter(lambda record: record.levelno >= logging.CRITICAL)
    # dask.dataframe warns that graph annotations are ignored; spans still apply,
    # because distributed attributes the tasks of each compute() to the open span.
    warnings.filterwarnings("ignore", message="Dask annotations", category=UserWarning)


def _record(name: str, workload) -> object:
    from dask_blackbox import producers

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        producers.attach(client, cluster_name=name)
        return workload(client)


def run(timeout: float = 120.0, progress=print) -> int:
    from dask_blackbox.cli.formatting import print_result
    from dask_blackbox.read import queries

    quiet_dask_console()
    pipeline = None
    if config.running_up() is None:
        progress("[1/4] starting the local pipeline (broker, faust processors, sink)")
        pipeline = LocalPipeline()
        pipeline.start(progress=lambda m: progress("      " + m))
    else:
        progress(f"[1/4] using the running pipeline (Kafka {config.bootstrap_servers()[0]})")
    try:
        t0 = time.monotonic()
        progress("[2/4] cluster demo-alice: nested spans (Alice's workflow)")
        with dask.config.set({"optimization.fuse.active": False}):
            _record("demo-alice", alice)
            progress("[2/4] cluster demo-bob: array reduction, dataframe groupby, a failing task")
            failed_key = _record("demo-bob", bob)
        progress(f"      both clusters ran and shut down in {time.monotonic() - t0:.1f}s")
        progress("[3/4] waiting until the pipeline has loaded everything into ClickHouse")
        with working("loading into ClickHouse"):
            drained = wait_drained(timeout)
        if not drained:
            progress("      warning: not fully drained; results may be incomplete")
        progress("[4/4] what ClickHouse knows, with both clusters gone:\n")
        backend = queries.connect()
        print_result({
            "clusters": queries.clusters(backend),
            "span trees": queries.spans(backend, tree=True),
            "top task prefixes by compute time": queries.prefixes(backend, limit=10),
            f"story of the failed task {failed_key!r} (cluster demo-bob)":
                queries.story(backend, failed_key, cluster="demo-bob"),
        }, "table")
        from dask_blackbox.read import report

        written = report.write_report(config.data_dir() / "demo-bob-report.html", "demo-bob",
                                      backend=backend)
        progress(f"The run of demo-bob as the dashboard showed it, one HTML file that opens "
                 f"offline ({written['bytes'] / 1e6:.1f} MB):")
        progress(f"  {written['path']}")
        progress("Browse every recorded run (then open http://127.0.0.1:8787/):")
        progress(f"  dask-blackbox ui --data-dir {config.data_dir()}")
        progress("Try: dask-blackbox query \"SELECT * FROM transitions LIMIT 5\"")
        return 0
    finally:
        if pipeline is not None:
            pipeline.stop(progress=lambda m: progress("      " + m))
