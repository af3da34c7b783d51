"""The logs view: the newest log records of the run matching the filters (level,
worker, logger, text), with their count (:func:`.log_search.logs`); a worker's page's
logs are its records and its nanny's (:mod:`.worker_logs`)."""

from __future__ import annotations

from dask_blackbox.read import log_search
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.params import BadParameter
from dask_blackbox.read.views.page import LEVELS, Context
from dask_blackbox.read.views.registry import View, number, register
from dask_blackbox.read.views.scope import Scope
from dask_blackbox.read.views.scope import ts as _ts


#: The workers a cluster's log records name (the choices of the worker filter).
LOG_WORKERS = ("SELECT DISTINCT worker FROM {logs} WHERE cluster_id = {{c:String}} "
               "AND worker != '' ORDER BY worker")


def data(ctx: Context) -> dict:
    q = ctx.params
    level = q.get("level") or None
    if level and level.upper() not in LEVELS:
        raise BadParameter(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
    worker = ctx.worker or q.get("worker") or None
    return {"logs": logs(ctx.backend, ctx.scope, level, worker, q.get("text") or None,
                                number(q.get("limit"), 500), q.get("logger") or None)}


def logs(backend: Backend, scope: Scope, level: str | None = None, worker: str | None = None,
         text: str | None = None, limit: int = 500, logger: str | None = None) -> dict:
    """The newest ``limit`` log records in the window (oldest first), with the total
    matching count and the workers seen (for the worker filter); the filters of
    :func:`.log_search.logs` (``worker``: a worker's address keeps its own records and
    its nanny's, "scheduler" the scheduler's)."""
    window = {"cluster": scope.cluster_id, "since": scope.t0, "until": scope.t1 + 1e-6,
              "worker": worker, "level": level, "logger": logger, "text": text}
    _, rows = log_search.logs(backend, limit=limit, **window)
    total = log_search.logs_count(backend, **window)
    _, workers = backend.query(LOG_WORKERS.format(logs=_t(backend, "logs")), {"c": scope.cluster_id})
    return {
        "total": total, "limit": limit, "processes": [r[0] for r in workers],
        "filters": {"level": level.upper() if level else None, "worker": worker, "text": text,
                    "logger": logger},
        "lines": [{"ts": _ts(r[0]), "level": r[1], "source": r[2], "worker": r[3],
                   "process": r[3] or r[2], "logger": r[4], "key": r[5], "message": r[6],
                   "exc_text": r[7]} for r in rows],
    }


VIEW = register(View("logs", "Logs", data, "panel_logs.html", order=140,
                     about="the newest log records matching the filters",
                     params="&level=&worker=&logger=&text=&limit="))
