"""The panels of the Run page and of a worker's page, a module each: what each one
reads, how it is drawn, and where the page shows it.

A view module (``read/views/<name>.py``) holds its view's data (its queries of the
raw rows and, where the view has them, of the per-minute roll-ups, side by side), its
figures, and registers its :class:`~.registry.View` (its template, ``ui/<template>``,
a fragment of the page; its place on its page; what the JSON API says of it). Below
the view modules: :mod:`.scope` (which cluster, span and window a page shows) and
:mod:`.page` (what the views of a page share: its :class:`~.page.Context`, the
deaths and markers, the counts of the heading, the critical path). Above them:
:mod:`.registry` (the lists of views the pages and the API take) and :mod:`.render`.

The same views make three things:

- the web page: a light page (the run's heading, a navigation bar, the filters, a
  placeholder per view) whose script asks ``/api/view/<name>`` for each panel as it
  scrolls into view (:func:`render_view`: the fragment's HTML and the script that
  draws its figures, one Bokeh document per panel);
- the report (:func:`run_data`, drawn by :mod:`dask_blackbox.read.report`): every
  panel at once, one Bokeh document, one self-contained file;
- the JSON API (``/api/run/<name>``): a view's data.

Importing this package imports every view module in it (each registers itself), so
:data:`RUN_VIEWS`, :data:`WORKER_VIEWS` and :data:`VIEWS` hold them all.
"""

from __future__ import annotations

import importlib
import pkgutil

from dask_blackbox.read.views import registry
from dask_blackbox.read.views.page import Context, Memo, context, summary
from dask_blackbox.read.views.registry import View
from dask_blackbox.read.views.render import Arrivals, read_run, render_view, report_data, run_data

#: The modules of the package that are not views.
_SHARED = {"scope", "page", "registry", "render"}

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _SHARED:
        importlib.import_module(f"{__name__}.{_module.name}")

#: The Run page's views, in the page's order.
RUN_VIEWS: tuple[View, ...] = registry.run_views()
#: A worker's page's views, in order.
WORKER_VIEWS: tuple[View, ...] = registry.worker_views()
#: Every view by name.
VIEWS: dict[str, View] = registry.views()

__all__ = ["View", "Context", "Memo", "RUN_VIEWS", "WORKER_VIEWS", "VIEWS", "render_view",
           "report_data", "run_data", "read_run", "Arrivals", "summary", "context"]
