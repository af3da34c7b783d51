"""A recorded run as a trace file in the Chrome Trace Event Format (the JSON that
Perfetto, ``chrome://tracing`` and ``about:tracing`` open): ``dask-blackbox trace
--cluster X [--span S] -o run.json.gz``.

The file is one JSON object, gzipped when the name ends in ``.gz``::

    {"traceEvents": [...], "displayTimeUnit": "ms",
     "otherData": {"cluster_id", "cluster_name", "span", "epoch_us", "threads"}}

Times (``ts``, ``dur``) are whole microseconds since ``otherData.epoch_us`` (the
run's first recorded moment, in microseconds since the Unix epoch).

- **One process per worker** (``pid`` 1, 2, ... in address order; its name is the
  worker's address), **one thread row per worker thread**: a compute goes on the
  row of the thread that ran it ("thread <ident>": the ``thread`` column, Dask's
  ``TaskFinishedMsg.thread``), and the worker's other actions (transfers, disk; and
  computes whose thread was not recorded) are packed onto the fewest rows of their
  own on which none overlap ("other actions #k", or "row #k" when no thread was
  recorded at all; ``otherData.threads`` says which: "recorded" or "packed"). Every action Dask reported in ``startstops`` is one
  complete event (``ph: "X"``): ``name`` the task's prefix (the action for
  transfers and disk), ``cat`` the action, ``args`` the key, ``erred: true`` for
  a task that erred, and a compute's ``thread``. (Dask shifts a
  compute's times by the worker's estimated clock offset, an estimate that moves: a
  compute that then seems to begin before the previous one on its thread ended goes
  on an "other actions" row, its times unchanged.)
- **The spans on a process of their own** (``pid`` 0, "dask spans"): each Dask span
  is a begin/end pair (``ph: "B"`` / ``"E"``) from its start to its stop, nested
  under its parent; spans that overlap without nesting go on another row. A span
  none of whose tasks finished in memory (Dask's ``Span.start`` unset) is a
  zero-length complete event at its ``enqueued`` time.
- **The critical path as flows** (``ph: "s"`` / ``"f"``, ``cat`` "critical-path",
  the ``id`` the link's place on the path): an arrow from each link's compute slice
  (bound at its end) to the next link's (bound at its start, ``bp: "e"``), ``args``
  naming both keys; ``otherData.critical_path`` gives the links in order, the basis
  (graph or actions, :func:`dask_blackbox.read.critical_path.critical_path`) and
  the path's seconds (``null`` when no task finished with recorded actions).
- **A task running when its worker died** (it reported no startstops) is a complete
  event from its last entry into processing to the worker's removal, ``cat`` "died",
  ``args`` its key and ``running_when_worker_died: true``, on a row of its worker's
  named "running when its worker died #k".
- **Deaths and errors as instant events** (``ph: "i"``): a worker's death (a
  removal whose cause, :func:`dask_blackbox.read.diagnosis.deaths`, is not an
  expected end) on its process (``s: "p"``) with its cause, an erred task on the
  spans' process (``s: "p"``) with its key and exception.

Metadata events (``ph: "M"``) name every process and thread. The rows are read from
ClickHouse with the times already in microseconds, and the file is written with
orjson and zlib at level 1 (the events are very alike: see bench/trace_file.py).
"""

from __future__ import annotations

import gzip
import heapq
import pathlib
from typing import Any, NamedTuple

import orjson

from dask_blackbox.read import critical_path, diagnosis
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.runs import has_column
from dask_blackbox.read.statements import ERRED
from dask_blackbox.read.views.scope import resolve
from dask_blackbox.read.died_tasks import died_tasks
from dask_blackbox.read.views.task_stream import DIED

#: The process of the spans' rows.
SPANS_PID = 0
#: Task actions read in one query, at most (pages of whole workers; a worker with
#: more is read alone, and then blackbox.query.max-result-rows must allow it).
PAGE_ROWS = 900_000
#: Rows of actions without a recorded thread are numbered from here (a worker's
#: thread rows from 1).
PACKED_TID = 1000
#: Rows of the tasks that were running when their worker died, from here.
DIED_TID = 2000


