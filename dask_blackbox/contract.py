"""The wire contract between producers, stream processors and sinks.

This is the only module the three layers share. It names the Kafka topics, defines
the batch envelope every raw message carries, the event kinds and their fields, and
the derived records the processors publish. Nothing here does I/O, and nothing here
imports a layer.

Every raw Kafka message is one *envelope*, a mapping::

    {"schema": 3, "cluster_id": "...", "cluster_name": "...", "source": "scheduler",
     "producer_id": "...", "seq": 17, "sent_at": 1700000000.123, "events": [...]}

encoded as MessagePack (version 3, what producers send) or as JSON (versions 1 and 2,
still read). The first byte tells them apart (:func:`is_msgpack`: a MessagePack map
header, which no JSON text begins with); readers decode either with
:func:`decode_envelope`. MessagePack, through msgspec, because the producers' cost is
what matters: a sender writes a capture (:data:`CAPTURE`: the items' fields a column at
a time, Dask's kwargs embedded as the bytes the hook already encoded, ``msgspec.Raw``)
and its envelope for about 0.7 µs a transition, msgspec's encoding 0.1-0.5 of it, where
version 2's rows and the JSON of their run cost 5.1-5.7 µs (a microbenchmark of
200,000 of the producers' own items, 4,000 a take, on a loaded machine); msgspec
decodes it in C, typed on the sink's and the processors' fast paths (each leaving
what it refuses to the untyped decoding), untyped for the other readers, with no
extension of our own. Arrow IPC would need pyarrow on every scheduler and its columns
built in Python first, which is what the capture already is.

``seq`` starts at 0 and increases by exactly one per envelope a producer sends, so a
gap seen downstream means envelopes were lost, never reordered (messages are keyed by
``cluster_id`` and a producer has a single in-flight sender). Every event is a mapping
with at least ``kind`` and ``ts`` (seconds since the epoch, the producer's clock).

Each event kind and each derived record is declared once, with its field types, as a
``TypedDict`` below (:data:`EVENTS`, :data:`RECORDS`); the field-name tuples
(:data:`EVENT_FIELDS`, :data:`SPAN_STATE_FIELDS`, ...) are derived from them. ``None``
means "unknown here", never an error. Readers must ignore fields they don't know, so
adding an optional field does not bump :data:`SCHEMA_VERSION`; removing or re-typing
one does.

Packed events (:data:`PACKED`): a run of consecutive events of one kind may travel as
one event holding them in columns (:data:`TRANSITION_RUN`: a producer's transitions,
about a quarter of their size as separate events; :data:`CAPTURE`: the same, written
straight from what the hook captured, keys as Dask made them and Dask's kwargs as they
came). A packed event stands for its events, in their order, at its place in
``events``: readers call :func:`expand_events` before they read the events (or
:func:`packed_columns` to read them as columns), and an event's index in its envelope
is its index in the expanded list. Version 2 of the envelope may hold TRANSITION_RUNs,
version 3 CAPTUREs too; version 1 holds no packed events, and is still read.

Adding a field: declare it in its TypedDict here (producers build events through
these declarations, the sink's column layouts are checked against them at import),
add its column in a new ``sinks/sql/NNN_*.sql`` migration, and read it in a query
(``read/``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from functools import lru_cache
from itertools import chain, repeat
from typing import Annotated, Any, Final, NamedTuple, TypedDict, get_type_hints

import msgspec
import orjson

SCHEMA_VERSION: Final = 3
#: Envelope versions this build reads: 1 (no packed events), 2 (TRANSITION_RUNs, JSON)
#: and 3 (CAPTUREs too, MessagePack).
READABLE_SCHEMAS: Final = (1, 2, 3)

class Envelope(TypedDict):
    """What every raw message carries (:func:`validate_envelope` checks it): who sent
    it, its ``seq``, when it was sent and its events (each a mapping with at least
    ``kind`` and ``ts``, of a kind of :data:`EVENTS` or :data:`PACKED`)."""

    schema: int
    cluster_id: str
    cluster_name: str | None
    source: str
    producer_id: str
    seq: int
    sent_at: float
    events: list[dict[str, Any]]


#: The envelope's fields, all required.
ENVELOPE_FIELDS: Final = tuple(Envelope.__annotations__)

#: Who sent an envelope.
SOURCES: Final = frozenset({"scheduler", "worker", "nanny", "client"})

#: Largest encoded envelope a producer sends and a processor accepts. Kafka's default
#: message.max.bytes is 1 MiB; staying under it keeps every broker default valid.
MAX_ENVELOPE_BYTES: Final = 900_000


# --------------------------------------------------------------------------- topics

#: Raw topic: every producer envelope, keyed by cluster_id.
RAW: Final = "raw"
#: Derived topic: versioned span snapshots (one record per changed span), keyed by
#: cluster_id. A later version of the same (cluster_id, span_id) supersedes earlier ones.
SPAN_STATE: Final = "span-state"
#: Derived topic: additive per-(cluster, span, prefix, window) partials.
PREFIX_STATS: Final = "prefix-stats"
#: Derived topic: sequence gaps detected per producer.
GAPS: Final = "gaps"
#: Messages on the raw topic that are not valid envelopes, with the reason.
DEAD_LETTER: Final = "dead-letter"

TOPICS: Final = (RAW, SPAN_STATE, PREFIX_STATS, GAPS, DEAD_LETTER)


def topic_name(prefix: str, topic: str) -> str:
    """Full Kafka topic name, e.g. ``topic_name("blackbox", RAW) == "blackbox.raw"``."""
    if topic not in TOPICS:
        raise ValueError(f"unknown blackbox topic {topic!r}; expected one of {TOPICS}")
    return f"{prefix}.{topic}" if prefix else topic


# --------------------------------------------------------------------------- events

#: A scheduler task transition, one per call of ``SchedulerPlugin.transition``
#: (worker-side transitions, when enabled, use the same kind with ``source="worker"``).
#: ``prefix``/``group``/``span_id`` are those of the TaskState at the time of the
#: transition, ``None`` once the task is forgotten. ``startstops`` is a list of
#: ``{"action", "start", "stop"}`` (plus ``"source"`` for transfers) exactly as Dask
#: passed it; ``exception``/``traceback`` are text.
TRANSITION: Final = "transition"
#: A graph submission (``SchedulerPlugin.update_graph``), in one or more parts (see
#: :class:`Graph`).
GRAPH: Final = "graph"
#: A span as it appears in ``scheduler.extensions["spans"]``.
SPAN: Final = "span"
#: A structured event (``log_event``) on any topic, including users' own.
EVENT: Final = "event"
#: Cluster lifecycle: worker/client added or removed, restart, close.
LIFECYCLE: Final = "lifecycle"
#: Periodic scheduler metrics.
SCHEDULER_METRICS: Final = "scheduler_metrics"
#: Periodic worker metrics.
WORKER_METRICS: Final = "worker_metrics"
#: Deltas of ``Worker.digests_total`` since the previous sample.
WORKER_DIGESTS: Final = "worker_digests"
#: A logging record.
LOG: Final = "log"
#: A worker process ended, as its nanny saw it.
WORKER_EXIT: Final = "worker_exit"
#: Envelopes a producer dropped because its buffer was full, published once the broker
#: is reachable again: ``{"dropped_events", "dropped_bytes", "since", "until"}``.
DROPS: Final = "drops"
#: One profile cycle of Dask's statistical profiler on one worker, for one task prefix
#: (or the whole worker), as folded stacks with their sample counts.
PROFILE: Final = "profile"
#: The stacks of every thread of a worker process, read from outside by its nanny
#: (py-spy) when the process neared the memory its nanny kills it at, or its event
#: loop stopped answering (where Dask's own profiler is stopped too).
STACKS: Final = "stacks"

class StartStop(TypedDict, total=False):
    """One entry of a transition's ``startstops``, as Dask passes it."""

    action: str
    start: float
    stop: float
    #: the worker a transfer came from (transfers only)
    source: str


