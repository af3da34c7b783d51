"""Why a worker left the cluster: the fixed vocabulary of causes, and the rules that
pick one from the facts recorded around a worker's removal.

The read side (``read/diagnosis.py``, from ClickHouse) and the stages that read the
raw stream (the alerts stage, the continuous OpenTelemetry exporter: they collect the
facts with :mod:`dask_blackbox.death_facts`) gather the same facts and call
:func:`classify` here, so a death has one cause wherever it is shown. Nothing here
does I/O.

The facts, and who records them:

==================  ==========================================================
:class:`Removal`    the scheduler's ``remove_worker`` (lifecycle ``worker_removed``:
                    stimulus, Dask's ``expected``; ``worker_added`` before it: the
                    process id and the nanny's address, None without a nanny)
:class:`Exit`       the worker's nanny, when the process ended (``worker_exits``:
                    exit status or signal, memory against the limit, nanny status)
:class:`MemoryKill` the nanny's memory monitor, before it terminates the process at
                    ``distributed.worker.memory.terminate`` (event
                    ``worker-restart-memory``: worker, pid, rss)
:class:`TtlTimeout` the scheduler's ``worker-ttl`` check (event
                    ``worker-ttl-timed-out``: the workers, the ttl)
:class:`Closing`    the worker itself as it closes (event ``closing-worker`` on the
                    worker's topic: Dask's close reason)
``restart``         the scheduler's restart hook (lifecycle ``restart``:
                    ``client.restart()``)
``close``           the scheduler's close (lifecycle ``scheduler_close``)
==================  ==========================================================

:func:`gather` picks, among a cluster's facts, those that concern one removal (the
same process id where both sides know it, else the same worker address close in
time); :func:`classify` applies these rules in order, the first that holds naming
the cause:

1. Dask expected the removal (``retire_workers``, a scale-down): **expected**.
2. The nanny's memory monitor killed that process: **memory limit**.
3. The worker-ttl check timed the worker out (its event, or the removal's stimulus):
   **stopped responding** (a task holding the GIL, a blocked event loop); its nanny
   then killed it.
4. The process ended on SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGSYS or SIGTRAP:
   **crashed in native code**.
5. A client asked for a restart (the worker's close reason or the removal's stimulus
   is the restart's; or a restart after the worker joined and shortly before, the
   process ending cleanly or killed when it did not close in time): **expected**.
   A worker that closed itself on a signal (``dask worker`` got SIGTERM or SIGINT
   from outside: a deployment scaling down, a preemption): **killed by the OS**.
6. The cluster was shutting down (a close reason of the nanny or the scheduler, the
   nanny closing, or the scheduler closing right after with the process ending
   cleanly): **expected**.
7. The process outlived its removal by :data:`OUTLIVED_S` or more, or closed itself
   because its connection to the scheduler broke: **connection lost**.
8. Any other signal, with no Dask decision behind it: **killed by the OS**. A SIGKILL
   names the kernel's OOM killer only when the evidence points at it (the process
   near its memory limit, or the host short of memory: :data:`OOM_NEAR`,
   :data:`HOST_SHORT`); far from both it says "not memory" and that something
   outside Dask sent it; SIGTERM: a batch system, a person.
9. An exit status (user code calling ``sys.exit``/``os._exit``, a fatal interpreter
   error): **exited on its own with status N**.
10. No exit recorded: without a nanny, or without a record from its nanny, the end
    of the process was not observed: **unknown (no nanny record)**, with what Dask
    saw. A removal Dask did not expect is never called expected on the strength of
    a time alone: the scheduler closing or a restart soon after explains it only
    with its nanny's record (the process ended cleanly, or its nanny was closing)
    or the worker's own close reason.

"unknown" is an honest answer: it says what is missing.
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Iterable
from typing import NamedTuple

from dask.utils import format_bytes


class Cause(str, enum.Enum):
    """The vocabulary. The value is the name used in settings and JSON; ``label`` is
    how a person reads it."""

    MEMORY_LIMIT = "memory-limit"
    KILLED = "killed"
    CRASHED = "crashed"
    EXITED = "exited"
    UNRESPONSIVE = "unresponsive"
    CONNECTION_LOST = "connection-lost"
    EXPECTED = "expected"
    UNKNOWN = "unknown"

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def is_death(self) -> bool:
        """Everything but an expected end is a death (counted and marked as one)."""
        return self is not Cause.EXPECTED


_LABELS = {
    Cause.MEMORY_LIMIT: "memory limit",
    Cause.KILLED: "killed by the OS",
    Cause.CRASHED: "crashed in native code",
    Cause.EXITED: "exited on its own",
    Cause.UNRESPONSIVE: "stopped responding (worker-ttl)",
    Cause.CONNECTION_LOST: "connection lost",
    Cause.EXPECTED: "expected",
    Cause.UNKNOWN: "unknown",
}

#: Confidence levels, highest first.
HIGH, MEDIUM, LOW = "high", "medium", "low"
CONFIDENCES = (HIGH, MEDIUM, LOW)

#: Signals of a process that crashed by itself.
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT", "SIGSYS",
                           "SIGTRAP"})
#: Close reasons (Dask's ``Worker.close(reason=...)``) of a cluster shutting down or
#: scaling down.
SHUTDOWN_REASONS = frozenset({"nanny-close", "nanny-close-gracefully", "scheduler-close",
                              "worker-close", "worker-close-gracefully",
                              "nanny-unregister-failed"})
#: The close reason of a worker whose connection to the scheduler broke.
CONNECTION_BROKEN_REASONS = frozenset({"worker-handle-scheduler-connection-broken"})
#: The close reason of a worker stopped by a signal (``dask worker``'s handler: "signal-15").
_SIGNAL_REASON = re.compile(r"signal-(\d+)")
#: A SIGKILL names the OOM killer when the process's peak RSS (its nanny's samples)
#: reached this fraction of its limit, or the host had less than HOST_SHORT of its
#: memory available; it rules memory out below FAR of the limit with at least
#: HOST_AMPLE of the host's memory available.
OOM_NEAR, HOST_SHORT = 0.8, 0.1
FAR, HOST_AMPLE = 0.5, 0.25
#: Nanny statuses of an expected end.
CLOSING_STATUSES = frozenset({"closing", "closed", "closing_gracefully"})

#: A process still alive this many seconds after its removal was not dead when the
#: scheduler removed it (generous: the nanny's clock may not be the scheduler's).
OUTLIVED_S = 10.0
#: A restart (``client.restart``) explains removals of workers that joined before it,
#: up to this long after it (Dask's restart waits for workers about 30 s).
RESTART_WINDOW_S = 35.0
#: A scheduler close explains removals up to this long before it.
SHUTDOWN_S = 10.0
#: A worker-ttl timeout explains a removal up to this long after it (Dask's restart
#: waits for the nanny, which kills a process that does not close in time).
TTL_WINDOW_S = 120.0
#: Facts matched by worker address (not pid) must lie this close to the removal.
NEAR_S = 60.0


# ------------------------------------------------------------------- the facts


class Removal(NamedTuple):
    """A worker removed from the scheduler."""

    cluster_id: str
    worker: str
    ts: float
    stimulus_id: str
    #: Dask's stimulus name without its time (``handle-worker-cleanup``, ...)
    reason: str
    #: Dask's ``expected`` (its remove-worker event); None if not recorded
    expected: bool | None
    #: tasks it was processing, results only it held, scattered data lost
    processing_tasks: int = 0
    lost_computed_tasks: int = 0
    lost_scattered_tasks: int = 0
    #: the worker process's id (worker_added), None if unknown
    pid: int | None = None
    #: its nanny's address, None without a nanny; ``nanny_known`` False when the
    #: worker_added record said nothing about it (recorded before it did)
    nanny: str | None = None
    nanny_known: bool = False
    #: when it joined (worker_added), None if unknown
    added: float | None = None


class Exit(NamedTuple):
    """A worker process's end, as its nanny saw it."""

    worker: str
    pid: int | None
    ts: float
    exitcode: int | None
    signal: str
    memory: int | None = None
    memory_peak: int | None = None
    memory_limit: int | None = None
    memory_terminate: float | None = None
    host_memory: int | None = None
    host_memory_available: int | None = None
    nanny_status: str = ""


