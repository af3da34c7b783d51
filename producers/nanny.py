"""The nanny producer: a NannyPlugin recording how each worker process ended.

Dask has no hook for a worker process's end, and only the nanny sees it, so the plugin
watches: every :data:`WATCH_INTERVAL` it samples ``Nanny.process`` (its memory with
psutil, as the nanny's memory monitor does, and the host's) and, once that process has
ended, publishes one :class:`~dask_blackbox.contract.WorkerExit`. Whether the nanny killed
it for memory is in the ``worker-restart-memory`` event Dask logs on the scheduler (same
pid): the read side joins them. The nanny's own log lines are shipped, ``source`` "nanny".

What the process was doing, read from outside, when Dask's own profiler may have no
word for it: once its RSS passes :data:`STACKS_MEMORY_SHARE` of the memory at which
the nanny terminates it, or once its event loop has left the nanny's request (an
``identity`` call, every :data:`PING_INTERVAL`) unanswered for :data:`UNRESPONSIVE_S`
(a task holding the GIL stops the worker's heartbeats and its profiler alike), the
plugin reads the threads' stacks with py-spy (``py-spy dump --pid P --json``: the
worker is the nanny's child, so the nanny may trace it), once per episode (until the
worker answers again, or its RSS falls back below :data:`STACKS_REARM_SHARE` of that
mark) and at most :data:`READINGS_PER_REASON` times per process per reason (a first
task's imports may hold a worker's event loop for seconds too), in a thread of its own (the nanny's event loop never waits for it, nor longer
than :data:`STACKS_TIMEOUT_S` for py-spy), and publishes one
:class:`~dask_blackbox.contract.Stacks` (its ``error`` saying why, when py-spy read
nothing).

The process running when the plugin is set up is watched at once (so a worker that dies
right after ``attach`` returns has its record). Dask's ``Nanny.close`` removes its
plugins before it kills the process: a plugin torn down while its nanny closes
publishes that process's record then, with no exit code and ``nanny_status``
"closing" (the nanny's decision, an expected end).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from typing import TYPE_CHECKING, Any

import dask.config
import psutil
from distributed.diagnostics.plugin import NannyPlugin
from tornado.ioloop import PeriodicCallback

from dask_blackbox.contract import STACKS, WORKER_EXIT, Stacks, WorkerExit
from dask_blackbox.producers import logs
from dask_blackbox.producers.encode import cap_text
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
#: Of the memory at which the nanny terminates its worker (its memory limit times
#: ``distributed.worker.memory.terminate``), the share past which the worker's stacks
#: are read (0.95 of the limit when terminate is not a fraction).
STACKS_MEMORY_SHARE = 0.9
#: Of that mark, the share the RSS must fall back below before it is read again.
STACKS_REARM_SHARE = 0.9
#: Readings at most per worker process and reason.
READINGS_PER_REASON = 3
#: How often the nanny asks its worker's event loop for an answer (seconds).
PING_INTERVAL = 1.0
#: Seconds without an answer after which the worker is unresponsive and its stacks
#: are read (Dask warns of an unresponsive event loop at 3 s,
#: ``distributed.admin.tick.limit``).
UNRESPONSIVE_S = 3.0
#: Longest wait for py-spy's reading (seconds).
STACKS_TIMEOUT_S = 20.0
#: Frames kept of one thread's stack, the innermost (a deep recursion is cut).
STACK_MAX_FRAMES = 200
#: Longest text of one frame (``file:line:function``), in characters.
FRAME_MAX_CHARS = 400


class Watched:
    """The worker process being watched, and what was last seen of it."""

    __slots__ = ("process", "pid", "worker", "started", "memory", "memory_peak",
                 "host_total", "host_available", "_psutil", "read_for", "reading",
                 "ping_since", "ping_last")

    def __init__(self, process: Any):
        self.process = process
        self.pid = process.pid
        self.started = time.time()
        #: set once Dask's WorkerProcess says this process registered: until then its
        #: ``worker_address`` is still that of the process it replaces
        self.worker: str | None = None
        self.memory: int | None = None
        self.memory_peak: int | None = None
        self.host_total: int | None = None
        self.host_available: int | None = None
        self._psutil: Any = None  # its psutil.Process, made at the first sample
        #: how often its stacks were read, per reason ("memory", "unresponsive"), and
        #: the reasons whose episode is on and was read
        self.read_for: dict[str, int] = {}
        self.reading: set[str] = set()
        #: when the nanny's request now unanswered was sent, and the last one was
        #: (``time.monotonic()``)
        self.ping_since: float | None = None
        self.ping_last = 0.0

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
                found = _MEMINFO.search(f.read())
        except OSError:  # not Linux
            found = None
        if found is not None:
            host = [int(kib) * 1024 for kib in found.groups()]
        else:  # not Linux, or a kernel without MemAvailable
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
        self._pings: set[asyncio.Future] = set()

    def __reduce__(self) -> tuple:  # only the settings and the cluster's identity travel
        return type(self), (self.settings, self.cluster_id, self.cluster_name)

    async def setup(self, nanny: Nanny) -> None:
        self.nanny = nanny
        self.transport = transport = Transport(
            self.settings, "nanny", cluster_id=self.cluster_id,
            cluster_name=self.cluster_name or self.settings.cluster_name,
            scheduler=nanny.scheduler)
        if self.settings.record.logs:
            logs.install(transport, worker=lambda: nanny.worker_address, nanny=nanny)
        # The process running now is watched before setup returns (so before
        # ``attach`` does): a death in the first moments after attach has its record.
        self.watch()
        self._watch = PeriodicCallback(self.watch, WATCH_INTERVAL * 1000)
        self._watch.start()

    async def teardown(self, nanny: Nanny) -> None:
        transport = self.transport
        if transport is None:
            return
        if self._watch is not None:
            self._watch.stop()
        self.watch()
        watched = self.watched
        closing = getattr(getattr(nanny, "status", None), "name", "") in ("closing", "closed")
        if watched is not None and closing and watched.process.exitcode is None:
            # Dask's Nanny.close removes its plugins before it kills the process: the
            # nanny's decision is recorded now (no exit code yet, status closing)
            self._publish_exit(watched)
        logs.uninstall(transport)
        await transport.close()

    def watch(self) -> None:
        """Look at the worker process: sample it, or publish its end."""
        if self.nanny is None:  # not set up
            return
        try:
            holder: Any = self.nanny.process  # Dask's WorkerProcess, or None
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
            if current is watched.process:
                self._look_for_trouble(watched)
        except Exception:  # watching must never break the nanny
            logger.exception("dask-blackbox could not watch the worker process")

    def _look_for_trouble(self, watched: Watched) -> None:
        """Read the stacks of a process near the memory its nanny kills it at, or whose
        event loop does not answer; ask it for an answer now and then."""
        status = getattr(getattr(self.nanny, "status", None), "name", "")
        if status not in ("running", "init", "starting") or watched.process.exitcode is not None:
            return  # the nanny is closing it: an end it decided
        limit = getattr(getattr(self.nanny, "memory_manager", None), "memory_limit", None)
        if limit and watched.memory:
            mark = limit * (kill_fraction(self.nanny) or 0.95) * STACKS_MEMORY_SHARE
            if watched.memory > mark:
                self._read_stacks(watched, "memory", memory_limit=limit)
            elif watched.memory < mark * STACKS_REARM_SHARE:
                watched.reading.discard("memory")
        if watched.worker is None:  # not registered yet: nothing to ask
            return
        now = time.monotonic()
        if watched.ping_since is not None:
            silent = now - watched.ping_since
            if silent >= UNRESPONSIVE_S:
                self._read_stacks(watched, "unresponsive", memory_limit=limit, silent=silent)
        elif now - watched.ping_last >= PING_INTERVAL:
            watched.ping_since = watched.ping_last = now
            ping = asyncio.ensure_future(self._ping(watched))
            self._pings.add(ping)  # the loop holds its tasks weakly
            ping.add_done_callback(self._pings.discard)

    async def _ping(self, watched: Watched) -> None:
        """Ask the worker's event loop for an answer (its ``identity``)."""
        assert self.nanny is not None and watched.worker is not None
        try:
            await asyncio.wait_for(self.nanny.rpc(watched.worker).identity(), 60)
            watched.reading.discard("unresponsive")  # it answers again
        except (Exception, asyncio.CancelledError):  # gone, closing, or silent a minute
            pass
        finally:
            watched.ping_since = None

    def _read_stacks(self, watched: Watched, reason: str, memory_limit: int | None = None,
                     silent: float | None = None) -> None:
        """Read the stacks of ``watched`` with py-spy in a thread of its own, and
        publish them: once an episode, READINGS_PER_REASON times a process at most."""
        if reason in watched.reading or watched.read_for.get(reason, 0) >= READINGS_PER_REASON:
            return
        watched.reading.add(reason)
        watched.read_for[reason] = watched.read_for.get(reason, 0) + 1
        event: Stacks = {
            "kind": STACKS, "ts": time.time(), "worker": watched.worker, "pid": watched.pid,
            "reason": reason, "memory": watched.memory, "memory_limit": memory_limit or None,
            "silent": round(silent, 3) if silent is not None else None, "threads": [],
            "thread_ids": [], "stacks": [], "active": [], "gil": [], "error": None,
        }
        threading.Thread(target=self._publish_stacks, args=(event,), daemon=True,
                         name=f"dask-blackbox-stacks-{watched.pid}").start()

    def _publish_stacks(self, event: Stacks) -> None:
        try:
            threads, error = read_stacks(event["pid"])
            event["error"] = error
            for thread in threads:
                event["threads"].append(thread["name"])
                event["thread_ids"].append(thread["id"])
                event["stacks"].append(thread["stack"])
                event["active"].append(thread["active"])
                event["gil"].append(thread["gil"])
            transport = self.transport
            if transport is not None:
                transport.offer(Ready(event, 200 + sum(map(len, event["stacks"]))))
                transport.hurry()  # the process may not outlive it by long
        except Exception:  # reading stacks must never break the nanny
            logger.exception("dask-blackbox could not read the worker process's stacks")

    def _publish_exit(self, watched: Watched) -> None:
        if self.transport is None:  # torn down
            return
        code = watched.process.exitcode
        memory_limit = getattr(getattr(self.nanny, "memory_manager", None), "memory_limit", None)
        event: WorkerExit = {
            "kind": WORKER_EXIT, "ts": time.time(), "worker": watched.worker,
            "pid": watched.pid, "exitcode": code, "signal": signal_name(code),
            "memory": watched.memory, "memory_peak": watched.memory_peak,
            "memory_limit": memory_limit or None,
            "memory_terminate": kill_fraction(self.nanny),
            "host_memory": watched.host_total, "host_memory_available": watched.host_available,
            "nanny_status": getattr(getattr(self.nanny, "status", None), "name", None),
            "starts": self.starts, "started": watched.started,
        }
        self.transport.offer(Ready(event, 600))


