"""The panels of the Run page and of a worker's page: what each one reads, how it is
drawn, and in which order the page shows them.

A :class:`View` names a panel: its ``data`` (read from ClickHouse for a
:class:`Context`), its template (``ui/<template>``, a fragment of the page) and how
its figures are drawn (:class:`~dask_blackbox.read.figures.Figures`). The same views
make three things:

- the web page: a light page (the run's heading, a navigation bar, the filters, a
  placeholder per view) whose script asks ``/api/view/<name>`` for each panel as it
  scrolls into view (:func:`render_view`: the fragment's HTML and the script that
  draws its figures, one Bokeh document per panel);
- the report (:func:`render_report`): every panel at once, one Bokeh document, one
  self-contained file;
- the JSON API (``/api/run/<name>``): a view's data.

:class:`Context` holds what several panels share (the run's deaths, its progress, its
critical path), computed once per page and, in the web UI, kept for
:data:`MEMO_SECONDS` by a :class:`Memo` shared by the requests: the panels of one page
ask for them within a second of each other.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dask_blackbox.read import aggregates, backends, diagnosis, history, panels, rollup_panels, templates
from dask_blackbox.read import graph as graphs
from dask_blackbox.read import groups as task_groups
from dask_blackbox.read import workers as worker_data
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.params import BadParameter, filters
from dask_blackbox.read.queries import TimeBound

if TYPE_CHECKING:  # Bokeh loads when a panel is drawn, not when data is read
    from dask_blackbox.read.figures import Figures

#: Seconds a shared result (deaths, progress, critical path, scope) is kept for the
#: next panels of the same page.
MEMO_SECONDS = 30.0
#: Erred tasks whose story the failures panel (and the report) shows.
STORIES = 20


class Memo:
    """A small time-bounded cache shared by the web app's requests (thread-safe):
    at most ``size`` entries, each kept ``seconds``."""

    def __init__(self, seconds: float = MEMO_SECONDS, size: int = 64) -> None:
        self.seconds, self.size = seconds, size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make: Callable[[], Any]):
        now = time.monotonic()
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        value = make()
        with self._lock:
            self._items[key] = (now + self.seconds, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


class Context:
    """One page's scope and parameters, and what its panels share."""

    def __init__(self, backend: Backend, scope: panels.Scope, params: Mapping | None = None,
                 memo: Memo | None = None, worker: str | None = None,
                 slowness: bool | None = None) -> None:
        self.backend, self.scope = backend, scope
        self.params = dict(params or {})
        self.memo = memo or Memo()
        self.worker = worker
        self._slowness = slowness
        s = scope
        self._key = (s.cluster_id, s.span, s.since, s.until)

    def _shared(self, what: str, make: Callable[[], Any]):
        return self.memo.get((what, *self._key), make)

    def deaths(self) -> list:
        return self.memo.get(("deaths", self.scope.cluster_id),
                             lambda: diagnosis.deaths(self.backend, [self.scope.cluster_id]))

    def info(self) -> dict[str, dict]:
        """The run's workers as the scheduler recorded them (:func:`workers.info`)."""
        return self.memo.get(("info", self.scope.cluster_id),
                             lambda: worker_data.info(self.backend, self.scope.cluster_id))

    def markers(self) -> dict:
        return self._shared("markers", lambda: panels.markers(self.backend, self.scope, self.deaths()))

    def history(self) -> history.Detail:
        """Where the run's panels come from (:func:`.history.detail`): its raw rows, or
        its per-minute roll-ups once the raw rows expired (the progress, task states,
        memory and a binned task stream then come from :mod:`.rollup_panels`, and the
        heading says so; what only raw rows could show is empty)."""
        return self.memo.get(("history", self.scope.cluster_id),
                             lambda: history.detail(self.backend, self.scope.cluster_id))

    def from_rollups(self) -> bool:
        return self.history().source == "rollups"

    def counts(self) -> dict[str, dict]:
        """Per prefix: tasks, transitions into memory and into erred (the progress
        panel's ``counts``; the heading's and the task stream's sums): without the
        progress panel's series where the raw rows answer."""
        if self.from_rollups():
            return self.progress()["counts"]
        return self._shared("counts", lambda: panels.prefix_totals(self.backend, self.scope))

    def progress(self) -> dict:
        if self.from_rollups():
            return self._shared("progress", lambda: rollup_panels.progress(self.backend, self.scope))
        return self._shared("progress", lambda: panels.progress(self.backend, self.scope, self.counts()))

    def n_tasks(self) -> int:
        return sum(c["tasks"] for c in self.counts().values())

    def slowness(self) -> bool:
        """Whether the critical path and the costs are computed for this page: asked
        for (``slowness``), or a scope of at most :data:`panels.SLOWNESS_MAX_TASKS`."""
        if self._slowness is not None:
            return self._slowness
        if self.params.get("slowness"):
            return True
        return self.n_tasks() <= panels.SLOWNESS_MAX_TASKS

    def critical_path(self) -> dict:
        if not self.slowness():
            return {"deferred": self.n_tasks()}
        return self._shared("critical_path", lambda: panels.critical_path(self.backend, self.scope))

    def count_bytes(self) -> bool:
        """Whether bytes moved between workers are counted for this page: asked for
        (``slowness``), or a run of at most :data:`workers.MOVED_MAX_TASKS` tasks."""
        if self._slowness or self.params.get("slowness"):
            return True
        return self.n_tasks() <= worker_data.MOVED_MAX_TASKS

    def moved(self) -> dict | None:
        """The run's bytes moved per (sender, receiver) (:func:`workers.moved_bytes`),
        None when not counted (:meth:`count_bytes`) or without a recorded graph."""
        if not self.count_bytes():
            return None
        return self.memo.get(("moved", self.scope.cluster_id),
                             lambda: worker_data.moved_bytes(self.backend, self.scope.cluster_id))

    def workers(self) -> dict:
        return self.memo.get(("workers", self.scope.cluster_id, self.count_bytes()),
                             lambda: worker_data.workers(self.backend, self.scope, self.deaths(),
                                                         self.moved(), not self.count_bytes(),
                                                         self.info()))

    def critical_keys(self) -> set[str] | None:
        path = self.critical_path()
        if path.get("deferred") is not None or not path.get("available"):
            return None
        return {link["key"] for link in path["links"]}


