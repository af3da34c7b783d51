"""The Grafana dashboards of infra/grafana: the committed JSON is what
``infra/grafana/dashboards.py`` builds with the Grafana Foundation SDK, and every
panel's SQL (and every variable's) runs, its macros expanded as the Grafana
ClickHouse plugin expands them, against the recorded run
(tests/recording_support.py) and returns rows. The panels are read from the
dashboards' JSON, so no panel goes untested."""

from __future__ import annotations

import datetime
import importlib.util
import json
import pathlib
import re
import time

import pytest

from recording_support import CLUSTER_NAME

GRAFANA = pathlib.Path(__file__).resolve().parents[1] / "infra" / "grafana"


def _builder():
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


def expand(sql: str, start: float, end: float, interval_s: int, variables: dict[str, str]) -> str:
    """``sql`` as the ClickHouse plugin (pkg/macros) and Grafana's template variables
    make it before it reaches ClickHouse."""
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
    sql = (sql.replace("$__fromTime", f"toDateTime({f})").replace("$__toTime", f"toDateTime({t})")
           .replace("$__interval_s", str(max(interval_s, 1))))
    for name, value in variables.items():
        quoted = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        sql = sql.replace(f"${{{name}:singlequote}}", quoted).replace(f"${{{name}}}", value)
    assert "$" not in sql, f"unexpanded: {sql}"
    return sql


def test_dashboards_are_what_the_sdk_builds(tmp_path):
    written = _builder().write(tmp_path)
    assert {p.name for p in written} == {f"{uid}.json" for uid in committed()}
    for path in written:
        assert json.loads(path.read_text()) == committed()[path.stem], (
            f"{path.name} is stale: run python infra/grafana/dashboards.py")
    boards = committed()
    assert set(boards) == {"blackbox-clusters", "blackbox-run", "blackbox-failures", "blackbox-pipeline"}
    run = boards["blackbox-run"]
    assert {p["type"] for p in run["panels"]} >= {"state-timeline", "timeseries", "table"}
    assert any(p["title"] == "Task stream" and p["type"] == "state-timeline" for p in run["panels"])
    for board in boards.values():
        for panel in board["panels"]:
            for target in panel["targets"]:
                assert target["datasource"] == {"type": "grafana-clickhouse-datasource",
                                                "uid": "${datasource}"}
                assert target["editorType"] == "sql" and target["queryType"] in (
                    "table", "timeSeries", "logs")


@pytest.mark.parametrize("where, sql", queries(), ids=[q[0] for q in queries()])
def test_every_panel_returns_rows(recorded_run, where, sql):
    backend = recorded_run["backend"]
    first = backend.query("SELECT toFloat64(min(first_seen)) FROM clusters "
                          "WHERE cluster_id = {c:String}", {"c": recorded_run["cluster_id"]})[1][0][0]
    expanded = expand(sql, first - 120, time.time() + 60, 1, {"cluster": CLUSTER_NAME})
    columns, rows = backend.query(expanded)
    assert rows, f"{where}: no rows\n{expanded}"
    if "$__timeInterval" in sql:
        assert columns[0] == "time" and isinstance(rows[0][0], datetime.datetime)
