"""The tasks a worker's death took out of processing: what the task stream hatches
("running when its worker died"), the trace file draws on a row of their own, and
the OTLP export sends as a ``died`` span each.

A death here is a removal Dask did not expect (``expected`` is not true in its
``remove-worker`` event): every task the scheduler then moved out of processing with
that removal's stimulus, whether it went back to released (to run again elsewhere)
or to erred (its last allowed failure: a KilledWorker). Such a task reported no
startstops, so Dask's own task stream has no bar for it; it is drawn from its last
entry into processing before the removal to the removal.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dask_blackbox.causes import LeftProcessing
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.statements import ENTERED_PROCESSING, TAKEN_OUT_OF_PROCESSING, WORKER_REMOVALS

if TYPE_CHECKING:  # below the views: importing read.views imports every view, the task stream's too
    from dask_blackbox.read.views.scope import Scope

#: The removals of :data:`.statements.WORKER_REMOVALS` that are deaths: those Dask did not
#: expect.
UNEXPECTED = " AND JSONExtract(detail, 'expected', 'Nullable(Bool)') IS DISTINCT FROM true"
#: ... and those in a window ``since``..``until`` (seconds since the epoch).
SINCE = " AND ts >= toDateTime64({since:Float64}, 6, 'UTC')"
UNTIL = " AND ts <= toDateTime64({until:Float64}, 6, 'UTC')"


@dataclasses.dataclass(frozen=True)
class DiedTask:
    """A task that was processing on ``worker`` when the scheduler removed that worker
    without expecting it: ``task``, the record the OTLP export sends as a ``died``
    span (:class:`~dask_blackbox.causes.LeftProcessing`: its key, prefix, group and
    span, the removal's stimulus, when it last entered processing before the removal
    and when the removal took it out), the worker, and where the removal sent it."""

    task: LeftProcessing
    worker: str
    #: where the removal sent it: "released" (to run again) or "erred" (KilledWorker)
    finish: str


def died_tasks(backend: Backend, scope: Scope, worker: str | None = None) -> list[DiedTask]:
    """The tasks of ``scope`` (its cluster, its spans) that the unexpected removals of
    its workers took out of processing (only those of ``worker``, if given), in the
    order they left it. A scope narrowed to a window (``since``/``until``) keeps the
    removals in that window; a task that entered processing before it still counts."""
    also = UNEXPECTED
    rp: dict[str, Any] = {"c": scope.cluster_id}
    if scope.since is not None:
        also += SINCE
        rp["since"] = scope.since
    if scope.until is not None:
        also += UNTIL
        rp["until"] = scope.until
    _, removals = backend.query(
        WORKER_REMOVALS.format(lifecycle=_t(backend, "lifecycle"), also=also), rp)
    died_on = {s: w for s, w in removals if s and (worker is None or w == worker)}
    if not died_on:
        return []
    where = "WHERE cluster_id = {c:String}"  # and its spans
    p: dict[str, Any] = {"c": scope.cluster_id}
    if scope.span_ids is not None:
        where += " AND span_id IN {ids:Array(String)}"
        p["ids"] = scope.span_ids
    transitions = _t(backend, "transitions")
    _, left = backend.query(TAKEN_OUT_OF_PROCESSING.format(transitions=transitions, where=where),
                            {**p, "stimuli": sorted(died_on)})
    if not left:
        return []
    _, entries = backend.query(ENTERED_PROCESSING.format(transitions=transitions, where=where),
                               {**p, "keys": sorted({row[2] for row in left})})
    entered: dict[str, list[float]] = {}
    for _, key, ts in entries:
        entered.setdefault(key, []).append(ts)
    out = []
    for _, stimulus_id, key, prefix, group, span_id, finish, removed in left:
        before = [t for t in entered.get(key, ()) if t <= removed]
        if before:
            task = LeftProcessing(key, prefix or "", group or "", span_id or None, stimulus_id,
                                  before[-1], removed)
            out.append(DiedTask(task, died_on[stimulus_id], finish))
    return out
