"""The sink as it runs: a real Tansu broker, the real sink subprocess, real chDB.

- everything published (raw envelopes, the processors' derived topics, invalid
  messages) ends up queryable, rows ClickHouse rejects included, as dead letters;
- SIGKILL before, during and after inserts, then a restart, leaves exactly the rows a
  crash-free run leaves;
- ClickHouse unable to write for a while delays loading and loses nothing;
- start-up errors are one clear line.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import clickhouse_connect
import dask.config
import orjson
import pytest

from dask_blackbox import config, contract
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.read import backends, queries
from dask_blackbox.cli import sink as service
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import TABLES

from sink_support import (
    SinkProcess, assert_same_rows, can_chattr, chattr, count, dump, envelope, lag, produce,
    reference_dump, topic_messages, transition, wait_consumed, workload,
)
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.settings import dask_env

NOW = time.time()


def derived_records() -> dict[str, list[tuple[bytes, bytes]]]:
    """Records as the stream processors publish them (contract.*_FIELDS)."""
    def span(version, stop):
        return {"cluster_id": "cluster-0", "cluster_name": "name-cluster-0", "span_id": "s-root",
                "name": ["etl"], "parent_id": None, "version": version, "enqueued": NOW - 100,
                "start": NOW - 99, "stop": stop, "duration": 2.0 * version, "nbytes_total": 10 * version,
                "states": {"memory": version}, "all_durations": {"compute": 2.0 * version},
                "cumulative_worker_metrics": [["execute", "inc", "thread-cpu", "seconds", 1.5]],
                "done": version == 3, "updated_at": NOW - 50 + version}

    def partial(partial_id, compute):
        return {"cluster_id": "cluster-0", "cluster_name": "name-cluster-0", "span_id": "s-root",
                "prefix": "inc", "window_start": NOW - 120, "partial_id": partial_id,
                "finished": {"memory": 2}, "durations": {"compute": compute}, "nbytes": 16,
                "n_erred": 0, "max_duration": compute / 2}

    def other_run(span_id, name, parent_id, duration):
        # The same span name in another cluster; its child's compute rolls up into it.
        return {**span(1, NOW - 60), "cluster_id": "cluster-1", "cluster_name": "name-cluster-1",
                "span_id": span_id, "name": name, "parent_id": parent_id, "enqueued": NOW - 65,
                "start": NOW - 64, "duration": duration}

    key = b"cluster-0"
    child_partial = {**partial("p3", 2.5), "cluster_id": "cluster-1", "span_id": "s-child", "prefix": "read"}
    return {
        # Version 3 is published before version 2: the highest version wins, not the last.
        contract.SPAN_STATE: [(key, orjson.dumps(span(1, NOW - 90))), (key, orjson.dumps(span(3, NOW - 70))),
                              (key, orjson.dumps(span(2, NOW - 80))),
                              (b"cluster-1", orjson.dumps(other_run("s-other", ["etl"], None, 5.0))),
                              (b"cluster-1", orjson.dumps(other_run("s-child", ["etl", "load"], "s-other", 2.5)))],
        # p1 replayed by a restarted processor: counted once.
        contract.PREFIX_STATS: [(key, orjson.dumps(partial("p1", 3.0))), (key, orjson.dumps(partial("p2", 1.0))),
                                (key, orjson.dumps(partial("p1", 3.0))),
                                (b"cluster-1", orjson.dumps(child_partial))],
        contract.GAPS: [(key, orjson.dumps({"cluster_id": "cluster-0", "producer_id": "prod-cluster-0",
                                            "source": "scheduler", "missing_from": 3, "missing_to": 4,
                                            "detected_at": NOW}))] * 2,
        contract.DEAD_LETTER: [(b"x", orjson.dumps({"topic": "t.raw", "partition": 0, "offset": 17, "key": "x",
                                                    "reason": "envelope lacks field(s) seq",
                                                    "payload": "{}", "detected_at": NOW}))],
    }


def produce_everything(n_envelopes: int = 10, events: int = 20) -> None:
    produce(workload(n_envelopes, events))
    produce([(b"cluster-0", b"{definitely not json"),
             (b"cluster-0", orjson.dumps(envelope(
                 [transition("ok-1", "waiting", "processing", NOW - 30),
                  transition("bad-clock", "waiting", "processing", 12.0),
                  transition("ok-2", "waiting", "processing", NOW - 29)],
                 cluster_id="cluster-0", cluster_name="name-cluster-0", producer_id="other", seq=0)))])
    for topic, messages in derived_records().items():
        produce(messages, topic)


def prepare_chdb(data_dir, sql: str) -> None:
    """Run DDL in the sink's chDB directory before the sink owns it."""
    client = clickhouse_connect.get_client(dsn=f"chdb://{data_dir / 'clickhouse'}")
    try:
        migrate(client, Target("blackbox", 90 * 86400))
        client.command(sql)
    finally:
        client.close()


