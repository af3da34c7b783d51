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
latest stop seen (check ``done``). ``cumulative_worker_metrics`` does not include
Dask's synthetic ``("execute", "N/A", "idle or other spans", "seconds")`` entry,
which Dask derives from the scheduler's thread-count history at the time it is read.

Not seen by a scheduler plugin, hence not counted: data scattered to the cluster
(``Scheduler.update_data`` sets states without a transition).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

#: Task states that make a TaskGroup (and so its span) not done.
ACTIVE_STATES = ("waiting", "no-worker", "queued", "processing")


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

    def to_list(self) -> list:
        return [self.states, self.durations_us, self.duration_us, self.nbytes,
                self.start, self.stop]

    @classmethod
    def from_list(cls, row: list) -> Aggregate:
        agg = cls()
        (agg.states, agg.durations_us, agg.duration_us, agg.nbytes, agg.start,
         agg.stop) = row
        return agg


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

    def to_list(self) -> list:
        return [self.name, self.parent_id, self.enqueued, self.children,
                self.agg.to_list(), [[*k, v] for k, v in self.metrics.items()],
                self.changed_at]

    @classmethod
    def from_list(cls, span_id: str, row: list) -> Span:
        s = cls(span_id)
        s.name, s.parent_id, s.enqueued, s.children = row[:4]
        s.agg = Aggregate.from_list(row[4])
        s.metrics = {tuple(r[:-1]): r[-1] for r in row[5]}
        s.changed_at = row[6]
        return s


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

    def to_list(self) -> list:
        pending = None if self.span_id is not None else self.target.to_list()
        return [self.uid, self.name, self.prefix, self.span_id, self.live, pending]


