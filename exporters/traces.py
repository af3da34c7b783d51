"""A recorded run as an OpenTelemetry trace: contract records in, :mod:`.model` out.

The same functions serve the continuous exporter (records as they arrive on Kafka)
and ``dask-blackbox export otlp`` (records read back from ClickHouse, through
:func:`build_run`), so a run exported either way is the same trace with the same ids
(:mod:`.ids`).

The trace of a run (one Dask cluster):

- **the run span** (root): ``run <cluster name>``, from the first to the last thing
  recorded; worker deaths (removals whose cause, :mod:`dask_blackbox.causes`, is not
  an expected end) are its events ``dask.worker.death`` (:func:`death_event`: the
  worker, the removal's reason, tasks it was running, results lost, and the cause
  with its confidence and explanation); when task spans were capped its attributes
  say so (``dask.task_spans.*``) and an event ``dask.task_spans.capped`` states how
  many actions were summarised;
- **one span per Dask span** (``distributed.spans.Span``), child of its parent span
  or of the run span, named by its last tag, from ``Span.start`` to ``Span.stop``
  (``enqueued`` while no task finished), with Dask's numbers as attributes:
  ``dask.span.id``, ``dask.span.name`` (the tags), ``dask.span.tasks`` and
  ``dask.span.states.<state>``, ``dask.span.nbytes_total``,
  ``dask.span.task_seconds`` (``Span.duration``), ``dask.span.seconds.<action>``
  (``all_durations``), ``dask.span.done``, ``dask.span.active_cpu_seconds``; an
  erred task is an ``exception`` event on its span (OpenTelemetry's exception
  conventions: ``exception.type``, ``exception.message``, ``exception.stacktrace``,
  plus ``dask.task.key`` and ``dask.task.cause``); at most :data:`MAX_EVENTS` events
  a span, ``dask.events.dropped`` counting the rest;
- **one span per task action** (each ``startstops`` entry Dask reported: compute,
  transfer, disk-read, disk-write), child of the task's Dask span (the run span for
  a task without one), named ``<action> <prefix>``, with ``dask.task.key``,
  ``dask.task.prefix``, ``dask.task.group``, ``dask.task.action``,
  ``dask.task.state`` (memory or erred), ``dask.worker.address``, ``thread.id`` (the
  worker thread that ran a compute, when recorded), ``dask.transfer.source``, ``dask.task.nbytes``,
  ``dask.task.typename``; an erred task's actions have status ERROR. At most
  ``max-task-spans`` of them per trace (:class:`TaskCap`); the rest become one
  summary span per prefix and action (``<action> <prefix> (summary)``: how many,
  their seconds, first start to last stop);
- **one span per task running when its worker died** (it reported no ``startstops``:
  :func:`died_spans`), named ``died <prefix>``, from its last entry into processing to
  the transition its worker's removal made of it, status ERROR ("running when its
  worker died: <cause>"), ``dask.task.action`` "died", with the key, prefix, group and
  the dead worker's address, child of the task's Dask span; the read side draws the
  same tasks hatched on its time axes. They are not capped (a death ends at most the
  few tasks its worker was running);
- the resource names the cluster (:func:`resource_attributes`).

Span kinds are INTERNAL; names are low-cardinality (no keys in them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from dask_blackbox.causes import Classified, LeftProcessing

from . import ids
from .model import LogData, Resource, SpanData, SpanEvent

#: The root span's name is this and the cluster's name.
RUN_SPAN = "run"
#: Events kept per span (OpenTelemetry's default span event count limit), the
#: earliest; ``dask.events.dropped`` counts the rest. An export request stays small
#: however many tasks of a span erred.
MAX_EVENTS = 128
#: Severity numbers of OpenTelemetry's log data model, by Python level name.
SEVERITY = {"DEBUG": 5, "INFO": 9, "WARNING": 13, "WARN": 13, "ERROR": 17, "CRITICAL": 21,
            "FATAL": 21}
_EXCEPTION_TYPE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*\(")


def ns(seconds: float) -> int:
    """Seconds since the epoch as nanoseconds, through whole microseconds (what
    ClickHouse stores), so both sources give the same times."""
    return ids.micros(seconds) * 1000


def trace_hex(cluster_id: str) -> str:
    return f"{ids.trace_id(cluster_id):032x}"


def resource_attributes(cluster_id: str, cluster_name: str | None) -> dict[str, Any]:
    """The resource of a run: OpenTelemetry's service attributes name the cluster
    (``service.name`` its name, ``service.instance.id`` the scheduler's id,
    ``service.namespace`` "dask"), plus ``dask.cluster.id`` and ``dask.cluster.name``."""
    name = cluster_name or cluster_id
    return {"service.name": name, "service.namespace": "dask",
            "service.instance.id": cluster_id, "dask.cluster.id": cluster_id,
            "dask.cluster.name": name}


def resource(cluster_id: str, cluster_name: str | None) -> Resource:
    return Resource(cluster_id, resource_attributes(cluster_id, cluster_name))


def _parent(cluster_id: str, span_id: str | None) -> int:
    return ids.dask_span_id(cluster_id, span_id) if span_id else ids.run_span_id(cluster_id)


def task_spans(cluster_id: str, tr: Mapping[str, Any]) -> list[SpanData]:
    """The task spans of a TRANSITION: one per ``startstops`` entry (none for a
    transition without)."""
    out = []
    key, prefix = tr["key"], tr.get("prefix") or ""
    finish = tr.get("finish") or ""
    ts_us = ids.micros(tr["ts"])
    parent = _parent(cluster_id, tr.get("span_id"))
    error = None
    if finish == "erred":
        error = tr.get("exception") or "erred"
    trace = trace_hex(cluster_id)
    for i, ss in enumerate(tr.get("startstops") or ()):
        action = ss.get("action") or "unknown"
        start, stop = ns(ss["start"]), ns(ss["stop"])
        attributes: dict[str, Any] = {
            "dask.task.key": key, "dask.task.prefix": prefix,
            "dask.task.group": tr.get("group") or "", "dask.task.action": action,
            "dask.task.state": finish, "dask.worker.address": tr.get("worker") or "",
        }
        if tr.get("thread") is not None and action == "compute":
            attributes["thread.id"] = int(tr["thread"])  # the thread that ran it
        if ss.get("source"):
            attributes["dask.transfer.source"] = ss["source"]
        if tr.get("nbytes") is not None:
            attributes["dask.task.nbytes"] = int(tr["nbytes"])
        if tr.get("typename"):
            attributes["dask.task.typename"] = tr["typename"]
        out.append(SpanData(trace, ids.task_span_id(cluster_id, key, ts_us, i), parent,
                            f"{action} {prefix}" if prefix else action, start, max(stop, start),
                            attributes, [], error))
    return out


#: What a scheduler transition out of processing into one of these is: a finish (a
#: transition into erred may be a death's doing: a KilledWorker).
FINISHED = frozenset({"memory"})
DIED = "died"


def died_span(cluster_id: str, task: LeftProcessing, death: Classified) -> SpanData:
    """A task running when its worker died (``death``), as a span."""
    attributes: dict[str, Any] = {
        "dask.task.key": task.key, "dask.task.prefix": task.prefix,
        "dask.task.group": task.group, "dask.task.action": DIED,
        "dask.task.state": DIED, "dask.worker.address": death.removal.worker,
        "dask.stimulus_id": task.stimulus_id,
    }
    start, stop = ns(task.entered), ns(task.left)
    return SpanData(trace_hex(cluster_id), ids.task_span_id(cluster_id, task.key,
                                                            ids.micros(task.left), 0),
                    _parent(cluster_id, task.span_id),
                    f"{DIED} {task.prefix}" if task.prefix else DIED, start, max(stop, start),
                    attributes, [],
                    f"running when its worker died: {death.verdict.cause.label}")


def died_spans(cluster_id: str, left: Iterable[LeftProcessing],
               removals: Iterable[Classified]) -> list[SpanData]:
    """The spans of the tasks that left processing by a removal that was a death."""
    deaths = {d.removal.stimulus_id: d for d in removals if d.is_death}
    return [died_span(cluster_id, t, deaths[t.stimulus_id]) for t in left
            if t.stimulus_id in deaths]


def error_event(tr: Mapping[str, Any]) -> SpanEvent:
    """An erred TRANSITION as an ``exception`` event (for the task's Dask span)."""
    text = tr.get("exception") or ""
    kind = _EXCEPTION_TYPE.match(text)
    attributes = {"exception.type": kind.group(1) if kind else "", "exception.message": text,
                  "exception.stacktrace": tr.get("traceback") or "",
                  "dask.task.key": tr["key"], "dask.task.cause": tr.get("cause") or "",
                  "dask.worker.address": tr.get("worker") or ""}
    return SpanEvent("exception", ns(tr["ts"]), attributes)


def death_event(death: Classified) -> SpanEvent:
    """A worker's death (a removal and its verdict) as a ``dask.worker.death`` event at
    the removal's time: ``dask.worker.address``, ``dask.worker.removal.reason`` (Dask's
    reason, else its stimulus), ``dask.stimulus_id``, ``dask.worker.processing_tasks``,
    ``dask.worker.lost_computed_tasks``, ``dask.worker.lost_scattered_tasks``, and the
    verdict: ``dask.worker.death.cause`` (:class:`~dask_blackbox.causes.Cause`'s value,
    e.g. "killed"), ``dask.worker.death.cause_label`` ("killed by the OS"),
    ``dask.worker.death.confidence`` (high, medium, low) and
    ``dask.worker.death.explanation`` (why, in one line)."""
    r, v = death.removal, death.verdict
    return SpanEvent("dask.worker.death", ns(r.ts), {
        "dask.worker.address": r.worker,
        "dask.worker.removal.reason": r.reason or r.stimulus_id,
        "dask.stimulus_id": r.stimulus_id,
        "dask.worker.processing_tasks": r.processing_tasks,
        "dask.worker.lost_computed_tasks": r.lost_computed_tasks,
        "dask.worker.lost_scattered_tasks": r.lost_scattered_tasks,
        "dask.worker.death.cause": v.cause.value,
        "dask.worker.death.cause_label": v.cause.label,
        "dask.worker.death.confidence": v.confidence,
        "dask.worker.death.explanation": v.explanation,
    })


def _limit(events: list[SpanEvent], attributes: dict[str, Any]) -> list[SpanEvent]:
    """The first :data:`MAX_EVENTS` events (by time; the last kept if it is the
    capping notice), counting the others in ``dask.events.dropped``."""
    if len(events) <= MAX_EVENTS:
        return events
    attributes["dask.events.dropped"] = len(events) - MAX_EVENTS
    notice = [e for e in events if e.name == "dask.task_spans.capped"]
    kept = [e for e in events if e.name != "dask.task_spans.capped"][:MAX_EVENTS - len(notice)]
    return kept + notice


def span_times(state: Mapping[str, Any]) -> tuple[float, float]:
    """A Dask span's (start, stop) in seconds: ``enqueued`` until a task finished."""
    start = state.get("start") or 0.0
    if not start or start <= 0:
        start = state["enqueued"]
    stop = state.get("stop") or 0.0
    return start, max(stop, start)


def dask_span(cluster_id: str, state: Mapping[str, Any],
              events: Iterable[SpanEvent] = ()) -> SpanData:
    """A SPAN_STATE record (or a SPAN event, which has no numbers yet) as a span."""
    start, stop = span_times(state)
    name = list(state.get("name") or ())
    states = {k: int(v) for k, v in (state.get("states") or {}).items()}
    attributes: dict[str, Any] = {"dask.span.id": state["span_id"], "dask.span.name": name}
    if "version" in state:
        attributes.update({
            "dask.span.tasks": sum(states.values()),
            "dask.span.nbytes_total": int(state.get("nbytes_total") or 0),
            "dask.span.task_seconds": float(state.get("duration") or 0.0),
            "dask.span.done": bool(state.get("done")),
            "dask.span.active_cpu_seconds": float(state.get("active_cpu_seconds") or 0.0),
        })
        attributes.update({f"dask.span.states.{k}": v for k, v in states.items()})
        attributes.update({f"dask.span.seconds.{k}": float(v)
                           for k, v in (state.get("all_durations") or {}).items()})
    events = sorted(events, key=lambda e: e.time_ns)
    erred = [e for e in events if e.name == "exception"]
    events = _limit(events, attributes)
    return SpanData(trace_hex(cluster_id), ids.dask_span_id(cluster_id, state["span_id"]),
                    _parent(cluster_id, state.get("parent_id")),
                    name[-1] if name else state["span_id"], ns(start), ns(stop), attributes,
                    events, f"{len(erred)} task(s) erred" if erred else None)


class TaskCap:
    """At most ``limit`` task spans per trace; the actions beyond are summarised per
    (prefix, action): how many, their seconds, first start, last stop."""

    def __init__(self, limit: int, admitted: int = 0) -> None:
        self.limit = limit
        self.admitted = admitted
        #: (prefix, action) -> [actions, seconds, first start ns, last stop ns]
        self.summaries: dict[tuple[str, str], list] = {}

    def admit(self, span: SpanData) -> bool:
        """True if ``span`` is to be exported; else it is added to the summaries."""
        if self.admitted < self.limit:
            self.admitted += 1
            return True
        key = (str(span.attributes.get("dask.task.prefix", "")),
               str(span.attributes.get("dask.task.action", "")))
        s = self.summaries.setdefault(key, [0, 0.0, span.start_ns, span.end_ns])
        s[0] += 1
        s[1] += (span.end_ns - span.start_ns) / 1e9
        s[2] = min(s[2], span.start_ns)
        s[3] = max(s[3], span.end_ns)
        return False

    @property
    def summarised(self) -> int:
        return sum(s[0] for s in self.summaries.values())


def summary_spans(cluster_id: str, summaries: Mapping[tuple[str, str], list]) -> list[SpanData]:
    """One span per (prefix, action) whose actions were not exported one by one."""
    trace, root = trace_hex(cluster_id), ids.run_span_id(cluster_id)
    return [SpanData(trace, ids.summary_span_id(cluster_id, prefix, action), root,
                     f"{action} {prefix} (summary)".strip(), first, last,
                     {"dask.task.prefix": prefix, "dask.task.action": action,
                      "dask.summary.actions": n, "dask.summary.seconds": seconds})
            for (prefix, action), (n, seconds, first, last) in sorted(summaries.items())]


def run_span(cluster_id: str, cluster_name: str | None, start_ns: int, end_ns: int,
             events: Iterable[SpanEvent], limit: int, admitted: int, summarised: int) -> SpanData:
    """The run's root span; ``admitted`` task spans were exported, ``summarised``
    actions were not (the cap ``limit`` was reached)."""
    events = sorted(events, key=lambda e: e.time_ns)
    attributes: dict[str, Any] = {
        "dask.cluster.id": cluster_id, "dask.cluster.name": cluster_name or cluster_id,
        "dask.task_spans.max": limit, "dask.task_spans.exported": admitted,
        "dask.task_spans.summarised": summarised, "dask.task_spans.capped": summarised > 0,
    }
    if summarised:
        events.append(SpanEvent("dask.task_spans.capped", end_ns, {
            "message": f"{summarised} task actions beyond blackbox.exporter.max-task-spans="
                       f"{limit} are summarised per prefix and action"}))
    died = [e for e in events if e.name == "dask.worker.death"]
    events = _limit(events, attributes)
    return SpanData(trace_hex(cluster_id), ids.run_span_id(cluster_id), None,
                    f"{RUN_SPAN} {cluster_name or cluster_id}", start_ns, max(end_ns, start_ns),
                    attributes, events, f"{len(died)} worker(s) died" if died else None)


def log_data(cluster_id: str, log: Mapping[str, Any], source: str | None = None) -> LogData:
    """A LOG event as a log record of the run's trace."""
    level = str(log.get("level") or "INFO").upper()
    attributes: dict[str, Any] = {"dask.process": str(log.get("process") or "")}
    if source:
        attributes["dask.source"] = source
    if log.get("worker"):
        attributes["dask.worker.address"] = log["worker"]
    if log.get("key"):
        attributes["dask.task.key"] = log["key"]
    if log.get("exc_text"):
        attributes["exception.stacktrace"] = log["exc_text"]
    return LogData(trace_hex(cluster_id), ids.run_span_id(cluster_id), ns(log["ts"]), level,
                   SEVERITY.get(level, 9), str(log.get("message") or ""),
                   str(log.get("logger") or ""), attributes)


def build_run(cluster_id: str, cluster_name: str | None, spans: Iterable[Mapping],
              transitions: Iterable[Mapping], lifecycle: Iterable[Mapping],
              max_task_spans: int, *, removals: Iterable[Classified],
              left: Iterable[LeftProcessing] = ()) -> list[SpanData]:
    """The whole trace of a recorded run, from its records: ``spans`` (SPAN_STATE
    records, or SPAN events for spans without one), ``transitions`` (TRANSITION
    events with startstops or into erred, in the order of their ``ts``),
    ``lifecycle`` (LIFECYCLE events: they extend the run), and ``removals``: its
    workers' removals with their verdicts (an event for each that is a death), and
    ``left``: its tasks that left processing without finishing (a span for each that a
    death ended, :func:`died_spans`). Task spans beyond ``max_task_spans`` are
    summarised (:class:`TaskCap`), in the order of the transitions."""
    cap = TaskCap(max_task_spans)
    out: list[SpanData] = []
    span_events: dict[str, list[SpanEvent]] = {}
    first, last = None, None

    def seen(start_ns: int, end_ns: int) -> None:
        nonlocal first, last
        first = start_ns if first is None else min(first, start_ns)
        last = end_ns if last is None else max(last, end_ns)

    for tr in transitions:
        for span in task_spans(cluster_id, tr):
            seen(span.start_ns, span.end_ns)
            if cap.admit(span):
                out.append(span)
        if tr.get("finish") == "erred":
            span_events.setdefault(tr.get("span_id") or "", []).append(error_event(tr))
    run_events = list(span_events.pop("", []))
    for lc in lifecycle:
        seen(ns(lc["ts"]), ns(lc["ts"]))
    removals = list(removals)
    run_events += [death_event(r) for r in removals if r.is_death]
    for span in died_spans(cluster_id, left, removals):
        seen(span.start_ns, span.end_ns)
        out.append(span)
    for state in spans:
        span = dask_span(cluster_id, state, span_events.pop(state["span_id"], ()))
        seen(span.start_ns, span.end_ns)
        out.append(span)
    for events in span_events.values():  # tasks of spans never described
        run_events.extend(events)
    out.extend(summary_spans(cluster_id, cap.summaries))
    out.append(run_span(cluster_id, cluster_name, first or 0, last or 0, run_events,
                        max_task_spans, cap.admitted, cap.summarised))
    return out
