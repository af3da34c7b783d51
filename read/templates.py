"""The Jinja2 environment every page of the web UI and the report is rendered with:
the templates of ``ui/``, autoescaping on (a task key, log line or exception holding
HTML is shown as text), undefined variables an error, and the filters ``time`` (UTC,
milliseconds), ``seconds``, ``bytes`` (binary units) and ``quote`` (a URL component)."""

from __future__ import annotations

import datetime
import pathlib
import urllib.parse

import jinja2

from dask_blackbox.read.figures import fmt_bytes as _fmt_bytes
from dask_blackbox.read.figures import fmt_s as _fmt_s

__all__ = ["TEMPLATES", "environment", "env"]

TEMPLATES = pathlib.Path(__file__).with_name("ui")


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
    env.filters.update(time=_fmt_time, seconds=_fmt_s, bytes=_fmt_bytes,
                       quote=lambda v: urllib.parse.quote(str(v), safe=""))
    return env


_ENV: jinja2.Environment | None = None


def env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        _ENV = environment()
    return _ENV