class SpanTree:
    """Spans, live groups and live keys of one cluster."""

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
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
        # Spans changed by the envelope being applied; changes since the last
        # checkpoint: registry keys (-> whether the key had a committed entry) and
        # spans; spans changed since the last snapshot.
        self.touched: set[str] = set()
        self.dirty_keys: dict[str, bool] = {}
        self.dirty_spans: set[str] = set()
        self.unpublished: set[str] = set()

    # ------------------------------------------------------------------ events

    def transition(self, ev: dict, partial: Callable, producer_id: str, seq: int) -> None:
        """Apply one scheduler TRANSITION event of envelope ``seq``.

        ``partial(producer_id, seq, span_id, prefix, ts)`` returns the prefix partial
        the transition adds to (``prefix_stats.PrefixWindows.partial``).
        """
        # The hot path of the processors: one call per scheduler transition.
        key = ev["key"]
        start = ev["start"]
        finish = ev["finish"]
        entry = self.registry.get(key)
        if entry is None:
            group, entry = self._first_sight(key, ev, start, finish)
            if group is None:
                return
        else:
            group = self.groups[entry[0]]
            if group.span_id is None and ev.get("span_id") is not None:
                self._attach(group, ev["span_id"])
        if start == finish:
            return

        st = group.target.states
        st[start] = st.get(start, 0) - 1
        st[finish] = st.get(finish, 0) + 1
        span_id = group.span_id
        finished = partial(producer_id, seq, span_id, group.prefix, ev["ts"])
        counts = finished.finished
        counts[finish] = counts.get(finish, 0) + 1
        if finish == "memory":
            if start == "processing":
                self._task_finished(ev, group.target, finished, key, entry)
        elif finish == "forgotten":
            if entry is not None:
                del self.registry[key]
                self.dirty_keys.setdefault(key, True)
            group.live -= 1
            if group.live <= 0:
                self._retire(group)
        elif finish == "erred":
            finished.n_erred += 1
        if span_id is not None:
            self.touched.add(span_id)

    def _first_sight(
        self, key: str, ev: dict, start: str, finish: str
    ) -> tuple[Group | None, list | None]:
        """A key's first transition: the task is created in ``start``, in its group
        (a new one if no live group has that name). Returns the group (None: no group
        to attribute it to) and the key's registry entry (None: not registered)."""
        name = ev.get("group")
        if name is None:
            self.unattributed += 1
            return None, None
        group = self.live_groups.get(name)
        if group is None:
            group = Group(self.next_group, name, ev.get("prefix"))
            self.next_group += 1
            self.groups[group.uid] = group
            self.live_groups[name] = group
        if group.span_id is None and ev.get("span_id") is not None:
            self._attach(group, ev["span_id"])
        group.live += 1
        st = group.target.states
        st[start] = st.get(start, 0) + 1
        entry = self._register(key, group.uid) if finish != "forgotten" else None
        return group, entry

    def _task_finished(self, ev: dict, agg: Aggregate, part, key: str, entry: list | None) -> None:
        for ss in ev.get("startstops") or ():
            action = ss["action"]
            begin, end = ss["start"], ss["stop"]
            us = max(round((end - begin) * 1e6), 0)
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
        nbytes = ev.get("nbytes")
        if nbytes is not None:
            old = -1 if entry is None else entry[1]
            diff = nbytes if old < 0 else nbytes - old
            agg.nbytes += diff
            part.nbytes += diff
            if entry is not None:
                entry[1] = nbytes
                self.dirty_keys.setdefault(key, True)

    def span(self, ev: dict) -> None:
        """Apply a SPAN event: a span's name, parent and enqueued time."""
        s = self._span(ev["span_id"])
        name = ev.get("name")
        s.name = list(name) if name is not None else s.name
        if ev.get("enqueued") is not None:
            s.enqueued = ev["enqueued"]
        parent_id = ev.get("parent_id")
        if parent_id is not None and s.parent_id is None:
            s.parent_id = parent_id
            parent = self._span(parent_id)
            parent.children.append(s.id)
            self._touch(parent_id)
        self._touch(s.id)

    def digests(self, rows: Iterable[list]) -> None:
        """Apply the rows of a WORKER_DIGESTS event (``contract.DIGEST_ROW``)."""
        for context, span_id, prefix, activity, unit, value in rows:
            if span_id is None:
                continue
            m = self._span(span_id).metrics
            k = (context, prefix, activity, unit)
            m[k] = m.get(k, 0) + value
            self._touch(span_id)

    # ---------------------------------------------------------------- internals

    def end_envelope(self) -> None:
        """The envelope being applied is done: stamp the spans it changed."""
        if self.touched:
            spans, clock = self.spans, self.clock
            for sid in self.touched:
                spans[sid].changed_at = clock
            self.dirty_spans |= self.touched
            self.unpublished |= self.touched
            self.touched = set()

    def _touch(self, span_id: str) -> None:
        self.touched.add(span_id)

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
        entry = self.registry[key] = [uid, -1]
        self.dirty_keys.setdefault(key, False)
        return entry

    def _attach(self, group: Group, span_id: str) -> None:
        span = self._span(span_id)
        span.agg.merge(group.target)
        group.target = span.agg
        group.span_id = span_id
        self._touch(span_id)

    def _retire(self, group: Group) -> None:
        del self.groups[group.uid]
        if self.live_groups.get(group.name) is group:
            del self.live_groups[group.name]

    # ---------------------------------------------------------------- snapshots

    def rollup(self, span_ids: Iterable[str]) -> dict[str, tuple[Aggregate, dict, int]]:
        """Tree aggregates, tree metrics and latest ``changed_at`` of the given spans."""
        memo: dict[str, tuple[Aggregate, dict, int]] = {}

        def tree(sid: str) -> tuple[Aggregate, dict, int]:
            if sid in memo:
                return memo[sid]
            s = self.spans[sid]
            agg = Aggregate()
            agg.merge(s.agg)
            metrics = dict(s.metrics)
            changed_at = s.changed_at
            for child in s.children:
                cagg, cmetrics, cchanged = tree(child)
                agg.merge(cagg)
                for k, v in cmetrics.items():
                    metrics[k] = metrics.get(k, 0) + v
                changed_at = max(changed_at, cchanged)
            memo[sid] = (agg, metrics, changed_at)
            return memo[sid]

        return {sid: tree(sid) for sid in span_ids}

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
        if enqueued is not None:
            if start:
                start = max(start, enqueued)
            stop = max(stop, enqueued)
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
            "cumulative_worker_metrics": [[*k, v] for k, v in metrics.items()],
            "done": not any(agg.states.get(state) for state in ACTIVE_STATES),
        }

    # ------------------------------------------------------------ persistence

    def meta(self) -> dict:
        return {
            "next_group": self.next_group,
            "unattributed": self.unattributed,
            "overflowed": self.overflowed,
            "groups": [g.to_list() for g in self.groups.values()],
        }

    def load(self, meta: dict, spans: dict[str, list], registry: dict[str, list]) -> None:
        self.next_group = meta["next_group"]
        self.unattributed = meta["unattributed"]
        self.overflowed = meta["overflowed"]
        self.spans = {sid: Span.from_list(sid, row) for sid, row in spans.items()}
        self.registry = registry
        for uid, name, prefix, span_id, live, pending in meta["groups"]:
            g = Group(uid, name, prefix)
            g.live = live
            if span_id is None:
                g.target = Aggregate.from_list(pending)
            else:
                g.span_id = span_id
                g.target = self._span(span_id).agg
            self.groups[uid] = self.live_groups[name] = g
