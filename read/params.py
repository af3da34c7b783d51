"""The query parameters shared by the JSON API, the web pages and the CLI: the
filters (``cluster``, ``span``, ``since``, ``until``), times and bounded integers, each
refused with a :class:`BadParameter` that names it."""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping

__all__ = ["BadParameter", "EARLIEST", "LATEST", "parse_time", "int_param", "opt", "filters"]


class BadParameter(ValueError):
    """A query parameter that cannot be used; the message names it."""


#: The times ClickHouse's DateTime64 holds, in seconds since the epoch:
#: 1900-01-01T00:00:00 .. 2299-12-31T23:59:59 UTC.
EARLIEST, LATEST = -2208988800.0, 10413791999.0


def parse_time(text: str | None, name: str) -> float | None:
    """``since``/``until``: ISO date-time (UTC unless zoned), epoch seconds, or a
    duration ago like 2h / 30m / 7d / 45s; a time between 1900 and 2299 (what
    ClickHouse's DateTime64 holds). BadParameter naming ``name`` otherwise."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    try:
        value = _seconds(text)
    except (ValueError, OverflowError):
        raise BadParameter(f"{name}={text[:80]!r} is neither an ISO date-time, seconds since the "
                           "epoch, nor a duration like 2h / 30m / 7d") from None
    if not (math.isfinite(value) and EARLIEST <= value <= LATEST):
        raise BadParameter(f"{name}={text[:80]!r} is not a time between 1900-01-01 and 2299-12-31")
    return value


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m[2]]
        now = datetime.datetime.now(datetime.timezone.utc)
        return (now - datetime.timedelta(**{unit: float(m[1])})).timestamp()
    try:
        return float(text)
    except ValueError:
        pass
    t = datetime.datetime.fromisoformat(text)
    return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()


def int_param(params: Mapping, name: str, default: int, low: int = 1, high: int = 100_000) -> int:
    value = params.get(name)
    if value in (None, ""):
        return default
    try:
        n = int(value)
    except ValueError:
        raise BadParameter(f"{name} must be an integer, not {str(value)[:80]!r}") from None
    if not low <= n <= high:
        raise BadParameter(f"{name} must be between {low} and {high}, not {n}")
    return n


def opt(params: Mapping, name: str) -> str | None:
    value = params.get(name)
    return value if value not in (None, "") else None


def filters(params: Mapping) -> dict:
    """cluster/span/since/until from query parameters."""
    return {"cluster": opt(params, "cluster"), "span": opt(params, "span"),
            "since": parse_time(params.get("since"), "since"),
            "until": parse_time(params.get("until"), "until")}
