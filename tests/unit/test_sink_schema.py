"""The ClickHouse schema: migrations applied to real chDB, single-node DDL, and the
rendered DDL for a multi-node ClickHouse cluster (checked statement by statement and
parsed by ClickHouse's own parser, since no multi-node cluster runs here)."""

from __future__ import annotations

import re

import clickhouse_connect
import dask.config
import pytest

from dask_blackbox import config
from dask_blackbox import clickhouse
from dask_blackbox.sinks import arrow, schema
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.tables import AGGREGATES, COLUMNS, TABLES


@pytest.fixture
def chdb_client(tmp_path):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'ch'}")
    yield client
    client.close()


SINGLE = schema.Target("blackbox", 90 * 86400)
CLUSTER = schema.Target("bbprod", 30 * 86400, "analytics")


def rendered(target: schema.Target) -> list[str]:
    return [s for m in schema.migrations() for s in schema.statements(schema.render(m.text, target))]


def test_migrations_apply_once_and_create_every_table(chdb_client):
    shipped = schema.migrations()
    assert [m.name for m in shipped][:3] == [
        "001_init.sql", "002_nthreads.sql", "003_threads_graph_parts_exits.sql"]
    assert schema.migrate(chdb_client, SINGLE) == [m.name for m in shipped]
    assert schema.migrate(chdb_client, SINGLE) == []  # idempotent
    tables = {r[0] for r in chdb_client.query("SHOW TABLES FROM blackbox").result_rows}
    views = {f"{a}_mv" for a in AGGREGATES}  # the materialized views that fill the aggregates
    assert set(TABLES) | set(AGGREGATES) | views | {"schema_migrations", "sink_batches", "clusters"} == tables
    recorded = chdb_client.query(
        "SELECT version, name, checksum FROM blackbox.schema_migrations FINAL").result_rows
    assert sorted(recorded) == [(m.version, m.name, m.checksum) for m in shipped]
    # The columns the sink inserts exist with types it can send (Arrow conversion).
    schemas = arrow.schemas(chdb_client, "blackbox", COLUMNS)
    assert set(schemas) == set(TABLES)
    # TTL, partitions and engines as the SQL says.
    engines = dict(chdb_client.query(
        "SELECT name, engine FROM system.tables WHERE database = 'blackbox'").result_rows)
    assert engines["span_state"] == engines["prefix_stats"] == engines["gaps"] == "ReplacingMergeTree"
    assert engines["transitions"] == "MergeTree" and engines["clusters"] == "View"
    ddl = chdb_client.query("SHOW CREATE TABLE blackbox.transitions").result_rows[0][0]
    assert "TTL toDateTime(ts) + toIntervalSecond(7776000)" in ddl
    assert "PARTITION BY toMonday(ts)" in ddl and "ORDER BY (cluster_id, key, ts)" in ddl


def test_a_changed_migration_is_refused(chdb_client):
    schema.migrate(chdb_client, SINGLE)
    chdb_client.command("INSERT INTO blackbox.schema_migrations (version, name, checksum) "
                        "VALUES (1, '001_init.sql', 'edited-since')")
    chdb_client.command("OPTIMIZE TABLE blackbox.schema_migrations FINAL")
    with pytest.raises(schema.MigrationError, match="001_init.sql was changed after it was applied"):
        schema.migrate(chdb_client, SINGLE)


def test_single_node_ddl_has_no_cluster_parts():
    for statement in rendered(SINGLE):
        assert "{" not in statement and "ON CLUSTER" not in statement, statement
        assert "Replicated" not in statement and "Distributed" not in statement, statement
        assert "_local" not in statement, statement