class Event(TypedDict):
    """What every event carries."""

    kind: str
    #: seconds since the epoch, the producer's clock
    ts: float


#: Marks a :class:`Transition` field that Dask passes in the transition's keyword
#: arguments (``SchedulerPlugin.transition(..., **kwargs)``) under the same name: the
#: scheduler producer copies every such field out of them as it is
#: (:data:`TRANSITION_KWARGS`). A new one is this declaration plus its SQL column.
DASK_KWARG: Final = "dask-kwarg"


class Transition(Event):
    """TRANSITION: one call of ``SchedulerPlugin.transition`` (or the worker's).

    ``thread`` is the ident of the worker thread that ran the task (Dask's
    ``TaskFinishedMsg.thread``, what its task stream draws a row for), with
    processing->memory and processing->erred."""

    key: str
    prefix: str | None
    group: str | None
    span_id: str | None
    start: str
    finish: str
    stimulus_id: str | None
    worker: Annotated[str | None, DASK_KWARG]
    nbytes: Annotated[int | None, DASK_KWARG]
    typename: Annotated[str | None, DASK_KWARG]
    startstops: Annotated[list[StartStop] | None, DASK_KWARG]
    thread: Annotated[int | None, DASK_KWARG]
    exception: str | None
    traceback: str | None
    cause: str | None


class _GraphTaskBase(TypedDict):
    key: str
    prefix: str | None
    group: str | None
    span_id: str | None
    dependencies: list[str]


class GraphTask(_GraphTaskBase, total=False):
    """One entry of a graph event's ``tasks``. ``dependencies`` is capped like the
    tasks themselves; ``n_dependencies``, the true count, is sent only when it was."""

    n_dependencies: int


class _GraphBase(Event):
    client: str | None
    stimulus_id: str | None
    n_tasks: int
    keys: list[str]
    tasks: list[GraphTask]
    annotations: dict[str, list[dict[str, Any]]]


