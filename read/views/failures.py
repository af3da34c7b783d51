"""The failures view: the erred tasks with their exceptions and stories (their
transitions, scheduler and workers), the dead workers with the tasks they ran, their
last metrics and log lines (:func:`.queries.failures`)."""

from __future__ import annotations

from dask_blackbox.read import queries
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.statements import ERRED
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register
from dask_blackbox.read.views.scope import Scope


#: Erred tasks whose story the failures panel (and the report) shows.
STORIES = 20


def data(ctx: Context) -> dict:
    fail = failures(ctx.backend, ctx.scope)
    keys = list(dict.fromkeys(t["key"] for t in fail["erred_tasks"][:STORIES]))
    stories: dict[str, list] = {k: [] for k in keys}
    if keys:  # the stories of queries.story (scheduler and workers), in one query
        columns, rows = ctx.backend.query(
            queries.STORY.format(transitions=_t(ctx.backend, "transitions"),
                                 where="WHERE cluster_id = {c:String} AND key IN {keys:Array(String)}"),
            {"c": ctx.scope.cluster_id, "keys": keys})
        for r in rows:
            stories[r[0]].append(dict(zip(columns, r)))
    fail["stories"] = stories
    return {"failures": fail}


def failures(backend: Backend, scope: Scope) -> dict:
    """:func:`queries.failures` for the cluster and window: erred tasks with their
    exceptions, dead workers with the tasks they ran, last metrics and log lines."""
    result = queries.failures(backend, cluster=scope.cluster_id, since=scope.since,
                              until=scope.until)
    out = {name: [dict(zip(columns, row)) for row in rows] for name, (columns, rows) in result.items()}
    if scope.span_ids is not None:
        _, in_span = backend.query(ERRED.format(
            transitions=_t(backend, "transitions"),
            where="WHERE cluster_id = {c:String} AND span_id IN {ids:Array(String)}"),
            {"c": scope.cluster_id, "ids": scope.span_ids})
        keys = {row[1] for row in in_span}
        out["erred_tasks"] = [r for r in out["erred_tasks"] if r["key"] in keys]
    return out


VIEW = register(View("failures", "Failures", data, "panel_failures.html", order=130,
                     about="erred tasks with their stories, dead workers with their last metrics and logs"))
