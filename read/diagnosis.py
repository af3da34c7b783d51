"""Why workers died and why tasks failed with KilledWorker, computed from ClickHouse.

:func:`deaths`
    every worker removal of the clusters asked for, each with the cause
    :func:`dask_blackbox.causes.classify` gives it from the recorded facts (the
    scheduler's lifecycle records, the nannies' ``worker_exits``, Dask's events
    ``worker-restart-memory``, ``worker-ttl-timed-out`` and ``closing-worker``).
    A *death* is a removal whose cause is not "expected": the one count every page
    shows (the Clusters page's workers lost, the Run page's deaths and markers, the
    post-mortem's dead workers).
:func:`killed_workers`
    each task that erred with KilledWorker: the deaths that counted against it (the
    removals Dask did not expect while the task was processing on the worker, what
    ``distributed.scheduler.allowed-failures`` counts), each with its cause, and the
    *suspect*: the tasks (and prefixes) processing on every one of those workers when
    it died, ranked, with their memory footprint.
:func:`diagnose`
    both for one run (or every run matching ``cluster``), with the rows that support
    each verdict: the dead worker's tasks, the log lines about its process (its
    nanny's, the scheduler's) and its own last warnings, and its last metrics
    (:mod:`.death_evidence`).

Every time is float seconds since the epoch.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, NamedTuple

from dask_blackbox.causes import (
    HIGH, MEDIUM, Cause, Closing, Exit, MemoryKill, Removal, TtlTimeout, Verdict, classify,
    gather,
)
from dask_blackbox.read import held_memory, last_stacks
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.death_evidence import LOG_LINES, _death_evidence, _timeline
from dask_blackbox.read.filters import TimeBound, cluster_ids, clusters_condition, epoch, table
from dask_blackbox.read.statements import ENTERED_PROCESSING, ERRED, TAKEN_OUT_OF_PROCESSING


class Death(NamedTuple):
    """A worker removal with its verdict (a death unless the cause is expected)."""

    cluster_id: str
    worker: str
    ts: float
    stimulus_id: str
    reason: str
    expected: bool | None
    processing_tasks: int
    lost_computed_tasks: int
    lost_scattered_tasks: int
    #: its process's id (its worker_added record, else its nanny's record of its end)
    pid: int | None
    nanny: str | None
    #: when it joined (None if not recorded)
    added: float | None
    #: the process's highest RSS known (its nanny's samples, the rss at a memory
    #: kill) and its memory limit
    memory_peak: int | None
    memory_limit: int | None
    verdict: Verdict
    #: the removal the verdict was given to (:func:`dask_blackbox.causes.classify`)
    removal: Removal

    @property
    def is_death(self) -> bool:
        return self.verdict.cause.is_death

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self._fields if k not in ("verdict", "removal")}
        out.update(self.verdict.as_dict(), is_death=self.is_death)
        return out


class Suspect(NamedTuple):
    """A task processing on the worker at every death of a KilledWorker's chain."""

    key: str
    prefix: str
    #: of the chain's deaths, and of every death in the cluster, at how many it was
    #: processing on the dying worker
    chain_deaths: int
    cluster_deaths: int
    #: seconds it had been processing on the worker when each chain death came
    processing_s: list[float]
    #: the largest and the count of its prefix's results that did fit in memory
    prefix_result_nbytes_max: int | None
    prefix_results: int
    #: at how many of the run's deaths a task of its prefix was processing
    prefix_deaths: int

    @property
    def prefix_death_rate(self) -> float:
        """Of its prefix's tasks that ended (in memory, or on a dying worker), the
        fraction that ended on a dying worker: near 0 for a prefix whose tasks
        finish fine elsewhere."""
        return self.prefix_deaths / max(self.prefix_deaths + self.prefix_results, 1)


