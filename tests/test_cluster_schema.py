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

from dask_blackbox.sinks import schema
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
    """The cluster-mode loader's inserts deduplicate: an insert of a batch that
    arrives again (a Distributed table retrying on another replica) is stored once,
    its roll-ups too (each insert carries a token of its batch, table and rows). Shown
    on chDB's MergeTree with a deduplication window, which ReplicatedMergeTree has by
    default; a new batch of the same rows is stored again."""
    # A single-node schema under the cluster target's database name (no Keeper here).
    schema.migrate(chdb_client, schema.Target("bbprod", 30 * 86400))
    for database, tables in (("bbprod", [*TABLES, "sink_batches"]), ("bbprod_rollups", ROLLUPS)):
        for table in tables:
            chdb_client.command(f"ALTER TABLE {database}.{table} "
                                "MODIFY SETTING non_replicated_deduplication_window = 1000")
    loader = Loader(chdb_client, CLUSTER, "g")
    assert loader.insert_settings["deduplicate_blocks_in_dependent_materialized_views"] == 1
    batch_id = loader._next_batch_id()
    loader._next_batch_id = lambda: batch_id  # the same batch, sent again
    batch = _batch()
    loader.prepare(batch)
    assert loader.load(batch, {})
    assert loader.load(batch, {})

    def counts():
        return (chdb_client.query("SELECT count() FROM bbprod.transitions").result_rows[0][0],
                chdb_client.query("SELECT sum(into['memory']) FROM bbprod_rollups.task_minutes"
                                  ).result_rows[0][0],
                chdb_client.query("SELECT count() FROM bbprod.sink_batches").result_rows[0][0])

    assert counts() == (50, 50, 2)  # transitions; their roll-up; begin + loaded
    # Another batch of the same rows is another insert: stored.
    loader._next_batch_id = lambda: batch_id + (1 << 12)
    assert loader.load(batch, {})
    assert counts() == (100, 100, 4)
