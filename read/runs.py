"""A recorded run read back as the contract's records: what ``dask-blackbox export
otlp`` hands to :func:`dask_blackbox.exporters.traces.build_run` (with the verdicts of
:func:`dask_blackbox.read.diagnosis.deaths`), so that a run exported on demand from
ClickHouse is the trace the continuous exporter builds from Kafka as it happens (the
same records, the same ids, the same deaths with the same causes).

:func:`read_run` takes a cluster (name or id: the latest run of that name, see
:func:`~dask_blackbox.read.views.scope.resolve`) and optionally a span (its tag or
'/'-joined name: that span and its sub-spans, and only their tasks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from dask_blackbox.causes import LeftProcessing
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.died_tasks import died_tasks
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.statements import LIFECYCLE
from dask_blackbox.read.views.scope import resolve


class Run(NamedTuple):
    """A run's records, each shaped as its contract declaration."""

    cluster_id: str
    cluster_name: str
    #: contract.SpanState records (contract.Span events for spans never described)
    spans: list[dict]
    #: contract.Transition events of the scheduler that carry startstops or erred,
    #: in the order they happened (``thread`` added where the table records it)
    transitions: list[dict]
    #: contract.Lifecycle events, ``detail`` parsed
    lifecycle: list[dict]
    #: contract.Log events, with ``source``
    logs: list[dict]
    #: the tasks a worker's death took out of processing (:func:`.died_tasks.died_tasks`:
    #: those it sent to erred too), with when they last entered it, as the exporter
    #: draws them (``died`` spans)
    left_processing: list[LeftProcessing]


#: Whether table ``t`` of database ``db`` has column ``c``.
HAS_COLUMN = ("SELECT count() FROM system.columns WHERE database = {db:String} AND table = "
              "{t:String} AND name = {c:String}")


def has_column(backend: Backend, table: str, column: str) -> bool:
    """Whether ``table`` has ``column`` (system.columns)."""
    _, rows = backend.query(
        HAS_COLUMN,
        {"db": backend.database, "t": table, "c": column})
    return bool(rows and rows[0][0])


def _json(text: str) -> Any:
    try:
        return orjson.loads(text) if text else None
    except orjson.JSONDecodeError:
        return None


#: The run's span states (``{in_span}``: only some spans), one per span.
SPAN_STATES = ("SELECT span_id, name, parent_id, version, toFloat64(enqueued), toFloat64(start), "
               "toFloat64(stop), duration, nbytes_total, states, all_durations, done, "
               "active_cpu_seconds, cluster_name FROM {span_state} FINAL WHERE cluster_id = "
               "{{c:String}}{in_span}")
#: The run's spans (``{in_span}``: only some) of which no state was recorded.
SPANS_WITHOUT_STATE = ("SELECT span_id, any(name), any(parent_id), min(toFloat64(enqueued)) FROM "
                       "{spans} WHERE cluster_id = {{c:String}}{in_span} AND span_id NOT IN (SELECT "
                       "span_id FROM {span_state} WHERE cluster_id = {{c:String}}) GROUP BY span_id")
#: The scheduler's transitions with startstops or into erred (``{in_span}``: only some
#: spans; ``{thread}``: the thread column, when recorded), in order (floats: arrays of
#: DateTime64 come back as text through a sink's query server).
TASK_RECORDS = ("SELECT key, toFloat64(ts) AS ts, start, finish, prefix, task_group, span_id, "
                "worker, nbytes, typename, exception, traceback, cause, startstops.action AS "
                "action, arrayMap(x -> toFloat64(x), startstops.start) AS starts, arrayMap(x -> "
                "toFloat64(x), startstops.stop) AS stops, startstops.source AS sources{thread} "
                "FROM {transitions} WHERE cluster_id = {{c:String}} AND source = 'scheduler' "
                "AND (notEmpty(startstops.action) OR finish = 'erred'){in_span} ORDER BY ts, "
                "seq, idx")
