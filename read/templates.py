"""The Jinja2 environment every page of the web UI and the report is rendered with:
the templates of ``ui/``, autoescaping on (a task key, log line or exception holding
HTML is shown as text), undefined variables an error, and the filters ``time`` (UTC,
milliseconds), ``seconds``, ``bytes`` (binary units) and ``quote`` (a URL component)."""

from __future__ import annotations

import datetime
import pathlib
import urllib.parse

import jinja2

__all__ = ["TEMPLATES", "environment", "env", "fmt_bytes", "fmt_s"]

TEMPLATES = pathlib.Path(__file__).with_name("ui")


def fmt_s(value) -> str:
    """Seconds as text: milliseconds below 100 s."""
    if value is None or value != value:
        return ""
    value = float(value)
    return f"{value:.3f} s" if value < 100 else f"{value:,.1f} s"


def fmt_bytes(value) -> str:
    """Bytes as text, in binary units."""
    if value is None:
        return ""
    n = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(value)


def _fmt_time(value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, datetime.datetime):
        value = value.timestamp()
    try:
        t = datetime.datetime.fromtimestamp(float(value), datetime.timezone.utc)
    except (TypeError, ValueError, OverflowError):
        return str(value)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def environment() -> jinja2.Environment:
    """The environment; compiled templates are kept in Jinja's bytecode cache (a
    directory of the user's own under the system's temporary directory), so a new
    process (``dask-blackbox report``) does not compile them again."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined,
                             bytecode_cache=jinja2.FileSystemBytecodeCache())
    env.filters.update(time=_fmt_time, seconds=fmt_s, bytes=fmt_bytes,
                       quote=lambda v: urllib.parse.quote(str(v), safe=""))
    return env


_ENV: jinja2.Environment | None = None


def env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        _ENV = environment()
    return _ENV
