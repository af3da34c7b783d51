"""Read-only SQL is read-only, on every query path.

Two real sinks load real (empty) topics into chDB: one keeps running, so the CLI's
``dask-blackbox query`` and Python's ``queries.connect()`` go through its query server
("server"); the other is stopped, so both open the chDB directory directly
("direct"). On both paths every known bypass is refused before it reaches
ClickHouse, with one line, and nothing changed: a multi-statement string that drops a
table, a string literal holding ``/*`` that hid ``INTO OUTFILE``, ``file()`` and
``url()``, a plain ``DROP TABLE``; and parameters that clickhouse-connect would splice
into the text on the client (``%(name)s`` in a literal, a ``$name$`` marker with bytes,
positional ``%s``, a name that is no placeholder), which would run text that was never
checked. Queries have a time and a memory limit, and the query server refuses bad
``Content-Length`` headers and never hangs on a client.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import socket
import subprocess
import sys
import time
import uuid

import dask.config
import pytest

from dask_blackbox import kafka, runfiles
from dask_blackbox.read import guard

from conftest import subprocess_env
from dask_blackbox.testing.settings import dask_env
from sink_support import SinkProcess

TABLE = "blackbox.envelopes"
BACKEND = {"server": "RemoteBackend", "direct": "DirectBackend"}

#: Limits the sinks' query servers run with (and the direct path gets by --set). The
#: execution time is far above what any query here needs on a slow, loaded machine (a
#: bound placeholder took 2.9 s on one): only the query meant to exceed it does.
MAX_EXECUTION = "20s"
LIMITS = {"DASK_BLACKBOX__QUERY__MAX_EXECUTION_TIME": MAX_EXECUTION,
          "DASK_BLACKBOX__QUERY__MAX_MEMORY_USAGE": "64MiB",
          "DASK_BLACKBOX__QUERY__SOCKET_TIMEOUT": "1s",
          "DASK_BLACKBOX__QUERY__REQUEST_TIMEOUT": "2s",
          "DASK_BLACKBOX__QUERY__SERVER_THREADS": "3"}


def _settings(broker: str, data_dir) -> dict[str, str]:
    prefix = "ro" + uuid.uuid4().hex[:10]
    settings = {
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": 1,
        "blackbox.data-dir": str(data_dir),
        "blackbox.sink.group-id": f"sink-{prefix}",
    }
    with dask.config.set(settings):
        asyncio.run(kafka.ensure_topics())
    return {**dask_env(settings), **LIMITS, "_path": data_dir.name}


@pytest.fixture(scope="module")
def paths(broker, tmp_path_factory):
    """{"server": env of a data dir whose sink runs, "direct": one whose sink stopped}."""
    root = tmp_path_factory.mktemp("read-only")
    direct = _settings(broker, root / "direct")
    stopped = SinkProcess(direct)
    try:
        stopped.wait_ready()
    finally:
        assert stopped.terminate() == 0, stopped.stderr()
    server = _settings(broker, root / "server")
    sink = SinkProcess(server)
    try:
        sink.wait_ready()
        yield {"server": server, "direct": direct}
    finally:
        sink.terminate()


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args],
                          env=subprocess_env(env), capture_output=True, text=True, timeout=120)


_PYTHON = """
import sys
from dask_blackbox.read import queries
backend = queries.connect()
print(type(backend).__name__)
for sql in sys.argv[1:]:
    try:
        backend.query(sql)
    except queries.QueryRejected as e:
        print("rejected:", e)
    except queries.QueryError as e:
        print("failed:", e)
    else:
        print("ran")
"""


def python_api(env: dict[str, str], *sqls: str) -> list[str]:
    """One outcome line per statement of ``queries.connect().query(sql)``, in a fresh
    process (chDB lets one process own a directory, so not in this one); checks the
    backend is the one of the path."""
    out = subprocess.run([sys.executable, "-c", _PYTHON, *sqls], env=subprocess_env(env),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    backend, *outcomes = out.stdout.strip().splitlines()
    assert backend == BACKEND[env["_path"]]
    assert len(outcomes) == len(sqls), out.stdout
    return outcomes


_BIND_PYTHON = """
import json, sys
from dask_blackbox.read import queries
target = sys.argv[1]
cases = {
    # Old clickhouse-connect routing: no {name:Type} in the text, so `query % values`:
    # each quoted value closes the literal, and what it holds runs as SQL.
    "pyformat in a literal": ("SELECT '%(a)s" + target + "%(b)s'",
                              {"a": "x INTO OUTFILE", "b": "TRUNCATE --"}),
    # A "$name$" key with bytes: the raw bytes are spliced after the marker.
    "bytes after a heredoc marker": ("SELECT 'x$a$'",
                                     {"$a$": ("' INTO OUTFILE '" + target + "' TRUNCATE --").encode()}),
    "positional %s": ("SELECT '%s' AS a", ["' INTO OUTFILE '" + target + "' TRUNCATE --"]),
    "a name beside a placeholder": ("SELECT {a:String} AS a, '%(b)s' AS b", {"a": "x", "b": "y"}),
    "a placeholder inside a literal": ("SELECT '{a:String}' AS a", {"a": "x"}),
    "a name that is no placeholder": ("SELECT {a:String} AS a", {"a": "x", "b": "y"}),
    "bound on the server": ("SELECT {a:String} AS a, {t:DateTime64(3, 'UTC')} AS t",
                            {"a": "' INTO OUTFILE '" + target + "' --", "t": 1.5}),
}
backend = queries.connect()
out = {"backend": type(backend).__name__}
for name, (sql, params) in cases.items():
    try:
        columns, rows = backend.query(sql, params)
    except queries.QueryRejected as e:
        out[name] = "rejected: " + str(e)
    except queries.QueryError as e:
        out[name] = "failed: " + str(e)
    else:
        out[name] = ["ran", [list(map(str, r)) for r in rows]]