@pytest.mark.both_brokers
def test_sink_loads_every_topic_and_dead_letters_what_cannot_be_stored(bb_config, tmp_path):
    data_dir = tmp_path / "data"
    # A DBA's constraint: ClickHouse itself will reject the transition with a huge key.
    prepare_chdb(data_dir, "ALTER TABLE blackbox.transitions ADD CONSTRAINT key_size CHECK length(key) <= 200")
    poison = "p" * 300
    produce_everything()
    produce([(b"cluster-1", orjson.dumps(envelope(
        [transition(f"n-{i}", "waiting", "processing", NOW - 20 + i) for i in range(3)]
        + [transition(poison, "waiting", "processing", NOW - 10)],
        cluster_id="cluster-1", cluster_name="name-cluster-1", producer_id="third", seq=0)))])
    sink = SinkProcess(bb_config)
    try:
        assert "sink ready" in sink.wait_ready()
        info = orjson.loads((data_dir / "sink.json").read_bytes())
        assert info["pid"] == sink.proc.pid and info["dsn"] == config.clickhouse_dsn()
        assert oct((data_dir / "sink.json").stat().st_mode & 0o777) == "0o600"
        # A second sink cannot take the directory over; it says why, in one line.
        second = SinkProcess(bb_config)
        assert second.proc.wait(60) == 1
        error = second.stderr().strip().splitlines()[-1]
        assert "is in use by another process" in error and error.startswith("dask-blackbox sink: error:")
        second.kill()

        wait_consumed(sink)
        backend = sink.backend()
        expected_transitions = 10 * 20 + 2 + 3  # workload + ok-1/ok-2 + n-0..n-2
        assert count(backend, "transitions") == expected_transitions
        assert count(backend, "envelopes") == 10 + 1 + 1
        assert count(backend, "logs") == count(backend, "events") == 10
        # Text an event leaves out (or sends as null) is '' in ClickHouse.
        assert backend.query("SELECT worker, typename, cause FROM blackbox.transitions "
                             "WHERE key = 'n-0'")[1] == [("", "", "")]
        _, letters = backend.query("SELECT origin, reason, payload FROM blackbox.dead_letters ORDER BY reason")
        reasons = [(origin, reason) for origin, reason, _ in letters]
        assert ("processor", "envelope lacks field(s) seq") in reasons
        assert any(o == "sink" and r.startswith("not JSON") for o, r in reasons)
        assert any(o == "sink" and "event 1: transition: ts: 12.0 is not a plausible time" in r for o, r in reasons)
        [(_, rejected, payload)] = [r for r in letters if "ClickHouse rejected" in r[1]]
        assert "Constraint `key_size`" in rejected and orjson.loads(payload)["key"] == poison
        assert len(letters) == 4

        # Latest span version wins; a replayed partial counts once.
        _, state = backend.query("SELECT version, duration FROM blackbox.span_state FINAL "
                                 "WHERE cluster_id = 'cluster-0'")
        assert state == [(3, 6.0)]
        _, top = queries.prefixes(backend, cluster="name-cluster-0")
        assert [(r[0], r[1], r[3]) for r in top] == [("inc", 4.0, 4)]
        _, top = queries.prefixes(backend, span="load")
        assert [(r[0], r[1]) for r in top] == [("read", 2.5)]
        # The same span in two runs, side by side, sub-spans' compute included.
        columns, rows = queries.compare(backend, "etl")
        assert [c.split(" ")[0] for c in columns] == ["metric", "name-cluster-0", "name-cluster-1"]
        metrics = {r[0]: r[1:] for r in rows}
        assert metrics["task_s"] == (6.0, 5.0) and metrics["tasks"] == (3, 1)
        assert metrics["elapsed_s"] == pytest.approx((29.0, 4.0))
        assert metrics["compute_s inc"] == (4.0, 0.0) and metrics["compute_s read"] == (0.0, 2.5)
        columns, tree = queries.spans(backend, tree=True, cluster="name-cluster-1")
        assert [(r[1], r[columns.index("depth")]) for r in tree] == [("etl", 0), ("  load", 1)]
        _, gaps = queries.gaps_and_drops(backend, cluster="cluster-0")
        by_producer = {r[2]: r for r in gaps}
        assert by_producer["prod-cluster-0"][7:9] == (0, 2)  # no seq missing; 2 reported by processors

        # The query server answers as a direct client would, and only reads.
        unqualified = backend.query("SELECT count() FROM envelopes")
        remote_story = queries.story(backend, "inc-3-5")
        remote_spans = queries.spans(backend, tree=True)
        with pytest.raises(queries.QueryError, match="only read-only statements"):
            backend.query("INSERT INTO blackbox.logs (cluster_id) VALUES ('x')")
        with pytest.raises(queries.QueryError, match="only read-only statements"):
            backend.query("SELECT 1 INTO OUTFILE '/tmp/x'")
        forged = backends.RemoteBackend(backend.url, "wrong-token", "blackbox")
        with pytest.raises(queries.QueryError, match="X-Blackbox-Token"):
            forged.query("SELECT 1")

        assert sink.terminate() == 0
        assert not (data_dir / "sink.json").exists()
    finally:
        sink.kill()
    direct = queries.connect()
    try:
        assert isinstance(direct, backends.DirectBackend)
        assert queries.story(direct, "inc-3-5") == remote_story
        assert direct.query("SELECT count() FROM envelopes") == unqualified == (["count()"], [(12,)])
        assert remote_story[1][0][:3] == ("inc-3-5", "waiting", "processing")
        assert queries.spans(direct, tree=True) == remote_spans
    finally:
        direct.close()


