"""The JSON API under the web UI: one endpoint per panel, the CLI's filters.

Endpoints (GET; every answer is JSON):

``/api/clusters?name=&since=&until=&limit=&offset=``
    one page of the recorded clusters, newest first, with how each ended and how
    many match (:func:`panels.clusters`: ``limit`` default 100, at most 1000).
``/api/run/{panel}?cluster=&span=&since=&until=``
    one panel of the Run page, ``panel`` one of :data:`panels.RUN_PANELS`: summary,
    task_stream, progress, task_states, markers, memory, spans, fine_metrics,
    failures, logs (which also takes ``level``, ``worker``: a worker's address for
    its records and its nanny's, ``logger``, ``text``, ``limit``), diagnosis (why
    each worker died and each KilledWorker; also takes ``key``).
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

import datetime
import math
import re
import threading
from collections.abc import Callable, Mapping

import orjson

from dask_blackbox.read import panels
from dask_blackbox.read.backends import Backend, QueryError

ENDPOINTS = [
    ("/api/clusters?name=&since=&until=&limit=&offset=",
     "one page of the recorded clusters, newest first, and how each ended"),
    *[(f"/api/run/{name}?cluster=&span=&since=&until="
       + {"logs": "&level=&worker=&logger=&text=&limit=", "diagnosis": "&key="}.get(name, ""),
       (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "))
      for name, fn in panels.RUN_PANELS.items()],
    ("/api/task?cluster=&key=", "a task's story, the metrics and logs around it, its dependencies"),
    ("/api/compare?span=&cluster=&since=&until=",
     "regressions beyond the noise, latest run against the one before; a span across runs"),
]


class BadParameter(ValueError):
    """A query parameter that cannot be used; the message names it."""


#: The times ClickHouse's DateTime64 holds, in seconds since the epoch:
#: 1900-01-01T00:00:00 .. 2299-12-31T23:59:59 UTC.
EARLIEST, LATEST = -2208988800.0, 10413791999.0


def parse_time(text: str | None, name: str) -> float | None:
    """``since``/``until``: ISO date-time (UTC unless zoned), epoch seconds, or a
    duration ago like 2h / 30m / 7d / 45s; a time between 1900 and 2299 (what
    ClickHouse's DateTime64 holds). BadParameter naming ``name`` otherwise."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    try:
        value = _seconds(text)
    except (ValueError, OverflowError):
        raise BadParameter(f"{name}={text[:80]!r} is neither an ISO date-time, seconds since the "
                           "epoch, nor a duration like 2h / 30m / 7d") from None
    if not (math.isfinite(value) and EARLIEST <= value <= LATEST):
        raise BadParameter(f"{name}={text[:80]!r} is not a time between 1900-01-01 and 2299-12-31")
    return value


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m[2]]
        now = datetime.datetime.now(datetime.timezone.utc)
        return (now - datetime.timedelta(**{unit: float(m[1])})).timestamp()
    try:
        return float(text)
    except ValueError:
        pass
    t = datetime.datetime.fromisoformat(text)
    return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _int(params: Mapping, name: str, default: int, low: int = 1, high: int = 100_000) -> int:
    value = params.get(name)
    if value in (None, ""):
        return default
    try:
        n = int(value)
    except ValueError:
        raise BadParameter(f"{name} must be an integer, not {str(value)[:80]!r}") from None
    if not low <= n <= high:
        raise BadParameter(f"{name} must be between {low} and {high}, not {n}")
    return n


def _opt(params: Mapping, name: str) -> str | None:
    value = params.get(name)
    return value if value not in (None, "") else None


def filters(params: Mapping) -> dict:
    """cluster/span/since/until from query parameters."""
    return {"cluster": _opt(params, "cluster"), "span": _opt(params, "span"),
            "since": parse_time(params.get("since"), "since"),
            "until": parse_time(params.get("until"), "until")}


def run_panel(backend: Backend, panel: str, params: Mapping) -> dict:
    if panel not in panels.RUN_PANELS:
        raise panels.NotFound(f"no panel {panel!r}; the panels are {', '.join(panels.RUN_PANELS)}")
    f = filters(params)
    if not f["cluster"]:
        raise BadParameter("cluster is required: a cluster name or id")
    scope = panels.resolve(backend, f["cluster"], f["span"], f["since"], f["until"])
    if panel == "logs":
        level = _opt(params, "level")
        if level and level.upper() not in panels.LEVELS:
            raise BadParameter(f"level must be one of {', '.join(panels.LEVELS)}, not {level!r}")
        return panels.logs(backend, scope, level, _opt(params, "worker"), _opt(params, "text"),
                           _int(params, "limit", 500, high=10_000), _opt(params, "logger"))
    if panel == "diagnosis":
        return panels.diagnosis_panel(backend, scope, _opt(params, "key"))
    if panel == "memory":
        dead = [d["worker"] for d in panels.markers(backend, scope)["deaths"]]
        return panels.memory(backend, scope, dead)
    if panel == "task_stream":
        return panels.task_stream(backend, scope, _int(params, "max_bars", panels.MAX_BARS, 0, 200_000))
    return panels.RUN_PANELS[panel](backend, scope)


def clusters(backend: Backend, params: Mapping) -> dict:
    return panels.clusters(backend, _opt(params, "name"), parse_time(params.get("since"), "since"),
                           parse_time(params.get("until"), "until"),
                           limit=_int(params, "limit", panels.CLUSTERS_PAGE, 1, panels.CLUSTERS_PAGE_MAX),
                           offset=_int(params, "offset", 0, 0, 10**12))


def task(backend: Backend, params: Mapping) -> dict:
    cluster, key = _opt(params, "cluster"), params.get("key")
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
    if isinstance(error, panels.NotFound):
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
