"""The Workers view: one row per worker of the run (an address the scheduler knew,
``scheduler_start``'s list of the workers there before the recording or
``worker_added``, or one that reported metrics or ran a task).

The panel's columns, per worker, over the whole run:

``threads``, ``memory_limit``    as the scheduler recorded them when it joined (the
                                 nanny's record of its end for a memory limit the
                                 scheduler did not give);
``memory_peak``                  the highest process memory (RSS) known: its own
                                 samples, its nanny's (sampled every 0.1 s) and the
                                 RSS at which its nanny killed it for memory, the one
                                 the Diagnosis names;
``managed_peak``, ``spilled_peak`` the highest managed and spilled bytes sampled;
``cpu_mean``                     its samples' mean CPU, in percent of one core;
``tasks``, ``erred``             computes it began (its task stream's bars), and of
                                 them those of tasks that erred (page aggregates);
``bytes_in``, ``bytes_out``      bytes fetched from other workers for the tasks it ran,
                                 and fetched from it for tasks others ran: each
                                 dependency once per worker that ran a dependent
                                 elsewhere, from the recorded graph (the rule of
                                 :mod:`.cost`'s ``moved_bytes``, which they add up to;
                                 None without a recorded graph);
                                 Above :data:`MOVED_MAX_TASKS` tasks in the run
                                 the count (a join of the whole graph with every
                                 task's worker) is made only when asked for
                                 (``count_bytes``): ``bytes_deferred`` says so;
``first_seen``, ``last_seen``    its joining (or first sample or task) and its removal
                                 (or last sample or task);
``ended``                        how it ended: the cause :mod:`.diagnosis` gives its
                                 removal (``died`` true for a death), or "there at the
                                 close" / "still there" without a removal.
"""

from __future__ import annotations

from collections import defaultdict

from dask_blackbox.read import aggregates, diagnosis
from dask_blackbox.read import workers as worker_data
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.statements import LIFECYCLE
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register

#: Tasks in a run above which bytes in and out are counted only when asked for.
MOVED_MAX_TASKS = worker_data.MOVED_MAX_TASKS


def data(ctx: Context) -> dict:
    return {"workers": rows(ctx)}


def rows(ctx: Context) -> dict:
    """:func:`workers` of the page's run, kept for the page's other views (a worker's page)."""
    return ctx.memo.get(("workers", ctx.scope.cluster_id, ctx.count_bytes()),
                        lambda: workers(ctx.backend, ctx.scope, ctx.deaths(), ctx.moved(),
                                        not ctx.count_bytes(), ctx.info()))


#: Per worker of a cluster, over its samples: the highest memory, managed and spilled
#: bytes, the mean CPU, the first and last sample (float seconds) and their count.
WORKER_SAMPLES = ("SELECT worker, max(memory), max(memory_managed), max(memory_spilled), avg(cpu), "
                  "toFloat64(min(ts)), toFloat64(max(ts)), count() "
                  "FROM {worker_metrics} WHERE cluster_id = {{c:String}} GROUP BY worker")


def _samples(backend: Backend, cluster_id: str) -> dict[str, tuple]:
    _, rows = backend.query(WORKER_SAMPLES.format(worker_metrics=_t(backend, "worker_metrics")),
                            {"c": cluster_id})
    return {r[0]: r[1:] for r in rows}


def workers(backend: Backend, scope, found: list | None = None,
            moved: dict | None = None, bytes_deferred: bool = False,
            known: dict | None = None) -> dict:
    """The Workers panel of ``scope``'s run (see the module docstring): ``workers`` (one
    row each, in the order they joined), ``graph`` (whether bytes in and out could be
    counted) and ``bytes_deferred``. ``found``: the run's :func:`diagnosis.deaths`, if
    already known; ``moved``: its :func:`.workers.moved_bytes`, if already known, unless
    ``bytes_deferred`` (then bytes in and out are None); ``known``: its :func:`.workers.info`, if
    already known."""
    cid = scope.cluster_id
    known = worker_data.info(backend, cid) if known is None else known
    samples = _samples(backend, cid)
    ran = aggregates.per_worker(backend, cid)
    if not bytes_deferred and moved is None:
        moved = worker_data.moved_bytes(backend, cid)
    found = diagnosis.deaths(backend, [cid]) if found is None else found
    ended = {d.worker: d for d in found}
    _, closed = backend.query(LIFECYCLE.format(lifecycle=_t(backend, "lifecycle"),
                                               also=" AND action = 'scheduler_close'"), {"c": cid})
    was_closed = bool(closed)
    bytes_in: dict[str, int] = defaultdict(int)
    bytes_out: dict[str, int] = defaultdict(int)
    for (sender, receiver), n in (moved or {}).items():
        bytes_out[sender] += n
        bytes_in[receiver] += n
    addresses = set(known) | set(samples) | {w for w in ran if w}
    rows = []
    for w in addresses:
        k = known.get(w, {})
        s = samples.get(w)
        r = ran.get(w, {})
        seen = [t for t in (k.get("added"), s[4] if s else None) if t]
        last = [t for t in (k.get("removed"), s[5] if s else None) if t]
        death = ended.get(w)
        if death is not None:
            how = {"cause": death.verdict.cause.value, "label": death.verdict.cause.label,
                   "died": death.is_death, "explanation": death.verdict.explanation,
                   "confidence": death.verdict.confidence, "ts": death.ts}
        else:
            how = {"cause": None, "label": "there at the close" if was_closed else "still there",
                   "died": False, "explanation": "", "confidence": None, "ts": None}
        rows.append({
            "worker": w, "name": k.get("name"), "threads": k.get("nthreads"),
            "memory_limit": k.get("memory_limit"), "pid": k.get("pid"), "nanny": k.get("nanny"),
            "memory_peak": max((v for v in (s[0] if s else None,
                                            death.memory_peak if death is not None else None) if v),
                               default=None),
            "managed_peak": s[1] if s else None,
            "spilled_peak": s[2] if s else None, "cpu_mean": s[3] if s else None,
            "samples": s[6] if s else 0,
            "tasks": r.get("tasks", 0), "erred": r.get("erred", 0),
            "compute_s": r.get("compute_s", 0.0), "transfer_s": r.get("transfer_s", 0.0),
            "bytes_in": bytes_in.get(w, 0) if moved is not None else None,
            "bytes_out": bytes_out.get(w, 0) if moved is not None else None,
            "first_seen": min(seen) if seen else None, "last_seen": max(last) if last else None,
            "ended": how})
    rows.sort(key=lambda r: (r["first_seen"] if r["first_seen"] is not None else float("inf"),
                             r["worker"]))
    return {"workers": rows, "graph": moved is not None, "bytes_deferred": bytes_deferred,
            "n_workers": len(rows),
            "deaths": sum(1 for r in rows if r["ended"]["died"])}


VIEW = register(View("workers", "Workers", data, "panel_workers.html", order=80,
                     about="one row per worker: threads, memory limit and peaks, CPU, tasks, bytes, its end"))
