"""The scheduler producer: a SchedulerPlugin publishing what the scheduler sees.

It publishes (the kinds of :mod:`dask_blackbox.contract`, which specifies each;
``blackbox.producer.record`` leaves kinds out):

- ``TRANSITION`` per call of :meth:`SchedulerPlugin.transition`, stamped with the time
  Dask recorded in ``Scheduler.transition_log`` (the one ``Scheduler.story`` shows),
  with Dask's :data:`~dask_blackbox.contract.TRANSITION_KWARGS` and an erred
  transition's exception, traceback and cause;
- ``GRAPH`` per ``update_graph``, in parts; before it, ``SPAN`` once per new span of
  ``scheduler.extensions["spans"]``, parents first;
- ``EVENT`` per ``log_event`` on any topic, with the time Dask stored with it (what
  ``Client.get_events`` returns), from the events Dask kept before it started on;
- ``LIFECYCLE`` for scheduler start/close, workers and clients added/removed and
  restart;
- ``SCHEDULER_METRICS`` every ``metrics-interval``.

``transition`` is the hot path: one dict lookup, the time of the record Dask just
appended, one :class:`~producers.rows.TransitionItem` (what Dask passed as kwargs as the
MessagePack msgspec makes of them, bytes the collector never looks into, when it passed
any) and ``Buffer.offer``; nothing a user passes is looked at on the event loop.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable, Hashable
from itertools import islice
from typing import TYPE_CHECKING, Any, cast

import msgspec
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from dask_blackbox.contract import (
    LIFECYCLE, SCHEDULER_METRICS, SPAN, TRANSITION_KWARGS, Lifecycle, SchedulerMetrics, Span,
    encode_key,
)
from dask_blackbox.producers import logs
from dask_blackbox.producers.rows import (
    TRANSITION_WEIGHT, EventItem, GraphEntry, GraphItem, Ready, TransitionItem,
)
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import Transport

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

#: Name of the plugin on the scheduler (and of the worker and nanny plugins).
PLUGIN_NAME = "dask-blackbox"
#: A graph part's estimated bytes: per task, and per dependency; a part is cut at
#: :data:`GRAPH_PART_BYTES` (an envelope holds about three).
GRAPH_TASK_BYTES, GRAPH_DEPENDENCY_BYTES, GRAPH_PART_BYTES = 200, 60, 250_000
#: Dependencies listed per task, and keys the client asked for listed per graph (at
#: most graph-max-tasks; their true counts are recorded).
GRAPH_MAX_DEPENDENCIES = 3_000
GRAPH_MAX_KEYS = 1_000
#: Lifecycle actions that carry the ``total_nthreads`` entries appended since the
#: previous one (the history changes only when a worker comes or goes).
_NTHREADS_ACTIONS = frozenset({"scheduler_start", "worker_added", "worker_removed"})
_TRAILING_TIME = re.compile(r"-[0-9.e+]+$")
_NO_TASKS: dict = {}
_encode = msgspec.msgpack.Encoder().encode


def _discard(*args: Any, **kwargs: Any) -> None:
    """The hook of a kind not recorded, or of a plugin not started yet."""


class BlackboxSchedulerPlugin(SchedulerPlugin):
    """Publishes what the scheduler sees (module docstring) through a
    :class:`~producers.transport.Transport` made in :meth:`start`."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, settings: ProducerSettings | None = None):
        self.settings = settings if settings is not None else ProducerSettings.resolve()
        self.scheduler: Scheduler | None = None
        self.transport: Transport | None = None
        self._metrics: PeriodicCallback | None = None
        self._n_spans = 0
        self._n_nthreads = 0  # entries of total_nthreads_history already published
        self._removals: dict[Any, dict] = {}  # by the worker the event names
        # Until start() binds them, hooks called on an unstarted plugin
        # (scheduler.add_plugin on a running scheduler) do nothing.
        self._offer: Callable[[Any], Any] = _discard
        self._tasks_get: Callable[[Any], Any] = _NO_TASKS.get
        self._log: Any = ()
        self._erred_weight = TRANSITION_WEIGHT + 2 * self.settings.max_value_bytes

    def __reduce__(self) -> tuple:
        """Only the settings travel."""
        return type(self), (self.settings,)

    @property
    def identity(self) -> dict[str, str | None]:
        """``cluster_id``, ``cluster_name`` and ``producer_id`` once started."""
        i = self.transport.identity if self.transport else None
        return {name: getattr(i, name, None)
                for name in ("cluster_id", "cluster_name", "producer_id")}

    async def start(self, scheduler: Scheduler) -> None:
        if self.transport is not None:  # already running on this scheduler
            return
        self.scheduler = scheduler
        record = self.settings.record
        self.transport = transport = Transport(
            self.settings, "scheduler", cluster_id=scheduler.id,
            cluster_name=self.settings.cluster_name or scheduler.address)
        # Bound once: the hot path allocates no bound method per call.
        self._offer = transport.offer
        self._tasks_get = scheduler.tasks.get  # Scheduler.tasks is never replaced
        self._log = scheduler.transition_log
        if not record.transitions:  # Dask calls the instance's attribute
            self.transition = _discard  # type: ignore[method-assign]
        self._lifecycle("scheduler_start", detail={
            "address": scheduler.address,
            "scheduler_started": getattr(scheduler, "time_started", None),
            "n_workers": len(scheduler.workers), "versions": _versions(),
            # the workers there before the recording (attach to a running cluster)
            "workers": {address: _worker_detail(ws) for address, ws in scheduler.workers.items()}})
        if record.events:
            self._publish_event_backlog()
        self._publish_new_spans()
        if record.logs:
            logs.install(transport)
        if record.metrics:
            self._metrics = PeriodicCallback(self._publish_metrics,
                                             self.settings.metrics_interval * 1000)
            self._metrics.start()

    async def close(self) -> None:
        """Publish ``scheduler_close`` and flush, bounded by ``close-timeout``."""
        transport = self.transport
        if transport is None:
            return
        if self._metrics is not None:
            self._metrics.stop()
            self._publish_metrics()
        self._lifecycle("scheduler_close")
        logs.uninstall(transport)
        await transport.close()

    def transition(self, key: Hashable, start: str, finish: str, *args: Any,
                   stimulus_id: str | None = None, **kwargs: Any) -> None:
        ts = self._tasks_get(key)
        log = self._log
        # The time of the record Dask just appended for this very transition, the one
        # Scheduler.story() shows (time() if the log is off).
        stamp = log[-1][5] if log else time.time()
        group = None if ts is None else ts.group
        if finish == "erred" and "cause" not in kwargs:
            # a dependent erred for its dependency's error: Dask's exception_blame names it
            blamed = getattr(ts, "exception_blame", None)
            if blamed is not None and blamed is not ts:
                kwargs["cause"] = blamed.key
        if not kwargs:
            self._offer(TransitionItem(key, start, finish, stimulus_id, stamp, group))
            return
        carried: Any = tuple(map(kwargs.get, TRANSITION_KWARGS))
        try:  # held as bytes: the collector never sees Dask's objects (TransitionItem)
            carried = _encode(carried)
        except Exception:  # not encodable (never Dask's own values): the objects, as they are
            pass
        if finish != "erred":
            self._offer(TransitionItem(key, start, finish, stimulus_id, stamp, group, None,
                                       carried))
        else:
            self._offer(TransitionItem(key, start, finish, stimulus_id, stamp, group, None,
                                       carried, kwargs, self._erred_weight))

    def update_graph(self, scheduler: Scheduler, *, client: str, keys: set, tasks: list,
                     annotations: dict[str, dict], priority: dict, stimulus_id: str,
                     **kwargs: Any) -> None:
        # Spans of this graph were just created by the spans extension, and the
        # graph's transitions come right after this hook: publish spans first.
        self._publish_new_spans()
        if not self.settings.record.graphs:
            return
        get = scheduler.tasks.get
        # Captured now, on the event loop: tasks may be forgotten before the drain
        # makes the rows. Cut into parts of about GRAPH_PART_BYTES.
        parts: list[list[GraphEntry]] = [[]]
        weights = [0]
        for key in islice(tasks, self.settings.graph_max_tasks):
            if (ts := get(key)) is None:
                continue
            dependencies = ts.dependencies
            shown = tuple([d.key for d in islice(dependencies, GRAPH_MAX_DEPENDENCIES)])
            weight = GRAPH_TASK_BYTES + GRAPH_DEPENDENCY_BYTES * len(shown)
            if weights[-1] + weight > GRAPH_PART_BYTES and parts[-1]:
                parts.append([])
                weights.append(0)
            parts[-1].append(GraphEntry(key, ts.group, shown, len(dependencies)))
            weights[-1] += weight
        n_recorded = sum(map(len, parts))
        n_keys = min(len(keys), GRAPH_MAX_KEYS, self.settings.graph_max_tasks)
        now = time.time()
        for i, (entries, weight) in enumerate(zip(parts, weights)):
            first = i == 0
            self._offer(GraphItem(
                now, client, stimulus_id, len(tasks), n_recorded, len(keys),
                list(islice(keys, n_keys)) if first else [],
                annotations if first else None, entries, i, len(parts),
                200 + weight + (GRAPH_DEPENDENCY_BYTES * n_keys if first else 0)))

    def _publish_new_spans(self) -> None:
        """A SPAN event per span the spans extension created since the last call (its
        ``spans`` dict is insertion-ordered, parents before children)."""
        ext = self.scheduler.extensions.get("spans") if self.scheduler else None
        if ext is None or len(ext.spans) == self._n_spans:
            return
        for span in list(islice(ext.spans.values(), self._n_spans, None)):
            parent = span.parent
            event: Span = {"kind": SPAN, "ts": span.enqueued, "span_id": span.id,
                           "name": [str(tag) for tag in span.name],
                           "parent_id": parent.id if parent is not None else None,
                           "enqueued": span.enqueued}
            self._offer(Ready(event, 300))
        self._n_spans = len(ext.spans)

    def log_event(self, topic: str, msg: Any) -> None:
        if self.settings.record.events:
            self._publish_event(topic, self._event_time(topic, msg), msg)
        # Only exact builtin types are looked at here, on the event loop: a user's
        # object may raise or stall on any attribute (its __class__ included).
        if type(msg) is dict and type(topic) is str and topic == "all" and (
                msg.get("action") == "remove-worker"):
            # Scheduler.remove_worker logs this right before calling remove_worker on
            # plugins: kept to say why and with what loss the worker left.
            self._removals[msg.get("worker")] = msg

    def _publish_event(self, topic: str, ts: float, msg: Any) -> None:
        """Offer the message as it is: sanitized in the drain, never here."""
        cap = self.settings.max_value_bytes
        t = type(msg)
        if t is str:
            weight = len(msg)
        elif t is dict or t is list or t is tuple:
            weight = 64 * len(msg)
        else:
            weight = 64
        self._offer(EventItem(ts, topic, msg, 100 + min(weight, cap)))

    def _publish_event_backlog(self) -> None:
        """The events Dask kept from before this plugin started (an ``attach`` to a
        running cluster), oldest first, so the stream holds what get_events holds."""
        if self.scheduler is None:
            return
        backlog = [(ts, topic, msg) for topic, events in self.scheduler.get_events().items()
                   for ts, msg in events]
        for ts, topic, msg in sorted(backlog, key=lambda e: e[0]):
            self._publish_event(topic, ts, msg)

    def _event_time(self, topic: str, msg: Any) -> float:
        """The timestamp Dask stored with this event (what get_events returns)."""
        try:
            scheduler: Any = self.scheduler  # Dask's private event broker, when it has one
            stored_time, stored_msg = scheduler._broker._topics[topic].events[-1]
            if stored_msg is msg:
                return stored_time
        except Exception:  # a Dask without the event broker, or events disabled
            pass
        return time.time()

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        self._lifecycle("worker_added", worker=worker,
                        detail=None if ws is None else _worker_detail(ws))

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str,
                      **kwargs: Any) -> None:
        removal = self._removals.pop(worker, None) or {}
        detail = {"expected": removal.get("expected")}
        for field in ("processing-tasks", "lost-computed-tasks", "lost-scattered-tasks"):
            if field in removal:
                detail[field.replace("-", "_")] = len(removal[field])
        self._lifecycle("worker_removed", worker=worker, stimulus_id=stimulus_id,
                        reason=_TRAILING_TIME.sub("", stimulus_id or "") or None, detail=detail)

    def add_client(self, scheduler: Scheduler, client: str) -> None:
        self._lifecycle("client_added", client=client)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        self._lifecycle("client_removed", client=client)

    def restart(self, scheduler: Scheduler) -> None:
        self._lifecycle("restart")

    def _lifecycle(self, action: str, **fields: Any) -> None:
        if self.scheduler is None:  # not started: nothing to publish with yet
            return
        event = cast(Lifecycle, {"kind": LIFECYCLE, "ts": time.time(), "action": action,
                                 "worker": None, "client": None, "reason": None,
                                 "stimulus_id": None, "detail": None, **fields})
        weight = 400
        if action in _NTHREADS_ACTIONS:
            event["total_nthreads"] = entries = self._new_nthreads_entries()
            weight += 40 * len(entries)
        self._offer(Ready(event, weight))

    def _new_nthreads_entries(self) -> list[list]:
        """The entries ``[time, nthreads]`` Dask appended to
        ``Scheduler.total_nthreads_history`` since the previous call (all of them the
        first time; Dask appends before it calls add_worker / remove_worker)."""
        if self.scheduler is None:
            return []
        history = self.scheduler.total_nthreads_history
        seen = self._n_nthreads if self._n_nthreads <= len(history) else 0
        self._n_nthreads = len(history)
        return [list(entry) for entry in history[seen:]]

    def _publish_metrics(self) -> None:
        s = self.scheduler
        if s is None:  # not started
            return
        try:
            self._publish_new_spans()
            states: defaultdict[str, int] = defaultdict(int)
            for tp in s.task_prefixes.values():
                for state, n in tp.states.items():
                    if n and state != "forgotten":
                        states[state] += n
            memory = s.memory
            event: SchedulerMetrics = {
                "kind": SCHEDULER_METRICS, "ts": time.time(), "tasks_by_state": dict(states),
                "n_workers": len(s.workers), "n_threads": s.total_nthreads,
                "memory": memory.process, "memory_managed": memory.managed,
                "memory_unmanaged": memory.unmanaged, "memory_spilled": memory.spilled,
                "event_loop_interval": s._tick_interval_observed,
            }
            self._offer(Ready(event, 500))
        except Exception:  # metrics must never break the scheduler
            logger.exception("dask-blackbox could not sample scheduler metrics")


def _worker_detail(ws: Any) -> dict[str, Any]:
    """What a lifecycle event says of a worker: its name, threads, memory limit,
    process id and its nanny's address (None without a nanny)."""
    return {"name": encode_key(ws.name), "nthreads": ws.nthreads,
            "memory_limit": ws.memory_limit, "pid": ws.pid, "nanny": ws.nanny}


def _versions() -> dict[str, str]:
    import dask
    import distributed

    import dask_blackbox

    return {"dask": dask.__version__, "distributed": distributed.__version__,
            "dask_blackbox": dask_blackbox.__version__}


def dask_setup(scheduler: Scheduler) -> None:
    """``dask scheduler --preload dask_blackbox.producers.scheduler``: attach the plugin,
    configured by this process's ``blackbox.*`` settings."""
    scheduler.add_plugin(BlackboxSchedulerPlugin(ProducerSettings.resolve()),
                         name=PLUGIN_NAME, idempotent=True)