def kill_fraction(nanny: Any) -> float | None:
    """The fraction of its memory limit at which ``nanny`` kills its worker (its memory
    manager's ``memory_terminate_fraction``, what Dask's own monitor uses), None when
    it is no fraction (``distributed.worker.memory.terminate`` false)."""
    manager = getattr(nanny, "memory_manager", None)
    fraction = getattr(manager, "memory_terminate_fraction",
                       dask.config.get("distributed.worker.memory.terminate", None))
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        return None
    return fraction


def py_spy() -> str | None:
    """The py-spy program: beside this Python's scripts (its environment's, then its
    base installation's), else on ``PATH``; None if there is none."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable),
                   os.path.join(sys.base_prefix, "bin")):
        candidate = os.path.join(folder, "py-spy")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("py-spy")


def read_stacks(pid: int, timeout: float = STACKS_TIMEOUT_S) -> tuple[list[dict], str | None]:
    """The threads of process ``pid`` as py-spy reads them (``py-spy dump --json``):
    each ``{"name", "id" (its OS thread id), "stack" (frames file:line:function, the
    line executing, from the outermost, joined by ";"), "active", "gil"}``; and the
    error when it read none (py-spy missing, refused, gone quiet, the process ended)."""
    program = py_spy()
    if program is None:
        return [], "py-spy is not installed (pip install py-spy)"
    try:
        out = subprocess.run([program, "dump", "--pid", str(pid), "--json"],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], f"py-spy read nothing in {timeout:g} s"
    except OSError as e:
        return [], f"py-spy could not run: {e}"
    if out.returncode != 0:
        said = (out.stderr or out.stdout).split("Stack backtrace")[0].split("Caused by")[0]
        said = " ".join(said.split()) or f"exit status {out.returncode}"
        return [], cap_text(f"py-spy: {said}", FRAME_MAX_CHARS)
    try:
        dumped = json.loads(out.stdout)
    except ValueError:
        return [], cap_text(f"py-spy wrote no JSON: {' '.join(out.stdout.split())}", FRAME_MAX_CHARS)
    threads = []
    for thread in dumped if isinstance(dumped, list) else ():
        frames = [frame_text(f.get("filename") or "?", f.get("name") or "?", f.get("line") or 0)
                  for f in (thread.get("frames") or [])[:STACK_MAX_FRAMES] if isinstance(f, dict)]
        threads.append({
            "name": str(thread.get("thread_name") or ""),
            "id": int(thread.get("os_thread_id") or thread.get("thread_id") or 0) % 2**64,
            "stack": ";".join(reversed(frames)),  # py-spy lists the innermost first
            "active": bool(thread.get("active")), "gil": bool(thread.get("owns_gil"))})
    return threads, None if threads else "py-spy read no thread"


def frame_text(filename: str, name: str, line: int) -> str:
    """``file:line:function``, its separators (``;``, line breaks) replaced, at most
    FRAME_MAX_CHARS characters."""
    text = f"{filename}:{line}:{name}"
    if ";" in text or "\n" in text or "\r" in text:
        text = text.replace(";", ",").replace("\r", " ").replace("\n", " ")
    return cap_text(text, FRAME_MAX_CHARS)


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
