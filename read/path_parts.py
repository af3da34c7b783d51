"""A critical path as :mod:`.critical_path` finds it: its links (:class:`Link`, each
task of the chain with the segments of its time, :class:`Segment`), the anomalies of
the recorded graph it met (:class:`GraphIssues`), the whole (:class:`CriticalPath`),
and how one link's time splits into its parts (:func:`link_segments`, from what the
task recorded, :class:`_Task`). The module docstring of :mod:`.critical_path` says
what each part means.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

#: The parts of a link, in the order they happen.
PARTS = ("client", "dependencies", "scheduler", "lost", "transfer", "disk", "thread", "compute")
#: How a link's predecessor was found (see the module docstring).
FOUND_BY = ("graph", "root", "stimulus", "not proven", "outside")
_FOUND_CODE = {1: "graph", 2: "root", 3: "stimulus", 4: "not proven"}
#: Graph anomalies shown by example (at most this many each).
EXAMPLES = 5


class NoActions(LookupError):
    """The scope holds no task that finished with recorded actions; the message says
    which scope."""


class Segment(NamedTuple):
    """A stretch of a link: ``part`` (one of :data:`PARTS`) from ``start`` to ``stop``."""

    part: str
    start: float
    stop: float


@dataclasses.dataclass(frozen=True)
class Link:
    """One task on the path and the time that led to its end."""

    key: str
    prefix: str
    worker: str
    span_id: str
    #: how its predecessor (the previous link, or the dependency outside the path) was found
    found_by: str
    #: the link covers [start, stop]: from the previous link's end to this one's
    start: float
    stop: float
    segments: tuple[Segment, ...]
    #: the task's compute as its worker reported it (where the task stream draws it)
    compute_start: float
    compute_stop: float
    #: the transitions the link is read from: (ts, start, finish, stimulus_id)
    evidence: tuple[tuple, ...]

    @property
    def seconds(self) -> float:
        return self.stop - self.start

    @property
    def parts(self) -> dict[str, float]:
        """Seconds per part (every part of :data:`PARTS`, zeros included)."""
        out = dict.fromkeys(PARTS, 0.0)
        for s in self.segments:
            out[s.part] += s.stop - s.start
        return out

    def as_dict(self) -> dict:
        return {"key": self.key, "prefix": self.prefix, "worker": self.worker,
                "span_id": self.span_id, "found_by": self.found_by, "start": self.start,
                "stop": self.stop, "seconds": self.seconds, "parts": self.parts,
                "segments": [s._asdict() for s in self.segments],
                "compute_start": self.compute_start, "compute_stop": self.compute_stop,
                "evidence": [{"ts": ts, "start": a, "finish": b, "stimulus_id": s}
                             for ts, a, b, s in self.evidence]}


@dataclasses.dataclass(frozen=True)
class GraphIssues:
    """What the recorded graph says that cannot be true."""

    #: dependencies naming a task the cluster never recorded: (key, dependency)
    dangling: tuple[tuple[str, str], ...] = ()
    n_dangling: int = 0
    #: dependencies whose result arrived after their dependent's: (key, dependency)
    backwards: tuple[tuple[str, str], ...] = ()
    n_backwards: int = 0
    #: a cycle of the recorded graph, if one was found: keys, first repeated last
    cycle: tuple[str, ...] = ()

    def notes(self) -> list[str]:
        out = []
        if self.cycle:
            out.append("the recorded graph has a cycle (" + " -> ".join(self.cycle)
                       + "); Dask cannot have run it as recorded: its dependencies were "
                       "followed only where their results arrived before their dependent's")
        if self.n_backwards and not self.cycle:
            k, d = self.backwards[0]
            out.append(f"{self.n_backwards:,} recorded dependencies first finished after "
                       f"their dependent (e.g. {k!r} on {d!r}): a wrong graph; not followed")
        if self.n_dangling:
            k, d = self.dangling[0]
            out.append(f"{self.n_dangling:,} recorded dependencies name a task this cluster "
                       f"never recorded (e.g. {k!r} on {d!r}); treated as already there")
        return out


@dataclasses.dataclass(frozen=True)
class CriticalPath:
    """The path, first link first, with the window it explains."""

    cluster_id: str
    span: str | None
    t0: float
    t1: float
    links: tuple[Link, ...]
    #: tasks in the scope, and how many of them had their graph recorded
    n_tasks: int
    n_graphed: int
    #: "graph", "actions" (no graph recorded), or "graph and actions" (part of it)
    basis: str
    issues: GraphIssues
    #: the key of the dependency outside the path the first link waited on, if any
    waited_on: str | None = None
    #: the walk stopped where the recorded arrivals stopped going back in time
    stopped: bool = False

    @property
    def wall(self) -> float:
        return self.t1 - self.t0

    @property
    def parts(self) -> dict[str, float]:
        out = dict.fromkeys(PARTS, 0.0)
        for link in self.links:
            for part, seconds in link.parts.items():
                out[part] += seconds
        return out

    @property
    def notes(self) -> list[str]:
        """What the reader should know about how far the path can be trusted."""
        out = []
        if self.basis == "actions":
            out.append("the graph of these tasks was not recorded: each dependency is the "
                       "task whose completion released it (the scheduler's stimulus ids)")
        elif self.basis == "graph and actions":
            out.append(f"the graph was recorded for {self.n_graphed:,} of {self.n_tasks:,} "
                       "tasks (graph-max-tasks, or a task with more dependencies than a "
                       "graph row lists); the others' dependencies come from the "
                       "scheduler's stimulus ids")
        if self.stopped and self.links:
            out.append(f"the walk stopped at {self.links[0].key!r}: its dependency's result "
                       "did not arrive before the one it led to (repeated stimulus ids, or "
                       "a corrupt record)")
        if self.links and self.links[0].found_by == "not proven":
            out.append(f"the walk stopped at {self.links[0].key!r}: it left the scheduler's "
                       "queue (or was released by its submission), and without its recorded "
                       "graph no dependency is proven")
        return out + self.issues.notes()

    def as_dict(self) -> dict:
        return {"cluster_id": self.cluster_id, "span": self.span, "t0": self.t0,
                "t1": self.t1, "wall": self.wall, "parts": self.parts, "basis": self.basis,
                "n_tasks": self.n_tasks, "n_graphed": self.n_graphed, "notes": self.notes,
                "waited_on": self.waited_on, "links": [link.as_dict() for link in self.links]}


class _Task(NamedTuple):
    key: str
    prefix: str
    worker: str
    span_id: str
    arrived: float
    entered: float          # last transition into processing before it finished
    submitted: float        # last released -> waiting before its first attempt
    actions: list[tuple[str, float, float]]
    evidence: tuple[tuple, ...]
    #: its first entry into processing since its previous finish (before ``entered``
    #: when an earlier attempt was lost: its worker died, and it ran again)
    first_entered: float = 0.0
    #: it had finished before: this is a computation again (its result was lost)
    recomputed: bool = False

    @property
    def compute(self) -> tuple[float, float]:
        """Its compute's first start and last stop (the worker's clock)."""
        computes = [(a, b) for action, a, b in self.actions if action == "compute"]
        return min(a for a, _ in computes), max(b for _, b in computes)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def link_segments(task: _Task, start: float, stop: float, ready: float | None,
                  ready_part: str, last: bool = False) -> list[Segment]:
    """The segments of a link from ``start`` to ``stop`` (see the module docstring),
    contiguous. ``ready``: when the task's last dependency arrived (None: no
    dependency), counted as ``ready_part`` ("scheduler" when that dependency is the
    previous link, else "dependencies"). ``last``: the link ends at the task's compute
    stop (the window's end), so what the worker did after it is not in it.

    Until the task reached a worker, the scheduler's times place the segments; from
    there, the worker's durations in the order it works: transfers, the wait for a
    thread, reading from disk, compute, writing to disk."""
    segments: list[Segment] = []
    t = start

    def take(part: str, seconds: float) -> None:
        nonlocal t
        until = min(t + max(seconds, 0.0), stop)
        if until > t:
            if segments and segments[-1].part == part:  # one stretch, not two
                segments[-1] = segments[-1]._replace(stop=until)
            else:
                segments.append(Segment(part, t, until))
            t = until

    if ready is None:  # a result lost and computed again was not the client's doing
        take("lost" if task.recomputed else "client", task.submitted - t)
    else:
        take(ready_part, ready - t)
    if t <= task.first_entered < task.entered:
        take("scheduler", task.first_entered - t)
        take("lost", task.entered - t)  # an attempt lost (its worker died), then again
    take("scheduler", task.entered - t)
    compute_stop = task.compute[1]
    actions = [(a, b - c) for a, c, b in task.actions if not last or b <= compute_stop]
    # (a, duration) pairs; transfers may overlap each other: count their union
    transfer = _union_length([(c, b) for a, c, b in task.actions if a == "transfer"
                              and (not last or b <= compute_stop)])
    before = sum(d for a, d in actions if a == "disk-read")
    after = sum(d for a, d in actions if a == "disk-write")
    compute = sum(d for a, d in actions if a not in ("transfer", "disk-read", "disk-write"))
    budget = stop - t
    work = transfer + before + compute + after
    scale = min(1.0, budget / work) if work > 0 else 1.0
    thread = max(0.0, budget - work * scale)
    for part, seconds in (("transfer", transfer * scale), ("thread", thread),
                          ("disk", before * scale), ("compute", compute * scale),
                          ("disk", after * scale)):
        take(part, seconds)
    if t < stop:  # rounding: the link ends where it ends
        take(segments[-1].part if segments else "thread", stop - t)
    return segments
