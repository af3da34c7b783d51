"""The Run page drawn with Bokeh, as a self-contained HTML report or as a page of
the web UI (:mod:`.web`).

:func:`write_report` writes the performance report of any recorded run, without the
run having been wrapped in ``performance_report``: one HTML file holding every
panel of the Run page (:mod:`.panels`), with BokehJS and the styles inline, so it
opens with no network. :func:`render_run` is the same page for the web UI, loading
BokehJS from the UI server instead.

Charts are Bokeh documents (the library Dask's dashboard and ``performance_report``
are built with), embedded with :func:`bokeh.embed.file_html` into a Jinja2 template
rendered with autoescaping on: a task key, log line or exception containing HTML is
shown as text. Every time axis shares one range (zoom one, zoom all) and marks the
worker deaths (red) and restarts (orange): the data source named ``markers`` (columns
``x`` in ms, ``kind`` "death" or "restart", ``worker``). The task stream's bars are
the data source named ``task-stream`` (one row per bar; column ``action``; binned:
``task-stream-binned``), so a test or a user can count them in the page
(``Bokeh.documents[0].get_model_by_name("task-stream")``).

The page is one Bokeh document holding every figure (its references computed once),
few models per figure and numeric columns as numpy arrays (sent as binary buffers):
Bokeh's Python side costs per model and per list element, not per array.
"""

from __future__ import annotations

import datetime
import pathlib
import time
import urllib.parse
from typing import Any

import jinja2
import numpy as np
from bokeh.embed import file_html
from bokeh.document import Document
from bokeh.models import (ColumnDataSource, DatetimeAxis, DatetimeTicker, DatetimeTickFormatter,
                          CustomJS, FixedTicker, HoverTool, NumeralTickFormatter, Range1d,
                          TapTool)
from bokeh.plotting import figure
from bokeh.resources import INLINE, Resources

from dask_blackbox.read import panels
from dask_blackbox.read.backends import Backend

TEMPLATES = pathlib.Path(__file__).with_name("ui")

#: Dask's task stream colours for actions other than compute (compute: colour of the prefix).
ACTION_COLORS = {"transfer": "red", "disk-write": "orange", "disk-read": "orange",
                 "deserialize": "gray"}
ACTION_ALPHA = {"transfer": 0.4, "disk-write": 0.4, "disk-read": 0.4, "deserialize": 0.4}
STATE_COLORS = {"released": "#999999", "waiting": "#7f7f7f", "no-worker": "#8c564b",
                "queued": "#bcbd22", "processing": "#1f77b4", "memory": "#2ca02c",
                "erred": "#000000"}
MEMORY_COLORS = {"managed": "#0f5d9c", "unmanaged": "#7eb5e0", "spilled": "#999999"}
ACTIVITY_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


#: The task stream's click: the task page of the bar clicked, every value encoded.
_OPEN_TASK = """
const i = source.selected.indices[0];
if (i === undefined) return;
window.location.href = "task?cluster=" + encodeURIComponent(cluster)
    + "&key=" + encodeURIComponent(source.data.key[i]);
"""


def color_of(name: str) -> str:
    """Dask's colour for a task prefix (the task stream's and progress bars')."""
    from distributed.utils import color_of as dask_color_of

    return dask_color_of(name)


# ------------------------------------------------------------------ templates


def _fmt_time(value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, datetime.datetime):
        value = value.timestamp()
    try:
        t = datetime.datetime.fromtimestamp(float(value), datetime.timezone.utc)
    except (TypeError, ValueError, OverflowError):
        return str(value)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _fmt_s(value) -> str:
    if value is None or value != value:  # None or NaN: nothing to show
        return ""
    value = float(value)
    return f"{value:.3f} s" if value < 100 else f"{value:,.1f} s"


def _fmt_bytes(value) -> str:
    if value is None:
        return ""
    n = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(value)


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined)
    env.filters.update(time=_fmt_time, seconds=_fmt_s, bytes=_fmt_bytes,
                       quote=lambda v: urllib.parse.quote(str(v), safe=""))
    return env


_ENV: jinja2.Environment | None = None


def env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        _ENV = environment()
    return _ENV


# -------------------------------------------------------------------- figures


def _ms(t: float | None) -> float | None:
    return None if t is None else t * 1000.0


