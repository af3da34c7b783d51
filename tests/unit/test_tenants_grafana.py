"""The Grafana dashboards on a recorder shared by many teams: a cluster's name is its
owner's choice, and the run dashboard puts the chosen name in its SQL. Here the rows
of several tenants are planted in chDB (the sink's own schema), some named as an
attacker would name them (a trailing backslash, quotes, ``$$``, ``url(``, a macro),
and every panel of the run dashboard is expanded with Grafana's real formatting
rules (tests/grafana_support.py) and run: each answers with the rows of the named
cluster exactly, never another tenant's, and ClickHouse makes no HTTP request.

The same harness shows what the earlier ``${cluster:singlequote}`` let through, so it
can see the bug it guards against. Then real Dask clusters, named so, are recorded
by the real producers and sink, and every run panel is run through the sink's query
server for each: the named run's rows, nobody else's. The data source's ClickHouse user is read-only:
its profile (infra/clickhouse/users.d/grafana.xml), applied to the dashboards' queries
in chDB, runs every one and refuses the table functions that reach the network or the
disk."""

from __future__ import annotations

import datetime
import pathlib
import time
import xml.etree.ElementTree as ET

import clickhouse_connect
import pytest

from dask_blackbox.sinks.schema import Target, migrate

from grafana_support import CLAUSE, VALUE, expand, hostile_names, macros, queries, run_panels, ssrf_target  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "infra" / "grafana"
USERS = ROOT / "infra" / "clickhouse" / "users.d" / "grafana.xml"
#: The clause as it was, with Grafana's singlequote format.
OLD_CLAUSE = ("cluster_id IN (SELECT cluster_id FROM blackbox.clusters "
              "WHERE cluster_name = ${cluster:singlequote} OR cluster_id = ${cluster:singlequote})")


def _plant(client, tenants: dict[str, str], now: float) -> None:
    """One run per tenant (cluster_id -> name): an envelope, a computed task with its
    startstops, scheduler and worker samples, a span, a prefix window, a removed
    worker; each tenant's values carry its id, so rows tell whose they are."""
    for n, (cid, name) in enumerate(tenants.items()):
        ts = datetime.datetime.fromtimestamp(now - 60 + n, datetime.timezone.utc)
        before = ts - datetime.timedelta(seconds=1)
        worker, prefix = f"tcp://{cid}:1", f"inc-{cid}"

        def put(table: str, **row) -> None:
            client.insert(f"blackbox.{table}", [list(row.values())], column_names=list(row))

        put("envelopes", cluster_id=cid, cluster_name=name, source="scheduler", producer_id=cid,
            seq=0, sent_at=ts, n_events=1, n_memory=1)
        put("transitions", cluster_id=cid, key=prefix, ts=ts, start="processing", finish="memory",
            source="scheduler", prefix=prefix, worker=worker, **{
                "startstops.action": ["compute"], "startstops.start": [before],
                "startstops.stop": [ts], "startstops.source": [""]})
        put("scheduler_metrics", cluster_id=cid, ts=ts, tasks_by_state={prefix: 1})
        put("worker_metrics", cluster_id=cid, worker=worker, ts=ts, memory=100, memory_managed=50)
        put("span_state", cluster_id=cid, cluster_name=name, span_id=cid, name=[prefix], version=1,
            enqueued=before, start=before, stop=ts, duration=1.0, done=True)
        put("prefix_stats", cluster_id=cid, cluster_name=name, prefix=prefix,
            window_start=ts.replace(microsecond=0), durations={"compute": 1.0},
            finished={"memory": 1})
        put("lifecycle", cluster_id=cid, ts=ts, action="worker_removed", worker=worker,
            reason=prefix, detail='{"processing_tasks": 1, "expected": false}')


@pytest.fixture
def tenants_db(tmp_path, ssrf_target):
    port, _ = ssrf_target
    tenants = {"victim": "team-a", "other": "team-b"}
    tenants.update({f"hostile-{i}": name for i, name in enumerate(hostile_names(port))})
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'chdb'}")
    migrate(client, Target("blackbox", 90 * 86400))
    now = time.time()
    _plant(client, tenants, now)
    yield client, tenants, now
    client.close()


