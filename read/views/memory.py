"""The memory view: each worker's memory over time (managed, unmanaged, spilled; the
highest process memory sampled) against its memory limit and the memory at which its
nanny kills it, and the cluster's, from the workers' samples (``worker_metrics``) or,
once they expired, their per-minute roll-ups (``worker_minutes``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_blackbox.read import history
from dask_blackbox.read import workers as worker_data
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.templates import fmt_bytes
from dask_blackbox.read.views.page import Context, metric_cell
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import Scope, minutes
from dask_blackbox.read.views.scope import where as _where

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures

#: Workers whose series are read one by one (dead workers first, then by peak).
MEMORY_WORKERS = 32
#: Workers drawn one by one (a small figure each).
MEMORY_FIGURES = 12


def data(ctx: Context) -> dict:
    marks = ctx.markers()
    dead = [d["worker"] for d in marks["deaths"]]
    if ctx.from_rollups():
        mem = from_rollups(ctx.backend, ctx.scope, dead=dead, shown=MEMORY_WORKERS)
    else:
        mem = raw(ctx.backend, ctx.scope, dead, ctx.info())
    return {"memory": mem, "markers": marks}


#: Per worker and time cell ``w`` wide from ``t0`` (``{where}``: the scope): the mean
#: managed, unmanaged and spilled bytes and the highest process memory sampled.
CELLS = ("SELECT worker, toUInt32(floor((toFloat64(ts) - {{t0:Float64}}) / {{w:Float64}})) AS b, "
         "avg(ifNull(memory_managed, 0)), avg(ifNull(memory_unmanaged, ifNull(memory, 0))), "
         "avg(ifNull(memory_spilled, 0)), max(memory) "
         "FROM {worker_metrics} {where} GROUP BY worker, b ORDER BY worker, b")


def _cells(backend: Backend, scope: Scope, w: float) -> list[tuple]:
    """Per worker and time cell ``w`` wide: the mean managed, unmanaged and spilled
    bytes and the highest process memory sampled."""
    where, p = _where(scope, span=False)
    p.update(w=w, t0=scope.t0)
    _, rows = backend.query(CELLS.format(worker_metrics=_t(backend, "worker_metrics"), where=where), p)
    return rows


def raw(backend: Backend, scope: Scope, dead: list[str] | None = None,
        known: dict | None = None) -> dict:
    """Worker memory over time from the worker metrics, averaged per bucket:
    ``cluster`` (managed/unmanaged/spilled summed over workers) and ``workers``
    (the same per worker, for the :data:`MEMORY_WORKERS` shown: dead workers first,
    then by peak memory; with ``memory_max``, the highest process memory sampled in
    each bucket), ``n_workers`` in all; ``limits``: each worker's memory limit as
    the scheduler recorded it, ``kills``: the memory at which its nanny kills it
    (:func:`.workers.info`'s ``memory_kill``), and ``limit``: the sum of the memory limits
    of the workers there, per bucket. A time cell is at least twice the workers'
    typical sampling interval, so a worker has a sample in every cell it lived.
    ``known``: the run's :func:`workers.info`, if already known."""
    w = metric_cell(backend, scope)
    rows = _cells(backend, scope, w)
    out = memory_series([r[:5] for r in rows], scope.t0, w, dead, MEMORY_WORKERS)
    highest: dict[str, list] = {}
    for worker, _b, *_means, top in rows:
        highest.setdefault(worker, []).append(top)
    for worker, series in out["workers"].items():
        series["memory_max"] = highest[worker]
    order = out.pop("buckets")
    known = worker_data.info(backend, scope.cluster_id) if known is None else known
    limits = {a: i["memory_limit"] for a, i in known.items() if i["memory_limit"]}
    times = [scope.t0 + b * w for b in order]
    total = [sum(i["memory_limit"] or 0 for i in known.values()
                 if (i["added"] or 0) <= t + w and (i["removed"] is None or i["removed"] > t))
             for t in times]
    kills = {a: i["memory_kill"] for a, i in known.items() if i.get("memory_kill")}
    return {**out, "limits": limits, "kills": kills,
            "limit": {"times": times, "total": total} if any(total) else {}}


def memory_series(cells, t0: float, bucket: float, dead: list[str] | None, shown: int) -> dict:
    """The memory chart's series from ``cells`` of (worker, bucket number, managed,
    unmanaged, spilled) in order of worker and bucket: ``n_workers``, ``cluster``
    (summed over workers per bucket), ``workers`` (the ``shown`` ones: dead workers
    first, then by peak memory) and ``buckets`` (the numbers, in order)."""
    series: dict[str, dict[str, list]] = {}
    cluster: dict[int, list[float]] = {}
    for worker, b, managed, unmanaged, spilled in cells:
        s = series.setdefault(worker, {"times": [], "managed": [], "unmanaged": [], "spilled": []})
        s["times"].append(t0 + (b + 0.5) * bucket)
        s["managed"].append(managed)
        s["unmanaged"].append(unmanaged)
        s["spilled"].append(spilled)
        c = cluster.setdefault(b, [0.0, 0.0, 0.0])
        c[0] += managed
        c[1] += unmanaged
        c[2] += spilled
    peak = {k: max(m + u for m, u in zip(s["managed"], s["unmanaged"])) for k, s in series.items()}
    dead = [k for k in (dead or []) if k in series]
    chosen = (dead + [k for k in sorted(peak, key=lambda k: -peak[k]) if k not in dead])
    chosen = chosen[:max(shown, len(dead))]
    order = sorted(cluster)
    return {
        "n_workers": len(series),
        "cluster": {"times": [t0 + (b + 0.5) * bucket for b in order],
                    "managed": [cluster[b][0] for b in order],
                    "unmanaged": [cluster[b][1] for b in order],
                    "spilled": [cluster[b][2] for b in order]},
        "workers": {k: series[k] for k in chosen},
        "buckets": order,
    }


def from_rollups(backend: Backend, scope: Scope, dead: list[str] | None = None,
                 shown: int = MEMORY_WORKERS) -> dict:
    """:func:`raw` from ``worker_minutes``: per bucket the average of each worker's
    samples."""
    w = minutes(scope)
    cells = history.worker_memory(backend, w, "rollups")
    out = memory_series(
        [(worker, b, managed, unmanaged, spilled)
         for (worker, b), (managed, unmanaged, spilled, _) in sorted(cells.items())],
        w.t0, w.bucket, dead, shown)
    del out["buckets"]
    return out


def figures(figs: Figures, mem: dict) -> list[str]:
    """The cluster's memory (stacked, with the live workers' total memory limit)
    and a small figure per worker shown, each on its own binary scale with its
    memory limit drawn (dashed red), the memory at which its nanny kills it
    (dotted dark red, where the nanny recorded it) and its highest process memory
    sampled per time cell (black; the stacked areas are means)."""
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, DatetimeAxis, Range1d, Span
    from bokeh.plotting import figure

    from dask_blackbox.read.figures import MEMORY_COLORS, bytes_axis, ms, num

    if not mem["n_workers"]:
        return []
    c = mem["cluster"]
    fig = figs.time_figure("memory", f"Memory, all {mem['n_workers']} workers (sum of averages)", 240)
    source = ColumnDataSource({"x": num(ms(t) for t in c["times"]), "managed": num(c["managed"]),
                               "unmanaged": num(c["unmanaged"]), "spilled": num(c["spilled"])})
    fig.varea_stack(["managed", "unmanaged", "spilled"], x="x", source=source,
                    color=[MEMORY_COLORS[k] for k in ("managed", "unmanaged", "spilled")],
                    legend_label=["managed", "unmanaged", "spilled"])
    limit = mem.get("limit") or {}
    if limit.get("times"):
        lx = [ms(t) for t in limit["times"]]
        fig.step(x=num(lx), y=num(limit["total"]), mode="after", line_color="#d62728",
                 line_dash="dashed", line_width=1.5, legend_label="memory limit of the workers")
    bytes_axis(fig.yaxis[0])
    figs.mark(fig)
    figs.legend_outside(fig)
    names = ["memory"]
    limits = mem.get("limits") or {}
    kills = mem.get("kills") or {}
    shown = list(mem["workers"])[:MEMORY_FIGURES]
    rows = []
    for worker in shown:
        s = mem["workers"][worker]
        cap = limits.get(worker)
        kill = kills.get(worker)
        highest = [v for v in s.get("memory_max") or () if v]
        total = [m + u + sp for m, u, sp in zip(s["managed"], s["unmanaged"], s["spilled"])]
        top = max(total + highest + [cap or 0.0, kill or 0.0, 1.0]) * 1.05
        dead = worker in figs.dead_workers
        name = f"memory-{len(rows)}"
        f = figure(name=name, x_range=figs.x_range, y_range=Range1d(0, top), height=110,
                   sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset", toolbar_location=None,
                   title=worker + (" (died)" if dead else "")
                   + (f", memory limit {fmt_bytes(cap)}" if cap else ", no memory limit recorded")
                   + (f", its nanny kills at {fmt_bytes(kill)}" if kill else "")
                   + (f", highest sample {fmt_bytes(max(highest))}" if highest else ""),
                   x_axis_type=None, min_border_left=190, min_border_right=260)
        f.title.text_font_size = "9pt"
        f.xgrid.ticker = figs.ticker
        src = ColumnDataSource({"x": num(ms(t) for t in s["times"]), "managed": num(s["managed"]),
                                "unmanaged": num(s["unmanaged"]), "spilled": num(s["spilled"])})
        f.varea_stack(["managed", "unmanaged", "spilled"], x="x", source=src,
                      color=[MEMORY_COLORS[k] for k in ("managed", "unmanaged", "spilled")])
        if s.get("memory_max"):
            f.line(x=num(ms(t) for t in s["times"]), y=num(s["memory_max"]), line_color="black",
                   line_width=1, name="memory-highest")
        if cap:
            f.add_layout(Span(location=cap, dimension="width", line_color="#d62728",
                              line_dash="dashed", line_width=1.5, name="memory-limit", tags=[worker]))
        if kill:
            f.add_layout(Span(location=kill, dimension="width", line_color="#7f0000",
                              line_dash="dotted", line_width=1.5, name="memory-kill", tags=[worker]))
        bytes_axis(f.yaxis[0])
        f.yaxis.major_label_text_font_size = "8pt"
        if figs.marks.data["x"]:
            f.vspan(x="x", source=figs.marks, line_color="color", line_width=2, line_dash="dashed")
        rows.append(f)
    if rows:
        rows[-1].add_layout(DatetimeAxis(ticker=figs.ticker, formatter=figs.formatter), "below")
        rows[-1].height += 30
        figs.figures["memory_workers"] = column(*rows, sizing_mode="stretch_width",
                                                name="memory_workers")
        names.append("memory_workers")
    return names


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    return {"memory_figures": figures(figs, data["memory"])}


VIEW = register(View("memory", "Memory", data, "panel_memory.html", draw, order=90,
                     about="memory per worker over time, with the memory limits"))