@dataclasses.dataclass(frozen=True)
class View:
    """A panel: its ``name`` (its JSON API and its anchor), ``title`` (the
    navigation's), ``data`` (its data for a context, a dict merged into the page's),
    ``template`` and ``draw`` (adds its figures, returns variables for its template;
    it reads this view's data only)."""

    name: str
    title: str
    data: Callable[[Context], dict]
    template: str
    draw: Callable[[Figures, dict, Context], dict] | None = None


# ----------------------------------------------------------------- the data


def _diagnosis(ctx: Context) -> dict:
    return {"diagnosis": panels.diagnosis_panel(ctx.backend, ctx.scope, found=ctx.deaths())}


def _task_stream(ctx: Context) -> dict:
    finished = sum(c["memory"] + c["erred"] for c in ctx.counts().values())
    max_bars = _int(ctx.params.get("max_bars"), panels.MAX_BARS)
    if ctx.from_rollups():
        stream = rollup_panels.task_stream(ctx.backend, ctx.scope,
                                           panels.nthreads(ctx.backend, ctx.scope, ctx.info()))
    else:
        stream = panels.task_stream(ctx.backend, ctx.scope, max_bars, finished=finished,
                                    known=ctx.info())
    return {"task_stream": stream, "critical_path": ctx.critical_path()}


def _critical_path(ctx: Context) -> dict:
    return {"critical_path": ctx.critical_path()}


def _cost(ctx: Context) -> dict:
    if not ctx.slowness():
        return {"cost": {"deferred": ctx.n_tasks()}}
    return {"cost": panels.cost(ctx.backend, ctx.scope)}


