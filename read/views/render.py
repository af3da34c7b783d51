"""The views drawn: one panel for the web page (:func:`render_view`), and every
panel of the Run page read for the report (:func:`run_data`, :func:`read_run`; the
report draws them as they arrive, :class:`Arrivals`)."""

from __future__ import annotations

import threading
from typing import Any

from dask_blackbox.read import backends, templates
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.queries import TimeBound
from dask_blackbox.read.views import registry
from dask_blackbox.read.views.page import Context, page_variables, span_names, summary
from dask_blackbox.read.views.registry import View
from dask_blackbox.read.views.scope import resolve


def render_view(name: str, ctx: Context, query_string: str = "") -> dict:
    """One panel for the web page: ``{"html": its fragment, "bokeh": null or
    {"docs_json": its Bokeh document as JSON text, "render_items": [...]}}`` -- what
    ``Bokeh.embed.embed_items`` draws into the fragment's figure divs."""
    from bokeh.core.json_encoder import serialize_json
    from bokeh.embed.util import OutputDocumentFor, standalone_docs_json_and_render_items

    from dask_blackbox.read.figures import Figures

    view = registry.views()[name]
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


def report_data(ctx: Context, views: tuple[View, ...] | None = None,
                arrivals: Arrivals | None = None) -> dict:
    """Every panel's data, merged (what the report draws), into ``arrivals`` if given."""
    arrivals = Arrivals() if arrivals is None else arrivals
    views = registry.run_views() if views is None else views
    head = summary(ctx)
    arrivals.add("head", {"scope": ctx.scope, "markers": ctx.markers(), "summary": head,
                          "history": head["history"]})
    for view in views:
        arrivals.add(view.name, view.data(ctx))
    return arrivals.data


def run_data(backend: Backend, cluster: str, span: str | None = None, since: TimeBound = None,
             until: TimeBound = None, level: str | None = None, worker: str | None = None,
             text: str | None = None, max_bars: int | None = None,
             slowness: bool | None = None, logger: str | None = None,
             arrivals: Arrivals | None = None) -> dict:
    """Every panel of the Run page (what :mod:`.report` draws): the data of each of
    :func:`.registry.run_views`, merged, with ``scope``,
    ``markers``, ``summary`` and ``span_names`` (last). ``slowness``: compute the critical
    path and the cost (default: when the scope holds at most
    :data:`.page.SLOWNESS_MAX_TASKS` tasks; otherwise those two panels say ``{"deferred":
    n_tasks}``). ``arrivals``: filled as the views are read."""
    arrivals = Arrivals() if arrivals is None else arrivals
    scope = resolve(backend, cluster, span, since, until)
    params = {"level": level, "worker": worker, "text": text, "logger": logger, "max_bars": max_bars}
    ctx = Context(backend, scope, params, slowness=slowness)
    report_data(ctx, arrivals=arrivals)
    arrivals.add("span_names", {"span_names": span_names(backend, scope)})
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
