"""The alerter's durable state: one JSON file, ``<state-dir>/<group-id>.json``,
replaced whole and atomically (written beside it, flushed to disk, renamed over it,
the directory flushed), so a crash at any instant leaves the previous checkpoint or
the next, never a mix.

It holds, consistent with each other: the next raw-topic offset per partition, what
the watcher knew of each cluster after reading up to those offsets, the incidents
completed and not yet delivered (the *outbox*), and the ids of those delivered (or
given up) recently. An incident enters the outbox in the same write that moves the
offsets past the messages that completed it, so it is either re-derived from those
messages after a crash or delivered from the outbox: never lost.

One alerter per state directory: :meth:`Checkpoint.lock` holds an exclusive
``flock`` on ``<group-id>.lock`` while it runs.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
from typing import Any

import orjson

#: Ids of delivered (or given up) incidents remembered, newest kept.
REMEMBERED = 20_000
VERSION = 1


class CheckpointError(RuntimeError):
    """The checkpoint cannot be used; the message names the file and why."""


class Checkpoint:
    """Load, save and lock the checkpoint of one consumer group."""

    def __init__(self, directory: pathlib.Path, group_id: str):
        self.directory = pathlib.Path(directory)
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in group_id)
        self.path = self.directory / f"{safe}.json"
        self._lock_path = self.directory / f"{safe}.lock"
        self._lock = None

    def lock(self) -> None:
        """Hold the directory's lock for this group, or CheckpointError if another
        alerter does."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            f = open(self._lock_path, "a+")
        except OSError as e:
            raise CheckpointError(f"alerts state directory {self.directory} is not usable "
                                  f"(blackbox.alerts.state-dir): {e.strerror or e}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise CheckpointError(f"another alerter (pid {holder}) runs on {self.directory} for "
                                  "this group; stop it first or use another blackbox.alerts.state-dir")
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock = f

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def load(self) -> dict[str, Any] | None:
        """The last checkpoint, or None if there is none."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            state = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise CheckpointError(f"{self.path} is not a checkpoint ({e}); move it away to start "
                                  "from the end of the raw topic") from None
        if not isinstance(state, dict) or state.get("version") != VERSION:
            raise CheckpointError(f"{self.path} is not a version {VERSION} checkpoint; move it "
                                  "away to start from the end of the raw topic")
        return state

    def save(self, state: dict[str, Any]) -> None:
        """Replace the checkpoint with ``state`` (atomically, flushed to disk)."""
        data = orjson.dumps({**state, "version": VERSION}, option=orjson.OPT_NON_STR_KEYS)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
