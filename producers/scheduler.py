"""The scheduler producer: a SchedulerPlugin publishing what the scheduler sees.

Attach it with ``dask scheduler --preload dask_blackbox.producers.scheduler`` (configured by the
scheduler's own ``blackbox.*`` settings) or with :func:`producers.attach`.

What it publishes (contract kinds, see :data:`dask_blackbox.contract.EVENT_FIELDS`):

- ``TRANSITION`` for every call of :meth:`SchedulerPlugin.transition`, with the
  timestamp Dask recorded in ``Scheduler.transition_log`` (the one
  ``Scheduler.story`` shows), the task's prefix, group and span id, and what the
  transition carried (worker, nbytes, typename, startstops as Dask passed them,
  exception/traceback text capped at ``max-value-bytes``, cause);
- ``GRAPH`` per ``update_graph``; ``SPAN`` once per span of
  ``scheduler.extensions["spans"]``, parents first;
- ``EVENT`` for every ``log_event`` on any topic, with the timestamp Dask stored with
  it (what ``Client.get_events`` returns), the message sanitized
  (:func:`producers.encode.sanitize`) in the sender thread: the hook itself looks at
  nothing but exact builtin types, so a user's object cannot raise or stall there;
- ``LIFECYCLE`` for scheduler start/close, workers and clients added/removed, restart;
  scheduler_start, worker_added and worker_removed carry ``total_nthreads``, the
  entries of ``Scheduler.total_nthreads_history`` appended since the previous one of
  them (the whole history in scheduler_start);
- ``SCHEDULER_METRICS`` every ``metrics-interval``.

``transition`` is the hot path. Where ``producers/_hotpath.c`` was built
(``producer.compiled-hook``, on by default), the plugin's ``transition`` is a
``_hotpath.Hook``: for every transition without an error (all but erred ones), it
writes the transition's row to a tape, in ``marshal``'s format (the record's five
fields Dask just appended to ``Scheduler.transition_log``; processing->memory's
worker, nbytes, typename and startstops besides), and appends the task's
``TaskGroup`` to the buffer, which keeps the row's place: no Python object is
created or held for it, and the sender thread, or the relay's helper process,
decodes a frame's rows in one call (see ``bench/transition_hotpath.py
--callgrind``). Every other call reaches this method, which then offers the
transition as one tuple (never a record's fields: they would be out of the tape's
order). Without the compiled hook, this method does it all: a transition that
carried nothing but what Dask's log records (released->waiting,
waiting->processing, memory->released, ->forgotten: ~4 in 5) costs one dict lookup
and two deque appends of objects that exist already (the five fields of the log
record, then the task's ``TaskGroup``; see :mod:`producers.transport` for why not
the record itself). The others offer one tuple with the record's timestamp:
processing->memory its worker, nbytes, typename and startstops, taken out of Dask's
kwargs, an erred transition the kwargs themselves (its error is read in the sender
thread). Names are resolved and the event encoded later,
in the sender thread (the :class:`~producers.events.TransitionBuilder` the worker
plugin uses too makes rows of the others, and :class:`~producers.events.TransitionRuns`
encodes runs of rows); this is safe because a TaskGroup's name, prefix and span id
never change once the task is runnable.

``update_graph`` walks at most ``graph-max-tasks`` tasks of the graph on the event
loop (capturing keys, groups and dependencies before tasks can be forgotten);
everything else about a graph is built in the sender thread.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Hashable
from itertools import islice
from typing import TYPE_CHECKING, Any

import orjson
from distributed import scheduler as _dask_scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from dask_blackbox.contract import (
    EVENT, GRAPH, SCHEDULER_METRICS, SPAN, Graph, GraphTask, SchedulerMetrics, Span,
    StructuredEvent, encode_key,
)
from dask_blackbox.producers import logs
from dask_blackbox.producers.encode import sanitize
from dask_blackbox.producers.events import TransitionBuilder, lifecycle
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.relay import open_transport
from dask_blackbox.producers.transport import RECORD_FIELDS as _RECORD_FIELDS
from dask_blackbox.producers.transport import Transport, ready

try:
    from dask_blackbox.producers._hotpath import Hook as _CompiledHook
    from dask_blackbox.producers._hotpath import Tape as _Tape
except ImportError:  # built without a C compiler: the Python hook does it all
    _CompiledHook = _Tape = None

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

#: Name of the plugin on the scheduler (and of the worker plugin on the workers).
PLUGIN_NAME = "dask-blackbox"

#: Buffer weight estimate of one transition (the encoded event is ~300-500 bytes).
_TRANSITION_BYTES = 400
#: Distinct values listed per annotation in a GRAPH event.
_MAX_ANNOTATION_VALUES = 20
#: Share of an envelope one GRAPH event may take.
_GRAPH_EVENT_BYTES = 600_000

#: Lifecycle actions that carry the ``total_nthreads`` entries appended since the
#: previous one (the history changes only when a worker comes or goes).
_NTHREADS_ACTIONS = frozenset({"scheduler_start", "worker_added", "worker_removed"})

_TRAILING_TIME = re.compile(r"-[0-9.e+]+$")


class BlackboxSchedulerPlugin(SchedulerPlugin):
    """Publishes the scheduler's transitions, graphs, spans, events, lifecycle and
    metrics to Kafka through a :class:`~producers.transport.Transport`.

    Only ``settings`` travels when the plugin is pickled; the transport is created
    in :meth:`start`, in the scheduler process.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, settings: ProducerSettings | None = None):
        self.settings = settings if settings is not None else ProducerSettings.resolve()
        self.scheduler: Scheduler | None = None
        self.transport: Transport | None = None
        self._metrics: PeriodicCallback | None = None
        self._n_spans = 0
        self._n_nthreads = 0  # entries of total_nthreads_history already published
        self._removals: dict[str, dict] = {}
        # Until start() binds them to the scheduler and the transport, hooks called
        # on an unstarted plugin (scheduler.add_plugin on a running scheduler) are
        # no-ops rather than an exception per transition.
        self._offer = _discard
        self._tasks_get = _NO_TASKS.get
        self._transition_log: Any = ()
        self._records: Any = ()
        self._buffer: Any = ()
        self._push = self._push_fields = self._push_transition = _discard
        self._build_transition = self._build_graph = self._build_structured = None
        self._erred_bytes = _TRANSITION_BYTES

    def __getstate__(self) -> dict:
        return {"settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["settings"])

    @property
    def identity(self) -> dict[str, str | None]:
        """``cluster_id``, ``cluster_name`` and ``producer_id`` once started."""
        t = self.transport
        return {
            "cluster_id": t.cluster_id if t else None,
            "cluster_name": t.cluster_name if t else None,
            "producer_id": t.producer_id if t else None,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self, scheduler: Scheduler) -> None:
        if self.transport is not None:  # already running on this scheduler
            return
        self.scheduler = scheduler
        builder = TransitionBuilder(self.settings.max_value_bytes)
        self.transport = transport = open_transport(
            self.settings,
            "scheduler",
            cluster_id=scheduler.id,
            cluster_name=self.settings.cluster_name or scheduler.address,
            transition_builder=builder,
        )
        # Bound once: the hot path must not allocate bound methods per call.
        self._offer = transport.offer
        self._buffer = transport._buffer
        self._push = transport._buffer.append
        self._push_fields = transport._record_fields.extend
        self._push_transition = transport.push_transition
        self._tasks_get = scheduler.tasks.get  # Scheduler.tasks is never replaced
        self._transition_log = scheduler.transition_log
        # Records are buffered as they are only if Dask's are of their own tuple
        # type: the sender tells them from offered tuples by type.
        self._records = scheduler.transition_log if _RECORDS_TYPED else ()
        self._build_transition = builder.build
        if _CompiledHook is not None and self.settings.compiled_hook:
            # In C (producers/_hotpath.c): every transition without an error, its row
            # written to a tape; every other call handed to this method, which then
            # only offers items (a record's fields would be out of the tape's order).
            # Dask calls the instance's attribute.
            tape = _Tape()
            transport.use_tape(tape)
            self._records = ()
            self.transition = _CompiledHook(  # type: ignore[method-assign]
                scheduler.tasks, scheduler.transition_log, transport, transport._buffer,
                tape, transport._buffer.append, self.transition)
        self._build_graph = self._graph_event
        self._build_structured = self._structured_event
        self._erred_bytes = _TRANSITION_BYTES + 2 * self.settings.max_value_bytes

        # "start" of the recording: with attach() the scheduler may be older
        self._lifecycle("scheduler_start", detail={
            "address": scheduler.address,
            "scheduler_started": getattr(scheduler, "time_started", None),
            "n_workers": len(scheduler.workers),
            "versions": _versions(),
        })
        self._publish_event_backlog()
        self._publish_new_spans()
        logs.install(transport)
        self._metrics = PeriodicCallback(
            self._publish_metrics, self.settings.metrics_interval * 1000
        )
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

    # ------------------------------------------------------------------ hot path

    def transition(
        self,
        key: Hashable,
        start: str,
        finish: str,
        *args: Any,
        stimulus_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        records = self._records
        ts = self._tasks_get(key)
        if not kwargs and records and ts is not None:
            # Carried nothing extra: the record Dask just appended for this very
            # transition says it all (key, start, finish, stimulus_id, the time
            # Scheduler.story() shows); buffer its fields, then the group.
            t = self.transport
            if len(self._buffer) + t._held_events < t.room:
                self._push_fields(_RECORD_FIELDS(records[-1]))
                self._push(ts.group)
            else:
                self._push_transition(records[-1], ts.group)
            return
        log = self._transition_log
        # The timestamp of the record Dask just appended for this very transition,
        # the one Scheduler.story() shows (not the record: held for a linger, it
        # would reach the collector's oldest generation, see producers.transport).
        # time() if the log is disabled.
        stamp = log[-1][5] if log else time.time()
        group = None if ts is None else ts.group
        if _ERROR_KWARGS.isdisjoint(kwargs):
            # Dask's values taken out of its kwargs now (processing->memory: worker,
            # nbytes, typename, startstops), so that the kwargs dict is not held until
            # the hand-over: one object fewer for the collector's young generations.
            get = kwargs.get
            self._offer((
                self._build_transition, _TRANSITION_BYTES, key, start, finish, stimulus_id,
                get("worker"), get("nbytes"), get("typename"), get("startstops"), group, stamp,
            ))
            return
        self._offer((
            self._build_transition,
            self._erred_bytes if finish == "erred" else _TRANSITION_BYTES,
            key, start, finish, stimulus_id, kwargs, group, stamp,
        ))

    # ------------------------------------------------------------ graphs, spans

    def update_graph(
        self,
        scheduler: Scheduler,
        *,
        client: str,
        keys: set,
        tasks: list,
        annotations: dict[str, dict],
        priority: dict,
        stimulus_id: str,
        **kwargs: Any,
    ) -> None:
        # Spans of this graph were just created by the spans extension, and the
        # graph's transitions come right after this hook: publish spans first.
        self._publish_new_spans()
        cap = self.settings.graph_max_tasks
        get = scheduler.tasks.get
        # Captured now, on the event loop: tasks may be forgotten before the sender
        # thread builds the event. Names are resolved there.
        entries = [
            (key, ts.group, tuple(islice(ts.dependencies, cap)), len(ts.dependencies))
            for key in islice(tasks, cap)
            if (ts := get(key)) is not None
        ]
        self._offer((
            self._build_graph,
            200 + 200 * len(entries),
            time.time(), client, stimulus_id, len(tasks), len(keys),
            list(islice(keys, cap)), entries, annotations,
        ))

    def _graph_event(self, item: tuple) -> Graph:
        _, _, ts, client, stimulus_id, n_tasks, n_keys, keys, entries, annotations = item
        tasks: list[GraphTask] = []
        size = 0
        for key, tg, deps, n_deps in entries:
            entry: GraphTask = {
                "key": encode_key(key),
                "prefix": tg.prefix.name,
                "group": tg.name,
                "span_id": tg.span_id,
                "dependencies": [encode_key(d.key) for d in deps],
            }
            if n_deps > len(deps):
                entry["n_dependencies"] = n_deps  # type: ignore[typeddict-unknown-key]
            size += 80 + sum(len(v) for v in entry["dependencies"]) + 3 * len(entry["key"])
            if size > _GRAPH_EVENT_BYTES:
                break  # n_tasks still says how many there were
            tasks.append(entry)
        event: Graph = {
            "kind": GRAPH,
            "ts": ts,
            "client": client,
            "stimulus_id": stimulus_id,
            "n_tasks": n_tasks,
            "keys": [encode_key(k) for k in keys],
            "tasks": tasks,
            "annotations": self._annotation_summary(annotations),
            "n_keys": n_keys,
        }
        return event

    def _annotation_summary(self, annotations: dict[str, dict]) -> dict[str, list]:
        """``{annotation: [{"value", "n_tasks"}, ...]}``: the distinct values of each
        annotation (span, retries, resources, priority, users' own ...) with how many
        tasks of the graph carry them, most frequent first."""
        out = {}
        for name, per_key in annotations.items():
            counts: dict[Any, list] = {}
            for value in per_key.values():
                marker = _hashable(value)
                if marker in counts:
                    counts[marker][1] += 1
                else:
                    counts[marker] = [value, 1]
            ranked = sorted(counts.values(), key=lambda e: -e[1])[:_MAX_ANNOTATION_VALUES]
            out[str(name)] = [
                {"value": sanitize(v, self.settings.max_value_bytes)[0], "n_tasks": n}
                for v, n in ranked
            ]
        return out

    def _publish_new_spans(self) -> None:
        """A SPAN event per span the spans extension created since last call. Its
        ``spans`` dict is insertion-ordered and parents are created before their
        children, so parents are published first."""
        ext = self.scheduler.extensions.get("spans") if self.scheduler else None
        if ext is None or len(ext.spans) == self._n_spans:
            return
        for span in list(islice(ext.spans.values(), self._n_spans, None)):
            parent = span.parent
            event: Span = {
                "kind": SPAN,
                "ts": span.enqueued,
                "span_id": span.id,
                "name": [str(tag) for tag in span.name],
                "parent_id": parent.id if parent is not None else None,
                "enqueued": span.enqueued,
            }
            self._offer((ready, 300, event))
        self._n_spans = len(ext.spans)

    # ------------------------------------------------------------- events, life

    def log_event(self, topic: str, msg: Any) -> None:
        self._publish_event(topic, self._event_time(topic, msg), msg)
        # Only exact builtin types are looked at here, on the event loop: a user's
        # object may raise or stall on any attribute (its __class__ included).
        if type(msg) is dict and type(topic) is str and topic == "all" and (
            msg.get("action") == "remove-worker"
        ):
            # Scheduler.remove_worker logs this right before calling remove_worker
            # on plugins: keep it to say why and with what loss the worker left.
            self._removals[msg.get("worker")] = msg

    def _publish_event(self, topic: str, ts: float, msg: Any) -> None:
        """Offer the message as it is; it is sanitized in the sender thread
        (:meth:`_structured_event`), never on the event loop."""
        cap = self.settings.max_value_bytes
        t = type(msg)
        if t is str:
            weight = len(msg)
        elif t is dict or t is list or t is tuple:
            weight = 64 * len(msg)
        else:
            weight = 64
        self._offer((self._build_structured, 100 + min(weight, cap), ts, topic, msg))

    def _structured_event(self, item: tuple) -> StructuredEvent:
        _, _, ts, topic, msg = item
        clean, _ = sanitize(msg, self.settings.max_value_bytes)
        topic_text = topic if type(topic) is str else encode_key(topic)
        event: StructuredEvent = {"kind": EVENT, "ts": ts, "topic": topic_text, "msg": clean}
        return event

    def _publish_event_backlog(self) -> None:
        """The events Dask kept from before this plugin started (an ``attach`` to a
        running cluster), oldest first, so the stream holds what get_events holds."""
        backlog = [
            (ts, topic, msg)
            for topic, events in self.scheduler.get_events().items()
            for ts, msg in events
        ]
        backlog.sort(key=lambda e: e[0])
        for ts, topic, msg in backlog:
            self._publish_event(topic, ts, msg)

    def _event_time(self, topic: str, msg: Any) -> float:
        """The timestamp Dask stored with this event (what get_events returns)."""
        try:
            stored_time, stored_msg = self.scheduler._broker._topics[topic].events[-1]
            if stored_msg is msg:
                return stored_time
        except Exception:  # a Dask without the event broker, or events disabled
            pass
        return time.time()

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        detail = None
        if ws is not None:
            detail = {"name": encode_key(ws.name), "nthreads": ws.nthreads,
                      "memory_limit": ws.memory_limit, "pid": ws.pid}
        self._lifecycle("worker_added", worker=worker, detail=detail)

    def remove_worker(
        self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any
    ) -> None:
        removal = self._removals.pop(worker, None) or {}
        detail = {"expected": removal.get("expected")}
        for field in ("processing-tasks", "lost-computed-tasks", "lost-scattered-tasks"):
            if field in removal:
                detail[field.replace("-", "_")] = len(removal[field])
        self._lifecycle(
            "worker_removed", worker=worker, stimulus_id=stimulus_id,
            reason=_TRAILING_TIME.sub("", stimulus_id or "") or None, detail=detail,
        )

    def add_client(self, scheduler: Scheduler, client: str) -> None:
        self._lifecycle("client_added", client=client)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        self._lifecycle("client_removed", client=client)

    def restart(self, scheduler: Scheduler) -> None:
        self._lifecycle("restart")

    def _lifecycle(self, action: str, **fields: Any) -> None:
        if self.scheduler is None:  # not started: nothing to publish with yet
            return
        event = lifecycle(time.time(), action, **fields)
        size = 400
        if action in _NTHREADS_ACTIONS:
            event["total_nthreads"] = entries = self._new_nthreads_entries()
            size += 40 * len(entries)
        self._offer((ready, size, event))

    def _new_nthreads_entries(self) -> list[list]:
        """The entries ``[time, nthreads]`` Dask appended to
        ``Scheduler.total_nthreads_history`` since the previous call (all of them the
        first time). Dask appends before it calls the plugins' add_worker /
        remove_worker, so the entry of this very change is included."""
        history = self.scheduler.total_nthreads_history
        seen = self._n_nthreads if self._n_nthreads <= len(history) else 0
        self._n_nthreads = len(history)
        return [list(entry) for entry in history[seen:]]

    # ------------------------------------------------------------------ metrics

    def _publish_metrics(self) -> None:
        s = self.scheduler
        try:
            self._publish_new_spans()
            states: defaultdict[str, int] = defaultdict(int)
            for tp in s.task_prefixes.values():
                for state, n in tp.states.items():
                    if n and state != "forgotten":
                        states[state] += n
            memory = s.memory
            event: SchedulerMetrics = {
                "kind": SCHEDULER_METRICS,
                "ts": time.time(),
                "tasks_by_state": dict(states),
                "n_workers": len(s.workers),
                "n_threads": s.total_nthreads,
                "memory": memory.process,
                "memory_managed": memory.managed,
                "memory_unmanaged": memory.unmanaged,
                "memory_spilled": memory.spilled,
                "event_loop_interval": s._tick_interval_observed,
            }
            self._offer((ready, 500, event))
        except Exception:  # metrics must never break the scheduler
            logger.exception("dask-blackbox could not sample scheduler metrics")


_NO_TASKS: dict = {}

#: Dask's kwargs of an erred transition, which the sender thread reads (the
#: exception may come pickled): the item holds the kwargs as they are.
_ERROR_KWARGS = frozenset({"exception_text", "exception", "traceback_text", "cause"})

#: Whether Dask's ``transition_log`` records are of a type of their own (a
#: NamedTuple), which the sender tells from the tuples ``offer`` buffers.
_RECORDS_TYPED = (isinstance(_Transition := getattr(_dask_scheduler, "Transition", None), type)
                  and issubclass(_Transition, tuple) and _Transition is not tuple)


def _discard(*item: Any) -> None:
    """The offer of a plugin that has not started: nothing to publish with yet."""


def _hashable(value: Any) -> Any:
    """A hashable stand-in for an annotation value, equal for equal values."""
    try:
        hash(value)
        return value
    except TypeError:
        pass
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except Exception:
        return id(value)


def _versions() -> dict[str, str]:
    import dask
    import distributed

    import dask_blackbox

    return {"dask": dask.__version__, "distributed": distributed.__version__,
            "dask_blackbox": dask_blackbox.__version__}


def dask_setup(scheduler: Scheduler) -> None:
    """``dask scheduler --preload dask_blackbox.producers.scheduler``: attach the plugin, configured
    by this process's ``blackbox.*`` settings."""
    scheduler.add_plugin(
        BlackboxSchedulerPlugin(ProducerSettings.resolve()), name=PLUGIN_NAME, idempotent=True
    )
