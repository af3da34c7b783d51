"""Safe JSON encoding of whatever a Dask user or Dask itself hands to a producer.

:func:`sanitize` makes any Python object encodable by orjson at a bounded cost and size,
and never raises: JSON-able values are kept, strings beyond the budget cut
(:func:`cap_text`), containers stopped when it is spent (counting what they left out), the
rest *described* (:func:`describe`).

It runs none of the value's own code. Every decision is taken on ``type(obj)``
(``issubclass``, never ``isinstance``, which reads ``obj.__class__``); subclasses of the
builtin types are read through the builtin's own methods (``dict.items``, ``str.__str__``,
...), so an overridden ``__getattr__``, ``__class__``, ``__iter__``, ``__len__``,
``__repr__`` or ``__sizeof__`` is never called. Deliberate exceptions: an exception's text
(``str``, guarded), numpy scalars (``item()``), the ``nbytes`` of numpy/pandas objects.
Other mappings and iterables are described, not walked, and so are datetimes and times
unless naive or, for a datetime, with a ``datetime.timezone`` or ``zoneinfo.ZoneInfo``
``tzinfo`` (orjson calls ``utcoffset``: a raising one can crash it). Producers sanitize in
their sender thread, never on Dask's event loop.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import logging
import sys
import types
import uuid
import zoneinfo
from collections.abc import Mapping
from typing import Any

import orjson

logger = logging.getLogger(__name__)

#: Containers nested deeper than this are described, not walked.
MAX_DEPTH = 32
#: Dict keys longer than this are cut.
MAX_KEY_CHARS = 200
#: Exact tzinfo types whose ``utcoffset`` is the standard library's own code.
_SAFE_TZINFOS = frozenset({datetime.timezone, zoneinfo.ZoneInfo})
#: Builtin containers walked (their subclasses through these types' own methods).
_CONTAINERS = (dict, list, tuple, set, frozenset)
#: ``__sizeof__`` implementations that are C code (not a user's Python function).
_BUILTIN_CALLABLES = (
    types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)
_OPTIONS = orjson.OPT_NON_STR_KEYS


def type_name(obj: Any) -> str:
    """``module.QualifiedName`` of ``type(obj)`` (builtins without a module)."""
    t = type(obj)
    try:
        module, name = t.__module__, t.__qualname__
    except Exception:  # a metaclass that refuses: say what we can
        return "<unknown type>"
    return name if module == "builtins" else f"{module}.{name}"


def cap_text(text: str, max_chars: int) -> str:
    """``text``, or its first ``max_chars`` characters and how many more were cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}…[{len(text) - max_chars} more characters]"


def describe(obj: Any) -> dict:
    """``{"__type__": <qualified type name>, "__size__": ...}`` for a value not encoded:
    the byte length of binary payloads (bytes, ``Serialized``/``Pickled`` frames,
    numpy/pandas objects), the item count of builtin containers, else ``sys.getsizeof``
    unless the type computes it in Python; ``None`` if it cannot be told safely.
    ``"__text__"`` holds an exception's text, or a datetime's or time's naive ISO text."""
    out: dict[str, Any] = {"__type__": type_name(obj), "__size__": _size_of(obj)}
    t = type(obj)
    try:
        if issubclass(t, BaseException):
            out["__text__"] = cap_text(str(obj), 1000)
        elif t is datetime.datetime or t is datetime.time:  # a subclass's replace() is its code
            out["__text__"] = obj.replace(tzinfo=None).isoformat()
    except Exception:
        out["__text__"] = None
    return out


def _size_of(obj: Any) -> int | None:
    t = type(obj)
    try:
        for base in (bytes, bytearray, *_CONTAINERS):
            if issubclass(t, base):
                return base.__len__(obj)
        if t is memoryview:
            return obj.nbytes
        # distributed's frames, looked up, not imported: a producer imports no more than it uses
        serialize = sys.modules.get("distributed.protocol.serialize")
        if serialize is not None and (t is serialize.Serialized or t is serialize.Pickled):
            return sum(memoryview(f).nbytes for f in obj.frames)
        if _trusted_array(t):
            nbytes = getattr(obj, "nbytes", None)
            if type(nbytes) is int:
                return nbytes
        if isinstance(getattr(t, "__sizeof__", None), _BUILTIN_CALLABLES):
            return sys.getsizeof(obj)
        return None
    except Exception:
        return None


def _trusted_array(t: type) -> bool:
    """Whether ``t`` comes from numpy, pandas or cupy (whose attributes are cheap)."""
    module = getattr(t, "__module__", None)
    return type(module) is str and module.partition(".")[0] in ("numpy", "pandas", "cupy")