@pytest.mark.both_brokers
def test_sigkill_before_during_and_after_inserts_leaves_crash_free_rows(bb_config, tmp_path):
    produce_everything(n_envelopes=40, events=30)
    small_batches = {"batch_max_rows": "300"}
    # Before any insert of a batch, between two tables' inserts, after the rows are in
    # but before the Kafka commit, after the commit: each time SIGKILL, then restart.
    for pause in ("after-begin:1", "between-tables:2", "after-load:2", "after-commit:1"):
        sink = SinkProcess(bb_config, debug_pause_at=pause, **small_batches)
        try:
            sink.wait_ready()
            sink.wait_paused(pause.split(":")[0])
        finally:
            sink.kill()

    # And at an arbitrary moment while a bigger wave loads.
    produce(workload(150, 40, clusters=3, t0=NOW - 300))
    before = lag()
    sink = SinkProcess(bb_config, **small_batches)
    try:
        sink.wait_ready()
        wait_for(lambda: lag() < before * 0.6, 90, "some of the wave to load", interval=0.05)
    finally:
        sink.kill()
    assert lag() > 0
    sink = SinkProcess(bb_config, **small_batches)
    try:
        sink.wait_ready()
        wait_consumed(sink)
        assert sink.terminate() == 0
    finally:
        sink.kill()
    actual = dump(tmp_path / "data" / "clickhouse")
    expected = reference_dump(topic_messages(), tmp_path / "reference")
    assert_same_rows(actual, expected)
    assert sum(len(rows) for rows in actual.values()) > 6000


