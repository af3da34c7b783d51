"""The page aggregates (sinks/sql/006_page_aggregates.sql) against the raw rows they are
made of, on chDB: rows loaded through the sink's Loader in several batches, the
materialized views filling the aggregates per batch. What the Run page reads from
them (read/aggregates.py) must equal what the raw transitions say: tasks, memory and
erred per prefix and per group, computes begun and erred per worker, compute and
transfer seconds (an action spread over the seconds it spans), the bars. An abandoned
batch leaves none of its aggregate rows; the backfill (rows loaded before the
migration) gives the same numbers and, run again, counts nothing twice."""

from __future__ import annotations

import dataclasses

import clickhouse_connect
import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.read import aggregates, backends, panels
from dask_blackbox.read.views import groups as task_groups
from dask_blackbox.read.views import activity
from dask_blackbox.sinks import schema
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.tables import AGGREGATES, Message

TARGET = schema.Target("blackbox", 90 * 86400)
T0 = 1_790_000_000.25
WORKERS = ("tcp://a:1", "tcp://b:2")


def _envelope(seq: int, n: int) -> dict:
    """One scheduler envelope of ``n`` tasks: prefixes and groups, two spans, computes
    of 0.3-2.6 s crossing second boundaries, transfers, every seventh task erred."""
    events = []
    for j in range(n):
        i = seq * n + j
        prefix = ("load", "inc", "sum")[i % 3]
        key, t = f"{prefix}-{i}", T0 + i * 0.37
        worker = WORKERS[i % 2]
        base = {"kind": contract.TRANSITION, "key": key, "prefix": prefix, "group": f"{prefix}-g{i % 4}",
                "span_id": f"span-{i % 2}", "worker": None, "nbytes": None, "typename": None,
                "startstops": None, "exception": None, "traceback": None, "cause": None}
        erred = i % 7 == 0
        stops = [{"action": "compute", "start": t + 0.1, "stop": t + 0.4 + (i % 8) * 0.3}]
        if i % 3 == 2:
            stops.insert(0, {"action": "transfer", "start": t, "stop": t + 0.05 + (i % 5) * 0.4,
                             "source": WORKERS[(i + 1) % 2]})
        events += [
            {**base, "ts": t, "start": "released", "finish": "waiting", "stimulus_id": f"graph-{seq}"},
            {**base, "ts": t + 0.01, "start": "waiting", "finish": "processing", "stimulus_id": f"graph-{seq}"},
            {**base, "ts": t + 3, "start": "processing", "finish": "erred" if erred else "memory",
             "stimulus_id": f"finished-{i}", "worker": worker, "nbytes": None if erred else 100 + i,
             "startstops": stops},
        ]
    return {"schema": contract.SCHEMA_VERSION, "cluster_id": "c-agg", "cluster_name": "agg",
            "source": "scheduler", "producer_id": "p-agg", "seq": seq, "sent_at": T0 + 100,
            "events": events}


def _recomputed() -> dict:
    """A run of cluster ``c-re``: group ``twice-g``'s task twice-0 finishes into memory
    twice (its worker lost it), twice-1 once, twice-2 errs; group ``once-g`` two tasks;
    group ``lost-g``'s lost-0 finishes twice and lost-1 never (the run ended first)."""
    events = []
    for key, group, finishes in (("twice-0", "twice-g", ("memory", "memory")), ("twice-1", "twice-g", ("memory",)),
                                 ("twice-2", "twice-g", ("erred",)), ("once-0", "once-g", ("memory",)),
                                 ("once-1", "once-g", ("memory",)), ("lost-0", "lost-g", ("memory", "memory")),
                                 ("lost-1", "lost-g", ())):
        base = {"kind": contract.TRANSITION, "key": key, "prefix": group[:-2], "group": group, "span_id": "",
                "worker": None, "nbytes": None, "typename": None, "startstops": None, "exception": None,
                "traceback": None, "cause": None}
        if not finishes:
            t = T0 + len(events)
            events += [
                {**base, "ts": t, "start": "released", "finish": "waiting", "stimulus_id": "graph"},
                {**base, "ts": t + 0.01, "start": "waiting", "finish": "processing", "stimulus_id": "graph"},
            ]
        for i, finish in enumerate(finishes):
            t = T0 + 10 * i + len(events)
            events += [
                {**base, "ts": t, "start": "released", "finish": "waiting", "stimulus_id": "graph"},
                {**base, "ts": t + 0.01, "start": "waiting", "finish": "processing", "stimulus_id": "graph"},
                {**base, "ts": t + 2, "start": "processing", "finish": finish, "stimulus_id": f"done-{i}",
                 "worker": WORKERS[i], "nbytes": 100 + 10 * i if finish == "memory" else None,
                 "startstops": [{"action": "compute", "start": t + 0.5, "stop": t + 1.5}]},
                {**base, "ts": t + 3, "start": finish, "finish": "released", "stimulus_id": "lost"},
            ]
    return {"schema": contract.SCHEMA_VERSION, "cluster_id": "c-re", "cluster_name": "re",
            "source": "scheduler", "producer_id": "p-re", "seq": 0, "sent_at": T0 + 100,
            "events": events}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """chDB migrated, three sink batches of 40 tasks each loaded; (client, loader,
    backend, batch ids). Shared by the tests, each of which holds whatever the others
    did (an abandoned batch, a backfill): they compare read and raw as they find them."""
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path_factory.mktemp('agg') / 'ch'}")
    schema.migrate(client, TARGET)
    loader, ids = _load(client)
    yield client, loader, backends.DirectBackend(client, "blackbox"), ids
    client.close()