print(json.dumps(out))
"""

BIND_CASES = ("pyformat in a literal", "bytes after a heredoc marker", "positional %s",
              "a name beside a placeholder", "a placeholder inside a literal",
              "a name that is no placeholder")


@pytest.fixture(scope="module")
def bound(paths, tmp_path_factory):
    """Per path: (the file a bypass would overwrite, each case's outcome through
    ``queries.connect().query(sql, parameters)``), all cases in one process."""
    out = {}
    for path, env in paths.items():
        target = tmp_path_factory.mktemp("bind") / "precious.txt"
        target.write_text("precious\n")
        run = subprocess.run([sys.executable, "-c", _BIND_PYTHON, str(target)],
                             env=subprocess_env(env), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        outcomes = json.loads(run.stdout.strip().splitlines()[-1])
        assert outcomes.pop("backend") == BACKEND[path]
        out[path] = (target, outcomes)
    return out


@pytest.mark.parametrize("case", BIND_CASES)
@pytest.mark.parametrize("path", ["server", "direct"])
def test_parameters_are_never_bound_on_the_client(bound, path, case):
    target, outcomes = bound[path]
    assert str(outcomes[case]).startswith("rejected: query refused: "), outcomes[case]
    assert "placeholder" in outcomes[case] or "mapping" in outcomes[case], outcomes[case]
    assert target.read_text() == "precious\n"


@pytest.mark.parametrize("path", ["server", "direct"])
def test_placeholders_are_bound_on_the_server(bound, path):
    target, outcomes = bound[path]
    assert outcomes["bound on the server"] == [
        "ran", [[f"' INTO OUTFILE '{target}' --", "1970-01-01 00:00:01.500000"]]]


def table_exists(env: dict[str, str]) -> bool:
    out = cli(env, "query", f"EXISTS TABLE {TABLE}", "--format", "csv")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "1"


def assert_refused(out: subprocess.CompletedProcess, *fragments: str) -> None:
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("dask-blackbox: error: query refused: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("path", ["server", "direct"])
def test_multi_statement_drops_nothing(paths, path):
    env = paths[path]
    assert_refused(cli(env, "query", f"SELECT 1; DROP TABLE {TABLE}"), "more than one statement")
    outcomes = python_api(env, f"SELECT 1; DROP TABLE {TABLE}", f"SELECT 1; DROP TABLE {TABLE};",
                          f"SELECT ';' AS a; DROP TABLE {TABLE}", f"SELECT 1;; DROP TABLE {TABLE}")
    assert all(o.startswith("rejected: query refused: more than one statement") for o in outcomes), outcomes
    assert table_exists(env)


@pytest.mark.parametrize("path", ["server", "direct"])
def test_comment_in_a_string_hides_no_outfile(paths, path, tmp_path):
    env = paths[path]
    target = tmp_path / "written.csv"
    sqls = (f"SELECT '/*' AS a INTO OUTFILE '{target}' -- */",
            f"SELECT 1 AS a /* a comment */ INTO OUTFILE '{target}'",
            f"SELECT '--' AS a INTO /* ' */ OUTFILE '{target}' FORMAT CSV",
            f"SELECT $$/*$$ AS a INTO OUTFILE '{target}' -- */")
    assert_refused(cli(env, "query", sqls[0]), "INTO OUTFILE")
    outcomes = python_api(env, *sqls)
    assert all(o.startswith("rejected: query refused: INTO OUTFILE") for o in outcomes), outcomes
    assert not target.exists()


@pytest.mark.parametrize("path", ["server", "direct"])
def test_file_and_url_are_refused(paths, path):
    env = paths[path]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        cases = [
            ("SELECT * FROM file('/etc/hostname', 'LineAsString')", "file()"),
            ("SELECT file('/etc/hostname')", "file()"),
            ("SELECT * FROM `file`('/etc/hostname', 'LineAsString')", "file()"),
            (f"SELECT * FROM url('http://127.0.0.1:{port}/x', 'LineAsString')", "url()"),
            (f"SELECT * FROM URL('http://127.0.0.1:{port}/x', 'LineAsString')", "url()"),
            (f"SELECT * FROM remote('127.0.0.1:{port}', system.one)", "remote()"),
            ("SELECT * FROM cluster('default', system.one)", "cluster()"),
            ("SELECT * FROM Python(sys)", "python()"),
            ("SELECT * FROM input('a String')", "input()"),
        ]
        assert_refused(cli(env, "query", cases[0][0]), "file()")
        assert_refused(cli(env, "query", cases[3][0]), "url()")
        outcomes = python_api(env, *(sql for sql, _ in cases))
        for (sql, name), outcome in zip(cases, outcomes):
            assert outcome.startswith(f"rejected: query refused: {name}"), (sql, outcome)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected to the URL's server
    finally:
        listener.close()


@pytest.mark.parametrize("path", ["server", "direct"])
def test_statements_that_are_not_reads(paths, path):
    env = paths[path]
    assert_refused(cli(env, "query", f"DROP TABLE {TABLE}"), "DROP is not a read")
    sqls = (f"DROP TABLE {TABLE}", f"/* SELECT */ DROP TABLE {TABLE}",
            f"-- SELECT\nTRUNCATE TABLE {TABLE}", f"INSERT INTO {TABLE} SELECT * FROM {TABLE}",
            "SYSTEM SHUTDOWN", "SET readonly = 0", f"EXPLAIN AST DROP TABLE {TABLE}",
            f"ALTER TABLE {TABLE} DELETE WHERE 1")
    outcomes = python_api(env, *sqls)
    assert all(o.startswith("rejected: query refused:") for o in outcomes), outcomes
    assert table_exists(env)
    # Reads still work, comments and all; a query cannot lift its own limits.
    outcomes = python_api(env, "/* why */ SELECT count() AS n FROM system.one -- ok",
                          "SELECT 1 SETTINGS max_execution_time = 0")
    assert outcomes[0] == "ran"
    assert outcomes[1].startswith("failed:") and "readonly" in outcomes[1], outcomes


@pytest.mark.parametrize("path", ["server", "direct"])
def test_time_and_memory_limits(paths, path):
    env = paths[path]
    # The direct path takes the limits from the CLI's config; the server path has
    # them from the sink's (LIMITS).
    flags = ["--set", f"query.max-execution-time={MAX_EXECUTION}", "--set",
             "query.max-memory-usage=64MiB"]
    # a count no machine finishes within the limit (1e15 rows: days), so it is the limit
    # that ends it, however fast the machine
    out = cli(env, "query", "SELECT count() FROM numbers(1000000000000000)", *flags)
    assert out.returncode == 1 and "TIMEOUT_EXCEEDED" in out.stderr, out.stderr
    out = cli(env, "query", "SELECT length(groupArray(number)) FROM numbers(100000000)", *flags)
    assert out.returncode == 1 and "MEMORY_LIMIT_EXCEEDED" in out.stderr, out.stderr


def _server(env: dict[str, str]) -> tuple[str, int, str]:
    info = runfiles.read(pathlib.Path(env["DASK_BLACKBOX__DATA_DIR"]), runfiles.SINK)
    assert info and info["query_url"], info
    host, port = info["query_url"].removeprefix("http://").rsplit(":", 1)
    return host, int(port), info["token"]


def _exchange(host: str, port: int, request: bytes, hold_open: bool = False) -> bytes:
    """Send ``request`` and read the whole answer (the server closes the connection).
    The generous client timeout only keeps a broken server from hanging the test."""
    with socket.create_connection((host, port), timeout=120) as s:
        s.sendall(request)
        if not hold_open:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:  # the server answered (503, 400) and closed first: read it
                pass
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        return answer


def _post(token: str, headers: str, body: bytes) -> bytes:
    return (f"POST /query HTTP/1.1\r\nHost: x\r\nX-Blackbox-Token: {token}\r\n{headers}\r\n"
            .encode() + body)


def test_query_server_rejects_bad_content_length(paths):
    host, port, token = _server(paths["server"])
    body = b'{"sql": "SELECT 1"}'
    cases = [
        ("", 411),                                        # missing
        ("Content-Length: -5\r\n", 400),                  # negative
        ("Content-Length: ten\r\n", 400),                 # not a number
        ("Content-Length: 1_9\r\n", 400),                 # Python would read 19
        ("Content-Length: 19\r\nContent-Length: 20\r\n", 400),  # two answers
        (f"Content-Length: {(1 << 20) + 1}\r\n", 413),    # too large
        ("Transfer-Encoding: chunked\r\n", 411),
        (f"Content-Length: {len(body) + 100}\r\n", 400),  # longer than the body
    ]
    for headers, status in cases:
        answer = _exchange(host, port, _post(token, headers, body))
        assert answer.startswith(f"HTTP/1.0 {status} ".encode()), (headers, answer[:200])
        assert b'"error"' in answer
    # A client that announces more than it sends and keeps the connection open is
    # answered once the socket timeout (1s here) passes, not waited on forever.
    answer = _exchange(host, port, _post(token, f"Content-Length: {len(body) + 100}\r\n", body),
                       hold_open=True)
    assert answer.startswith(b"HTTP/1.0 400 "), answer[:200]
    # A client that connects and says nothing is dropped.
    assert _exchange(host, port, b"", hold_open=True) == b""
    # And the server still serves.
    ok = _exchange(host, port, _post(token, f"Content-Length: {len(body)}\r\n", body))
    assert ok.startswith(b"HTTP/1.0 200 ") and b'"rows":[[1]]' in ok, ok[:300]


class Trickle:
    """A client that sends its request a byte at a time, each byte well within the
    socket timeout (1s), as a slow or hostile client would; it notes when the server
    closed the connection."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.sock = socket.create_connection((host, port), timeout=5)
        self.request = _post(token, "Content-Length: 1000\r\n", b"{")
        self.sent = 0
        self.closed_after: float | None = None
        self.started = time.monotonic()

    def step(self) -> None:
        if self.closed_after is not None:
            return
        try:
            self.sock.sendall(self.request[self.sent % len(self.request):][:1])
            self.sent += 1
            self.sock.setblocking(False)
            try:
                answer = self.sock.recv(65536)
            except BlockingIOError:
                return
            finally:
                self.sock.setblocking(True)
            if answer == b"" or answer:
                self.closed_after = time.monotonic() - self.started
        except OSError:
            self.closed_after = time.monotonic() - self.started

    def close(self) -> None:
        self.sock.close()