@pytest.mark.both_brokers
def test_clickhouse_unable_to_write_delays_loading_and_loses_nothing(bb_config, tmp_path):
    """ClickHouse fails every insert into transitions while its data directory is
    immutable (chattr +i: a read-only disk, as far as ClickHouse can tell): the sink
    keeps the batch, retries with backoff, commits nothing, and loads it all once
    the directory is writable again. Envelopes of the same batches do get inserted
    before each failure, so the retries also prove partial batches are undone."""
    if not can_chattr(tmp_path):
        pytest.skip("needs root and a filesystem with chattr +i to make ClickHouse fail for real")
    produce(workload(1, 5))
    sink = SinkProcess(bb_config, retry_backoff_max="500ms")
    locked: list[str] = []
    try:
        sink.wait_ready()
        wait_consumed(sink)
        backend = sink.backend()
        _, paths = backend.query("SELECT data_paths FROM system.tables "
                                 "WHERE database = 'blackbox' AND name = 'transitions'")
        locked = list(paths[0][0])
        chattr(locked, "+i")
        produce(workload(30, 20, t0=NOW - 200))
        wait_for(lambda: sink.stderr().count("did not take batch") >= 3, 60, "failed attempts",
                 interval=0.2)
        assert sink.proc.poll() is None
        assert lag() > 0  # nothing committed while ClickHouse fails
        assert count(backend, "transitions") == 5
        chattr(locked, "-i")
        locked = []
        wait_consumed(sink)
        assert count(backend, "transitions") == 5 + 30 * 20
        assert sink.terminate() == 0
    finally:
        if locked:
            chattr(locked, "-i")
        sink.kill()
    assert "deleted" in sink.stderr()  # partial attempts were undone
    assert_same_rows(dump(tmp_path / "data" / "clickhouse"),
                     reference_dump(topic_messages(), tmp_path / "reference"))


@pytest.mark.parametrize("settings, message", [
    ({"blackbox.clickhouse.dsn": "mysql://db:3306"}, "blackbox.clickhouse.dsn: 'mysql://db:3306' must start with"),
    ({"blackbox.sink.batch-max-rows": 0}, "blackbox.sink.batch-max-rows: 0 must be an integer >= 1"),
    ({"blackbox.sink.debug-pause-at": "nowhere"}, "blackbox.sink.debug-pause-at: 'nowhere' is not one of"),
    ({"blackbox.sink.session-timeout": "0s"}, "blackbox.sink.session-timeout: '0s' must be at least"),
    ({"blackbox.sink.batch-max-wait": 0}, "blackbox.sink.batch-max-wait: 0 must be at least"),
    ({"blackbox.sink.query-port": 70000}, "blackbox.sink.query-port: 70000 is not a TCP port"),
    ({"blackbox.sink.group-id": ""}, "blackbox.sink.group-id: '' must be a non-empty string"),
])
def test_bad_settings_stop_the_sink_with_one_line(settings, message, tmp_path, capsys):
    with dask.config.set({"blackbox.data-dir": str(tmp_path / "d"), **settings}):
        assert service.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dask-blackbox sink: error: ") and message in err[-1]


