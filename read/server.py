"""A loopback HTTP server through which other processes read the chDB directory the
sink owns (chDB allows one process per directory).

Protocol: ``POST /query`` with a JSON body ``{"sql": ..., "parameters": {...}}`` and
the header ``X-Blackbox-Token`` (the random token the sink writes to
``<data-dir>/sink.json``, readable only by its owner). The answer is JSON
``{"columns": [...], "types": [...], "rows": [[...], ...]}`` or, with status 400,
``{"error": "..."}`` (plus ``"rejected": true`` when the statement was refused
before it ran). Parameters are bound by ClickHouse, never spliced into the SQL: each
must be a ``{name:Type}`` placeholder of the statement
(:func:`~dask_blackbox.read.guard.check_parameters`). ``GET /ping`` answers
``{"ok": true}`` to the same token.

Every statement goes through :class:`~dask_blackbox.read.guard.ReadOnlyClient`: one
statement, parsed by ClickHouse and checked before it runs (SELECT, WITH, SHOW,
DESCRIBE, EXPLAIN, EXISTS; no INTO OUTFILE; no table function that reaches files,
URLs, other servers or the sink's memory), run under ``readonly=1`` and the
``blackbox.query.*`` time, memory and result limits. A refused statement is a 400
with a one-line ``error``.

The request itself is bounded: every connection has a socket timeout
(``blackbox.query.socket-timeout``; a client that stops sending is cut off, it never
holds a thread for longer), and ``POST /query`` needs a ``Content-Length`` of at most
1 MiB that the body fills: missing is 411, not a non-negative integer is 400, larger
than 1 MiB is 413, a body shorter than announced is 400. Error messages are redacted
(:func:`dask_blackbox.config.redact`).
"""

from __future__ import annotations

import datetime
import decimal
import hmac
import logging
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

from dask_blackbox import config
from dask_blackbox.read.guard import Limits, QueryRejected, ReadOnlyClient

__all__ = ["QueryRejected", "QueryServer", "TOKEN_HEADER", "decode_result", "encode_result"]

logger = logging.getLogger("dask_blackbox.read.server")

TOKEN_HEADER = "X-Blackbox-Token"
_MAX_BODY = 1 << 20
_LENGTH = re.compile(r"^[0-9]{1,20}$")


class BadRequest(Exception):
    """The HTTP request itself is unusable: (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json_default(value):
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    return str(value)


def encode_result(columns, types, rows) -> bytes:
    return orjson.dumps(
        {"columns": list(columns), "types": list(types), "rows": rows},
        default=_json_default,
        option=orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_SUBCLASS,
    )


def decode_result(body: bytes) -> tuple[list[str], list[tuple]]:
    """(columns, rows) from a server answer, with DateTime/Date columns back as
    datetime/date objects (JSON carries them as ISO text)."""
    answer = orjson.loads(body)
    converters = []
    for type_name in answer["types"]:
        base = re.sub(r"^(Nullable|LowCardinality)\((.*)\)$", r"\2", type_name)
        if base.startswith("DateTime"):
            converters.append(datetime.datetime.fromisoformat)
        elif base == "Date" or base == "Date32":
            converters.append(datetime.date.fromisoformat)
        else:
            converters.append(None)
    rows = [
        tuple(v if (f is None or v is None) else f(v) for f, v in zip(converters, row))
        for row in answer["rows"]
    ]
    return answer["columns"], rows


class QueryServer:
    """Serves read-only SQL against ``client`` on 127.0.0.1:``port`` (0: any free
    port) in a background thread. ``limits`` (default ``blackbox.query.*``) bound
    every query; ``socket_timeout`` (default ``blackbox.query.socket-timeout``)
    every connection."""

    def __init__(self, client, port: int, token: str, limits: Limits | None = None,
                 socket_timeout: float | None = None) -> None:
        self.reader = ReadOnlyClient(client, limits)
        self.token = token
        if socket_timeout is None:
            socket_timeout = config.get_seconds("query.socket-timeout", minimum=0.001)
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = socket_timeout  # StreamRequestHandler puts it on the socket

            def log_message(self, fmt, *args):  # requests are not worth a log line each
                logger.debug(fmt, *args)

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self) -> bool:
                given = self.headers.get(TOKEN_HEADER, "")
                if hmac.compare_digest(given.encode(), server.token.encode()):
                    return True
                self._reply(403, orjson.dumps({"error": f"missing or wrong {TOKEN_HEADER}"}))
                return False

            def do_GET(self):
                if self._authorized():
                    if self.path == "/ping":
                        self._reply(200, b'{"ok":true}')
                    else:
                        self._reply(404, b'{"error":"not found"}')

            def do_POST(self):
                if not self._authorized():
                    return
                if self.path != "/query":
                    self._reply(404, b'{"error":"not found"}')
                    return
                try:
                    request = orjson.loads(self._body())
                    if not isinstance(request, dict):
                        raise BadRequest(400, "the body must be a JSON object")
                    body = server.execute(request.get("sql"), request.get("parameters"))
                except BadRequest as e:
                    self.close_connection = True
                    self._reply(e.status, orjson.dumps({"error": str(e)}))
                    return
                except Exception as e:
                    message = " ".join(str(e).split()) or type(e).__name__
                    answer = {"error": config.redact(message)}
                    if isinstance(e, QueryRejected):
                        answer["rejected"] = True
                    self._reply(400, orjson.dumps(answer))
                    return
                self._reply(200, body)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding"):
                    raise BadRequest(411, "send the body with a Content-Length, not chunked")
                values = self.headers.get_all("Content-Length") or []
                if not values:
                    raise BadRequest(411, "Content-Length is required")
                if len(set(values)) != 1 or not _LENGTH.match(values[0].strip()):
                    raise BadRequest(400, "Content-Length must be one non-negative integer")
                length = int(values[0])
                if length > _MAX_BODY:
                    raise BadRequest(413, f"request larger than {_MAX_BODY} bytes")
                try:
                    body = self.rfile.read(length)
                except OSError:  # the socket timeout: the client stopped sending
                    body = b""
                if len(body) != length:
                    raise BadRequest(400, f"the body is shorter than its Content-Length ({length})")
                return body

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="sink-query-server",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def execute(self, sql, parameters) -> bytes:
        if not isinstance(sql, str):
            raise QueryRejected("the request needs 'sql', a string")
        result = self.reader.query(sql, parameters)
        types = [t.name for t in result.column_types]
        return encode_result(result.column_names, types, result.result_rows)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
