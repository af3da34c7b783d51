"""Turning one raw Kafka message into an envelope, or into a dead letter.

A raw message is accepted when it is at most ``contract.MAX_ENVELOPE_BYTES`` long,
nests arrays and objects at most :data:`MAX_DEPTH` deep (JSON: checked before decoding,
a deeper value would make decoding, ``repr`` or encoding recurse past Python's limit;
MessagePack: by its decoder's guard, then on what it decoded, a level at a time),
decodes as MessagePack or JSON (``contract.decode_envelope``), passes
``contract.validate_envelope``, names a known ``source`` and
has a string (or null) ``cluster_name`` and is keyed by its own ``cluster_id`` (the
key decides the partition, and the partition decides which processor owns the
cluster's state, so a message keyed otherwise would split a cluster across
processors). Anything else becomes a dead letter (``contract.DEAD_LETTER_FIELDS``)
saying why. An accepted envelope's packed events (``contract.PACKED``) are expanded
to the events they stand for, unless the caller reads them packed
(``ClusterState.apply`` does).

Read packed, a MessagePack message first takes the typed path: msgspec decodes it
into structs of every field the contract declares for the envelope and each event
kind (:func:`_typed`: their values are exactly what the generic decoder makes of
them), and no other, so that decoding is also checking depth and text: what the typed
decoder takes nests at most :data:`TYPED_DEPTH` deep and is valid MessagePack and
UTF-8 throughout, and is then checked as above. Whatever it refuses (a wrong type, a
value deeper than :data:`NESTED_LEVELS` where the contract says ``Any``, an unknown
field or kind, bytes, an extension, anything the checks refuse) takes the generic
path, which decides as it always did: the typed path never changes what is a dead
letter or a refused event, it saves the generic decoding and its depth walk (about
half a microsecond a transition) on what producers send.
"""

from __future__ import annotations

import time
import types
from functools import lru_cache
from typing import Any, Union, get_args, get_origin, get_type_hints, is_typeddict

import msgspec

from dask_blackbox import contract
from dask_blackbox.contract import InvalidEnvelope
from dask_blackbox.nesting import MAX_DEPTH, too_deep

from .cluster import APPLIED_KINDS

#: Dead letters keep at most this much of the offending message.
MAX_PAYLOAD_BYTES = contract.DEAD_LETTER_PAYLOAD_MAX


# ------------------------------------------------------------------ the typed path

#: How many levels of arrays and maps the typed path decodes where the contract says
#: ``Any`` (a deeper value takes the generic path). Its union is built level on level,
#: each in two places (array, map), so building it doubles with each level.
NESTED_LEVELS = 8


@lru_cache(None)
def _nested(levels: int) -> Any:
    """What the generic decoder makes of a value at most ``levels`` arrays and maps
    deep whose maps have text keys (no bytes, no extension: those take the generic
    path), as a msgspec type: its values are exactly the generic decoder's."""
    typed: Any = Union[None, bool, int, float, str]
    for _ in range(levels):
        typed = Union[None, bool, int, float, str, list[typed], dict[str, typed]]
    return typed


def _typed(hint: Any, depth: int) -> tuple[Any, int]:
    """A contract field type (``contract.field_types``) as a msgspec type whose values
    are exactly what the generic decoder makes of a value of that type (a ``float``
    may be an int, as the generic decoder leaves it), and how deep the arrays and maps
    of a value of it nest at most, a container at this place being ``depth`` deep.
    TypedDicts are maps of :func:`_nested` values (what a reader checks of them is
    the reader's)."""
    if hint is Any or is_typeddict(hint):
        return _nested(NESTED_LEVELS), depth - 1 + NESTED_LEVELS
    if hint is float:
        return Union[int, float], depth - 1
    if hint in (None, type(None), bool, int, str):
        return hint, depth - 1
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        typed = [_typed(a, depth) for a in args]
        return Union[tuple(t for t, _ in typed)], max(d for _, d in typed)
    if origin is list:
        item, deepest = _typed(args[0], depth + 1)
        return list[item], deepest
    if origin is dict and args[0] is str:
        item, deepest = _typed(args[1], depth + 1)
        return dict[str, item], deepest
    raise TypeError(f"no typed decoding of a contract field of type {hint!r}")


def _event_struct(kind: str, declaration: type) -> tuple[type, int]:
    """The struct of an event of ``kind``: every field of its declaration (those it
    may leave out None where it does), no other (an unknown field, whose bytes the
    typed decoder would skip unchecked, takes the generic path); and its depth."""
    fields, deepest = [], 0
    for name, hint in get_type_hints(declaration).items():
        if name == "kind":
            continue
        typed, depth = _typed(hint, 4)  # the envelope, events, the event, the value
        deepest = max(deepest, depth)
        fields.append((name, typed) if name in declaration.__required_keys__
                      else (name, typed, None))
    struct = msgspec.defstruct(f"Typed_{kind}", fields, tag_field="kind", tag=kind,
                               forbid_unknown_fields=True, kw_only=True, gc=False)
    return struct, deepest


def _envelope_decoder() -> tuple[Any, dict[type, tuple[str, tuple[str, ...]]], int]:
    """The typed decoder of whole version 3 envelopes, each event struct's kind and
    fields, and how deep what it decodes nests at most."""
    kinds = {**contract.EVENTS, **{k: decl for k, (decl, _) in contract.PACKED.items()}}
    structs: dict[type, tuple[str, tuple[str, ...]]] = {}
    deepest = 3
    for kind, declaration in kinds.items():
        struct, depth = _event_struct(kind, declaration)
        structs[struct] = (kind, struct.__struct_fields__)
        deepest = max(deepest, depth)
    fields = []
    for name, hint in get_type_hints(contract.Envelope).items():
        if name == "events":
            fields.append((name, list[Union[tuple(structs)]]))
            continue
        typed, depth = _typed(hint, 2)
        deepest = max(deepest, depth)
        fields.append((name, typed))
    envelope = msgspec.defstruct("TypedEnvelope", fields, forbid_unknown_fields=True,
                                 gc=False)
    return msgspec.msgpack.Decoder(envelope).decode, structs, deepest


