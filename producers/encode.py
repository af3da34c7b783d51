"""Safe JSON encoding of whatever a Dask user or Dask itself hands to a producer.

:func:`sanitize` turns any Python object into something orjson can encode, with a
bounded cost and a bounded size: JSON-able values are kept, everything else is
*described* as ``{"__type__": <qualified type name>, "__size__": <bytes or items>}``,
strings longer than the budget are cut (:func:`cap_text`), containers stop when the
budget is spent and say how many items were left out. It never raises and never
calls ``__repr__``/``__str__`` of arbitrary objects (they may raise, hang or be huge);
only exceptions get their text, guarded.
"""

from __future__ import annotations

import datetime
import enum
import logging
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

logger = logging.getLogger(__name__)

#: Containers nested deeper than this are described, not walked.
MAX_DEPTH = 32

#: Dict keys longer than this are cut.
MAX_KEY_CHARS = 200

#: Approximate encoded size charged for a scalar (number, bool, null).
_SCALAR_BYTES = 8

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson encodes natively

#: Types orjson encodes natively and that have no size worth capping.
_NATIVE_ATOMS = (datetime.datetime, datetime.date, datetime.time, uuid.UUID)

_OPTIONS = orjson.OPT_NON_STR_KEYS


def type_name(obj: Any) -> str:
    t = type(obj)
    module = t.__module__
    return t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"


