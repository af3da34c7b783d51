"""ClickHouse beyond one node: the roll-ups' DDL for a cluster, checked statement by
statement and parsed by ClickHouse's own parser (chDB), and the loader's
deduplication tokens, which a real ClickHouse stores once when the same insert
arrives twice. No ClickHouse cluster (no Keeper) runs here: replication, sharding
and ON CLUSTER execution are not run, only parsed (docs/pipeline.md says so)."""

from __future__ import annotations

import re
import time

import clickhouse_connect
import orjson
import pytest

from dask_blackbox.sinks import arrow, schema
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.tables import ROLLUPS, TABLES, Message

from sink_support import envelope, transition

CLUSTER = schema.Target("bbprod", 30 * 86400, "analytics", 365 * 86400)
ROLLUP_MIGRATION = next(m for m in schema.migrations() if m.name == "008_rollups.sql")


@pytest.fixture
def chdb_client(tmp_path):
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'ch'}")
    yield client
    client.close()


def test_every_cluster_statement_parses(chdb_client):
    """Every statement of every migration for a cluster, its backfills included,
    through ClickHouse's parser (formatQuery and EXPLAIN AST)."""
    for migration in schema.migrations():
        for statement in [*schema.statements(schema.render(migration.text, CLUSTER)),
                          *schema.backfills(migration.text, CLUSTER)]:
            chdb_client.query("SELECT formatQuery({s:String})", parameters={"s": statement})
            chdb_client.query(f"EXPLAIN AST {statement}")


def test_rollups_are_replicated_sharded_and_filled_on_each_shard():
    statements = list(schema.statements(schema.render(ROLLUP_MIGRATION.text, CLUSTER)))
    assert all("ON CLUSTER 'analytics'" in s for s in statements)
    for table in ROLLUPS:
        local = next(s for s in statements
                     if s.startswith(f"CREATE TABLE IF NOT EXISTS bbprod_rollups.{table}_local "))
        assert "ENGINE = ReplicatedAggregatingMergeTree" in local
        assert re.search(r"GROUP BY cluster_id, minute", local), local  # folded by TTL
        assert "minute + INTERVAL 31536000 SECOND" in local  # the roll-ups' own retention
        distributed = next(s for s in statements
                           if s.startswith(f"CREATE TABLE IF NOT EXISTS bbprod_rollups.{table} "))
        assert distributed.endswith(f"ENGINE = Distributed('analytics', bbprod_rollups, "
                                    f"{table}_local, cityHash64(cluster_id))")
        view = next(s for s in statements
                    if s.startswith(f"CREATE MATERIALIZED VIEW IF NOT EXISTS bbprod_rollups.{table}_mv "))
        # On each node: read that node's raw rows, write that node's roll-up.
        assert f"TO bbprod_rollups.{table}_local AS" in view
        assert re.search(r"FROM bbprod\.\w+_local\b", view), view
    # The raw retention stays on the raw tables; what outlives them gets the roll-ups'.
    for table in ("span_state", "lifecycle", "prefix_stats"):
        alter = next(s for s in statements if s.startswith(f"ALTER TABLE bbprod.{table}_local "))
        assert "MODIFY TTL" in alter and "31536000 SECOND" in alter
    view = next(s for s in statements if s.startswith("CREATE OR REPLACE VIEW bbprod.clusters"))
    assert "FROM bbprod_rollups.cluster_minutes" in view  # the Distributed roll-up
    for backfill in schema.backfills(ROLLUP_MIGRATION.text, CLUSTER):
        # into the Distributed roll-up, from the Distributed raw table, each batch once
        assert re.match(r"INSERT INTO bbprod_rollups\.\w+\n", backfill), backfill
        assert "_batch GLOBAL NOT IN (SELECT _batch FROM bbprod_rollups." in backfill
        assert "_local" not in backfill


def test_abandoning_deletes_on_every_node():
    assert CLUSTER.rollups.storage_table("task_minutes") == \
        "bbprod_rollups.task_minutes_local ON CLUSTER 'analytics'"
    assert CLUSTER.rollups.table("task_minutes") == "bbprod_rollups.task_minutes"
    assert set(TABLES).isdisjoint(ROLLUPS)


def _batch() -> Batch:
    batch = Batch()
    events = [transition(f"('x-1', {i})", "processing", "memory", time.time() - 600 + i, prefix="x",
                         span_id="s1", worker="tcp://w:1") for i in range(50)]
    value = orjson.dumps(envelope(events, seq=0))
    batch.add(Message("raw", "bbprod.raw", 0, 7, b"c1", value, 1000))
    return batch


def test_a_repeated_insert_is_stored_once(chdb_client):
    """In cluster mode every insert of the loader carries a deduplication token of its
    batch, table and rows: the same insert arriving twice (a Distributed table
    retrying on another replica) is stored once, the roll-ups made of it too, and an
    insert of another batch is stored. Shown on chDB's MergeTree with a
    deduplication window, which ReplicatedMergeTree has by default."""
    # A single-node schema under the cluster target's database name (no Keeper here).
    schema.migrate(chdb_client, schema.Target("bbprod", 30 * 86400))
    for database, tables in (("bbprod", TABLES), ("bbprod_rollups", ROLLUPS)):
        for table in tables:
            chdb_client.command(f"ALTER TABLE {database}.{table} "
                                "MODIFY SETTING non_replicated_deduplication_window = 1000")
    loader = Loader(chdb_client, CLUSTER, "g")
    assert loader.insert_settings["deduplicate_blocks_in_dependent_materialized_views"] == 1
    batch = _batch()
    loader.prepare(batch)
    rows = arrow.with_batch(batch.arrow["transitions"], 42 << 12)
    for token in ("42:transitions:0-50", "42:transitions:0-50", "43:transitions:0-50"):
        settings = loader.settings_for(token)
        assert settings["insert_deduplication_token"] == f"g:{token}"
        chdb_client.insert_arrow("bbprod.transitions", rows, settings=settings)
    assert chdb_client.query("SELECT count() FROM bbprod.transitions").result_rows[0][0] == 100
    assert chdb_client.query("SELECT sum(into['memory']) FROM bbprod_rollups.task_minutes"
                             ).result_rows[0][0] == 100
