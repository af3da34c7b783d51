"""The stream processors against Dask's own numbers, and against themselves after a
crash.

One shared pipeline (module fixture ``recorded``): a real LocalCluster with worker
processes, the producers attached, one real ``faust ... worker`` processing the raw
topic live, and a workload with the spans document's nested example, a dask.array
reduction, a dask.dataframe groupby, failing tasks and a worker that dies mid-task.
Dask's truth is read on the live cluster at two quiescent points: with results held
(tasks in memory/erred) and after everything was released and forgotten.

What is compared, precisely:

- spans: for every span of ``scheduler.extensions["spans"]``, the latest snapshot
  has the same name, parent, enqueued, start, stop, nbytes_total, states (non-zero
  counts) and done; duration and all_durations in whole microseconds (Dask's unit);
  cumulative_worker_metrics (with Dask's derived "idle or other spans" entry) and
  active_cpu_seconds to 1e-9 relative, nthreads_intervals exactly;
- prefixes: summed over the partials (one per partial_id), ``finished`` equals
  ``TaskPrefix.state_counts`` (how many times a task entered each state),
  ``durations`` equals ``TaskPrefix.all_durations`` in microseconds, ``n_erred``
  equals ``state_counts["erred"]``; and per span tree, partial ``nbytes`` sum to
  ``Span.nbytes_total``.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter

import dask
import dask.array as da
import dask.config
import dask.dataframe as dd
import numpy as np
import orjson
import pandas as pd
import pytest
from aiokafka.partitioner import murmur2
from distributed import Client, LocalCluster, span, wait

from dask_blackbox import producers
from dask_blackbox import contract, kafka
from dask_blackbox.testing.kafka_reader import read_json
from dask_blackbox.testing.processors import (
    FaustWorker, committed_clusters, contract_violations, converge, env_for,
    latest_snapshots, prefix_totals, processor_settings, span_diffs, unique_partials,
)
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing import replay
from dask_blackbox.stream_processors.checkpoint import Journal, parse_key
from dask_blackbox.stream_processors.cluster import ClusterState
from cluster_support import live_workers

PARTITIONS = 2
PROCESSOR_SETTINGS = {
    "blackbox.processors.session-timeout": "6s",
    "blackbox.processors.snapshot-interval": "200ms",
}


# ------------------------------------------------------------------ workload


def fail(i):
    raise ValueError(f"task {i} fails on purpose")


def total(parts):
    return sum(parts)


def slowinc(i):
    time.sleep(0.05)
    return i + 1


def die_once(parts, marker):
    """Kill the worker process the first time it runs, so Dask recomputes it (and
    the lost inputs) elsewhere."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return sum(parts)


def run_workload(client: Client, marker: str, agree) -> list:
    """Run the workload; ``agree(name)`` waits until the pipeline's snapshot of the
    span called ``name`` equals Dask's."""
    held = []
    with dask.config.set({"optimization.fuse.active": False}):
        # The spans document's example, with dask.array standing in for parquet
        with span("Alice's workflow"):
            with span("data load"):
                x = da.random.random((200, 200), chunks=50)
            with span("ML preprocessing"):
                y = (x - x.mean()) / x.std()
            with span("Model training"):
                model = (y @ y.T).sum()
            model.compute()
        with span("array reduction"):
            held.append(da.ones((400, 400), chunks=100).sum(axis=0).persist())
        with span("dataframe groupby"):
            df = dd.from_pandas(
                pd.DataFrame({"k": np.arange(2000) % 7, "v": np.arange(2000.0)}),
                npartitions=4)
            held.append(df.groupby("k").v.sum().persist())
        with span("failures"):
            bad = client.map(fail, range(3))
            after = client.submit(total, bad)
            wait(after)
            held += [*bad, after]
        with span("worker death"):
            # All inputs on one worker, and the task that kills it there too: every
            # input is lost with it and recomputed on the other worker.
            victim = sorted(live_workers(client))[0]
            parts = client.map(slowinc, range(6), workers=[victim], allow_other_workers=True)
            wait(parts)
            # What a dying worker had not reported yet is lost to Dask, and what its
            # producer had not sent is lost to the pipeline, not necessarily the same:
            # wait until both have the digests of `parts` before the worker dies.
            agree("worker death")
            survivor = client.submit(die_once, parts, marker, workers=[victim],
                                     allow_other_workers=True)
            survivor.result()
            held += [*parts, survivor]
    wait(held)
    return held


