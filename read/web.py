"""The web UI: a small ASGI application (Starlette, served by uvicorn) over the
recorded history.

Pages (HTML, Jinja2 templates in ``ui/`` with autoescaping on; charts are Bokeh
documents embedded with ``bokeh.embed.file_html``, BokehJS served from the bokeh
package under ``/static``):

``/``                    Clusters: every recorded cluster, filterable by name and time.
``/run?cluster=``        Run: the heading, a navigation bar, the filters (``span``,
                         ``since``, ``until``) and a placeholder per panel of
                         :data:`.views.RUN_VIEWS`, which the page's script fills from
                         ``/api/view/<name>`` as each scrolls into view; a filter
                         changes the panels without reloading the page.
``/worker?cluster=&worker=`` a worker's page (:data:`.views.WORKER_VIEWS`), the same way.
``/api/view/<name>?...`` one panel: ``{"html", "bokeh"}`` (its fragment, and its
                         figures for ``Bokeh.embed.embed_items``); ``header``: the Run
                         page's heading for new filters.
``/report?cluster=``     the Run page as a self-contained HTML file to download.
``/task?cluster=&key=``  Task: story, metrics and logs around it, dependencies.
``/compare?span=``       Compare: one span across runs and clusters.
``/api``                 the JSON API's endpoints (:mod:`.api`).

An unknown cluster, span or key answers 404 with a page naming it; a bad parameter
400; a ClickHouse failure 502 -- never a stack trace.

It answers only requests addressed to it: the ``Host`` header must name a loopback
address (``localhost``, ``127.0.0.1``, ``[::1]``) or one of the ``hosts`` it was
created with (``dask-blackbox ui --host`` and ``--trusted-host``); anything else is a
400 before any page or file is served, so a page of another site that rebinds its
name to this address (DNS rebinding) reads nothing. Every URL the pages hold is
relative (BokehJS from ``./static/``, links to other pages), none built from the
request's host, and every value in a link is URL-encoded (task keys in the task
stream's click too).
"""

from __future__ import annotations

import contextlib
import logging
import urllib.parse
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dask_blackbox.read import api, report, templates, views
from dask_blackbox.read.views.page import span_names
from dask_blackbox.read.views.scope import NotFound
from dask_blackbox.read.backends import Backend

logger = logging.getLogger("dask_blackbox.read.web")


def _bokeh_static() -> str:
    from bokeh.util.paths import bokehjs_path

    return str(bokehjs_path())


#: Host names every UI answers to.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def trusted_hosts(hosts=()) -> frozenset[str]:
    """The ``Host`` names the UI answers to: :data:`LOOPBACK_HOSTS` and ``hosts``
    (lower case; an IPv6 address in brackets, as a Host header carries it)."""
    out = set(LOOPBACK_HOSTS)
    for host in hosts:
        host = str(host).strip().lower()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        if host:
            out.add(host)
    return frozenset(out)


