"""The critical path view: the chain of tasks that decided the wall time, each link's
parts (:func:`.page.critical_path`, shared with the task stream, which outlines it,
and the task graph, which colours it)."""

from __future__ import annotations

from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register


def data(ctx: Context) -> dict:
    return {"critical_path": ctx.critical_path()}


VIEW = register(View("critical_path", "Critical path", data, "critical_path.html", order=30,
                     about="the chain of tasks that decided the wall time, each link's parts"))
