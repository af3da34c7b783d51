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

from dask_blackbox.read import api, panels, report, templates, views
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


def create_app(connect: Callable[[], Backend] | None = None, hosts=()) -> Starlette:
    """The ASGI app. ``connect`` returns the backend (default
    :func:`dask_blackbox.read.backends.connect`), called on the first request;
    ``hosts``: names it answers to besides the loopback ones (:func:`trusted_hosts`)."""
    if connect is None:
        from dask_blackbox.read.backends import connect
    backends = api.Backends(connect)
    memo = views.Memo()

    async def call(fn, *args):
        return await run_in_threadpool(backends.run, lambda b: fn(b, *args))

    def error_page(error: BaseException) -> HTMLResponse:
        status = api.status_of(error)
        if status == 500:
            logger.exception("internal error", exc_info=error)
        heading = {404: "Not found", 400: "Bad request", 502: "ClickHouse failed"}.get(status, "Error")
        message = api.one_line(error) if status != 500 else \
            f"internal error ({type(error).__name__}): {api.one_line(error)}"
        return HTMLResponse(report.render_page("error.html", heading=heading, message=message,
                                               page_title=f"{heading} - dask-blackbox",
                                               query={}, generated=0), status_code=status)

    def error_json(error: BaseException) -> Response:
        status = api.status_of(error)
        if status == 500:
            logger.exception("internal error", exc_info=error)
        return Response(api.dumps({"error": api.one_line(error)}), status,
                        media_type="application/json")

    def html(fn):
        async def endpoint(request: Request) -> Response:
            try:
                return HTMLResponse(await fn(request))
            except Exception as e:  # every error becomes a page naming it
                return error_page(e)
        return endpoint

    def json(fn):
        async def endpoint(request: Request) -> Response:
            try:
                return Response(api.dumps(await fn(request)), media_type="application/json")
            except Exception as e:
                return error_json(e)
        return endpoint

    def params(request: Request) -> dict:
        return dict(request.query_params)

    def scope_query(q: dict) -> str:
        return urllib.parse.urlencode(
            {k: v for k, v in q.items() if k in ("cluster", "span", "since", "until") and v})

    async def clusters_page(request: Request) -> str:
        q = params(request)
        data = await call(api.clusters, q)
        return report.render_page("clusters.html", clusters=data["clusters"], page=_page_links(q, data),
                                  query=q, page_title="Clusters - dask-blackbox", generated=0)

    def _shell(backend: Backend, q: dict) -> dict:
        ctx = views.context(backend, q, memo)
        return {"ctx": ctx, "head": views.summary(ctx), "span_names": panels.span_names(backend, ctx.scope)}

    async def run_page(request: Request) -> str:
        q = params(request)
        shell = await call(_shell, q)
        ctx = shell["ctx"]
        return report.render_page(
            "run.html", web=True, lazy=True, views=views.RUN_VIEWS, scope=ctx.scope, query=q,
            query_string=scope_query(q), head=shell["head"], span_names=shell["span_names"],
            page_kind="run", generated=0, bokeh_js=report.web_resources(_ROOT),
            page_title=f"{ctx.scope.cluster_name} - dask-blackbox")

    def _worker_shell(backend: Backend, q: dict):
        worker = api.opt(q, "worker")
        if not worker:
            raise api.BadParameter("worker is required: a worker's address")
        ctx = views.context(backend, q, memo, worker=worker)
        from dask_blackbox.read import workers

        known = ctx.info()
        if worker not in known and worker not in workers.nthreads(backend, ctx.scope.cluster_id, known):
            _, seen = backend.query(
                f"SELECT count() FROM {backend.database}.worker_metrics WHERE cluster_id = {{c:String}} "
                "AND worker = {w:String}", {"c": ctx.scope.cluster_id, "w": worker})
            if not seen[0][0]:
                raise panels.NotFound(f"no worker {worker!r} was recorded in cluster "
                                      f"{ctx.scope.cluster_name} ({ctx.scope.cluster_id})")
        return ctx

    async def worker_page(request: Request) -> str:
        q = params(request)
        ctx = await call(_worker_shell, q)
        return report.render_page(
            "worker.html", web=True, views=views.WORKER_VIEWS, scope=ctx.scope, query=q,
            worker_address=ctx.worker, page_kind="worker", generated=0,
            bokeh_js=report.web_resources(_ROOT),
            page_title=f"{ctx.worker} - {ctx.scope.cluster_name} - dask-blackbox")

    def _view(backend: Backend, name: str, q: dict) -> dict:
        if name == "header":
            shell = _shell(backend, q)
            ctx = shell["ctx"]
            return {"html": templates.env().get_template("header.html").render(
                scope=ctx.scope, head=shell["head"], web=True), "bokeh": None}
        if name not in views.VIEWS:
            raise panels.NotFound(f"no panel {name!r}; the panels are {', '.join(views.VIEWS)}")
        worker = api.opt(q, "worker") if name in {v.name for v in views.WORKER_VIEWS} else None
        if name in {v.name for v in views.WORKER_VIEWS} and not worker:
            raise api.BadParameter("worker is required: a worker's address")
        ctx = views.context(backend, q, memo, worker=worker)
        return views.render_view(name, ctx, scope_query(q))

    async def api_view(request: Request):
        return await call(_view, request.path_params["name"], params(request))

    async def report_file(request: Request) -> Response:
        try:
            q = params(request)
            data = await call(_run_data, q)
            page = await run_in_threadpool(report.render_run, data, False)
            name = f"{data['scope'].cluster_name or data['scope'].cluster_id}-report.html"
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            return HTMLResponse(page, headers={"Content-Disposition": f'attachment; filename="{safe}"'})
        except Exception as e:
            return error_page(e)

    def _run_data(backend: Backend, q: dict) -> dict:
        f = api.filters(q)
        if not f["cluster"]:
            raise api.BadParameter("cluster is required: a cluster name or id")
        return views.run_data(backend, f["cluster"], f["span"], f["since"], f["until"],
                               slowness=True if api.opt(q, "slowness") else None)

    async def task_page(request: Request) -> str:
        q = params(request)
        data = await call(api.task, q)
        return report.render_page("task.html", t=data, query=q, generated=0,
                                  page_title=f"{data['key']} - dask-blackbox")

    async def compare_page(request: Request) -> str:
        q = params(request)
        if not api.opt(q, "span") and not api.opt(q, "cluster"):
            names = await call(_all_span_names)
            return report.render_page("compare.html", cmp=None, spans=names, query=q, generated=0,
                                      page_title="Compare - dask-blackbox")
        data = await call(api.compare, q)
        figures = report.compare_figures(data)
        return report.render_page("compare.html", figures=figures, root_url=_ROOT, cmp=data,
                                  spans=[], query=q, generated=0,
                                  page_title=f"Compare {data['span'] or data['cluster']} - dask-blackbox")

    async def api_index(request: Request) -> str:
        return report.render_page("api.html", endpoints=api.ENDPOINTS, query={}, generated=0,
                                  page_title="JSON API - dask-blackbox")

    async def api_clusters(request: Request):
        return await call(api.clusters, params(request))

    async def api_run(request: Request):
        return await call(lambda b, name, q: api.run_panel(b, name, q, memo),
                          request.path_params["panel"], params(request))

    async def api_task(request: Request):
        return await call(api.task, params(request))

    async def api_compare(request: Request):
        return await call(api.compare, params(request))

    async def not_found(request: Request, exc) -> Response:
        error = panels.NotFound(f"no page {request.url.path!r}")
        return error_json(error) if request.url.path.startswith("/api/") else error_page(error)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        backends.close()

    app = Starlette(
        debug=False,
        routes=[
            Route("/", html(clusters_page)),
            Route("/run", html(run_page)),
            Route("/worker", html(worker_page)),
            Route("/report", report_file),
            Route("/task", html(task_page)),
            Route("/compare", html(compare_page)),
            Route("/api", html(api_index)),
            Route("/api/clusters", json(api_clusters)),
            Route("/api/run/{panel}", json(api_run)),
            Route("/api/view/{name}", json(api_view)),
            Route("/api/task", json(api_task)),
            Route("/api/compare", json(api_compare)),
            Mount("/static", StaticFiles(directory=_bokeh_static()), name="static"),
        ],
        exception_handlers={404: not_found},
        lifespan=lifespan,
    )
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


def _all_span_names(backend: Backend) -> list[str]:
    _, rows = backend.query(
        f"SELECT DISTINCT arrayStringConcat(name, '/') AS n FROM {backend.database}.spans ORDER BY n")
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