class MemoryKill(NamedTuple):
    """The nanny's memory monitor terminating a process (``worker-restart-memory``)."""

    worker: str
    pid: int | None
    ts: float
    rss: int | None


class TtlTimeout(NamedTuple):
    """Workers the scheduler's worker-ttl check timed out (``worker-ttl-timed-out``)."""

    ts: float
    workers: tuple[str, ...]
    ttl: float | None


class Closing(NamedTuple):
    """A worker closing itself, with Dask's reason (``closing-worker``)."""

    worker: str
    ts: float
    reason: str


class Facts(NamedTuple):
    """What is known around one removal (:func:`gather`)."""

    removal: Removal
    exit: Exit | None = None
    memory_kill: MemoryKill | None = None
    ttl: TtlTimeout | None = None
    closing: Closing | None = None
    #: when a restart was asked for, and when the scheduler closed
    restart: float | None = None
    close: float | None = None
    #: whether any nanny of the cluster recorded anything (its plugin is attached)
    nanny_records: bool = False


class Evidence(NamedTuple):
    """One recorded row that supports a verdict: when, where it is recorded, what it
    says."""

    ts: float
    source: str
    text: str


class Verdict(NamedTuple):
    """A cause with its confidence, a one-line explanation, and its evidence."""

    cause: Cause
    confidence: str
    #: why, in one line, without the cause's label ("its nanny terminated it at ...")
    explanation: str
    evidence: tuple[Evidence, ...]

    @property
    def summary(self) -> str:
        """The label and the explanation: "memory limit: its nanny terminated it ..."."""
        return f"{self.cause.label}: {self.explanation}"

    def as_dict(self) -> dict:
        return {"cause": self.cause.value, "label": self.cause.label,
                "confidence": self.confidence, "explanation": self.explanation,
                "summary": self.summary, "evidence": [e._asdict() for e in self.evidence]}