class Graph(_GraphBase, total=False):
    """GRAPH: one part of a graph submission.

    A submission's tasks, up to ``blackbox.producer.graph-max-tasks`` of them, travel
    in ``parts`` GRAPH events (``part`` 0, 1, ...; one event when both are absent),
    each under an envelope's size, with the same ``ts``, ``client`` and
    ``stimulus_id``; ``tasks`` lists each part's entries ``{"key", "prefix", "group",
    "span_id", "dependencies"}``. The submission's own fields are part 0's (the other
    parts repeat ``n_tasks`` and leave ``keys`` and ``annotations`` empty):
    ``n_tasks`` is the true count of tasks, ``n_recorded`` how many of them all the
    parts list (fewer than ``n_tasks`` past the setting), ``keys`` (the keys the client
    wants) is capped the same way and ``n_keys`` is their true count; ``annotations``
    maps each annotation name (span, retries, resources, ...) to its distinct values
    ``[{"value", "n_tasks"}, ...]``, most frequent first."""

    n_keys: int
    part: int
    parts: int
    n_recorded: int


class Span(Event):
    """SPAN: a span as it appears in ``scheduler.extensions["spans"]``. ``name`` is
    Dask's tuple of tags (a list on the wire)."""

    span_id: str
    name: list[str]
    parent_id: str | None
    enqueued: float


class StructuredEvent(Event):
    """EVENT: one ``log_event`` record; ``msg`` is the sanitized payload."""

    topic: str
    msg: Any


class _LifecycleBase(Event):
    action: str
    worker: str | None
    client: str | None
    reason: str | None
    stimulus_id: str | None
    detail: Any


class Lifecycle(_LifecycleBase, total=False):
    """LIFECYCLE: ``action`` is one of :data:`LIFECYCLE_ACTIONS`.

    ``total_nthreads`` (scheduler_start, worker_added, worker_removed) holds the
    entries ``[time, nthreads]`` of ``Scheduler.total_nthreads_history`` appended since
    the producer's previous lifecycle event, exactly as Dask recorded them (all of them
    in scheduler_start): what ``Span.nthreads_intervals`` is computed from.
    """

    total_nthreads: list[list[float]]


class SchedulerMetrics(Event):
    """SCHEDULER_METRICS: a periodic sample of the scheduler."""

    tasks_by_state: dict[str, int]
    n_workers: int | None
    n_threads: int | None
    memory: int | None
    memory_managed: int | None
    memory_unmanaged: int | None
    memory_spilled: int | None
    event_loop_interval: float | None


class WorkerMetrics(Event):
    """WORKER_METRICS: a periodic sample of one worker."""

    worker: str
    memory: int | None
    memory_managed: int | None
    memory_unmanaged: int | None
    memory_spilled: int | None
    cpu: float | None
    executing: int | None
    ready: int | None
    in_flight: int | None
    event_loop_interval: float | None
    gil_contention: float | None


class WorkerDigests(Event):
    """WORKER_DIGESTS: rows shaped as :data:`DIGEST_ROW`."""

    worker: str
    digests: list[list[Any]]


class Log(Event):
    """LOG: one logging record. ``worker`` is the address of the worker the logging
    process serves (a worker's, or its nanny's; None on the scheduler and a client),
    ``key`` the task a worker thread was running when it logged (None elsewhere)."""

    logger: str
    level: str
    message: str
    process: str | int | None
    exc_text: str | None
    worker: str | None
    key: str | None


class WorkerExit(Event):
    """WORKER_EXIT: a worker process its nanny ran has ended. ``exitcode`` is the
    process's exit status, or minus the signal that killed it (``signal`` names it);
    ``memory``/``memory_peak`` are its last and highest RSS the nanny sampled, against
    ``memory_limit`` and the fraction ``memory_terminate``
    (``distributed.worker.memory.terminate``) at which the nanny kills it;
    ``host_memory``/``host_memory_available`` the host's at the last sample;
    ``nanny_status`` the nanny's (``closing``: an expected end); ``starts`` how many
    worker processes this nanny had started, this one included; ``started`` when the
    nanny first saw this one."""

    worker: str | None
    pid: int | None
    exitcode: int | None
    signal: str | None
    memory: int | None
    memory_peak: int | None
    memory_limit: int | None
    memory_terminate: float | None
    host_memory: int | None
    host_memory_available: int | None
    nanny_status: str | None
    starts: int | None
    started: float | None


class Drops(Event):
    """DROPS: envelopes a producer dropped, published once the broker is back."""

    dropped_events: int
    dropped_bytes: int
    since: float
    until: float


class Profile(Event):
    """PROFILE: one cycle of a worker's profile (``Worker.profile_keys_history`` for a
    task prefix, ``Worker.profile_history`` for ``prefix`` ""), ``ts`` being the time
    Dask gave the cycle. ``stacks[i]`` is a folded stack, its frames
    ``file:line:function`` (the line where the function begins, as Dask's profile
    tells frames apart) from the outermost to the innermost, joined by ``;``;
    ``counts[i]`` the samples (every ``distributed.worker.profile.interval``) whose
    stack it was. A cycle's stacks may travel in several events of the same ``ts``."""

    worker: str
    prefix: str
    stacks: list[str]
    counts: list[int]


