"""A worker's page's logs: the Run page's logs view (:mod:`.logs`) of that worker's
records and its nanny's."""

from __future__ import annotations

from dask_blackbox.read.views import logs
from dask_blackbox.read.views.registry import View, register

VIEW = register(View("worker_logs", "Logs", logs.data, "panel_logs.html", page="worker", order=50))
