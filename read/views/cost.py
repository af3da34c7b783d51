"""The cost view: what the run (or span) cost, per span and per prefix
(:mod:`dask_blackbox.read.cost`); computed for a scope of at most
:data:`.page.SLOWNESS_MAX_TASKS` tasks unless asked for (``slowness``)."""

from __future__ import annotations

from dask_blackbox.read import cost as costs
from dask_blackbox.read import queries
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import Scope


def data(ctx: Context) -> dict:
    if not ctx.slowness():
        return {"cost": {"deferred": ctx.n_tasks()}}
    return {"cost": cost(ctx.backend, ctx.scope)}


def cost(backend: Backend, scope: Scope) -> dict:
    """What the run (or span) cost (:mod:`.cost`): ``spans`` (each span tree of the
    scope: thread CPU seconds, thread-seconds occupied and offered, idle and who was
    idle, bytes moved and spilled, memory byte-seconds), ``prefixes`` (the additive
    measures per prefix) and ``totals`` (the scope's sum; for the whole run, the
    cluster's)."""
    found = costs.measures(backend, [scope.cluster_id])
    in_scope = set(scope.span_ids) if scope.span_ids is not None else None
    spans_ = [c for c in costs.span_costs(backend, [scope.cluster_id], found, windows_for=in_scope)
              if in_scope is None or c.span_id in in_scope]
    prefixes_ = costs.by_prefix(found, in_scope)
    kept = [m for (_, s, _), m in found.items() if in_scope is None or s in in_scope]
    # parents before children, siblings by time, each with its depth
    nodes = [{"cluster_id": c.cluster_id, "span_id": c.span_id, "parent_id": c.parent_id,
              "enqueued": c.enqueued or 0.0, "cost": c} for c in spans_]
    tree = [{**n["cost"].as_dict(), "depth": depth} for depth, n in queries.tree_order(nodes)]
    return {"spans": tree,
            "prefixes": {p: m._asdict() for p, m in sorted(
                prefixes_.items(), key=lambda kv: (-(kv[1].busy_s or 0.0), -kv[1].memory_byte_s,
                                                   kv[0]))},
            "totals": costs.total(kept)._asdict()}


VIEW = register(View("cost", "Cost", data, "cost.html", order=40,
                     about="what each span and prefix cost: CPU, occupied, idle, moved, spilled, memory held"))