def _rows(client, sql: str) -> list[tuple]:
    return sorted(map(tuple, client.query(sql).result_rows), key=repr)


def test_a_hostile_cluster_name_selects_its_own_rows_and_nothing_else(tenants_db, ssrf_target):
    client, tenants, now = tenants_db
    _, hits = ssrf_target
    panels = run_panels()
    assert len(panels) == 8 and all(CLAUSE in sql for _, sql in panels)
    victim_rows = 0
    for cid, name in tenants.items():
        for title, sql in panels:
            expanded = expand(sql, now - 3600, now + 60, 1, {"cluster": name})
            assert "$" not in expanded and "\\" not in expanded, (title, expanded)
            expected = macros(sql.replace(CLAUSE, f"cluster_id = '{cid}'"), now - 3600, now + 60, 1)
            got = _rows(client, expanded)
            assert got == _rows(client, expected), f"{title} for {name!r}:\n{expanded}"
            assert got, f"{title} for {name!r}: the tenant's own rows are missing"
            if cid == "victim":
                victim_rows += len(got)
            else:
                assert "victim" not in repr(got), f"{title} for {name!r} shows the victim's rows"
    assert victim_rows and hits == [], f"ClickHouse made HTTP requests: {hits}"


def test_the_singlequote_format_let_a_tenant_read_every_tenant(tenants_db, ssrf_target):
    """The harness sees the hole the percent-encoding closes: with Grafana's
    singlequote (backslashes left as they are) a name ending in a backslash reads
    the other tenants' worker deaths and makes ClickHouse fetch a URL."""
    client, tenants, now = tenants_db
    _, hits = ssrf_target
    [deaths] = [sql for title, sql in run_panels() if title == "Worker deaths"]
    old = deaths.replace(CLAUSE, OLD_CLAUSE)
    expanded = expand(old, now - 3600, now + 60, 1, {"cluster": ") OR 1=1 -- \\"})
    assert "tcp://victim:1" in repr(_rows(client, expanded))
    ssrf = next(n for n in tenants.values() if n.startswith(") OR 0 < (SELECT count() FROM url("))
    client.query(expand(old, now - 3600, now + 60, 1, {"cluster": ssrf}))
    assert hits, "the url() in the name was not fetched: the harness does not see the hole"


def _profile() -> tuple[dict[str, str], list[str], ET.Element]:
    root = ET.parse(USERS).getroot()
    [user] = root.find("users")
    profile = root.find(f"profiles/{user.findtext('profile')}")
    settings = {e.tag: e.text for e in profile if e.tag != "constraints"}
    grants = [q.text for q in user.findall("grants/query")]
    return settings, grants, user


def test_the_data_source_user_reads_the_blackbox_tables_only(tenants_db):
    client, tenants, now = tenants_db
    settings, grants, user = _profile()
    assert user.tag == "grafana" and user.find("password").get("from_env") == "CLICKHOUSE_GRAFANA_PASSWORD"
    assert user.findtext("access_management") == "0"
    assert grants and all(g.startswith("GRANT SELECT ON blackbox") and g.endswith(".*") for g in grants), grants
    assert settings["readonly"] == "1"
    datasource = (GRAFANA / "provisioning" / "datasources" / "clickhouse.yaml").read_text()
    assert "username: grafana" in datasource and "$CLICKHOUSE_GRAFANA_PASSWORD" in datasource
    # every dashboard query runs under the profile; what leaves ClickHouse does not
    for where, sql in queries():
        client.query(expand(sql, now - 3600, now + 60, 1, {"cluster": "team-a"}), settings=settings)
    for forbidden in ("SELECT * FROM url('http://127.0.0.1:9/', LineAsString)",
                      "SELECT * FROM file('/etc/hostname', LineAsString)",
                      "SELECT * FROM remote('127.0.0.1:9000', system.one)",
                      "SELECT * FROM s3('http://127.0.0.1:9/bucket/key.csv', CSV)",
                      "INSERT INTO blackbox.lifecycle (cluster_id) VALUES ('x')",
                      "DROP TABLE blackbox.lifecycle"):
        with pytest.raises(Exception, match="readonly|READONLY"):
            client.command(forbidden, settings=settings)