def test_cluster_ddl_is_replicated_sharded_and_parses(chdb_client):
    statements = rendered(CLUSTER)
    storage = {}
    distributed = {}
    for statement in statements:
        # ClickHouse's own parser: every statement is valid SQL.
        chdb_client.query("SELECT formatQuery({s:String})", parameters={"s": statement})
        assert "ON CLUSTER 'analytics'" in statement, statement
        if match := re.match(r"CREATE TABLE IF NOT EXISTS bbprod\.(\w+)_local ON CLUSTER", statement):
            engine = re.search(r"ENGINE = (\w+)", statement).group(1)
            storage[match.group(1)] = engine
            assert "INTERVAL 30 DAY" in statement or "2592000 SECOND" in statement or "TTL" not in statement
        elif match := re.match(r"CREATE TABLE IF NOT EXISTS bbprod\.(\w+) ON CLUSTER 'analytics'\s+"
                               r"AS bbprod\.(\w+)_local\s+ENGINE = Distributed\('analytics', bbprod, "
                               r"(\w+)_local, (.+)\)$", statement):
            assert match.group(1) == match.group(2) == match.group(3)
            distributed[match.group(1)] = match.group(4)
    assert set(storage) == set(distributed) == (set(TABLES) | set(AGGREGATES)
                                                | {"schema_migrations", "sink_batches"})
    assert all(engine.startswith("Replicated") for engine in storage.values()), storage
    assert storage["span_state"] == "ReplicatedReplacingMergeTree"
    # One cluster's rows live on one shard, so a story or a span tree reads one shard.
    for table in set(TABLES) - {"dead_letters"}:
        assert distributed[table] == "cityHash64(cluster_id)", table
    view = next(s for s in statements if s.startswith("CREATE VIEW"))
    assert "FROM bbprod.envelopes" in view  # reads the Distributed table


def test_cluster_mode_deletes_and_inserts_address_every_shard():
    assert CLUSTER.table("transitions") == "bbprod.transitions"
    assert CLUSTER.storage_table("transitions") == "bbprod.transitions_local ON CLUSTER 'analytics'"
    assert SINGLE.storage_table("transitions") == "blackbox.transitions"


def test_loader_requires_foreground_distributed_inserts_in_cluster_mode(chdb_client):
    # A single-node schema under the cluster target's database name lets the loader
    # read column types; its insert settings are what the cluster needs.
    schema.migrate(chdb_client, schema.Target("bbprod", 30 * 86400))
    loader = Loader(chdb_client, CLUSTER, "g")
    assert loader.insert_settings["distributed_foreground_insert"] == 1
    assert loader.insert_settings["async_insert"] == 0


def test_loader_names_missing_columns(chdb_client):
    schema.migrate(chdb_client, SINGLE)
    chdb_client.command("ALTER TABLE blackbox.logs DROP COLUMN exc_text")
    with pytest.raises(arrow.UnsupportedType, match="table logs lacks column.*exc_text.*migrated"):
        Loader(chdb_client, SINGLE, "g")


@pytest.mark.parametrize("key, value, message", [
    ("clickhouse.database", "black-box", "not a plain identifier"),
    ("clickhouse.retention", "10m", "shorter than an hour"),
    ("clickhouse.cluster", "a b", "not a plain identifier"),
])
def test_bad_schema_settings_are_named(key, value, message):
    with dask.config.set({f"blackbox.{key}": value}):
        with pytest.raises(config.ConfigError, match=f"blackbox.{key}.*{message}"):
            schema.Target.from_config()


def test_target_from_config_renders_retention_and_cluster():
    with dask.config.set({"blackbox.clickhouse.retention": "7d", "blackbox.clickhouse.cluster": "c1",
                          "blackbox.clickhouse.database": "bb"}):
        target = schema.Target.from_config()
    assert target == schema.Target("bb", 7 * 86400, "c1")
    assert target.placeholders["ttl"] == "604800 SECOND"
    assert target.placeholders["on_cluster"] == "ON CLUSTER 'c1'"


def test_clickhouse_errors_are_classified():
    from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

    assert clickhouse.is_rejection(DatabaseError("Code: 469. violated", code=469))
    assert not clickhouse.is_rejection(DatabaseError("Code: 1001. filesystem error", code=1001))
    assert not clickhouse.is_rejection(OperationalError("connection refused"))
    assert clickhouse.redact("http://bob:secret@h:8123/db") == "http://bob:***@h:8123/db"
