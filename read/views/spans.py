"""The spans view: the span tree (depth-first) with Dask's numbers, and each span from
its start to its stop over time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_blackbox.read import palette, queries
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.templates import fmt_s
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import Scope
from dask_blackbox.read.views.scope import ts as _ts

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures


def data(ctx: Context) -> dict:
    return {"spans": spans(ctx.backend, ctx.scope)}


def spans(backend: Backend, scope: Scope) -> dict:
    """The span tree (depth-first) with Dask's numbers: ``task_s`` is Span.duration
    (seconds of every task action in the tree), ``elapsed_s`` stop - start."""
    columns, rows = queries.spans(backend, tree=True, cluster=scope.cluster_id, cost=False)
    out = []
    for row in rows:
        r = dict(zip(columns, row))
        if scope.span_ids is not None and r["span_id"] not in scope.span_ids:
            continue
        out.append({
            "span_id": r["span_id"], "parent_id": r["parent_id"], "depth": r["depth"],
            "name": r["name"].strip(), "enqueued": _ts(r["enqueued"]), "start": _ts(r["start"]),
            "stop": _ts(r["stop"]), "elapsed_s": r["elapsed_s"], "task_s": r["task_s"],
            "tasks": r["tasks"], "nbytes": r["nbytes"], "by_action": r["by_action"] or {},
            "done": r["done"],
        })
    if scope.since is not None or scope.until is not None:
        out = [s for s in out if (s["stop"] or s["enqueued"] or 0) >= scope.t0
               and (s["start"] or s["enqueued"] or 0) <= scope.t1]
    return {"spans": out}


def figures(figs: Figures, spans: dict) -> None:
    from bokeh.models import ColumnDataSource, FixedTicker, HoverTool, Range1d

    from dask_blackbox.read.figures import ms

    rows = [s for s in spans["spans"] if s["start"] and s["stop"]]
    if not rows:
        return
    fig = figs.time_figure("span_gantt", "Spans: start to stop", int(min(600, 60 + 24 * len(rows))),
                            y_range=Range1d(len(rows) - 0.5, -0.5))
    depth_colors = palette.SPARE
    source = ColumnDataSource(name="spans", data={
        "y": list(range(len(rows))), "left": [ms(s["start"]) for s in rows],
        "right": [ms(s["stop"]) for s in rows], "name": [s["name"] for s in rows],
        "task_s": [fmt_s(s["task_s"]) for s in rows],
        "elapsed": [fmt_s(s["elapsed_s"]) for s in rows],
        "color": [depth_colors[s["depth"] % len(depth_colors)] for s in rows]})
    glyph = fig.hbar(y="y", left="left", right="right", height=0.6, color="color", source=source)
    fig.add_tools(HoverTool(renderers=[glyph], tooltips=[
        ("span", "@name"), ("elapsed", "@elapsed"), ("task seconds (Dask's duration)", "@task_s")]))
    fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))))
    fig.yaxis.major_label_overrides = {i: "  " * s["depth"] + s["name"] for i, s in enumerate(rows)}
    figs.mark(fig)


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    figures(figs, data["spans"])
    return {}


VIEW = register(View("spans", "Spans", data, "panel_spans.html", draw, order=110,
                     about="the span tree with Dask's numbers"))