class _Lanes:
    """Packs one worker's actions, in order of start, onto the fewest rows on which
    none overlap: each goes on the lowest row free at its start."""

    def __init__(self) -> None:
        self.busy: list[tuple[int, int]] = []  # (end, row), a heap
        self.free: list[int] = []              # rows free now, a heap
        self.rows = 0

    def place(self, start: int, stop: int) -> int:
        busy, free = self.busy, self.free
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            row = heapq.heappop(free)
        else:
            row = self.rows
            self.rows += 1
        heapq.heappush(busy, (stop, row))
        return row


def _span_lanes(spans: list[tuple[int, int, str, str | None]]) -> dict[str, tuple[int, int]]:
    """A row for each span (start, stop, id, parent) such that on every row the
    spans nest: a span goes on the first row where, once the spans that ended by its
    start are closed, the innermost open one contains it. Returns span id -> (row,
    order), ``order`` the place of the span in the order rows were filled: of spans
    that begin (or end) at one time on one row, the one placed first is the outer."""
    parent_of = {span_id: parent for _, _, span_id, parent in spans}

    def depth(span_id: str) -> int:
        n, seen = 0, set()
        while (span_id := parent_of.get(span_id)) is not None and span_id not in seen:
            seen.add(span_id)
            n += 1
        return n

    stacks: list[list[tuple[int, int]]] = []
    placed = {}
    ordered = sorted(spans, key=lambda s: (s[0], -s[1], depth(s[2]), s[2]))
    for order, (start, stop, span_id, _) in enumerate(ordered):
        for i, stack in enumerate(stacks):
            while stack and stack[-1][1] <= start and stack[-1][0] < start:
                stack.pop()
            if not stack or stack[-1][1] >= stop:
                stack.append((start, stop))
                placed[span_id] = (i, order)
                break
        else:
            stacks.append([(start, stop)])
            placed[span_id] = (len(stacks) - 1, order)
    return placed


class TraceFile(NamedTuple):
    """A trace: ``events`` (metadata, spans, instants) as dicts, ``slices`` (the
    task actions' complete events) as JSON text, and ``other`` (``otherData``)."""

    events: list[dict]
    slices: list[str]
    other: dict


#: What :func:`trace_events` reads (``{where}`` filled in where it is run).
WORKER_FIRSTS = ("SELECT worker, count(), toInt64(min(toUnixTimestamp64Micro(ss.start))) "
                 "{where} GROUP BY worker ORDER BY worker")
#: What :func:`trace_events` reads (from ``{span_state}``; ``{in_span}`` filled in where it
#: is run).
TRACE_SPANS = ("SELECT span_id, name, parent_id, "
               "toInt64(toUnixTimestamp64Micro(enqueued)), "
               "toInt64(toUnixTimestamp64Micro(start)), "
               "toInt64(toUnixTimestamp64Micro(stop)), arraySum(mapValues(states)), "
               "duration FROM {span_state} FINAL WHERE cluster_id = {{c:String}}{in_span}")


