"""The typed fast path: field kinds, and the msgspec decoder of whole envelopes.

A :class:`Field` is a column (or a group of columns) taken from one event field. Its
*kind* (:data:`KINDS`) gives it three equivalent forms of one check:

- ``check``: one value at a time (sinks.checks), the checked path, which names the
  field at fault;
- ``typed``: a msgspec type, so that decoding a whole envelope with
  :func:`envelope_decoder` is also checking it, in one pass in C;
- ``column``: what remains to do on all of an envelope's values of the field once
  typed (at most one pass: '' for None, the upper bound of event times, which moves
  with the sink's clock, JSON text). It returns the column, or raises
  :class:`Irregular` to send the envelope down the checked path.

A typed value must be one ``check`` accepts unchanged, or the two paths would give
different rows. :data:`ACCEPTS` says which contract field types (``contract.
field_types``) each kind can store; sinks.events asserts it at import.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import msgspec

from dask_blackbox import contract
from dask_blackbox.sinks import checks
from dask_blackbox.sinks.checks import EARLIEST, LATEST_AHEAD, TIME_MAX
from dask_blackbox.sinks.tables import FlatLists


class Irregular(Exception):
    """A column of values needs a closer look, event by event."""


Time = Annotated[float, msgspec.Meta(ge=0, le=TIME_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# Finite: the checked path's orjson refuses a number like 1e400, msgspec makes it inf.
Number = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class StartStop(msgspec.Struct, kw_only=True, gc=False):
    # In the order of the startstops.* columns (see col_startstops).
    action: str | None = None
    start: Time
    stop: Time
    source: str | None = None


# ------------------------------------------------------ columns of typed values


def col_as_is(values, now):
    return values


def col_text_or_number(values, now):
    return [checks.text(v, "") for v in values]


def col_event_time(values, now):
    if values and max(values) > now + LATEST_AHEAD:
        raise Irregular
    return values


def col_json(values, now):
    return [checks.json_text(v) for v in values]


def col_map(values, now):
    return [{} if v is None else v for v in values] if None in values else values


def _flat(values, width: int, entry_values: Callable | None) -> list[FlatLists]:
    """``width`` FlatLists columns of lists of entries, all of an envelope's at once,
    kept flat with the row lengths: no list per row."""
    lists = [v or () for v in values] if None in values else values
    lengths = list(map(len, lists))
    entries = [e for entries in lists for e in entries]
    if entry_values is not None:
        entries = map(entry_values, entries)
    columns = zip(*entries) if lengths and max(lengths) else ((),) * width
    return [FlatLists(column, lengths) for column in columns]


def col_startstops(values, now):
    """Dask's startstops: four FlatLists columns (action, start, stop, source)."""
    return _flat(values, 4, msgspec.structs.astuple)


def col_pairs(values, now):
    """Lists of ``[a, b]`` entries (msgspec tuples): two FlatLists columns."""
    return _flat(values, 2, None)


@dataclasses.dataclass(frozen=True)
class Field:
    """A column (or, with ``width`` > 1, several) taken from an event field."""

    name: str
    kind: str
    check: Callable     # one value: (value, field, now) -> stored value, or Invalid
    typed: Any          # the msgspec type that checks a value on the typed path
    column: Callable    # all values, typed: (values, now) -> column, or Irregular
    width: int = 1

    @property
    def optional(self) -> bool:
        """Whether an event may leave this field out (its check accepts None)."""
        try:
            self.check(None, self.name, 0.0)
        except checks.Invalid:
            return False
        return True


def field(name: str, kind: str) -> Field:
    return Field(name, kind, *KINDS[kind])


#: Field kind -> (check, typed, column[, width]) of its Field.
KINDS: dict[str, tuple] = {
    "text": (checks.text, str | None, col_as_is),
    "text|number": (checks.text, str | int | float | None, col_text_or_number),
    "key": (checks.key, str, col_as_is),
    "event_time": (checks.event_time, Annotated[float, msgspec.Meta(ge=EARLIEST, le=TIME_MAX)],
                   col_event_time),
    "int?": (checks.int_or_none, Int64 | None, col_as_is),
    "count?": (checks.count_or_none, Count | None, col_as_is),
    "float?": (checks.float_or_none, Number | None, col_as_is),
    "time?": (checks.time_or_none, Time | None, col_as_is),
    "json": (checks.json_column, Any, col_json),
    "map:count": (checks.mapping(checks.count), dict[str, Count] | None, col_map),
    "startstops": (checks.startstops, list[StartStop] | None, col_startstops, 4),
    "[time, count]": (checks.tuples(checks.time_, checks.count, names=("time", "nthreads")),
                      list[tuple[Time, Count]] | None, col_pairs, 2),
}

#: A contract field type -> the kind a field of it is stored with where no layout
#: says otherwise (what Dask passes with a transition, sinks.tables.LATER_KWARGS).
KIND_OF_TYPE: dict[Any, str] = {str | None: "text", int | None: "int?", float | None: "float?"}