def _progress(ctx: Context) -> dict:
    states = (rollup_panels.task_states if ctx.from_rollups() else panels.task_states)(
        ctx.backend, ctx.scope)
    return {"progress": ctx.progress(), "task_states": states}


def _groups(ctx: Context) -> dict:
    return {"groups": task_groups.groups(ctx.backend, ctx.scope)}


def _graph(ctx: Context) -> dict:
    max_nodes = _int(ctx.params.get("max_nodes"), graphs.MAX_NODES)
    return {"graph": graphs.graph(ctx.backend, ctx.scope, ctx.critical_keys(), max_nodes)}


def _workers(ctx: Context) -> dict:
    return {"workers": ctx.workers()}


def _memory(ctx: Context) -> dict:
    marks = ctx.markers()
    dead = [d["worker"] for d in marks["deaths"]]
    if ctx.from_rollups():
        mem = rollup_panels.memory(ctx.backend, ctx.scope, dead=dead, shown=panels.MEMORY_WORKERS)
    else:
        mem = panels.memory(ctx.backend, ctx.scope, dead, ctx.info())
    return {"memory": mem, "markers": marks}


def _activity(ctx: Context) -> dict:
    return {"activity": panels.activity(ctx.backend, ctx.scope, ctx.worker, ctx.info())}


def _spans(ctx: Context) -> dict:
    return {"spans": panels.spans(ctx.backend, ctx.scope)}


def _fine_metrics(ctx: Context) -> dict:
    return {"fine_metrics": panels.fine_metrics(ctx.backend, ctx.scope)}


def _failures(ctx: Context) -> dict:
    fail = panels.failures(ctx.backend, ctx.scope)
    keys = list(dict.fromkeys(t["key"] for t in fail["erred_tasks"][:STORIES]))
    stories: dict[str, list] = {k: [] for k in keys}
    if keys:  # the stories of queries.story (scheduler and workers), in one query
        columns, rows = ctx.backend.query(
            "SELECT key, start, finish, stimulus_id, toFloat64(ts) AS ts, cluster_id, worker, source "
            f"FROM {_t(ctx.backend, 'transitions')} WHERE cluster_id = {{c:String}} "
            "AND key IN {keys:Array(String)} ORDER BY ts, seq, idx",
            {"c": ctx.scope.cluster_id, "keys": keys})
        for r in rows:
            stories[r[0]].append(dict(zip(columns, r)))
    fail["stories"] = stories
    return {"failures": fail}


def _logs(ctx: Context) -> dict:
    q = ctx.params
    level = q.get("level") or None
    if level and level.upper() not in panels.LEVELS:
        raise BadParameter(f"level must be one of {', '.join(panels.LEVELS)}, not {level!r}")
    worker = ctx.worker or q.get("worker") or None
    return {"logs": panels.logs(ctx.backend, ctx.scope, level, worker, q.get("text") or None,
                                _int(q.get("limit"), 500), q.get("logger") or None)}


def _int(value, default: int) -> int:
    try:
        return int(value) if value not in (None, "") else default
    except (TypeError, ValueError):
        return default


# -------------------------------------------------------------- the drawing


def _draw_task_stream(f: Figures, data: dict, ctx: Context) -> dict:
    path = data.get("critical_path")
    f.task_stream(data["task_stream"], path if path and path.get("available") else None)
    return {}


def _draw_progress(f: Figures, data: dict, ctx: Context) -> dict:
    f.progress(data["progress"])
    f.task_states(data["task_states"])
    return {}


def _draw_groups(f: Figures, data: dict, ctx: Context) -> dict:
    f.groups(data["groups"])
    return {}


def _draw_graph(f: Figures, data: dict, ctx: Context) -> dict:
    return {"graph_legends": f.graph(data["graph"])}


def _draw_memory(f: Figures, data: dict, ctx: Context) -> dict:
    return {"memory_figures": f.memory(data["memory"])}