def test_unwritable_dirs_and_unreachable_clickhouse_are_named(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [
        ({"blackbox.data-dir": str(tmp_path / "p"), "blackbox.sink.query-port": port},
         f"blackbox.sink.query-port: cannot listen on 127.0.0.1:{port}"),
        ({"blackbox.data-dir": str(blocker / "data")}, f"blackbox.data-dir: cannot write to {blocker / 'data'}"),
        ({"blackbox.data-dir": str(tmp_path / "d"), "blackbox.clickhouse.dsn": f"chdb://{blocker}/ch"},
         f"blackbox.clickhouse.dsn: cannot write to {blocker}/ch"),
        ({"blackbox.data-dir": str(tmp_path / "d"),
          "blackbox.clickhouse.dsn": f"http://bob:secret@127.0.0.1:{free_port()}"},
         "cannot reach ClickHouse at http://bob:***@127.0.0.1:"),
    ]
    try:
        for settings, message in cases:
            with dask.config.set(settings):
                assert service.main([]) == 1
            err = capsys.readouterr().err.strip().splitlines()
            assert message in err[-1] and "secret" not in err[-1], err
            assert err[-1].startswith("dask-blackbox sink: error: ")
    finally:
        taken.close()


@pytest.mark.both_brokers
def test_a_sink_on_a_new_broker_loads_at_once(own_broker_factory, broker_kind, tmp_path):
    """The broker is replaced by a new, empty incarnation on the same port (a Tansu
    restart; Kafka with a new data directory) while the journal still names a loaded
    batch from offset 0 of every partition that had messages. The restarted sink does
    not wait for those messages (the group never committed on the new broker: the
    check is moot), nor, restarted once more after committing there, for more than
    the journal checks' bound (the new broker answers that nothing is there); it is
    ready when it loads, at once, and what it loads is loaded exactly once."""
    import asyncio

    from dask_blackbox import kafka
    from dask_blackbox.sinks.consumer import CHECK_TIMEOUT

    port = free_port()
    first = own_broker_factory(port=port)
    settings = {"blackbox.kafka.bootstrap-servers": first.address,
                "blackbox.kafka.topic-prefix": "fresh", "blackbox.kafka.partitions": 4,
                "blackbox.data-dir": str(tmp_path / "data"), "blackbox.sink.group-id": "sink-fresh"}
    env = dask_env(settings)
    with dask.config.set(settings):
        first.start(timeout=120)
        asyncio.run(kafka.ensure_topics())
        # One batch from offset 0 on each partition that gets messages: 8 clusters'
        # envelopes spread over the raw topic's partitions, and derived records.
        produce(workload(8, 5, clusters=8, t0=NOW - 900))
        for topic, records in derived_records().items():
            produce(records, topic)
        sink = SinkProcess(env)
        try:
            sink.wait_ready()
            wait_consumed(sink)
            loaded = count(sink.backend(), "transitions")
        finally:
            assert sink.terminate() == 0, sink.stderr()
        assert loaded == 8 * 5
        first.kill()
        second = own_broker_factory(port=port)  # same port, nothing of the first
        second.start(timeout=120)
        asyncio.run(kafka.ensure_topics())
        for restart in ("moot", "absent"):
            sink = SinkProcess(env)
            try:
                began = time.monotonic()
                ready = sink.wait_ready(timeout=CHECK_TIMEOUT + 60)
                waited = time.monotonic() - began
                info = orjson.loads((tmp_path / "data" / "sink.json").read_bytes())
                assert info["loading"] is True and "sink ready" in ready
                if restart == "moot":  # from producers started since (new ids)
                    produce(workload(4, 5, clusters=4, t0=NOW - 300, producer="later"))
                wait_consumed(sink)
                assert count(sink.backend(), "transitions") == loaded + 4 * 5
            finally:
                assert sink.terminate() == 0, sink.stderr()
            log = sink.stderr()
            if restart == "moot":
                assert log.count("never committed this partition on this broker") >= 5, log
                assert "is not the one it loaded" not in log
            else:
                assert "is not the one it loaded" in log, log
            # Old sinks waited 10 s per such partition, one after another.
            assert waited < CHECK_TIMEOUT + 30, (restart, waited)


@pytest.mark.both_brokers
def test_a_commit_the_group_refused_leaves_the_batch_to_its_next_owner(bb_config, tmp_path):
    """A sink stalls between loading a batch and committing it (SIGSTOP: a long pause,
    a swapped-out host) past its session timeout; the group gives its partitions to a
    second sink, which loads everything from the group's offsets. When the first goes
    on, its commit is refused: it gives up the batch it loaded (each sink has a chDB
    store of its own here), so the two stores together hold every row exactly once."""
    produce(workload(40, 25, clusters=3, t0=NOW - 200))
    first = SinkProcess(bb_config, debug_pause_at="after-load:1", batch_max_rows="300")
    second_env = {**bb_config, "DASK_BLACKBOX__DATA_DIR": str(tmp_path / "second")}
    second = None
    try:
        first.wait_ready()
        first.wait_paused("after-load")
        os.kill(first.proc.pid, signal.SIGSTOP)  # no heartbeats from here
        assert lag() > 0
        second = SinkProcess(second_env, batch_max_rows="300")
        second.wait_ready()
        wait_consumed(second, timeout=120)  # the first's partitions came to it
        os.kill(first.proc.pid, signal.SIGCONT)
        first.resume("after-load")
        wait_for(lambda: "could not commit after loading" in first.stderr()
                 or first.proc.poll() is not None, 60, "the first sink's commit to be refused")
        assert first.proc.poll() is None, first.stderr()
        wait_consumed(second)
        assert first.terminate() == 0 and second.terminate() == 0
    finally:
        first.kill()
        if second is not None:
            second.kill()
    stores = [dump(d / "clickhouse") for d in (tmp_path / "data", tmp_path / "second")]
    expected = reference_dump(topic_messages(), tmp_path / "reference")
    for table in TABLES:  # the raw tables: rows, duplicates counted
        assert sorted(stores[0][table] + stores[1][table]) == expected[table], table
    assert sum(len(expected[t]) for t in TABLES) > 1000
