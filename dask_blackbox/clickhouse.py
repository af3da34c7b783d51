"""Opening ClickHouse through clickhouse-connect, and telling its errors apart.

The same client type serves a ``chdb://<dir>`` DSN (ClickHouse in this process; the
``chdb`` package registers the backend) and an ``http(s)://`` server. Opening fails
with :class:`ClickHouseUnavailable`, whose message says what to fix (a chDB directory
another process holds, a server that does not answer, ...).

Insert errors fall in two classes, see :func:`is_rejection`: the rows are wrong (a
value ClickHouse cannot store, a constraint) -- retrying cannot help, the rows go to
the dead-letter table -- or ClickHouse is not able to take any rows right now (down,
disk, permissions, too many parts) -- the sink waits and retries, losing nothing.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pathlib
import re
import struct
from urllib.parse import urlparse, urlunparse

import clickhouse_connect
from clickhouse_connect.driver.exceptions import ClickHouseError, DataError, DatabaseError

from dask_blackbox import config, runfiles

#: ClickHouse error codes that mean "these rows cannot be stored", not "try later".
REJECTION_CODES = frozenset({
    6,    # CANNOT_PARSE_TEXT
    27,   # CANNOT_PARSE_INPUT_ASSERTION_FAILED
    38,   # CANNOT_PARSE_DATE
    41,   # CANNOT_PARSE_DATETIME
    53,   # TYPE_MISMATCH
    69,   # ARGUMENT_OUT_OF_BOUND
    70,   # CANNOT_CONVERT_TYPE
    72,   # CANNOT_PARSE_NUMBER
    117,  # INCORRECT_DATA
    131,  # TOO_LARGE_STRING_SIZE
    321,  # VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
    407,  # DECIMAL_OVERFLOW
    469,  # VIOLATED_CONSTRAINT
})


#: What a ClickHouse call raises when ClickHouse is (perhaps only for now) unable to
#: do it: every clickhouse-connect error, and I/O errors (chDB writes a temp file).
UNAVAILABLE = (ClickHouseError, OSError)


#: The default of ``blackbox.clickhouse.rollup-retention``: two years.
ROLLUP_RETENTION_SECONDS = 730 * 86400

#: A plain ClickHouse identifier (database, cluster names).
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ClickHouseUnavailable(ConnectionError):
    """ClickHouse cannot be opened or reached; the message says why and where."""


#: The DSN without its password, for messages: :func:`dask_blackbox.config.redact`,
#: the one redaction function.
redact = config.redact


def chdb_owner(directory: pathlib.Path) -> str | None:
    """If another process holds the chDB directory, a description of it (ClickHouse's
    status file names the PID); None when the directory is free."""
    status = directory / "status"
    if not status.exists():
        return None
    with open(status, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().decode("utf-8", "replace").strip().replace("\n", ", ")
            return text or "another process"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def check_writable(directory: pathlib.Path, key: str) -> None:
    """Create ``directory`` if needed, private (:func:`dask_blackbox.runfiles.private_dir`),
    and prove it is writable, or raise ConfigError naming ``key`` (the setting that
    points there)."""
    try:
        runfiles.private_dir(directory)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise config.ConfigError(f"{key}: cannot write to {directory}: {e.strerror or e}") from None


def open_client(dsn: str, connect_timeout: float = 10.0, owned: bool = False,
                database: str | None = None):
    """A clickhouse-connect client for ``dsn`` (already validated by
    ``config.clickhouse_dsn``), or ClickHouseUnavailable. ``owned``: this process
    already has the chDB directory open (a second client shares its engine).
    ``database``: where unqualified table names point (it must exist)."""
    directory = config.chdb_path(dsn)
    if directory is not None:
        check_writable(directory, "blackbox.clickhouse.dsn")
        owner = None if owned else chdb_owner(directory)
        if owner is not None:
            raise ClickHouseUnavailable(
                f"the chDB directory {directory} is in use by another process ({owner}); "
                "one process at a time can own it"
            )
        try:
            return clickhouse_connect.get_client(dsn=f"chdb://{directory}", database=database)
        except Exception as e:
            raise ClickHouseUnavailable(f"cannot open chDB at {directory}: {e}") from e
    parsed = urlparse(dsn)
    scheme = {"clickhouse": "http", "clickhouses": "https"}.get(parsed.scheme, parsed.scheme)
    try:
        return clickhouse_connect.get_client(
            dsn=urlunparse(parsed._replace(scheme=scheme)),
            database=database,
            connect_timeout=connect_timeout,
            send_receive_timeout=max(30.0, connect_timeout),
        )
    except Exception as e:
        raise ClickHouseUnavailable(f"cannot reach ClickHouse at {redact(dsn)}: {e}") from e


def is_rejection(error: BaseException) -> bool:
    """True when ``error``, raised by an insert, means the rows themselves cannot be
    stored: ClickHouse refused their values, or clickhouse-connect could not serialise
    them for the column type."""
    if isinstance(error, DataError):
        return True
    if isinstance(error, DatabaseError):
        return getattr(error, "code", None) in REJECTION_CODES
    return isinstance(error, (TypeError, ValueError, AttributeError, OverflowError, struct.error))


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how the schema lives: the database, the retention of raw rows, the
    ClickHouse cluster name (None for a single node), and the retention of what
    outlives the raw rows (roll-ups, spans, lifecycle: sinks/sql/008_rollups.sql)."""

    database: str
    retention_seconds: int
    cluster: str | None = None
    rollup_retention_seconds: int = ROLLUP_RETENTION_SECONDS

    @classmethod
    def from_config(cls) -> Target:
        """The target described by ``blackbox.clickhouse.*``, validated."""
        database = str(config.get("clickhouse.database") or "")
        if not IDENTIFIER.match(database):
            raise config.ConfigError(
                f"blackbox.clickhouse.database: {database!r} is not a plain identifier "
                "(letters, digits and _, not starting with a digit)"
            )
        retention = config.get_seconds("clickhouse.retention")
        if retention < 3600:
            raise config.ConfigError(
                f"blackbox.clickhouse.retention: {config.get('clickhouse.retention')!r} "
                "is shorter than an hour; rows would expire while they are still loaded"
            )
        cluster = config.get("clickhouse.cluster")
        if cluster is not None and not IDENTIFIER.match(str(cluster)):
            raise config.ConfigError(
                f"blackbox.clickhouse.cluster: {cluster!r} is not a plain identifier"
            )
        rollups = config.get_seconds("clickhouse.rollup-retention")
        if rollups < retention:
            raise config.ConfigError(
                f"blackbox.clickhouse.rollup-retention: {config.get('clickhouse.rollup-retention')!r} "
                f"is shorter than blackbox.clickhouse.retention "
                f"({config.get('clickhouse.retention')!r}); roll-ups would expire before the "
                "rows they summarise")
        return cls(database, int(retention), str(cluster) if cluster else None, int(rollups))

    @property
    def placeholders(self) -> dict[str, str]:
        clustered = self.cluster is not None
        return {
            "database": self.database,
            "ttl": f"{self.retention_seconds} SECOND",
            "rollup_ttl": f"{max(self.rollup_retention_seconds, self.retention_seconds)} SECOND",
            "on_cluster": f"ON CLUSTER '{self.cluster}'" if clustered else "",
            "replicated": "Replicated" if clustered else "",
            "local": "_local" if clustered else "",
            "cluster": f"'{self.cluster}'" if clustered else "",
        }

    def table(self, name: str) -> str:
        """The table to insert into and read from: ``database.name`` (in cluster mode
        the Distributed table of that name)."""
        return f"{self.database}.{name}"

    def storage_table(self, name: str) -> str:
        """The table that holds the rows on a node, with the ON CLUSTER clause to
        address every node: what row deletions must target."""
        if self.cluster is None:
            return f"{self.database}.{name}"
        return f"{self.database}.{name}_local ON CLUSTER '{self.cluster}'"

    @property
    def rollups(self) -> Target:
        """The target of the roll-ups' database, ``<database>_rollups``
        (sinks/sql/008_rollups.sql)."""
        return dataclasses.replace(self, database=f"{self.database}_rollups")