def prefix_diffs(truth: dict, partials: list[dict]) -> dict:
    totals = prefix_totals(partials)
    out = {}
    for name, t in truth["prefixes"].items():
        got = totals.get(name, {"finished": {}, "durations": {}, "n_erred": 0})
        expected = {"finished": t["state_counts"],
                    "durations": {a: round(v * 1e6) for a, v in t["all_durations"].items()},
                    "n_erred": t["state_counts"].get("erred", 0)}
        if got != expected:
            out[name] = {"dask": expected, "pipeline": got}
    for name in totals.keys() - truth["prefixes"].keys():
        out[name] = {"dask": None, "pipeline": totals[name]}
    return out


def poll_until_equal(diff, timeout=45.0):
    """Re-read the derived topics until ``diff()`` is empty; return the last diff."""
    deadline = time.monotonic() + timeout
    while True:
        d = diff()
        if not d or time.monotonic() > deadline:
            return d
        time.sleep(0.5)


class Recorded:
    """What the shared pipeline produced, and Dask's truth at two points."""


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("processors")
    prefix = "p" + uuid.uuid4().hex[:10]
    settings = processor_settings(broker, prefix, PARTITIONS, snapshot_interval="200ms")
    rec = Recorded()
    with dask.config.set(settings):
        asyncio.run(kafka.ensure_topics())
        worker = FaustWorker(env_for(settings), tmp, "live").start()
        try:
            with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                              dashboard_address=":0", silence_logs=50) as cluster, \
                    Client(cluster) as client:
                cid = rec.cluster_id = producers.attach(client)["cluster_id"]
                held = run_workload(client, str(tmp / "died-once"),
                                    lambda name: converge(client, cid, name))
                rec.truth_held, rec.diffs_held = converge(client, cid)

                del held
                wait_for(lambda: client.run_on_scheduler(
                    lambda dask_scheduler: not dask_scheduler.tasks), 30,
                    "every task forgotten")
                rec.truth_final, _ = converge(client, cid)
            # The cluster is closed: its scheduler_close closes the last partials.
            rec.raw = asyncio.run(replay.read_raw(idle=1.0))

            def final_diff():
                snaps = latest_snapshots(read_json(contract.SPAN_STATE, idle=0.3))
                partials = unique_partials(read_json(contract.PREFIX_STATS, idle=0.3))
                d = {"spans": span_diffs(rec.truth_final, snaps, rec.cluster_id),
                     "prefixes": prefix_diffs(rec.truth_final, partials)}
                rec.snapshots, rec.partials = snaps, partials
                return {k: v for k, v in d.items() if v}

            rec.diffs_final = poll_until_equal(final_diff)
            wait_for(lambda: worker.stats()["envelopes"] >= len(rec.raw), 30,
                     "every envelope")
            rec.stats = worker.stats()
            rec.published = {topic: read_json(topic, idle=0.3)
                             for topic in (contract.SPAN_STATE, contract.PREFIX_STATS)}
        finally:
            worker.stop()
    return rec


# ----------------------------------------------------------------- fidelity


