"""Span trees rebuilt from scheduler transitions, with the semantics of
``distributed.spans`` and ``distributed.scheduler.TaskGroup``.

What Dask does, and how it is reproduced here from the wire events:

- A task is created in state ``released`` and counted in its TaskGroup's ``states``;
  every call of the ``TaskState.state`` setter moves one count from the old state to
  the new one, and the SchedulerPlugin sees each as one transition ``start ->
  finish`` (``start == finish`` means nothing moved, e.g. a task finished on a worker
  that has since left). Here a task is *created* at its key's first transition (one
  count in ``start``, which is ``released`` for a task seen from its birth), and each
  transition with ``start != finish`` moves one count.
- A TaskGroup belongs to the span it was first attached to (``TaskGroup.span_id``,
  carried by every transition); all its tasks count there, even those counted before
  the attachment. When the last task of a group is forgotten, Dask drops the group
  and a later task of the same name starts a new group; the same happens here, per
  cluster, through a registry of live keys -> (group, nbytes). The registry is also
  what attributes a ``forgotten`` transition, which carries no group on the wire.
- ``processing -> memory`` adds each startstop's duration, rounded to whole
  microseconds (``TaskGroup.add_duration``), to ``all_durations[action]`` and
  ``duration``; ``compute`` startstops move the group's ``start`` (earliest) and
  ``stop`` (latest). ``nbytes_total`` grows by the change of the task's ``nbytes``
  (``TaskState.set_nbytes``; a forgotten task's bytes stay counted).
- ``cumulative_worker_metrics`` sums the WORKER_DIGESTS rows that carry the span id,
  keyed like Dask's with the span id removed.

A span's snapshot is the roll-up of its tree (itself and all descendants), like
``Span``'s properties. ``done`` is true when no task of the tree is ``waiting``,
``no-worker``, ``queued`` or ``processing`` (``TaskGroup.done`` for every group).
``start`` is the earliest compute start of the tree (0 if none), raised to
``enqueued``. ``stop`` is the latest compute stop of the tree, raised to
``enqueued``: for a done span this is exactly Dask's ``Span.stop``; while a span is
not done Dask reports the current time instead, and the snapshot still carries the
latest stop seen (check ``done``).

``nthreads_intervals`` and ``active_cpu_seconds`` are Dask's, computed from the
cluster's copy of ``Scheduler.total_nthreads_history`` (LIFECYCLE ``total_nthreads``;
scheduler_start carries the whole history and replaces it, later events append):
Dask's span starts at the last history entry recorded before it was enqueued (here:
the last entry at or before ``enqueued``), and the intervals cover ``enqueued ..
stop`` with ``stop`` as above (for a span not done yet: the latest stop seen, where
Dask would use the current time). ``cumulative_worker_metrics`` then carries Dask's
derived ``("execute", "N/A", "idle or other spans", "seconds")`` entry,
``max(0, active_cpu_seconds - known execute seconds of the tree)``. Until the
cluster's history is known (a producer without ``total_nthreads``), the intervals
are empty, ``active_cpu_seconds`` is 0 and the derived entry is left out. A history
entry changes the snapshot (and version) of every span whose interval it falls in.

Input is checked before it changes anything: an event with a field of the wrong
type, a startstop whose duration does not fit in whole microseconds, the first task
of a new task group without a prefix (partials are per prefix), or a span that
would be its own ancestor (a self-parent, two spans each other's parent) raises
:class:`Rejected` naming the field, and the tree is left as it was. The tree never
holds a span cycle, also after :meth:`SpanTree.load` (which cuts any it finds and
reports them).

Not seen by a scheduler plugin, hence not counted: data scattered to the cluster
(``Scheduler.update_data`` sets states without a transition).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable

from dask_blackbox.contract import InvalidEvent

logger = logging.getLogger(__name__)

#: Task states that make a TaskGroup (and so its span) not done.
ACTIVE_STATES = ("waiting", "no-worker", "queued", "processing")
#: Dask's derived ``cumulative_worker_metrics`` key (``Span.cumulative_worker_metrics``).
IDLE_KEY = ("execute", "N/A", "idle or other spans", "seconds")

_NUMBER = (int, float)
#: Durations (microseconds) and sizes must stay below this: their sums must still be
#: exact and fit the 64-bit integers of the changelog and of ClickHouse.
_MAX_INT = 2**53


class Rejected(InvalidEvent):
    """An event the tree refuses; nothing was changed. ``field`` names the culprit."""


def _is_number(value) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _str_or_none(value, field: str) -> str | None:
    """``value`` (field ``field``), a string or None, or :class:`Rejected`."""
    if value is not None and type(value) is not str:
        raise Rejected(field, f"{value!r:.80} is a {type(value).__name__}, not a string")
    return value


class Aggregate:
    """Sums over tasks: what ``TaskGroup`` keeps, without the group identity."""

    __slots__ = ("states", "durations_us", "duration_us", "nbytes", "start", "stop")

    def __init__(self) -> None:
        self.states: dict[str, int] = {}
        self.durations_us: dict[str, int] = {}
        self.duration_us = 0
        self.nbytes = 0
        #: earliest compute start (0.0: none yet) and latest compute stop (0.0: none)
        self.start = 0.0
        self.stop = 0.0

    def merge(self, other: Aggregate) -> None:
        for s, n in other.states.items():
            self.states[s] = self.states.get(s, 0) + n
        for a, us in other.durations_us.items():
            self.durations_us[a] = self.durations_us.get(a, 0) + us
        self.duration_us += other.duration_us
        self.nbytes += other.nbytes
        if other.start and (not self.start or other.start < self.start):
            self.start = other.start
        if other.stop > self.stop:
            self.stop = other.stop

    def copy(self) -> Aggregate:
        """An empty Aggregate merged with this one (:meth:`merge`), without the merge:
        the same counts, and ``start``/``stop`` where the merge would keep them."""
        agg = Aggregate.__new__(Aggregate)
        agg.states = dict(self.states)
        agg.durations_us = dict(self.durations_us)
        agg.duration_us = self.duration_us
        agg.nbytes = self.nbytes
        agg.start = self.start if self.start else 0.0
        agg.stop = self.stop if self.stop > 0.0 else 0.0
        return agg

    @property
    def done(self) -> bool:
        """No task is waiting, no-worker, queued or processing (``TaskGroup.done``)."""
        return not any(map(self.states.get, ACTIVE_STATES))

    def to_record(self) -> dict:
        return {"states": self.states, "durations_us": self.durations_us,
                "duration_us": self.duration_us, "nbytes": self.nbytes,
                "start": self.start, "stop": self.stop}

    @classmethod
    def from_record(cls, rec: dict) -> Aggregate:
        agg = cls()
        agg.states = _counts(rec["states"], "states")
        agg.durations_us = _counts(rec["durations_us"], "durations_us")
        agg.duration_us = _int(rec["duration_us"], "duration_us")
        agg.nbytes = _int(rec["nbytes"], "nbytes")
        agg.start = _num(rec["start"], "start")
        agg.stop = _num(rec["stop"], "stop")
        return agg

    @classmethod
    def from_v1(cls, row: list) -> Aggregate:
        """Format 1 (positional): ``[states, durations_us, duration_us, nbytes, start,
        stop]``."""
        if not isinstance(row, list) or len(row) != 6:
            raise ValueError(f"format 1 aggregate must be a list of 6, got {row!r:.80}")
        return cls.from_record(dict(zip(
            ("states", "durations_us", "duration_us", "nbytes", "start", "stop"), row)))


def _counts(value, field: str) -> dict:
    if not isinstance(value, dict) or not all(
            type(k) is str and type(v) is int for k, v in value.items()):
        raise ValueError(f"{field} must map names to integers, got {value!r:.80}")
    return value


def _int(value, field: str) -> int:
    if type(value) is not int:
        raise ValueError(f"{field} must be an integer, got {value!r:.80}")
    return value


def _num(value, field: str) -> float:
    if not _is_number(value):
        raise ValueError(f"{field} must be a number, got {value!r:.80}")
    return value


class Span:
    """One span and the aggregates of the task groups *directly* attached to it."""

    __slots__ = ("id", "name", "parent_id", "enqueued", "children", "agg", "metrics",
                 "changed_at")

    def __init__(self, span_id: str):
        self.id = span_id
        #: None until the SPAN event is seen
        self.name: list[str] | None = None
        self.parent_id: str | None = None
        self.enqueued: float | None = None
        #: child span ids, in the order they appeared
        self.children: list[str] = []
        self.agg = Aggregate()
        #: (context, prefix, activity, unit) -> summed value
        self.metrics: dict[tuple, float] = {}
        #: the cluster's envelope count (``SpanTree.clock``) when this span last changed
        self.changed_at = 0

    def to_record(self) -> dict:
        """The span's checkpoint record (format 2, see :mod:`.cluster`)."""
        return {"name": self.name, "parent_id": self.parent_id, "enqueued": self.enqueued,
                "children": self.children, "agg": self.agg.to_record(),
                "metrics": [[*k, v] for k, v in self.metrics.items()],
                "changed_at": self.changed_at}

    @classmethod
    def from_record(cls, span_id: str, rec: dict) -> Span:
        """A span from its format 2 record; ValueError/KeyError/TypeError if bad."""
        s = cls(span_id)
        name, parent_id, enqueued = rec["name"], rec["parent_id"], rec["enqueued"]
        if name is not None and not (isinstance(name, list)
                                     and all(type(t) is str for t in name)):
            raise ValueError(f"name must be a list of strings, got {name!r:.80}")
        if parent_id is not None and type(parent_id) is not str:
            raise ValueError(f"parent_id must be a string, got {parent_id!r:.80}")
        if enqueued is not None:
            _num(enqueued, "enqueued")
        children = rec["children"]
        if not isinstance(children, list) or not all(type(c) is str for c in children):
            raise ValueError(f"children must be a list of span ids, got {children!r:.80}")
        s.name, s.parent_id, s.enqueued, s.children = name, parent_id, enqueued, children
        s.agg = Aggregate.from_record(rec["agg"])
        metrics = {}
        for row in rec["metrics"]:
            if not isinstance(row, list) or len(row) != 5 or not _is_number(row[-1]):
                raise ValueError(f"metrics row must be [context, prefix, activity, "
                                 f"unit, number], got {row!r:.80}")
            metrics[tuple(row[:-1])] = row[-1]
        s.metrics = metrics
        s.changed_at = _int(rec["changed_at"], "changed_at")
        return s

    @classmethod
    def from_v1(cls, span_id: str, row: list) -> Span:
        """Format 1 (positional): ``[name, parent_id, enqueued, children, aggregate,
        metrics, changed_at]``."""
        if not isinstance(row, list) or len(row) != 7:
            raise ValueError(f"format 1 span must be a list of 7, got {row!r:.80}")
        name, parent_id, enqueued, children, agg, metrics, changed_at = row
        if not isinstance(agg, list) or len(agg) != 6:
            raise ValueError(f"format 1 aggregate must be a list of 6, got {agg!r:.80}")
        return cls.from_record(span_id, {
            "name": name, "parent_id": parent_id, "enqueued": enqueued,
            "children": children,
            "agg": dict(zip(("states", "durations_us", "duration_us", "nbytes", "start",
                             "stop"), agg)),
            "metrics": metrics, "changed_at": changed_at})


