"""The Task groups view: per task group (Dask's ``TaskGroup``, the tasks of one prefix
made by one call), the figures Dask's scheduler keeps for it, from the scheduler's
recorded transitions in a scope:

``tasks``        distinct keys (``len(TaskGroup)``);
``memory``       tasks whose last finish was into memory: their results were made
                 (what the group's ``states`` count as memory, released or forgotten
                 once it finished);
``erred``        tasks whose last finish was erred (``states["erred"]``);
``recomputed``   transitions into memory beyond each task's first: results computed
                 again, after the worker holding them was lost (``memory +
                 recomputed`` over a prefix's groups is Dask's
                 ``TaskPrefix.state_counts["memory"]``);
``compute_s``,   seconds of the compute and transfer actions of its tasks' startstops
``transfer_s``   (``TaskGroup.all_durations``, which leaves out the actions of tasks
                 that erred: these count them);
``nbytes``       the size of each task's latest result (``TaskGroup.nbytes_total``);
``start``,       its first compute start and last compute stop, None when none
``stop``         computed (``TaskGroup.start`` / ``stop``, erred tasks' computes
                 included here).

A whole run or span is read from the page aggregates (:func:`aggregates.groups`:
distinct tasks, tasks that reached memory and recomputations are exact there), the
groups shown with a recomputation (whose ``nbytes`` would count each result) or with
more tasks computed or erred than tasks (a task that reached memory and erred later,
or erred twice) again from their raw rows, task by task. (A task that erred twice,
retried by the client, in a group where another never finished is counted twice
there.) An explicit window, or a run
the aggregates do not answer for (:func:`aggregates.usable`), is read from the raw
rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_blackbox.read import aggregates, palette
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.templates import fmt_s
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import where as _where

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures

#: Task groups shown: the most computing ones, and every group with an erred task.
SHOWN = 80

_COLUMNS = ("group", "prefix", "tasks", "memory", "erred", "recomputed", "compute_s", "transfer_s",
            "nbytes", "start", "stop")


def data(ctx: Context) -> dict:
    return {"groups": groups(ctx.backend, ctx.scope)}


def groups(backend: Backend, scope, shown: int = SHOWN) -> dict[str, Any]:
    """``groups``: the :data:`SHOWN` groups that computed longest and every group
    with an erred task, longest first; ``n_groups``: the groups of the scope;
    ``erred``: the groups with an erred task."""
    if aggregates.usable(scope):
        found = aggregates.groups(backend, scope.cluster_id, scope.span_ids)
        picked = _pick(found, shown)
        again = [g["group"] for g in picked
                 if g["recomputed"] or g["memory"] + g["erred"] > g["tasks"]]
        if again:
            exact = {g["group"]: g for g in _raw(backend, scope, again)}
            picked = [exact.get(g["group"], g) for g in picked]
    else:
        found = _raw(backend, scope)
        picked = _pick(found, shown)
    return {"groups": picked, "n_groups": len(found), "erred": [g for g in found if g["erred"]]}


def _pick(found: list[dict], shown: int) -> list[dict]:
    return [g for i, g in enumerate(found) if i < shown or g["erred"]]


_ACTION_SECONDS = ("sum(arraySum(arrayMap((a, b, e) -> if(a = '{0}', toFloat64(e) - toFloat64(b), 0.), "
                   "startstops.action, startstops.start, startstops.stop)))")
_HAS_COMPUTE = "has(startstops.action, 'compute')"
#: Per task group of the scheduler's transitions (``{where}``), task by task: a
#: prefix, its tasks, those that ended in memory and erred, the results computed
#: again, compute and transfer seconds, bytes, its first compute's start and last
#: one's stop; longest computing first.
RAW_GROUPS = (
    "SELECT task_group, any(prefix), count(), countIf(outcome = 'memory'), countIf(outcome = 'erred'), "
    "sum(m) - countIf(m > 0), sum(c), sum(x), sum(nb), min(s0), max(s1) FROM ("
    " SELECT task_group, cityHash64(key) AS k, anyLast(toString(prefix)) AS prefix, "
    "  argMaxIf(finish, (ts, seq, idx), finish IN ('memory', 'erred')) AS outcome, "
    "  countIf(finish = 'memory') AS m, "
    "  argMaxIf(ifNull(nbytes, 0), (ts, seq, idx), finish = 'memory') AS nb, "
    f"  {_ACTION_SECONDS.format('compute')} AS c, {_ACTION_SECONDS.format('transfer')} AS x, "
    "  minOrNullIf(toFloat64(startstops.start[indexOf(startstops.action, 'compute')]), "
    f"{_HAS_COMPUTE}) AS s0, "
    "  maxOrNullIf(toFloat64(startstops.stop[indexOf(startstops.action, 'compute')]), "
    f"{_HAS_COMPUTE}) AS s1 "
    " FROM {transitions} {where} GROUP BY task_group, k"
    ") GROUP BY task_group ORDER BY sum(c) DESC, task_group")


def _raw(backend: Backend, scope, only: list[str] | None = None) -> list[dict]:
    """The groups of the scope (or the groups ``only``) from the raw transitions, task
    by task, longest computing first."""
    windowed = scope.since is not None or scope.until is not None
    where, p = _where(scope, time_column="ts" if windowed else "")
    where += " AND source = 'scheduler'"
    if only is not None:
        where += " AND task_group IN {only:Array(String)}"
        p["only"] = list(only)
    _, rows = backend.query(RAW_GROUPS.format(transitions=_t(backend, "transitions"), where=where), p)
    return [{**dict(zip(_COLUMNS, r)), "tasks": int(r[2]), "memory": int(r[3]), "erred": int(r[4]),
             "recomputed": int(r[5]), "compute_s": float(r[6]), "transfer_s": float(r[7]),
             "nbytes": int(r[8])} for r in rows]


def figures(figs: Figures, data: dict) -> None:
    """Task groups over time: a bar per group from its first compute to its last
    (the groups that computed), coloured by prefix (black: a task of it erred),
    its tasks, computed, erred and compute seconds in the hover; the data source
    ``group-bars`` (``left``/``right`` in ms, ``group``, ``tasks``, ``memory``,
    ``erred``, ``compute``)."""
    from bokeh.models import ColumnDataSource, FixedTicker, HoverTool, Range1d

    from dask_blackbox.read.figures import ms, num

    rows = [g for g in data["groups"] if g["start"] is not None and g["stop"] is not None]
    if not rows:
        return
    colors = palette.distinct(dict.fromkeys(g["prefix"] for g in rows))
    fig = figs.time_figure("groups", f"Task groups over time ({len(rows)} of {data['n_groups']} groups)",
                            int(min(900, 70 + 18 * len(rows))), y_range=Range1d(len(rows) - 0.5, -0.5))
    source = ColumnDataSource(name="group-bars", data={
        "y": num(range(len(rows))), "left": num(ms(g["start"]) for g in rows),
        "right": num(ms(max(g["stop"], g["start"] + 1e-3)) for g in rows),
        "group": [g["group"] for g in rows], "prefix": [g["prefix"] for g in rows],
        "tasks": num(g["tasks"] for g in rows), "memory": num(g["memory"] for g in rows),
        "erred": num(g["erred"] for g in rows),
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
    figs.mark(fig)


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    figures(figs, data["groups"])
    return {}


VIEW = register(View("groups", "Task groups", data, "panel_groups.html", draw, order=60,
                     about="task groups: tasks, erred, compute seconds, first and last compute"))
