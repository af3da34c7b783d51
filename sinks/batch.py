"""A :class:`Batch`: Kafka messages turned into rows of every table, ready to load.

Each message is decoded and converted as it is added: raw envelopes become a row of
``envelopes`` and rows of one table per event kind (sinks.events), derived records
one row each (sinks.records). Every value is checked on the way (types, ranges,
plausible timestamps), so what ClickHouse receives is well typed.

Nothing a producer or processor publishes can stop the sink. Before anything is
decoded, a message larger than :data:`MAX_MESSAGE_BYTES` is a dead letter; before
anything is decoded into Python objects (orjson, the checked path), so is a message
nested deeper than ``dask_blackbox.nesting.MAX_DEPTH``. (The typed path's msgspec decoder
comes first: it decodes in C, bounded by its own recursion guard, and whatever it
fails on, RecursionError included, goes to the checked path; so the depth scan, a
about 15% of the typed path's cost, is only paid for irregular messages.) After that,
whatever fails (a check, or
anything unforeseen in a converter) becomes a ``dead_letters`` row naming the message
(topic, partition, offset), the event (its index and kind), the field and the
problem; the rest of the message is still loaded, and so is every later message.

A raw envelope takes one of two paths. The typed path decodes it with msgspec into
structs whose field types are the checks (sinks.typed), so that decoding and checking
are one pass in C, and converts each kind's events a column at a time: this is what
makes the sink fast, and what producers' envelopes take. Anything irregular (a wrong
type, an unknown kind, a bad value) sends the whole envelope down the checked path
instead: decoded with orjson and converted event by event, value by value, to find
out which event is wrong and why. Both give the same rows for what both accept.

A raw message is MessagePack (envelope version 3) or JSON (1, 2): ``contract.is_msgpack``
tells, and each path decodes either (the typed path with msgspec's decoder of that
format; the checked path with ``contract.decode_envelope``, MessagePack checked for
depth on what it decoded, a level at a time, JSON on its bytes before decoding).

A packed event (``contract.PACKED``: a TRANSITION_RUN or a CAPTURE) stands for its
events: the typed path converts its columns as the transitions' columns, the checked
path expands it (``contract.expand_events``) and converts its events one by one, and on
both an event's index is its index in the expanded envelope. A packed event whose shape
is wrong (``contract.run_shape``, ``contract.capture_shape``) is one dead letter that
says why.
"""

from __future__ import annotations

import itertools
import operator
import time
import zlib
from typing import Any

import msgspec
import orjson

from dask_blackbox import contract, nesting
from dask_blackbox.sinks import checks
from dask_blackbox.sinks.checks import Invalid
from dask_blackbox.sinks.events import (
    EVENT_CONVERTERS, EVENT_LAYOUTS, PACKED_STRUCTS, STRUCT_KINDS, TRANSITION_STRUCT,
    decode_envelope, decode_msgpack_envelope, layout_row, transition_blocks, typed_columns,
)
from dask_blackbox.sinks.records import RECORD_CONVERTERS
from dask_blackbox.sinks import arrow
from dask_blackbox.sinks.tables import (
    CHUNK_MIN_ROWS, COLUMNS, Block, Envelope, FlatLists, Message, TableData,
)

#: Largest message the sink decodes: twice what a producer sends at most
#: (contract.MAX_ENVELOPE_BYTES), which also stays under Kafka's default 1 MiB limit.
MAX_MESSAGE_BYTES = 2 * contract.MAX_ENVELOPE_BYTES

_FINISH = COLUMNS["transitions"].index("finish")


def fingerprint(message: Message) -> tuple[int, int]:
    """(Kafka timestamp, CRC-32 of the value): what identifies a message beyond its
    offset, which a new broker incarnation reuses."""
    return message.timestamp, zlib.crc32(message.value)


def _raw_text(message: Message) -> str:
    return contract.payload_text(message.value, contract.DEAD_LETTER_PAYLOAD_MAX)


def _event_text(event: Any, message: Message) -> str:
    """An event as a dead letter's payload: its JSON, or (when it cannot be written
    back as JSON) the whole message's text."""
    try:
        return checks.json_text(event)[:contract.DEAD_LETTER_PAYLOAD_MAX]
    except (orjson.JSONEncodeError, RecursionError, TypeError, ValueError):
        return _raw_text(message)


