"""The Bokeh figures of the Run page, the worker page and the report, built from the
panels' data (:mod:`.panels`, :mod:`.views`); nothing here reads ClickHouse.

:class:`Figures` makes each panel's figures into ``figures`` (name -> Bokeh root):
the report puts every panel's into one document, the web page each panel's into a
document of its own as the panel loads. Every time axis shares one range within a
document (zoom one, zoom all); across the web page's documents a range carries the
tag ``"time"`` and a change of one is copied to the others by the page's script
(``blackboxSync``). Every time axis marks the worker deaths (red) and restarts
(orange): the data source named ``markers`` (columns ``x`` in ms, ``kind`` "death"
or "restart", ``worker``).

Names a test or a user can find in the page (``get_model_by_name`` on a
``Bokeh.documents`` entry): ``task-stream`` (one row per bar; binned:
``task-stream-binned``), ``critical-path``, ``markers``, ``graph-nodes`` and
``graph-edges`` (the task graph's), ``group-bars`` (the task groups' bars),
``memory-limit`` (a worker's memory limit line: a Span, the worker in its tags),
``<figure>-steps`` (a chart of steps: ``progress``, ``task_states``,
``activity_processing``, ``activity_cpu``, ``activity_transfer`` and a worker
page's ``worker_*`` ones).

Kept to few models per figure (one renderer per series family) and numeric columns
as numpy arrays (sent as binary buffers): Bokeh's Python side costs per model and per
list element, not per array.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from bokeh.layouts import column
from bokeh.models import (AdaptiveTicker, ColumnDataSource, CustomJS, DatetimeAxis, DatetimeTicker,
                          DatetimeTickFormatter, FixedTicker, HoverTool, NumeralTickFormatter,
                          Range1d, Select, Span, TapTool)
from bokeh.plotting import figure

from dask_blackbox.read import palette
from dask_blackbox.read.templates import fmt_bytes, fmt_s

#: Binary steps on a bytes axis (Dask's dashboard's TICKS_1024).
TICKS_1024 = {"base": 1024, "mantissas": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}
BYTES_FORMAT = "0.0 b"
STATE_COLORS = {"released": "#999999", "waiting": "#7f7f7f", "no-worker": "#8c564b",
                "queued": "#bcbd22", "processing": "#1f77b4", "memory": "#2ca02c",
                "erred": "#000000"}
MEMORY_COLORS = {"managed": "#0f5d9c", "unmanaged": "#7eb5e0", "spilled": "#999999"}
ACTION_ALPHA = {"transfer": 0.4, "disk-write": 0.4, "disk-read": 0.4, "deserialize": 0.4}
#: Workers drawn one by one (a small figure each) in the memory panel.
MEMORY_FIGURES = 12

#: A click on a task-stream bar or a graph node: the task page of its key, every
#: value encoded (Bokeh's OpenURL uses encodeURI, which keeps "&" and "=": a key
#: holding "&cluster=" would open another cluster's task).
_OPEN_TASK = """
const i = source.selected.indices[0];
if (i === undefined) return;
const key = source.data.key[i];
if (!key) return;
window.location.href = "task?cluster=" + encodeURIComponent(cluster)
    + "&key=" + encodeURIComponent(key);
"""

#: A time range changed: the page's other time ranges follow (documents of their own).
_SYNC = "if (window.blackboxSync) window.blackboxSync(cb_obj);"

#: The graph's colour choice: the nodes' fill colour field, and the legend shown.
_RECOLOR = """
renderer.glyph.fill_color = {field: "color_" + select.value};
for (const el of document.querySelectorAll(".graph-legend"))
    el.style.display = el.dataset.by === select.value ? "" : "none";
