"""The worker producer: a WorkerPlugin publishing worker metrics and digests.

Every ``metrics-interval`` it publishes ``WORKER_METRICS`` (GIL contention when the
worker's system monitor measures it) and ``WORKER_DIGESTS``: the increase of every
``Worker.digests_total`` entry since the previous sample (Dask's fine performance
metrics, a task's own ``context_meter.digest_metric`` calls among them) as
:func:`digest_row` rows. What was published is remembered per Worker object, so a
replaced plugin never publishes the same increase twice.

``blackbox.producer.record`` leaves kinds out (``metrics``, ``fine-metrics``,
``logs``); with ``worker-transitions`` it also publishes the worker's own task
transitions (``TRANSITION`` with ``source="worker"``; Dask passes worker plugins no
stimulus id, so ``stimulus_id`` is null).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.spans import CONTEXTS_WITH_SPAN_ID
from tornado.ioloop import PeriodicCallback

from dask_blackbox.contract import (
    WORKER_DIGESTS, WORKER_METRICS, WorkerDigests, WorkerMetrics, encode_key,
)
from dask_blackbox.producers import logs
from dask_blackbox.producers.rows import Ready, TransitionItem
from dask_blackbox.producers.scheduler import PLUGIN_NAME
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import Transport

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

#: ``Worker.digests_total`` values already published, per Worker object.
_PUBLISHED_DIGESTS: weakref.WeakKeyDictionary[Worker, dict] = weakref.WeakKeyDictionary()


class BlackboxWorkerPlugin(WorkerPlugin):
    """Publishes one worker's metrics, digests (and optionally transitions).
    ``cluster_id``/``cluster_name``: the scheduler plugin's identity, if known where the
    plugin is built (:func:`producers.attach`); else learned from the scheduler."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, settings: ProducerSettings | None = None, cluster_id: str | None = None,
                 cluster_name: str | None = None):
        self.settings = settings if settings is not None else ProducerSettings.resolve()
        self.cluster_id = cluster_id
        self.cluster_name = cluster_name
        self.worker: Worker | None = None
        self.transport: Transport | None = None
        self._metrics: PeriodicCallback | None = None

    def __reduce__(self) -> tuple:
        """Only the settings (and the cluster's identity) travel."""
        return type(self), (self.settings, self.cluster_id, self.cluster_name)

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        record = self.settings.record
        self.transport = transport = Transport(
            self.settings, "worker", cluster_id=self.cluster_id,
            cluster_name=self.cluster_name or self.settings.cluster_name,
            worker=worker.address, scheduler=worker.scheduler)
        self._offer = transport.offer
        self._tasks_get = worker.state.tasks.get
        if record.logs:
            logs.install(transport, worker=worker.address)
        if record.metrics or record.fine_metrics:
            self._metrics = PeriodicCallback(self._sample,
                                             self.settings.metrics_interval * 1000)
            self._metrics.start()

    async def teardown(self, worker: Worker) -> None:
        """Last sample, then a flush bounded by ``close-timeout``."""
        transport = self.transport
        if transport is None:
            return
        if self._metrics is not None:
            self._metrics.stop()
            self._sample()
        logs.uninstall(transport)
        await transport.close()

    def _sample(self) -> None:
        record = self.settings.record
        try:
            if record.metrics:
                self._offer(Ready(self._metrics_event(), 400))
            rows = self._digest_rows() if record.fine_metrics else None
            if rows:
                digests: WorkerDigests = {
                    "kind": WORKER_DIGESTS, "ts": time.time(),
                    "worker": self.worker.address, "digests": rows,
                }
                self._offer(Ready(digests, 100 + 80 * len(rows)))
        except Exception:  # metrics must never break the worker
            logger.exception("dask-blackbox could not sample worker metrics")

    def _metrics_event(self) -> WorkerMetrics:
        w = self.worker
        recent = w.monitor.recent()
        memory = recent.get("memory")
        try:
            spilled = w.data.spilled_total.memory  # sizeof() of the spilled keys
        except AttributeError:  # spilling disabled
            spilled = 0
        # As Dask's MemoryState: managed is what sits in RAM, unmanaged the rest.
        managed = max(w.state.nbytes - spilled, 0)
        event: WorkerMetrics = {
            "kind": WORKER_METRICS,
            "ts": time.time(),
            "worker": w.address,
            "memory": memory,
            "memory_managed": managed,
            "memory_unmanaged": max(memory - managed, 0) if memory is not None else None,
            "memory_spilled": spilled,
            "cpu": recent.get("cpu"),
            "executing": w.state.executing_count,
            "ready": len(w.state.ready),
            "in_flight": w.state.in_flight_tasks_count,
            "event_loop_interval": w._tick_interval_observed,
            "gil_contention": recent.get("gil_contention"),
        }
        return event

    def _digest_rows(self) -> list[list]:
        """Increases of the ``Worker.digests_total`` entries since last published, as
        :func:`digest_row` rows."""
        published = _PUBLISHED_DIGESTS.setdefault(self.worker, {})
        rows = []
        for key, total in list(self.worker.digests_total.items()):
            delta = total - published.get(key, 0)
            if not delta:
                continue
            published[key] = total
            rows.append(digest_row(key, delta))
        return rows

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        if not self.settings.record.worker_transitions or self.transport is None:
            return
        ts = self._tasks_get(key)
        names = None if ts is None else (ts.prefix, None, ts.span_id)
        self._offer(TransitionItem(key, start, finish, None, time.time(), None, names))


def digest_row(key: Hashable, value: float) -> list:
    """A ``Worker.digests_total`` entry as ``[context, span_id, prefix, activity,
    unit, value]``: a key of a span-keyed context (``(context, span_id, prefix,
    activity, unit)``) maps one to one; another tuple key keeps its context (first),
    activity (second to last) and unit (last) and joins what lies between into
    ``prefix``; a key that is not a tuple (``"latency"``, ``"tick-duration"``,
    ``"transfer-bandwidth"``) is a context of its own, without a unit."""
    if not isinstance(key, tuple) or not key:
        return [_text(key), None, None, None, None, value]
    context, *rest = key
    span_id = rest.pop(0) if context in CONTEXTS_WITH_SPAN_ID and rest else None
    activity, unit = (rest[-2:] + [None, None])[:2]
    prefix = ".".join(map(encode_key, rest[:-2])) or None
    return [_text(context), _text(span_id), _text(prefix), _text(activity), _text(unit), value]


def _text(value: Any) -> str | None:
    return None if value is None else encode_key(value)


async def dask_setup(worker: Worker) -> None:
    """``dask worker --preload dask_blackbox.producers.worker``: attach the plugin, configured by
    this process's ``blackbox.*`` settings."""
    await worker.plugin_add(BlackboxWorkerPlugin(ProducerSettings.resolve()), name=PLUGIN_NAME)