def _draw_activity(f: Figures, data: dict, ctx: Context) -> dict:
    return {"activity_figures": f.activity(data["activity"])}


def _draw_spans(f: Figures, data: dict, ctx: Context) -> dict:
    f.span_gantt(data["spans"])
    return {}


def _draw_fine_metrics(f: Figures, data: dict, ctx: Context) -> dict:
    f.fine_metrics(data["fine_metrics"])
    return {}


#: The Run page's panels, in the page's order.
RUN_VIEWS: tuple[View, ...] = (
    View("diagnosis", "Diagnosis", _diagnosis, "panel_diagnosis.html"),
    View("task_stream", "Task stream", _task_stream, "panel_task_stream.html", _draw_task_stream),
    View("critical_path", "Critical path", _critical_path, "critical_path.html"),
    View("cost", "Cost", _cost, "cost.html"),
    View("progress", "Progress", _progress, "panel_progress.html", _draw_progress),
    View("groups", "Task groups", _groups, "panel_groups.html", _draw_groups),
    View("graph", "Task graph", _graph, "panel_graph.html", _draw_graph),
    View("workers", "Workers", _workers, "panel_workers.html"),
    View("memory", "Memory", _memory, "panel_memory.html", _draw_memory),
    View("activity", "Processing, CPU, transfers", _activity, "panel_activity.html", _draw_activity),
    View("spans", "Spans", _spans, "panel_spans.html", _draw_spans),
    View("fine_metrics", "Fine metrics", _fine_metrics, "panel_fine_metrics.html", _draw_fine_metrics),
    View("failures", "Failures", _failures, "panel_failures.html"),
    View("logs", "Logs", _logs, "panel_logs.html"),
)


# ------------------------------------------------------------ a worker's page


def _worker_summary(ctx: Context) -> dict:
    rows = ctx.workers()["workers"]
    row = next((r for r in rows if r["worker"] == ctx.worker), None)
    if row is None:
        raise panels.NotFound(f"no worker {ctx.worker!r} was recorded in cluster "
                              f"{ctx.scope.cluster_name} ({ctx.scope.cluster_id})")
    deaths = [d.as_dict() for d in ctx.deaths() if d.worker == ctx.worker]
    return {"worker": row, "worker_deaths": deaths}


def _worker_stream(ctx: Context) -> dict:
    max_bars = _int(ctx.params.get("max_bars"), panels.MAX_BARS)
    return {"task_stream": panels.task_stream(ctx.backend, ctx.scope, max_bars, worker=ctx.worker)}


def _worker_metrics(ctx: Context) -> dict:
    known = ctx.info().get(ctx.worker, {})
    series = worker_data.series(ctx.backend, ctx.scope, ctx.worker, panels.BUCKETS)
    series["worker"] = ctx.worker
    return {"worker_series": series, "memory_limit": known.get("memory_limit"),
            "activity": panels.activity(ctx.backend, ctx.scope, ctx.worker, ctx.info())}


def _worker_transfers(ctx: Context) -> dict:
    moved = ctx.moved()
    peers: dict[str, dict] = {}
    for (sender, receiver), n in (moved or {}).items():
        if receiver == ctx.worker:
            peers.setdefault(sender, {"in": 0, "out": 0, "seconds_in": 0.0, "transfers_in": 0})["in"] += n
        elif sender == ctx.worker:
            peers.setdefault(receiver, {"in": 0, "out": 0, "seconds_in": 0.0, "transfers_in": 0})["out"] += n
    for sender, receiver, seconds, count in aggregates.transfers(ctx.backend, ctx.scope):
        if receiver == ctx.worker and sender:
            p = peers.setdefault(sender, {"in": 0, "out": 0, "seconds_in": 0.0, "transfers_in": 0})
            p["seconds_in"] += seconds
            p["transfers_in"] += count
    sent = [r for r in aggregates.digests(ctx.backend, ctx.scope.cluster_id, ctx.worker)
            if r[0] in ("get-data", "gather-dep")]
    return {"transfers": {"peers": dict(sorted(peers.items())), "graph": moved is not None,
                          "bytes_deferred": not ctx.count_bytes(),
                          "digests": [dict(zip(("context", "prefix", "activity", "unit", "value"), r))
                                      for r in sorted(sent)]}}