class TrustedHosts:
    """ASGI middleware: a request whose ``Host`` header is not one of ``hosts`` gets
    a 400 naming it; nothing else of the app runs."""

    def __init__(self, app, hosts: frozenset[str]) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            from starlette._utils import parse_host_header
            from starlette.datastructures import Headers

            raw = Headers(scope=scope).get("host")
            parsed = parse_host_header(raw)
            if parsed is None or parsed.host.lower() not in self.hosts:
                message = (f"host {raw!r:.80} is not one this UI answers to ({', '.join(sorted(self.hosts))}); "
                           "start it with --trusted-host NAME to add one")
                body = api.dumps({"error": message})
                await Response(body, 400, media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------ plumbing


async def _call(request: Request, fn, *args):
    """``fn(backend, *args)`` in a thread, on the app's shared backend (``app.state.backends``)."""
    backends: api.Backends = request.app.state.backends
    return await run_in_threadpool(backends.run, lambda b: fn(b, *args))


def _error_page(error: BaseException) -> HTMLResponse:
    status = api.status_of(error)
    if status == 500:
        logger.exception("internal error", exc_info=error)
    heading = {404: "Not found", 400: "Bad request", 502: "ClickHouse failed"}.get(status, "Error")
    message = api.one_line(error) if status != 500 else \
        f"internal error ({type(error).__name__}): {api.one_line(error)}"
    return HTMLResponse(report.render_page("error.html", heading=heading, message=message,
                                           page_title=f"{heading} - dask-blackbox",
                                           query={}, generated=0), status_code=status)


def _error_json(error: BaseException) -> Response:
    status = api.status_of(error)
    if status == 500:
        logger.exception("internal error", exc_info=error)
    return Response(api.dumps({"error": api.one_line(error)}), status, media_type="application/json")


def _html(fn):
    """An endpoint answering ``fn``'s text as a page; every error becomes a page naming it."""
    async def endpoint(request: Request) -> Response:
        try:
            return HTMLResponse(await fn(request))
        except Exception as e:
            return _error_page(e)
    return endpoint


def _json(fn):
    """An endpoint answering ``fn``'s value as JSON; every error becomes ``{"error"}``."""
    async def endpoint(request: Request) -> Response:
        try:
            return Response(api.dumps(await fn(request)), media_type="application/json")
        except Exception as e:
            return _error_json(e)
    return endpoint


def _params(request: Request) -> dict:
    return dict(request.query_params)


def _scope_query(q: dict) -> str:
    return urllib.parse.urlencode(
        {k: v for k, v in q.items() if k in ("cluster", "span", "since", "until") and v})


def _shell(backend: Backend, q: dict, memo: views.Memo) -> dict:
    ctx = views.context(backend, q, memo)
    return {"ctx": ctx, "head": views.summary(ctx), "span_names": span_names(backend, ctx.scope)}


#: What :func:`_worker_shell` reads (``{database}`` filled in where it is run).
WORKER_SHELL = ("SELECT count() FROM {database}.worker_metrics WHERE cluster_id = "
                "{{c:String}} AND worker = {{w:String}}")


def _worker_shell(backend: Backend, q: dict, memo: views.Memo):
    worker = api.opt(q, "worker")
    if not worker:
        raise api.BadParameter("worker is required: a worker's address")
    ctx = views.context(backend, q, memo, worker=worker)
    from dask_blackbox.read import workers

    known = ctx.info()
    if worker not in known and worker not in workers.nthreads(backend, ctx.scope.cluster_id, known):
        _, seen = backend.query(
            WORKER_SHELL.format(database=backend.database), {"c": ctx.scope.cluster_id, "w": worker})
        if not seen[0][0]:
            raise NotFound(f"no worker {worker!r} was recorded in cluster "
                           f"{ctx.scope.cluster_name} ({ctx.scope.cluster_id})")
    return ctx


def _view(backend: Backend, name: str, q: dict, memo: views.Memo) -> dict:
    if name == "header":
        shell = _shell(backend, q, memo)
        ctx = shell["ctx"]
        return {"html": templates.env().get_template("header.html").render(
            scope=ctx.scope, head=shell["head"], web=True), "bokeh": None}
    if name not in views.VIEWS:
        raise NotFound(f"no panel {name!r}; the panels are {', '.join(views.VIEWS)}")
    on_worker_page = views.VIEWS[name].page == "worker"
    worker = api.opt(q, "worker") if on_worker_page else None
    if on_worker_page and not worker:
        raise api.BadParameter("worker is required: a worker's address")
    ctx = views.context(backend, q, memo, worker=worker)
    return views.render_view(name, ctx, _scope_query(q))


def _run_data(backend: Backend, q: dict) -> dict:
    f = api.filters(q)
    if not f["cluster"]:
        raise api.BadParameter("cluster is required: a cluster name or id")
    return views.run_data(backend, f["cluster"], f["span"], f["since"], f["until"],
                          slowness=True if api.opt(q, "slowness") else None)


# ------------------------------------------------------------------- pages


async def clusters_page(request: Request) -> str:
    q = _params(request)
    data = await _call(request, api.clusters, q)
    return report.render_page("clusters.html", clusters=data["clusters"], page=_page_links(q, data),
                              query=q, page_title="Clusters - dask-blackbox", generated=0)


async def run_page(request: Request) -> str:
    q = _params(request)
    shell = await _call(request, _shell, q, request.app.state.memo)
    ctx = shell["ctx"]
    return report.render_page(
        "run.html", web=True, lazy=True, views=views.RUN_VIEWS, scope=ctx.scope, query=q,
        query_string=_scope_query(q), head=shell["head"], span_names=shell["span_names"],
        page_kind="run", generated=0, bokeh_js=report.web_resources(_ROOT),
        page_title=f"{ctx.scope.cluster_name} - dask-blackbox")


async def worker_page(request: Request) -> str:
    q = _params(request)
    ctx = await _call(request, _worker_shell, q, request.app.state.memo)
    return report.render_page(
        "worker.html", web=True, views=views.WORKER_VIEWS, scope=ctx.scope, query=q,
        worker_address=ctx.worker, page_kind="worker", generated=0,
        bokeh_js=report.web_resources(_ROOT),
        page_title=f"{ctx.worker} - {ctx.scope.cluster_name} - dask-blackbox")


async def report_file(request: Request) -> Response:
    try:
        data = await _call(request, _run_data, _params(request))
        page = await run_in_threadpool(report.render_run, data, False)
        name = f"{data['scope'].cluster_name or data['scope'].cluster_id}-report.html"
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return HTMLResponse(page, headers={"Content-Disposition": f'attachment; filename="{safe}"'})
    except Exception as e:
        return _error_page(e)


async def task_page(request: Request) -> str:
    q = _params(request)
    data = await _call(request, api.task, q)
    return report.render_page("task.html", t=data, query=q, generated=0,
                              page_title=f"{data['key']} - dask-blackbox")


async def compare_page(request: Request) -> str:
    q = _params(request)
    if not api.opt(q, "span") and not api.opt(q, "cluster"):
        names = await _call(request, _all_span_names)
        return report.render_page("compare.html", cmp=None, spans=names, query=q, generated=0,
                                  page_title="Compare - dask-blackbox")
    data = await _call(request, api.compare, q)
    figures = report.compare_figures(data)
    return report.render_page("compare.html", figures=figures, root_url=_ROOT, cmp=data,
                              spans=[], query=q, generated=0,
                              page_title=f"Compare {data['span'] or data['cluster']} - dask-blackbox")


async def api_index(request: Request) -> str:
    return report.render_page("api.html", endpoints=api.endpoints(), query={}, generated=0,
                              page_title="JSON API - dask-blackbox")


# -------------------------------------------------------------- JSON API


async def api_view(request: Request):
    return await _call(request, _view, request.path_params["name"], _params(request),
                       request.app.state.memo)


async def api_clusters(request: Request):
    return await _call(request, api.clusters, _params(request))


async def api_run(request: Request):
    return await _call(request, api.run_panel, request.path_params["panel"], _params(request),
                       request.app.state.memo)


async def api_task(request: Request):
    return await _call(request, api.task, _params(request))


async def api_compare(request: Request):
    return await _call(request, api.compare, _params(request))


async def not_found(request: Request, exc) -> Response:
    error = NotFound(f"no page {request.url.path!r}")
    return _error_json(error) if request.url.path.startswith("/api/") else _error_page(error)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    yield
    app.state.backends.close()


ROUTES = [
    Route("/", _html(clusters_page)),
    Route("/run", _html(run_page)),
    Route("/worker", _html(worker_page)),
    Route("/report", report_file),
    Route("/task", _html(task_page)),
    Route("/compare", _html(compare_page)),
    Route("/api", _html(api_index)),
    Route("/api/clusters", _json(api_clusters)),
    Route("/api/run/{panel}", _json(api_run)),
    Route("/api/view/{name}", _json(api_view)),
    Route("/api/task", _json(api_task)),
    Route("/api/compare", _json(api_compare)),
]


def create_app(connect: Callable[[], Backend] | None = None, hosts=()) -> Starlette:
    """The ASGI app. ``connect`` returns the backend (default
    :func:`dask_blackbox.read.backends.connect`), called on the first request;
    ``hosts``: names it answers to besides the loopback ones (:func:`trusted_hosts`).
    Its requests share ``app.state.backends`` (one backend, :class:`api.Backends`)
    and ``app.state.memo`` (what the panels of a page share, :class:`views.Memo`)."""
    if connect is None:
        from dask_blackbox.read.backends import connect
    app = Starlette(
        debug=False,
        routes=[*ROUTES, Mount("/static", StaticFiles(directory=_bokeh_static()), name="static")],
        exception_handlers={404: not_found},
        lifespan=_lifespan,
    )
    app.state.backends = api.Backends(connect)
    app.state.memo = views.Memo()
    app.add_middleware(TrustedHosts, hosts=trusted_hosts(hosts))
    return app


#: Where pages find BokehJS (``./static/``): relative, never the request's host.
_ROOT = "./"


def _page_links(q: dict, data: dict) -> dict:
    """The clusters page's paging: which rows are shown, and the relative links to the
    previous and next pages (the filters kept, URL-encoded)."""
    offset, limit, total = data["offset"], data["limit"], data["total"]
    keep = {k: v for k, v in q.items() if k in ("name", "since", "until", "limit") and v}

    def link(start: int) -> str:
        return "./?" + urllib.parse.urlencode({**keep, "offset": start} if start else keep)

    return {"first": offset + 1 if data["clusters"] else 0, "last": offset + len(data["clusters"]),
            "total": total,
            "previous": link(max(0, offset - limit)) if offset > 0 else None,
            "next": link(offset + limit) if offset + limit < total else None}


#: What :func:`_all_span_names` reads (``{database}`` filled in where it is run).
ALL_SPAN_NAMES = ("SELECT DISTINCT arrayStringConcat(name, '/') AS n FROM {database}.spans "
                  "ORDER BY n")


def _all_span_names(backend: Backend) -> list[str]:
    _, rows = backend.query(ALL_SPAN_NAMES.format(database=backend.database))
    return [r[0] for r in rows]


def serve(host: str = "127.0.0.1", port: int = 8787, connect: Callable[[], Backend] | None = None,
          ready: Callable[[str], None] | None = None, trusted=()) -> None:
    """Serve the UI until interrupted (uvicorn). ``ready(url)`` is called once it listens.
    It answers to the loopback names, ``host`` and ``trusted`` (:class:`TrustedHosts`)."""
    import uvicorn

    config = uvicorn.Config(create_app(connect, hosts=[host, *trusted]), host=host, port=port,
                            log_level="warning",
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    if ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
            ready(f"http://{host}:{bound}/")
        server.startup = startup
    server.run()
