"""The Grafana dashboards of infra/grafana: the committed JSON is what
``infra/grafana/dashboards.py`` builds with the Grafana Foundation SDK
(tests/integration/test_grafana_queries.py runs every panel's SQL)."""

from __future__ import annotations

import json

from grafana_support import builder, committed


def test_dashboards_are_what_the_sdk_builds(tmp_path):
    written = builder().write(tmp_path)
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