class Stacks(Event):
    """STACKS: the threads of the worker process ``pid`` (serving ``worker``, once it
    registered) as py-spy read them from outside, by its nanny, at ``ts``. ``reason``
    says why: ``"memory"`` (its RSS, ``memory``, had passed a high fraction of what the
    nanny terminates it at: ``memory_limit`` times
    ``distributed.worker.memory.terminate``) or ``"unresponsive"`` (its event loop had
    left the nanny's request unanswered for ``silent`` seconds, as when a task holds
    the GIL). Per thread ``i``: ``threads[i]`` its name, ``thread_ids[i]`` its OS id,
    ``stacks[i]`` its Python frames ``file:line:function`` (the line executing), from
    the outermost to the innermost, joined by ``;`` (as PROFILE's), ``active[i]``
    whether it was running rather than waiting (py-spy's reading), ``gil[i]``
    whether it held the GIL. ``error`` says why no stack was read (py-spy missing or
    not allowed to trace, the process gone), the lists then empty."""

    worker: str | None
    pid: int
    reason: str
    memory: int | None
    memory_limit: int | None
    silent: float | None
    threads: list[str]
    thread_ids: list[int]
    stacks: list[str]
    active: list[bool]
    gil: list[bool]
    error: str | None


#: Event kind -> its declaration.
EVENTS: Final[Mapping[str, type]] = {
    TRANSITION: Transition,
    GRAPH: Graph,
    SPAN: Span,
    EVENT: StructuredEvent,
    LIFECYCLE: Lifecycle,
    SCHEDULER_METRICS: SchedulerMetrics,
    WORKER_METRICS: WorkerMetrics,
    WORKER_DIGESTS: WorkerDigests,
    LOG: Log,
    WORKER_EXIT: WorkerExit,
    DROPS: Drops,
    PROFILE: Profile,
    STACKS: Stacks,
}


def fields(declaration: type) -> tuple[str, ...]:
    """The field names of a declaration, in declaration order (inherited first)."""
    return tuple(get_type_hints(declaration))


def field_types(declaration: type) -> dict[str, Any]:
    """Field name -> type of a declaration (the TypedDict's resolved annotations)."""
    return get_type_hints(declaration)


#: Fields each event kind carries besides ``kind`` and ``ts`` (derived from EVENTS).
EVENT_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    kind: tuple(f for f in fields(decl) if f not in ("kind", "ts"))
    for kind, decl in EVENTS.items()
}

#: The :class:`Transition` fields marked :data:`DASK_KWARG`, in declaration order.
TRANSITION_KWARGS: Final = tuple(
    name for name, hint in get_type_hints(Transition, include_extras=True).items()
    if DASK_KWARG in getattr(hint, "__metadata__", ()))

# ------------------------------------------------------------------ packed events

#: Consecutive TRANSITION events of one producer, in columns.
TRANSITION_RUN: Final = "transition_run"


class _TransitionRunBase(Event):
    key: list[str]
    time: list[float]
    start: list[str]
    finish: list[str]
    stimulus_id: list[str | None]
    names: list[list[str | None] | None]
    name: list[int]


class TransitionRun(_TransitionRunBase, total=False):
    """TRANSITION_RUN: ``n`` TRANSITION events in columns of ``n`` values, in order.

    ``key``, ``start``, ``finish`` and ``stimulus_id`` hold those fields of each event,
    ``time`` its ``ts``; ``names`` lists the distinct ``[prefix, group, span_id]`` of
    the run (null for a forgotten task) and ``name`` the index in ``names`` of each
    event's. The run's own ``ts`` is its first event's. The other fields of
    :class:`Transition` (:data:`RUN_OPTIONAL_COLUMNS`) are columns too, left out (or
    null) where every event of the run has None: most transitions carry nothing
    but what Dask's ``transition_log`` records."""

    worker: list[str | None]
    nbytes: list[int | None]
    typename: list[str | None]
    startstops: list[list[StartStop] | None]
    thread: list[int | None]
    exception: list[str | None]
    traceback: list[str | None]
    cause: list[str | None]



#: A run's columns that it always has, each as long as the run.
RUN_COLUMNS: Final = ("key", "time", "start", "finish", "stimulus_id", "name")
#: A run's columns that it may leave out: the TRANSITION fields after ``stimulus_id``
#: (what a transition may carry besides Dask's ``transition_log`` record), in order.
RUN_OPTIONAL_COLUMNS: Final = fields(Transition)[fields(Transition).index("stimulus_id") + 1:]
#: The fields of an event a run stands for, in :class:`Transition`'s order.
_RUN_EVENT_FIELDS: Final = ("kind", *fields(Transition)[1:])


#: Consecutive TRANSITION events of one producer as its hook captured them, in columns.
CAPTURE: Final = "capture"


class _CaptureBase(Event):
    time: list[float]
    key: list[Any]
    start: list[str]
    finish: list[str]
    stimulus_id: list[str | None]
    names: list[list[str | None] | None]
    name: list[int]


