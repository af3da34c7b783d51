"""A worker's page's metrics: its memory against its limit and the memory at which
its nanny kills it, and the Run page's processing, CPU and transfer charts
(:mod:`.activity`) of that worker alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.templates import fmt_bytes
from dask_blackbox.read.views import activity
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import BUCKETS

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures


def data(ctx: Context) -> dict:
    known = ctx.info().get(ctx.worker, {})
    s = series(ctx.backend, ctx.scope, ctx.worker, BUCKETS)
    s["worker"] = ctx.worker
    return {"worker_series": s, "memory_limit": known.get("memory_limit"),
            "memory_kill": known.get("memory_kill"),
            "activity": activity.activity(ctx.backend, ctx.scope, ctx.worker, ctx.info())}


#: One worker's metrics per time bucket ``b`` of ``w`` seconds from ``t0`` up to ``t1``.
WORKER_SERIES = (
    "SELECT toUInt32(floor((toFloat64(ts) - {{t0:Float64}}) / {{w:Float64}})) AS b, "
    "avg(memory), max(memory), avg(memory_managed), avg(ifNull(memory_unmanaged, memory)), "
    "avg(memory_spilled), avg(cpu), avg(executing), avg(ready), avg(in_flight) "
    "FROM {worker_metrics} WHERE cluster_id = {{c:String}} "
    "AND worker = {{worker:String}} AND ts >= toDateTime64({{t0:Float64}}, 6, 'UTC') "
    "AND ts <= toDateTime64({{t1:Float64}}, 6, 'UTC') GROUP BY b ORDER BY b")


def series(backend: Backend, scope, worker: str, buckets: int) -> dict[str, Any]:
    """One worker's metrics over the scope's window, per time bucket: ``times`` (bucket
    middles), process memory (mean and highest sample), managed, unmanaged and
    spilled (means), CPU (mean percent), executing, ready and in flight (means)."""
    w = max(scope.bucket, (scope.t1 - scope.t0) / buckets)
    _, rows = backend.query(
        WORKER_SERIES.format(worker_metrics=_t(backend, "worker_metrics")),
        {"c": scope.cluster_id, "worker": worker, "t0": scope.t0, "t1": scope.t1, "w": w})
    names = ("memory", "memory_max", "managed", "unmanaged", "spilled", "cpu", "executing",
             "ready", "in_flight")
    out: dict[str, Any] = {"times": [scope.t0 + (b + 0.5) * w for b, *_ in rows]}
    for i, name in enumerate(names, start=1):
        out[name] = [r[i] for r in rows]
    return out


def memory_figure(figs: Figures, s: dict, limit: int | None, kill: int | None = None,
                  name: str = "worker_memory") -> None:
    """One worker's memory against its limit: managed, unmanaged, spilled (stacked
    means per cell), the highest process memory sampled, the memory limit and the
    memory at which its nanny kills it (``kill``, where recorded)."""
    from bokeh.models import ColumnDataSource, Range1d, Span

    from dask_blackbox.read.figures import MEMORY_COLORS, bytes_axis, ms, num

    fig = figs.time_figure(name, "Memory" + (f" against its limit, {fmt_bytes(limit)}" if limit
                                               else " (no memory limit recorded)")
                            + (f"; its nanny kills at {fmt_bytes(kill)}" if kill else ""), 260)
    src = ColumnDataSource({"x": num(ms(t) for t in s["times"]), "managed": num(s["managed"]),
                            "unmanaged": num(s["unmanaged"]), "spilled": num(s["spilled"]),
                            "peak": num(s["memory_max"])})
    fig.varea_stack(["managed", "unmanaged", "spilled"], x="x", source=src,
                    color=[MEMORY_COLORS[k] for k in ("managed", "unmanaged", "spilled")],
                    legend_label=["managed", "unmanaged", "spilled"])
    fig.line(x="x", y="peak", source=src, line_color="black", line_width=1,
             legend_label="process memory, highest sample")
    if limit:
        fig.add_layout(Span(location=limit, dimension="width", line_color="#d62728",
                            line_dash="dashed", line_width=2, name="memory-limit", tags=[s.get("worker", "")]))
    if kill:
        fig.add_layout(Span(location=kill, dimension="width", line_color="#7f0000",
                            line_dash="dotted", line_width=2, name="memory-kill", tags=[s.get("worker", "")]))
    if limit or kill:
        fig.y_range = Range1d(0, max([limit or 0, kill or 0] + [v for v in s["memory_max"] if v]) * 1.05)
    bytes_axis(fig.yaxis[0])
    figs.mark(fig)
    figs.legend_outside(fig)


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    s = data["worker_series"]
    memory_figure(figs, s, data["memory_limit"], data["memory_kill"])
    # its CPU, executing / ready / in flight and actions: the Run page's charts of one worker
    return {"worker_figures": ["worker_memory",
                               *activity.figures(figs, data["activity"], prefix="worker",
                                                 whose="its samples")]}


VIEW = register(View("worker_metrics", "Memory, CPU, processing", data, "panel_worker_metrics.html",
                     draw, page="worker", order=30))