class Classified(NamedTuple):
    """A removal with the verdict :func:`classify` gave it."""

    removal: Removal
    verdict: Verdict

    @property
    def is_death(self) -> bool:
        return self.verdict.cause.is_death


class LeftProcessing(NamedTuple):
    """A task that left processing without finishing in memory (a scheduler transition
    from processing to anything else: a worker's removal, sending it back to released
    or, its last allowed failure, to erred; a steal, a cancellation), and when it last
    entered processing. A removal's stimulus names the transitions it made: those of
    a death are the tasks the death took out of processing, which the continuous
    exporter (from the raw stream) and the read side (from ClickHouse) both find, the
    one to send a ``died`` span each, the other to draw them."""

    key: str
    prefix: str
    group: str
    span_id: str | None
    stimulus_id: str
    #: when it last entered processing (seconds since the epoch)
    entered: float
    #: the time of the transition out of processing
    left: float


# ----------------------------------------------------------------- gathering


def gather(removal: Removal, exits: Iterable[Exit] = (), memory_kills: Iterable[MemoryKill] = (),
           ttls: Iterable[TtlTimeout] = (), closings: Iterable[Closing] = (),
           restarts: Iterable[float] = (), closes: Iterable[float] = (),
           nanny_records: bool = False) -> Facts:
    """The facts of one removal among a cluster's (see the module docstring)."""
    t = removal.ts
    exit_ = _exit_of(removal, exits)
    pids = {p for p in (removal.pid, exit_.pid if exit_ else None) if p is not None}
    kill = _latest(k for k in memory_kills if k.pid in pids) if pids else None
    if kill is None:
        kill = _latest(k for k in memory_kills if k.worker == removal.worker
                       and t - NEAR_S <= k.ts <= t + 5.0 and (k.pid is None or not pids))
    ttl = _latest(x for x in ttls if removal.worker in x.workers and t - TTL_WINDOW_S <= x.ts <= t + 1.0)
    closing = _latest(c for c in closings if c.worker == removal.worker
                      and t - TTL_WINDOW_S <= c.ts <= t + 5.0)
    # a restart before the worker joined is not why it left
    joined = removal.added if removal.added is not None else t - RESTART_WINDOW_S
    restart = max((r for r in restarts if max(joined, t - RESTART_WINDOW_S) <= r <= t + 1.0),
                  default=None)
    close = min((c for c in closes if t - 1.0 <= c <= t + SHUTDOWN_S), default=None)
    return Facts(removal, exit_, kill, ttl, closing, restart, close, nanny_records)