def _load(client, target: schema.Target = TARGET) -> tuple[Loader, list[int]]:
    """Three sink batches: 40 tasks of ``c-agg`` each, and ``c-re`` in the first."""
    loader = Loader(client, target, "agg")
    for seq in range(3):
        batch = Batch()
        batch.add(Message(contract.RAW, "t.raw", 0, seq, b"c-agg", orjson.dumps(_envelope(seq, 40)), 0))
        if seq == 0:
            batch.add(Message(contract.RAW, "t.raw", 1, 0, b"c-re", orjson.dumps(_recomputed()), 0))
        assert loader.load(batch, {})
    ids = [r[0] for r in client.query(
        f"SELECT DISTINCT batch_id FROM {target.table('sink_batches')} WHERE state = 'loaded' "
        "ORDER BY batch_id").result_rows]
    assert len(ids) == 3
    return loader, ids


def _raw(backend, db: str = "blackbox") -> dict:
    """The numbers the aggregates answer, from the raw transitions."""
    q = backend.query
    where = f"FROM {db}.transitions WHERE cluster_id = 'c-agg' AND source = 'scheduler'"
    joined = (f"FROM {db}.transitions ARRAY JOIN startstops AS ss "
              "WHERE cluster_id = 'c-agg' AND source = 'scheduler'")
    prefixes = {p: {"tasks": n, "memory": m, "erred": e, "recomputed": m - k} for p, n, m, e, k in q(
        f"SELECT prefix, uniqExact(key), countIf(finish = 'memory'), countIf(finish = 'erred'), "
        f"uniqExactIf(key, finish = 'memory') {where} GROUP BY prefix")[1]}
    workers = {w: {"tasks": n, "erred": e, "compute_s": c, "transfer_s": x} for w, n, e, c, x in q(
        "SELECT worker, countIf(ss.action = 'compute'), countIf(ss.action = 'compute' AND finish = 'erred'), "
        "sumIf(toFloat64(ss.stop) - toFloat64(ss.start), ss.action = 'compute'), "
        "sumIf(toFloat64(ss.stop) - toFloat64(ss.start), ss.action = 'transfer') "
        f"{joined} GROUP BY worker")[1]}
    groups = {g: {"tasks": n, "memory": m, "erred": e, "nbytes": b} for g, n, m, e, b in q(
        "SELECT task_group, uniqExact(key), countIf(finish = 'memory'), countIf(finish = 'erred'), "
        f"sumIf(ifNull(nbytes, 0), finish = 'memory') {where} GROUP BY task_group")[1]}
    bars = q(f"SELECT count(), countIf(ss.action = 'compute') {joined}")[1][0]
    return {"prefixes": prefixes, "workers": workers, "groups": groups, "bars": tuple(bars)}


def _read(backend) -> dict:
    """The same numbers, as the Run page reads them from the aggregates."""
    scope = panels.resolve(backend, "c-agg")
    workers = aggregates.per_worker(backend, "c-agg")
    return {"prefixes": aggregates.prefix_counts(backend, scope),
            "workers": {w: {k: pytest.approx(v, abs=1e-6) for k, v in r.items()} for w, r in workers.items()},
            "groups": {g["group"]: {"tasks": g["tasks"], "memory": g["memory"], "erred": g["erred"],
                                    "nbytes": g["nbytes"]} for g in aggregates.groups(backend, "c-agg")},
            "bars": aggregates.bars(backend, scope)}