def trace_events(backend: Backend, cluster: str, span: str | None = None) -> TraceFile:
    """The trace of ``cluster``'s latest run (or of the span ``span`` and its
    sub-spans); NotFound for an unknown cluster or span."""
    scope = resolve(backend, cluster, span)
    p: dict[str, Any] = {"c": scope.cluster_id}
    in_span = ""
    if scope.span_ids is not None:
        p["ids"] = scope.span_ids
        in_span = " AND span_id IN {ids:Array(String)}"
    recorded = has_column(backend, "transitions", "thread")
    thread = "thread" if recorded else "NULL"
    # the thread in a compute's args, where recorded
    thread_arg = ("if(isNull(thread) OR ss.action != 'compute', '', "
                  "concat(',\"thread\":', toString(thread))), " if recorded else "")
    where = (f"FROM {_t(backend, 'transitions')} ARRAY JOIN startstops AS ss "
             f"WHERE cluster_id = {{c:String}} AND source = 'scheduler'{in_span}")
    # a page of workers at a time: one answer may hold at most blackbox.query.max-result-rows
    _, per_worker = backend.query(WORKER_FIRSTS.format(where=where), p)
    pages = _pages(per_worker)
    _, span_rows = backend.query(
        TRACE_SPANS.format(span_state=_t(backend, 'span_state'), in_span=in_span), p)
    _, rows = backend.query(ERRED.format(transitions=_t(backend, "transitions"),
                                         where="WHERE cluster_id = {c:String}" + in_span), p)
    erred = [(us, key, prefix, worker, exception)
             for _, key, prefix, worker, _, us, exception in rows]
    removals = [d for d in diagnosis.deaths(backend, [scope.cluster_id]) if d.is_death]
    died_running = died_tasks(backend, scope)
    try:
        path = critical_path.critical_path(backend, scope.cluster_id, scope.span_ids,
                                           span=span, check_graph=False)
    except critical_path.NoActions:
        path = None
    on_path = {link.key: i for i, link in enumerate(path.links)} if path else {}

    spans = []
    for span_id, name, parent, enqueued, start, stop, tasks, task_s in span_rows:
        begin = start if start > 0 else enqueued
        spans.append((begin, max(stop, begin), span_id, parent or None, list(name), tasks, task_s))
    starts = ([s[0] for s in spans] + [e[0] for e in erred]
              + [round(d.ts * 1e6) for d in removals] + [first for _, _, first in per_worker]
              + [round(d.task.entered * 1e6) for d in died_running])
    epoch = min(starts) if starts else 0

    workers = sorted({w for w, _, _ in per_worker} | {d.worker for d in removals if d.worker}
                     | {d.worker for d in died_running})
    pid_of = {w: i + 1 for i, w in enumerate(workers)}
    events = _process_events(pid_of)

    p["epoch"] = epoch
    slices, thread_names, thread_rows, placed_links = _task_slices(
        backend, pages, p, thread, thread_arg, where, pid_of, path, on_path)
    append = slices.append
    # tasks running when their worker died: no startstops, a row of their own
    died_lanes: dict[str, _Lanes] = {}
    for d in sorted(died_running, key=lambda d: (d.worker, d.task.entered)):
        pid, t = pid_of[d.worker], d.task
        start, stop = round(t.entered * 1e6) - epoch, round(t.left * 1e6) - epoch
        tid = DIED_TID + died_lanes.setdefault(d.worker, _Lanes()).place(start, stop)
        thread_names.setdefault((pid, tid), f"{DIED} #{tid - DIED_TID}")
        append(orjson.dumps({"name": t.prefix or t.key, "cat": "died", "ph": "X", "ts": start,
                             "dur": max(stop - start, 0), "pid": pid, "tid": tid,
                             "args": {"key": t.key, "running_when_worker_died": True}}).decode())
    for (pid, tid), name in sorted(thread_names.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})

    events.extend(_span_events(spans, epoch))
    events.extend(_marks(removals, pid_of, path, placed_links, erred, epoch))
    links = path.links if path else ()
    return TraceFile(events, slices, {
        "cluster_id": scope.cluster_id, "cluster_name": scope.cluster_name, "span": span,
        "epoch_us": epoch, "threads": "recorded" if thread_rows else "packed",
        "critical_path": {"links": [link.key for link in links], "basis": path.basis,
                          "seconds": path.wall} if path else None})


def _pages(per_worker: list[tuple]) -> list[list[str]]:
    """The workers in pages of at most :data:`PAGE_ROWS` actions (one answer may hold at
    most blackbox.query.max-result-rows), from (worker, actions, first start)."""
    pages: list[list[str]] = [[]]
    rows_in_page = 0
    for worker, n, _ in per_worker:
        if pages[-1] and rows_in_page + n > PAGE_ROWS:
            pages.append([])
            rows_in_page = 0
        pages[-1].append(worker)
        rows_in_page += n
    return pages


