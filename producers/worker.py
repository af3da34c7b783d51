"""The worker producer: a WorkerPlugin publishing worker metrics and digests.

Every ``metrics-interval`` it publishes ``WORKER_METRICS`` (GIL contention when the
worker's system monitor measures it) and ``WORKER_DIGESTS``: the increase of every
``Worker.digests_total`` entry since the previous sample (Dask's fine performance
metrics, a task's own ``context_meter.digest_metric`` calls among them) as
:func:`digest_row` rows. What was published is remembered per Worker object, so a
replaced plugin never publishes the same increase twice.

Every few of Dask's profile cycles (:data:`PROFILE_CYCLES`) it publishes ``PROFILE``:
each cycle of ``Worker.profile_keys_history`` (per task prefix) and
``Worker.profile_history`` (the worker's whole profile, prefix "") not published yet,
its tree folded into stacks with their sample counts (:func:`folded`); at teardown the
cycle in progress (``profile_keys``, ``profile_recent``) too. What was published is
remembered per Worker object, as the digests are; a plugin attached to a worker that
has run for a while publishes the hour Dask keeps too, a few cycles at a time
(:data:`PROFILE_CATCH_UP_CYCLES`). The work is a walk of trees Dask no longer changes,
on the event loop that changes them (no lock), and an offer to the transport's buffer.

``blackbox.producer.record`` leaves kinds out (``metrics``, ``fine-metrics``,
``logs``, ``profiles``); with ``worker-transitions`` it also publishes the worker's own task
transitions (``TRANSITION`` with ``source="worker"``; Dask passes worker plugins no
stimulus id, so ``stimulus_id`` is null).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.spans import CONTEXTS_WITH_SPAN_ID
from tornado.ioloop import PeriodicCallback

from dask_blackbox.contract import (
    MAX_ENVELOPE_BYTES, PROFILE, WORKER_DIGESTS, WORKER_METRICS, Profile, WorkerDigests,
    WorkerMetrics, encode_key,
)
from dask_blackbox.producers import logs
from dask_blackbox.producers.encode import cap_text
from dask_blackbox.producers.rows import Ready, TransitionItem
from dask_blackbox.producers.scheduler import PLUGIN_NAME
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import Transport

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

#: ``Worker.digests_total`` values already published, per Worker object.
_PUBLISHED_DIGESTS: weakref.WeakKeyDictionary[Worker, dict] = weakref.WeakKeyDictionary()

#: Profile cycles between two publications of the profile.
PROFILE_CYCLES = 3
#: Longest text of one frame (``file:line:function``), in characters.
FRAME_MAX_CHARS = 400
#: Stacks of one PROFILE event, in characters at most (a cycle past it is split).
PROFILE_EVENT_CHARS = MAX_ENVELOPE_BYTES // 4
#: Cycles published at most at once, the oldest first (a plugin attached to a worker
#: that has run for a while catches up on the hour Dask keeps a little at a time, so
#: that the event loop is never held long).
PROFILE_CATCH_UP_CYCLES = 20


@dataclasses.dataclass
class _ProfilesPublished:
    """The newest entries of a Worker's ``profile_history`` and
    ``profile_keys_history`` published (compared by identity: Dask's deques hold each
    cycle's tuple until it is an hour old)."""

    history: Any = None
    keys_history: Any = None
    #: the trees of the cycle in progress published at a teardown
    partial: list = dataclasses.field(default_factory=list)


_PUBLISHED_PROFILES: weakref.WeakKeyDictionary[Worker, _ProfilesPublished] = (
    weakref.WeakKeyDictionary())


class BlackboxWorkerPlugin(WorkerPlugin):
    """Publishes one worker's metrics, digests (and optionally transitions).
    ``cluster_id``/``cluster_name``: the scheduler plugin's identity, if known where the
    plugin is built (:func:`producers.attach`); else learned from the scheduler."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, settings: ProducerSettings | None = None, cluster_id: str | None = None,
                 cluster_name: str | None = None):
        self.settings = settings if settings is not None else ProducerSettings.resolve()
        self.cluster_id = cluster_id
        self.cluster_name = cluster_name
        self.worker: Worker | None = None
        self.transport: Transport | None = None
        self._metrics: PeriodicCallback | None = None
        self._profiles: PeriodicCallback | None = None

    def __reduce__(self) -> tuple:
        """Only the settings (and the cluster's identity) travel."""
        return type(self), (self.settings, self.cluster_id, self.cluster_name)

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        record = self.settings.record
        self.transport = transport = Transport(
            self.settings, "worker", cluster_id=self.cluster_id,
            cluster_name=self.cluster_name or self.settings.cluster_name,
            worker=worker.address, scheduler=worker.scheduler)
        self._offer = transport.offer
        self._tasks_get: Callable[[Any], Any] = worker.state.tasks.get
        if record.logs:
            logs.install(transport, worker=worker.address)
        if record.metrics or record.fine_metrics:
            self._metrics = PeriodicCallback(self._sample,
                                             self.settings.metrics_interval * 1000)
            self._metrics.start()
        if record.profiles and "profile-cycle" in worker.periodic_callbacks:
            cycle = worker.periodic_callbacks["profile-cycle"].callback_time  # ms
            self._profiles = PeriodicCallback(self._publish_profiles, cycle * PROFILE_CYCLES)
            self._profiles.start()

    async def teardown(self, worker: Worker) -> None:
        """Last sample, then a flush bounded by ``close-timeout``."""
        transport = self.transport
        if transport is None:
            return
        if self._metrics is not None:
            self._metrics.stop()
            self._sample()
        if self._profiles is not None:
            self._profiles.stop()
            self._publish_profiles(final=True)
        logs.uninstall(transport)
        await transport.close()

    def _sample(self) -> None:
        record, w = self.settings.record, self.worker
        if w is None:  # not set up
            return
        try:
            if record.metrics:
                self._offer(Ready(self._metrics_event(w), 400))
            rows = self._digest_rows(w) if record.fine_metrics else None
            if rows:
                digests: WorkerDigests = {
                    "kind": WORKER_DIGESTS, "ts": time.time(),
                    "worker": w.address, "digests": rows,
                }
                self._offer(Ready(digests, 100 + 80 * len(rows)))
        except Exception:  # metrics must never break the worker
            logger.exception("dask-blackbox could not sample worker metrics")

    def _publish_profiles(self, final: bool = False) -> None:
        """The profile cycles not published yet, as PROFILE events (``final``: the
        cycle in progress too)."""
        w = self.worker
        if w is None:
            return
        try:
            for event in profile_events(w, final, self.settings.max_value_bytes,
                                        None if final else PROFILE_CATCH_UP_CYCLES):
                self._offer(Ready(event, 100 + sum(map(len, event["stacks"]))
                                  + 8 * len(event["counts"])))
        except Exception:  # profiles must never break the worker
            logger.exception("dask-blackbox could not publish the worker's profile")

    def _metrics_event(self, w: Worker) -> WorkerMetrics:
        recent = w.monitor.recent()
        memory: int | None = recent.get("memory")  # type: ignore[assignment]  # RSS, bytes
        try:
            spilled = w.data.spilled_total.memory  # type: ignore[attr-defined]  # sizeof() of the spilled keys
        except AttributeError:  # spilling disabled
            spilled = 0
        # As Dask's MemoryState: managed is what sits in RAM, unmanaged the rest.
        managed = max(w.state.nbytes - spilled, 0)
        event: WorkerMetrics = {
            "kind": WORKER_METRICS,
            "ts": time.time(),
            "worker": w.address,
            "memory": memory,
            "memory_managed": managed,
            "memory_unmanaged": max(memory - managed, 0) if memory is not None else None,
            "memory_spilled": spilled,
            "cpu": recent.get("cpu"),
            "executing": w.state.executing_count,
            "ready": len(w.state.ready),
            "in_flight": w.state.in_flight_tasks_count,
            "event_loop_interval": w._tick_interval_observed,
            "gil_contention": recent.get("gil_contention"),
        }
        return event

    def _digest_rows(self, w: Worker) -> list[list]:
        """Increases of the ``Worker.digests_total`` entries since last published, as
        :func:`digest_row` rows."""
        published = _PUBLISHED_DIGESTS.setdefault(w, {})
        rows = []
        for key, total in list(w.digests_total.items()):
            delta = total - published.get(key, 0)
            if not delta:
                continue
            published[key] = total
            rows.append(digest_row(key, delta))
        return rows

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        if not self.settings.record.worker_transitions or self.transport is None:
            return
        ts = self._tasks_get(key)
        names = None if ts is None else (ts.prefix, None, ts.span_id)
        self._offer(TransitionItem(key, start, finish, None, time.time(), None, names))


def digest_row(key: Hashable, value: float) -> list:
    """A ``Worker.digests_total`` entry as ``[context, span_id, prefix, activity,
    unit, value]``: a key of a span-keyed context (``(context, span_id, prefix,
    activity, unit)``) maps one to one; another tuple key keeps its context (first),
    activity (second to last) and unit (last) and joins what lies between into
    ``prefix``; a key that is not a tuple (``"latency"``, ``"tick-duration"``,
    ``"transfer-bandwidth"``) is a context of its own, without a unit."""
    if not isinstance(key, tuple) or not key:
        return [_text(key), None, None, None, None, value]
    context, *rest = key
    span_id = rest.pop(0) if context in CONTEXTS_WITH_SPAN_ID and rest else None
    activity, unit = (rest[-2:] + [None, None])[:2]
    prefix = ".".join(map(encode_key, rest[:-2])) or None
    return [_text(context), _text(span_id), _text(prefix), _text(activity), _text(unit), value]


def profile_events(w: Worker, final: bool, max_chars: int,
                   max_cycles: int | None = None) -> list[Profile]:
    """PROFILE events of the cycles of ``w`` not published yet, oldest first (at most
    ``max_cycles`` of them, the rest left for the next call), and of the cycle in
    progress if ``final``; remembers them as published (a cycle published in progress
    is not published again when Dask ends it)."""
    published = _PUBLISHED_PROFILES.setdefault(w, _ProfilesPublished())
    history = _unpublished(w.profile_history, published.history)[:max_cycles]
    keys_history = _unpublished(w.profile_keys_history, published.keys_history)[:max_cycles]
    if history:
        published.history = history[-1]
    if keys_history:
        published.keys_history = keys_history[-1]
    cycles: list[tuple[float, str, Mapping]] = [(ts, "", tree) for ts, tree in history]
    for ts, by_prefix in keys_history:
        cycles.extend((ts, prefix, tree) for prefix, tree in by_prefix.items())
    if final:
        now = time.time() + w.scheduler_delay  # as Dask dates a cycle
        cycles.append((now, "", w.profile_recent))
        cycles.extend((now, prefix, tree) for prefix, tree in w.profile_keys.items())
    if published.partial:
        cycles = [c for c in cycles if not any(c[2] is t for t in published.partial)]
    if final:
        published.partial = [w.profile_recent, *w.profile_keys.values()]
    events: list[Profile] = []
    for ts, prefix, tree in cycles:
        if not tree["count"]:
            continue
        stacks, counts = folded(tree, max_chars)
        for lo, hi in _parts(stacks):
            events.append({"kind": PROFILE, "ts": ts, "worker": w.address,
                           "prefix": encode_key(prefix), "stacks": stacks[lo:hi],
                           "counts": counts[lo:hi]})
    return events


def _unpublished(entries: Iterable, last: Any) -> list:
    """The entries after ``last`` (by identity), oldest first; all of them when
    ``last`` is not among them (none published yet, or gone from Dask's deque)."""
    out = []
    for entry in reversed(entries):  # type: ignore[call-overload]
        if entry is last:
            break
        out.append(entry)
    out.reverse()
    return out


def _parts(stacks: list[str]) -> list[tuple[int, int]]:
    """Ranges of ``stacks`` of at most PROFILE_EVENT_CHARS characters (one stack at
    least)."""
    parts, lo, size = [], 0, 0
    for i, stack in enumerate(stacks):
        if size and size + len(stack) > PROFILE_EVENT_CHARS:
            parts.append((lo, i))
            lo, size = i, 0
        size += len(stack)
    parts.append((lo, len(stacks)))
    return parts


def folded(tree: Mapping[str, Any], max_chars: int) -> tuple[list[str], list[int]]:
    """A tree of ``distributed.profile``, as a worker makes it, as folded stacks and
    their sample counts, the stacks' frames (:func:`frame_text`) from the outermost
    joined by ``;``.

    A worker's tree does not count a sample in its innermost frame
    (``Worker.trigger_profile`` processes each frame as a caller): a node's ``count``
    is the samples in which it called another frame, the root's every sample. So a
    node's samples beyond its children's ended in one of its children, which is
    innermost there: in those that have no count of their own (the frames only ever
    seen innermost) equally, or else in proportion to their counts (largest
    remainders: the stacks' counts add up to the root's). A stack longer than
    ``max_chars`` keeps its innermost frames, after one saying how many were cut."""
    stacks: list[str] = []
    counts: list[int] = []
    path: list[str] = []  # the frames of the node visited, from the outermost

    def visit(node: Mapping[str, Any]) -> None:
        children = node["children"]
        if not children:  # counted innermost (the low-level profiler's frames are)
            if node["count"] > 0 and path:
                stacks.append(_joined(path, max_chars))
                counts.append(node["count"])
            return
        frames = [(_frame(c), c) for c in children.values()]
        own = node["count"] - sum(c["count"] for _, c in frames)
        if own > 0:
            leaves = [(f, c) for f, c in frames if not c["count"]] or frames
            weights = [c["count"] or 1 for _, c in leaves]
            for (text, _), n in zip(leaves, _apportioned(own, weights)):
                if n:
                    path.append(text)
                    stacks.append(_joined(path, max_chars))
                    counts.append(n)
                    path.pop()
        for text, child in frames:
            path.append(text)
            visit(child)
            path.pop()

    visit(tree)
    return stacks, counts


#: frame_text of each node identifier seen lately (cleared past FRAME_CACHE entries)
_FRAMES: dict[str, str] = {}
FRAME_CACHE = 20_000


def _frame(node: Mapping[str, Any]) -> str:
    identifier = node["identifier"]
    text = _FRAMES.get(identifier)
    if text is None:
        d = node["description"]
        text = frame_text(identifier, d["filename"], d["name"], d["line_number"])
        if identifier.count(";") >= 2:  # the identifier says it all (else: the description)
            if len(_FRAMES) >= FRAME_CACHE:
                _FRAMES.clear()
            _FRAMES[identifier] = text
    return text


def _apportioned(total: int, weights: list[int]) -> list[int]:
    """``total`` split in integers in proportion to ``weights`` (largest remainders,
    ties to the first)."""
    whole = sum(weights)
    shares = [total * w // whole for w in weights]
    rest = sorted(range(len(weights)), key=lambda i: -(total * weights[i] % whole))
    for i in rest[:total - sum(shares)]:
        shares[i] += 1
    return shares


def _joined(frames: list[str], max_chars: int) -> str:
    stack = ";".join(frames)
    if len(stack) <= max_chars:
        return stack
    size, k = 0, len(frames)
    while k and size + len(frames[k - 1]) + 1 <= max_chars - 30:
        k -= 1
        size += len(frames[k]) + 1
    return ";".join((f"…[{k} outer frames cut]", *frames[k:]))


def frame_text(identifier: str, filename: str, name: str, line: int) -> str:
    """``file:line:function`` of a profile node: Dask's identifier
    (``name;filename;first line``) read back, the line where the function begins (as
    Dask tells frames apart), else the node's description; ``;`` and line breaks
    replaced (they separate frames and stacks), at most FRAME_MAX_CHARS characters."""
    parts = identifier.split(";")
    if len(parts) >= 3 and parts[-1].isdigit():
        name, filename, line = parts[0], ";".join(parts[1:-1]), int(parts[-1])
    text = f"{filename}:{line}:{name}"
    if ";" in text or "\n" in text or "\r" in text:
        text = text.replace(";", ",").replace("\r", " ").replace("\n", " ")
    return cap_text(text, FRAME_MAX_CHARS)


def _text(value: Any) -> str | None:
    return None if value is None else encode_key(value)


async def dask_setup(worker: Worker) -> None:
    """``dask worker --preload dask_blackbox.producers.worker``: attach the plugin, configured by
    this process's ``blackbox.*`` settings."""
    await worker.plugin_add(BlackboxWorkerPlugin(ProducerSettings.resolve()), name=PLUGIN_NAME)
