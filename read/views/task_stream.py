"""The task stream view: Dask's task stream of the run (or span, or window), one bar
per recorded ``startstops`` action laid out one row per worker thread, with the
critical path outlined and the tasks that were running when their worker died
hatched.

Reduced so that a run of millions of tasks opens as fast as a run of ten: when the
scope holds more than ``max_bars`` bars the stream is ``mode="binned"``: per worker
and time bucket (:data:`.scope.BUCKETS` across the window) the busy fraction of the
worker's threads and the prefix that kept them busiest, computed by ClickHouse (from
the page aggregates for a whole run or span, :mod:`.aggregates`; from the per-minute
roll-ups, ``task_minutes``, once the raw rows expired). Narrow the window or pick a
span to see single tasks again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from dask_blackbox.read import aggregates, history, palette
from dask_blackbox.read import workers as worker_data
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.died_tasks import died_tasks
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.templates import fmt_s
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, number, register
from dask_blackbox.read.views.scope import BUCKETS, Scope, minutes
from dask_blackbox.read.views.scope import n_buckets as _n_buckets
from dask_blackbox.read.views.scope import where as _where

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures

#: Bars drawn see-through: the actions around a compute.
ACTION_ALPHA = {"transfer": 0.4, "disk-write": 0.4, "disk-read": 0.4, "deserialize": 0.4}


def data(ctx: Context) -> dict:
    finished = sum(c["memory"] + c["erred"] for c in ctx.counts().values())
    max_bars = number(ctx.params.get("max_bars"), MAX_BARS)
    if ctx.from_rollups():
        stream = from_rollups(ctx.backend, ctx.scope, nthreads(ctx.backend, ctx.scope, ctx.info()))
    else:
        stream = task_stream(ctx.backend, ctx.scope, max_bars, finished=finished, known=ctx.info())
    return {"task_stream": stream, "critical_path": ctx.critical_path()}


#: At most this many task-stream bars are shipped to a page; above, the stream is binned.
MAX_BARS = 20_000

#: What the bars of a stream are read from: the scheduler's transitions' startstops
#: (``ss``) of the scope (``{where}``) over the window ``t0``..``t1``.
STARTSTOPS = ("FROM {transitions} ARRAY JOIN startstops AS ss {where} "
              "AND source = 'scheduler' AND ss.stop >= toDateTime64({{t0:Float64}}, 6, 'UTC') "
              "AND ss.start <= toDateTime64({{t1:Float64}}, 6, 'UTC')")
#: The bars of :data:`STARTSTOPS` and the computes among them.
BARS_COUNTED = "SELECT count(), countIf(ss.action = 'compute') {startstops}"
#: The bars of :data:`STARTSTOPS` (as :func:`_lay_out` reads them), by worker and time.
BARS = ("SELECT worker, key, prefix, ss.action, toFloat64(ss.start), toFloat64(ss.stop), "
        "ss.source, finish = 'erred', toFloat64(ts), thread {startstops} ORDER BY worker, ts, key")
#: The binned stream of :data:`STARTSTOPS`: per worker and bucket ``b`` (``n`` buckets of
#: ``w`` seconds from ``t0``), busy seconds per prefix (or action), then the dominant one
#: and the total, and the computes and bars begun in it.
CELLS = (
    "SELECT worker, b, sum(busy) AS total, argMax(what, busy), sum(computes), sum(bars) FROM ("
    " SELECT worker, what, b, sum(least(e, {{t0:Float64}} + (b + 1) * {{w:Float64}}) "
    "   - greatest(s, {{t0:Float64}} + b * {{w:Float64}})) AS busy, "
    "   countIf(is_compute AND b = first_b) AS computes, countIf(b = first_b) AS bars FROM ("
    "  SELECT worker, if(ss.action = 'compute', prefix, ss.action) AS what, "
    "   ss.action = 'compute' AS is_compute, "
    "   greatest(toFloat64(ss.start), {{t0:Float64}}) AS s, least(toFloat64(ss.stop), {{t1:Float64}}) AS e, "
    "   toUInt32(least(floor((s - {{t0:Float64}}) / {{w:Float64}}), {{n:Float64}} - 1)) AS first_b, "
    "   toUInt32(least(floor((e - {{t0:Float64}}) / {{w:Float64}}), {{n:Float64}} - 1)) AS last_b "
    "  {startstops}) ARRAY JOIN range(first_b, last_b + 1) AS b "
    " GROUP BY worker, what, b) GROUP BY worker, b ORDER BY worker, b")
#: The binned stream from the roll-ups (``{where}``: the cluster, window and spans): per
#: worker and bucket ``b`` of ``w`` seconds from ``t0``, compute seconds, the prefix that
#: took most of them, and the tasks finished.
ROLLUP_CELLS = (
    "SELECT worker, b, sum(compute), argMax(prefix, compute), sum(n) FROM ("
    " SELECT worker, prefix, toUInt32(intDiv(toUInt32(minute) - toUInt32({{t0:Float64}}), "
    " toUInt32({{w:Float64}}))) AS b, sumMap(durations)['compute'] AS compute, "
    " sum(into['memory']) + sum(into['erred']) AS n "
    " FROM {task_minutes} {where} "
    " GROUP BY worker, prefix, b) GROUP BY worker, b ORDER BY worker, b")


def nthreads(backend: Backend, scope: Scope, known: dict | None = None) -> dict[str, int]:
    return worker_data.nthreads(backend, scope.cluster_id, known)


def task_stream(backend: Backend, scope: Scope, max_bars: int = MAX_BARS,
                finished: int | None = None, worker: str | None = None,
                known: dict | None = None) -> dict:
    """Dask's task stream: ``mode="bars"`` with one bar per recorded startstop
    (``bars``: worker, row, key, prefix, action, start, stop, erred) and ``rows``
    (one per worker thread, "worker thread N"), or ``mode="binned"`` (see the module
    docstring) with ``cells``: worker, row, start, stop, busy fraction, prefix, tasks,
    and ``died``: worker, row, key, prefix, start, stop of each task that was running
    when its worker died (:func:`.died_tasks.died_tasks`; in bars mode, bars of action
    :data:`DIED`).
    ``worker``: that worker's rows only; ``known``: the run's :func:`workers.info`, if
    already known.

    Rows: one per worker thread that ran a task (the ``thread`` Dask passed with
    processing->memory/erred, what its own task stream draws a row for), a worker's
    threads in the order they first ran something, workers by when their first task
    started; ``row_workers`` names each row's worker. Tasks recorded without a
    thread (older recordings) are packed onto the fewest rows of their worker where
    their compute intervals do not overlap.

    ``finished``: the transitions into memory or erred in the scope, if known (each
    carries at least one bar); above ``max_bars`` the stream is binned without
    counting its bars first. A whole run or span is counted and binned from the page
    aggregates (:mod:`.aggregates`) when it holds more than ``max_bars`` bars.
    """
    where, p = _where(scope, time_column="", span=True)
    p.update(t0=scope.t0, t1=scope.t1)
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    base = STARTSTOPS.format(transitions=_t(backend, "transitions"), where=where)
    out: dict[str, Any] = {"max_bars": max_bars}
    n_bars = None
    use_aggregates = worker is None and scope.since is None and scope.until is None
    if use_aggregates:
        n_bars, n_compute = aggregates.bars(backend, scope)
        out.update(bars_recorded=n_bars, computes_recorded=n_compute)
    elif finished is None or finished <= max_bars:
        _, counted = backend.query(BARS_COUNTED.format(startstops=base), p)
        n_bars, n_compute = counted[0]
        out.update(bars_recorded=n_bars, computes_recorded=n_compute)
    if n_bars is not None and n_bars <= max_bars:
        _, rows = backend.query(BARS.format(startstops=base), p)
        rows = list(rows) + _running_at_deaths(backend, scope, worker)
        out.update(mode="bars", **_lay_out(rows))
        return out
    cells = _cells(backend, scope, base, p, use_aggregates)
    out.update(_binned(backend, scope, cells, worker, known, out))
    return out


#: The action of a bar drawn for a task that was running when its worker died: it
#: reported no startstops, so Dask's own task stream has no bar for it.
DIED = "running when its worker died"


def _running_at_deaths(backend: Backend, scope: Scope, worker: str | None = None) -> list[tuple]:
    """The tasks running when their worker died (:func:`.died_tasks.died_tasks`) as
    bars (rows as :func:`_lay_out` reads them), action :data:`DIED`, from their last
    entry into processing (or the window's start) to the removal."""
    return [(d.worker, d.task.key, d.task.prefix, DIED, max(d.task.entered, scope.t0),
             d.task.left, "", False, d.task.left, None)
            for d in died_tasks(backend, scope, worker)]


def _lay_out(rows: list[tuple]) -> dict:
    """Assign each task to a thread row of its worker (see :func:`task_stream`)."""
    per_task: dict[tuple, list] = {}
    for worker, key, prefix, action, start, stop, source, erred, ts, thread in rows:
        per_task.setdefault((worker, key, ts, thread), []).append(
            (action, start, stop, source, prefix, erred))
    by_worker: dict[str, list] = defaultdict(list)
    for (worker, key, ts, thread), actions in per_task.items():
        compute = [a for a in actions if a[0] == "compute"] or actions
        start = min(a[1] for a in compute)
        stop = max(a[2] for a in compute)
        by_worker[worker].append((start, stop, key, thread, actions))
    row_names, row_workers, bars = [], [], []
    for worker in sorted(by_worker, key=lambda w: (min(t[0] for t in by_worker[w]), w)):
        tasks = sorted(by_worker[worker], key=lambda t: (t[0], t[1]))
        first = len(row_names)
        threads: dict[int, int] = {}  # thread -> its row, in order of first task
        for _, _, _, thread, _ in tasks:
            if thread is not None and thread not in threads:
                threads[thread] = len(threads)
        lanes_end: list[float] = []  # rows of tasks without a thread, after the threads'
        busy: dict[int, list[tuple[float, float]]] = defaultdict(list)  # thread row -> computes
        for start, stop, _, thread, actions in tasks:
            if thread is not None and actions[0][0] != DIED:
                busy[threads[thread]].append((start, stop))
        for start, stop, key, thread, actions in tasks:
            if thread is not None:
                row = threads[thread]
            elif actions[0][0] == DIED and threads:
                # the thread it ran on is not recorded: the first of its worker's
                # thread rows with no compute over that time (the one it kept busy)
                row = next((r for r in sorted(busy.keys() | set(threads.values()))
                            if not any(a < stop and start < b for a, b in busy[r])), 0)
            else:
                lane = _free_lane(lanes_end, start)
                if lane is None:
                    lane = len(lanes_end)
                    lanes_end.append(stop)
                else:
                    lanes_end[lane] = stop
                row = len(threads) + lane
            for action, a_start, a_stop, source, prefix, erred in actions:
                bars.append({"worker": worker, "row": first + row, "key": key, "prefix": prefix,
                             "action": action, "start": a_start, "stop": a_stop,
                             "source": source or "", "erred": bool(erred), "thread": thread})
        row_names += [f"{worker} thread {i + 1}" for i in range(len(threads))]
        row_names += [f"{worker} #{i}" for i in range(len(lanes_end))]
        row_workers += [worker] * (len(threads) + len(lanes_end))
    return {"rows": row_names, "row_workers": row_workers, "bars": bars}


def _free_lane(lanes_end: list[float], start: float) -> int | None:
    """The lowest lane whose last task ended by ``start``."""
    for i, end in enumerate(lanes_end):
        if end <= start:
            return i
    return None


def _cells(backend: Backend, scope: Scope, base: str, p: dict, use_aggregates: bool) -> list[tuple]:
    """Per worker and bucket: busy seconds, the busiest prefix (or action), computes
    and bars begun in it; from the page aggregates (a whole run or span) or from the
    startstops of ``base`` (the statement's FROM and WHERE)."""
    if use_aggregates:
        return aggregates.stream_cells(backend, scope, _n_buckets(scope))
    p.update(w=scope.bucket, n=BUCKETS)
    _, cells = backend.query(CELLS.format(startstops=base), p)
    return cells


def _binned(backend: Backend, scope: Scope, cells: list[tuple], worker: str | None,
            known: dict | None, counted: dict) -> dict:
    """The binned stream of :func:`task_stream` from its ``cells`` (the bars and
    computes recorded: as ``counted`` if counted)."""
    counts = {k: counted[k] for k in ("bars_recorded", "computes_recorded") if k in counted}
    threads = nthreads(backend, scope, known)
    first_cell: dict[str, int] = {}
    peak: dict[str, float] = defaultdict(float)
    for w, b, busy, _, _, _ in cells:
        peak[w] = max(peak[w], busy / scope.bucket)
        first_cell[w] = min(first_cell.get(w, b), b)
    workers = sorted(first_cell, key=lambda w: (first_cell[w], w))  # by first seen
    died = died_tasks(backend, scope, worker)
    workers += sorted({d.worker for d in died} - set(first_cell))  # died before any bar
    index = {w: i for i, w in enumerate(workers)}
    counts.setdefault("bars_recorded", sum(c[5] for c in cells))
    counts.setdefault("computes_recorded", sum(c[4] for c in cells))
    return dict(counts, mode="binned", bucket=scope.bucket, rows=workers, row_workers=workers, cells=[
        {"worker": w, "row": index[w], "start": scope.t0 + b * scope.bucket,
         "stop": scope.t0 + (b + 1) * scope.bucket,
         "busy": min(1.0, busy / scope.bucket / max(threads.get(w) or peak[w], 1e-9)),
         "prefix": what, "tasks": computes}
        for w, b, busy, what, computes, _ in cells
    ], died=[{"worker": d.worker, "row": index[d.worker], "key": d.task.key,
              "prefix": d.task.prefix, "start": max(d.task.entered, scope.t0),
              "stop": d.task.left}
             for d in died])


def from_rollups(backend: Backend, scope: Scope, threads: dict[str, int]) -> dict:
    """:func:`task_stream` in its binned mode, from ``task_minutes``: per
    worker and bucket, the compute seconds reported in it over the seconds its
    ``threads`` offered, and the prefix that took most of them."""
    w = minutes(scope)
    where = ["cluster_id = {c:String}", "minute >= toDateTime({t0:Float64}, 'UTC')",
             "minute < toDateTime({t1:Float64}, 'UTC')", "worker != ''"]
    p: dict = {"c": w.cluster_id, "t0": w.t0, "t1": w.t1, "w": w.bucket}
    if w.span_ids is not None:
        where.append("span_id IN {ids:Array(String)}")
        p["ids"] = w.span_ids
    _, rows = backend.query(ROLLUP_CELLS.format(
        task_minutes=history.rollup_table(backend, "task_minutes"),
        where="WHERE " + " AND ".join(where)), p)
    workers = sorted({r[0] for r in rows})
    return {
        "max_bars": 0, "bars_recorded": int(sum(r[4] for r in rows)),
        "computes_recorded": int(sum(r[4] for r in rows)), "mode": "binned",
        "bucket": w.bucket, "rows": workers, "from_rollups": True,
        "cells": [{"worker": worker, "row": workers.index(worker),
                   "start": w.t0 + b * w.bucket, "stop": w.t0 + (b + 1) * w.bucket,
                   "busy": min(1.0, compute / w.bucket / max(threads.get(worker) or 1, 1)),
                   "prefix": prefix, "tasks": int(n)}
                  for worker, b, compute, prefix, n in rows],
    }


def figures(figs: Figures, stream: dict, path: dict | None = None, name: str = "task_stream") -> None:
    """The task stream figure ``name`` (its bars, or its cells binned; hatched, the
    tasks running when their worker died; outlined, the critical path ``path``)."""
    from bokeh.models import CustomJS, FixedTicker, HoverTool, Range1d, TapTool

    from dask_blackbox.read.figures import OPEN_TASK

    rows = stream["rows"]
    row_workers = stream.get("row_workers") or rows
    height = int(min(900, max(180, 16 * len(rows) + 90)))
    source, tooltips, title, died = (_bars if stream["mode"] == "bars" else _binned_cells)(stream)
    fig = figs.time_figure(name, title, height, y_range=Range1d(len(rows) - 0.5, -0.5))
    glyph = fig.quad(left="left", right="right", bottom="bottom", top="top", color="color",
                     alpha="alpha", line_color=None, source=source)
    fig.add_tools(HoverTool(renderers=[glyph], tooltips=tooltips))
    if died:
        _hatch(fig, died)
    if figs.web and stream["mode"] == "bars":
        fig.add_tools(TapTool(renderers=[glyph], callback=CustomJS(
            args={"source": source, "cluster": figs.scope.cluster_id}, code=OPEN_TASK)))
    fig.yaxis.ticker = FixedTicker(ticks=list(range(len(rows))))
    fig.yaxis.major_label_overrides = {
        i: label + (" (died)" if worker in figs.dead_workers else "")
        for i, (label, worker) in enumerate(zip(rows, row_workers))} if len(rows) <= 60 else {}
    fig.yaxis.major_label_text_font_size = "8pt"
    fig.ygrid.grid_line_color = None
    figs.mark(fig)
    if path:
        critical_path_outline(fig, stream, path)


def _bars(stream: dict) -> tuple:
    """The bars' data source (``task-stream``), tooltips and title, and the tasks
    running when their worker died."""
    from bokeh.models import ColumnDataSource

    from dask_blackbox.read.figures import ms, num

    died = [b for b in stream["bars"] if b["action"] == DIED]
    bars = [b for b in stream["bars"] if b["action"] != DIED]
    title = (f"Task stream: {len(bars):,} bars ({stream['computes_recorded']:,} computes), "
             "one row per worker thread"
             + (f"; hatched: {len(died):,} task(s) running when their worker died"
                if died else ""))
    color = [("black" if b["erred"] else palette.color_of(b["prefix"])) if b["action"] == "compute"
             else palette.ACTIONS.get(b["action"], "gray") for b in bars]
    alpha = [ACTION_ALPHA.get(b["action"], 1.0) for b in bars]
    source = ColumnDataSource(name="task-stream", data={
        "left": num(ms(b["start"]) for b in bars), "right": num(ms(b["stop"]) for b in bars),
        "bottom": num(b["row"] - 0.4 for b in bars), "top": num(b["row"] + 0.4 for b in bars),
        "color": color, "alpha": num(alpha), "key": [b["key"] for b in bars],
        "prefix": [b["prefix"] for b in bars], "action": [b["action"] for b in bars],
        "worker": [b["worker"] for b in bars],
        "duration": [fmt_s(b["stop"] - b["start"]) for b in bars]})
    tooltips = [("key", "@key"), ("action", "@action"), ("worker", "@worker"),
                ("duration", "@duration")]
    return source, tooltips, title, died


def _binned_cells(stream: dict) -> tuple:
    """The binned cells' data source (``task-stream-binned``), tooltips and title, and
    the tasks running when their worker died."""
    from bokeh.models import ColumnDataSource

    from dask_blackbox.read.figures import ms, num

    cells = stream["cells"]
    died = stream.get("died") or []
    title = (f"Task stream, binned: {stream['bars_recorded']:,} bars in "
             f"{stream['bucket']:.3g} s cells, one row per worker (height: threads busy, "
             "colour: busiest prefix); narrow the window to see single tasks"
             + (f"; hatched: {len(died):,} task(s) running when their worker died"
                if died else ""))
    source = ColumnDataSource(name="task-stream-binned", data={
        "left": num(ms(c["start"]) for c in cells), "right": num(ms(c["stop"]) for c in cells),
        "bottom": num(c["row"] - 0.45 for c in cells),
        "top": num(c["row"] - 0.45 + 0.9 * c["busy"] for c in cells),
        "color": [palette.ACTIONS.get(c["prefix"]) or palette.color_of(c["prefix"]) for c in cells],
        "alpha": num([1.0] * len(cells)), "prefix": [c["prefix"] for c in cells],
        "worker": [c["worker"] for c in cells],
        "busy": [f"{100 * c['busy']:.0f}%" for c in cells],
        "tasks": num(c["tasks"] for c in cells)})
    tooltips = [("worker", "@worker"), ("busiest", "@prefix"), ("threads busy", "@busy"),
                ("computes started", "@tasks")]
    return source, tooltips, title, died


def _hatch(fig, died: list[dict]) -> None:
    """The tasks running when their worker died, hatched (``task-stream-died``): no
    startstops, so drawn from its last entry into processing to the removal."""
    from bokeh.models import ColumnDataSource, HoverTool

    from dask_blackbox.read.figures import ms, num

    lost = ColumnDataSource(name="task-stream-died", data={
        "left": num(ms(b["start"]) for b in died), "right": num(ms(b["stop"]) for b in died),
        "bottom": num(b["row"] - 0.4 for b in died), "top": num(b["row"] + 0.4 for b in died),
        "color": [palette.color_of(b["prefix"]) for b in died],
        "key": [b["key"] for b in died], "prefix": [b["prefix"] for b in died],
        "worker": [b["worker"] for b in died],
        "duration": [fmt_s(b["stop"] - b["start"]) for b in died]})
    hatched = fig.quad(left="left", right="right", bottom="bottom", top="top",
                       fill_color="color", fill_alpha=0.35, hatch_pattern="/",
                       hatch_color="black", hatch_alpha=0.8, line_color="black",
                       source=lost)
    fig.add_tools(HoverTool(renderers=[hatched], tooltips=[
        ("key", "@key"), ("", DIED), ("worker", "@worker"), ("for", "@duration")]))


def critical_path_outline(stream_figure, stream: dict, path: dict) -> None:
    """Outline the critical path on the task stream figure: each link's compute, on
    the row where the stream drew that task (bars) or on its worker's row (binned),
    as the data source named ``critical-path`` (columns ``key``, ``left``, ``right``,
    ...), and a dashed line from each link's compute to the next one's
    (``critical-path-joins``): the time between them is what the link waited on."""
    from bokeh.models import ColumnDataSource, HoverTool

    from dask_blackbox.read.figures import ms, num

    if not path or not path.get("available"):
        return
    if stream["mode"] == "bars":
        # a key computed twice has two bars: the link's is the one its compute is
        computes: dict[str, list[dict]] = {}
        for b in stream["bars"]:
            if b["action"] == "compute":
                computes.setdefault(b["key"], []).append(b)

        def row_of(link: dict):
            bars = computes.get(link["key"])
            if not bars:
                return None
            return min(bars, key=lambda b: abs(b["start"] - link["compute_start"])
                       + abs(b["stop"] - link["compute_stop"]))["row"]
    else:
        index = {worker: i for i, worker in enumerate(stream["rows"])}

        def row_of(link: dict):
            return index.get(link["worker"])
    boxes = []
    for link in path["links"]:
        row = row_of(link)
        if row is None:
            continue
        waited = {p: v for p, v in link["parts"].items() if p != "compute" and v > 0}
        boxes.append({"key": link["key"], "row": row, "left": ms(link["compute_start"]),
                      "right": ms(link["compute_stop"]), "prefix": link["prefix"],
                      "link": fmt_s(link["seconds"]),
                      "waited": ", ".join(f"{p} {fmt_s(v)}" for p, v in waited.items()) or "nothing"})
    if not boxes:
        return
    source = ColumnDataSource(name="critical-path", data={
        "left": num(b["left"] for b in boxes), "right": num(b["right"] for b in boxes),
        "bottom": num(b["row"] - 0.45 for b in boxes), "top": num(b["row"] + 0.45 for b in boxes),
        **{k: [b[k] for b in boxes] for k in ("key", "prefix", "link", "waited")}})
    glyph = stream_figure.quad(left="left", right="right", bottom="bottom", top="top",
                               source=source, fill_alpha=0.0, line_color="black", line_width=3)
    joins = ColumnDataSource(name="critical-path-joins", data={
        "xs": [num([a["right"], b["left"]]) for a, b in zip(boxes, boxes[1:])],
        "ys": [num([a["row"], b["row"]]) for a, b in zip(boxes, boxes[1:])]})
    stream_figure.multi_line(xs="xs", ys="ys", source=joins, line_color="black", line_width=2,
                             line_dash="dashed")
    stream_figure.add_tools(HoverTool(renderers=[glyph], tooltips=[
        ("critical path", "@key"), ("link", "@link"), ("waited on", "@waited")]))


ACTION_ALPHA = {"transfer": 0.4, "disk-write": 0.4, "disk-read": 0.4, "deserialize": 0.4}


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    path = data.get("critical_path")
    figures(figs, data["task_stream"], path if path and path.get("available") else None)
    return {}


VIEW = register(View("task_stream", "Task stream", data, "panel_task_stream.html", draw, order=20,
                     about="Dask's task stream: a bar per action, a row per worker thread (or binned)",
                     params="&max_bars="))