class Capture(_CaptureBase, total=False):
    """CAPTURE: ``n`` TRANSITION events in columns of ``n`` values, in order, as the
    hook captured them (envelope version 3).

    ``time``, ``start``, ``finish``, ``stimulus_id``, ``names`` and ``name`` are those
    of :class:`TransitionRun`. ``key`` holds each key as Dask made it: a string, a
    number, bytes, or an array for a tuple key (:func:`key_text` gives the text every
    other shape holds). ``kwargs`` holds, per event, the values of
    :data:`TRANSITION_KWARGS` in that order (an array at least that long: later
    entries are a newer contract's) or null where Dask passed none; ``error`` holds
    ``[exception, traceback, cause]`` (:data:`CAPTURE_ERROR`) of an erred transition,
    null elsewhere. Either may be left out where every event has null."""

    kwargs: list[list[Any] | None]
    error: list[list[str | None] | None]


#: The fields of an erred transition a capture's ``error`` column holds, in order.
CAPTURE_ERROR: Final = tuple(f for f in RUN_OPTIONAL_COLUMNS if f not in TRANSITION_KWARGS)
#: A capture's columns that it always has, each as long as the capture.
CAPTURE_COLUMNS: Final = ("key", "time", "start", "finish", "stimulus_id", "name")

#: Packed kind -> (its declaration, the kind of the events it stands for).
PACKED: Final[Mapping[str, tuple[type, str]]] = {
    TRANSITION_RUN: (TransitionRun, TRANSITION),
    CAPTURE: (Capture, TRANSITION),
}


class InvalidEvent(ValueError):
    """An event cannot be read; ``field`` names the field at fault."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


_NO_NAMES: Final = (None, None, None)


class RunShape(NamedTuple):
    """What :func:`run_shape` found: the run's length, its ``names`` table (an entry
    ``(prefix, group, span_id)`` per distinct name, a null entry as three Nones), and
    its optional columns (:data:`RUN_OPTIONAL_COLUMNS` -> the list, or None where left
    out)."""

    n: int
    names: list
    optional: dict[str, list | None]


def _common_shape(run: Mapping[str, Any], required: tuple[str, ...]) -> tuple[int, list]:
    """The length of a packed event's ``required`` columns (lists of one length, at
    least one value) and its ``names`` table, ``name`` checked against it."""
    n = None
    for column in required:
        values = run.get(column)
        if type(values) is not list:
            raise InvalidEvent(column, f"expected a list, got {type(values).__name__}")
        if n is None:
            n = len(values)
            if not n:
                raise InvalidEvent(column, "a run of no events")
        elif len(values) != n:
            raise InvalidEvent(column, f"{len(values)} values, {required[0]} has {n}")
    names = run.get("names")
    if type(names) is not list:
        raise InvalidEvent("names", f"expected a list, got {type(names).__name__}")
    table = []
    for entry in names:
        if entry is None:
            entry = _NO_NAMES
        elif type(entry) not in (list, tuple) or len(entry) != 3:
            raise InvalidEvent("names", f"{entry!r:.80} is not [prefix, group, span_id] "
                                        "or null")
        table.append(entry)
    index = run["name"]
    if not set(map(type, index)) <= {int} or min(index) < 0 or max(index) >= len(table):
        raise InvalidEvent("name", f"expected indexes into names (0..{len(table) - 1})")
    assert n is not None  # required is not empty
    return n, table


def _optional(run: Mapping[str, Any], column: str, n: int) -> list | None:
    values = run.get(column)
    if values is not None and type(values) is not list:
        raise InvalidEvent(column, f"expected a list or null, got {type(values).__name__}")
    if values is not None and len(values) != n:
        raise InvalidEvent(column, f"{len(values)} values, key has {n}")
    return values


def run_shape(run: Mapping[str, Any]) -> RunShape:
    """Check the shape of a :data:`TRANSITION_RUN` (lists of one length, ``names``
    entries of three, ``name`` in range), not its values: a reader checks them as it
    checks any TRANSITION event's. Raises :class:`InvalidEvent` naming the column."""
    n, table = _common_shape(run, RUN_COLUMNS)
    optional = {column: _optional(run, column, n) for column in RUN_OPTIONAL_COLUMNS}
    return RunShape(n, table, optional)


def run_columns(run: Mapping[str, Any]) -> dict[str, list]:
    """The TRANSITION fields of a :data:`TRANSITION_RUN`'s events as columns: field ->
    one value per event, for every field of :class:`Transition` but ``kind`` (``ts``
    from ``time``, ``prefix``/``group``/``span_id`` from ``names``, a column left out
    all None). Its shape is checked by :func:`run_shape` (InvalidEvent), its values
    are not."""
    n, table, optional = run_shape(run)
    prefix, group, span_id = zip(*map(table.__getitem__, run["name"]))
    columns = {"ts": run["time"], "key": run["key"], "prefix": list(prefix),
               "group": list(group), "span_id": list(span_id), "start": run["start"],
               "finish": run["finish"], "stimulus_id": run["stimulus_id"]}
    for column, values in optional.items():
        columns[column] = [None] * n if values is None else values
    return columns


def unpack_run(run: Mapping[str, Any]) -> list[dict]:
    """The TRANSITION events of a :data:`TRANSITION_RUN`, each with every field of
    :class:`Transition` in declaration order; raises :class:`InvalidEvent`."""
    columns = run_columns(run)
    names = _RUN_EVENT_FIELDS
    values = [repeat(TRANSITION), *map(columns.__getitem__, names[1:])]
    return list(map(dict, map(zip, repeat(names), zip(*values))))


