"""The fine metrics view: Dask's fine performance metrics, seconds (and bytes) per
activity and prefix, as the spans rolled them up (``span_state``) or as the workers'
digests summed them (``worker_digests``, the page aggregates)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from dask_blackbox.read import aggregates, palette
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import Scope
from dask_blackbox.read.views.scope import where as _where

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures


#: The condition on a cluster's root spans (those without a recorded parent).
ROOTS = ("parent_id = '' OR parent_id NOT IN (SELECT span_id FROM {span_state} "
         "WHERE cluster_id = {{c:String}})")

#: Dask's fine performance metrics summed over the spans ``{top}`` picks (their
#: ``cumulative_worker_metrics``: the metrics of their trees): (context, prefix,
#: activity, unit, value).
SPAN_METRICS = ("SELECT m.context, m.prefix, m.activity, m.unit, sum(m.value) "
                "FROM {span_state} FINAL ARRAY JOIN cumulative_worker_metrics AS m "
                "WHERE cluster_id = {{c:String}} AND ({top}) "
                "GROUP BY m.context, m.prefix, m.activity, m.unit")

#: The same from the workers' raw digests in the scope (``{where}``).
DIGESTS = ("SELECT context, prefix, activity, unit, sum(value) "
           "FROM {worker_digests} {where} GROUP BY context, prefix, activity, unit")


def data(ctx: Context) -> dict:
    return {"fine_metrics": fine_metrics(ctx.backend, ctx.scope)}


def fine_metrics(backend: Backend, scope: Scope) -> dict:
    """Dask's fine performance metrics: seconds (and bytes) per activity and prefix,
    as the spans rolled them up (``Span.cumulative_worker_metrics`` of the top spans
    of the scope), or summed from the workers' digests when no span state was
    recorded.

    ``execute``: {prefix: {activity: seconds}} of task execution; ``idle``: the
    seconds of Dask's ``("execute", "N/A", "idle or other spans")`` (the threads'
    time offered to the spans and not used by their tasks; None without span
    state); ``transfer``: {context: {activity: seconds}} of sending data
    (``get-data``) and gathering dependencies (``gather-dep``), from the workers'
    digests of the run (these contexts have no span); ``other``: rows of (context,
    prefix, activity, unit, value) for the rest."""
    p: dict[str, Any] = {"c": scope.cluster_id}
    if scope.span_ids is None:
        top = ROOTS.format(span_state=_t(backend, "span_state"))
    else:
        top = "span_id IN {ids:Array(String)} AND parent_id NOT IN {ids:Array(String)}"
        p["ids"] = scope.span_ids
    _, rows = backend.query(SPAN_METRICS.format(span_state=_t(backend, "span_state"), top=top), p)
    source = "spans"
    windowed = scope.since is not None or scope.until is not None
    if not rows:
        source = "worker_digests"
        if windowed:
            where, p = _where(scope)
            _, rows = backend.query(DIGESTS.format(worker_digests=_t(backend, "worker_digests"),
                                                   where=where), p)
        else:
            rows = aggregates.digests(backend, scope.cluster_id, span_ids=scope.span_ids)
    else:
        # the contexts without a span (sending and gathering data, the memory
        # monitor, ...) are only in the digests
        rows = [r for r in rows if r[0] == "execute" or r[0] == "p2p"] + [
            r for r in aggregates.digests(backend, scope.cluster_id)
            if r[0] not in ("execute", "p2p")]
    execute: dict[str, dict[str, float]] = defaultdict(dict)
    transfer: dict[str, dict[str, float]] = defaultdict(dict)
    idle, other = None, []
    for context, prefix, activity, unit, value in rows:
        if context == "execute" and unit == "seconds" and prefix == "N/A":
            idle = (idle or 0.0) + value
        elif context == "execute" and unit == "seconds" and prefix != "":
            execute[prefix or "(none)"][activity] = execute[prefix or "(none)"].get(activity, 0.0) + value
        elif context in ("get-data", "gather-dep") and unit == "seconds":
            transfer[context][activity] = transfer[context].get(activity, 0.0) + value
        else:
            other.append({"context": context, "prefix": prefix, "activity": activity,
                          "unit": unit, "value": value})
    other.sort(key=lambda r: (r["context"], r["unit"], -r["value"]))
    return {"source": source if rows else None, "execute": dict(execute), "idle": idle,
            "transfer": dict(transfer), "other": other}


def figures(figs: Figures, fm: dict) -> None:
    """Dask's Fine Performance Metrics: task execution seconds by prefix and
    activity (with the "idle or other spans" of Dask's ``N/A`` prefix), and the
    seconds of sending data (get-data) and gathering dependencies (gather-dep) by
    activity; Dask's colours, the same activity one colour in both."""
    execute = fm["execute"]
    transfer = fm.get("transfer") or {}
    colors = palette.activities([a for v in execute.values() for a in v]
                                + [a for v in transfer.values() for a in v])
    if execute:
        totals = {p: sum(v.values()) for p, v in execute.items()}
        prefixes = sorted(totals, key=lambda p: (-totals[p], p))[:20][::-1]
        _stacked(figs, "fine_metrics", prefixes, execute, colors,
                      "Fine performance metrics: task execution seconds by prefix and activity",
                      "prefix")
    if transfer:
        contexts = [c for c in ("get-data", "gather-dep") if c in transfer][::-1]
        _stacked(figs, "fine_metrics_transfer", contexts, transfer, colors,
                      "Sending data (get-data) and gathering dependencies (gather-dep): "
                      "seconds by activity", "context")


def _stacked(figs: Figures, name: str, rows: list[str], values: dict, colors: dict, title: str,
             what: str) -> None:
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure

    activities = sorted({a for r in rows for a in values[r]},
                        key=lambda a: -sum(values[r].get(a, 0.0) for r in rows))
    data = {"row": rows}
    for a in activities:
        data[a] = [values[r].get(a, 0.0) for r in rows]
    fig = figure(name=name, y_range=rows, height=int(min(600, 90 + 26 * len(rows) + 12 * len(activities))),
                 sizing_mode="stretch_width", toolbar_location=None, tools="", title=title)
    fig.hbar_stack(activities, y="row", height=0.7, source=ColumnDataSource(data),
                   color=[colors[a] for a in activities], legend_label=activities)
    fig.add_tools(HoverTool(tooltips=[(what, "@row"), ("activity", "$name"),
                                      ("seconds", "@$name{0.000}")]))
    fig.xaxis.axis_label = "seconds"
    figs.figures[name] = fig
    figs.legend_outside(fig)


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    figures(figs, data["fine_metrics"])
    return {}


VIEW = register(View("fine_metrics", "Fine metrics", data, "panel_fine_metrics.html", draw, order=120,
                     about="fine performance metrics: execution, sending and gathering data, idle"))
