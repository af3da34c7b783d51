"""Reaching the recorded history: a :class:`Backend` runs one SQL statement and
returns ``(columns, rows)``.

:func:`connect` returns one: while a sink runs and owns the configured chDB
directory (its run file ``sink.json`` names it, see :mod:`dask_blackbox.runfiles`),
queries go through that sink's loopback query server (:mod:`.server`); otherwise
the DSN is opened directly with clickhouse-connect (chDB or a ClickHouse server).
Parameters use clickhouse-connect's server-side binding (``{name:Type}``);
unqualified table names are those of ``blackbox.clickhouse.database`` either way.

Either way a backend only reads: the direct backend runs every statement through
:class:`~dask_blackbox.read.guard.ReadOnlyClient` (one statement, checked, under the
read-only profile and the ``blackbox.query.*`` limits), and the query server does the
same on its side. A statement that is not one read raises
:class:`~dask_blackbox.read.guard.QueryRejected` (a :class:`QueryError`) before it
reaches ClickHouse. Error messages are redacted (:func:`dask_blackbox.config.redact`).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import Protocol

import orjson

from dask_blackbox import clickhouse, config, runfiles
from dask_blackbox.clickhouse import Target
from dask_blackbox.read import server as query_server
from dask_blackbox.read.guard import Limits, QueryError, QueryRejected, ReadOnlyClient

__all__ = ["Backend", "BackendUnavailable", "DirectBackend", "QueryError", "QueryRejected", "RemoteBackend",
           "Result", "connect", "running_sink"]

Result = tuple[list[str], list[tuple]]


class BackendUnavailable(QueryError, clickhouse.ClickHouseUnavailable):
    """ClickHouse cannot be opened or reached for reading; the message (one line,
    redacted) says why and where. Both a QueryError and a ClickHouseUnavailable."""


class Backend(Protocol):
    database: str

    def query(self, sql: str, parameters: dict | None = None) -> Result: ...

    def close(self) -> None: ...


class DirectBackend:
    """Runs read-only queries on a clickhouse-connect client of its own, which it
    keeps inside a :class:`~dask_blackbox.read.guard.ReadOnlyClient`: nothing can
    write through it."""

    def __init__(self, client, database: str, limits: Limits | None = None) -> None:
        self._reader = ReadOnlyClient(client, limits)
        self.database = database

    def query(self, sql: str, parameters: dict | None = None) -> Result:
        result = self._reader.query(sql, parameters)
        return list(result.column_names), result.result_rows

    def close(self) -> None:
        self._reader.close()


class RemoteBackend:
    """Sends queries to a running sink's query server (see dask_blackbox.read.server)."""

    def __init__(self, url: str, token: str, database: str, timeout: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.database = database
        #: Seconds to wait for an answer: the query time limit, plus a margin.
        self.timeout = timeout if timeout is not None else (
            config.get_seconds("query.max-execution-time", minimum=0.001) + 30.0)

    def _request(self, path: str, body: bytes | None, timeout: float) -> bytes:
        request = urllib.request.Request(
            self.url + path, data=body, method="POST" if body is not None else "GET",
            headers={query_server.TOKEN_HEADER: self.token, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            detail = e.read()
            try:
                answer = orjson.loads(detail)
                message, rejected = str(answer["error"]), answer.get("rejected") is True
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                message, rejected = detail.decode("utf-8", "replace") or str(e), False
            raise (QueryRejected if rejected else QueryError)(config.redact(message)) from None

    def ping(self) -> bool:
        try:
            return orjson.loads(self._request("/ping", None, 2.0)).get("ok") is True
        except (OSError, QueryError, orjson.JSONDecodeError):
            return False

    def query(self, sql: str, parameters: dict | None = None) -> Result:
        body = orjson.dumps({"sql": sql, "parameters": parameters or {}},
                            default=query_server._json_default)
        try:
            return query_server.decode_result(self._request("/query", body, self.timeout))
        except OSError as e:
            raise QueryError(config.redact(
                f"the sink's query server at {self.url} did not answer: {e}")) from None

    def close(self) -> None:
        pass


def _same_dsn(a: str, b: str) -> bool:
    """Whether two DSNs name the same ClickHouse (run files may hold them redacted)."""
    pa, pb = config.chdb_path(a), config.chdb_path(b)
    if pa is not None and pb is not None:
        return os.path.realpath(pa) == os.path.realpath(pb)
    return config.redact(a) == config.redact(b)


def running_sink() -> RemoteBackend | None:
    """A backend for the live sink that owns the configured DSN, if there is one."""
    info = runfiles.read(config.data_dir(), runfiles.SINK)
    if not (info and info.get("query_url") and _same_dsn(str(info.get("dsn")), config.clickhouse_dsn())):
        return None
    backend = RemoteBackend(info["query_url"], str(info.get("token", "")),
                            Target.from_config().database)
    return backend if backend.ping() else None


def connect() -> Backend:
    """The backend for the configured DSN: the running sink's query server when a sink
    owns the chDB directory, otherwise a direct clickhouse-connect client.
    :class:`BackendUnavailable` (one redacted line) when neither can be had."""
    target = Target.from_config()
    limits = Limits.from_config()
    remote = running_sink()
    if remote is not None:
        return remote
    dsn = config.clickhouse_dsn()
    directory = config.chdb_path(dsn)
    if directory is not None and not (directory / "metadata").exists():
        raise BackendUnavailable(config.redact(
            f"no chDB data at {directory} (blackbox.clickhouse.dsn): nothing was recorded "
            "there yet -- start the pipeline with `dask-blackbox up` or the sink with "
            "`dask-blackbox sink`"
        ))
    try:
        client = clickhouse.open_client(dsn, database=target.database)
    except clickhouse.ClickHouseUnavailable as e:
        raise BackendUnavailable(config.redact(" ".join(str(e).split()))) from None
    return DirectBackend(client, target.database, limits)
