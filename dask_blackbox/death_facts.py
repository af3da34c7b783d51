"""The facts of :mod:`dask_blackbox.causes`, collected from one cluster's raw events as
they arrive: what every stage that reads the raw stream keeps per cluster to name the
cause of a worker's removal (the alerts stage, the continuous OpenTelemetry exporter),
so that it gives the verdict the read side gives from ClickHouse.

:class:`DeathFacts` reads the contract's events (any source) and keeps:

==================  ==========================================================
``workers``         address -> :class:`Joined` (``worker_added``, and
                    ``scheduler_start``'s list of the workers there before the
                    recording); never forgotten
``exits``           :class:`~dask_blackbox.causes.Exit` (``worker_exit``)
``kills``           :class:`~dask_blackbox.causes.MemoryKill` (event
                    ``worker-restart-memory``)
``ttls``            :class:`~dask_blackbox.causes.TtlTimeout` (event
                    ``worker-ttl-timed-out`` on the ``scheduler`` topic)
``closings``        :class:`~dask_blackbox.causes.Closing` (event ``closing-worker``
                    on a worker's topic)
``restarts``        times of lifecycle ``restart``
``closes``          times of lifecycle ``scheduler_close``
``nanny_records``   whether an envelope from a nanny arrived (:meth:`DeathFacts.envelope`)
==================  ==========================================================

A ``worker_removed`` lifecycle event becomes a :class:`~dask_blackbox.causes.Removal`
(:meth:`DeathFacts.lifecycle` returns it, with the process id and nanny of its
``worker_added``); :meth:`DeathFacts.verdict` classifies it with the facts known when
it is called, so a caller decides when it has waited long enough. :meth:`DeathFacts.prune`
forgets facts (not workers, not closes) older than a time the caller names, usually
:data:`FACT_WINDOW_S` behind the newest event: every fact that can explain a removal
lies less than that before it.

:meth:`DeathFacts.state` is plain JSON (lists and dicts), and
:meth:`DeathFacts.from_state` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from dask_blackbox import contract
from dask_blackbox.causes import (
    Closing, Exit, Facts, MemoryKill, Removal, TtlTimeout, Verdict, classify, gather,
)

#: Facts older than this (event time) behind the newest event of the cluster can be
#: forgotten: the rules look at most TTL_WINDOW_S (120 s) before a removal.
FACT_WINDOW_S = 300.0


class Joined(NamedTuple):
    """What a worker's ``worker_added`` (or ``scheduler_start``) record said of it."""

    pid: int | None
    #: its nanny's address, None without one; ``nanny_known`` False when the record
    #: did not say
    nanny: str | None
    nanny_known: bool
    #: when it joined; None for a worker there before the recording
    added: float | None

    @classmethod
    def of(cls, detail: Mapping, ts: float | None) -> Joined:
        nanny = detail.get("nanny")
        return cls(_int(detail.get("pid")), nanny if isinstance(nanny, str) else None,
                   "nanny" in detail, ts)


_UNKNOWN = Joined(None, None, False, None)