def _draw_worker_stream(f: Figures, data: dict, ctx: Context) -> dict:
    f.task_stream(data["task_stream"], name="worker_stream")
    return {}


def _draw_worker_metrics(f: Figures, data: dict, ctx: Context) -> dict:
    s = data["worker_series"]
    f.worker_memory(s, data["memory_limit"])
    # its CPU, executing / ready / in flight and actions: the Run page's charts of one worker
    return {"worker_figures": ["worker_memory",
                               *f.activity(data["activity"], prefix="worker", whose="its samples")]}


#: A worker's page, in order.
WORKER_VIEWS: tuple[View, ...] = (
    View("worker", "Worker", _worker_summary, "panel_worker.html"),
    View("worker_stream", "Its task stream", _worker_stream, "panel_worker_stream.html",
         _draw_worker_stream),
    View("worker_metrics", "Memory, CPU, processing", _worker_metrics, "panel_worker_metrics.html",
         _draw_worker_metrics),
    View("worker_transfers", "Transfers", _worker_transfers, "panel_worker_transfers.html"),
    View("worker_logs", "Logs", _logs, "panel_logs.html"),
)

VIEWS: dict[str, View] = {v.name: v for v in (*RUN_VIEWS, *WORKER_VIEWS)}


# ---------------------------------------------------------------- rendering


def page_variables(ctx: Context, web: bool, query_string: str = "") -> dict:
    """What every panel's template is given besides its data."""
    return {"scope": ctx.scope, "web": web, "query": ctx.params, "query_string": query_string,
            "levels": panels.LEVELS, "worker_address": ctx.worker}


def render_view(name: str, ctx: Context, query_string: str = "") -> dict:
    """One panel for the web page: ``{"html": its fragment, "bokeh": null or
    {"docs_json": its Bokeh document as JSON text, "render_items": [...]}}`` -- what
    ``Bokeh.embed.embed_items`` draws into the fragment's figure divs."""
    from bokeh.core.json_encoder import serialize_json
    from bokeh.embed.util import OutputDocumentFor, standalone_docs_json_and_render_items

    from dask_blackbox.read.figures import Figures

    view = VIEWS[name]
    data = view.data(ctx)
    markers = data.get("markers") or ctx.markers()
    figures = Figures(ctx.scope, markers, web=True)
    extra = view.draw(figures, data, ctx) if view.draw else {}
    bokeh, roots = None, {}
    if figures.figures:
        names, models = list(figures.figures), list(figures.figures.values())
        with OutputDocumentFor(models):
            docs_json, [item] = standalone_docs_json_and_render_items(models)
        roots = dict(zip(names, item.roots))
        bokeh = {"docs_json": serialize_json(docs_json), "render_items": [item.to_json()]}
    html = templates.env().get_template(view.template).render(
        data={**data, "markers": markers}, roots=roots, has=set(roots), **extra,
        **page_variables(ctx, True, query_string))
    return {"html": html, "bokeh": bokeh}


class Arrivals:
    """The report's data as it is read in one thread and drawn in another: ``data``
    fills view by view, and :meth:`wait` returns once the named views' data (and
    ``scope``, ``markers`` and ``summary``, the first to come) are in it."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self._arrived: set[str] = set()
        self._failed: BaseException | None = None
        self._changed = threading.Condition()

    def add(self, name: str, values: dict) -> None:
        with self._changed:
            self.data.update(values)
            self._arrived.add(name)
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._changed:
            self._failed = error
            self._changed.notify_all()

    def wait(self, *names: str) -> dict:
        """``data``, once ``names`` arrived; raises what the reading raised."""
        with self._changed:
            self._changed.wait_for(lambda: self._failed is not None
                                   or self._arrived.issuperset(("head", *names)))
            if self._failed is not None:
                raise self._failed
        return self.data


def report_data(ctx: Context, views=RUN_VIEWS, arrivals: Arrivals | None = None) -> dict:
    """Every panel's data, merged (what the report draws), into ``arrivals`` if given."""
    arrivals = Arrivals() if arrivals is None else arrivals
    head = summary(ctx)
    arrivals.add("head", {"scope": ctx.scope, "markers": ctx.markers(), "summary": head,
                          "history": head["history"]})
    for view in views:
        arrivals.add(view.name, view.data(ctx))
    return arrivals.data


