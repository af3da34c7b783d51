"""Turning one raw Kafka message into an envelope, or into a dead letter.

A raw message is accepted when it is at most ``contract.MAX_ENVELOPE_BYTES`` long,
nests arrays and objects at most :data:`MAX_DEPTH` deep (checked before decoding: a
deeper value would make decoding, ``repr`` or encoding recurse past Python's limit),
decodes as JSON, passes ``contract.validate_envelope``, names a known ``source`` and
has a string (or null) ``cluster_name`` and is keyed by its own ``cluster_id`` (the
key decides the partition, and the partition decides which processor owns the
cluster's state, so a message keyed otherwise would split a cluster across
processors). Anything else becomes a dead letter (``contract.DEAD_LETTER_FIELDS``)
saying why. An accepted envelope's packed events (``contract.PACKED``) are expanded
to the events they stand for, unless the caller reads them packed
(``ClusterState.apply`` does).
"""

from __future__ import annotations

import time

import orjson

from dask_blackbox import contract
from dask_blackbox.contract import InvalidEnvelope
from dask_blackbox.nesting import MAX_DEPTH, too_deep

#: Dead letters keep at most this much of the offending message.
MAX_PAYLOAD_BYTES = contract.DEAD_LETTER_PAYLOAD_MAX


def decode(value: bytes | None, key: bytes | None, expand: bool = True) -> dict:
    """The envelope carried by a raw message; :class:`InvalidEnvelope` says why not.
    ``expand``: its packed events are expanded (else left as they came)."""
    if value is None:
        raise InvalidEnvelope("message has no value")
    if len(value) > contract.MAX_ENVELOPE_BYTES:
        raise InvalidEnvelope(
            f"message is {len(value)} bytes, more than the contract's "
            f"MAX_ENVELOPE_BYTES={contract.MAX_ENVELOPE_BYTES}"
        )
    depth = too_deep(value)
    if depth:
        raise InvalidEnvelope(f"nested {depth} deep; the processors decode at most "
                              f"{MAX_DEPTH} levels of arrays and objects")
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise InvalidEnvelope(f"not JSON: {e}") from None
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
        if ev["kind"] == contract.TRANSITION_RUN:  # (decoded: every event has a kind)
            try:
                n += contract.run_shape(ev).n - 1
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
        else value[:MAX_PAYLOAD_BYTES].decode("utf-8", "replace"),
        "detected_at": time.time(),
    }