def test_span_snapshots_equal_dask_spans(recorded):
    spans = recorded.truth_held["spans"]
    names = {tuple(s["name"]) for s in spans.values()}
    # the workload did what it says: nested spans, a death, failures
    assert {("Alice's workflow",), ("Alice's workflow", "data load"),
            ("Alice's workflow", "ML preprocessing"),
            ("Alice's workflow", "Model training"), ("worker death",),
            ("failures",)} <= names
    failures = next(s for s in spans.values() if s["name"] == ["failures"])
    assert failures["states"].get("erred") == 4
    death = next(s for s in spans.values() if s["name"] == ["worker death"])
    slowinc = recorded.truth_held["prefixes"]["slowinc"]["state_counts"]
    assert slowinc["memory"] > 6, "no input was lost and recomputed with the worker"
    assert death["done"]
    assert recorded.stats["gaps"] == recorded.stats["dead_letters"] == 0

    assert recorded.diffs_held == {}, recorded.diffs_held
    assert recorded.diffs_final.get("spans", {}) == {}, recorded.diffs_final
    # The parent span, equal to Dask's, rolls up its children (and its own tasks).
    final = recorded.truth_final["spans"]
    alice = next(k for k, s in final.items() if s["name"] == ["Alice's workflow"])
    children = [s for s in final.values() if s["parent_id"] == alice]
    assert len(children) == 3
    parent = recorded.snapshots[(recorded.cluster_id, alice)]
    for state, n in parent["states"].items():
        assert n >= sum(c["states"].get(state, 0) for c in children)
    assert parent["nbytes_total"] >= sum(c["nbytes_total"] for c in children)


def test_prefix_partials_sum_to_dask_task_prefixes(recorded):
    assert recorded.diffs_final.get("prefixes", {}) == {}, recorded.diffs_final
    # nbytes of the partials of a span tree sum to its nbytes_total
    spans = recorded.truth_final["spans"]
    nbytes = Counter()
    for p in recorded.partials:
        sid = p["span_id"]
        while sid is not None:
            nbytes[sid] += p["nbytes"]
            sid = spans[sid]["parent_id"]
    assert {sid: s["nbytes_total"] for sid, s in spans.items() if s["nbytes_total"]} == \
        {sid: n for sid, n in nbytes.items() if n}
    assert all(p["max_duration"] <= p["durations"].get("compute", 0) for p in recorded.partials)


def test_published_records_follow_the_contract(recorded):
    """Every record published, not only the latest: exactly the fields
    ``contract.RECORDS`` declares, each of its declared type."""
    for topic, records in recorded.published.items():
        assert records, topic
        assert contract_violations(topic, records) == [], topic


# --------------------------------------------- crash, scale-out, dead letters, gaps


def _comparable_snapshot(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in ("cluster_id", "cluster_name", "updated_at")}


def _comparable_partials(partials: list[dict]) -> Counter:
    return Counter(orjson.dumps({k: v for k, v in p.items()
                                 if k not in ("cluster_id", "cluster_name", "partial_id")},
                                option=orjson.OPT_SORT_KEYS) for p in partials)


def _cluster_ids_per_partition(n_per_partition: int) -> list[str]:
    """Cluster ids whose messages land evenly on the raw topic's partitions."""
    chosen: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    i = 0
    while any(len(v) < n_per_partition for v in chosen.values()):
        cid = f"copy-{i}"
        p = (murmur2(cid.encode()) & 0x7FFFFFFF) % PARTITIONS
        if len(chosen[p]) < n_per_partition:
            chosen[p].append(cid)
        i += 1
    return [c for p in range(PARTITIONS) for c in chosen[p]]