def run_data(backend: Backend, cluster: str, span: str | None = None, since: TimeBound = None,
             until: TimeBound = None, level: str | None = None, worker: str | None = None,
             text: str | None = None, max_bars: int = panels.MAX_BARS,
             slowness: bool | None = None, logger: str | None = None,
             arrivals: Arrivals | None = None) -> dict:
    """Every panel of the Run page (what :mod:`.report` draws): the data of each of
    :data:`RUN_VIEWS`, merged, with ``scope``,
    ``markers``, ``summary`` and ``span_names`` (last). ``slowness``: compute the critical
    path and the cost (default: when the scope holds at most
    :data:`panels.SLOWNESS_MAX_TASKS` tasks; otherwise those two panels say ``{"deferred":
    n_tasks}``). ``arrivals``: filled as the views are read."""
    arrivals = Arrivals() if arrivals is None else arrivals
    scope = panels.resolve(backend, cluster, span, since, until)
    params = {"level": level, "worker": worker, "text": text, "logger": logger, "max_bars": max_bars}
    ctx = Context(backend, scope, params, slowness=slowness)
    report_data(ctx, arrivals=arrivals)
    arrivals.add("span_names", {"span_names": panels.span_names(backend, scope)})
    return arrivals.data


def read_run(cluster: str, span: str | None = None, since: TimeBound = None,
             until: TimeBound = None, backend: Backend | None = None,
             arrivals: Arrivals | None = None) -> dict:
    """:func:`run_data` of the report, over ``backend`` or a connection of its own
    (closed after); what connecting or reading raises is passed on to ``arrivals``."""
    own = backend is None
    try:
        backend = backends.connect() if own else backend
        try:
            return run_data(backend, cluster, span=span, since=since, until=until, arrivals=arrivals)
        finally:
            if own:
                backend.close()
    except BaseException as e:
        if arrivals is not None:
            arrivals.fail(e)
        raise


def summary(ctx: Context) -> dict:
    """The page's heading: the scope and its counts (tasks, in memory, erred, workers,
    deaths, restarts)."""
    if ctx.from_rollups():
        head = rollup_panels.summary(ctx.scope, ctx.progress())
    else:
        head = panels.summary(ctx.backend, ctx.scope, {"counts": ctx.counts()})
    marks = ctx.markers()
    found = ctx.history()
    head.update(deaths=len(marks["deaths"]), restarts=len(marks["restarts"]),
                workers=len(ctx.info()),
                history={"source": found.source, "note": found.note})
    return head


def context(backend: Backend, params: Mapping, memo: Memo | None = None,
            worker: str | None = None) -> Context:
    """The context of a page from its query parameters (``cluster``, ``span``,
    ``since``, ``until``; parsed by :func:`dask_blackbox.read.params.filters`)."""
    f = filters(params)
    if not f["cluster"]:
        raise BadParameter("cluster is required: a cluster name or id")
    memo = memo or Memo()
    scope = memo.get(("scope", f["cluster"], f["span"], f["since"], f["until"]),
                     lambda: panels.resolve(backend, f["cluster"], f["span"], f["since"], f["until"]))
    return Context(backend, scope, params, memo, worker)


__all__ = ["View", "Context", "Memo", "RUN_VIEWS", "WORKER_VIEWS", "VIEWS", "render_view",
           "report_data", "run_data", "read_run", "Arrivals", "summary", "context"]
