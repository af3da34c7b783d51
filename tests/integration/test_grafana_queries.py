"""Every panel's SQL of the Grafana dashboards (and every variable's) runs, its variables
and macros expanded as Grafana and its ClickHouse plugin expand them, against the recorded run
(tests/recording_support.py) and returns rows. The panels are read from the
dashboards' JSON, so no panel goes untested."""

from __future__ import annotations

import datetime
import time

import pytest

from grafana_support import expand, queries
from recording_support import CLUSTER_NAME


@pytest.mark.parametrize("where, sql", queries(), ids=[q[0] for q in queries()])
def test_every_panel_returns_rows(recorded_run, where, sql):
    backend = recorded_run["backend"]
    first = backend.query("SELECT toFloat64(min(first_seen)) FROM clusters "
                          "WHERE cluster_id = {c:String}", {"c": recorded_run["cluster_id"]})[1][0][0]
    expanded = expand(sql, first - 120, time.time() + 60, 1, {"cluster": CLUSTER_NAME})
    assert "$" not in expanded, f"unexpanded: {expanded}"
    columns, rows = backend.query(expanded)
    assert rows, f"{where}: no rows\n{expanded}"
    if "$__timeInterval" in sql:
        assert columns[0] == "time" and isinstance(rows[0][0], datetime.datetime)