def _num(values) -> np.ndarray:
    """A numeric column: Bokeh sends numpy arrays as one binary buffer, lists value by value."""
    return np.fromiter((np.nan if v is None else v for v in values), dtype=float)


class _Figures:
    """Builds the Run page's Bokeh figures from :func:`panels.run_data`.

    Kept to few Bokeh models (one renderer per series family, one shared datetime
    ticker): Bokeh's Python side costs per model, not per data point."""

    def __init__(self, data: dict, web: bool) -> None:
        self.data = data
        self.web = web
        scope: panels.Scope = data["scope"]
        self.scope = scope
        self.x_range = Range1d(_ms(scope.t0), _ms(scope.t1))
        self.ticker = DatetimeTicker()
        self.formatter = DatetimeTickFormatter()
        marks = data["markers"]
        deaths, restarts = marks["deaths"], marks["restarts"]
        self.dead_workers = {d["worker"] for d in deaths}
        self.marks = ColumnDataSource(name="markers", data={
            "x": [_ms(d["ts"]) for d in deaths] + [_ms(r["ts"]) for r in restarts],
            "kind": ["death"] * len(deaths) + ["restart"] * len(restarts),
            "worker": [d["worker"] for d in deaths] + [""] * len(restarts),
            "color": ["#d62728"] * len(deaths) + ["#ff7f0e"] * len(restarts)})
        self.figures: dict[str, Any] = {}

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

    def task_stream(self) -> None:
        stream = self.data["task_stream"]
        rows = stream["rows"]
        height = int(min(900, max(180, 16 * len(rows) + 90)))
        if stream["mode"] == "bars":
            bars = stream["bars"]
            title = (f"Task stream: {len(bars):,} bars ({stream['computes_recorded']:,} computes), "
                     "one row per worker thread")
            color = [("black" if b["erred"] else color_of(b["prefix"])) if b["action"] == "compute"
                     else ACTION_COLORS.get(b["action"], "gray") for b in bars]
            alpha = [ACTION_ALPHA.get(b["action"], 1.0) for b in bars]
            source = ColumnDataSource(name="task-stream", data={
                "left": _num(_ms(b["start"]) for b in bars), "right": _num(_ms(b["stop"]) for b in bars),
                "bottom": _num(b["row"] - 0.4 for b in bars), "top": _num(b["row"] + 0.4 for b in bars),
                "color": color, "alpha": _num(alpha), "key": [b["key"] for b in bars],
                "prefix": [b["prefix"] for b in bars], "action": [b["action"] for b in bars],
                "worker": [b["worker"] for b in bars],
                "duration": [_fmt_s(b["stop"] - b["start"]) for b in bars]})
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
                "color": [ACTION_COLORS.get(c["prefix"]) or color_of(c["prefix"]) for c in cells],
                "alpha": _num([1.0] * len(cells)), "prefix": [c["prefix"] for c in cells],
                "worker": [c["worker"] for c in cells],
                "busy": [f"{100 * c['busy']:.0f}%" for c in cells],
                "tasks": _num(c["tasks"] for c in cells)})
            tooltips = [("worker", "@worker"), ("busiest", "@prefix"), ("threads busy", "@busy"),
                        ("computes started", "@tasks")]
        fig = self._time_figure("task_stream", title, height, y_range=Range1d(len(rows) - 0.5, -0.5))
        glyph = fig.quad(left="left", right="right", bottom="bottom", top="top", color="color",
                         alpha="alpha", line_color=None, source=source)
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=tooltips))
        if self.web and stream["mode"] == "bars":
            # A click opens the bar's task page; the key is encoded whole (Bokeh's
            # OpenURL uses encodeURI, which keeps "&" and "=": a key holding
            # "&cluster=" would open another cluster's task).
            fig.add_tools(TapTool(renderers=[glyph], callback=CustomJS(
                args={"source": source, "cluster": self.scope.cluster_id}, code=_OPEN_TASK)))
        fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))))
        fig.yaxis.major_label_overrides = {i: name for i, name in enumerate(rows)} if len(rows) <= 60 else {}
        fig.yaxis.major_label_text_font_size = "8pt"
        fig.ygrid.grid_line_color = None
        self._mark(fig)

    def _lines(self, name: str, title: str, height: int, times: list, series: dict, colors: dict,
               labels: dict, **kwargs) -> None:
        """One multi_line renderer for every series, drawn as steps."""
        fig = self._time_figure(name, title, height, **kwargs)
        xs, ys = [], []
        x = [_ms(t) for t in times]
        for values in series.values():
            # steps: each value holds until the next bucket's end
            xs.append(_num([v for pair in zip(x, x) for v in pair][1:] + [x[-1]] if x else []))
            ys.append(_num([v for pair in zip(values, values) for v in pair] if values else []))
        source = ColumnDataSource(name=name, data={
            "xs": xs, "ys": ys, "color": [colors[k] for k in series],
            "label": [labels[k] for k in series]})
        glyph = fig.multi_line(xs="xs", ys="ys", color="color", line_width=2, source=source,
                               legend_field="label")
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[("", "@label"), ("value", "$y{0.00}")]))
        self._mark(fig)
        self._legend_outside(fig)

    def progress(self) -> None:
        prog = self.data["progress"]
        series = prog["series"]
        self._lines("progress", "Progress per prefix: fraction of its tasks finished",
                    max(260, 50 + 22 * len(series)),
                    prog["times"], series,
                    {p: "#777777" if p == "other" else color_of(p) for p in series},
                    {p: f"{p} ({prog['totals'].get(p, 0):,})" for p in series},
                    y_range=Range1d(0, 1.05))

    def task_states(self) -> None:
        states = self.data["task_states"]
        series = states["series"]
        self._lines("task_states", "Tasks by state", 240, states["times"], series,
                    {s: STATE_COLORS.get(s, "#333333") for s in series}, {s: s for s in series})

    def memory(self) -> list[str]:
        mem = self.data["memory"]
        if not mem["n_workers"]:
            return []
        c = mem["cluster"]
        fig = self._time_figure("memory", f"Memory, all {mem['n_workers']} workers (sum of averages)", 220)
        source = ColumnDataSource({"x": _num(_ms(t) for t in c["times"]), "managed": _num(c["managed"]),
                                   "unmanaged": _num(c["unmanaged"]), "spilled": _num(c["spilled"])})
        fig.varea_stack(["managed", "unmanaged", "spilled"], x="x", source=source,
                        color=[MEMORY_COLORS[k] for k in ("managed", "unmanaged", "spilled")],
                        legend_label=["managed", "unmanaged", "spilled"])
        fig.yaxis.formatter = NumeralTickFormatter(format="0.0 b")
        self._mark(fig)
        self._legend_outside(fig)
        # Per worker: one row each, the three layers stacked and scaled to the worker's peak.
        workers = list(mem["workers"])
        xs, ys, colors, labels, rows, peaks = [], [], [], [], [], []
        for i, worker in enumerate(workers):
            s = mem["workers"][worker]
            x = [_ms(t) for t in s["times"]]
            total = [m + u + sp for m, u, sp in zip(s["managed"], s["unmanaged"], s["spilled"])]
            peak = max(total + [1.0])
            low = [0.0] * len(x)
            for kind in ("managed", "unmanaged", "spilled"):
                high = [a + b for a, b in zip(low, s[kind])]
                base = i + 0.45
                xs.append(_num(x + x[::-1]))
                ys.append(_num([base - 0.9 * v / peak for v in high] + [base - 0.9 * v / peak for v in low[::-1]]))
                colors.append(MEMORY_COLORS[kind])
                labels.append(kind)
                rows.append(worker)
                peaks.append(_fmt_bytes(peak))
                low = high
        fig = self._time_figure("memory_workers", "Memory per worker (each row scaled to its peak)",
                                int(min(900, 90 + 40 * len(workers))),
                                y_range=Range1d(len(workers) - 0.5, -0.5))
        glyph = fig.patches(xs="xs", ys="ys", color="color", line_color=None, source=ColumnDataSource(
            {"xs": xs, "ys": ys, "color": colors, "kind": labels, "worker": rows, "peak": peaks}))
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[("worker", "@worker"), ("layer", "@kind"),
                                                             ("peak", "@peak")]))
        fig.yaxis.ticker = FixedTicker(ticks=list(range(len(workers))))
        fig.yaxis.major_label_overrides = {
            i: w + (" (died)" if w in self.dead_workers else "") for i, w in enumerate(workers)}
        fig.yaxis.major_label_text_font_size = "8pt"
        fig.ygrid.grid_line_color = None
        self._mark(fig)
        return ["memory", "memory_workers"]

    def span_gantt(self) -> None:
        rows = [s for s in self.data["spans"]["spans"] if s["start"] and s["stop"]]
        if not rows:
            return
        fig = self._time_figure("span_gantt", "Spans: start to stop", int(min(600, 60 + 24 * len(rows))),
                                y_range=Range1d(len(rows) - 0.5, -0.5))
        source = ColumnDataSource(name="spans", data={
            "y": list(range(len(rows))), "left": [_ms(s["start"]) for s in rows],
            "right": [_ms(s["stop"]) for s in rows], "name": [s["name"] for s in rows],
            "task_s": [_fmt_s(s["task_s"]) for s in rows],
            "elapsed": [_fmt_s(s["elapsed_s"]) for s in rows],
            "color": [ACTIVITY_PALETTE[s["depth"] % len(ACTIVITY_PALETTE)] for s in rows]})
        glyph = fig.hbar(y="y", left="left", right="right", height=0.6, color="color", source=source)
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[
            ("span", "@name"), ("elapsed", "@elapsed"), ("task seconds (Dask's duration)", "@task_s")]))
        fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))))
        fig.yaxis.major_label_overrides = {i: "  " * s["depth"] + s["name"] for i, s in enumerate(rows)}
        self._mark(fig)

    def fine_metrics(self) -> None:
        execute = self.data["fine_metrics"]["execute"]
        if not execute:
            return
        totals = {p: sum(v.values()) for p, v in execute.items()}
        prefixes = sorted(totals, key=lambda p: (-totals[p], p))[:20][::-1]
        activities = sorted({a for v in execute.values() for a in v},
                            key=lambda a: -sum(v.get(a, 0.0) for v in execute.values()))
        data = {"prefix": prefixes}
        for a in activities:
            data[a] = [execute[p].get(a, 0.0) for p in prefixes]
        fig = figure(name="fine_metrics", y_range=prefixes, height=int(min(600, 80 + 26 * len(prefixes))),
                     sizing_mode="stretch_width", toolbar_location=None, tools="",
                     title="Fine performance metrics: task execution seconds by prefix and activity")
        fig.hbar_stack(activities, y="prefix", height=0.7, source=ColumnDataSource(data),
                       color=[ACTIVITY_PALETTE[i % len(ACTIVITY_PALETTE)] for i in range(len(activities))],
                       legend_label=activities)
        fig.add_tools(HoverTool(tooltips=[("prefix", "@prefix"), ("activity", "$name"),
                                          ("seconds", "@$name{0.000}")]))
        fig.xaxis.axis_label = "seconds"
        self.figures["fine_metrics"] = fig
        self._legend_outside(fig)

    def build(self) -> dict:
        self.task_stream()
        critical_path_panel(self.figures.get("task_stream"), self.data)
        self.progress()
        self.task_states()
        memory = self.memory()
        self.span_gantt()
        self.fine_metrics()
        return {"figures": self.figures, "memory": memory}


