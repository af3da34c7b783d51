"""The web UI: a small ASGI application (Starlette, served by uvicorn) over the
recorded history.

Pages (HTML, Jinja2 templates in ``ui/`` with autoescaping on; charts are Bokeh
documents embedded with ``bokeh.embed.file_html``, BokehJS served from the bokeh
package under ``/static``):

``/``                    Clusters: every recorded cluster, filterable by name and time.
``/run?cluster=``        Run: the panels of :mod:`.panels` (``span``, ``since``,
                         ``until``; logs also ``level``, ``worker``, ``text``).
``/report?cluster=``     the same page as a self-contained HTML file to download.
``/task?cluster=&key=``  Task: story, metrics and logs around it, dependencies.
``/compare?span=``       Compare: one span across runs and clusters.
``/api``                 the JSON API's endpoints (:mod:`.api`).

An unknown cluster, span or key answers 404 with a page naming it; a bad parameter
400; a ClickHouse failure 502 -- never a stack trace.
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

from dask_blackbox.read import api, panels, report
from dask_blackbox.read.backends import Backend

logger = logging.getLogger("dask_blackbox.read.web")


def _bokeh_static() -> str:
    from bokeh.util.paths import bokehjs_path

    return str(bokehjs_path())


def create_app(connect: Callable[[], Backend] | None = None) -> Starlette:
    """The ASGI app. ``connect`` returns the backend (default
    :func:`dask_blackbox.read.backends.connect`), called on the first request."""
    if connect is None:
        from dask_blackbox.read.backends import connect
    backends = api.Backends(connect)

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

    async def clusters_page(request: Request) -> str:
        q = params(request)
        data = await call(api.clusters, q)
        return report.render_page("clusters.html", clusters=data["clusters"], query=q,
                                  page_title="Clusters - dask-blackbox", generated=0)

    def _run_data(backend: Backend, q: dict) -> dict:
        f = api.filters(q)
        if not f["cluster"]:
            raise api.BadParameter("cluster is required: a cluster name or id")
        level = api._opt(q, "level")
        if level and level.upper() not in panels.LEVELS:
            raise api.BadParameter(f"level must be one of {', '.join(panels.LEVELS)}, not {level!r}")
        return panels.run_data(backend, f["cluster"], f["span"], f["since"], f["until"],
                               level=level, worker=api._opt(q, "worker"), text=api._opt(q, "text"),
                               logger=api._opt(q, "logger"),
                               slowness=True if api._opt(q, "slowness") else None)

    async def run_page_wrapped(request: Request) -> Response:
        try:
            q = params(request)
            data = await call(_run_data, q)
            query_string = urllib.parse.urlencode(
                {k: v for k, v in q.items() if k in ("cluster", "span", "since", "until") and v})
            page = await run_in_threadpool(_render_run, data, _root(request), q, query_string)
            return HTMLResponse(page)
        except Exception as e:
            return error_page(e)

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

    async def task_page(request: Request) -> str:
        q = params(request)
        data = await call(api.task, q)
        return report.render_page("task.html", t=data, query=q, generated=0,
                                  page_title=f"{data['key']} - dask-blackbox")

    async def compare_page(request: Request) -> str:
        q = params(request)
        if not api._opt(q, "span") and not api._opt(q, "cluster"):
            names = await call(_all_span_names)
            return report.render_page("compare.html", cmp=None, spans=names, query=q, generated=0,
                                      page_title="Compare - dask-blackbox")
        data = await call(api.compare, q)
        figures = report.compare_figures(data)
        return report.render_page("compare.html", figures=figures, root_url=_root(request), cmp=data,
                                  spans=[], query=q, generated=0,
                                  page_title=f"Compare {data['span'] or data['cluster']} - dask-blackbox")

    async def api_index(request: Request) -> str:
        return report.render_page("api.html", endpoints=api.ENDPOINTS, query={}, generated=0,
                                  page_title="JSON API - dask-blackbox")

    async def api_clusters(request: Request):
        return await call(api.clusters, params(request))

    async def api_run(request: Request):
        return await call(api.run_panel, request.path_params["panel"], params(request))

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
            Route("/run", run_page_wrapped),
            Route("/report", report_file),
            Route("/task", html(task_page)),
            Route("/compare", html(compare_page)),
            Route("/api", html(api_index)),
            Route("/api/clusters", json(api_clusters)),
            Route("/api/run/{panel}", json(api_run)),
            Route("/api/task", json(api_task)),
            Route("/api/compare", json(api_compare)),
            Mount("/static", StaticFiles(directory=_bokeh_static()), name="static"),
        ],
        exception_handlers={404: not_found},
        lifespan=lifespan,
    )
    return app


def _root(request: Request) -> str:
    return str(request.base_url)


def _render_run(data: dict, root_url: str, q: dict, query_string: str) -> str:
    return report.render_run(data, web=True, root_url=root_url, query=q, query_string=query_string)


def _all_span_names(backend: Backend) -> list[str]:
    _, rows = backend.query(
        f"SELECT DISTINCT arrayStringConcat(name, '/') AS n FROM {backend.database}.spans ORDER BY n")
    return [r[0] for r in rows]


def serve(host: str = "127.0.0.1", port: int = 8787, connect: Callable[[], Backend] | None = None,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve the UI until interrupted (uvicorn). ``ready(url)`` is called once it listens."""
    import uvicorn

    config = uvicorn.Config(create_app(connect), host=host, port=port, log_level="warning",
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
