"""The JSON API under the web UI: one endpoint per panel, the CLI's filters.

Endpoints (GET; every answer is JSON):

``/api/clusters?name=&since=&until=&limit=&offset=``
    one page of the recorded clusters, newest first, with how each ended and how
    many match (:func:`panels.clusters`: ``limit`` default 100, at most 1000).
``/api/run/{panel}?cluster=&span=&since=&until=``
    one panel of the Run page: a view of :data:`views.RUN_VIEWS` (diagnosis,
    task_stream, critical_path, cost, progress, groups, graph (also ``max_nodes``),
    workers, memory, activity, spans, fine_metrics, failures, logs) or summary,
    task_states, markers. logs also takes ``level``, ``worker`` (a worker's address:
    its records and its nanny's), ``logger``, ``text``, ``limit``; diagnosis ``key``
    (that task's KilledWorker); task_stream ``max_bars``.
``/api/view/{name}?cluster=&...``
    one panel as the web page draws it: its HTML fragment and its Bokeh document
    (``{"html", "bokeh"}``); the worker page's panels (worker, worker_stream,
    worker_metrics, worker_transfers, worker_logs) take ``worker``.
``/api/task?cluster=&key=``
    a task's story, the metrics and logs around it, its dependencies/dependents.
``/api/run/critical_path?cluster=&span=&since=&until=``, ``/api/run/cost?...``
    the run's (or span's) critical path, and what each span and prefix cost.
``/api/compare?span=&cluster=&since=&until=``
    the latest run of the span (or, with only ``cluster``, of the clusters of that
    name) against the one before it, verdicts first; and the span in every run and
    cluster, side by side.

Filters: ``cluster`` a name or id (several runs with one name: the latest),
``span`` a span tag or '/'-joined name (its sub-spans included), ``since`` and
``until`` an ISO date-time (UTC unless it has a zone), seconds since the epoch, or a
duration ago (``30s``, ``15m``, ``2h``, ``7d``).

Errors: ``{"error": "..."}`` with 404 (an unknown cluster, span or key, named in
the message), 400 (a bad parameter, named) or 502 (ClickHouse failed); never a
stack trace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import orjson

from dask_blackbox.read import panels, views
from dask_blackbox.read.views import diagnosis, progress, task_stream
from dask_blackbox.read.views.page import LEVELS
from dask_blackbox.read.views.scope import NotFound
from dask_blackbox.read.backends import Backend, QueryError
from dask_blackbox.read.params import BadParameter, filters, int_param, opt, parse_time

#: The JSON API's panels that are not views of the Run page, and what each gives.
EXTRA_PANELS = {
    "summary": "the run's heading: tasks, in memory, erred, workers, deaths, restarts",
    "task_states": "tasks in each state over time",
    "markers": "worker deaths, restarts and arrivals on the time axes",
}


def endpoints() -> list[tuple[str, str]]:
    """The JSON API's endpoints and what each answers: a ``/api/run/<name>`` per view
    of the Run page (:data:`views.RUN_VIEWS`, with its own parameters) and per
    :data:`EXTRA_PANELS`."""
    run = [("summary", EXTRA_PANELS["summary"], ""),
           *((v.name, v.about, v.params) for v in views.RUN_VIEWS),
           *((name, text, "") for name, text in EXTRA_PANELS.items() if name != "summary")]
    return [
        ("/api/clusters?name=&since=&until=&limit=&offset=",
         "one page of the recorded clusters, newest first, and how each ended"),
        *[(f"/api/run/{name}?cluster=&span=&since=&until={extra}", text) for name, text, extra in run],
        ("/api/view/{name}?cluster=&span=&since=&until=&worker=",
         "one panel as the web page draws it: its HTML and its Bokeh document"),
        ("/api/task?cluster=&key=", "a task's story, the metrics and logs around it, its dependencies"),
        ("/api/compare?span=&cluster=&since=&until=",
         "regressions beyond the noise, latest run against the one before; a span across runs"),
    ]


def run_panel(backend: Backend, panel: str, params: Mapping, memo=None) -> dict:
    """The data of one panel of the Run page (see the module docstring)."""
    names = [*EXTRA_PANELS, *(v.name for v in views.RUN_VIEWS)]
    if panel not in names:
        raise NotFound(f"no panel {panel!r}; the panels are {', '.join(names)}")
    int_param(params, "limit", 500, high=10_000)
    int_param(params, "max_bars", task_stream.MAX_BARS, 0, 200_000)
    int_param(params, "max_nodes", 1500, 1, 200_000)
    level = opt(params, "level")
    if level and level.upper() not in LEVELS:
        raise BadParameter(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
    ctx = views.context(backend, params, memo)
    if panel == "summary":
        return views.summary(ctx)
    if panel == "markers":
        return ctx.markers()
    if panel == "task_states":
        return progress.task_states(backend, ctx.scope)
    if panel == "diagnosis" and opt(params, "key"):
        return diagnosis.diagnosis_panel(backend, ctx.scope, opt(params, "key"), found=ctx.deaths())
    return views.VIEWS[panel].data(ctx)[panel]


def clusters(backend: Backend, params: Mapping) -> dict:
    return panels.clusters(backend, opt(params, "name"), parse_time(params.get("since"), "since"),
                           parse_time(params.get("until"), "until"),
                           limit=int_param(params, "limit", panels.CLUSTERS_PAGE, 1, panels.CLUSTERS_PAGE_MAX),
                           offset=int_param(params, "offset", 0, 0, 10**12))


def task(backend: Backend, params: Mapping) -> dict:
    cluster, key = opt(params, "cluster"), params.get("key")
    if not cluster:
        raise BadParameter("cluster is required: a cluster name or id")
    if key is None or key == "":
        raise BadParameter("key is required: the task key as the dashboard shows it")
    return panels.task(backend, cluster, key)


def compare(backend: Backend, params: Mapping) -> dict:
    f = filters(params)
    if not f["span"] and not f["cluster"]:
        raise BadParameter("span is required: a span tag or a path like etl/load "
                           "(or cluster alone, to compare the whole runs of that name)")
    return panels.compare(backend, f["span"], f["cluster"], f["since"], f["until"])


def dumps(value) -> bytes:
    return orjson.dumps(value, default=_default,
                        option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


def _default(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return str(value)


def status_of(error: BaseException) -> int:
    """The HTTP status for an error raised by a handler."""
    if isinstance(error, NotFound):
        return 404
    if isinstance(error, BadParameter):
        return 400
    if isinstance(error, QueryError):
        return 502
    return 500


def one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyError) and error.args:
        text = f"missing {error.args[0]!r}"
    first = text.splitlines()[0]
    return first if len(first) < 500 else first[:500] + "..."


class Backends:
    """One backend shared by the app's requests, behind a lock (a chDB client is not
    made for concurrent use), reconnected once when a query through a sink's query
    server fails (the sink may have restarted on another port)."""

    def __init__(self, connect: Callable[[], Backend]) -> None:
        self._connect = connect
        self._backend: Backend | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[Backend], object]):
        with self._lock:
            if self._backend is None:
                self._backend = self._connect()
            try:
                return fn(self._backend)
            except QueryError:
                from dask_blackbox.read.backends import RemoteBackend

                if not isinstance(self._backend, RemoteBackend) or self._backend.ping():
                    raise
                self._backend = self._connect()
                return fn(self._backend)

    def close(self) -> None:
        with self._lock:
            if self._backend is not None:
                self._backend.close()
                self._backend = None
