"""Checking one value at a time: the checked path's field checks.

Each checker takes ``(value, field, now)`` and returns the value as its column stores
it, or raises :class:`Invalid` naming the field and the problem. The typed path
(sinks.typed) declares the same checks as msgspec types; both must accept the same
values and give the same result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import orjson

#: Event times outside [2000-01-01, now + 1 day] come from a broken clock.
EARLIEST = 946_684_800.0
LATEST_AHEAD = 86_400.0
#: Any time must fit ClickHouse's DateTime64 (up to 2299) as microseconds.
TIME_MAX = 1e10

_NONE = type(None)


class Invalid(ValueError):
    """A value does not have the type or range its column needs; says which and why."""


def json_text(value: Any) -> str:
    """``value`` as JSON text (what JSON columns and dead letters' payloads hold)."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def time_(value, field, now=None):
    """Seconds since the epoch (float seconds are what time columns hold)."""
    if type(value) not in (float, int) or not math.isfinite(value) or not 0 <= value <= TIME_MAX:
        raise Invalid(f"{field}: {value!r:.80} is not a time in seconds since the epoch")
    return value


def time_or_none(value, field, now=None):
    return None if value is None else time_(value, field)


def event_time(value, field, now):
    """When an event happened: a time, and a plausible one."""
    time_(value, field)
    if not EARLIEST <= value <= now + LATEST_AHEAD:
        raise Invalid(
            f"{field}: {value!r} is not a plausible time (before 2000 or more than a day "
            "ahead of the sink's clock: a broken producer clock?)"
        )
    return value


def text(value, field, now=None):
    """A string column: None stays None (''), numbers are written out, anything else is
    invalid."""
    if type(value) is str or value is None:
        return value
    if type(value) in (int, float):
        return repr(value)
    raise Invalid(f"{field}: expected a string, got {type(value).__name__}")


def key(value, field, now=None):
    if type(value) is not str:
        raise Invalid(f"{field}: a key must be a string (contract.encode_key), got {value!r:.80}")
    return value


def int_or_none(value, field, now=None):
    if value is None:
        return None
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise Invalid(f"{field}: {value!r:.80} is not an integer")
    return value


def count_or_none(value, field, now=None):
    n = int_or_none(value, field)
    if n is not None and not 0 <= n < 2**32:
        raise Invalid(f"{field}: {value!r:.80} is not a count (0 <= n < 2**32)")
    return n


def float_or_none(value, field, now=None):
    if value is None:
        return None
    if type(value) not in (float, int):
        raise Invalid(f"{field}: {value!r:.80} is not a number")
    return float(value)


def required(check: Callable) -> Callable:
    """``check`` of a value that must be present: None is "missing"."""
    def checked(value, field, now=None):
        if value is None:
            raise Invalid(f"{field}: missing")
        return check(value, field)
    return checked


int_ = required(int_or_none)
count = required(count_or_none)
float_ = required(float_or_none)


def json_column(value, field, now=None):
    try:
        return json_text(value)
    except orjson.JSONEncodeError as e:
        raise Invalid(f"{field}: cannot be written as JSON ({e})") from None


def list_(value, field) -> list:
    """A list, None being the empty list."""
    if value is None:
        return []
    if type(value) is not list:
        raise Invalid(f"{field}: expected a list, got {type(value).__name__}")
    return value


def keys(value, field, now=None):
    return [key(k, field) for k in list_(value, field)]


def name(value, field, now=None):
    """A span name: Dask's tuple of tags (a list on the wire; a string is one tag)."""
    if type(value) is str:
        return [value]
    return [text(tag, field) for tag in list_(value, field)]


def mapping(number: Callable) -> Callable:
    """``{text: number}``, None being the empty mapping."""
    def check(value, field, now=None):
        if value is None:
            return {}
        if type(value) is not dict:
            raise Invalid(f"{field}: expected an object, got {type(value).__name__}")
        return {text(k, field): number(v, f"{field}[{k!r:.40}]") for k, v in value.items()}
    return check


def startstops(value, field, now=None):
    """Dask's startstops: four columns (action, start, stop, source) of lists."""
    actions, starts, stops, sources = [], [], [], []
    for ss in list_(value, field):
        if type(ss) is not dict:
            raise Invalid(f"{field}: each entry must be an object")
        actions.append(text(ss.get("action"), f"{field}.action"))
        starts.append(time_(ss.get("start"), f"{field}.start"))
        stops.append(time_(ss.get("stop"), f"{field}.stop"))
        sources.append(text(ss.get("source"), f"{field}.source"))
    return actions, starts, stops, sources


def tuples(*checks: Callable, names: tuple[str, ...]) -> Callable:
    """A list of fixed-length lists (``[time, nthreads]``, ...), as one column per
    position: each entry must have ``len(checks)`` values, each passing its check."""
    shape = f"[{', '.join(names)}]"

    def check(value, field, now=None):
        columns: tuple[list, ...] = tuple([] for _ in checks)
        for entry in list_(value, field):
            if type(entry) is not list or len(entry) != len(checks):
                raise Invalid(f"{field}: each entry must be a list {shape}, got {entry!r:.80}")
            for column, c, v, n in zip(columns, checks, entry, names):
                column.append(c(v, f"{field}.{n}"))
        return columns
    return check