class _Walker:
    """One sanitizing pass with a byte budget shared by the whole value."""

    __slots__ = ("budget", "active")

    def __init__(self, max_bytes: int):
        self.budget = max_bytes
        self.active: set[int] = set()  # ids of the containers on the current path

    def walk(self, obj: Any, depth: int) -> Any:
        t = type(obj)
        if t is str:
            return self._text(obj)
        if obj is None or t is bool or t is float or t is int:
            self.budget -= 8
            # orjson encodes the ints of [-2**63, 2**64) natively
            return obj if t is not int or -(2**63) <= obj < 2**64 else describe(obj)
        if t is dict or t is list or t is tuple or t is set or t is frozenset:
            return self._container(obj, t, depth)
        if t is datetime.datetime or t is datetime.time:
            tz = obj.tzinfo
            # orjson rejects an aware time and calls an aware datetime's utcoffset
            if tz is None or (t is datetime.datetime and type(tz) in _SAFE_TZINFOS):
                self.budget -= 40
                return obj
            self.budget -= 96
            return describe(obj)
        if t is datetime.date or t is uuid.UUID:  # native, with no size worth capping
            self.budget -= 40
            return obj
        # Subclasses of the builtins, read through the builtin's own methods.
        if issubclass(t, enum.Enum):
            with contextlib.suppress(Exception):
                return self.walk(object.__getattribute__(obj, "_value_"), depth)
        elif issubclass(t, str):
            return self._text(str.__str__(obj))
        elif issubclass(t, int):
            return self.walk(int.__int__(obj), depth)
        elif issubclass(t, float):
            return self.walk(float.__float__(obj), depth)
        else:
            for base in _CONTAINERS:
                if issubclass(t, base):
                    return self._container(obj, base, depth)
            if _trusted_array(t) and getattr(obj, "ndim", None) == 0:  # numpy scalars
                with contextlib.suppress(Exception):
                    return self.walk(obj.item(), depth)
        self.budget -= 64
        return describe(obj)

    def _text(self, text: str) -> str:
        capped = cap_text(text, max(self.budget, 0))
        self.budget -= len(capped) + 2
        return capped

    def _container(self, obj: Any, base: Any, depth: int) -> Any:
        """Walk a dict, list, tuple, set or frozenset (or a subclass, as ``base``)."""
        if id(obj) in self.active:
            self.budget -= 64
            return {"__type__": type_name(obj), "__size__": None, "__cycle__": True}
        if depth >= MAX_DEPTH:
            self.budget -= 64
            return describe(obj)
        self.active.add(id(obj))
        self.budget -= 2
        try:
            n = base.__len__(obj)
            if base is dict:
                out: dict[str, Any] = {}
                for i, (k, v) in enumerate(dict.items(obj)):
                    if self.budget <= 0:
                        out["__truncated__"] = n - i
                        break
                    key = self._key(k)
                    self.budget -= len(key) + 3
                    out[key] = self.walk(v, depth + 1)
                return out
            items: list[Any] = []
            for i, v in enumerate(base.__iter__(obj)):
                if self.budget <= 0:
                    items.append({"__type__": "truncated", "__size__": n - i})
                    break
                items.append(self.walk(v, depth + 1))
                self.budget -= 1
            return items
        except Exception:  # mutated while iterated, ...
            return describe(obj)
        finally:
            self.active.discard(id(obj))

    def _key(self, key: Any) -> str:
        if issubclass(type(key), str):
            return cap_text(str.__str__(key), MAX_KEY_CHARS)
        if key is None or type(key) is bool:
            return "null" if key is None else str(key).lower()
        if _is_plain_key(key):
            return cap_text(str(key), MAX_KEY_CHARS)
        return f"<{type_name(key)}>"


def _is_plain_key(key: Any) -> bool:
    """None, bool, int, float, str or (nested) tuples of those (as Dask keys are): the
    types whose ``str`` is safe and meaningful."""
    t = type(key)
    if t is tuple:
        return all(_is_plain_key(k) for k in key)
    return key is None or t in (str, bool, int, float)


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


def encode_event(event: Mapping[str, Any], max_bytes: int) -> bytes:
    """The orjson encoding of one event, values it cannot encode described; should that
    fail (huge ints, deep nesting, cycles), the encoding of the event sanitized with
    ``max_bytes``, text that is not UTF-8 escaped (:func:`utf8`). Never raises."""
    try:
        return orjson.dumps(event, default=describe, option=_OPTIONS)
    except (TypeError, RecursionError):  # orjson.JSONEncodeError is a TypeError
        clean, _ = sanitize(event, max_bytes)
    try:
        return orjson.dumps(clean, option=_OPTIONS)
    except TypeError:  # text that is not UTF-8
        return orjson.dumps(utf8(clean), option=_OPTIONS)


def utf8(value: Any) -> Any:
    """A sanitized value with each lone surrogate (as os.fsdecode makes) escaped."""
    t = type(value)
    if t is str:
        return value.encode("utf-8", "backslashreplace").decode()
    if t is dict:
        return {utf8(k): utf8(v) for k, v in value.items()}
    if t is list or t is tuple:
        return [utf8(v) for v in value]
    return value
