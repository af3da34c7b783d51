"""The activity view: Dask's Processing, CPU and Data Transfer views over time (tasks
executing, ready and in flight, CPU against the threads offered, from the workers'
samples; the seconds of each action per second, from the startstops or the page
aggregates)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

from dask_blackbox.read import aggregates, palette
from dask_blackbox.read import workers as worker_data
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.views.page import Context, metric_cell
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import BUCKETS, Scope
from dask_blackbox.read.views.scope import n_buckets as _n_buckets
from dask_blackbox.read.views.scope import where as _where

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures


#: Per bucket of width ``w`` from ``t0``: the workers' executing, ready, in-flight
#: tasks and CPU, each worker's mean over the bucket summed (``{where}``: the scope).
PROCESSING = ("SELECT b, sum(e), sum(r), sum(f), sum(c) FROM ("
              " SELECT worker, toUInt32(floor((toFloat64(ts) - {{t0:Float64}}) / {{w:Float64}})) AS b, "
              " avg(executing) AS e, avg(ready) AS r, avg(in_flight) AS f, avg(cpu) AS c "
              " FROM {worker_metrics} {where} GROUP BY worker, b) GROUP BY b ORDER BY b")

#: Seconds of each action (the startstops overlapping ``t0``..``t1``) within each of
#: ``nb`` buckets of width ``w`` from ``t0``, an action's seconds split over the
#: buckets it spans (``{where}``: the scope).
ACTION_SECONDS = (
    "SELECT action, b, sum(greatest(0., least(e, {{t0:Float64}} + (b + 1) * {{w:Float64}}) "
    "- greatest(s, {{t0:Float64}} + b * {{w:Float64}}))) FROM ("
    " SELECT ss.action AS action, toFloat64(ss.start) AS s, toFloat64(ss.stop) AS e "
    " FROM {transitions} ARRAY JOIN startstops AS ss {where}"
    " AND ss.stop >= toDateTime64({{t0:Float64}}, 6, 'UTC') AND ss.start <= toDateTime64({{t1:Float64}}, 6, 'UTC'))"
    " ARRAY JOIN range(toUInt32(greatest(0., floor((s - {{t0:Float64}}) / {{w:Float64}}))), "
    "  toUInt32(least({{nb:Float64}}, greatest(floor((s - {{t0:Float64}}) / {{w:Float64}}) + 1, "
    "  ceil((e - {{t0:Float64}}) / {{w:Float64}}))))) AS b "
    "GROUP BY action, b")


def data(ctx: Context) -> dict:
    return {"activity": activity(ctx.backend, ctx.scope, ctx.worker, ctx.info())}


def activity(backend: Backend, scope: Scope, worker: str | None = None,
             known: dict | None = None) -> dict:
    """Dask's Processing, CPU and Data Transfer views over time, for the cluster (or
    one ``worker``):

    ``processing``: per time cell (``times``, cell middles; ``cell`` wide) the tasks
    ``executing``, ``ready`` and ``in_flight`` and the ``cpu`` percent (100: one
    core), each the mean of a worker's samples in the cell summed over the workers;
    ``threads``: the threads of the workers there (as the scheduler recorded them);
    ``actions``: per bucket (``times``, bucket ends; ``bucket`` wide) the seconds of
    each action (compute, transfer, disk-read, disk-write, ...) within it per second
    of it -- how many threads were doing it at once, on average over the bucket.
    From the raw startstops, each split over the buckets it spans; for a scope the
    page aggregates answer (:func:`aggregates.usable`), from their whole seconds, in
    buckets of whole seconds starting on one. ``known``: the run's
    :func:`workers.info`, if already known."""
    w = metric_cell(backend, scope, worker)
    where, p = _where(scope, span=False)
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    p.update(w=w)
    _, rows = backend.query(PROCESSING.format(worker_metrics=_t(backend, "worker_metrics"), where=where), p)
    times = [scope.t0 + (b + 0.5) * w for b, *_ in rows]
    known = worker_data.info(backend, scope.cluster_id) if known is None else known
    if worker is not None:
        known = {worker: known[worker]} if worker in known else {}
    threads = [sum(i["nthreads"] or 0 for i in known.values()
                   if (i["added"] or 0) <= t and (i["removed"] is None or i["removed"] > t))
               for t in times]
    processing = {"times": times, "executing": [r[1] for r in rows], "ready": [r[2] for r in rows],
                  "in_flight": [r[3] for r in rows], "cpu": [r[4] for r in rows], "threads": threads}
    if aggregates.usable(scope):
        step = float(math.ceil(scope.bucket))
        start = float(math.floor(scope.t0))
        n = min(BUCKETS, int((scope.t1 - start) / step) + 1)
        per_action = aggregates.activity(backend, scope, n, worker, t0=start, width=step)
    else:
        step, start, n = scope.bucket, scope.t0, _n_buckets(scope)
        per_action = _action_seconds(backend, scope, n, worker)
    series = {a: [per_action[a].get(i, 0.0) / step for i in range(n)]
              for a in sorted(per_action, key=lambda a: (a != "compute", a))}
    return {"processing": processing,
            "actions": {"times": [start + (i + 1) * step for i in range(n)], "series": series,
                        "bucket": step},
            "cell": w}


def _action_seconds(backend: Backend, scope: Scope, n: int, worker: str | None = None) -> dict[str, dict]:
    """Seconds of each action within each of the scope's ``n`` buckets, summed over
    the workers (or of ``worker``), from the raw startstops: ``{action: {bucket:
    seconds}}``, an action's seconds split over the buckets it spans."""
    where, p = _where(scope, time_column="")
    where += " AND source = 'scheduler'"
    if worker is not None:
        where += " AND worker = {worker:String}"
        p["worker"] = worker
    if scope.since is not None:  # a transition comes after its actions
        where += " AND ts >= toDateTime64({t0:Float64}, 6, 'UTC')"
    p.update(t0=scope.t0, t1=scope.t1, w=scope.bucket, nb=float(n))
    _, rows = backend.query(ACTION_SECONDS.format(transitions=_t(backend, "transitions"), where=where), p)
    out: dict[str, dict] = defaultdict(dict)
    for action, b, seconds in rows:
        out[action][int(b)] = float(seconds)
    return dict(out)


def figures(figs: Figures, act: dict, prefix: str = "activity",
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
        figs.steps(f"{prefix}_processing", f"Processing: tasks executing, ready and in flight "
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
        figs.steps(f"{prefix}_cpu", f"CPU: cores busy ({whose})", 200,
                    starts, series, colors, labels, value_format="0.00", width=cell)
        names.append(f"{prefix}_cpu")
    t = act.get("actions") or {}
    if t.get("times") and t.get("series"):
        series = t["series"]
        bucket = t["bucket"]
        colors = {a: palette.ACTIONS.get(a, "#2ca02c" if a == "compute" else "#8c564b") for a in series}
        figs.steps(f"{prefix}_transfer", "Data transfer and disk: seconds of each action per "
                    "second of the window (compute for scale)", 200, [e - bucket for e in t["times"]],
                    series, colors, {a: a for a in series}, value_format="0.00", width=bucket)
        names.append(f"{prefix}_transfer")
    return names


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    return {"activity_figures": figures(figs, data["activity"])}


VIEW = register(View("activity", "Processing, CPU, transfers", data, "panel_activity.html", draw,
                     order=100, about="executing, ready, in flight, CPU and each action's threads over time"))