"""


def _ms(t: float | None) -> float | None:
    return None if t is None else t * 1000.0


def _num(values) -> np.ndarray:
    """A numeric column: Bokeh sends numpy arrays as one binary buffer, lists value by value."""
    return np.fromiter((np.nan if v is None else v for v in values), dtype=float)


def bytes_axis(axis) -> None:
    """Binary steps (KiB, MiB, GiB at powers of two), labelled in binary units."""
    axis.ticker = AdaptiveTicker(**TICKS_1024)
    axis.formatter = NumeralTickFormatter(format=BYTES_FORMAT)


class Figures:
    """Builds figures from panel data; ``scope`` and ``markers`` are the page's.
    ``web``: clicks open task pages and time ranges follow each other."""

    def __init__(self, scope, markers: dict, web: bool) -> None:
        self.scope = scope
        self.web = web
        self.x_range = Range1d(_ms(scope.t0), _ms(scope.t1), tags=["time"])
        if web:
            self.x_range.js_on_change("start", CustomJS(code=_SYNC))
            self.x_range.js_on_change("end", CustomJS(code=_SYNC))
        self.ticker = DatetimeTicker()
        self.formatter = DatetimeTickFormatter()
        deaths, restarts = markers.get("deaths", []), markers.get("restarts", [])
        self.dead_workers = {d["worker"] for d in deaths}
        self.marks = ColumnDataSource(name="markers", data={
            "x": [_ms(d["ts"]) for d in deaths] + [_ms(r["ts"]) for r in restarts],
            "kind": ["death"] * len(deaths) + ["restart"] * len(restarts),
            "worker": [d["worker"] for d in deaths] + [""] * len(restarts),
            "color": ["#d62728"] * len(deaths) + ["#ff7f0e"] * len(restarts)})
        self.figures: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers

    def _time_figure(self, name: str, title: str, height: int, **kwargs):
        # Equal borders on every time figure: their time axes line up on the page.
        fig = figure(name=name, title=title, x_axis_type=None, x_range=self.x_range,
                     height=height, sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset",
                     toolbar_location="above", min_border_left=190, min_border_right=260, **kwargs)
        fig.add_layout(DatetimeAxis(ticker=self.ticker, formatter=self.formatter,
                                    axis_label="time (UTC)"), "below")
        fig.xgrid.ticker = self.ticker
        self.figures[name] = fig
        return fig

    def _mark(self, fig) -> None:
        """Worker deaths (red) and restarts (orange) on this time axis."""
        if self.marks.data["x"]:
            fig.vspan(x="x", source=self.marks, line_color="color", line_width=2, line_dash="dashed")

    @staticmethod
    def _legend_outside(fig) -> None:
        if fig.legend:
            fig.legend.click_policy = "hide"
            fig.legend.label_text_font_size = "9pt"
            fig.add_layout(fig.legend[0], "right")

    def _steps(self, name: str, title: str, height: int, times: list, series: dict, colors: dict,
               labels: dict, value_format: str = "0.00", width: float | None = None, **kwargs):
        """One multi_line renderer for every series, drawn as steps, in the data source
        ``<name>-steps`` (columns ``xs``, ``ys`` in ms and values, ``label``).

        Without ``width``, ``times`` are instants: each value holds from its instant
        to the next one's. With ``width``, ``times`` are the starts of cells that wide
        and each value (a cell's mean or rate) is drawn over its own cell; the line
        breaks where a cell is missing (nothing was there to measure)."""
        fig = self._time_figure(name, title, height, **kwargs)
        xs, ys = [], []
        x = [_ms(t) for t in times]
        for values in series.values():
            if width is None:
                xs.append(_num([v for pair in zip(x, x) for v in pair][1:] + [x[-1]] if x else []))
                ys.append(_num([v for pair in zip(values, values) for v in pair] if values else []))
                continue
            px: list = []
            py: list = []
            w = _ms(width)
            for start, value in zip(x, values):
                if px and start > px[-1] + 1e-6 * w:
                    px.append(None)
                    py.append(None)
                px += [start, start + w]
                py += [value, value]
            xs.append(_num(px))
            ys.append(_num(py))
        source = ColumnDataSource(name=f"{name}-steps", data={
            "xs": xs, "ys": ys, "color": [colors[k] for k in series],
            "label": [labels[k] for k in series]})
        glyph = fig.multi_line(xs="xs", ys="ys", color="color", line_width=2, source=source,
                               legend_field="label")
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[("", "@label"),
                                                             ("value", "$y{" + value_format + "}")]))
        self._mark(fig)
        self._legend_outside(fig)
        return fig

    # ------------------------------------------------------------- task stream

    def task_stream(self, stream: dict, path: dict | None = None, name: str = "task_stream") -> None:
        rows = stream["rows"]
        row_workers = stream.get("row_workers") or rows
        height = int(min(900, max(180, 16 * len(rows) + 90)))
        if stream["mode"] == "bars":
            bars = stream["bars"]
            title = (f"Task stream: {len(bars):,} bars ({stream['computes_recorded']:,} computes), "
                     "one row per worker thread")
            color = [("black" if b["erred"] else palette.color_of(b["prefix"])) if b["action"] == "compute"
                     else palette.ACTIONS.get(b["action"], "gray") for b in bars]
            alpha = [ACTION_ALPHA.get(b["action"], 1.0) for b in bars]
            source = ColumnDataSource(name="task-stream", data={
                "left": _num(_ms(b["start"]) for b in bars), "right": _num(_ms(b["stop"]) for b in bars),
                "bottom": _num(b["row"] - 0.4 for b in bars), "top": _num(b["row"] + 0.4 for b in bars),
                "color": color, "alpha": _num(alpha), "key": [b["key"] for b in bars],
                "prefix": [b["prefix"] for b in bars], "action": [b["action"] for b in bars],
                "worker": [b["worker"] for b in bars],
                "duration": [fmt_s(b["stop"] - b["start"]) for b in bars]})
            tooltips = [("key", "@key"), ("action", "@action"), ("worker", "@worker"),
                        ("duration", "@duration")]
        else:
            cells = stream["cells"]
            title = (f"Task stream, binned: {stream['bars_recorded']:,} bars in "
                     f"{stream['bucket']:.3g} s cells, one row per worker (height: threads busy, "
                     "colour: busiest prefix); narrow the window to see single tasks")
            source = ColumnDataSource(name="task-stream-binned", data={
                "left": _num(_ms(c["start"]) for c in cells), "right": _num(_ms(c["stop"]) for c in cells),
                "bottom": _num(c["row"] - 0.45 for c in cells),
                "top": _num(c["row"] - 0.45 + 0.9 * c["busy"] for c in cells),
                "color": [palette.ACTIONS.get(c["prefix"]) or palette.color_of(c["prefix"]) for c in cells],
                "alpha": _num([1.0] * len(cells)), "prefix": [c["prefix"] for c in cells],
                "worker": [c["worker"] for c in cells],
                "busy": [f"{100 * c['busy']:.0f}%" for c in cells],
                "tasks": _num(c["tasks"] for c in cells)})
            tooltips = [("worker", "@worker"), ("busiest", "@prefix"), ("threads busy", "@busy"),
                        ("computes started", "@tasks")]
        fig = self._time_figure(name, title, height, y_range=Range1d(len(rows) - 0.5, -0.5))
        glyph = fig.quad(left="left", right="right", bottom="bottom", top="top", color="color",
                         alpha="alpha", line_color=None, source=source)
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=tooltips))
        if self.web and stream["mode"] == "bars":
            fig.add_tools(TapTool(renderers=[glyph], callback=CustomJS(
                args={"source": source, "cluster": self.scope.cluster_id}, code=_OPEN_TASK)))
        fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))))
        fig.yaxis.major_label_overrides = {
            i: label + (" (died)" if worker in self.dead_workers else "")
            for i, (label, worker) in enumerate(zip(rows, row_workers))} if len(rows) <= 60 else {}
        fig.yaxis.major_label_text_font_size = "8pt"
        fig.ygrid.grid_line_color = None
        self._mark(fig)
        if path:
            critical_path_outline(fig, stream, path)

    # ------------------------------------------------------------ progress

    def progress(self, prog: dict) -> None:
        series = prog["series"]
        colors = palette.distinct([p for p in series if p != "other"], {"other": "#777777"})
        erred = prog.get("erred", {})
        labels = {p: f"{p} ({prog['totals'].get(p, 0):,}"
                     + (f", {erred[p]:,} erred = {erred[p] / max(prog['totals'].get(p, 0), 1):.0%})"
                        if erred.get(p) else ")")
                  for p in series}
        self._steps("progress", "Progress per prefix: fraction of its tasks finished",
                    max(260, 50 + 22 * len(series)), prog["times"], series, colors, labels,
                    value_format="0%", y_range=Range1d(0, 1.05))

    def task_states(self, states: dict) -> None:
        series = states["series"]
        self._steps("task_states", "Tasks by state", 240, states["times"], series,
                    {s: STATE_COLORS.get(s, "#333333") for s in series}, {s: s for s in series},
                    value_format="0,0")

    # -------------------------------------------------------------- memory

    def memory(self, mem: dict) -> list[str]:
        """The cluster's memory (stacked, with the live workers' total memory limit)
        and a small figure per worker shown, each on its own binary scale with its
        memory limit drawn (dashed red)."""
        if not mem["n_workers"]:
            return []
        c = mem["cluster"]
        fig = self._time_figure("memory", f"Memory, all {mem['n_workers']} workers (sum of averages)", 240)
        source = ColumnDataSource({"x": _num(_ms(t) for t in c["times"]), "managed": _num(c["managed"]),
                                   "unmanaged": _num(c["unmanaged"]), "spilled": _num(c["spilled"])})
        fig.varea_stack(["managed", "unmanaged", "spilled"], x="x", source=source,
                        color=[MEMORY_COLORS[k] for k in ("managed", "unmanaged", "spilled")],
                        legend_label=["managed", "unmanaged", "spilled"])
        limit = mem.get("limit") or {}
        if limit.get("times"):
            lx = [_ms(t) for t in limit["times"]]
            fig.step(x=_num(lx), y=_num(limit["total"]), mode="after", line_color="#d62728",
                     line_dash="dashed", line_width=1.5, legend_label="memory limit of the workers")
        bytes_axis(fig.yaxis[0])
        self._mark(fig)
        self._legend_outside(fig)
        names = ["memory"]
        limits = mem.get("limits") or {}
        shown = list(mem["workers"])[:MEMORY_FIGURES]
        rows = []
        for worker in shown:
            s = mem["workers"][worker]
            cap = limits.get(worker)
            total = [m + u + sp for m, u, sp in zip(s["managed"], s["unmanaged"], s["spilled"])]
            top = max(total + [cap or 0.0, 1.0]) * 1.05
            dead = worker in self.dead_workers
            name = f"memory-{len(rows)}"
            f = figure(name=name, x_range=self.x_range, y_range=Range1d(0, top), height=110,
                       sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset", toolbar_location=None,
                       title=worker + (" (died)" if dead else "")
                       + (f", memory limit {fmt_bytes(cap)}" if cap else ", no memory limit recorded"),
                       x_axis_type=None, min_border_left=190, min_border_right=260)
            f.title.text_font_size = "9pt"
            f.xgrid.ticker = self.ticker
            src = ColumnDataSource({"x": _num(_ms(t) for t in s["times"]), "managed": _num(s["managed"]),
                                    "unmanaged": _num(s["unmanaged"]), "spilled": _num(s["spilled"])})
            f.varea_stack(["managed", "unmanaged", "spilled"], x="x", source=src,
                          color=[MEMORY_COLORS[k] for k in ("managed", "unmanaged", "spilled")])
            if cap:
                f.add_layout(Span(location=cap, dimension="width", line_color="#d62728",
                                  line_dash="dashed", line_width=1.5, name="memory-limit", tags=[worker]))
            bytes_axis(f.yaxis[0])
            f.yaxis.major_label_text_font_size = "8pt"
            if self.marks.data["x"]:
                f.vspan(x="x", source=self.marks, line_color="color", line_width=2, line_dash="dashed")
            rows.append(f)
        if rows:
            rows[-1].add_layout(DatetimeAxis(ticker=self.ticker, formatter=self.formatter), "below")
            rows[-1].height += 30
            self.figures["memory_workers"] = column(*rows, sizing_mode="stretch_width",
                                                    name="memory_workers")
            names.append("memory_workers")
        return names

    # --------------------------------------------------------------- spans

    def span_gantt(self, spans: dict) -> None:
        rows = [s for s in spans["spans"] if s["start"] and s["stop"]]
        if not rows:
            return
        fig = self._time_figure("span_gantt", "Spans: start to stop", int(min(600, 60 + 24 * len(rows))),
                                y_range=Range1d(len(rows) - 0.5, -0.5))
        depth_colors = palette.SPARE
        source = ColumnDataSource(name="spans", data={
            "y": list(range(len(rows))), "left": [_ms(s["start"]) for s in rows],
            "right": [_ms(s["stop"]) for s in rows], "name": [s["name"] for s in rows],
            "task_s": [fmt_s(s["task_s"]) for s in rows],
            "elapsed": [fmt_s(s["elapsed_s"]) for s in rows],
            "color": [depth_colors[s["depth"] % len(depth_colors)] for s in rows]})
        glyph = fig.hbar(y="y", left="left", right="right", height=0.6, color="color", source=source)
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[
            ("span", "@name"), ("elapsed", "@elapsed"), ("task seconds (Dask's duration)", "@task_s")]))
        fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))))
        fig.yaxis.major_label_overrides = {i: "  " * s["depth"] + s["name"] for i, s in enumerate(rows)}
        self._mark(fig)

    # ------------------------------------------------------- fine metrics

    def fine_metrics(self, fm: dict) -> None:
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
            self._stacked("fine_metrics", prefixes, execute, colors,
                          "Fine performance metrics: task execution seconds by prefix and activity",
                          "prefix")
        if transfer:
            contexts = [c for c in ("get-data", "gather-dep") if c in transfer][::-1]
            self._stacked("fine_metrics_transfer", contexts, transfer, colors,
                          "Sending data (get-data) and gathering dependencies (gather-dep): "
                          "seconds by activity", "context")

    def _stacked(self, name: str, rows: list[str], values: dict, colors: dict, title: str,
                 what: str) -> None:
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
        self.figures[name] = fig
        self._legend_outside(fig)

    # ------------------------------------------------------------ groups

    def groups(self, data: dict) -> None:
        """Task groups over time: a bar per group from its first compute to its last
        (the groups that computed), coloured by prefix (black: a task of it erred),
        its tasks, computed, erred and compute seconds in the hover; the data source
        ``group-bars`` (``left``/``right`` in ms, ``group``, ``tasks``, ``memory``,
        ``erred``, ``compute``)."""
        rows = [g for g in data["groups"] if g["start"] is not None and g["stop"] is not None]
        if not rows:
            return
        colors = palette.distinct(dict.fromkeys(g["prefix"] for g in rows))
        fig = self._time_figure("groups", f"Task groups over time ({len(rows)} of {data['n_groups']} groups)",
                                int(min(900, 70 + 18 * len(rows))), y_range=Range1d(len(rows) - 0.5, -0.5))
        source = ColumnDataSource(name="group-bars", data={
            "y": _num(range(len(rows))), "left": _num(_ms(g["start"]) for g in rows),
            "right": _num(_ms(max(g["stop"], g["start"] + 1e-3)) for g in rows),
            "group": [g["group"] for g in rows], "prefix": [g["prefix"] for g in rows],
            "tasks": _num(g["tasks"] for g in rows), "memory": _num(g["memory"] for g in rows),
            "erred": _num(g["erred"] for g in rows),
            "compute": [fmt_s(g["compute_s"]) for g in rows],
            "line": ["black" if g["erred"] else None for g in rows],
            "color": [colors[g["prefix"]] for g in rows]})
        glyph = fig.hbar(y="y", left="left", right="right", height=0.7, fill_color="color",
                         line_color="line", line_width=2, source=source)
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[
            ("group", "@group"), ("prefix", "@prefix"), ("tasks", "@tasks{0,0}"),
            ("computed", "@memory{0,0}"), ("erred", "@erred{0,0}"), ("compute", "@compute")]))
        fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))))
        fig.yaxis.major_label_overrides = {i: g["group"][:40] for i, g in enumerate(rows)}
        fig.yaxis.major_label_text_font_size = "8pt"
        fig.ygrid.grid_line_color = None
        self._mark(fig)

    # ------------------------------------------------------------- graph

    def graph(self, g: dict) -> dict[str, dict[str, str]]:
        """The task graph: nodes in layers, edges as lines; a choice of colouring (a
        Select, switched in the page without asking the server again); a click on a
        node opens its task page. Returns the legend of each colouring
        (``{by: {label: colour}}``)."""
        nodes, edges = g["nodes"], g["edges"]
        if not nodes:
            return {}
        pos = {n["id"]: (n["x"], n["y"]) for n in nodes}
        prefix_colors = palette.distinct(dict.fromkeys(n["prefix"] for n in nodes))
        worker_colors = palette.categories(sorted({n["worker"] for n in nodes if n["worker"]}))
        durations = [n["duration"] for n in nodes]
        by = {
            "duration": palette.ramp(durations),
            "worker": [worker_colors.get(n["worker"], "#cccccc") for n in nodes],
            "prefix": [prefix_colors[n["prefix"]] for n in nodes],
            "state": [palette.GRAPH_STATES.get(n["state"], "#cccccc") for n in nodes],
            "critical": ["#d62728" if n["critical"] else "#dddddd" for n in nodes],
        }
        top = max(durations, default=0.0)
        legends = {
            "duration": {f"0 s": palette.ramp([0.0, top])[0], fmt_s(top): palette.ramp([top, top])[0]},
            "worker": worker_colors, "prefix": prefix_colors,
            "state": {s: palette.GRAPH_STATES[s] for s in sorted({n["state"] for n in nodes})
                      if s in palette.GRAPH_STATES},
            "critical": {"on the critical path": "#d62728", "not on it": "#dddddd"}
            if g.get("critical") else {"critical path not computed": "#dddddd"},
        }
        most = max(n["tasks"] for n in nodes)
        size = [6 + 10 * min(1.0, (n["tasks"] / most) ** 0.5) if g["level"] != "task" else 9
                for n in nodes]
        node_source = ColumnDataSource(name="graph-nodes", data={
            "x": _num(n["x"] for n in nodes), "y": _num(n["y"] for n in nodes),
            "id": [n["id"] for n in nodes], "key": [n["key"] for n in nodes],
            "label": [n["label"] for n in nodes], "prefix": [n["prefix"] for n in nodes],
            "worker": [n["worker"] for n in nodes], "state": [n["state"] for n in nodes],
            "tasks": _num(n["tasks"] for n in nodes), "size": _num(size),
            "duration": [fmt_s(n["duration"]) for n in nodes],
            **{f"color_{k}": v for k, v in by.items()}})
        edge_source = ColumnDataSource(name="graph-edges", data={
            "xs": [_num([pos[e["source"]][0], pos[e["target"]][0]]) for e in edges],
            "ys": [_num([pos[e["source"]][1], pos[e["target"]][1]]) for e in edges],
            "source": [e["source"] for e in edges], "target": [e["target"] for e in edges],
            "weight": _num(e["weight"] for e in edges)})
        width = max(x for x, _ in pos.values()) + 1
        height = max(y for _, y in pos.values()) + 1
        fig = figure(name="graph", height=int(min(900, max(260, 22 * height + 60))),
                     sizing_mode="stretch_width", tools="pan,wheel_zoom,box_zoom,reset",
                     toolbar_location="above", x_range=Range1d(-0.5, width - 0.5),
                     y_range=Range1d(height - 0.5, -0.5),
                     title=f"Task graph: {len(nodes):,} {g['level']} nodes, {len(edges):,} edges "
                           "(dependencies left, dependents right)")
        fig.multi_line(xs="xs", ys="ys", source=edge_source, line_color="#888888", line_alpha=0.5,
                       line_width=1)
        glyph = fig.scatter(x="x", y="y", size="size", source=node_source, fill_color="color_duration",
                            line_color="#444444", line_width=0.5)
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[
            (g["level"], "@label"), ("prefix", "@prefix"), ("worker", "@worker"), ("state", "@state"),
            ("compute" + (" per task" if g["level"] != "task" else ""), "@duration"),
            ("tasks", "@tasks{0,0}")]))
        if self.web:
            fig.add_tools(TapTool(renderers=[glyph], callback=CustomJS(
                args={"source": node_source, "cluster": self.scope.cluster_id}, code=_OPEN_TASK)))
        fig.axis.visible = False
        fig.grid.grid_line_color = None
        select = Select(title="colour by", value="duration", options=list(by), name="graph-color",
                        width=200)
        select.js_on_change("value", CustomJS(args={"renderer": glyph, "select": select}, code=_RECOLOR))
        self.figures["graph"] = column(select, fig, sizing_mode="stretch_width", name="graph")
        return legends

    # ------------------------------------------------ processing, CPU, transfer

    def activity(self, act: dict, prefix: str = "activity",
                 whose: str = "workers' samples, summed") -> list[str]:
        """Dask's Processing, CPU and Data Transfer views over time: tasks executing,
        ready and in flight (summed over the workers), CPU (cores busy, with the
        threads offered), each drawn over its time cell (``cell`` wide, ``times``
        their middles); and the seconds of each action per second of its bucket
        (``actions``: ``times`` the buckets' ends, ``bucket`` their width): how many
        threads were doing it at once. ``whose``: the samples' source, in the titles."""
        names = []
        p = act.get("processing") or {}
        if p.get("times"):
            cell = act["cell"]
            starts = [t - cell / 2 for t in p["times"]]
            series = {k: p[k] for k in ("executing", "ready", "in_flight")}
            self._steps(f"{prefix}_processing", f"Processing: tasks executing, ready and in flight "
                        f"({whose})", 220, starts, series,
                        {"executing": "#2ca02c", "ready": "#1f77b4", "in_flight": "#d62728"},
                        {"executing": "executing", "ready": "ready", "in_flight": "in flight"},
                        value_format="0.0", width=cell)
            names.append(f"{prefix}_processing")
            series = {"cpu": [None if v is None else v / 100.0 for v in p["cpu"]]}
            labels = {"cpu": "CPU (cores busy)"}
            colors = {"cpu": "#9467bd"}
            if any(v for v in p.get("threads", [])):
                series["threads"] = p["threads"]
                labels["threads"], colors["threads"] = "threads offered", "#7f7f7f"
            self._steps(f"{prefix}_cpu", f"CPU: cores busy ({whose})", 200,
                        starts, series, colors, labels, value_format="0.00", width=cell)
            names.append(f"{prefix}_cpu")
        t = act.get("actions") or {}
        if t.get("times") and t.get("series"):
            series = t["series"]
            bucket = t["bucket"]
            colors = {a: palette.ACTIONS.get(a, "#2ca02c" if a == "compute" else "#8c564b") for a in series}
            self._steps(f"{prefix}_transfer", "Data transfer and disk: seconds of each action per "
                        "second of the window (compute for scale)", 200, [e - bucket for e in t["times"]],
                        series, colors, {a: a for a in series}, value_format="0.00", width=bucket)
            names.append(f"{prefix}_transfer")
        return names

    def worker_memory(self, s: dict, limit: int | None, name: str = "worker_memory") -> None:
        """One worker's memory against its limit: managed, unmanaged, spilled (stacked
        means per cell), the highest process memory sampled, the memory limit."""
        fig = self._time_figure(name, "Memory" + (f" against its limit, {fmt_bytes(limit)}" if limit
                                                   else " (no memory limit recorded)"), 260)
        src = ColumnDataSource({"x": _num(_ms(t) for t in s["times"]), "managed": _num(s["managed"]),
                                "unmanaged": _num(s["unmanaged"]), "spilled": _num(s["spilled"]),
                                "peak": _num(s["memory_max"])})
        fig.varea_stack(["managed", "unmanaged", "spilled"], x="x", source=src,
                        color=[MEMORY_COLORS[k] for k in ("managed", "unmanaged", "spilled")],
                        legend_label=["managed", "unmanaged", "spilled"])
        fig.line(x="x", y="peak", source=src, line_color="black", line_width=1,
                 legend_label="process memory, highest sample")
        if limit:
            fig.add_layout(Span(location=limit, dimension="width", line_color="#d62728",
                                line_dash="dashed", line_width=2, name="memory-limit", tags=[s.get("worker", "")]))
            fig.y_range = Range1d(0, max([limit] + [v for v in s["memory_max"] if v]) * 1.05)
        bytes_axis(fig.yaxis[0])
        self._mark(fig)
        self._legend_outside(fig)


def critical_path_outline(stream_figure, stream: dict, path: dict) -> None:
    """Outline the critical path on the task stream figure: each link's compute, on
    the row where the stream drew that task (bars) or on its worker's row (binned),
    as the data source named ``critical-path`` (columns ``key``, ``left``, ``right``,
    ...), and a dashed line from each link's compute to the next one's
    (``critical-path-joins``): the time between them is what the link waited on."""
    if not path or not path.get("available"):
        return
    if stream["mode"] == "bars":
        row_of = {b["key"]: b["row"] for b in stream["bars"] if b["action"] == "compute"}
    else:
        index = {worker: i for i, worker in enumerate(stream["rows"])}
        row_of = {link["key"]: index.get(link["worker"]) for link in path["links"]}
    boxes = []
    for link in path["links"]:
        row = row_of.get(link["key"])
        if row is None:
            continue
        waited = {p: v for p, v in link["parts"].items() if p != "compute" and v > 0}
        boxes.append({"key": link["key"], "row": row, "left": _ms(link["compute_start"]),
                      "right": _ms(link["compute_stop"]), "prefix": link["prefix"],
                      "link": fmt_s(link["seconds"]),
                      "waited": ", ".join(f"{p} {fmt_s(v)}" for p, v in waited.items()) or "nothing"})
    if not boxes:
        return
    source = ColumnDataSource(name="critical-path", data={
        "left": _num(b["left"] for b in boxes), "right": _num(b["right"] for b in boxes),
        "bottom": _num(b["row"] - 0.45 for b in boxes), "top": _num(b["row"] + 0.45 for b in boxes),
        **{k: [b[k] for b in boxes] for k in ("key", "prefix", "link", "waited")}})
    glyph = stream_figure.quad(left="left", right="right", bottom="bottom", top="top",
                               source=source, fill_alpha=0.0, line_color="black", line_width=3)
    joins = ColumnDataSource(name="critical-path-joins", data={
        "xs": [_num([a["right"], b["left"]]) for a, b in zip(boxes, boxes[1:])],
        "ys": [_num([a["row"], b["row"]]) for a, b in zip(boxes, boxes[1:])]})
    stream_figure.multi_line(xs="xs", ys="ys", source=joins, line_color="black", line_width=2,
                             line_dash="dashed")
    stream_figure.add_tools(HoverTool(renderers=[glyph], tooltips=[
        ("critical path", "@key"), ("link", "@link"), ("waited on", "@waited")]))
