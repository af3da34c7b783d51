"""dask-blackbox's Grafana dashboards as code, built with the Grafana Foundation SDK
(grafana-foundation-sdk, Apache-2.0) from the panels of ``panels.py``, for the
Grafana ClickHouse data source plugin (grafana-clickhouse-datasource).

    python infra/grafana/dashboards.py      # writes infra/grafana/dashboards/*.json

The JSON files are committed (infra/docker-compose.yml's grafana service provisions
them, see provisioning/); tests/unit/test_grafana.py checks they are what this script
builds, and runs every panel's SQL against a recorded run.

Every dashboard has a ``datasource`` variable (any ClickHouse data source; the
provisioned one, uid ``blackbox-clickhouse``, by default); the run dashboard a
``cluster`` variable (recorded clusters, the latest first).
"""

from __future__ import annotations

import json
import pathlib
import sys

from grafana_foundation_sdk.builders import (barchart, dashboard, logs, stat, statetimeline, table,
                                             timeseries)
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (DataSourceRef, GridPos, VariableRefresh,
                                                     VariableSort)

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from panels import CLUSTERS_VARIABLE, DASHBOARDS, Dashboard, Panel  # noqa: E402

#: The plugin's id, and the uid of the data source provisioning/ creates.
PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE_UID = "blackbox-clickhouse"
OUT = pathlib.Path(__file__).parent / "dashboards"
#: The plugin's result formats (its Format enum) by query type.
FORMATS = {"timeSeries": 0, "table": 1, "logs": 2, "traces": 3}
VISUALISATIONS = {"timeseries": timeseries.Panel, "table": table.Panel, "stat": stat.Panel,
                  "state-timeline": statetimeline.Panel, "barchart": barchart.Panel,
                  "logs": logs.Panel}
DATASOURCE = DataSourceRef(type_val=PLUGIN, uid="${datasource}")


class ClickHouseQuery(cogvariants.Dataquery):
    """A query of the ClickHouse plugin in its SQL editor (the SDK has no builder for
    this plugin: its query model, as the plugin stores it)."""

    def __init__(self, ref_id: str, sql: str, query_type: str) -> None:
        self.ref_id, self.sql, self.query_type = ref_id, sql, query_type

    def to_json(self) -> dict[str, object]:
        return {"refId": self.ref_id, "datasource": DATASOURCE.to_json(), "editorType": "sql",
                "queryType": self.query_type, "format": FORMATS[self.query_type],
                "rawSql": self.sql}


class Query(cogbuilder.Builder[ClickHouseQuery]):
    def __init__(self, ref_id: str, sql: str, query_type: str) -> None:
        self._internal = ClickHouseQuery(ref_id, sql, query_type)

    def build(self) -> ClickHouseQuery:
        return self._internal


def panel(spec: Panel, panel_id: int, x: int, y: int):
    built = (VISUALISATIONS[spec.kind]().id(panel_id).title(spec.title).datasource(DATASOURCE)
             .with_target(Query("A", spec.sql, spec.query_type))
             .grid_pos(GridPos(h=spec.height, w=spec.width, x=x, y=y)))
    if spec.description:
        built = built.description(spec.description)
    return built


def build(spec: Dashboard) -> dict:
    """The dashboard's JSON model."""
    board = (dashboard.Dashboard(spec.title).uid(spec.uid).description(spec.description)
             .tags(["dask", "dask-blackbox"]).time("now-6h", "now").refresh("1m")
             .with_variable(dashboard.DatasourceVariable("datasource").label("ClickHouse")
                            .type(PLUGIN).regex("")))
    if spec.per_cluster:
        board = board.with_variable(
            dashboard.QueryVariable("cluster").label("Cluster").datasource(DATASOURCE)
            .query(CLUSTERS_VARIABLE).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.DISABLED))
    x = y = row_height = 0
    for panel_id, spec_panel in enumerate(spec.panels, 1):
        if x + spec_panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        board = board.with_panel(panel(spec_panel, panel_id, x, y))
        x += spec_panel.width
        row_height = max(row_height, spec_panel.height)
    model = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for variable in model["templating"]["list"]:
        if variable["name"] == "datasource":
            variable["current"] = {"text": "ClickHouse (dask-blackbox)", "value": DATASOURCE_UID}
    return model


def write(directory: pathlib.Path = OUT) -> list[pathlib.Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in DASHBOARDS:
        path = directory / f"{spec.uid}.json"
        path.write_text(json.dumps(build(spec), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write():
        print(path)