_KEY_TYPES: Final = frozenset({str, int, float, bytes, list})
_flat_key_text = lru_cache(1 << 16)(str)


def key_text(key: Any) -> str:
    """:func:`encode_key` of a key as a :data:`CAPTURE` holds it (a tuple key arrives
    as an array); raises :class:`InvalidEvent` for what is no Dask key."""
    t = type(key)
    if t is str:
        return key
    if t is list:
        try:  # a flat tuple key: its text remembered (a task's transitions share its key)
            return _flat_key_text(tuple(key))
        except TypeError:  # a part that is a list (a nested tuple), or no key's part
            return str(_tupled(key))
    if t in _KEY_TYPES and t is not bool:
        return str(key)
    raise InvalidEvent("key", f"{key!r:.80} is not a Dask key")


def _tupled(key: list) -> tuple:
    parts = []
    for part in key:
        t = type(part)
        if t is list:
            part = _tupled(part)
        elif t not in _KEY_TYPES:
            raise InvalidEvent("key", f"{part!r:.80} is not part of a Dask key")
        parts.append(part)
    return tuple(parts)


def key_texts(keys: list) -> list:
    """:func:`key_text` of each key (the list itself when all are strings)."""
    if set(map(type, keys)) <= {str}:
        return keys
    return list(map(key_text, keys))


def _entries(values: list | None, width: int, column: str, n: int, exact: bool) -> list:
    """A capture's ``kwargs`` or ``error`` column as ``width`` columns of ``n`` values
    (None where the event has null)."""
    if values is None:
        return [[None] * n] * width
    types = set(map(type, values))
    if not types <= {list, tuple, type(None)}:
        raise InvalidEvent(column, "expected arrays or null")
    lengths = {len(v) for v in values if v is not None}
    if lengths and (min(lengths) < width or (exact and max(lengths) > width)):
        raise InvalidEvent(column, f"expected arrays of {width} values")
    if type(None) in types:
        blank = (None,) * width
        values = [blank if v is None else v for v in values]
    if lengths and max(lengths) > width:
        values = [v[:width] for v in values]
    return [list(c) for c in zip(*values)] if values else [[] for _ in range(width)]


class CaptureShape(NamedTuple):
    """What :func:`capture_shape` found: the capture's length, its ``names`` table, its
    keys' text, and the columns of :data:`TRANSITION_KWARGS` and :data:`CAPTURE_ERROR`
    (field -> one value per event)."""

    n: int
    names: list
    keys: list
    optional: dict[str, list]


def capture_shape(capture: Mapping[str, Any]) -> CaptureShape:
    """Check the shape of a :data:`CAPTURE` (as :func:`run_shape`; ``kwargs`` and
    ``error`` entries arrays of their width or null, keys Dask keys) and read its keys'
    text and its optional columns. Raises :class:`InvalidEvent` naming the column."""
    n, table = _common_shape(capture, CAPTURE_COLUMNS)
    keys = key_texts(capture["key"])
    optional = dict(zip(TRANSITION_KWARGS, _entries(
        _optional(capture, "kwargs", n), len(TRANSITION_KWARGS), "kwargs", n, False)))
    optional.update(zip(CAPTURE_ERROR, _entries(
        _optional(capture, "error", n), len(CAPTURE_ERROR), "error", n, True)))
    return CaptureShape(n, table, keys, optional)


def capture_columns(capture: Mapping[str, Any]) -> dict[str, list]:
    """The TRANSITION fields of a :data:`CAPTURE`'s events as columns, as
    :func:`run_columns` gives a run's (keys as text, Dask's kwargs and an erred
    transition's error spread into their fields). Raises :class:`InvalidEvent`."""
    n, table, keys, optional = capture_shape(capture)
    prefix, group, span_id = zip(*map(table.__getitem__, capture["name"]))
    columns = {"ts": capture["time"], "key": keys, "prefix": list(prefix),
               "group": list(group), "span_id": list(span_id), "start": capture["start"],
               "finish": capture["finish"], "stimulus_id": capture["stimulus_id"]}
    for column in RUN_OPTIONAL_COLUMNS:
        columns[column] = optional[column]
    return columns


def packed_columns(event: Mapping[str, Any]) -> dict[str, list]:
    """:func:`run_columns` or :func:`capture_columns` of a packed event, by its kind."""
    if event.get("kind") == CAPTURE:
        return capture_columns(event)
    return run_columns(event)


def unpack(event: Mapping[str, Any]) -> list[dict]:
    """The TRANSITION events of a packed event (a TRANSITION_RUN or a CAPTURE), each
    with every field of :class:`Transition` in declaration order; raises
    :class:`InvalidEvent`."""
    columns = packed_columns(event)
    names = _RUN_EVENT_FIELDS
    values = [repeat(TRANSITION), *map(columns.__getitem__, names[1:])]
    return list(map(dict, map(zip, repeat(names), zip(*values))))


