"""The Grafana dashboards of infra/grafana as the tests read them (the committed JSON,
every query in it), and a query as it reaches ClickHouse: Grafana's template variables
interpolated first, with Grafana's own formatting rules, then the ClickHouse plugin's
macros (pkg/macros) on what is left.

The formats are those of Grafana's format registry (grafana/scenes,
``variables/interpolation/formatRegistry.ts``), as written there:

- ``singlequote``: ``'`` + ``replace(v, /'/g, "\\\\'")`` + ``'``: a quote becomes
  backslash-quote and a backslash stays as it is;
- ``percentencode``: ``encodeURIComponentStrict(v)``: JavaScript's
  ``encodeURIComponent`` (UTF-8; ``A-Za-z0-9-_.!~*'()`` left as they are), then
  ``!'()*`` as ``%XX`` too: only ``A-Za-z0-9-_.~`` and ``%XX`` remain;
- ``raw`` (no format): the value as it is.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import pathlib
import re
import threading
from urllib.parse import quote

import pytest

GRAFANA = pathlib.Path(__file__).resolve().parents[1] / "infra" / "grafana"


def builder():
    """infra/grafana/dashboards.py, imported from its file (it is a script, not a module)."""
    spec = importlib.util.spec_from_file_location("blackbox_dashboards", GRAFANA / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}


def queries() -> list[tuple[str, str]]:
    """(dashboard/panel or variable, SQL) of every query in the dashboards."""
    out = []
    for uid, board in committed().items():
        for panel in board["panels"]:
            assert panel["targets"], f"{uid}: panel {panel['title']!r} has no query"
            for target in panel["targets"]:
                out.append((f"{uid}/{panel['title']}", target["rawSql"]))
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                out.append((f"{uid}/${variable['name']}", variable["query"]))
    return out


def singlequote(value: str) -> str:
    return "'" + value.replace("'", "\\'") + "'"


def percentencode(value: str) -> str:
    # encodeURIComponent leaves A-Za-z0-9 and -_.!~*'() alone; the strict variant
    # encodes !'()* as well, which is what quote() leaves alone with safe="".
    return quote(value, safe="", encoding="utf-8")


FORMATS = {"singlequote": singlequote, "percentencode": percentencode, "raw": str}


def interpolate(sql: str, variables: dict[str, str]) -> str:
    """Grafana's template variables: ``${name}``, ``${name:format}``, ``$name``."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name not in variables:
            return m.group(0)
        return FORMATS[m.group(2) or "raw"](variables[name])

    return re.sub(r"\$\{(\w+)(?::(\w+))?\}|\$(?!__)(\w+)", one, sql)


def macros(sql: str, start: float, end: float, interval_s: int) -> str:
    """The ClickHouse plugin's macros, as its backend expands them."""
    f, t = int(start), int(end)

    def macro(m: re.Match) -> str:
        name, args = m.group(1), [a.strip() for a in (m.group(2) or "").split(",") if a.strip()]
        if name == "timeFilter":
            (column,) = args
            return f"{column} >= toDateTime({f}) AND {column} <= toDateTime({t})"
        if name == "timeFilter_ms":
            (column,) = args
            return (f"{column} >= fromUnixTimestamp64Milli({int(start * 1000)}) AND "
                    f"{column} <= fromUnixTimestamp64Milli({int(end * 1000)})")
        if name == "timeInterval":
            (column,) = args
            return f"toStartOfInterval(toDateTime({column}), INTERVAL {max(interval_s, 1)} second)"
        raise AssertionError(f"macro $__{name} is not expanded by this test")

    sql = re.sub(r"\$__(timeFilter_ms|timeFilter|timeInterval)\(([^)]*)\)", macro, sql)
    return (sql.replace("$__fromTime", f"toDateTime({f})").replace("$__toTime", f"toDateTime({t})")
            .replace("$__interval_s", str(max(interval_s, 1))))


def expand(sql: str, start: float, end: float, interval_s: int, variables: dict[str, str]) -> str:
    """``sql`` as Grafana and the ClickHouse plugin make it before it reaches
    ClickHouse: variables first (the frontend), macros after (the plugin's backend)."""
    return macros(interpolate(sql, variables), start, end, interval_s)


#: The clause every run panel filters with (infra/grafana/panels.py).
VALUE = "decodeURLComponent('${cluster:percentencode}')"
CLAUSE = ("cluster_id IN (SELECT cluster_id FROM blackbox.clusters "
          f"WHERE cluster_name = {VALUE} OR cluster_id = {VALUE})")


def hostile_names(port: int) -> list[str]:
    ssrf = f"url($$http://127.0.0.1:{port}/ssrf$$, $$LineAsString$$)"
    return [
        ") OR 1=1 -- \\",
        "\\' OR 1=1 --",
        "x\\",
        f") OR 0 < (SELECT count() FROM {ssrf}) -- \\",
        f"' OR 0 < (SELECT count() FROM {ssrf}) OR '",
        "$$) OR 1=1 -- $$",
        "$__timeFilter(ts) ${cluster} $__fromTime",
        "%41%27 + plus, \"double\", 'single', 名前",
    ]


class _Counter(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        type(self).hits.append(self.path)
        body = b"a\nb\nc\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def ssrf_target():
    """A loopback HTTP server counting the requests it gets."""
    _Counter.hits = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], _Counter.hits
    server.shutdown()
    server.server_close()


def run_panels() -> list[tuple[str, str]]:
    board = json.loads((GRAFANA / "dashboards" / "blackbox-run.json").read_text())
    return [(p["title"], t["rawSql"]) for p in board["panels"] for t in p["targets"]]