def _process_events(pid_of: dict[str, int]) -> list[dict]:
    """A process per worker (and the spans'), named and in order."""
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": SPANS_PID, "tid": 0, "args": {"name": "dask spans"}},
        {"name": "process_sort_index", "ph": "M", "pid": SPANS_PID, "tid": 0, "args": {"sort_index": 0}},
    ]
    for w, pid in pid_of.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": w}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
    return events


#: What :func:`_task_slices` reads (``{thread}``, ``{thread_arg}``, ``{where}`` filled in
#: where it is run).
TASK_SLICES = ("SELECT worker, {thread}, ss.action = 'compute', key, "
               "toInt64(toUnixTimestamp64Micro(ss.start)) - {{epoch:Int64}} AS s, "
               "toInt64(toUnixTimestamp64Micro(ss.stop)) - {{epoch:Int64}} AS e, "
               "concat('{{\"name\":', toJSONString(if(ss.action = 'compute', prefix, "
               "ss.action)), ',\"cat\":', toJSONString(ss.action), ',\"ph\":\"X\",\"ts\":', "
               "toString(s), ',\"dur\":', toString(greatest(e - s, 0)), "
               "',\"args\":{{\"key\":', toJSONString(key), if(finish = 'erred', "
               "',\"erred\":true', ''), {thread_arg}'}}') {where} AND worker IN "
               "{{page:Array(String)}} ORDER BY worker, ss.start, ss.stop")


def _task_slices(backend: Backend, pages: list[list[str]], p: dict, thread: str, thread_arg: str,
                 where: str, pid_of: dict[str, int], path, on_path: dict[str, int]) -> tuple:
    """The task actions: X events, one row per worker thread, read a page of workers at
    a time. ClickHouse writes each event's JSON but for its row (pid, tid), which is
    known only here. Returns the events' text, the rows' names, the rows of recorded
    threads and where each link of the critical path was placed: (pid, tid, start, stop)."""
    placed_links: dict[int, tuple[int, int, int, int]] = {}
    epoch = p["epoch"]
    thread_names: dict[tuple[int, int], str] = {}
    thread_rows: dict[tuple[str, int], int] = {}
    slices: list[str] = []
    append = slices.append
    for page in pages:
        if not page:
            continue
        _, rows = backend.query(
            TASK_SLICES.format(thread=thread, thread_arg=thread_arg, where=where),
            {**p, "page": page})
        lanes: _Lanes | None = None
        current = None
        for worker, thread_id, is_compute, key, start, stop, text in rows:
            if worker != current:
                current, lanes, pid, ends = worker, _Lanes(), pid_of[worker], {}
            # Dask adds the worker's estimated clock offset to its computes' times, and
            # the estimate moves: a compute may seem to begin before the one before it
            # on its thread ended. It then goes on another row (a slice of a row never
            # overlaps another), its times as recorded.
            if thread_id is not None and is_compute and start >= ends.get(thread_id, start):
                ends[thread_id] = stop
                tid = thread_rows.get((worker, thread_id))
                if tid is None:
                    tid = thread_rows[(worker, thread_id)] = 1 + sum(
                        1 for k in thread_rows if k[0] == worker)
                    thread_names[(pid, tid)] = f"thread {thread_id}"
            else:
                lane = lanes.place(start, stop)
                tid = PACKED_TID + lane
                if (pid, tid) not in thread_names:
                    thread_names[(pid, tid)] = f"{'other actions' if thread_rows else 'row'} #{lane}"
            append(f'{text},"pid":{pid},"tid":{tid}}}')
            if is_compute and key in on_path:  # a retried task: the compute on the path
                i = on_path[key]
                was = placed_links.get(i)
                at = path.links[i].compute_start * 1e6 - epoch
                if was is None or abs(start - at) < abs(was[2] - at):
                    placed_links[i] = (pid, tid, start, stop)
    return slices, thread_names, thread_rows, placed_links