def expand_events(events: list) -> list:
    """``events`` with every packed event replaced by the events it stands for (the
    list itself if it holds none). A packed event that cannot be unpacked stays as
    it is: a reader refuses it as an event of an unknown kind, naming the problem
    with :func:`unpack`'s :class:`InvalidEvent`."""
    # (compared, not looked up: a malformed kind may be a list, which has no hash)
    if not any(type(ev) is dict and (ev.get("kind") == TRANSITION_RUN
                                     or ev.get("kind") == CAPTURE) for ev in events):
        return events
    out: list = []
    for ev in events:
        if type(ev) is dict and (ev.get("kind") == TRANSITION_RUN or ev.get("kind") == CAPTURE):
            try:
                out.extend(unpack(ev))
                continue
            except InvalidEvent:
                pass
        out.append(ev)
    return out


def packed_length(event: Mapping[str, Any]) -> int:
    """How many events a packed event stands for, by the shape of its columns that
    every packed kind has (:class:`InvalidEvent` if they are wrong)."""
    if event.get("kind") == CAPTURE:
        return _common_shape(event, CAPTURE_COLUMNS)[0]
    return _common_shape(event, RUN_COLUMNS)[0]


def is_packed(event: Any) -> bool:
    """Whether a decoded event is a packed one (its kind in :data:`PACKED`)."""
    kind = event.get("kind") if type(event) is dict else None
    return kind == TRANSITION_RUN or kind == CAPTURE


#: ``LIFECYCLE.action`` values.
LIFECYCLE_ACTIONS: Final = frozenset(
    {"worker_added", "worker_removed", "client_added", "client_removed", "restart",
     "scheduler_start", "scheduler_close"}
)

#: ``WORKER_DIGESTS.digests`` is a list of ``[context, span_id, prefix, activity, unit,
#: value]`` rows, the keys of ``Worker.digests_total`` that have a span (the same keys
#: ``SpansWorkerExtension.heartbeat`` apportions), with the increase since last sample.
DIGEST_ROW: Final = ("context", "span_id", "prefix", "activity", "unit", "value")


# ----------------------------------------------------------------- derived records

class SpanState(TypedDict):
    """A span snapshot on SPAN_STATE. Values are those of ``distributed.spans.Span``
    for the span *tree* rooted at ``span_id`` (a parent rolls up its children), as the
    processors have rebuilt them. ``version`` increases per (cluster_id, span_id); a
    consumer keeps the highest. ``states``/``all_durations`` are ``{name: number}``;
    ``cumulative_worker_metrics`` is a list of ``[context, prefix, activity, unit,
    value]`` rows (Dask's key tuple with the span id removed)."""

    cluster_id: str
    cluster_name: str | None
    span_id: str
    name: list[str]
    parent_id: str | None
    version: int
    enqueued: float
    start: float
    stop: float
    duration: float
    nbytes_total: int
    states: dict[str, int]
    all_durations: dict[str, float]
    cumulative_worker_metrics: list[list[Any]]
    done: bool
    updated_at: float
    #: ``Span.nthreads_intervals``: ``[begin, end, total_nthreads]`` while the tree ran
    nthreads_intervals: list[list[float]]
    #: ``Span.active_cpu_seconds``: the thread-seconds the cluster offered meanwhile
    active_cpu_seconds: float


class PrefixStats(TypedDict):
    """A prefix partial on PREFIX_STATS for (cluster_id, span_id, prefix,
    window_start), window_start being the start of a tumbling window of the
    transition ``ts``. ``partial_id`` identifies the partial uniquely and
    deterministically (same input, same id), so a replayed partial can be recognised
    and not counted twice. ``finished`` counts transitions by finish state,
    ``durations`` sums startstop seconds by action (compute, transfer, ...),
    ``max_duration`` is the longest single compute in the window."""

    cluster_id: str
    cluster_name: str | None
    span_id: str | None
    prefix: str
    window_start: float
    partial_id: str
    finished: dict[str, int]
    durations: dict[str, float]
    nbytes: int
    n_erred: int
    max_duration: float


class Gap(TypedDict):
    """A gap on GAPS: envelopes ``missing_from``..``missing_to`` (inclusive) of a
    producer never arrived."""

    cluster_id: str
    producer_id: str
    source: str
    missing_from: int
    missing_to: int
    detected_at: float


class DeadLetter(TypedDict):
    """A dead letter on DEAD_LETTER. ``payload`` is the raw message, decoded as UTF-8
    with replacement and cut to :data:`DEAD_LETTER_PAYLOAD_MAX` bytes; ``reason``
    says what is wrong with it."""

    topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    payload: str
    detected_at: float


#: Cap on a dead letter's payload text.
DEAD_LETTER_PAYLOAD_MAX: Final = 64 * 1024

#: Derived topic -> the declaration of its records.
RECORDS: Final[Mapping[str, type]] = {
    SPAN_STATE: SpanState,
    PREFIX_STATS: PrefixStats,
    GAPS: Gap,
    DEAD_LETTER: DeadLetter,
}

SPAN_STATE_FIELDS: Final = fields(SpanState)
PREFIX_STATS_FIELDS: Final = fields(PrefixStats)
GAP_FIELDS: Final = fields(Gap)
DEAD_LETTER_FIELDS: Final = fields(DeadLetter)


# ------------------------------------------------------------------------- helpers


