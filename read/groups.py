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

from typing import Any

from dask_blackbox.read import aggregates, panels
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t

#: Task groups shown: the most computing ones, and every group with an erred task.
SHOWN = 80

_COLUMNS = ("group", "prefix", "tasks", "memory", "erred", "recomputed", "compute_s", "transfer_s",
            "nbytes", "start", "stop")


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


def _raw(backend: Backend, scope, only: list[str] | None = None) -> list[dict]:
    """The groups of the scope (or the groups ``only``) from the raw transitions, task
    by task, longest computing first."""
    windowed = scope.since is not None or scope.until is not None
    where, p = panels._where(scope, time_column="ts" if windowed else "")
    where += " AND source = 'scheduler'"
    if only is not None:
        where += " AND task_group IN {only:Array(String)}"
        p["only"] = list(only)
    action_seconds = ("sum(arraySum(arrayMap((a, b, e) -> if(a = '{0}', toFloat64(e) - toFloat64(b), 0.), "
                      "startstops.action, startstops.start, startstops.stop)))")
    has_compute = "has(startstops.action, 'compute')"
    _, rows = backend.query(
        "SELECT task_group, any(prefix), count(), countIf(outcome = 'memory'), countIf(outcome = 'erred'), "
        "sum(m) - countIf(m > 0), sum(c), sum(x), sum(nb), min(s0), max(s1) FROM ("
        " SELECT task_group, cityHash64(key) AS k, anyLast(toString(prefix)) AS prefix, "
        "  argMaxIf(finish, (ts, seq, idx), finish IN ('memory', 'erred')) AS outcome, "
        "  countIf(finish = 'memory') AS m, "
        "  argMaxIf(ifNull(nbytes, 0), (ts, seq, idx), finish = 'memory') AS nb, "
        f"  {action_seconds.format('compute')} AS c, {action_seconds.format('transfer')} AS x, "
        "  minOrNullIf(toFloat64(startstops.start[indexOf(startstops.action, 'compute')]), "
        f"{has_compute}) AS s0, "
        "  maxOrNullIf(toFloat64(startstops.stop[indexOf(startstops.action, 'compute')]), "
        f"{has_compute}) AS s1 "
        f" FROM {_t(backend, 'transitions')} {where} GROUP BY task_group, k"
        ") GROUP BY task_group ORDER BY sum(c) DESC, task_group", p)
    return [{**dict(zip(_COLUMNS, r)), "tasks": int(r[2]), "memory": int(r[3]), "erred": int(r[4]),
             "recomputed": int(r[5]), "compute_s": float(r[6]), "transfer_s": float(r[7]),
             "nbytes": int(r[8])} for r in rows]