def critical_path_panel(stream_figure, data: dict) -> None:
    """Outline the critical path on the task stream figure: each link's compute, on
    the row where the stream drew that task (bars) or on its worker's row (binned),
    as the data source named ``critical-path`` (columns ``key``, ``left``, ``right``,
    ...), and a dashed line from each link's compute to the next one's
    (``critical-path-joins``): the time between them is what the link waited on."""
    path = data.get("critical_path") or {}
    if stream_figure is None or not path.get("available"):
        return
    stream = data["task_stream"]
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
                      "link": _fmt_s(link["seconds"]),
                      "waited": ", ".join(f"{p} {_fmt_s(v)}" for p, v in waited.items()) or "nothing"})
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


def _document(figures: dict) -> Document:
    """One document holding every figure, its references computed once (adding
    roots one by one recomputes them per root)."""
    doc = Document()
    with doc.models.freeze():
        for fig in figures.values():
            doc.add_root(fig)
    return doc


# -------------------------------------------------------------------- render


def _bokeh_resources(web: bool, root_url: str):
    return Resources(mode="server", root_url=root_url) if web else INLINE


def render_run(data: dict, web: bool = False, root_url: str = "/", query: dict | None = None,
               query_string: str = "") -> str:
    """The Run page of :func:`panels.run_data` as HTML: self-contained (BokehJS
    inline) unless ``web``, where BokehJS comes from ``root_url``static/."""
    built = _Figures(data, web).build()
    figures = built["figures"]
    scope: panels.Scope = data["scope"]
    title = f"{scope.cluster_name} - dask-blackbox"
    variables = {
        "web": web, "data": data, "scope": scope, "query": query or {},
        "has": set(figures), "memory_figures": built["memory"], "levels": panels.LEVELS,
        "generated": time.time(), "page_title": title, "query_string": query_string,
    }
    template = env().get_template("run.html")
    return file_html(_document(figures), _bokeh_resources(web, root_url), title,
                     template=template, template_variables=variables)