def payload_of(message: Message, event: int | None) -> str:
    """The text to keep in a dead letter for ``message`` / its event ``event``."""
    if event is not None and len(message.value) <= MAX_MESSAGE_BYTES and (
            contract.is_msgpack(message.value) or not nesting.too_deep(message.value)):
        try:
            decoded = contract.decode_envelope(message.value, nesting.MAX_DEPTH)
            items = contract.expand_events(decoded["events"]) if type(decoded) is dict \
                else decoded
            return _event_text(items[event], message)
        except (contract.InvalidEnvelope, KeyError, IndexError, TypeError):
            pass
    return _raw_text(message)


def _unforeseen(e: BaseException) -> str:
    """The reason of a dead letter for an error no check foresaw."""
    return f"the sink could not convert it ({type(e).__name__}: {str(e)[:300]})"


class Batch:
    """Messages the sink loads and commits together, already converted to rows.

    ``positions`` maps ``(kafka_topic, partition)`` to the offset after the last
    message added: what gets committed once the batch is loaded. ``firsts`` holds the
    Kafka timestamp and value CRC-32 of each partition's first message: the
    fingerprint that tells one broker incarnation's offsets from another's.
    """

    def __init__(self, schemas: dict[str, arrow.TableSchema] | None = None) -> None:
        #: The Arrow conversion of each table (the loader's), or None: with it, a
        #: large block (a transition run) becomes raw Arrow arrays as it is added,
        #: while its values are fresh, and its Python objects are let go.
        self.schemas = schemas
        self.tables: dict[str, TableData] = {name: TableData(name) for name in COLUMNS}
        #: Arrow tables built ahead of loading, per table (see Loader.prepare).
        self.arrow: dict = {}
        self.positions: dict[tuple[str, int], int] = {}
        self.firsts: dict[tuple[str, int], tuple[int, int]] = {}
        self.n_messages = 0
        #: Raw messages the typed path refused, converted event by event instead.
        self.n_checked = 0

    @property
    def n_rows(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def add(self, message: Message, now: float | None = None) -> None:
        """Convert ``message`` into rows (or dead letters) of this batch. Never raises
        for what the message holds."""
        now = time.time() if now is None else now
        self.n_messages += 1
        tp = (message.kafka_topic, message.partition)
        if tp not in self.firsts:
            self.firsts[tp] = fingerprint(message)
        self.positions[tp] = message.offset + 1
        if len(message.value) > MAX_MESSAGE_BYTES:
            self.dead_letter(message, None, f"a message of {len(message.value)} bytes; the sink "
                             f"decodes at most {MAX_MESSAGE_BYTES}", now)
            return
        if message.topic == contract.RAW and self._add_typed(message, now):
            return
        msgpack = message.topic == contract.RAW and contract.is_msgpack(message.value)
        try:
            depth = 0 if msgpack else nesting.too_deep(message.value)
            if depth:
                raise contract.TooDeep(depth, nesting.MAX_DEPTH)
            if msgpack:
                decoded = contract.decode_envelope(message.value, nesting.MAX_DEPTH)
            else:
                decoded = orjson.loads(message.value)
        except contract.TooDeep as e:
            self.dead_letter(message, None, f"{e}; the sink decodes at most "
                             f"{nesting.MAX_DEPTH} levels of arrays and objects", now)
            return
        except contract.InvalidEnvelope as e:
            self.dead_letter(message, None, str(e), now)
            return
        except orjson.JSONDecodeError as e:
            self.dead_letter(message, None, f"not JSON: {e}", now)
            return
        try:
            if message.topic == contract.RAW:
                self.n_checked += 1
                self._add_envelope(message, decoded, now)
            else:
                self._add_records(message, decoded, now)
        except Exception as e:  # a converter bug must not stop the sink: say so
            self.dead_letter(message, None, _unforeseen(e), now)

    def drop_messages(self, keys: set[tuple[str, int, int]]) -> int:
        """Remove every row made of the messages at ``keys`` ((Kafka topic,
        partition, offset): duplicates, see sinks.sequences); their positions stay,
        so they are committed with the batch. Returns the rows removed."""
        removed = 0
        for table, data in self.tables.items():
            refs = list(data.refs)
            keep = [i for i, (m, _) in enumerate(refs)
                    if (m.kafka_topic, m.partition, m.offset) not in keys]
            if len(keep) == len(refs):
                continue
            columns = data.columns
            kept = TableData(table)
            kept.extend([_subset(c, keep) for c in columns], [refs[i] for i in keep])
            self.tables[table] = kept
            self.arrow.pop(table, None)
            removed += len(refs) - len(keep)
        return removed

    def dead_letter(self, message: Message, event: int | None, reason: str, now: float,
                    payload: str | None = None) -> None:
        """Record that ``message`` (or its event number ``event``) cannot be loaded."""
        if payload is None:
            payload = _raw_text(message)
        self.tables["dead_letters"].append((
            "sink", message.kafka_topic, message.partition, message.offset, message.key_text(),
            reason if event is None else f"event {event}: {reason}",
            payload[:contract.DEAD_LETTER_PAYLOAD_MAX], now,
        ), (message, event))

    # ------------------------------------------------------------- typed path

    def _add_typed(self, message: Message, now: float) -> bool:
        """Add the rows of a raw message whose every value has its type, a column at a
        time. False, with nothing added, when anything in it is irregular (a wrong
        type, an unknown kind, not JSON, ...): the checked path finds out what."""
        try:
            if contract.is_msgpack(message.value):
                wire = decode_msgpack_envelope(message.value)
            else:
                # msgspec skips unknown keys without checking their UTF-8; the checked
                # path (orjson) refuses the message: both paths must agree on what is JSON.
                message.value.decode()
                wire = decode_envelope(message.value)
            env = Envelope(wire.cluster_id, wire.source, wire.producer_id, wire.seq)
            positions = _positions(wire.events)
            converted = list(self._typed_rows(message, env, wire.events, positions, now))
        # Whatever goes wrong (msgspec's ValidationError; orjson.JSONEncodeError, since
        # msgspec reads integers of any size that orjson cannot write back; anything
        # unforeseen), the checked path, event by event, finds out what and says so.
        except Exception:
            return False
        n_transitions = n_memory = n_erred = 0
        for table, data, events in converted:
            self._put(table, data, message, events)
            if table == "transitions":
                finishes = data.columns[_FINISH]
                n_transitions += len(finishes)
                n_memory += finishes.count("memory")
                n_erred += finishes.count("erred")
        self._add_envelope_row(message, env, wire.cluster_name, wire.sent_at, positions[-1],
                               n_transitions, n_memory, n_erred)
        return True

    @staticmethod
    def _typed_rows(message: Message, env: Envelope, events: list, positions, now: float):
        """(table, row or Block, event index or indexes) of typed ``events``, a kind at
        a time, ``positions`` their indexes in the expanded envelope
        (:func:`_positions`). With TRANSITION_RUNs, the transitions come first: a block
        per run or capture, or, with single TRANSITION events among them, one block in
        the envelope's order."""
        kinds = list(map(type, events))
        distinct = set(kinds)
        one_kind = len(distinct) == 1

        def select(struct: type) -> tuple[list, list]:
            if one_kind:
                return list(positions[:len(events)]), events
            mask = list(map(operator.is_, kinds, itertools.repeat(struct)))
            return list(itertools.compress(positions, mask)), list(itertools.compress(events, mask))

        packed = distinct.intersection(PACKED_STRUCTS)
        if packed:
            if len(packed) == 1:
                firsts, runs = select(*packed)
            else:  # runs and captures: in the envelope's order
                mask = [k in packed for k in kinds]
                firsts = list(itertools.compress(positions, mask))
                runs = list(itertools.compress(events, mask))
            indexes, structs = select(TRANSITION_STRUCT) if TRANSITION_STRUCT in distinct \
                else ([], [])
            for columns, indexes in transition_blocks(env, structs, indexes, runs, firsts, now):
                yield "transitions", Block(columns, len(indexes)), indexes
            distinct -= {*PACKED_STRUCTS, TRANSITION_STRUCT}
        for struct in distinct:
            kind = STRUCT_KINDS[struct]
            indexes, selected = select(struct)
            if kind in EVENT_LAYOUTS:
                columns = typed_columns(kind, env, selected, indexes, now)
                yield EVENT_LAYOUTS[kind][0], Block(columns, len(indexes)), indexes
                continue
            for idx, event in zip(indexes, selected):
                yield from _converted(kind, env, msgspec.structs.asdict(event), idx, now)

    def _put(self, table: str, data, message: Message, events) -> None:
        """Add a row of ``message`` (``events``: its event index) or a Block (an
        event index per row)."""
        if type(data) is Block:
            chunk = None
            if self.schemas is not None and data.n_rows >= CHUNK_MIN_ROWS:
                try:
                    chunk = self.schemas[table].chunk(data.columns)
                except (ValueError, TypeError, OverflowError):
                    pass  # kept as Python values: the loader finds the rows at fault
            self.tables[table].add_block(data.columns, data.n_rows, message, events, chunk)
        else:
            self.tables[table].append(data, (message, events))

    def _add_envelope_row(self, message: Message, env: Envelope, cluster_name: str,
                          sent_at: float, n_events: int, n_transitions: int, n_memory: int,
                          n_erred: int) -> None:
        self.tables["envelopes"].append((
            env.cluster_id, cluster_name, env.source, env.producer_id, env.seq, sent_at,
            n_events, len(message.value), n_transitions, n_memory, n_erred, message.partition,
            message.offset,
        ), (message, None))

    # ----------------------------------------------------------- checked path

    def _add_envelope(self, message: Message, decoded: Any, now: float) -> None:
        """An envelope event by event: what cannot be loaded becomes a dead letter
        that says why, and the rest is loaded."""
        try:
            envelope = contract.validate_envelope(decoded)
            env = Envelope(envelope["cluster_id"], envelope["source"], envelope["producer_id"],
                           checks.count(envelope["seq"], "seq"))
            sent_at = checks.time_(envelope["sent_at"], "sent_at")
            cluster_name = checks.text(envelope["cluster_name"], "cluster_name")
        except (contract.InvalidEnvelope, Invalid) as e:
            self.dead_letter(message, None, str(e), now)
            return
        events = contract.expand_events(envelope["events"])
        finishes = []
        for idx, event in enumerate(events):
            kind = event["kind"]
            if type(kind) is not str:
                self.dead_letter(message, idx, f"kind: expected a string, got {type(kind).__name__}",
                                 now, _event_text(event, message))
                continue
            if kind == contract.TRANSITION:
                finishes.append(event.get("finish"))
            try:
                if kind in EVENT_LAYOUTS:
                    table, layout = EVENT_LAYOUTS[kind]
                    self.tables[table].append(layout_row(layout, env, event, idx, now), (message, idx))
                elif kind in EVENT_CONVERTERS:
                    for table, data, at in list(_converted(kind, env, event, idx, now)):
                        self._put(table, data, message, at)
                elif kind == contract.TRANSITION_RUN or kind == contract.CAPTURE:
                    contract.unpack(event)  # left packed: say why it cannot be read
                    raise Invalid("could not be expanded")
                else:
                    self.dead_letter(message, idx, f"unknown event kind {kind[:100]!r}", now,
                                     _event_text(event, message))
            except (Invalid, contract.InvalidEvent) as e:
                self.dead_letter(message, idx, f"{kind}: {e}", now, _event_text(event, message))
            except Exception as e:  # a converter bug must not stop the sink: say so
                self.dead_letter(message, idx, f"{kind}: {_unforeseen(e)}", now,
                                 _event_text(event, message))
        self._add_envelope_row(message, env, cluster_name, sent_at, len(events), len(finishes),
                               finishes.count("memory"), finishes.count("erred"))

    def _add_records(self, message: Message, decoded: Any, now: float) -> None:
        conv = RECORD_CONVERTERS[message.topic]
        records = decoded if type(decoded) is list else [decoded]
        if not records:
            self.dead_letter(message, None, f"an empty list of {message.topic} records", now)
            return
        for i, record in enumerate(records):
            event = i if type(decoded) is list else None
            if type(record) is not dict:
                self.dead_letter(message, event, f"a {message.topic} record must be an object", now)
                continue
            try:
                missing = [f for f in conv.required if record.get(f) is None]
                if missing:
                    raise Invalid(f"lacks field(s) {', '.join(missing)}")
                converted = list(conv.convert(record, now))
            except Invalid as e:
                self.dead_letter(message, event, f"{message.topic}: {e}", now)
                continue
            except Exception as e:  # a converter bug must not stop the sink: say so
                self.dead_letter(message, event, f"{message.topic}: {_unforeseen(e)}", now)
                continue
            for table, row in converted:
                self.tables[table].append(row, (message, event))


def _subset(column, rows: list[int]):
    """The values of ``column`` (a list or FlatLists) at ``rows``."""
    if isinstance(column, FlatLists):
        values = list(column)
        return FlatLists([v for i in rows for v in values[i]], [len(values[i]) for i in rows])
    return [column[i] for i in rows]


def _positions(events: list):
    """The index in the expanded envelope (``contract.expand_events``) of each typed
    event, and after them the number of events: a TRANSITION_RUN or a CAPTURE stands
    for as many as it has keys."""
    if not any(type(ev) in PACKED_STRUCTS for ev in events):
        return range(len(events) + 1)
    sizes = [len(ev.key) if type(ev) in PACKED_STRUCTS else 1 for ev in events]
    return [0, *itertools.accumulate(sizes)]


def _converted(kind: str, env: Envelope, event: dict, idx: int, now: float):
    """(table, row or Block, event index or indexes) of event ``idx`` of a kind in
    EVENT_CONVERTERS; raises Invalid."""
    for table, row in EVENT_CONVERTERS[kind].convert(env, event, now):
        yield table, row, ([idx] * row.n_rows if type(row) is Block else idx)