class Group:
    """A live TaskGroup: its identity, the span it belongs to and its live task count.

    While not attached to a span, a group keeps its own aggregates (``pending``);
    attaching merges them into the span, as Dask's span then sees the whole group.
    """

    __slots__ = ("uid", "name", "prefix", "span_id", "live", "target")

    def __init__(self, uid: int, name: str, prefix: str | None):
        self.uid = uid
        self.name = name
        self.prefix = prefix
        self.span_id: str | None = None
        #: tasks created and not yet forgotten
        self.live = 0
        #: where this group's counts go: its span's Aggregate, or its own while unattached
        self.target = Aggregate()

    def to_record(self) -> dict:
        pending = None if self.span_id is not None else self.target.to_record()
        return {"uid": self.uid, "name": self.name, "prefix": self.prefix,
                "span_id": self.span_id, "live": self.live, "pending": pending}


def nthreads_intervals(
    times: list[float], counts: list[int], enqueued: float, stop: float, done: bool
) -> list[list]:
    """``Span.nthreads_intervals`` of a span enqueued at ``enqueued`` that stops at
    ``stop``, from the cluster's ``total_nthreads_history`` (as ``times`` and
    ``counts``), value for value as Dask computes them: the thread counts from the
    span's first entry on (``_nthreads_timeseries``) and the span's activity
    (``_active_timeseries``: ``enqueued <= t < stop``), forward-filled
    (``distributed.itertools.ffill``) on the grid of all their times."""
    # Dask's span starts at the last entry recorded before it was enqueued.
    first = max(bisect.bisect_right(times, enqueued) - 1, 0)
    limit = stop if done else 0
    series_t: list[float] = []
    series_n: list[int] = []
    for i in range(first, len(times)):
        t = times[i]
        if limit and t >= limit:
            break
        series_t.append(max(enqueued, t))
        series_n.append(counts[i])
    grid = sorted({*series_t, enqueued, stop})
    out = []
    # n: the count of the last series entry at or before the grid point (0 before any)
    j, n, m = 0, 0, len(series_t)
    for k in range(len(grid) - 1):
        t = grid[k]
        while j < m and series_t[j] <= t:
            n = series_n[j]
            j += 1
        if enqueued <= t < stop:
            out.append([t, grid[k + 1], n])
    return out