def encode_key(key: Hashable) -> str:
    """The text form of a Dask key used on the wire and in ClickHouse.

    ``str`` keys are themselves; tuple keys such as ``("x-abc", 0, 1)`` become
    ``str(key)``, the form the dashboard shows.
    """
    return key if isinstance(key, str) else str(key)


class InvalidEnvelope(ValueError):
    """A raw message is not a valid envelope; the message says why."""


_ENVELOPE_KEYS: Final = frozenset(ENVELOPE_FIELDS)


def validate_envelope(obj: Any) -> dict:
    """Check a decoded raw message against the contract and return it.

    Raises :class:`InvalidEnvelope` naming the first problem found.
    """
    if not isinstance(obj, dict):
        raise InvalidEnvelope(f"envelope is a {type(obj).__name__}, not an object")
    if not obj.keys() >= _ENVELOPE_KEYS:
        missing = [f for f in ENVELOPE_FIELDS if f not in obj]
        raise InvalidEnvelope(f"envelope lacks field(s) {', '.join(missing)}")
    if obj["schema"] not in READABLE_SCHEMAS or type(obj["schema"]) is not int:
        raise InvalidEnvelope(
            f"unknown schema version {obj['schema']!r}; this build reads "
            f"{', '.join(map(str, READABLE_SCHEMAS))}"
        )
    if not isinstance(obj["seq"], int) or obj["seq"] < 0:
        raise InvalidEnvelope(f"seq must be a non-negative integer, got {obj['seq']!r}")
    if not isinstance(obj["events"], list):
        raise InvalidEnvelope("events must be a list")
    for field in ("cluster_id", "producer_id", "source"):
        if not isinstance(obj[field], str) or not obj[field]:
            raise InvalidEnvelope(f"{field} must be a non-empty string")
    for i, ev in enumerate(obj["events"]):
        if not isinstance(ev, dict) or "kind" not in ev or "ts" not in ev:
            raise InvalidEnvelope(f"event {i} is not an object with 'kind' and 'ts'")
    return obj


# ------------------------------------------------------------------- encodings

#: The first bytes of a MessagePack map (fixmap, map 16, map 32): a version 3 envelope.
#: No JSON text begins with one (they are no ASCII character, nor a UTF-8 lead byte
#: JSON allows: JSON text begins with whitespace or a value).
_MSGPACK_MAP: Final = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})

_decode_msgpack = msgspec.msgpack.Decoder().decode


def is_msgpack(value: bytes) -> bool:
    """Whether a raw message is MessagePack (version 3) rather than JSON (1, 2)."""
    return bool(value) and value[0] in _MSGPACK_MAP


class TooDeep(InvalidEnvelope):
    """A message nests arrays and maps deeper than a reader decodes: ``depth`` deep
    (at least; ``None`` when the decoder itself gave up)."""

    def __init__(self, depth: int | None, limit: int):
        super().__init__(f"nested {depth if depth else f'more than {limit}'} deep")
        self.depth = depth
        self.limit = limit


def decoded_depth(value: Any, limit: int) -> int:
    """0 when the lists and dicts of a decoded ``value`` nest at most ``limit`` deep,
    else how deep they nest (found a level at a time, each level in one pass)."""
    level = [value] if type(value) is list or type(value) is dict else []
    depth = 0
    while level:
        depth += 1
        values = chain.from_iterable(c.values() if type(c) is dict else c for c in level)
        level = [v for v in values if type(v) is list or type(v) is dict]
    return depth if depth > limit else 0


def decode_envelope(value: bytes, max_depth: int | None = None) -> Any:
    """A raw message decoded, MessagePack or JSON (:func:`is_msgpack`), not validated
    (:func:`validate_envelope` does). Raises :class:`InvalidEnvelope` when it does not
    decode, :class:`TooDeep` when MessagePack nests deeper than ``max_depth`` (JSON's
    depth is for the caller to check on its bytes, before decoding)."""
    if is_msgpack(value):
        try:
            decoded = _decode_msgpack(value)
        except RecursionError:
            raise TooDeep(None, max_depth or 0) from None
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            raise InvalidEnvelope(f"not MessagePack: {e}") from None
        if max_depth is not None and (depth := decoded_depth(decoded, max_depth)):
            raise TooDeep(depth, max_depth)
        return decoded
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise InvalidEnvelope(f"not JSON: {e}") from None


def payload_text(value: bytes, max_chars: int) -> str:
    """A raw message as a dead letter keeps it: JSON as its text (UTF-8, invalid bytes
    replaced), MessagePack as the JSON text of what it decodes to (bytes as their
    ``repr``), else ``"msgpack:"`` and its bytes in hex; at most ``max_chars``."""
    if is_msgpack(value):
        try:
            decoded = _decode_msgpack(value)
            return orjson.dumps(decoded, default=repr, option=orjson.OPT_NON_STR_KEYS)[
                :4 * max_chars].decode("utf-8", "replace")[:max_chars]
        except (RecursionError, ValueError, TypeError, msgspec.DecodeError):
            return ("msgpack:" + value[:max_chars // 2].hex())[:max_chars]
    return value[:4 * max_chars].decode("utf-8", "replace")[:max_chars]