def render_page(name: str, web: bool = True, figures: dict | None = None, root_url: str = "/",
                **variables) -> str:
    """Any other page (clusters, task, compare, error) from its template."""
    template = env().get_template(name)
    variables.setdefault("web", web)
    if figures:
        variables["has"] = set(figures)
        return file_html(_document(figures), _bokeh_resources(web, root_url),
                         variables.get("page_title", "dask-blackbox"), template=template,
                         template_variables=variables)
    return template.render(has=set(), bokeh_css="", bokeh_js="", plot_script="", roots={},
                           **variables)


def _unique(labels: list[str]) -> list[str]:
    """The labels, a repeated one numbered (a categorical axis needs distinct factors)."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def compare_figures(data: dict) -> dict:
    """Bokeh figures of :func:`panels.compare`: durations and compute by prefix per run."""
    runs = _unique(data["runs"])
    metrics = data["metrics"]
    figures = {}
    if not runs:
        return figures
    fig = figure(name="compare_durations", y_range=runs[::-1], height=int(80 + 40 * len(runs)),
                 sizing_mode="stretch_width", tools="save,reset", toolbar_location="above",
                 title=f"{data['span']}: elapsed and task seconds per run")
    for i, (metric, color) in enumerate((("elapsed_s", "#1f77b4"), ("task_s", "#ff7f0e"))):
        values = [v or 0.0 for v in metrics.get(metric, [0.0] * len(runs))]
        source = ColumnDataSource({"run": runs, "value": values,
                                   "text": [_fmt_s(v) for v in values]})
        from bokeh.transform import dodge
        glyph = fig.hbar(y=dodge("run", -0.18 + 0.36 * i, range=fig.y_range), right="value",
                         height=0.34, color=color, source=source,
                         legend_label="elapsed (stop - start)" if i == 0 else "task seconds (Span.duration)")
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[("run", "@run"), (metric, "@text")]))
    fig.xaxis.axis_label = "seconds"
    figures["compare_durations"] = fig
    compute = {m.removeprefix("compute_s "): v for m, v in metrics.items() if m.startswith("compute_s ")}
    if compute:
        prefixes = list(compute)
        source = ColumnDataSource({"run": runs, **{p: [v or 0.0 for v in compute[p]] for p in prefixes}})
        fig = figure(name="compare_compute", y_range=runs[::-1], height=int(80 + 40 * len(runs)),
                     sizing_mode="stretch_width", tools="save,reset", toolbar_location="above",
                     title=f"{data['span']}: compute seconds by prefix per run")
        fig.hbar_stack(prefixes, y="run", height=0.6, source=source,
                       color=[color_of(p) for p in prefixes], legend_label=prefixes)
        fig.add_tools(HoverTool(tooltips=[("run", "@run"), ("prefix", "$name"),
                                          ("seconds", "@$name{0.000}")]))
        fig.add_layout(fig.legend[0], "right")
        figures["compare_compute"] = fig
    return figures


def write_report(path: str | pathlib.Path, cluster: str, span: str | None = None,
                 since=None, until=None, backend: Backend | None = None) -> dict:
    """Write the Run page of ``cluster`` (name or id; optionally narrowed to a span
    and/or a window) to ``path`` as one self-contained HTML file. Returns
    ``{"path", "bytes", "seconds", "cluster_id"}``; raises panels.NotFound for an
    unknown cluster or span."""
    from dask_blackbox.read import backends

    started = time.perf_counter()
    own = backend is None
    backend = backends.connect() if own else backend
    try:
        data = panels.run_data(backend, cluster, span=span, since=since, until=until)
    finally:
        if own:
            backend.close()
    html = render_run(data, web=False)
    path = pathlib.Path(path)
    path.write_text(html, encoding="utf-8")
    return {"path": str(path), "bytes": path.stat().st_size,
            "seconds": time.perf_counter() - started, "cluster_id": data["scope"].cluster_id}
