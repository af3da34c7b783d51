"""A worker's page's task stream: the Run page's task stream (:mod:`.task_stream`)
of that worker's rows only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_blackbox.read.views import task_stream
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, number, register

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures


def data(ctx: Context) -> dict:
    max_bars = number(ctx.params.get("max_bars"), task_stream.MAX_BARS)
    return {"task_stream": task_stream.task_stream(ctx.backend, ctx.scope, max_bars, worker=ctx.worker)}


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    task_stream.figures(figs, data["task_stream"], name="worker_stream")
    return {}


VIEW = register(View("worker_stream", "Its task stream", data, "panel_worker_stream.html", draw,
                     page="worker", order=20))