#: Field kind -> the contract field types (``contract.field_types``) it stores every
#: value of. A field read with a kind that does not accept its declared type would
#: dead-letter values the contract allows.
ACCEPTS: dict[str, tuple] = {
    "text": (str, str | None),
    "text|number": (str, str | None, str | int | None, str | int | float | None),
    "key": (str,),
    "event_time": (float,),
    "int?": (int, int | None),
    "count?": (int, int | None),
    "float?": (float, float | None),
    "time?": (float, float | None),
    "json": (Any,),
    "map:count": (dict[str, int],),
    "startstops": (list[contract.StartStop] | None, list[contract.StartStop]),
    "[time, count]": (list[list[float]],),
}


# --------------------------------------------------------- the typed envelope


def run_struct(transition_fields: tuple[Field, ...]) -> type:
    """The struct of a ``TRANSITION_RUN`` (``contract.TransitionRun``) whose column
    values have the types ``transition_fields`` give the TRANSITION fields they hold
    (its shape, lengths and indexes, is ``contract.run_columns``'s to check; an
    optional column left out is None)."""
    typed = {f.name: f.typed for f in transition_fields}
    names = tuple[tuple(typed[name] for name in ("prefix", "group", "span_id"))]
    return msgspec.defstruct(f"Typed_{contract.TRANSITION_RUN}", [
        ("ts", typed["ts"]), ("key", list[typed["key"]]), ("time", list[typed["ts"]]),
        ("start", list[typed["start"]]), ("finish", list[typed["finish"]]),
        ("stimulus_id", list[typed["stimulus_id"]]),
        ("names", list[Union[names, None]]),
        ("name", list[Count]),
        *((name, Union[list[typed[name]], None], None) for name in contract.RUN_OPTIONAL_COLUMNS),
    ], tag_field="kind", tag=contract.TRANSITION_RUN, kw_only=True, gc=False)


#: A key as a capture holds it (``contract.key_text``): a tuple key is an array (a
#: bytes key, which JSON cannot type apart from text, takes the checked path).
CapturedKey = Union[str, int, float, list[Any]]


def capture_struct(transition_fields: tuple[Field, ...]) -> type:
    """The struct of a ``CAPTURE`` (``contract.Capture``) whose column values have the
    types ``transition_fields`` give the TRANSITION fields they hold (its shape is
    ``contract.capture_shape``'s to check; ``kwargs`` and ``error`` left out are
    None)."""
    typed = {f.name: f.typed for f in transition_fields}
    names = tuple[tuple(typed[name] for name in ("prefix", "group", "span_id"))]
    kwargs = tuple[tuple(typed[name] for name in contract.TRANSITION_KWARGS)]
    error = tuple[tuple(typed[name] for name in contract.CAPTURE_ERROR)]
    return msgspec.defstruct(f"Typed_{contract.CAPTURE}", [
        ("ts", typed["ts"]), ("time", list[typed["ts"]]), ("key", list[CapturedKey]),
        ("start", list[typed["start"]]), ("finish", list[typed["finish"]]),
        ("stimulus_id", list[typed["stimulus_id"]]),
        ("names", list[Union[names, None]]),
        ("name", list[Count]),
        ("kwargs", Union[list[Union[kwargs, None]], None], None),
        ("error", Union[list[Union[error, None]], None], None),
    ], tag_field="kind", tag=contract.CAPTURE, kw_only=True, gc=False)


def envelope_decoder(typed_fields: dict[str, tuple[Field, ...]], untyped_kinds,
                     packed: dict[str, type]):
    """Decoders of whole envelopes, JSON and MessagePack, and the event kind of each
    event struct they make.

    Events of a kind in ``typed_fields`` become structs with those fields typed (in
    that order); events of ``untyped_kinds`` take any JSON value in their contract
    fields (their converters check them); packed events (``contract.PACKED``) the
    struct ``packed`` gives their kind. Every kind has ``ts``, as the contract says.
    An event of any other kind, or any value of the wrong type, fails the decoding."""

    def event_struct(kind: str) -> type:
        if kind in typed_fields:
            fields = [(f.name, f.typed, None) if f.optional else (f.name, f.typed)
                      for f in typed_fields[kind]]
        else:
            fields = [("ts", Any), *((n, Any, None) for n in contract.EVENT_FIELDS[kind])]
        return msgspec.defstruct(f"Typed_{kind}", fields, tag_field="kind", tag=kind,
                                 kw_only=True, gc=False)

    kinds = {event_struct(kind): kind for kind in (*typed_fields, *untyped_kinds)}
    kinds.update({struct: kind for kind, struct in packed.items()})

    # An envelope as contract.validate_envelope accepts it, each event of a known
    # kind and typed.
    envelope = msgspec.defstruct("TypedEnvelope", [
        ("schema", Literal[contract.READABLE_SCHEMAS]), ("cluster_id", NonEmpty),
        ("cluster_name", str), ("source", NonEmpty), ("producer_id", NonEmpty), ("seq", Count),
        ("sent_at", Time), ("events", list[Union[tuple(kinds)]]),
    ], gc=False)
    return msgspec.json.Decoder(envelope).decode, msgspec.msgpack.Decoder(envelope).decode, kinds
