"""What the figures of the Run page, the worker page and the report share (each
view's figures are its module's, :mod:`.views`); nothing here reads ClickHouse.

:class:`Figures` holds a page's figures, as the views draw them, in ``figures`` (name
-> Bokeh root), with the time range, ticks and markers they share:
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
from bokeh.models import (AdaptiveTicker, ColumnDataSource, CustomJS, DatetimeAxis, DatetimeTicker,
                          DatetimeTickFormatter, HoverTool, NumeralTickFormatter, Range1d)
from bokeh.plotting import figure

#: Binary steps on a bytes axis (Dask's dashboard's TICKS_1024).
TICKS_1024 = {"base": 1024, "mantissas": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}
BYTES_FORMAT = "0.0 b"
MEMORY_COLORS = {"managed": "#0f5d9c", "unmanaged": "#7eb5e0", "spilled": "#999999"}

#: A click on a task-stream bar or a graph node: the task page of its key, every
#: value encoded (Bokeh's OpenURL uses encodeURI, which keeps "&" and "=": a key
#: holding "&cluster=" would open another cluster's task).
OPEN_TASK = """
const i = source.selected.indices[0];
if (i === undefined) return;
const key = source.data.key[i];
if (!key) return;
window.location.href = "task?cluster=" + encodeURIComponent(cluster)
    + "&key=" + encodeURIComponent(key);
"""

#: A time range changed: the page's other time ranges follow (documents of their own).
_SYNC = "if (window.blackboxSync) window.blackboxSync(cb_obj);"


def ms(t: float | None) -> float | None:
    return None if t is None else t * 1000.0


def num(values) -> np.ndarray:
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
        self.x_range = Range1d(ms(scope.t0), ms(scope.t1), tags=["time"])
        if web:
            self.x_range.js_on_change("start", CustomJS(code=_SYNC))
            self.x_range.js_on_change("end", CustomJS(code=_SYNC))
        self.ticker = DatetimeTicker()
        self.formatter = DatetimeTickFormatter()
        deaths, restarts = markers.get("deaths", []), markers.get("restarts", [])
        self.dead_workers = {d["worker"] for d in deaths}
        self.marks = ColumnDataSource(name="markers", data={
            "x": [ms(d["ts"]) for d in deaths] + [ms(r["ts"]) for r in restarts],
            "kind": ["death"] * len(deaths) + ["restart"] * len(restarts),
            "worker": [d["worker"] for d in deaths] + [""] * len(restarts),
            "color": ["#d62728"] * len(deaths) + ["#ff7f0e"] * len(restarts)})
        self.figures: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers

    def time_figure(self, name: str, title: str, height: int, **kwargs):
        # Equal borders on every time figure: their time axes line up on the page.
        fig = figure(name=name, title=title, x_axis_type=None, x_range=self.x_range,
                     height=height, sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset",
                     toolbar_location="above", min_border_left=190, min_border_right=260, **kwargs)
        fig.add_layout(DatetimeAxis(ticker=self.ticker, formatter=self.formatter,
                                    axis_label="time (UTC)"), "below")
        fig.xgrid.ticker = self.ticker
        self.figures[name] = fig
        return fig

    def mark(self, fig) -> None:
        """Worker deaths (red) and restarts (orange) on this time axis."""
        if self.marks.data["x"]:
            fig.vspan(x="x", source=self.marks, line_color="color", line_width=2, line_dash="dashed")

    @staticmethod
    def legend_outside(fig) -> None:
        if fig.legend:
            fig.legend.click_policy = "hide"
            fig.legend.label_text_font_size = "9pt"
            fig.add_layout(fig.legend[0], "right")

    def steps(self, name: str, title: str, height: int, times: list, series: dict, colors: dict,
               labels: dict, value_format: str = "0.00", width: float | None = None, **kwargs):
        """One multi_line renderer for every series, drawn as steps, in the data source
        ``<name>-steps`` (columns ``xs``, ``ys`` in ms and values, ``label``).

        Without ``width``, ``times`` are instants: each value holds from its instant
        to the next one's. With ``width``, ``times`` are the starts of cells that wide
        and each value (a cell's mean or rate) is drawn over its own cell; the line
        breaks where a cell is missing (nothing was there to measure)."""
        fig = self.time_figure(name, title, height, **kwargs)
        xs, ys = [], []
        x = [ms(t) for t in times]
        for values in series.values():
            if width is None:
                xs.append(num([v for pair in zip(x, x) for v in pair][1:] + [x[-1]] if x else []))
                ys.append(num([v for pair in zip(values, values) for v in pair] if values else []))
                continue
            px: list = []
            py: list = []
            w = ms(width)
            for start, value in zip(x, values):
                if px and start > px[-1] + 1e-6 * w:
                    px.append(None)
                    py.append(None)
                px += [start, start + w]
                py += [value, value]
            xs.append(num(px))
            ys.append(num(py))
        source = ColumnDataSource(name=f"{name}-steps", data={
            "xs": xs, "ys": ys, "color": [colors[k] for k in series],
            "label": [labels[k] for k in series]})
        glyph = fig.multi_line(xs="xs", ys="ys", color="color", line_width=2, source=source,
                               legend_field="label")
        fig.add_tools(HoverTool(renderers=[glyph], tooltips=[("", "@label"),
                                                             ("value", "$y{" + value_format + "}")]))
        self.mark(fig)
        self.legend_outside(fig)
        return fig

    # ------------------------------------------------------------- task stream


    # ------------------------------------------------------------ progress


    # --------------------------------------------------------------- spans


    # ------------------------------------------------------- fine metrics


    # ------------------------------------------------------------ groups


    # ------------------------------------------------------------- graph


    # ------------------------------------------------ processing, CPU, transfer
