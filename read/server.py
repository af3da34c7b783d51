"""A loopback HTTP server through which other processes read the chDB directory the
sink owns (chDB allows one process per directory).

Protocol: ``POST /query`` with a JSON body ``{"sql": ..., "parameters": {...}}`` and
the header ``X-Blackbox-Token`` (the random token the sink writes to
``<data-dir>/sink.json``, readable only by its owner). The answer is JSON
``{"columns": [...], "types": [...], "rows": [[...], ...]}`` or, with status 400,
``{"error": "..."}``. Parameters are bound server-side by clickhouse-connect
(``{name:Type}`` placeholders), never spliced into the SQL. ``GET /ping`` answers
``{"ok": true}`` to the same token.

Only reading statements are accepted (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN, EXISTS;
no INTO OUTFILE), and they run with ClickHouse's ``readonly=2``.
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

logger = logging.getLogger("dask_blackbox.read.server")

TOKEN_HEADER = "X-Blackbox-Token"
_MAX_BODY = 1 << 20
_READ_ONLY = re.compile(r"^\s*\(*\s*(SELECT|WITH|SHOW|DESCRIBE|DESC|EXPLAIN|EXISTS)\b", re.I)
_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.I)
_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)


class QueryRejected(ValueError):
    """The statement is not a read-only query."""


def check_read_only(sql: str) -> None:
    """Raise QueryRejected unless ``sql`` only reads."""
    bare = _COMMENTS.sub(" ", sql)
    if not _READ_ONLY.match(bare) or _OUTFILE.search(bare):
        raise QueryRejected(
            "only read-only statements (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN, EXISTS) "
            "are served while the sink owns the chDB directory"
        )


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
    port) in a background thread."""

    def __init__(self, client, port: int, token: str) -> None:
        self.client = client
        self.token = token
        server = self

        class Handler(BaseHTTPRequestHandler):
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
                length = int(self.headers.get("Content-Length") or 0)
                if length > _MAX_BODY:
                    self._reply(413, b'{"error":"request too large"}')
                    return
                try:
                    request = orjson.loads(self.rfile.read(length))
                    body = server.execute(request.get("sql"), request.get("parameters"))
                except Exception as e:
                    self._reply(400, orjson.dumps({"error": str(e)}))
                    return
                self._reply(200, body)

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
        if parameters is not None and not isinstance(parameters, dict):
            raise QueryRejected("'parameters' must be an object")
        check_read_only(sql)
        result = self.client.query(sql, parameters=parameters or None, settings={"readonly": 2})
        types = [t.name for t in result.column_types]
        return encode_result(result.column_names, types, result.result_rows)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
