"""Run files: how the processes of a local pipeline find each other.

A process that others must find describes itself in a small JSON file in the data
directory (``blackbox.data-dir``), written atomically with mode 0600 (it may hold a
token), and removes it when it stops:

- ``up.json``, by the local supervisor (``dask-blackbox up``):
  ``{"pid", "kafka", "topic_prefix", "clickhouse", "started_at"}``;
- ``sink.json``, by the sink while it runs:
  ``{"pid", "query_url", "dsn", "started_at", "token", "metrics_url", "loading"}``
  (``loading``: the sink has its partitions and loads; false while it joins its group
  and repairs what a crash left, when it already serves queries);
- ``exporter.json``, by the continuous OpenTelemetry exporter while it runs:
  ``{"pid", "endpoint", "journal", "started_at", "metrics_url"}``.

The data directory and what a pipeline keeps under it (logs, the chDB store, the
brokers' and processors' data) are private to their owner: :func:`private_dir`
creates them 0700, and takes group and other permissions away from one that exists.

A file is *live* only while the process that wrote it runs (its ``pid`` answers
signal 0); a file left behind by a killed process is stale and ignored. This module
is the only one that reads or writes these files.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

UP = "up.json"
SINK = "sink.json"
EXPORTER = "exporter.json"


def path(directory: pathlib.Path, name: str) -> pathlib.Path:
    """Where run file ``name`` lives in ``directory``."""
    return pathlib.Path(directory) / name


def private_dir(directory: pathlib.Path) -> pathlib.Path:
    """Create ``directory`` (and missing parents) readable by its owner only (0700);
    an existing one that this user owns loses any group and other permissions. Raises
    OSError when it cannot be created or changed."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = directory.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(directory, st.st_mode & 0o700)
    return directory


def pid_alive(pid: Any) -> bool:
    """Whether a process with this pid runs (any user's)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write(directory: pathlib.Path, name: str, info: dict) -> pathlib.Path:
    """Write run file ``name`` atomically, readable by its owner only (0600)."""
    target = path(directory, name)
    tmp = target.with_name(f".{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, target)
    return target


def read(directory: pathlib.Path, name: str) -> dict | None:
    """The content of run file ``name`` if the process that wrote it still runs;
    None if there is no such file, it is unreadable, or it is stale."""
    try:
        info = json.loads(path(directory, name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not pid_alive(info.get("pid")):
        return None
    return info


def remove(directory: pathlib.Path, name: str) -> None:
    """Remove run file ``name`` if this process wrote it (a newer writer's file stays)."""
    target = path(directory, name)
    try:
        if json.loads(target.read_text()).get("pid") == os.getpid():
            target.unlink()
    except (OSError, ValueError, AttributeError):
        pass
