"""The views the pages are made of, as the view modules register them.

Each module of :mod:`dask_blackbox.read.views` that is a view calls :func:`register`
with its :class:`View` when imported; the Run page, a worker's page, the report and
the JSON API take their lists of views from here (:func:`run_views`,
:func:`worker_views`, :func:`views`), each page in the order its views name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Bokeh loads when a panel is drawn, not when data is read
    from dask_blackbox.read.figures import Figures
    from dask_blackbox.read.views.page import Context

#: The pages views belong to.
PAGES = ("run", "worker")


@dataclasses.dataclass(frozen=True)
class View:
    """A panel: its ``name`` (its JSON API and its anchor), ``title`` (the
    navigation's), ``data`` (its data for a context, a dict merged into the page's),
    ``template`` and ``draw`` (adds its figures, returns variables for its template;
    it reads this view's data only). ``page`` ("run" or "worker") and ``order``
    place it on its page; ``about`` (what the JSON API's index says of it) and
    ``params`` (its own query parameters, as the index lists them) describe it in
    the JSON API (a Run page's view)."""

    name: str
    title: str
    data: Callable[[Context], dict]
    template: str
    draw: Callable[[Figures, dict, Context | None], dict] | None = None
    page: str = "run"
    order: int = 0
    about: str = ""
    params: str = ""


_REGISTERED: dict[str, View] = {}


def register(view: View) -> View:
    """Adds ``view`` to its page; a second view of the same name is an error."""
    if view.page not in PAGES:
        raise ValueError(f"view {view.name!r}: page must be one of {PAGES}, not {view.page!r}")
    if view.name in _REGISTERED and _REGISTERED[view.name] != view:
        raise ValueError(f"a view named {view.name!r} is registered already")
    _REGISTERED[view.name] = view
    return view


def _of(page: str) -> tuple[View, ...]:
    return tuple(sorted((v for v in _REGISTERED.values() if v.page == page),
                        key=lambda v: (v.order, v.name)))


def run_views() -> tuple[View, ...]:
    """The Run page's views, in the page's order."""
    return _of("run")


def worker_views() -> tuple[View, ...]:
    """A worker's page's views, in the page's order."""
    return _of("worker")


def views() -> dict[str, View]:
    """Every view by name: the Run page's, then a worker's page's."""
    return {v.name: v for v in (*run_views(), *worker_views())}


def number(value: Any, default: int) -> int:
    """A query parameter as an integer, ``default`` when missing or not one."""
    try:
        return int(value) if value not in (None, "") else default
    except (TypeError, ValueError):
        return default
