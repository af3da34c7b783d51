"""A worker's page's heading: its row of the Workers view (:mod:`.workers`) and how
it died, if it did."""

from __future__ import annotations

from dask_blackbox.read.views import workers
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import NotFound


def data(ctx: Context) -> dict:
    found = workers.rows(ctx)["workers"]
    row = next((r for r in found if r["worker"] == ctx.worker), None)
    if row is None:
        raise NotFound(f"no worker {ctx.worker!r} was recorded in cluster "
                       f"{ctx.scope.cluster_name} ({ctx.scope.cluster_id})")
    deaths = [d.as_dict() for d in ctx.deaths() if d.worker == ctx.worker]
    return {"worker": row, "worker_deaths": deaths}


VIEW = register(View("worker", "Worker", data, "panel_worker.html", page="worker", order=10))
