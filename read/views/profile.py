"""The profile view: where the workers' threads spent their time, from Dask's own
worker profiles as recorded (:mod:`dask_blackbox.read.profiles`): the merged profile
of the page's scope (the whole run; a span's or a window's time), of every task or
of one task prefix (``prefix``), drawn as Dask's dashboard draws it (an icicle: a
rectangle per frame, as wide as its samples, a row per depth, coloured by file)
beside its hottest frames (self and total samples). A worker's page shows the same
view of that worker (:data:`WORKER_VIEW`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_blackbox.read import profiles
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures

#: The most sampled stacks drawn (and counted in the table); the rest are left off.
STACKS = 500
#: Frames in the table of the hottest.
TOP = 25
#: Prefixes offered in the prefix picker.
PREFIXES = 100


def data(ctx: Context) -> dict:
    return {"profile": profile_data(ctx, ctx.params.get("prefix") or "", ctx.worker)}


def profile_data(ctx: Context, prefix: str = "", worker: str | None = None) -> dict:
    """The scope's merged profile (of ``prefix``, "" for every task; of ``worker``):
    ``samples`` (of the :data:`STACKS` most sampled stacks), ``left_off`` (the
    stacks and samples beyond them), ``top`` (its :data:`TOP` hottest frames,
    :func:`profiles.top`), ``flame`` (the icicle's rectangles, Dask's
    ``profile.plot_data`` of the tree of those stacks, with each frame's samples),
    ``prefixes`` (those profiled in the scope, with their samples); ``none`` says
    why there is nothing when nothing was recorded (``samples`` 0)."""
    s = ctx.scope
    # the run's every cycle (a worker's Dask keeps its last hour, published once the
    # plugin attached); a span or a window: the cycles dated within it
    timed = s.span is not None or s.since is not None or s.until is not None
    window = {"since": s.t0, "until": s.t1 + 1e-6} if timed else {}
    out: dict = {"prefix": prefix, "worker": worker, "samples": 0, "left_off": [0, 0],
                 "top": [], "flame": None, "none": None,
                 "prefixes": profiles.prefixes(ctx.backend, s.cluster_id, worker,
                                               limit=PREFIXES, **window)}
    try:
        merged = profiles.load(ctx.backend, s.cluster_id, prefix, worker, limit=STACKS, **window)
    except profiles.NoProfiles as e:
        out["none"] = str(e)
        return out
    columns, rows = profiles.top(merged, TOP)
    out.update(samples=merged.samples, left_off=list(merged.left_off),
               top=[dict(zip(columns, r)) for r in rows], flame=flame(merged))
    return out


def tree(profile: profiles.Profile) -> dict:
    """The stacks of ``profile`` as a tree of Dask's (``distributed.profile``: each
    node's ``count``, ``children`` by frame text, ``description``), children in order
    of samples, most first."""
    root = {"count": 0, "children": {}, "identifier": "root",
            "description": {"filename": "", "name": "", "line_number": 0, "line": ""}}
    for frames, n in profile.frames():
        node = root
        node["count"] += n
        for text in frames:
            child = node["children"].get(text)
            if child is None:
                f = profiles.frame(text)
                child = node["children"][text] = {
                    "count": 0, "children": {}, "identifier": text,
                    "description": {"filename": f.file, "name": f.function,
                                    "line_number": f.line, "line": f.location}}
            child["count"] += n
            node = child
    todo = [root]
    while todo:
        node = todo.pop()
        node["children"] = dict(sorted(node["children"].items(), key=lambda kv: -kv[1]["count"]))
        todo.extend(node["children"].values())
    return root


def flame(profile: profiles.Profile) -> dict:
    """The icicle's rectangles: Dask's ``profile.plot_data`` of :func:`tree` (left,
    right, bottom, top in shares of the samples and rows; its colour by file), the
    root (every sample) left out, with each frame's ``samples`` and ``location``."""
    from distributed.profile import plot_data

    drawn = plot_data(tree(profile))
    samples = [state["count"] for state in drawn.pop("states")]
    del drawn["time"]  # the samples as seconds at Dask's default interval, not this run's
    out = {k: v[1:] for k, v in drawn.items()}
    out["samples"] = samples[1:]
    out["location"] = out.pop("line")
    return out


def figure(figs: Figures, flame: dict, name: str = "profile") -> str:
    """The icicle of ``flame``: the outermost frames on top, each frame's callees
    beneath it; its data source ``<name>-frames``, hovering a frame names it."""
    from bokeh.models import ColumnDataSource, HoverTool, Range1d
    from bokeh.plotting import figure as make

    depth = max(flame["top"], default=2)  # the rows run from 1 (the outermost) to depth
    source = ColumnDataSource(flame, name=f"{name}-frames")
    fig = make(name=name, height=min(60 + 18 * (depth - 1), 900), sizing_mode="stretch_width",
               x_range=Range1d(0, 1, bounds=(0, 1)), y_range=Range1d(depth, 1),
               tools="xpan,xwheel_zoom,box_zoom,reset,tap", toolbar_location="above",
               title="Samples by stack (outermost frame on top; width: share of the samples)")
    quads = fig.quad(left="left", right="right", bottom="bottom", top="top", color="color",
             line_color="black", line_width=0.5, line_alpha=0.3, source=source,
             name=f"{name}-quads")
    # a frame's function written on it where it is wide enough (canvas text, not HTML)
    labels = ColumnDataSource({
        "x": [left + 0.002 for left in flame["left"]],
        "y": [bottom + 0.5 for bottom in flame["bottom"]],
        "text": [_label(n, w) for n, w in zip(flame["name"], flame["width"])]},
        name=f"{name}-labels")
    fig.text(x="x", y="y", text="text", source=labels, text_font_size="8pt",
             text_baseline="middle", text_color="black")
    # tooltip fields are inserted as text (no HTML template here): a frame's name is data
    fig.add_tools(HoverTool(renderers=[quads], point_policy="follow_mouse", tooltips=[
        ("function", "@name"), ("file", "@filename"), ("line", "@line_number"),
        ("samples", "@samples (@percentage)")]))
    fig.axis.visible = False
    fig.grid.visible = False
    figs.figures[name] = fig
    return name


def _label(function: str, width: float) -> str:
    """``function`` cut to what a rectangle ``width`` wide (a share of the figure's
    width) holds at about 110 characters across, "" where that is too little."""
    room = int(width * 110)
    if room < 4:
        return ""
    return function if len(function) <= room else function[:room - 1] + "\u2026"


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    flame = data["profile"]["flame"]
    return {"profile_figure": figure(figs, flame) if flame and flame["left"] else None}


VIEW = register(View("profile", "Profile", data, "panel_profile.html", draw, order=125,
                     about="the workers' recorded profiles merged: a flame graph and the "
                           "hottest frames", params="&prefix="))
#: A worker's page: the same view of that worker's profile.
WORKER_VIEW = register(View("worker_profile", "Profile", data, "panel_profile.html", draw,
                            page="worker", order=45))