class SpanTree:
    """Spans, live groups and live keys of one cluster.

    It keeps its own books of what changed: :meth:`take_changed` (since the last
    checkpoint) and :meth:`take_unpublished` (since the last snapshot).
    """

    def __init__(self, max_keys: int, budget=None):
        self.max_keys = max_keys
        #: the processor's :class:`~.bounds.KeyBudget` (None: only ``max_keys`` bounds)
        self.budget = budget
        self.spans: dict[str, Span] = {}
        self.groups: dict[int, Group] = {}
        #: group name -> its live Group (a forgotten group's name may be reused)
        self.live_groups: dict[str, Group] = {}
        #: key -> [group uid, nbytes (-1: not yet known)]
        self.registry: dict[str, list] = {}
        self.next_group = 0
        #: transitions that could not be attributed to any group
        self.unattributed = 0
        #: the registry reached ``max_keys`` and stopped taking new keys
        self.overflowed = False
        #: the envelope being applied (``ClusterState.applied``), see ``Span.changed_at``
        self.clock = 0
        #: the cluster's ``Scheduler.total_nthreads_history``: times and thread counts
        self.nthreads_times: list[float] = []
        self.nthreads_counts: list[int] = []
        # Spans changed by the envelope being applied; changes since the last
        # checkpoint: registry keys (-> whether the key had a committed entry) and
        # spans; spans changed since the last snapshot.
        self._touched: set[str] = set()
        self._dirty_keys: dict[str, bool] = {}
        self._dirty_spans: set[str] = set()
        self._unpublished: set[str] = set()

    # ------------------------------------------------------------------ events

    def transition(self, ev: dict, partial: Callable, producer_id: str, seq: int) -> None:
        """Apply one scheduler TRANSITION event of envelope ``seq``
        (:meth:`transition_fields` of its fields; KeyError for a missing ``key``,
        ``start``, ``finish`` or ``ts``)."""
        self.transition_fields(
            ev["key"], ev["start"], ev["finish"], ev.get("group"), ev.get("prefix"),
            ev.get("span_id"), ev.get("startstops"), ev.get("nbytes"), ev["ts"], partial,
            producer_id, seq)

    def transition_fields(self, key, start, finish, group_name, prefix, span_id,
                          startstops, nbytes, ts, partial: Callable, producer_id: str,
                          seq: int) -> None:
        """Apply one scheduler transition of envelope ``seq``, given by the fields of
        its TRANSITION event (``group_name`` is its ``group``).

        ``partial(producer_id, seq, span_id, prefix, ts)`` returns the prefix partial
        the transition adds to (``prefix_stats.PrefixWindows.partial``).
        """
        # The hot path of the processors: one call per scheduler transition.
        if type(key) is not str or type(start) is not str or type(finish) is not str:
            for field, value in (("key", key), ("start", start), ("finish", finish)):
                if type(value) is not str:
                    raise Rejected(field, f"{value!r:.80} is not a string")
        costs = None
        if finish == "memory" and start == "processing":
            costs = _costs(startstops, nbytes)  # checked before anything changes
        entry = self.registry.get(key)
        if entry is None:
            group, entry = self._first_sight(key, group_name, prefix, span_id, start, finish)
            if group is None:
                return
        else:
            group = self.groups[entry[0]]
            if group.span_id is None and span_id is not None:
                self._attach(group, _str_or_none(span_id, "span_id"))
        if start == finish:
            return

        st = group.target.states
        st[start] = st.get(start, 0) - 1
        st[finish] = st.get(finish, 0) + 1
        span_id = group.span_id
        finished = partial(producer_id, seq, span_id, group.prefix, ts)
        counts = finished.finished
        counts[finish] = counts.get(finish, 0) + 1
        if costs is not None:
            self._task_finished(costs, group.target, finished, key, entry)
        elif finish == "forgotten":
            if entry is not None:
                del self.registry[key]
                if self.budget is not None:
                    self.budget.give_back()
                self._dirty_keys.setdefault(key, True)
            group.live -= 1
            if group.live <= 0:
                self._retire(group)
        elif finish == "erred":
            finished.n_erred += 1
        if span_id is not None:
            self._touched.add(span_id)

    def _first_sight(
        self, key: str, name, prefix, span_id, start: str, finish: str
    ) -> tuple[Group | None, list | None]:
        """A key's first transition: the task is created in ``start``, in its group
        ``name`` (a new one if no live group has that name). Returns the group (None:
        no group to attribute it to) and the key's registry entry (None: not
        registered)."""
        name = _str_or_none(name, "group")
        prefix = _str_or_none(prefix, "prefix")
        span_id = _str_or_none(span_id, "span_id")
        if name is None:
            self.unattributed += 1
            return None, None
        group = self.live_groups.get(name)
        if group is None:
            if prefix is None:  # (partials are per prefix: a new group needs one)
                raise Rejected("prefix", f"null for the first task of group {name!r:.80}")
            group = Group(self.next_group, name, prefix)
            self.next_group += 1
            self.groups[group.uid] = group
            self.live_groups[name] = group
        if group.span_id is None and span_id is not None:
            self._attach(group, span_id)
        group.live += 1
        st = group.target.states
        st[start] = st.get(start, 0) + 1
        entry = self._register(key, group.uid) if finish != "forgotten" else None
        return group, entry

    def _task_finished(self, costs: tuple, agg: Aggregate, part, key: str,
                       entry: list | None) -> None:
        startstops, nbytes = costs
        for action, begin, end, us in startstops:
            agg.duration_us += us
            agg.durations_us[action] = agg.durations_us.get(action, 0) + us
            part.durations_us[action] = part.durations_us.get(action, 0) + us
            if action == "compute":
                if agg.stop < end:
                    agg.stop = end
                if agg.start == 0.0 or agg.start > begin:
                    agg.start = begin
                if us > part.max_compute_us:
                    part.max_compute_us = us
        if nbytes is not None:
            old = -1 if entry is None else entry[1]
            diff = nbytes if old < 0 else nbytes - old
            agg.nbytes += diff
            part.nbytes += diff
            if entry is not None:
                entry[1] = nbytes
                self._dirty_keys.setdefault(key, True)

    def span(self, ev: dict) -> None:
        """Apply a SPAN event: a span's name, parent and enqueued time."""
        span_id = ev["span_id"]
        if type(span_id) is not str or not span_id:
            raise Rejected("span_id", f"{span_id!r:.80} is not a span id")
        name = ev.get("name")
        if name is not None and not (isinstance(name, list)
                                     and all(type(t) is str for t in name)):
            raise Rejected("name", f"{name!r:.80} is not a list of strings")
        enqueued = ev.get("enqueued")
        if enqueued is not None and not _is_number(enqueued):
            raise Rejected("enqueued", f"{enqueued!r:.80} is a "
                                       f"{type(enqueued).__name__}, not a number")
        parent_id = _str_or_none(ev.get("parent_id"), "parent_id")
        existing = self.spans.get(span_id)
        link = parent_id is not None and (existing is None or existing.parent_id is None)
        if link:
            if parent_id == span_id:
                raise Rejected("parent_id", "a span cannot be its own parent")
            ancestor = parent_id
            seen = set()
            while ancestor is not None and ancestor not in seen:
                if ancestor == span_id:
                    raise Rejected("parent_id", f"{parent_id} is a descendant of span "
                                                f"{span_id}: that would be a cycle")
                seen.add(ancestor)
                a = self.spans.get(ancestor)
                ancestor = a.parent_id if a is not None else None
        s = self._span(span_id)
        if name is not None:
            s.name = list(name)
        if enqueued is not None:
            s.enqueued = enqueued
        if link:
            s.parent_id = parent_id
            parent = self._span(parent_id)
            parent.children.append(s.id)
            self._touched.add(parent_id)
        self._touched.add(s.id)

    def digests(self, rows) -> None:
        """Apply the rows of a WORKER_DIGESTS event (``contract.DIGEST_ROW``)."""
        if not isinstance(rows, list):
            raise Rejected("digests", f"is a {type(rows).__name__}, not a list")
        for i, row in enumerate(rows):
            if (not isinstance(row, list) or len(row) != 6 or not _is_number(row[5])
                    or not all(v is None or type(v) is str for v in row[:5])):
                raise Rejected(f"digests[{i}]", f"{row!r:.80} is not [context, span_id, "
                                                "prefix, activity, unit, number]")
        for context, span_id, prefix, activity, unit, value in rows:
            if span_id is None:
                continue
            m = self._span(span_id).metrics
            k = (context, prefix, activity, unit)
            m[k] = m.get(k, 0) + value
            self._touched.add(span_id)

    def nthreads(self, entries, whole: bool) -> None:
        """Apply a LIFECYCLE ``total_nthreads``: entries ``[time, nthreads]`` appended
        to ``Scheduler.total_nthreads_history`` (``whole``: the whole history, from
        scheduler_start, which replaces what was known). Entries older than the last
        known one are already known. Every span whose interval a new entry falls in
        has changed."""
        if not isinstance(entries, list):
            raise Rejected("total_nthreads", f"is a {type(entries).__name__}, not a list")
        for i, e in enumerate(entries):
            if (not isinstance(e, list) or len(e) != 2 or not _is_number(e[0])
                    or type(e[1]) is not int):
                raise Rejected(f"total_nthreads[{i}]",
                               f"{e!r:.80} is not [time, number of threads]")
        times, counts = self.nthreads_times, self.nthreads_counts
        if whole:
            if [list(p) for p in zip(times, counts)] == entries:
                return
            times.clear()
            counts.clear()
        new = [(t, n) for t, n in entries if not times or t >= times[-1]]
        if not new:
            return
        earliest = new[0][0] if not whole else -float("inf")
        for t, n in new:
            times.append(t)
            counts.append(n)
        for sid, (stop, _) in self._tree_stops().items():
            if self.spans[sid].enqueued is not None and earliest < stop:
                self._touched.add(sid)

    # ---------------------------------------------------------------- internals

    def end_envelope(self) -> None:
        """The envelope being applied is done: stamp the spans it changed."""
        if self._touched:
            spans, clock = self.spans, self.clock
            for sid in self._touched:
                spans[sid].changed_at = clock
            self._dirty_spans |= self._touched
            self._unpublished |= self._touched
            self._touched = set()

    def take_changed(self) -> tuple[dict[str, Span], dict[str, list | None]]:
        """Spans and registry keys changed since the previous call (a key's value
        None: it is gone, and it had been returned before)."""
        spans = {sid: self.spans[sid] for sid in self._dirty_spans}
        registry = self.registry
        keys = {}
        for key, existed in self._dirty_keys.items():
            entry = registry.get(key)
            if entry is not None or existed:
                keys[key] = entry
        self._dirty_spans = set()
        self._dirty_keys = {}
        return spans, keys

    def take_unpublished(self) -> set[str]:
        """Spans changed since the previous call, with their ancestors (which roll
        them up)."""
        if not self._unpublished:
            return set()
        out = self.with_ancestors(self._unpublished)
        self._unpublished = set()
        return out

    def republish_all(self) -> None:
        """Count every span as changed since the last snapshot (after a recovery,
        whatever was published before a crash is published again)."""
        self._unpublished = set(self.spans)

    def open_spans(self) -> set[str]:
        """Spans whose tree is not done."""
        return {sid for sid, (_, done) in self._tree_stops().items() if not done}

    def release(self) -> None:
        """The tree is dropped: its keys go back to the budget."""
        if self.budget is not None:
            self.budget.give_back(len(self.registry))

    def _span(self, span_id: str) -> Span:
        s = self.spans.get(span_id)
        if s is None:
            s = self.spans[span_id] = Span(span_id)
        return s

    def _register(self, key: str, uid: int) -> list | None:
        if len(self.registry) >= self.max_keys:
            if not self.overflowed:
                self.overflowed = True
                logger.warning(
                    "more than %d live keys in one cluster (blackbox.processors."
                    "max-live-keys): new keys are no longer tracked, so their later "
                    "transitions count as new tasks and forgotten ones go unattributed",
                    self.max_keys,
                )
            return None
        if self.budget is not None and not self.budget.take():
            self.overflowed = True
            return None
        entry = self.registry[key] = [uid, -1]
        self._dirty_keys.setdefault(key, False)
        return entry

    def _attach(self, group: Group, span_id: str) -> None:
        span = self._span(span_id)
        span.agg.merge(group.target)
        group.target = span.agg
        group.span_id = span_id
        self._touched.add(span_id)

    def _retire(self, group: Group) -> None:
        del self.groups[group.uid]
        if self.live_groups.get(group.name) is group:
            del self.live_groups[group.name]

    def _postorder(self, span_ids: Iterable[str]) -> list[str]:
        """The given spans and their descendants, children before parents (no
        recursion: a tree may be deeper than Python's stack)."""
        out: list[str] = []
        seen: set[str] = set()
        spans = self.spans
        for root in span_ids:
            if root in seen:
                continue
            if not spans[root].children:  # a leaf
                seen.add(root)
                out.append(root)
                continue
            stack = [(root, False)]
            while stack:
                sid, expanded = stack.pop()
                if expanded:
                    out.append(sid)
                    continue
                if sid in seen:
                    continue
                seen.add(sid)
                stack.append((sid, True))
                stack.extend((c, False) for c in reversed(spans[sid].children)
                             if c not in seen)
        return out

    def _tree_stops(self) -> dict[str, tuple[float, bool]]:
        """Per span: the latest compute stop of its tree (raised to its enqueued)
        and whether the tree is done."""
        out: dict[str, tuple[float, bool]] = {}
        spans = self.spans
        for sid in self._postorder(list(spans)):
            s = spans[sid]
            stop, done = s.agg.stop, s.agg.done
            for c in s.children:
                cstop, cdone = out[c]
                stop = max(stop, cstop)
                done = done and cdone
            if s.enqueued is not None:
                stop = max(stop, s.enqueued)
            out[sid] = (stop, done)
        return out

    # ---------------------------------------------------------------- snapshots

    def rollup(self, span_ids: Iterable[str]) -> dict[str, tuple[Aggregate, dict, int]]:
        """Tree aggregates, tree metrics and latest ``changed_at`` of the given spans."""
        memo: dict[str, tuple[Aggregate, dict, int]] = {}
        wanted = list(span_ids)
        for sid in self._postorder(wanted):
            s = self.spans[sid]
            agg = s.agg.copy()
            metrics = dict(s.metrics)
            changed_at = s.changed_at
            for child in s.children:
                cagg, cmetrics, cchanged = memo[child]
                agg.merge(cagg)
                for k, v in cmetrics.items():
                    metrics[k] = metrics.get(k, 0) + v
                changed_at = max(changed_at, cchanged)
            memo[sid] = (agg, metrics, changed_at)
        return {sid: memo[sid] for sid in wanted}

    def with_ancestors(self, span_ids: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for sid in span_ids:
            while sid is not None and sid not in out:
                out.add(sid)
                sid = self.spans[sid].parent_id
        return out

    def snapshot(self, span_id: str, agg: Aggregate, metrics: dict, changed_at: int) -> dict:
        """The SPAN_STATE fields of one span from its tree aggregates (without the
        cluster fields and updated_at). The version is the tree's latest
        ``changed_at``: the same input always gives the same version to the same
        content, whenever and however often it is published."""
        s = self.spans[span_id]
        enqueued = s.enqueued
        start = agg.start
        stop = agg.stop
        done = agg.done
        intervals: list[list] = []
        known_history = enqueued is not None and bool(self.nthreads_times)
        if enqueued is not None:
            if start:
                start = max(start, enqueued)
            stop = max(stop, enqueued)
            if known_history:
                intervals = nthreads_intervals(self.nthreads_times, self.nthreads_counts,
                                               enqueued, stop, done)
        active = sum((t1 - t0) * n for t0, t1, n in intervals)
        if known_history:
            known = sum(v for k, v in metrics.items()
                        if k[0] == "execute" and k[-1] == "seconds" and k != IDLE_KEY)
            metrics = {**metrics, IDLE_KEY: max(0.0, active - known)}
        rows = [[*k, v] for k, v in metrics.items()]
        return {
            "span_id": span_id,
            "version": changed_at,
            "name": s.name,
            "parent_id": s.parent_id,
            "enqueued": enqueued,
            "start": start,
            "stop": stop,
            "duration": agg.duration_us / 1e6,
            "nbytes_total": agg.nbytes,
            "states": {k: v for k, v in agg.states.items() if v},
            "all_durations": {a: us / 1e6 for a, us in agg.durations_us.items()},
            "cumulative_worker_metrics": rows,
            "done": done,
            "nthreads_intervals": intervals,
            "active_cpu_seconds": float(active),
        }

    # ------------------------------------------------------------ persistence

    def meta(self) -> dict:
        return {
            "next_group": self.next_group,
            "unattributed": self.unattributed,
            "overflowed": self.overflowed,
            "groups": [g.to_record() for g in self.groups.values()],
            "nthreads": [[t, n] for t, n in zip(self.nthreads_times, self.nthreads_counts)],
        }

    def load(self, meta: dict, spans: dict[str, Span], registry: dict[str, list],
             fmt: int = 2) -> list[tuple[str, str]]:
        """Restore from :meth:`meta` (of record format ``fmt``), spans and the key
        registry. Returns ``(span_id, problem)`` for every link it had to cut: the
        loaded tree holds no cycle and no dangling parent or child."""
        self.next_group = meta["next_group"]
        self.unattributed = meta["unattributed"]
        self.overflowed = meta["overflowed"]
        self.spans = dict(spans)
        if self.budget is not None:
            self.budget.give_back(len(self.registry))
            self.budget.used += len(registry)
        self.registry = registry
        for t, n in meta.get("nthreads", ()):
            self.nthreads_times.append(t)
            self.nthreads_counts.append(n)
        problems = self._repair()
        for row in meta["groups"]:
            if fmt == 1:
                uid, name, prefix, span_id, live, pending = row
                pending = None if pending is None else Aggregate.from_v1(pending)
            else:
                uid, name, prefix, span_id, live = (
                    row["uid"], row["name"], row["prefix"], row["span_id"], row["live"])
                pending = None if row["pending"] is None else Aggregate.from_record(
                    row["pending"])
            g = Group(uid, name, prefix)
            g.live = live
            if span_id is None:
                g.target = pending
            else:
                g.span_id = span_id
                g.target = self._span(span_id).agg
            self.groups[uid] = self.live_groups[name] = g
        return problems

    def _repair(self) -> list[tuple[str, str]]:
        """Make the loaded span links consistent: children lists name exactly the
        spans that name them as parent, a missing parent exists (empty), and every
        link on a cycle is cut."""
        problems = []
        spans = self.spans
        for s in list(spans.values()):
            if s.parent_id is not None and s.parent_id not in spans:
                self._span(s.parent_id)
        for s in spans.values():
            s.children = [c for c in dict.fromkeys(s.children)
                          if c in spans and spans[c].parent_id == s.id]
        for s in spans.values():
            p = s.parent_id
            if p is not None and s.id not in spans[p].children:
                spans[p].children.append(s.id)
        state: dict[str, int] = {}  # 1: on the current path, 2: checked
        for sid in list(spans):
            path = []
            cur = sid
            while cur is not None and state.get(cur) is None:
                state[cur] = 1
                path.append(cur)
                cur = spans[cur].parent_id
            if cur is not None and state.get(cur) == 1:
                cycle = path[path.index(cur):]
                for member in cycle:
                    m = spans[member]
                    spans[m.parent_id].children.remove(member)
                    problems.append((member, f"its parent {m.parent_id} is its own "
                                             f"descendant (a cycle of {len(cycle)} span(s)); "
                                             "the parent link is dropped"))
                for member in cycle:
                    spans[member].parent_id = None
            for p in path:
                state[p] = 2
        return problems


def _costs(startstops, nbytes) -> tuple[list[tuple[str, float, float, int]], int | None]:
    """The startstops (action, start, stop, whole microseconds) and nbytes of a
    ``processing -> memory`` transition, checked."""
    out = []
    startstops = startstops or ()
    if not isinstance(startstops, (list, tuple)):
        raise Rejected("startstops", f"is a {type(startstops).__name__}, not a list")
    for i, ss in enumerate(startstops):
        try:
            action, begin, end = ss["action"], ss["start"], ss["stop"]
        except (KeyError, TypeError):
            raise Rejected(f"startstops[{i}]", f"{ss!r:.80} lacks action, start or "
                                               "stop") from None
        if type(action) is not str:
            raise Rejected(f"startstops[{i}].action", f"{action!r:.80} is not a string")
        if not _is_number(begin) or not _is_number(end):
            raise Rejected(f"startstops[{i}]", f"start {begin!r:.40} and stop "
                                               f"{end!r:.40} must be numbers")
        try:
            us = max(round((end - begin) * 1e6), 0)
        except (OverflowError, ValueError):
            us = _MAX_INT
        if us >= _MAX_INT:
            raise Rejected(f"startstops[{i}]", f"stop - start = {end!r} - {begin!r} "
                                               "overflows in whole microseconds")
        out.append((action, begin, end, us))
    if nbytes is not None and (type(nbytes) is not int or not -_MAX_INT < nbytes < _MAX_INT):
        raise Rejected("nbytes", f"{nbytes!r:.80} is not an integer of 53 bits")
    return out, nbytes