def _garbage(good: dict, key: bytes) -> list[tuple[bytes, bytes, str]]:
    """(key, value, expected reason) of messages that are not valid envelopes."""
    encoded = orjson.dumps(good)
    return [
        (key, b"this is not json", "not JSON"),
        (key, encoded[: len(encoded) // 2], "not JSON"),
        (key, orjson.dumps({**good, "schema": 99}), "unknown schema version 99"),
        (key, orjson.dumps({k: v for k, v in good.items() if k != "seq"}),
         "lacks field(s) seq"),
        (key, orjson.dumps({**good, "events": [{"kind": "log", "ts": 1.0,
                                                "message": "x" * 950_000}]}),
         "MAX_ENVELOPE_BYTES"),
        (b"someone-else", encoded, "is not the envelope's cluster_id"),
    ]


def _differences_from_recorded(recorded, cluster_ids) -> list[str]:
    """How the latest span snapshots and the partials (one per partial_id) of each
    of ``cluster_ids``, copies of the recorded stream, differ from the recorded
    cluster's."""
    reference = {sid: _comparable_snapshot(s) for (cid, sid), s in
                 recorded.snapshots.items() if cid == recorded.cluster_id}
    reference_partials = _comparable_partials(recorded.partials)
    snaps = latest_snapshots(read_json(contract.SPAN_STATE, idle=0.3))
    partials = unique_partials(read_json(contract.PREFIX_STATS, idle=0.3))
    out = []
    for cid in cluster_ids:
        mine = {sid: _comparable_snapshot(s) for (c, sid), s in snaps.items() if c == cid}
        for sid in reference.keys() | mine.keys():
            ref, got = reference.get(sid) or {}, mine.get(sid) or {}
            if ref != got:
                fields = sorted(k for k in ref.keys() | got.keys()
                                if ref.get(k) != got.get(k))
                out.append(f"{cid} span {sid}: {fields}")
        got = _comparable_partials([p for p in partials if p["cluster_id"] == cid])
        if got != reference_partials:
            out.append(f"{cid} partials: missing {reference_partials - got}, "
                       f"extra {got - reference_partials}")
    return out


def _converge_on_recorded(recorded, cluster_ids, timeout: float) -> list[str]:
    """:func:`_differences_from_recorded`, polled until there are none or the time is up."""
    deadline = time.monotonic() + timeout
    while (problems := _differences_from_recorded(recorded, cluster_ids)) \
            and time.monotonic() < deadline:
        time.sleep(1.0)
    return problems


@pytest.mark.both_brokers
def test_killed_processor_restarts_into_the_same_state(recorded, bb_config, tmp_path):
    """Copies of the recorded stream under new cluster ids, spread over both
    partitions, with garbage in between and one copy missing envelopes, go through
    two faust workers; one is SIGKILLed after it processed part of the stream and
    restarted while the rest arrives. Every copy ends with exactly the snapshots
    and partials of the single-worker run without a crash; closed clusters are then
    forgotten after the TTL."""
    source = [contract.decode_envelope(v) for _, v in recorded.raw]
    copies = _cluster_ids_per_partition(2)
    gappy = "gappy-copy"
    scheduler_pid = next(e["producer_id"] for e in source if e["source"] == "scheduler")
    half = len(source) // 2

    def messages(cid: str, envelopes: list[dict], drop=()) -> list[tuple[bytes, bytes]]:
        return [replay.encode(replay.renamed(e, cid, "@" + cid)) for e in envelopes
                if not (e["producer_id"] == scheduler_pid and e["seq"] in drop)]

    garbage = [g for cid in copies[:: PARTITIONS] for g in
               _garbage(replay.renamed(source[3], cid, "@" + cid), cid.encode())]
    first = [m for cid in copies for m in messages(cid, source[:half])]
    first[len(first) // 3: len(first) // 3] = [(k, v) for k, v, _ in garbage]
    first += messages(gappy, source, drop={5, 6, 7})
    second = [m for cid in copies for m in messages(cid, source[half:])]

    app_id = dask.config.get("blackbox.processors.app-id")
    asyncio.run(replay.publish_raw(first))
    ttl = {"blackbox.processors.finished-cluster-ttl": "4s"}
    env = {**env_for({**PROCESSOR_SETTINGS, **ttl}), **bb_config}
    a = FaustWorker(env, tmp_path, "a").start()
    b = FaustWorker(env, tmp_path, "b").start()
    try:
        wait_for(lambda: all((s := w.stats()) and s["envelopes"] > 0 for w in (a, b)),
                 60, "both workers processing")
        # Every copy has a checkpoint, so the restart has something to recover.
        wait_for(lambda: set(copies) <= committed_clusters(app_id), 30,
                 "checkpoints of every copy")
        a.kill()
        asyncio.run(replay.publish_raw(second))
        a.start()

        problems = _converge_on_recorded(recorded, copies, 90)
        assert not problems, (problems, a.tail(), b.tail())
        # the killed worker's clusters were rebuilt from the changelog, not from scratch
        assert a.stats()["adopted"] + b.stats()["adopted"] > 0
        # closed clusters are forgotten after the TTL, in memory and on the changelog
        wait_for(lambda: a.stats()["clusters"] + b.stats()["clusters"] == 0, 30,
                 "closed clusters forgotten")
        wait_for(lambda: not committed_clusters(app_id), 30,
                 "their checkpoints deleted")
    finally:
        a.stop()
        b.stop()

    dead = read_json(contract.DEAD_LETTER, idle=0.5)
    assert contract_violations(contract.DEAD_LETTER, dead) == []
    got = {(d["key"], d["payload"][:50], d["reason"]) for d in dead}
    for key, value, reason in garbage:
        assert any(k == key.decode() and p == value[:50].decode("utf-8", "replace")
                   and reason in r for k, p, r in got), (reason, got)
    assert len({(d["partition"], d["offset"]) for d in dead}) == len(garbage)

    gaps = read_json(contract.GAPS, idle=0.5)
    assert contract_violations(contract.GAPS, gaps) == []
    assert {(g["cluster_id"], g["producer_id"], g["missing_from"], g["missing_to"])
            for g in gaps} == {(gappy, scheduler_pid + "@" + gappy, 5, 7)}


def test_a_cluster_is_forgotten_only_once_its_last_message_is_committed(
        recorded, bb_config, tmp_path):
    """A processor that applied a cluster to its scheduler_close but has not
    committed the raw offsets yet keeps it past finished-cluster-ttl. Killed then, the
    next processor reads the uncommitted half again as duplicates of the checkpoint,
    instead of starting the cluster over from the middle (its partials a second time
    under new ids, and a gap), and forgets it once it has committed the last message."""
    source = [contract.decode_envelope(v) for _, v in recorded.raw]
    cid = "late-commit"
    messages = [replay.encode(replay.renamed(e, cid, "@" + cid)) for e in source]
    half = len(messages) // 2
    app_id = dask.config.get("blackbox.processors.app-id")
    settings = {**PROCESSOR_SETTINGS, "blackbox.processors.finished-cluster-ttl": "1s"}
    env = {**env_for(settings), **bb_config}
    never_commits = {**env_for({**settings, "blackbox.processors.commit-interval": "1h"}),
                     **bb_config}
    asyncio.run(replay.publish_raw(messages[:half]))
    a = FaustWorker(env, tmp_path, "a").start()
    b = FaustWorker(never_commits, tmp_path, "b")
    c = FaustWorker(env, tmp_path, "c")
    try:
        wait_for(lambda: (a.stats() or {}).get("envelopes", 0) >= half, 60,
                 "the first half processed")
        # Stopped, a commits what it processed and leaves the group: b's assignment
        # is b's only rebalance (on a rebalance, faust commits what it processed).
        a.stop()
        asyncio.run(replay.publish_raw(messages[half:]))
        b.start()
        wait_for(lambda: (b.stats() or {}).get("forget_postponed", 0) > 0, 60,
                 "the closed cluster kept past its TTL, its last messages uncommitted")
        assert b.stats()["clusters"] == 1 and cid in committed_clusters(app_id)
        b.kill()
        c.start()
        wait_for(lambda: (c.stats() or {}).get("envelopes", 0) >= len(messages) - half,
                 60, "the uncommitted half read again")
        again = c.stats()
        assert again["adopted"] == 1 and again["duplicates"] == again["envelopes"], again
        problems = _converge_on_recorded(recorded, [cid], 60)
        assert not problems, (problems, c.tail())
        wait_for(lambda: c.stats()["clusters"] == 0, 30, "the cluster forgotten")
        wait_for(lambda: cid not in committed_clusters(app_id), 30,
                 "its checkpoint deleted")
    finally:
        for w in (a, b, c):
            w.stop()
    # no second set of partials, no gap where the uncommitted half began
    assert not _differences_from_recorded(recorded, [cid])
    assert [g for g in read_json(contract.GAPS, idle=0.5) if g["cluster_id"] == cid] == []


# ------------------------------------------------------- checkpoint consistency


@pytest.mark.both_brokers
def test_checkpoints_recover_from_a_crash_at_any_message(recorded):
    """Apply the recorded stream with a checkpoint after every few envelopes, keep
    every changelog message, then for each cut of that log (a crash after message
    i): recover, re-apply the stream from where the recovered state stands
    (duplicates skipped by seq) and compare with the uninterrupted state."""
    # small parts, little carried inline and frequent bases, so cuts fall inside
    # multi-part checkpoints
    sizes = {"part_bytes": 2000, "compact_min_bytes": 20_000, "compact_max_deltas": 5,
             "inline_bytes": 400}
    source = [contract.decode_envelope(v) for _, v in recorded.raw]
    cid = source[0]["cluster_id"]

    def fresh():
        return ClusterState(cid, 60.0, 10**6)

    log: list[tuple[bytes, bytes | None]] = []
    state, journal = fresh(), Journal(cid, **sizes)
    bases, deltas = set(), 0  # which base slots were written, how many deltas
    for i, envelope in enumerate(source):
        state.apply(envelope)
        if i % 3 == 2 or i == len(source) - 1:
            log += journal.commit(state.take_changes(), state.records, 0)
            if journal.base is not None:
                bases.add(journal.base[0])
            deltas += bool(journal.deltas)
    expected = state.records()
    # the cuts only prove something if the log rewrote a base (both slots) and
    # carried deltas between bases; the final commit may be either kind
    assert bases == {0, 1} and deltas, (bases, deltas)

    for cut in range(len(log) + 1):
        store: dict[bytes, bytes] = {}
        for key, value in log[:cut]:
            if value is None:
                store.pop(key, None)
            else:
                store[key] = value
        entries = {parse_key(k)[1]: v for k, v in store.items()}
        rec = Journal.recover(cid, entries, **sizes)
        recovered = fresh() if rec.journal is None else ClusterState.from_records(
            cid, rec.records, 60.0, 10**6)
        assert not recovered.problems
        for envelope in source:
            recovered.apply(envelope)
        assert recovered.records() == expected, f"crash after changelog message {cut}"


# ------------------------------------------------------------------ settings


def test_settings_are_resolved_once_and_validated():
    from dask_blackbox.config import ConfigError
    from dask_blackbox.stream_processors.settings import ProcessorSettings

    with dask.config.set({"blackbox.processors.idle-cluster-ttl": "90s",
                          "blackbox.kafka.bootstrap-servers": "127.0.0.1:9"}):
        s = ProcessorSettings.from_config()
    assert s.idle_cluster_ttl == 90 and s.kafka.bootstrap_servers == ("127.0.0.1:9",)
    assert s.commit_interval == 2.8  # faust's default
    with pytest.raises(Exception):
        s.prefix_window = 1  # frozen
    for key, value, fix in (
            ("processors.snapshot-interval", "0s", "snapshot-interval: '0s' must be at least"),
            ("processors.idle-cluster-ttl", "soon", "idle-cluster-ttl: 'soon' is not a duration"),
            ("processors.session-timeout", "500ms", "session-timeout: '500ms' must be at least 1s"),
            ("processors.commit-interval", "0s", "commit-interval: '0s' must be at least"),
            ("processors.batch-max-envelopes", 0, "batch-max-envelopes: 0 must be an integer")):
        with dask.config.set({f"blackbox.{key}": value,
                              "blackbox.kafka.bootstrap-servers": "127.0.0.1:9"}):
            with pytest.raises(ConfigError, match=fix.replace("(", r"\(")):
                ProcessorSettings.from_config()