def test_query_server_bounds_whole_requests_and_threads(paths):
    """The request timeout (2s here) bounds the whole request, not one read; at most
    3 requests are handled at once, a fourth is answered 503 at once."""
    host, port, token = _server(paths["server"])
    body = b'{"sql": "SELECT 1"}'
    slow = [Trickle(host, port, token) for _ in range(3)]
    try:
        for _ in range(3):  # a few bytes each: every thread is taken
            for t in slow:
                t.step()
            time.sleep(0.2)
        busy = _exchange(host, port, _post(token, f"Content-Length: {len(body)}\r\n", body))
        assert busy.startswith(b"HTTP/1.0 503 "), busy[:200]
        assert b"busy" in busy
        give_up = time.monotonic() + 15
        while time.monotonic() < give_up and any(t.closed_after is None for t in slow):
            for t in slow:
                t.step()
            time.sleep(0.3)
        assert all(t.closed_after is not None for t in slow), [t.sent for t in slow]
        assert all(t.sent < 40 for t in slow), [t.sent for t in slow]  # cut off, not done
    finally:
        for t in slow:
            t.close()
    ok = _exchange(host, port, _post(token, f"Content-Length: {len(body)}\r\n", body))
    assert ok.startswith(b"HTTP/1.0 200 ") and b'"rows":[[1]]' in ok, ok[:300]


def test_canonical_check_reads_tokens_not_text():
    """The statement check runs on ClickHouse's canonical text; string literals and
    quoted identifiers are tokens, so their content never counts as SQL."""
    denied = guard.DENIED_TABLE_FUNCTIONS | guard.DENIED_FUNCTIONS
    guard.check_canonical("SELECT 'INTO OUTFILE', 'file(', `url`\nFROM t", denied)
    guard.check_canonical("SELECT format('{} x', 1), x IN ({ids:Array(String)})", denied)
    guard.check_canonical("EXPLAIN actions = 1, header = 1\nSELECT 1", denied)
    for sql, reason in [("SELECT 1\nINTO OUTFILE 'x'", "INTO OUTFILE"),
                        ("SELECT `file`('x')", "file()"),
                        ("SELECT 'a\\'b', url('x')", "url()"),
                        ("EXPLAIN CURRENT TRANSACTION", "EXPLAIN of something"),
                        ("SELECT 'unterminated", "unterminated"),
                        ("ALTER TABLE t DELETE WHERE 1", "ALTER is not a read")]:
        with pytest.raises(guard.QueryRejected, match=reason):
            guard.check_canonical(sql, denied)
