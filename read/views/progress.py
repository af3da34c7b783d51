"""The progress view: per prefix the fraction of its tasks finished over time (like
Dask's progress bars), and the tasks in each state over time; from the scheduler's
transitions (or the page aggregates, :mod:`.aggregates`, for a whole run or span) or,
once the raw rows expired, the per-minute roll-ups (``task_minutes``: a task's work
counted in the minute of the transition that reported it; ``tasks`` counts the
tasks that finished, a task recomputed after its worker died twice)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from dask_blackbox.read import aggregates, history, palette
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import Scope, minute_ends, minutes
from dask_blackbox.read.views.scope import n_buckets as _n_buckets
from dask_blackbox.read.views.scope import where as _where

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures

STATE_COLORS = {"released": "#999999", "waiting": "#7f7f7f", "no-worker": "#8c564b",
                "queued": "#bcbd22", "processing": "#1f77b4", "memory": "#2ca02c",
                "erred": "#000000"}


#: Prefixes shown by name in the progress panel (the rest are summed as "other").
TOP_PREFIXES = 12


#: The task states drawn in "tasks by state". Not "released": a task is created
#: released without a transition, so its count is not known from transitions alone;
#: forgotten tasks are gone.
STATES = ("waiting", "no-worker", "queued", "processing", "memory", "erred")


#: Per prefix and bucket of width ``w`` from ``t0``: the tasks the scheduler finished
#: into memory or erred (``{where}``: the scope).
FINISHED = ("SELECT prefix, toUInt32(floor((toFloat64(ts) - {{t0:Float64}}) / {{w:Float64}})) AS b, count() "
            "FROM {transitions} {where} AND source = 'scheduler' "
            "AND finish IN ('memory', 'erred') GROUP BY prefix, b ORDER BY b")

#: The scheduler's transitions per (start, finish) state and bucket of width ``w``
#: from ``t0`` up to ``t1`` (bucket -1: before ``t0``; ``{where}``: the scope).
MOVES = ("SELECT start, finish, if(toFloat64(ts) < {{t0:Float64}}, -1, "
         "toInt64(floor((toFloat64(ts) - {{t0:Float64}}) / {{w:Float64}}))) AS b, count() "
         "FROM {transitions} {where} AND source = 'scheduler' "
         "AND ts <= toDateTime64({{t1:Float64}}, 6, 'UTC') GROUP BY start, finish, b")


def _top(totals: dict[str, float], n: int) -> list[str]:
    return sorted(totals, key=lambda k: (-totals[k], k))[:n]


def data(ctx: Context) -> dict:
    if ctx.from_rollups():
        states = task_states_from_rollups(ctx.backend, ctx.scope)
        prog = ctx.shared("progress", lambda: progress_from_rollups(ctx))
    else:
        states = task_states(ctx.backend, ctx.scope)
        prog = ctx.shared("progress", lambda: progress(ctx.backend, ctx.scope, ctx.counts()))
    return {"progress": prog, "task_states": states}


def progress(backend: Backend, scope: Scope, per_prefix: dict[str, dict]) -> dict:
    """Per prefix, over time: the fraction of its tasks finished (in memory or
    erred), like Dask's progress bars. ``times`` are bucket ends; ``series`` maps
    prefix -> fractions; ``totals`` the prefix's distinct keys: the
    :data:`TOP_PREFIXES` with the most tasks by name, and every prefix with an erred
    task by name too (however few its tasks), the rest summed as "other";
    ``counts`` per prefix: tasks, transitions into memory, into erred; ``erred`` per
    series shown: its transitions into erred. ``per_prefix``: the scope's
    :func:`.page.prefix_totals`.

    From the page aggregates (:mod:`.aggregates`) for a whole run or span."""
    n = _n_buckets(scope)
    if aggregates.usable(scope):
        rows = aggregates.finished_per_bucket(backend, scope, n)
    else:
        where, p = _where(scope)
        p.update(w=scope.bucket, t0=scope.t0)
        _, rows = backend.query(FINISHED.format(transitions=_t(backend, "transitions"), where=where), p)
    return progress_series(per_prefix, rows, n,
                           [scope.t0 + (i + 1) * scope.bucket for i in range(n)])


def progress_series(per_prefix: dict[str, dict], rows, n: int, times: list[float]) -> dict:
    """The progress panel (:func:`progress`) from ``per_prefix`` (prefix -> tasks,
    memory, erred) and ``rows`` of (prefix, bucket number, tasks finished in it), in
    ``n`` buckets ending at ``times``."""
    totals = {prefix: c["tasks"] for prefix, c in per_prefix.items()}
    shown = set(_top(totals, TOP_PREFIXES)) | {pr for pr, c in per_prefix.items() if c["erred"]}
    label = {prefix: prefix if prefix in shown else "other" for prefix in totals}
    counts: dict[str, list[float]] = {}
    for prefix, b, c in rows:
        name = label.get(prefix or "(none)", "other")
        counts.setdefault(name, [0.0] * n)[min(int(b), n - 1)] += c
    grouped_totals: dict[str, int] = defaultdict(int)
    grouped_erred: dict[str, int] = defaultdict(int)
    for prefix, total in totals.items():
        grouped_totals[label[prefix]] += total
        grouped_erred[label[prefix]] += per_prefix[prefix]["erred"]
    series = {}
    for name, per_bucket in counts.items():
        done, out = 0.0, []
        for c in per_bucket:
            done += c
            out.append(min(1.0, done / max(grouped_totals[name], 1)))
        series[name] = out
    # erred prefixes first, then by size: never lost below the fold of a long legend
    order = sorted(series, key=lambda k: (k == "other", 0 if grouped_erred[k] else 1,
                                          -grouped_totals[k], k))
    return {"times": times, "series": {k: series[k] for k in order},
            "totals": dict(grouped_totals), "erred": {k: grouped_erred[k] for k in order},
            "counts": per_prefix}


def task_states(backend: Backend, scope: Scope) -> dict:
    """Tasks in each state over time, from the transitions themselves (each one
    moves a task from ``start`` to ``finish``): exact, and available without
    scheduler metrics. A window starting mid-run starts from the states at its start."""
    n = _n_buckets(scope)
    if aggregates.usable(scope):
        rows = aggregates.moves_per_bucket(backend, scope, n)
    else:
        where, p = _where(scope, time_column="")
        p.update(w=scope.bucket, t0=scope.t0, t1=scope.t1)
        _, rows = backend.query(MOVES.format(transitions=_t(backend, "transitions"), where=where), p)
    base: dict[str, int] = defaultdict(int)
    deltas: dict[str, list[int]] = {}
    for start, finish, b, count in rows:
        for state, d in ((finish, count), (start, -count)):
            if state not in STATES:
                continue
            if b < 0:
                base[state] += d
            else:
                deltas.setdefault(state, [0] * n)[min(int(b), n - 1)] += d
    series = {}
    for state in STATES:
        if state not in deltas and not base.get(state):
            continue
        level, out = base.get(state, 0), []
        for d in deltas.get(state, [0] * n):
            level += d
            out.append(level)
        series[state] = out
    return {"times": [scope.t0 + (i + 1) * scope.bucket for i in range(n)], "series": series}


def progress_from_rollups(ctx: Context) -> dict:
    """:func:`progress` from ``task_minutes`` (:func:`progress_series`): per prefix
    the fraction of its finished tasks finished by each bucket's end; ``totals`` and
    ``counts['tasks']`` are tasks finished (memory or erred)."""
    w = minutes(ctx.scope)
    rows = [(prefix, b, memory + erred) for (prefix, b), (memory, erred) in ctx.finished_minutes().items()]
    return progress_series(ctx.counts(), rows, w.n_buckets, minute_ends(w))


def task_states_from_rollups(backend: Backend, scope: Scope) -> dict:
    """:func:`task_states` from ``task_minutes`` (transitions into and out of
    each state per minute)."""
    w = minutes(scope)
    moves = history.state_moves(backend, w, "rollups")
    return {"times": minute_ends(w), "series": history.levels(moves, STATES, w.n_buckets)}

def progress_figure(figs: Figures, prog: dict) -> None:
    from bokeh.models import Range1d

    series = prog["series"]
    colors = palette.distinct([p for p in series if p != "other"], {"other": "#777777"})
    erred = prog.get("erred", {})
    labels = {p: f"{p} ({prog['totals'].get(p, 0):,}"
                 + (f", {erred[p]:,} erred = {erred[p] / max(prog['totals'].get(p, 0), 1):.0%})"
                    if erred.get(p) else ")")
              for p in series}
    figs.steps("progress", "Progress per prefix: fraction of its tasks finished",
                max(260, 50 + 22 * len(series)), prog["times"], series, colors, labels,
                value_format="0%", y_range=Range1d(0, 1.05))


def task_states_figure(figs: Figures, states: dict) -> None:
    series = states["series"]
    figs.steps("task_states", "Tasks by state", 240, states["times"], series,
                {s: STATE_COLORS.get(s, "#333333") for s in series}, {s: s for s in series},
                value_format="0,0")


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    progress_figure(figs, data["progress"])
    task_states_figure(figs, data["task_states"])
    return {}


VIEW = register(View("progress", "Progress", data, "panel_progress.html", draw, order=50,
                     about="per prefix, the fraction of its tasks finished over time; erred shares"))