class KilledTask(NamedTuple):
    """A task that erred with KilledWorker, the deaths that counted against it, and
    its suspects (best first)."""

    cluster_id: str
    key: str
    prefix: str
    ts: float
    exception: str
    deaths: list[Death]
    suspects: list[Suspect]
    #: prefixes processing on the worker at every death of the chain
    prefixes: list[str]
    confidence: str
    summary: str
    #: per death: the peak RSS of the process (its nanny's sample, or the rss at the
    #: nanny's memory kill) and its memory limit
    peak_memory: list[int | None]
    memory_limit: int | None

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self._fields if k not in ("deaths", "suspects")}
        out["deaths"] = [d.as_dict() for d in self.deaths]
        out["suspects"] = [s._asdict() for s in self.suspects]
        return out


# ------------------------------------------------------------------- deaths


def _detail(text: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: What :func:`deaths` reads (from ``{lifecycle}``; ``{where}`` filled in where it is run).
LIFECYCLE_OF_WORKERS = ("SELECT cluster_id, toFloat64(ts), action, worker, reason, stimulus_id, detail FROM "
                        "{lifecycle} WHERE {where} AND action IN ('scheduler_start', 'worker_added', "
                        "'worker_removed', 'restart', 'scheduler_close') ORDER BY cluster_id, ts")
#: What :func:`deaths` reads (from ``{worker_exits}``; ``{where}`` filled in where it is
#: run).
EXITS = ("SELECT cluster_id, worker, pid, toFloat64(ts), exitcode, signal, memory, "
         "memory_peak, memory_limit, memory_terminate, host_memory, host_memory_available, "
         "nanny_status FROM {worker_exits} WHERE {where}")
#: What :func:`deaths` reads (from ``{events}``; ``{where}`` filled in where it is run).
KILLS_AND_TTLS = ("SELECT cluster_id, toFloat64(ts), topic, msg FROM {events} WHERE {where} AND "
                  "(topic = 'worker-restart-memory' OR (topic = 'scheduler' AND "
                  "JSONExtractString(msg, 'action') = 'worker-ttl-timed-out') OR (topic IN "
                  "{{removed:Array(String)}} AND JSONExtractString(msg, 'action') = "
                  "'closing-worker'))")
#: What :func:`deaths` reads (from ``{envelopes}``; ``{where}`` filled in where it is run).
NANNY_CLUSTERS = "SELECT DISTINCT cluster_id FROM {envelopes} WHERE {where} AND source = 'nanny'"


def deaths(backend: Backend, ids: list[str] | None = None, since: TimeBound = None,
           until: TimeBound = None) -> list[Death]:
    """Every worker removal of the clusters ``ids`` (None: all) in [since, until),
    oldest first, each with its verdict. Five queries, whatever the number of
    clusters. A worker's process id and nanny come from its ``worker_added`` record,
    or from ``scheduler_start``'s list of the workers there before the recording."""
    where, p = clusters_condition(ids)
    _, life = backend.query(
        LIFECYCLE_OF_WORKERS.format(lifecycle=table(backend, 'lifecycle'), where=where), p)
    removed = sorted({w for _, _, a, w, *_ in life if a == "worker_removed" and w})
    if not removed:
        return []
    _, exit_rows = backend.query(
        EXITS.format(worker_exits=table(backend, 'worker_exits'), where=where), p)
    _, event_rows = backend.query(
        KILLS_AND_TTLS.format(events=table(backend, 'events'), where=where),
        {**p, "removed": removed})
    _, nanny_rows = backend.query(
        NANNY_CLUSTERS.format(envelopes=table(backend, 'envelopes'), where=where), p)
    with_nannies = {c for c, in nanny_rows}

    exits: dict[str, list[Exit]] = defaultdict(list)
    for c, worker, pid, ts, code, sig, mem, peak, limit, term, host, avail, status in exit_rows:
        exits[c].append(Exit(worker, pid, ts, code, sig, mem, peak, limit, term, host, avail, status))
    kills, ttls, closings = _events(event_rows)
    restarts, closes, added, removals = _lifecycle(life, since, until)
    out = []
    for r in removals:
        c = r.cluster_id
        facts = gather(r, exits[c], kills[c], ttls[c], closings[c], restarts[c], closes[c],
                       c in with_nannies)
        peaks = [v for v in (facts.exit.memory_peak if facts.exit else None,
                             facts.memory_kill.rss if facts.memory_kill else None) if v]
        limit = (facts.exit.memory_limit if facts.exit else None) or _int(
            added.get((c, r.worker), (None, {}))[1].get("memory_limit"))
        pid = r.pid if r.pid is not None else facts.exit.pid if facts.exit else None
        out.append(Death(c, r.worker, r.ts, r.stimulus_id, r.reason, r.expected, r.processing_tasks,
                         r.lost_computed_tasks, r.lost_scattered_tasks, pid, r.nanny, r.added,
                         max(peaks, default=None), limit, classify(facts), r))
    out.sort(key=lambda d: (d.ts, d.cluster_id))
    return out


def _events(event_rows: list[tuple]) -> tuple[dict, dict, dict]:
    """Per cluster: the nannies' memory kills, the scheduler's TTL timeouts and the
    workers' closings, from the events :func:`deaths` read."""
    kills: dict[str, list[MemoryKill]] = defaultdict(list)
    ttls: dict[str, list[TtlTimeout]] = defaultdict(list)
    closings: dict[str, list[Closing]] = defaultdict(list)
    for c, ts, topic, msg in event_rows:
        m = _detail(msg)
        if topic == "worker-restart-memory":
            kills[c].append(MemoryKill(str(m.get("worker") or ""), _int(m.get("pid")), ts,
                                       _int(m.get("rss"))))
        elif topic == "scheduler":
            workers = m.get("workers")
            ttl = m.get("ttl")
            ttls[c].append(TtlTimeout(ts, tuple(map(str, workers)) if isinstance(workers, list) else (),
                                      float(ttl) if isinstance(ttl, (int, float)) else None))
        else:
            closings[c].append(Closing(topic, ts, str(m.get("reason") or "")))
    return kills, ttls, closings


def _lifecycle(life: list[tuple], since: TimeBound, until: TimeBound) -> tuple:
    """Per cluster its restarts and closes, per (cluster, worker) when it joined and
    what it said then, and the removals in [since, until), from the lifecycle rows
    :func:`deaths` read."""
    start, stop = epoch(since, "since"), epoch(until, "until")
    restarts: dict[str, list[float]] = defaultdict(list)
    closes: dict[str, list[float]] = defaultdict(list)
    added: dict[tuple[str, str], tuple[float, dict]] = {}
    removals: list[Removal] = []
    for c, ts, action, worker, reason, stimulus_id, detail in life:
        if action == "restart":
            restarts[c].append(ts)
        elif action == "scheduler_close":
            closes[c].append(ts)
        elif action == "worker_added":
            added[(c, worker)] = (ts, _detail(detail))
        elif action == "scheduler_start":  # the workers there before the recording
            there = _detail(detail).get("workers")
            for address, info in (there.items() if isinstance(there, dict) else ()):
                if isinstance(info, dict):
                    added[(c, address)] = (None, info)
        elif (start is None or ts >= start) and (stop is None or ts < stop):
            info = _detail(detail)
            joined, joined_detail = added.get((c, worker), (None, {}))
            expected = info.get("expected")
            removals.append(Removal(
                c, worker, ts, stimulus_id, reason,
                expected if isinstance(expected, bool) else None,
                _int(info.get("processing_tasks")) or 0, _int(info.get("lost_computed_tasks")) or 0,
                _int(info.get("lost_scattered_tasks")) or 0, _int(joined_detail.get("pid")),
                joined_detail.get("nanny") if isinstance(joined_detail.get("nanny"), str) else None,
                "nanny" in joined_detail, joined))
    return restarts, closes, added, removals


def death_counts(backend: Backend, ids: list[str] | None = None) -> dict[str, int]:
    """cluster_id -> how many of its workers died (removals not expected)."""
    counts: dict[str, int] = defaultdict(int)
    for d in deaths(backend, ids):
        if d.is_death:
            counts[d.cluster_id] += 1
    return dict(counts)


# ----------------------------------------------------------- KilledWorker


#: What :func:`killed_workers` reads (from ``{transitions}``; ``{cwhere}`` filled in where
#: it is run).
KILLED_WORKERS = ("SELECT cluster_id, key, stimulus_id FROM {transitions} WHERE {cwhere} AND "
                  "source = 'scheduler' AND key IN {{keys:Array(String)}} AND start = "
                  "'processing' AND finish IN ('released', 'erred')")


def killed_workers(backend: Backend, ids: list[str] | None, found: list[Death] | None = None,
                   key: str | None = None, since: TimeBound = None,
                   until: TimeBound = None) -> list[KilledTask]:
    """Each task of the clusters ``ids`` that erred with KilledWorker (only ``key``
    if given), with its chain of deaths and its suspects. ``found``: the clusters'
    :func:`deaths`, if already computed."""
    where, p = clusters_condition(ids)
    if key is not None:
        where += " AND key = {key:String}"
        p["key"] = key
    start, stop = epoch(since, "since"), epoch(until, "until")
    if start is not None:
        where += " AND ts >= toDateTime64({since:Float64}, 6, 'UTC')"
        p["since"] = start
    if stop is not None:
        where += " AND ts < toDateTime64({until:Float64}, 6, 'UTC')"
        p["until"] = stop
    _, rows = backend.query(ERRED.format(
        transitions=table(backend, "transitions"),
        where=f"WHERE {where} AND startsWith(exception, 'KilledWorker')"), p)
    erred = [(c, k, prefix, ts, exception) for c, k, prefix, _, ts, _, exception in rows]
    if not erred:
        return []
    found = deaths(backend, sorted({r[0] for r in erred})) if found is None else found
    # Dask counts a removal against a task when it did not expect it (whatever its cause)
    counted = {(d.cluster_id, d.stimulus_id): d for d in found if d.expected is not True}
    keys = sorted({r[1] for r in erred})
    clusters = sorted({r[0] for r in erred})
    cwhere, cp = clusters_condition(clusters)
    _, left = backend.query(
        KILLED_WORKERS.format(transitions=table(backend, 'transitions'), cwhere=cwhere),
        {**cp, "keys": keys})
    chains: dict[tuple[str, str], list[Death]] = defaultdict(list)
    for c, k, stimulus_id in left:
        death = counted.get((c, stimulus_id))
        if death is not None and death not in chains[(c, k)]:
            chains[(c, k)].append(death)
    stimuli = sorted({d.stimulus_id for chain in chains.values() for d in chain}
                     | {d.stimulus_id for d in counted.values() if d.is_death})
    _, present = backend.query(TAKEN_OUT_OF_PROCESSING.format(
        transitions=table(backend, "transitions"), where=f"WHERE {cwhere}"),
        {**cp, "stimuli": stimuli})
    # death -> key -> (prefix, when the death released it from processing)
    running: dict[tuple[str, str], dict[str, tuple[str, float]]] = defaultdict(dict)
    for c, stimulus_id, k, prefix, _, _, _, released in present:
        running[(c, stimulus_id)][k] = (prefix, released)
    deaths_of_key: dict[tuple[str, str], int] = defaultdict(int)
    deaths_of_prefix: dict[tuple[str, str], int] = defaultdict(int)
    for (c, stimulus_id), tasks in running.items():
        if (c, stimulus_id) in counted and counted[(c, stimulus_id)].is_death:
            for k in tasks:
                deaths_of_key[(c, k)] += 1
            for p in {p for p, _ in tasks.values()}:
                deaths_of_prefix[(c, p)] += 1
    candidates = sorted({k for (c, stimulus_id), tasks in running.items() for k in tasks})
    entered = _entered_processing(backend, clusters, candidates)
    out = []
    for c, k, prefix, ts, exception in erred:
        chain = sorted(chains.get((c, k), []), key=lambda d: d.ts)
        out.append(_explain(c, k, prefix, ts, exception, chain, running, deaths_of_key,
                            deaths_of_prefix, entered, backend))
    return out


def _entered_processing(backend: Backend, clusters: list[str], keys: list[str]) -> dict:
    """(cluster_id, key) -> the times the key entered processing, ascending."""
    if not keys:
        return {}
    cwhere, cp = clusters_condition(clusters)
    _, rows = backend.query(ENTERED_PROCESSING.format(
        transitions=table(backend, "transitions"), where=f"WHERE {cwhere}"), {**cp, "keys": keys})
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for c, k, ts in rows:
        out[(c, k)].append(ts)
    return out


def _explain(cluster_id: str, key: str, prefix: str, ts: float, exception: str,
             chain: list[Death], running: dict, deaths_of_key: dict, deaths_of_prefix: dict,
             entered: dict, backend: Backend) -> KilledTask:
    at_each = [running.get((cluster_id, d.stimulus_id), {}) for d in chain]
    common = set(at_each[0]) if at_each else {key}
    for tasks in at_each[1:]:
        common &= set(tasks)
    prefix_of = {k: p for tasks in at_each for k, (p, _) in tasks.items()}
    prefix_of.setdefault(key, prefix)
    prefixes = {p for p, _ in at_each[0].values()} if at_each else {prefix}
    for tasks in at_each[1:]:
        prefixes &= {p for p, _ in tasks.values()}

    def processing_s(k: str) -> list[float]:
        """How long ``k`` had been processing on each dying worker: from its last
        entry into processing before the death released it (Dask sends the task on
        to another worker, into processing again, before the removal's record)."""
        times = entered.get((cluster_id, k), [])
        out = []
        for tasks in at_each:
            released = tasks[k][1]
            before = [t for t in times if t < released]
            out.append(round(released - before[-1], 6) if before else 0.0)
        return out

    footprint = _result_sizes(backend, cluster_id, sorted({prefix_of[k] for k in common if prefix_of[k]}))
    suspects = [Suspect(k, prefix_of[k], len(chain), deaths_of_key.get((cluster_id, k), 0),
                        processing_s(k), *footprint.get(prefix_of[k], (None, 0)),
                        deaths_of_prefix.get((cluster_id, prefix_of[k]), 0))
                for k in common]
    # Processing at more of the run's deaths first; then the task whose prefix's tasks
    # end on dying workers the most (not one whose siblings finish fine elsewhere);
    # then the one that had been processing longest at those deaths (a worker runs
    # what it was sent first: that one was executing, the others waiting behind it).
    suspects.sort(key=lambda s: (-s.cluster_deaths, -s.prefix_death_rate, -sum(s.processing_s),
                                 s.key))
    peaks = [d.memory_peak for d in chain]
    limit = next((d.memory_limit for d in reversed(chain) if d.memory_limit), None)
    n = len(chain)
    causes = sorted({d.verdict.cause.label for d in chain})
    if not chain:
        confidence, summary = MEDIUM, ("no recorded death counted against it (the removals that "
                                       "released it were not recorded)")
    elif len(suspects) == 1:
        s = suspects[0]
        confidence = HIGH
        summary = (f"{s.key} was the only task processing on each of the {n} workers that died "
                   f"({', '.join(causes)})")
    else:
        s, other = suspects[0], suspects[1]
        confidence = MEDIUM
        why = ("was at more of the run's deaths" if s.cluster_deaths > other.cluster_deaths
               else f"is of a prefix whose tasks ended on a dying worker {s.prefix_death_rate:.0%} "
                    f"of the time ({other.prefix}: {other.prefix_death_rate:.0%})"
               if s.prefix_death_rate > other.prefix_death_rate
               else "had been processing longest")
        summary = (f"{len(suspects)} tasks were processing on each of the {n} workers that died "
                   f"({', '.join(causes)}); {s.key} {why}")
    return KilledTask(cluster_id, key, prefix, ts, exception, chain, suspects, sorted(prefixes),
                      confidence, summary, peaks, limit)


#: What :func:`_result_sizes` reads (from ``{transitions}``).
RESULT_SIZES = ("SELECT prefix, max(nbytes), count() FROM {transitions} WHERE cluster_id = "
                "{{c:String}} AND source = 'scheduler' AND prefix IN {{p:Array(String)}} AND "
                "finish = 'memory' GROUP BY prefix")


def _result_sizes(backend: Backend, cluster_id: str, prefixes: list[str]) -> dict:
    """prefix -> (largest result in bytes, if known; how many) of its tasks that
    finished in memory."""
    if not prefixes:
        return {}
    _, rows = backend.query(
        RESULT_SIZES.format(transitions=table(backend, 'transitions')),
        {"c": cluster_id, "p": prefixes})
    return {prefix: (nbytes, n) for prefix, nbytes, n in rows}


# --------------------------------------------------------------- diagnose


def diagnose(backend: Backend, cluster: str | None = None, key: str | None = None,
             since: TimeBound = None, until: TimeBound = None, ids: list[str] | None = None,
             log_lines: int = LOG_LINES, found: list[Death] | None = None) -> dict:
    """One verdict per removal and per KilledWorker of the clusters named (or of
    ``ids``; every cluster when neither is given), with the evidence rows:

    ``deaths`` (every removal not expected), ``expected`` (the others), each a
    :meth:`Death.as_dict` plus ``tasks`` (what it was processing: key, prefix, then
    finish), ``logs`` (the lines about its process and its last warnings: ts, level,
    source, worker, logger, message), ``metrics`` (its last sample before the
    removal), ``timeline`` (the evidence, the lines and the sample by time) and, for a
    death, ``held_memory`` (what its worker held, :mod:`.held_memory`), and
    ``last_stack`` (what it was doing: :mod:`.last_stacks`); ``killed_workers`` (:meth:`KilledTask.as_dict`); ``counts``: deaths,
    expected ends, deaths by cause. With ``key``, only the KilledWorker of that task
    and the deaths of its chain. ``found``: the clusters' :func:`deaths` (every
    removal, no window), if already computed."""
    if ids is None:
        ids = cluster_ids(backend, cluster)
    every = deaths(backend, ids) if found is None else found
    start, stop = epoch(since, "since"), epoch(until, "until")
    found = [d for d in every if (start is None or d.ts >= start) and (stop is None or d.ts < stop)]
    killed = killed_workers(backend, ids, every, key, since, until)
    if key is not None:
        chain = {(d.cluster_id, d.stimulus_id) for k in killed for d in k.deaths}
        found = [d for d in found if (d.cluster_id, d.stimulus_id) in chain]
    evidence = _death_evidence(backend, found, log_lines)
    held = _held_at_deaths(backend, found)
    _add_last_stacks(backend, found, evidence)
    by_cause: dict[str, int] = defaultdict(int)
    out_deaths, out_expected = [], []
    for d in found:
        row = {**d.as_dict(), **evidence.get((d.cluster_id, d.stimulus_id, d.worker), {}),
               **held.get((d.cluster_id, d.stimulus_id, d.worker), {})}
        row["timeline"] = _timeline(row)
        if d.is_death:
            by_cause[d.verdict.cause.value] += 1
            out_deaths.append(row)
        else:
            out_expected.append(row)
    return {"deaths": out_deaths, "expected": out_expected,
            "killed_workers": [k.as_dict() for k in killed],
            "counts": {"deaths": len(out_deaths), "expected": len(out_expected),
                       "killed_workers": len(killed), "by_cause": dict(by_cause)}}


def _add_last_stacks(backend: Backend, found: list[Death], evidence: dict) -> None:
    """Each death's evidence gets ``last_stack``: what it was doing
    (:meth:`last_stacks.LastStack.as_dict`)."""
    for d, last in zip(found, last_stacks.of_deaths(backend, found)):
        evidence.setdefault((d.cluster_id, d.stimulus_id, d.worker), {})["last_stack"] = last.as_dict()


def _held_at_deaths(backend: Backend, found: list[Death]) -> dict:
    """(cluster_id, stimulus_id, worker) -> ``{"held_memory": ...}`` of each death
    (:meth:`held_memory.HeldMemory.as_dict`: what its worker held when it died)."""
    dead = [d for d in found if d.is_death]
    return {(d.cluster_id, d.stimulus_id, d.worker): {"held_memory": h.as_dict()}
            for d, h in zip(dead, held_memory.at_deaths(backend, dead))}


__all__ = ["Death", "KilledTask", "Suspect", "deaths", "death_counts", "killed_workers",
           "diagnose", "Cause"]