def test_aggregates_equal_the_raw_rows(loaded):
    _, _, backend, _ = loaded
    raw = _raw(backend)
    assert raw["prefixes"]["load"]["erred"] > 0 and raw["workers"][WORKERS[0]]["transfer_s"] > 0
    assert _read(backend) == raw
    # An action's seconds spread over the seconds it spans add up to its duration.
    busy = dict(backend.query(
        "SELECT action, sum(busy) FROM blackbox.stream_seconds WHERE cluster_id = 'c-agg' GROUP BY action")[1])
    assert busy["compute"] == pytest.approx(sum(w["compute_s"] for w in raw["workers"].values()))


def test_an_abandoned_batch_leaves_no_aggregate_rows(loaded):
    client, loader, backend, ids = loaded
    loader.abandon([ids[1]])
    for table in AGGREGATES:
        left = client.query(f"SELECT count() FROM blackbox.{table} WHERE _batch = {ids[1]}").result_rows[0][0]
        assert left == 0, table
    raw = _raw(backend)
    assert sum(p["tasks"] for p in raw["prefixes"].values()) == 80  # two batches of 40 are left
    assert client.query(f"SELECT count() FROM blackbox.transitions WHERE _batch = {ids[1]}").result_rows == [(0,)]
    assert _read(backend) == raw


def test_the_backfill_counts_each_row_once(loaded):
    """Rows loaded before the aggregates' migrations (006, 009), in a database of
    their own: each migration, in order, fills its aggregates from them; its backfill
    run twice (an interrupted migration is run again) counts nothing twice."""
    client = loaded[0]
    before = schema.Target("before", TARGET.retention_seconds)
    for migration in schema.migrations():
        if migration.version < 6 or migration.version >= 10:  # (010 on: tables the sink loads)
            for statement in schema.statements(schema.render(migration.text, before)):
                client.command(statement)
    _load(client, before)
    backend = backends.DirectBackend(client, "before")
    for migration in (m for m in schema.migrations() if m.version >= 6):
        for statement in schema.statements(schema.render(migration.text, before)):
            client.command(statement)
        for _ in range(2):
            for statement in schema.backfills(migration.text, before):
                client.command(statement)
    assert _read(backend) == _raw(backend, "before")
    recomputed = panels.resolve(backend, "c-re")
    big = dataclasses.replace(recomputed, n_transitions=aggregates.RAW_TRANSITIONS + 1)
    assert task_groups.groups(backend, big)["groups"] == task_groups.groups(backend, recomputed)["groups"]


def test_groups_and_actions_read_alike_from_aggregates_and_raw_rows(loaded):
    """The Task groups and transfer views answer the same from the aggregates (a run
    too big for raw rows) as from the raw rows: a group whose task finished twice
    counts it once, its latest result's bytes, and one recomputation."""
    _, _, backend, _ = loaded
    for cluster in ("c-agg", "c-re"):
        raw = panels.resolve(backend, cluster)
        big = dataclasses.replace(raw, n_transitions=aggregates.RAW_TRANSITIONS + 1)
        assert not aggregates.usable(raw) and aggregates.usable(big)
        by_raw, by_agg = task_groups.groups(backend, raw), task_groups.groups(backend, big)
        assert [g["group"] for g in by_raw["groups"]] == [g["group"] for g in by_agg["groups"]]
        for a, b in zip(by_raw["groups"], by_agg["groups"]):
            assert a == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in b.items()}
        # Each action's seconds over the run, in the raw rows' buckets and in whole seconds.
        fine, whole = activity.activity(backend, raw)["actions"], activity.activity(backend, big)["actions"]
        assert whole["bucket"] == int(whole["bucket"]) >= 1 and whole["times"][0] == int(whole["times"][0])
        assert set(fine["series"]) == set(whole["series"]) >= {"compute"}
        for action, values in fine["series"].items():
            assert sum(values) * fine["bucket"] == pytest.approx(sum(whole["series"][action]) * whole["bucket"])
    twice = {g["group"]: g for g in task_groups.groups(backend, panels.resolve(backend, "c-re"))["groups"]}
    assert {k: twice["twice-g"][k] for k in ("tasks", "memory", "erred", "recomputed", "nbytes", "compute_s")} == {
        "tasks": 3, "memory": 2, "erred": 1, "recomputed": 1, "nbytes": 110 + 100, "compute_s": 4.0}
    assert (twice["once-g"]["memory"], twice["once-g"]["recomputed"], twice["once-g"]["nbytes"]) == (2, 0, 200)
    # finishes equal tasks, but one task finished twice and the other never did
    assert {k: twice["lost-g"][k] for k in ("tasks", "memory", "erred", "recomputed", "nbytes")} == {
        "tasks": 2, "memory": 1, "erred": 0, "recomputed": 1, "nbytes": 110}
