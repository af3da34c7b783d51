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
``blackbox.query.*`` time, memory and result limits (rows and bytes). A refused
statement is a 400 with a one-line ``error``. Requests served at once run on clients
of their own (chDB queries on one client wait for each other), so one long query
holds one reader, not all of them.

The request itself is bounded: every connection has a socket timeout
(``blackbox.query.socket-timeout``: a client that stops sending is cut off) and a
whole-request deadline (``blackbox.query.request-timeout``: the whole request must
have arrived that long after the connection was accepted, and the answer must have
been taken that long after the query ran, or the connection is shut; a client that
sends a byte now and then holds a thread no longer). At most
``blackbox.query.server-threads`` requests are handled at once; a connection past
that is answered 503 at once and closed. ``POST /query`` needs a ``Content-Length``
of at most 1 MiB that the body fills: missing is 411, not a non-negative integer is
400, larger than 1 MiB is 413, a body shorter than announced is 400. Error messages
are redacted (:func:`dask_blackbox.config.redact`).
"""

from __future__ import annotations

import datetime
import decimal
import hmac
import logging
import queue
import re
import socket
import threading
import time
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


_WRAPPED = re.compile(r"^(?:Nullable|LowCardinality)\((.*)\)$")
_SIMPLE_AGGREGATE = re.compile(r"^SimpleAggregateFunction\(\w+,\s*(.*)\)$")


def _base_type(type_name: str) -> str:
    """The type a value is encoded as: ``type_name`` without its Nullable,
    LowCardinality and SimpleAggregateFunction wrappers (``max`` over a roll-up's
    ``SimpleAggregateFunction(max, DateTime64(6, 'UTC'))`` is a DateTime64)."""
    while True:
        m = _WRAPPED.match(type_name) or _SIMPLE_AGGREGATE.match(type_name)
        if m is None:
            return type_name
        type_name = m.group(1)


def decode_result(body: bytes) -> tuple[list[str], list[tuple]]:
    """(columns, rows) from a server answer, with DateTime/Date columns back as
    datetime/date objects (JSON carries them as ISO text)."""
    answer = orjson.loads(body)
    converters = []
    for type_name in answer["types"]:
        base = _base_type(type_name)
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


class Deadline:
    """Shuts a connection's socket down (both ways) once ``seconds`` pass after
    :meth:`arm`, unless :meth:`disarm` came first: a read or write blocked on it
    then ends at once."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._timer: threading.Timer | None = None
        self.expired = False

    def arm(self, seconds: float) -> None:
        self.disarm()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self.expired = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: 55\r\n\r\n"
         b'{"error":"the query server is busy; try again shortly"}')


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most ``threads`` requests handled at once; a
    connection past that gets a 503 and is closed at once."""

    daemon_threads = True

    def __init__(self, address, handler, threads: int) -> None:
        self._slots = threading.BoundedSemaphore(threads)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            threading.Thread(target=self._refuse, args=(request,), daemon=True).start()
            return
        try:
            threading.Thread(target=self._handle, args=(request, client_address),
                             daemon=True).start()
        except BaseException:
            self._slots.release()
            raise

    def _refuse(self, request) -> None:
        """Answer 503 and close without a reset: what the client sent is read (for at
        most a second) after the answer, since closing a socket with unread bytes
        resets the connection and the client may lose the answer."""
        try:
            request.settimeout(1.0)
            request.sendall(_BUSY)
            request.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and request.recv(65536):
                pass
        except OSError:
            pass
        finally:
            request.close()

    def _handle(self, request, client_address) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    """One request to a :class:`QueryServer` (``owner``), one per connection, within
    ``request_timeout`` seconds; ``timeout`` is the socket's (StreamRequestHandler
    puts it on the socket). A server serves a subclass setting the three."""

    owner: QueryServer
    request_timeout: float

    def setup(self):
        super().setup()
        self.deadline = Deadline(self.connection)
        self.deadline.arm(self.request_timeout)

    def finish(self):
        self.deadline.disarm()
        try:
            super().finish()
        except OSError:  # the deadline shut the socket
            pass

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except OSError:  # the deadline shut the socket mid-request
            self.close_connection = True
        self.close_connection = True  # one request per connection

    def log_message(self, fmt, *args):  # requests are not worth a log line each
        logger.debug(fmt, *args)

    def _reply(self, status: int, body: bytes) -> None:
        # The answer must be taken within the deadline too.
        self.deadline.arm(self.request_timeout)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        given = self.headers.get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode(), self.owner.token.encode()):
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
            raw = self._body()
            self.deadline.disarm()  # the request is in: the query's own limits apply
            request = orjson.loads(raw)
            if not isinstance(request, dict):
                raise BadRequest(400, "the body must be a JSON object")
            body = self.owner.execute(request.get("sql"), request.get("parameters"))
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


class QueryServer:
    """Serves read-only SQL against ``client`` on 127.0.0.1:``port`` (0: any free
    port) in a background thread. ``limits`` (default ``blackbox.query.*``) bound
    every query; ``socket_timeout``, ``request_timeout`` and ``threads`` (defaults
    ``blackbox.query.socket-timeout``, ``request-timeout``, ``server-threads``)
    every connection and how many are served at once."""

    def __init__(self, client, port: int, token: str, limits: Limits | None = None,
                 socket_timeout: float | None = None, request_timeout: float | None = None,
                 threads: int | None = None, open_client=None) -> None:
        self.reader = ReadOnlyClient(client, limits)
        self.token = token
        #: Readers not in use. ``open_client`` (a callable returning a new client of
        #: the same ClickHouse) opens more, up to one per request served at once:
        #: each chDB client has its own handle, and queries on one handle wait for
        #: each other, so one long query does not hold every reader.
        self._idle: queue.LifoQueue[ReadOnlyClient] = queue.LifoQueue()
        self._idle.put(self.reader)
        self._opened: list[ReadOnlyClient] = []
        self._open_client = open_client
        self._open_lock = threading.Lock()
        if socket_timeout is None:
            socket_timeout = config.get_seconds("query.socket-timeout", minimum=0.001)
        if request_timeout is None:
            request_timeout = config.get_seconds("query.request-timeout", minimum=0.001)
        if threads is None:
            threads = config.get_int("query.server-threads", minimum=1)
        self._threads = threads
        handler = type("Handler", (_Handler,), {"owner": self, "timeout": socket_timeout,
                                                "request_timeout": request_timeout})
        self.httpd = _BoundedServer(("127.0.0.1", port), handler, threads)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="sink-query-server",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def _take(self) -> ReadOnlyClient:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._open_lock:
            if self._open_client is not None and len(self._opened) + 1 < self._threads:
                try:
                    reader = ReadOnlyClient(self._open_client(), self.reader.limits)
                except Exception as e:  # the one handle still serves
                    logger.warning("cannot open one more reader: %s", config.redact(e))
                    self._open_client = None
                else:
                    self._opened.append(reader)
                    return reader
        return self._idle.get()

    def execute(self, sql, parameters) -> bytes:
        if not isinstance(sql, str):
            raise QueryRejected("the request needs 'sql', a string")
        reader = self._take()
        try:
            result = reader.query(sql, parameters)
        finally:
            self._idle.put(reader)
        types = [t.name for t in result.column_types]
        return encode_result(result.column_names, types, result.result_rows)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
        for reader in self._opened:
            try:
                reader.close()
            except Exception:
                pass