def cap_text(text: str, max_chars: int) -> str:
    """``text`` itself, or its first ``max_chars`` characters plus a marker saying how
    many characters were cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}…[{len(text) - max_chars} more characters]"


def describe(obj: Any) -> dict:
    """``{"__type__", "__size__"}`` for an object that is not encoded: the size is the
    byte length for binary payloads (bytes, ``Serialized``/``Pickled`` frames,
    arrays), the item count for sized containers, else ``sys.getsizeof``; ``None`` if
    even that fails. Exceptions also carry their text under ``"__text__"``."""
    out: dict[str, Any] = {"__type__": type_name(obj), "__size__": _size_of(obj)}
    if isinstance(obj, BaseException):
        try:
            out["__text__"] = cap_text(str(obj), 1000)
        except Exception:
            out["__text__"] = None
    return out


def _size_of(obj: Any) -> int | None:
    try:
        if isinstance(obj, (bytes, bytearray)):
            return len(obj)
        if isinstance(obj, memoryview):
            return obj.nbytes
        frames = getattr(obj, "frames", None)  # distributed Serialized / Pickled
        if isinstance(frames, (list, tuple)):
            return sum(memoryview(f).nbytes for f in frames)
        nbytes = getattr(obj, "nbytes", None)  # numpy, pandas, ...
        if isinstance(nbytes, int):
            return nbytes
        return sys.getsizeof(obj)
    except Exception:
        return None


class _Walker:
    """One sanitizing pass with a byte budget shared by the whole value."""

    __slots__ = ("budget", "max_text", "active")

    def __init__(self, max_bytes: int):
        self.budget = max_bytes
        self.max_text = max_bytes
        self.active: set[int] = set()  # ids of the containers on the current path

    def walk(self, obj: Any, depth: int) -> Any:
        if obj is None or obj is True or obj is False:
            self.budget -= _SCALAR_BYTES
            return obj
        t = type(obj)
        if t is str:
            return self._text(obj)
        if t is int or t is float:
            self.budget -= _SCALAR_BYTES
            if t is int and not _INT_MIN <= obj <= _INT_MAX:
                return describe(obj)
            return obj
        if isinstance(obj, enum.Enum):
            return self.walk(obj.value, depth)
        if isinstance(obj, str):
            return self._text(str.__str__(obj))
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, int):
            return self.walk(int(obj), depth)
        if isinstance(obj, float):
            return self.walk(float(obj), depth)
        if isinstance(obj, _NATIVE_ATOMS):
            self.budget -= 32
            return obj
        if isinstance(obj, (dict, list, tuple, set, frozenset)) or _is_mapping(obj):
            return self._container(obj, depth)
        item = getattr(obj, "item", None)  # numpy scalars
        if callable(item) and getattr(obj, "ndim", None) == 0:
            try:
                return self.walk(item(), depth)
            except Exception:
                pass
        self.budget -= 64
        return describe(obj)

    def _text(self, text: str) -> str:
        capped = cap_text(text, max(self.budget, 0))
        self.budget -= len(capped) + 2
        return capped

    def _container(self, obj: Any, depth: int) -> Any:
        if id(obj) in self.active:
            self.budget -= 64
            return {"__type__": type_name(obj), "__size__": None, "__cycle__": True}
        if depth >= MAX_DEPTH:
            self.budget -= 64
            return describe(obj)
        self.active.add(id(obj))
        try:
            if isinstance(obj, dict) or _is_mapping(obj):
                return self._mapping(obj, depth)
            return self._sequence(obj, depth)
        except Exception:  # mutated while iterated, a raising __iter__, ...
            return describe(obj)
        finally:
            self.active.discard(id(obj))

    def _mapping(self, obj: Mapping, depth: int) -> dict:
        out: dict[str, Any] = {}
        self.budget -= 2
        n = len(obj)
        for i, (k, v) in enumerate(obj.items()):
            if self.budget <= 0:
                out["__truncated__"] = n - i
                break
            key = self._key(k)
            self.budget -= len(key) + 3
            out[key] = self.walk(v, depth + 1)
        return out

    def _sequence(self, obj: Any, depth: int) -> list:
        out: list[Any] = []
        self.budget -= 2
        n = len(obj)
        for i, v in enumerate(obj):
            if self.budget <= 0:
                out.append({"__type__": "truncated", "__size__": n - i})
                break
            out.append(self.walk(v, depth + 1))
            self.budget -= 1
        return out

    def _key(self, key: Any) -> str:
        if isinstance(key, str):
            return cap_text(str.__str__(key), MAX_KEY_CHARS)
        if _is_plain_key(key):
            if key is None or type(key) is bool:
                return "null" if key is None else ("true" if key else "false")
            return cap_text(str(key), MAX_KEY_CHARS)
        return f"<{type_name(key)}>"


def _is_plain_key(key: Any) -> bool:
    """None, bool, int, float or (nested) tuples of those and str: the types whose
    ``str`` is safe and meaningful (Dask keys are tuples of str and int)."""
    t = type(key)
    if t is tuple:
        return all(_is_plain_key(k) for k in key)
    return key is None or t in (str, bool, int, float)


def _is_mapping(obj: Any) -> bool:
    return isinstance(obj, Mapping)


def sanitize(value: Any, max_bytes: int) -> tuple[Any, int]:
    """``(json_able, approximate_encoded_size)`` for ``value``, using at most about
    ``max_bytes`` of encoded output. Never raises."""
    walker = _Walker(max_bytes)
    try:
        out = walker.walk(value, 0)
    except RecursionError:
        out = describe(value)
    except Exception:
        logger.debug("dask-blackbox could not sanitize a %s", type_name(value), exc_info=True)
        out = describe(value)
    return out, max_bytes - walker.budget


def _encode_default(obj: Any) -> Any:
    return describe(obj)


def encode_event(event: dict, max_bytes: int) -> bytes:
    """The orjson encoding of one event. Values orjson cannot encode are described
    (see :func:`describe`); if orjson still fails (huge ints, deep nesting, cycles),
    the whole event is passed through :func:`sanitize` with ``max_bytes``."""
    try:
        return orjson.dumps(event, default=_encode_default, option=_OPTIONS)
    except (orjson.JSONEncodeError, TypeError, RecursionError):
        clean, _ = sanitize(event, max_bytes)
        return orjson.dumps(clean, option=_OPTIONS)
