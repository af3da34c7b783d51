"""The diagnosis view: why each worker died and why tasks failed with KilledWorker,
one verdict each with its evidence (:func:`.diagnosis.diagnose`)."""

from __future__ import annotations

from dask_blackbox.read import diagnosis
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import Scope


def data(ctx: Context) -> dict:
    return {"diagnosis": diagnosis_panel(ctx.backend, ctx.scope, found=ctx.deaths())}


def diagnosis_panel(backend: Backend, scope: Scope, key: str | None = None,
                    found: list | None = None) -> dict:
    """Why workers died and why tasks failed with KilledWorker (:func:`diagnosis.diagnose`
    for the cluster and window): one verdict per death and per KilledWorker, with its
    evidence; ``key`` narrows it to that task's KilledWorker. ``found``: the cluster's
    :func:`diagnosis.deaths`, if already computed."""
    return diagnosis.diagnose(backend, key=key, since=scope.since, until=scope.until,
                              ids=[scope.cluster_id], found=found)


VIEW = register(View("diagnosis", "Diagnosis", data, "panel_diagnosis.html", order=10,
                     about="why each worker died and each task failed with KilledWorker, with the evidence",
                     params="&key="))