def _span_events(spans: list[tuple], epoch: int) -> list[dict]:
    """The spans: B/E pairs on rows where they nest (an X event for a span no task
    finished in), with their rows' names."""
    events: list[dict] = []
    placed = _span_lanes([(s[0], s[1], s[2], s[3]) for s in spans])
    for lane in sorted({lane for lane, _ in placed.values()}):
        events.append({"name": "thread_name", "ph": "M", "pid": SPANS_PID, "tid": lane + 1,
                       "args": {"name": f"spans #{lane}"}})
    span_events = []
    for begin, stop, span_id, parent, name, tasks, task_s in spans:
        lane, order = placed[span_id]
        tid = lane + 1
        label = name[-1] if name else span_id
        args = {"span_id": span_id, "path": "/".join(name), "parent_id": parent,
                "tasks": tasks, "task_seconds": task_s}
        if stop == begin:  # no task finished: an instant-long slice, not a B/E pair
            span_events.append((begin, 0.5, order, {"name": label, "cat": "span", "ph": "X",
                                "ts": begin - epoch, "dur": 0, "pid": SPANS_PID, "tid": tid,
                                "args": args}))
            continue
        span_events.append((begin, 1, order, {"name": label, "cat": "span", "ph": "B",
                            "ts": begin - epoch, "pid": SPANS_PID, "tid": tid, "args": args}))
        span_events.append((stop, 0, -order, {"name": label, "cat": "span", "ph": "E",
                            "ts": stop - epoch, "pid": SPANS_PID, "tid": tid}))
    # at one time, ends before begins; inner spans begin after and end before outer ones
    span_events.sort(key=lambda e: e[:3])
    events.extend(e[3] for e in span_events)

    return events


def _marks(removals: list, pid_of: dict[str, int], path, placed_links: dict, erred: list,
           epoch: int) -> list[dict]:
    """The deaths (instant events on their workers' rows), the critical path (flow
    events from each link's compute to the next one's) and the erred tasks."""
    events: list[dict] = []
    for d in removals:
        if d.worker in pid_of:
            events.append({"name": "worker died", "cat": "death", "ph": "i", "s": "p",
                           "ts": round(d.ts * 1e6) - epoch, "pid": pid_of[d.worker], "tid": 0,
                           "args": {"worker": d.worker, "cause": d.verdict.cause.label,
                                    "why": d.verdict.summary, "reason": d.reason,
                                    "processing_tasks": d.processing_tasks,
                                    "lost_computed_tasks": d.lost_computed_tasks,
                                    "lost_scattered_tasks": d.lost_scattered_tasks}})
    links = path.links if path else ()
    for i in range(len(links) - 1):
        if i in placed_links and i + 1 in placed_links:
            (pid, tid, start, stop), (npid, ntid, nstart, _) = placed_links[i], placed_links[i + 1]
            args = {"from": links[i].key, "to": links[i + 1].key}
            events.append({"name": "critical path", "cat": "critical-path", "ph": "s", "id": i,
                           "ts": max(start, stop - 1), "pid": pid, "tid": tid, "args": args})
            events.append({"name": "critical path", "cat": "critical-path", "ph": "f", "bp": "e",
                           "id": i, "ts": nstart, "pid": npid, "tid": ntid, "args": args})
    for ts_us, key, prefix, worker, exception in erred:
        events.append({"name": f"erred {prefix}".strip(), "cat": "error", "ph": "i", "s": "p",
                       "ts": ts_us - epoch, "pid": SPANS_PID, "tid": 0,
                       "args": {"key": key, "worker": worker, "exception": exception}})
    return events


def write(trace: TraceFile, path: str | pathlib.Path) -> int:
    """Write ``trace`` to ``path`` (gzipped if it ends in .gz); returns the bytes written."""
    head = orjson.dumps({"displayTimeUnit": "ms", "otherData": trace.other})
    parts = [b'{"traceEvents":[', b",".join(orjson.dumps(e) for e in trace.events)]
    if trace.slices:
        parts += [b"," if trace.events else b"", ",".join(trace.slices).encode()]
    parts += [b"],", head[1:]]
    path = pathlib.Path(path)
    if path.suffix == ".gz":
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1,
                                                     mtime=0) as f:
            for part in parts:
                f.write(part)
    else:
        with open(path, "wb") as f:
            for part in parts:
                f.write(part)
    return path.stat().st_size
