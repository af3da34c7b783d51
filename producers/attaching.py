"""Attaching the producers to a running cluster from a client: :func:`attach`, :func:`detach`."""

from __future__ import annotations

from typing import Any

from distributed.protocol.pickle import dumps

from dask_blackbox.producers.nanny import BlackboxNannyPlugin
from dask_blackbox.producers.scheduler import PLUGIN_NAME, BlackboxSchedulerPlugin
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.worker import BlackboxWorkerPlugin


def attach(client, cluster_name: str | None = None, **overrides: Any) -> dict:
    """Attach the scheduler, worker and nanny (on clusters with nannies) plugins to the
    cluster of ``client``; return the scheduler producer's ``{"cluster_id",
    "cluster_name", "producer_id"}`` (an awaitable with an asynchronous client).

    ``overrides`` (dotted, ``**{"producer.flush-interval": "50ms"}``, or nested,
    ``producer={"flush-interval": "50ms"}``) are resolved and validated here, on the
    client's Dask config (:meth:`ProducerSettings.resolve`). Plugins the cluster already
    has (an earlier ``attach`` or a ``--preload``) are left as they are.
    """
    settings = ProducerSettings.resolve(overrides, cluster_name=cluster_name)
    return client.sync(_attach, client, settings)


def detach(client) -> None:
    """Flush and remove the plugins :func:`attach` (or a preload) installed: workers
    flush in their plugin teardown; the scheduler plugin publishes ``scheduler_close``
    and flushes, bounded by ``close-timeout`` (as when the scheduler closes)."""
    return client.run_on_scheduler(_detach_on_scheduler)


async def _attach(client, settings: ProducerSettings) -> dict:
    await client.scheduler.register_scheduler_plugin(
        plugin=dumps(BlackboxSchedulerPlugin(settings)), name=PLUGIN_NAME, idempotent=True
    )
    identity = await client.run_on_scheduler(_scheduler_identity)
    if identity is None or identity["cluster_id"] is None:
        raise RuntimeError(f"the scheduler has no started {PLUGIN_NAME!r} plugin")
    known = {"cluster_id": identity["cluster_id"], "cluster_name": identity["cluster_name"]}
    await client.scheduler.register_worker_plugin(
        plugin=dumps(BlackboxWorkerPlugin(settings, **known)), name=PLUGIN_NAME, idempotent=True)
    await client.scheduler.register_nanny_plugin(
        plugin=dumps(BlackboxNannyPlugin(settings, **known)), name=PLUGIN_NAME, idempotent=True)
    return identity


def _scheduler_identity(dask_scheduler) -> dict | None:
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    return plugin.identity if isinstance(plugin, BlackboxSchedulerPlugin) else None


async def _detach_on_scheduler(dask_scheduler) -> None:
    # Preloaded plugins are not in worker_plugins / nanny_plugins: broadcast removals.
    dask_scheduler.worker_plugins.pop(PLUGIN_NAME, None)
    dask_scheduler.nanny_plugins.pop(PLUGIN_NAME, None)
    await dask_scheduler.broadcast(msg={"op": "plugin-remove", "name": PLUGIN_NAME})
    await dask_scheduler.broadcast(msg={"op": "plugin_remove", "name": PLUGIN_NAME}, nanny=True)
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, BlackboxSchedulerPlugin):
        dask_scheduler.remove_plugin(PLUGIN_NAME)
        await plugin.close()