#: The run's log records (``{where}``: within its time, for a span), in order.
LOG_RECORDS = ("SELECT toFloat64(ts), logger, level, message, process, exc_text, worker, key, "
               "source FROM {logs} WHERE cluster_id = {{c:String}}{where} ORDER BY ts, seq, idx")


def read_run(backend: Backend, cluster: str, span: str | None = None,
             logs: bool = True) -> Run:
    """The records of ``cluster``'s latest run (NotFound for an unknown cluster or
    span); with ``span``, only that span tree's spans and tasks."""
    scope = resolve(backend, cluster, span)
    p: dict[str, Any] = {"c": scope.cluster_id}
    in_span = ""
    if scope.span_ids is not None:
        p["ids"] = scope.span_ids
        in_span = " AND span_id IN {ids:Array(String)}"
    spans = []
    _, rows = backend.query(
        SPAN_STATES.format(span_state=_t(backend, 'span_state'), in_span=in_span), p)
    for (span_id, name, parent, version, enqueued, start, stop, duration, nbytes, states,
         durations, done, cpu, cluster_name) in rows:
        spans.append({"cluster_id": scope.cluster_id, "cluster_name": cluster_name,
                      "span_id": span_id, "name": list(name), "parent_id": parent or None,
                      "version": version, "enqueued": enqueued, "start": start, "stop": stop,
                      "duration": duration, "nbytes_total": nbytes, "states": dict(states),
                      "all_durations": dict(durations), "done": bool(done),
                      "active_cpu_seconds": cpu})
    _, rows = backend.query(
        SPANS_WITHOUT_STATE.format(spans=_t(backend, 'spans'), in_span=in_span, span_state=_t(backend, 'span_state')), p)
    spans += [{"kind": "span", "ts": enqueued, "span_id": span_id, "name": list(name),
               "parent_id": parent or None, "enqueued": enqueued}
              for span_id, name, parent, enqueued in rows]
    thread = ", thread" if has_column(backend, "transitions", "thread") else ""
    columns, rows = backend.query(
        TASK_RECORDS.format(thread=thread, transitions=_t(backend, 'transitions'), in_span=in_span), p)
    transitions = []
    for row in rows:
        tr = dict(zip(columns, row))
        tr["kind"] = "transition"
        tr["group"] = tr.pop("task_group") or None
        tr["startstops"] = [
            {"action": a, "start": s, "stop": e, **({"source": src} if src else {})}
            for a, s, e, src in zip(tr.pop("action"), tr.pop("starts"), tr.pop("stops"),
                                    tr.pop("sources"))]
        for field in ("span_id", "worker", "typename", "exception", "traceback", "cause"):
            tr[field] = tr[field] or None
        transitions.append(tr)
    _, rows = backend.query(LIFECYCLE.format(lifecycle=_t(backend, "lifecycle"), also=""),
                            {"c": p["c"]})
    lifecycle = [{"kind": "lifecycle", "ts": ts, "action": action, "worker": worker or None,
                  "client": client or None, "reason": reason or None,
                  "stimulus_id": stimulus_id or None, "detail": _json(detail)}
                 for ts, action, worker, client, reason, stimulus_id, detail in rows]
    log_records = []
    if logs:
        where = ""
        if scope.span_ids is not None:
            where = " AND ts >= toDateTime64({t0:Float64}, 6, 'UTC') AND ts <= toDateTime64({t1:Float64}, 6, 'UTC')"
            p.update(t0=scope.t0, t1=scope.t1)
        _, rows = backend.query(LOG_RECORDS.format(logs=_t(backend, 'logs'), where=where), p)
        log_records = [{"kind": "log", "ts": ts, "logger": logger, "level": level,
                        "message": message, "process": process or None,
                        "exc_text": exc or None, "worker": worker or None, "key": key or None,
                        "source": source}
                       for ts, logger, level, message, process, exc, worker, key, source in rows]
    return Run(scope.cluster_id, scope.cluster_name, spans, transitions, lifecycle, log_records,
               [d.task for d in died_tasks(backend, scope)])