_decode_typed, _STRUCTS, TYPED_DEPTH = _envelope_decoder()
assert TYPED_DEPTH <= MAX_DEPTH, "the typed path would accept what the generic one refuses"
_astuple = msgspec.structs.astuple


def _read(event: Any) -> dict:
    """A typed event as the processors read it: the mapping the generic path decodes
    (a field left out None, which the processors read as left out), or for a kind
    ``ClusterState.apply`` reads nothing of but ``kind`` and ``ts``, only those."""
    kind, fields = _STRUCTS[type(event)]
    if kind in APPLIED_KINDS:
        out = dict(zip(fields, _astuple(event)))
        out["kind"] = kind
        return out
    return {"kind": kind, "ts": event.ts}


def _typed_envelope(value: bytes, key: bytes | None) -> dict | None:
    """The envelope of a MessagePack message as :func:`decode` reads it, decoded by
    the typed decoder, if that takes it and it passes every check :func:`decode`
    makes; else None (the generic path decides, and says why). Its values are the
    generic decoder's, and it nests at most :data:`TYPED_DEPTH` deep: what the typed
    path accepts, the generic path accepts as the same envelope."""
    try:
        env = _decode_typed(value)
    except Exception:  # ValidationError, DecodeError, RecursionError, MemoryError, ...
        return None
    if (env.schema not in contract.READABLE_SCHEMAS or env.seq < 0 or not env.cluster_id
            or not env.producer_id or env.source not in contract.SOURCES
            or (key is not None and key != env.cluster_id.encode())):
        return None
    return {"schema": env.schema, "cluster_id": env.cluster_id,
            "cluster_name": env.cluster_name, "source": env.source,
            "producer_id": env.producer_id, "seq": env.seq, "sent_at": env.sent_at,
            "events": list(map(_read, env.events))}


# --------------------------------------------------------------------- decoding


def decode(value: bytes | None, key: bytes | None, expand: bool = True,
           typed: bool = True) -> dict:
    """The envelope carried by a raw message; :class:`InvalidEnvelope` says why not.
    ``expand``: its packed events are expanded (else left as they came, and the
    envelope is read as ``ClusterState.apply`` reads it: a MessagePack one through the
    typed path, whose events of kinds it does not apply keep only ``kind`` and
    ``ts``, unless ``typed`` is false)."""
    if value is None:
        raise InvalidEnvelope("message has no value")
    if len(value) > contract.MAX_ENVELOPE_BYTES:
        raise InvalidEnvelope(
            f"message is {len(value)} bytes, more than the contract's "
            f"MAX_ENVELOPE_BYTES={contract.MAX_ENVELOPE_BYTES}"
        )
    if typed and not expand and contract.is_msgpack(value):
        typed = _typed_envelope(value, key)
        if typed is not None:
            return typed
    depth = 0 if contract.is_msgpack(value) else too_deep(value)
    try:
        if depth:
            raise contract.TooDeep(depth, MAX_DEPTH)
        obj = contract.decode_envelope(value, MAX_DEPTH)
    except contract.TooDeep as e:
        raise InvalidEnvelope(f"{e}; the processors decode at most {MAX_DEPTH} levels of "
                              "arrays and objects") from None
    envelope = contract.validate_envelope(obj)
    if envelope["source"] not in contract.SOURCES:
        raise InvalidEnvelope(
            f"unknown source {envelope['source']!r}; expected one of "
            f"{sorted(contract.SOURCES)}"
        )
    name = envelope["cluster_name"]
    if name is not None and not isinstance(name, str):
        raise InvalidEnvelope(
            f"cluster_name must be a string or null, got a {type(name).__name__}")
    if key is not None and key != envelope["cluster_id"].encode():
        raise InvalidEnvelope(
            f"message key {key.decode('utf-8', 'replace')!r} is not the envelope's "
            f"cluster_id {envelope['cluster_id']!r}"
        )
    # Packed events stand for their events, in place (a malformed one stays, and is
    # refused as an event with the reason: ClusterState.apply).
    if expand:
        envelope["events"] = contract.expand_events(envelope["events"])
    return envelope


def count_events(events: list) -> int:
    """How many events a decoded envelope's ``events`` stand for, packed or not
    (``len(contract.expand_events(events))``)."""
    n = len(events)
    for ev in events:
        kind = ev["kind"]  # (decoded: every event has a kind)
        if kind == contract.TRANSITION_RUN or kind == contract.CAPTURE:
            try:
                n += contract.packed_length(ev) - 1
            except contract.InvalidEvent:
                pass
    return n


def dead_letter(
    topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
    reason: str,
) -> dict:
    """The DEAD_LETTER record for a raw message that is not a valid envelope."""
    return {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": None if key is None else key.decode("utf-8", "replace"),
        "reason": reason,
        "payload": None
        if value is None
        else value[:MAX_PAYLOAD_BYTES].decode("utf-8", "replace") if not contract.is_msgpack(value)
        else contract.payload_text(value, MAX_PAYLOAD_BYTES),
        "detected_at": time.time(),
    }
