"""The nanny producer: a NannyPlugin recording how each worker process ended.

Dask has no hook for a worker process's end, and only the nanny sees it, so the plugin
watches: every :data:`WATCH_INTERVAL` it samples ``Nanny.process`` (its memory with
psutil, as the nanny's memory monitor does, and the host's) and, once that process has
ended, publishes one :class:`~dask_blackbox.contract.WorkerExit`. Whether the nanny killed
it for memory is in the ``worker-restart-memory`` event Dask logs on the scheduler (same
pid): the read side joins them. The nanny's own log lines are shipped, ``source`` "nanny".
"""

from __future__ import annotations

import logging
import re
import signal
import time
from typing import TYPE_CHECKING, Any

import dask.config
import psutil
from distributed.diagnostics.plugin import NannyPlugin
from tornado.ioloop import PeriodicCallback

from dask_blackbox.contract import WORKER_EXIT, WorkerExit
from dask_blackbox.producers import logs
from dask_blackbox.producers.rows import Ready
from dask_blackbox.producers.scheduler import PLUGIN_NAME
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import Transport

if TYPE_CHECKING:
    from distributed import Nanny

logger = logging.getLogger(__name__)

#: How often the plugin looks at the worker process (seconds).
WATCH_INTERVAL = 0.1
_MEMINFO = re.compile(rb"MemTotal:\s+(\d+).*?MemAvailable:\s+(\d+)", re.S)


class Watched:
    """The worker process being watched, and what was last seen of it."""

    __slots__ = ("process", "pid", "worker", "started", "memory", "memory_peak",
                 "host_total", "host_available", "_psutil")

    def __init__(self, process: Any):
        self.process = process
        self.pid = process.pid
        self.started = time.time()
        #: set once Dask's WorkerProcess says this process registered: until then its
        #: ``worker_address`` is still that of the process it replaces
        self.worker: str | None = None
        self.memory = self.memory_peak = self.host_total = self.host_available = None
        self._psutil: Any = None  # its psutil.Process, made at the first sample

    def sample(self) -> None:
        try:
            self._psutil = self._psutil or psutil.Process(self.pid)
            rss = self._psutil.memory_info().rss
        except Exception:  # gone already, or not ours to read
            return
        if not rss:  # a process that died and is not reaped yet (a zombie) has none
            return
        self.memory = rss
        self.memory_peak = max(self.memory_peak or 0, rss)
        try:  # psutil.virtual_memory()'s total and available, read cheaply
            with open("/proc/meminfo", "rb", buffering=0) as f:
                host = [int(kib) * 1024 for kib in _MEMINFO.search(f.read()).groups()]
        except (OSError, AttributeError):  # not Linux, or a kernel without MemAvailable
            host = psutil.virtual_memory()[:2]
        self.host_total, self.host_available = host


class BlackboxNannyPlugin(NannyPlugin):
    """Publishes a ``WORKER_EXIT`` per worker process its nanny ran (module docstring)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, settings: ProducerSettings | None = None, cluster_id: str | None = None,
                 cluster_name: str | None = None):
        self.settings = settings if settings is not None else ProducerSettings.resolve()
        self.cluster_id = cluster_id
        self.cluster_name = cluster_name
        self.nanny: Nanny | None = None
        self.transport: Transport | None = None
        self.watched: Watched | None = None
        #: the process whose end was published, not to watch again (Dask holds it a moment)
        self.ended: Any = None
        self.starts = 0  # worker processes this nanny started that were watched
        self._watch: PeriodicCallback | None = None

    def __reduce__(self) -> tuple:  # only the settings and the cluster's identity travel
        return type(self), (self.settings, self.cluster_id, self.cluster_name)

    async def setup(self, nanny: Nanny) -> None:
        self.nanny = nanny
        self.transport = transport = Transport(
            self.settings, "nanny", cluster_id=self.cluster_id,
            cluster_name=self.cluster_name or self.settings.cluster_name,
            scheduler=nanny.scheduler)
        if self.settings.record.logs:
            logs.install(transport, worker=lambda: nanny.worker_address)
        self._watch = PeriodicCallback(self.watch, WATCH_INTERVAL * 1000)
        self._watch.start()

    async def teardown(self, nanny: Nanny) -> None:
        transport = self.transport
        if transport is None:
            return
        if self._watch is not None:
            self._watch.stop()
        self.watch()
        logs.uninstall(transport)
        await transport.close()

    def watch(self) -> None:
        """Look at the worker process: sample it, or publish its end."""
        try:
            holder = self.nanny.process  # Dask's WorkerProcess, or None
            current = getattr(holder, "process", None)  # its AsyncProcess
            watched = self.watched
            if watched is not None and watched.process.exitcode is not None:
                self._publish_exit(watched)
                self.ended = watched.process
                self.watched = watched = None
            if current is None:  # none yet, or being replaced (its exit code comes later)
                return
            if watched is None:
                if current.pid is None or current is self.ended:
                    return
                self.watched = watched = Watched(current)
                self.starts += 1
            if (watched.worker is None and current is watched.process
                    and getattr(getattr(holder, "status", None), "name", None) == "running"):
                watched.worker = holder.worker_address
            watched.sample()
        except Exception:  # watching must never break the nanny
            logger.exception("dask-blackbox could not watch the worker process")

    def _publish_exit(self, watched: Watched) -> None:
        code = watched.process.exitcode
        memory_limit = getattr(getattr(self.nanny, "memory_manager", None), "memory_limit", None)
        terminate = dask.config.get("distributed.worker.memory.terminate", None)
        event: WorkerExit = {
            "kind": WORKER_EXIT, "ts": time.time(), "worker": watched.worker,
            "pid": watched.pid, "exitcode": code, "signal": signal_name(code),
            "memory": watched.memory, "memory_peak": watched.memory_peak,
            "memory_limit": memory_limit or None,
            "memory_terminate": terminate if isinstance(terminate, (int, float))
            and not isinstance(terminate, bool) else None,
            "host_memory": watched.host_total, "host_memory_available": watched.host_available,
            "nanny_status": getattr(getattr(self.nanny, "status", None), "name", None),
            "starts": self.starts, "started": watched.started,
        }
        self.transport.offer(Ready(event, 600))


def signal_name(exitcode: int | None) -> str | None:
    """``"SIGKILL"`` for an exit code of -9 (killed by a signal, Dask's and
    multiprocessing's convention); None for an exit status."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


async def dask_setup(nanny: Nanny) -> None:
    """``dask worker --preload-nanny dask_blackbox.producers.nanny``: attach the plugin,
    configured by this process's ``blackbox.*`` settings."""
    await nanny.plugin_add(BlackboxNannyPlugin(ProducerSettings.resolve()), name=PLUGIN_NAME)
