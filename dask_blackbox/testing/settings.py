"""Settings handed to a child process as ``DASK_*`` environment variables, written the
way ``dask.config.collect_env`` reads them back there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dask.config import interpret_value

#: Values written as Python literals; anything else (a path, ...) is written as its text.
LITERALS = (bool, int, float, list, tuple, type(None))


def dask_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """``settings`` (dotted keys as ``dask.config.set`` takes them, nested dicts, or
    both) as ``DASK_*`` environment variables: ``blackbox.kafka.bootstrap-servers``
    becomes ``DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS``. Numbers, booleans, None and
    lists are written as literals; text is written as it is, quoted only where Dask
    would read it back as something else (``"true"``, ``"2"``)."""
    return {"DASK_" + "__".join(part.upper().replace("-", "_") for part in key.split(".")):
            _text(value) for key, value in _flat(settings)}


def _flat(settings: Mapping[str, Any], within: str = ""):
    for key, value in settings.items():
        key = f"{within}.{key}" if within else str(key)
        if isinstance(value, Mapping):
            yield from _flat(value, key)
        else:
            yield key, value


def _text(value: Any) -> str:
    if isinstance(value, str):
        read = interpret_value(value)
        return value if type(read) is str and read == value else repr(value)
    if isinstance(value, LITERALS):
        return repr(value)
    return str(value)
