"""What both fuzzing tiers (sink, processors) mutate messages with: JSON values drawn
by hypothesis, the nodes of a decoded message, and a node replaced or dropped."""

from __future__ import annotations

import orjson
from hypothesis import strategies as st

from dask_blackbox import contract


def json_values(*words: str):
    """A strategy for JSON values: scalars (and ``words``, strings the code under
    test gives a meaning to), and lists and objects of them."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.text(max_size=20),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        *([st.sampled_from(words)] if words else []),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12,
    )


def nodes(value, path=()):
    """Every (path, node) of a decoded message, the root included."""
    yield path, value
    if type(value) is dict:
        for k, v in value.items():
            yield from nodes(v, (*path, k))
    elif type(value) is list:
        for i, v in enumerate(value):
            yield from nodes(v, (*path, i))


def replaced(value, path, new):
    """``value`` with the node at ``path`` replaced by ``new`` (the root: ``new``)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if type(value) is dict:
        return {**value, head: replaced(value[head], rest, new)}
    out = list(value)
    out[head] = replaced(value[head], rest, new)
    return out


def dropped(value, path):
    """``value`` without the dict key or list item at ``path``."""
    *parent, last = path

    def drop(node, rest):
        if not rest:
            if type(node) is dict:
                return {k: v for k, v in node.items() if k != last}
            return [v for i, v in enumerate(node) if i != last]
        head = rest[0]
        if type(node) is dict:
            return {**node, head: drop(node[head], rest[1:])}
        out = list(node)
        out[head] = drop(node[head], rest[1:])
        return out

    return drop(value, parent)


def mutated_bytes(draw, value: bytes) -> bytes:
    """``value`` truncated, with one bit flipped, or with a few bytes inserted, at a
    place ``draw`` (hypothesis's, inside a composite strategy) chooses."""
    cut = draw(st.integers(0, len(value)))
    kind = draw(st.sampled_from(["truncate", "flip", "insert"]))
    if kind == "truncate":
        return value[:cut]
    if kind == "flip" and value:
        i = min(cut, len(value) - 1)
        return value[:i] + bytes([value[i] ^ (1 << draw(st.integers(0, 7)))]) + value[i + 1:]
    return value[:cut] + draw(st.binary(max_size=8)) + value[cut:]


def as_version_1(values: list[bytes]) -> list[bytes]:
    """The raw envelopes among ``values`` that hold packed events, as a version-1
    producer sent them: schema 1, every run expanded (readers still take both)."""
    out = []
    for value in values:
        try:
            envelope = contract.decode_envelope(value)
        except contract.InvalidEnvelope:
            continue
        if type(envelope) is not dict or envelope.get("schema") not in (2, 3) \
                or type(envelope.get("events")) is not list:
            continue
        events = contract.expand_events(envelope["events"])
        if events is not envelope["events"]:
            out.append(orjson.dumps({**envelope, "schema": 1, "events": events}))
    return out