def _exit_of(removal: Removal, exits: Iterable[Exit]) -> Exit | None:
    """The exit of the removed process: the same pid if both are known, else the
    exit of the same worker address nearest the removal (within NEAR_S before it,
    any time after it)."""
    exits = list(exits)
    if removal.pid is not None:
        same = [e for e in exits if e.pid == removal.pid]
        if same:
            return min(same, key=lambda e: abs(e.ts - removal.ts))
    near = [e for e in exits if e.worker == removal.worker and e.ts >= removal.ts - NEAR_S
            and (removal.pid is None or e.pid is None)]
    return min(near, key=lambda e: abs(e.ts - removal.ts)) if near else None


def _latest(items):
    return max(items, key=lambda x: x.ts, default=None)


# ---------------------------------------------------------------- classifying


def classify(facts: Facts) -> Verdict:
    """The cause of a removal (the rules of the module docstring, in order)."""
    r, x = facts.removal, facts.exit
    ev = _EvidenceList(facts)
    ev.removal()
    if r.expected is True:
        return ev.verdict(Cause.EXPECTED, HIGH,
                          f"Dask retired it ({r.reason or r.stimulus_id})")
    if facts.memory_kill is not None:
        k = facts.memory_kill
        ev.memory_kill()
        ev.exit()
        limit = (x.memory_limit if x else None)
        budget = ""
        if k.rss and limit:
            frac = f", terminates at {x.memory_terminate:.0%}" if x and x.memory_terminate else ""
            budget = (f" at {format_bytes(k.rss)} of its {format_bytes(limit)} limit "
                      f"({k.rss / limit:.0%}{frac})")
        elif k.rss:
            budget = f" at {format_bytes(k.rss)}"
        return ev.verdict(Cause.MEMORY_LIMIT, HIGH,
                          f"its nanny terminated it{budget} "
                          "(distributed.worker.memory.terminate)")
    if facts.ttl is not None or r.reason == "check-worker-ttl":
        ev.ttl()
        ev.exit()
        ttl = f" for {facts.ttl.ttl:g}s" if facts.ttl and facts.ttl.ttl else ""
        then = ""
        if x is not None and x.signal:
            then = f"; its nanny then ended it ({x.signal})"
        return ev.verdict(Cause.UNRESPONSIVE, HIGH,
                          f"no heartbeat{ttl} (distributed.scheduler."
                          f"worker-ttl): a task holding the GIL or a blocked event loop{then}")
    if x is not None and x.signal in CRASH_SIGNALS:
        ev.exit()
        return ev.verdict(Cause.CRASHED, HIGH,
                          f"the process died of {x.signal} "
                          f"(exit code {x.exitcode})")
    closing_reason = facts.closing.reason if facts.closing else ""
    # without its nanny's record, nothing says the process ended cleanly
    clean = x is not None and (x.exitcode in (0, None) or x.signal == "SIGKILL")
    asked = closing_reason.startswith("client-restart") or r.reason.startswith("client-restart")
    if asked or (facts.restart is not None and clean):
        ev.closing()
        ev.restart()
        ev.exit()
        how = "" if x is None or not x.signal else f", ended by {x.signal} when it did not close in time"
        return ev.verdict(Cause.EXPECTED, HIGH if asked else MEDIUM,
                          f"a client restarted the cluster (client.restart){how}")
    signalled = _SIGNAL_REASON.fullmatch(closing_reason)
    if signalled:
        ev.closing()
        ev.exit()
        name = _signal_name(int(signalled[1]))
        return ev.verdict(Cause.KILLED, MEDIUM,
                          f"{name} from outside Dask (a deployment scaling down, "
                          "a batch system's preemption, a person); the worker closed cleanly on it")
    closing_status = x is not None and x.nanny_status in CLOSING_STATUSES
    closing_at_close = facts.close is not None and x is not None and x.exitcode == 0
    if closing_reason in SHUTDOWN_REASONS or closing_status or closing_at_close:
        ev.closing()
        ev.exit()
        ev.close()
        why = (f"the worker closed ({closing_reason})" if closing_reason in SHUTDOWN_REASONS
               else "its nanny was closing" if closing_status
               else "the scheduler closed right after")
        return ev.verdict(Cause.EXPECTED, HIGH if closing_reason in SHUTDOWN_REASONS or closing_status
                          else MEDIUM, f"the cluster was closing or scaling down: {why}")
    if closing_reason in CONNECTION_BROKEN_REASONS:
        ev.closing()
        ev.exit()
        return ev.verdict(Cause.CONNECTION_LOST, HIGH,
                          "its connection to the scheduler broke and the "
                          f"worker closed itself ({closing_reason})")
    if x is not None and x.ts - r.ts >= OUTLIVED_S:
        ev.exit()
        return ev.verdict(Cause.CONNECTION_LOST, MEDIUM,
                          f"the scheduler removed it ({r.reason}) while its "
                          f"process lived on for {x.ts - r.ts:.0f}s more")
    if x is not None and x.signal:
        ev.exit()
        if x.signal == "SIGKILL":
            return ev.verdict(Cause.KILLED, MEDIUM, _sigkill(x))
        return ev.verdict(Cause.KILLED, MEDIUM,
                          f"{x.signal} from outside Dask (a batch system, "
                          "a person, a supervisor)" + _memory_note(x))
    if x is not None and x.exitcode is not None:
        ev.exit()
        if x.exitcode == 0:
            return ev.verdict(Cause.EXITED, MEDIUM,
                              "the process exited with status 0 (no close reason recorded)")
        return ev.verdict(Cause.EXITED, HIGH,
                          f"the process exited with status {x.exitcode} (user code called exit, "
                          "or the interpreter failed)")
    saw = f"the scheduler saw {r.reason or r.stimulus_id}" + (
        ", and Dask did not expect it" if r.expected is False else "")
    if r.nanny_known and r.nanny is None:
        return ev.verdict(Cause.UNKNOWN, LOW,
                          f"the worker had no nanny, so how its process ended was not "
                          f"observed ({saw})")
    if not facts.nanny_records:
        return ev.verdict(Cause.UNKNOWN, LOW,
                          "no nanny record (no nanny, or the nanny plugin was not "
                          f"attached); {saw}")
    return ev.verdict(Cause.UNKNOWN, LOW,
                      "no nanny record of how its process ended (it ended before its "
                      "nanny's plugin watched it, or it lives on behind a broken "
                      f"connection); {saw}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _sigkill(x: Exit) -> str:
    """A SIGKILL neither Dask nor the nanny sent, in the words its memory allows: the
    OOM killer is named only when the process was near its limit or the host short."""
    peak = x.memory_peak or x.memory
    near_limit = bool(peak and x.memory_limit and peak >= OOM_NEAR * x.memory_limit)
    host_short = bool(x.host_memory and x.host_memory_available is not None
                      and x.host_memory_available < HOST_SHORT * x.host_memory)
    note = _memory_note(x)[2:]
    if near_limit or host_short:
        where = " and ".join(w for w, yes in (("near its memory limit", near_limit),
                                               ("with the host short of memory", host_short)) if yes)
        return (f"SIGKILL {where} ({note}), and neither Dask nor its nanny decided it: "
                "the kernel's OOM killer (or a cgroup's) is the likely sender")
    far_limit = bool(peak and x.memory_limit and peak < FAR * x.memory_limit)
    host_ample = bool(x.host_memory and x.host_memory_available is not None
                      and x.host_memory_available >= HOST_AMPLE * x.host_memory)
    if far_limit and host_ample:
        return (f"not memory: {note}; something outside Dask sent SIGKILL (a person, a "
                "supervisor, a batch system, or the task itself)")
    if not note:
        return ("SIGKILL, and neither Dask nor its nanny decided it; its memory was not "
                "sampled, so neither the OOM killer nor a sender outside Dask is ruled out")
    return (f"SIGKILL, and neither Dask nor its nanny decided it ({note}): memory neither "
            "near a limit nor far from it, so the OOM killer is not ruled out")


def _memory_note(x: Exit) -> str:
    """The process's last memory against its limit and the host's."""
    parts = []
    peak = x.memory_peak or x.memory
    if peak:
        of = f" of its {format_bytes(x.memory_limit)} limit" if x.memory_limit else ""
        parts.append(f"peak {format_bytes(peak)}{of}")
    if x.host_memory and x.host_memory_available is not None:
        parts.append(f"host {format_bytes(x.host_memory_available)} free of "
                     f"{format_bytes(x.host_memory)}")
    return f"; {', '.join(parts)}" if parts else ""


class _EvidenceList:
    """The evidence of a verdict, in the order the rules looked at it."""

    def __init__(self, facts: Facts):
        self.facts = facts
        self.items: list[Evidence] = []

    def verdict(self, cause: Cause, confidence: str, explanation: str) -> Verdict:
        return Verdict(cause, confidence, explanation, tuple(sorted(self.items, key=lambda e: e.ts)))

    def removal(self) -> None:
        r = self.facts.removal
        expected = {True: "expected", False: "not expected", None: "expectation not recorded"}
        lost = (f"; it was processing {r.processing_tasks} task(s)" if r.processing_tasks else "")
        nanny = ("" if not r.nanny_known else f"; nanny {r.nanny}" if r.nanny else "; no nanny")
        self.items.append(Evidence(r.ts, "lifecycle", f"worker_removed {r.worker} "
                                   f"({r.stimulus_id}, {expected[r.expected]} by Dask){lost}{nanny}"))

    def exit(self) -> None:
        x = self.facts.exit
        if x is None or any(e.source == "worker_exits" for e in self.items):
            return
        how = (f"killed by {x.signal}" if x.signal else f"exited with status {x.exitcode}"
               if x.exitcode is not None else "still running as its nanny closed")
        mem = ""
        if x.memory_peak:
            limit = f" (limit {format_bytes(x.memory_limit)})" if x.memory_limit else ""
            mem = f", peak RSS {format_bytes(x.memory_peak)}{limit}"
        if x.host_memory and x.host_memory_available is not None:
            mem += (f", host {format_bytes(x.host_memory_available)} available of "
                    f"{format_bytes(x.host_memory)}")
        status = f", nanny {x.nanny_status}" if x.nanny_status else ""
        self.items.append(Evidence(x.ts, "worker_exits", f"process {x.pid} {how}{mem}{status}"))

    def memory_kill(self) -> None:
        k = self.facts.memory_kill
        if k is None:
            return
        rss = f" at RSS {format_bytes(k.rss)}" if k.rss else ""
        self.items.append(Evidence(k.ts, "events", f"worker-restart-memory: the nanny terminated "
                                   f"process {k.pid}{rss}"))

    def ttl(self) -> None:
        t = self.facts.ttl
        if t is None:
            return
        self.items.append(Evidence(t.ts, "events", f"worker-ttl-timed-out: no heartbeat from "
                                   f"{', '.join(t.workers)} within {t.ttl}s"))

    def closing(self) -> None:
        c = self.facts.closing
        if c is not None:
            self.items.append(Evidence(c.ts, "events", f"closing-worker: reason {c.reason}"))

    def restart(self) -> None:
        if self.facts.restart is not None:
            self.items.append(Evidence(self.facts.restart, "lifecycle", "restart (client.restart)"))

    def close(self) -> None:
        if self.facts.close is not None:
            self.items.append(Evidence(self.facts.close, "lifecycle", "scheduler_close"))