class DeathFacts:
    """The facts of one cluster's worker removals, from its raw events."""

    def __init__(self, cluster_id: str) -> None:
        self.cluster_id = cluster_id
        self.nanny_records = False
        self.workers: dict[str, Joined] = {}
        self.exits: list[Exit] = []
        self.kills: list[MemoryKill] = []
        self.ttls: list[TtlTimeout] = []
        self.closings: list[Closing] = []
        self.restarts: list[float] = []
        self.closes: list[float] = []

    # --------------------------------------------------------------- reading

    def envelope(self, source: str) -> None:
        """An envelope of ``source`` arrived (a nanny's: its plugin is attached)."""
        if source == "nanny":
            self.nanny_records = True

    def read(self, ev: Mapping[str, Any]) -> Removal | None:
        """Take what one event (of any kind) says; the removal of a ``worker_removed``.
        Raises KeyError, TypeError or ValueError for an event the contract does not
        allow."""
        kind = ev["kind"]
        if kind == contract.LIFECYCLE:
            return self.lifecycle(ev)
        if kind == contract.WORKER_EXIT:
            self.worker_exit(ev)
        elif kind == contract.EVENT:
            self.structured(ev)
        return None

    def lifecycle(self, ev: Mapping[str, Any]) -> Removal | None:
        """A LIFECYCLE event; the :class:`Removal` of a ``worker_removed``."""
        action, ts = ev.get("action"), float(ev["ts"])
        raw = ev.get("detail")
        detail: dict = raw if isinstance(raw, dict) else {}
        worker = ev.get("worker")
        if action == "worker_added" and isinstance(worker, str):
            self.workers[worker] = Joined.of(detail, ts)
        elif action == "scheduler_start":  # the workers there before the recording
            there = detail.get("workers")
            for address, info in (there.items() if isinstance(there, dict) else ()):
                if isinstance(info, dict):
                    self.workers[str(address)] = Joined.of(info, None)
        elif action == "worker_removed" and isinstance(worker, str):
            joined = self.workers.get(worker, _UNKNOWN)
            expected = detail.get("expected")
            return Removal(self.cluster_id, worker, ts, str(ev.get("stimulus_id") or ""),
                           str(ev.get("reason") or ""),
                           expected if isinstance(expected, bool) else None,
                           _int(detail.get("processing_tasks")) or 0,
                           _int(detail.get("lost_computed_tasks")) or 0,
                           _int(detail.get("lost_scattered_tasks")) or 0,
                           joined.pid, joined.nanny, joined.nanny_known, joined.added)
        elif action == "restart":
            self.restarts.append(ts)
        elif action == "scheduler_close":
            self.closes.append(ts)
        return None

    def worker_exit(self, ev: Mapping[str, Any]) -> Exit:
        """A WORKER_EXIT event (a nanny's record of its process's end)."""
        x = Exit(str(ev.get("worker") or ""), _int(ev.get("pid")), float(ev["ts"]),
                 _int(ev.get("exitcode")), str(ev.get("signal") or ""), _int(ev.get("memory")),
                 _int(ev.get("memory_peak")), _int(ev.get("memory_limit")),
                 _float(ev.get("memory_terminate")), _int(ev.get("host_memory")),
                 _int(ev.get("host_memory_available")), str(ev.get("nanny_status") or ""))
        self.exits.append(x)
        return x

    def structured(self, ev: Mapping[str, Any]) -> None:
        """An EVENT (Dask's structured events: memory kills, worker-ttl timeouts,
        workers closing)."""
        topic, msg, ts = ev.get("topic"), ev.get("msg"), float(ev["ts"])
        if not isinstance(msg, dict):
            return
        if topic == "worker-restart-memory":
            self.kills.append(MemoryKill(str(msg.get("worker") or ""), _int(msg.get("pid")), ts,
                                         _int(msg.get("rss"))))
        elif topic == "scheduler" and msg.get("action") == "worker-ttl-timed-out":
            workers = msg.get("workers")
            self.ttls.append(TtlTimeout(ts, tuple(map(str, workers)) if isinstance(workers, list)
                                        else (), _float(msg.get("ttl"))))
        elif msg.get("action") == "closing-worker" and isinstance(topic, str):
            self.closings.append(Closing(topic, ts, str(msg.get("reason") or "")))

    # ------------------------------------------------------------ concluding

    def facts(self, removal: Removal) -> Facts:
        """The facts known now about ``removal`` (:func:`~dask_blackbox.causes.gather`)."""
        return gather(removal, self.exits, self.kills, self.ttls, self.closings, self.restarts,
                      self.closes, self.nanny_records)

    def verdict(self, removal: Removal) -> Verdict:
        """Its cause, from the facts known now (:func:`~dask_blackbox.causes.classify`)."""
        return classify(self.facts(removal))

    def prune(self, before: float) -> None:
        """Forget exits, memory kills, ttl timeouts, closings and restarts older than
        ``before`` (event time)."""
        self.exits = [e for e in self.exits if e.ts >= before]
        self.kills = [k for k in self.kills if k.ts >= before]
        self.ttls = [t for t in self.ttls if t.ts >= before]
        self.closings = [c for c in self.closings if c.ts >= before]
        self.restarts = [r for r in self.restarts if r >= before]

    # ----------------------------------------------------------------- state

    def state(self) -> dict:
        return {"nanny_records": self.nanny_records,
                "workers": {w: list(j) for w, j in self.workers.items()},
                "exits": [list(e) for e in self.exits], "kills": [list(k) for k in self.kills],
                "ttls": [[t.ts, list(t.workers), t.ttl] for t in self.ttls],
                "closings": [list(c) for c in self.closings], "restarts": self.restarts,
                "closes": self.closes}

    @classmethod
    def from_state(cls, cluster_id: str, s: Mapping) -> DeathFacts:
        f = cls(cluster_id)
        f.nanny_records = s["nanny_records"]
        f.workers = {w: Joined(*j) for w, j in s["workers"].items()}
        f.exits = [Exit(*e) for e in s["exits"]]
        f.kills = [MemoryKill(*k) for k in s["kills"]]
        f.ttls = [TtlTimeout(t, tuple(w), ttl) for t, w, ttl in s["ttls"]]
        f.closings = [Closing(*c) for c in s["closings"]]
        f.restarts, f.closes = list(s["restarts"]), list(s["closes"])
        return f


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
