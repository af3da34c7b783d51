"""The span state alone (``SpanTree``, ``ClusterState``, checkpoints), fed hand-written
events: no cluster, no broker. Dask's own ``distributed.spans.Span`` is the oracle of
the thread-count figures (built on a history written here, not on a cluster)."""

from __future__ import annotations

import math
import random

import orjson
import pytest
from distributed.scheduler import TaskGroup, TaskPrefix
from distributed.spans import Span as DaskSpan

from dask_blackbox.stream_processors.checkpoint import (
    Journal, UnknownFormat, entry_key, parse_key,
)
from dask_blackbox.stream_processors.cluster import BadRecord, ClusterState
from dask_blackbox.stream_processors.prefix_stats import PrefixWindows
from dask_blackbox.stream_processors.span_state import (
    IDLE_KEY, Rejected, SpanTree, nthreads_intervals,
)

# ------------------------------------------------------------------ events


def envelope(seq, events, producer="sched-1", source="scheduler", cid="c1"):
    return {"schema": 1, "cluster_id": cid, "cluster_name": "one", "source": source,
            "producer_id": producer, "seq": seq, "sent_at": 0.0, "events": events}


def tr(key, start, finish, ts, group="inc-1", prefix="inc", span_id="S", **extra):
    return {"kind": "transition", "ts": ts, "key": key, "start": start,
            "finish": finish, "group": group, "prefix": prefix, "span_id": span_id,
            **extra}


def sp(span_id, name, parent_id, enqueued):
    return {"kind": "span", "ts": enqueued, "span_id": span_id, "name": name,
            "parent_id": parent_id, "enqueued": enqueued}


def computed(key, t0, t1, group="inc-1", prefix="inc", span_id="S", nbytes=8):
    """A task's whole life up to memory, computing from t0 to t1."""
    return [
        tr(key, "released", "waiting", t0 - 0.2, group, prefix, span_id),
        tr(key, "waiting", "processing", t0 - 0.1, group, prefix, span_id),
        tr(key, "processing", "memory", t1 + 0.01, group, prefix, span_id, nbytes=nbytes,
           startstops=[{"action": "compute", "start": t0, "stop": t1}]),
    ]


def forgotten(key, ts, group="inc-1", prefix="inc", span_id="S"):
    return [tr(key, "memory", "released", ts, group, prefix, span_id),
            tr(key, "released", "forgotten", ts, None, None, None)]


def lifecycle(action, ts, entries):
    return {"kind": "lifecycle", "ts": ts, "action": action, "worker": None,
            "client": None, "reason": None, "stimulus_id": None, "detail": None,
            "total_nthreads": entries}


class Feed:
    """A SpanTree fed one envelope per call, as ClusterState feeds it."""

    def __init__(self):
        self.tree = SpanTree(10_000)
        self.windows = PrefixWindows(60.0)
        self.seq = 0

    def __call__(self, *events):
        self.seq += 1
        tree = self.tree
        tree.clock = self.seq
        for ev in events:
            if ev["kind"] == "transition":
                tree.transition(ev, self.windows.partial, "sched", self.seq)
            elif ev["kind"] == "span":
                tree.span(ev)
            elif ev["kind"] == "lifecycle":
                tree.nthreads(ev["total_nthreads"], ev["action"] == "scheduler_start")
            else:
                tree.digests(ev["digests"])
        tree.end_envelope()

    def snapshot(self, sid):
        return self.snapshots([sid])[sid]

    def snapshots(self, ids=None):
        tree = self.tree
        ids = list(tree.spans) if ids is None else ids
        return {sid: tree.snapshot(sid, *parts) for sid, parts in tree.rollup(ids).items()}


# ------------------------------------------------------------ counting tasks


def test_a_task_is_counted_through_its_life():
    feed = Feed()
    feed(sp("S", ["work"], None, 100.0))
    feed(*computed("a", 101.0, 101.5, nbytes=100))
    s = feed.snapshot("S")
    assert s["states"] == {"memory": 1}
    assert s["all_durations"] == {"compute": 0.5}
    assert s["duration"] == 0.5
    assert (s["start"], s["stop"], s["nbytes_total"], s["done"]) == (101.0, 101.5, 100, True)
    feed(tr("b", "released", "waiting", 102.0))
    assert feed.snapshot("S")["done"] is False
    assert feed.snapshot("S")["states"] == {"memory": 1, "waiting": 1}
    feed(*forgotten("a", 103.0))
    # a forgotten task's bytes stay counted; the group lives on through "b"
    s = feed.snapshot("S")
    assert s["states"] == {"forgotten": 1, "waiting": 1} and s["nbytes_total"] == 100


def test_start_and_stop_are_raised_to_enqueued():
    feed = Feed()
    feed(sp("S", ["work"], None, 100.0))
    # a worker clock a little behind the scheduler's
    feed(*computed("a", 99.9, 99.95))
    s = feed.snapshot("S")
    assert (s["start"], s["stop"]) == (100.0, 100.0)


def test_a_parent_rolls_up_its_children():
    feed = Feed()
    feed(sp("P", ["outer"], None, 100.0), sp("A", ["outer", "a"], "P", 100.1),
         sp("B", ["outer", "b"], "P", 100.2))
    feed(*computed("a1", 101.0, 102.0, "a-1", "a", "A", nbytes=10))
    feed(*computed("a2", 101.5, 103.0, "a-1", "a", "A", nbytes=20))
    feed(*computed("b1", 100.5, 101.0, "b-1", "b", "B", nbytes=5))
    feed(*computed("p1", 104.0, 104.25, "p-1", "p", "P", nbytes=1))
    feed({"kind": "worker_digests", "ts": 105.0, "worker": "w", "digests": [
        ["execute", "A", "a", "thread-cpu", "seconds", 1.0],
        ["execute", "B", "b", "thread-cpu", "seconds", 0.25],
        ["execute", "P", "p", "thread-cpu", "seconds", 0.125],
        ["execute", None, "x", "thread-cpu", "seconds", 9.0]]})
    snaps = feed.snapshots()
    p, a, b = snaps["P"], snaps["A"], snaps["B"]
    assert a["states"] == {"memory": 2} and b["states"] == {"memory": 1}
    assert p["states"] == {"memory": 4}
    assert p["nbytes_total"] == a["nbytes_total"] + b["nbytes_total"] + 1 == 36
    assert p["all_durations"] == {"compute": 1.0 + 1.5 + 0.5 + 0.25}
    assert (p["start"], p["stop"]) == (100.5, 104.25)
    assert {tuple(r[:-1]): r[-1] for r in p["cumulative_worker_metrics"]} == {
        ("execute", "a", "thread-cpu", "seconds"): 1.0,
        ("execute", "b", "thread-cpu", "seconds"): 0.25,
        ("execute", "p", "thread-cpu", "seconds"): 0.125}
    # a parent's version is the latest change in its tree
    assert p["version"] == max(a["version"], b["version"], p["version"]) == feed.seq
    assert a["parent_id"] == b["parent_id"] == "P" and p["parent_id"] is None
    # a new running child makes the parent not done
    feed(sp("C", ["outer", "c"], "P", 106.0), tr("c1", "released", "waiting", 106.1,
                                                    "c-1", "c", "C"))
    assert feed.snapshot("P")["done"] is False


def test_a_span_reopened_under_the_same_name_is_a_new_span():
    """``with span("x")`` twice: two spans with one name; the same task group name
    computed again after its first group was forgotten starts a new group, counted
    in the second span only."""
    feed = Feed()
    feed(sp("X1", ["x"], None, 100.0))
    feed(*computed("k", 101.0, 102.0, "inc-1", "inc", "X1"))
    feed(*forgotten("k", 103.0))
    feed(sp("X2", ["x"], None, 110.0))
    feed(*computed("k", 111.0, 111.5, "inc-1", "inc", "X2"))
    snaps = feed.snapshots()
    assert snaps["X1"]["name"] == snaps["X2"]["name"] == ["x"]
    assert snaps["X1"]["states"] == {"forgotten": 1}
    assert snaps["X2"]["states"] == {"memory": 1}
    assert snaps["X1"]["all_durations"] == {"compute": 1.0}
    assert snaps["X2"]["all_durations"] == {"compute": 0.5}
    assert (snaps["X2"]["start"], snaps["X2"]["stop"]) == (111.0, 111.5)
    # while a group lives, a task of it stays in its first span (Dask's TaskGroup.span_id)
    feed(tr("k2", "released", "waiting", 112.0, "inc-1", "inc", "X1"))
    assert feed.snapshot("X2")["states"] == {"memory": 1, "waiting": 1}


def test_a_group_counted_before_its_span_is_known_moves_with_it():
    feed = Feed()
    feed(tr("a", "released", "waiting", 100.0, span_id=None))
    feed(tr("a", "waiting", "processing", 100.1), sp("S", ["late"], None, 99.0))
    assert feed.snapshot("S")["states"] == {"processing": 1}


# ------------------------------------------------------------ bookkeeping


def test_changes_and_unpublished_spans_are_the_trees_own_books():
    feed = Feed()
    tree = feed.tree
    feed(sp("P", ["p"], None, 1.0), sp("S", ["p", "s"], "P", 2.0))
    feed(*computed("a", 3.0, 4.0))
    spans, keys = tree.take_changed()
    assert set(spans) == {"P", "S"} and set(keys) == {"a"}
    assert tree.take_changed() == ({}, {})
    assert tree.take_unpublished() == {"P", "S"}
    assert tree.take_unpublished() == set()
    feed(*forgotten("a", 5.0))
    spans, keys = tree.take_changed()
    assert set(spans) == {"S"} and keys == {"a": None}
    # a child's change republishes its ancestors, which roll it up
    assert tree.take_unpublished() == {"P", "S"}
    tree.republish_all()
    assert tree.take_unpublished() == {"P", "S"}
    # a key born and forgotten between two checkpoints never reaches the changelog
    feed(*computed("b", 6.0, 7.0), *forgotten("b", 8.0))
    assert tree.take_changed()[1] == {}


# -------------------------------------------------------------- bad input


def _state_of(feed):
    return orjson.dumps([feed.tree.meta(), {s: v.to_record() for s, v in
                                            feed.tree.spans.items()},
                         feed.tree.registry], option=orjson.OPT_SORT_KEYS)


@pytest.mark.parametrize("event, field", [
    (sp("T", ["t"], "T", 1.0), "parent_id"),
    (sp("P", ["p"], "S", 1.0), "parent_id"),           # P is S's parent already
    (sp("Q", ["q"], "S", 1.0) | {"parent_id": "Q"}, "parent_id"),
    (sp("T", ["t"], None, "yesterday"), "enqueued"),
    (sp("T", "abc", None, 1.0), "name"),
    (sp(7, ["t"], None, 1.0), "span_id"),
    (tr("a", "processing", "memory", 5.0, startstops=[
        {"action": "compute", "start": -1e308, "stop": 1e308}]), "startstops[0]"),
    (tr("a", "processing", "memory", 5.0, startstops=[
        {"action": "compute", "start": 0, "stop": 1e300}]), "startstops[0]"),
    (tr("a", "processing", "memory", 5.0, startstops=[
        {"action": "compute", "start": "0", "stop": 1}]), "startstops[0]"),
    (tr("a", "processing", "memory", 5.0, nbytes=1.5, startstops=[]), "nbytes"),
    (tr("a", 3, "memory", 5.0), "start"),
    (tr(["a"], "processing", "memory", 5.0), "key"),
    (tr("new", "released", "waiting", 5.0, group=["g"]), "group"),
    ({"kind": "worker_digests", "ts": 1.0, "worker": "w",
      "digests": [["execute", "S", "inc", "thread-cpu", "seconds", "1"]]}, "digests[0]"),
    (lifecycle("worker_added", 5.0, [[5.0, "two"]]), "total_nthreads[0]"),
])
def test_bad_events_are_refused_and_change_nothing(event, field):
    feed = Feed()
    feed(sp("P", ["p"], None, 1.0), sp("S", ["p", "s"], "P", 2.0),
         tr("a", "released", "waiting", 3.0), tr("a", "waiting", "processing", 3.1))
    before = _state_of(feed)
    with pytest.raises(Rejected) as info:
        feed(event)
    assert info.value.field == field
    assert _state_of(feed) == before
    feed.snapshots()  # the tree is still whole: no cycle, nothing half-done


def test_a_cluster_publishes_refused_events_and_applies_the_rest():
    state = ClusterState("c1", 60.0, 1000)
    applied = state.apply(envelope(0, [
        sp("S", ["s"], None, 1.0), sp("S", ["s"], "S", 1.0),
        {"kind": "span", "ts": "noon", "span_id": "T", "name": ["t"],
         "parent_id": None, "enqueued": 1.0},
        {**sp("U", ["u"], None, 1.0), "enqueued": {"not": "a number"}},
        *computed("a", 2.0, 3.0)]))
    assert [(r.index, r.kind, r.field) for r in applied.rejected] == [
        (1, "span", "parent_id"), (2, "span", "ts"), (3, "span", "enqueued")]
    assert "event 1 (span): parent_id: a span cannot be its own parent" == \
        applied.rejected[0].describe()
    assert state.malformed_events == 3
    (snap,) = state.snapshots()
    assert snap["states"] == {"memory": 1} and snap["parent_id"] is None
    orjson.dumps(state.records())


# ------------------------------------------------------------ thread counts


def dask_span(history, enqueued, groups, parent=None):
    """Dask's own Span over a history written here, enqueued at ``enqueued``, with
    TaskGroups whose ``states``/``stop`` are set from ``groups``."""
    # Dask records the offset as the history length when the span is created
    created = [h for h in history if h[0] <= enqueued]
    s = DaskSpan(("x",), f"id{random.random()}", parent, created)
    s._total_nthreads_history = history
    s.enqueued = enqueued
    for states, stop in groups:
        tg = TaskGroup("g", TaskPrefix("g"))
        tg.states.update(states)
        tg.stop = stop
        s.groups.add(tg)
    return s


@pytest.mark.parametrize("seed", range(40))
def test_nthreads_intervals_are_dasks(seed):
    rng = random.Random(seed)
    t = 100.0
    history = [(t, 0)]
    for _ in range(rng.randrange(0, 8)):
        t += rng.choice([0.5, 1.0, 2.5])
        history.append((t, rng.randrange(0, 9)))
    enqueued = 100.0 + rng.uniform(0, t - 100 + 1)
    done = rng.random() < 0.7
    stop = enqueued + rng.uniform(0, 6)
    states = {"memory": 1} if done else {"memory": 1, "processing": 1}
    theirs = dask_span(history, enqueued, [(states, stop)])
    if not done:
        # Dask stops a running span at the current time; ours at the latest stop
        # seen: compare at the same stop
        theirs_intervals = nthreads_intervals(
            [h[0] for h in history], [h[1] for h in history], enqueued, stop, False)
        theirs_ref = _dask_intervals_at(theirs, stop)
        assert theirs_intervals == theirs_ref
        return
    ours = nthreads_intervals([h[0] for h in history], [h[1] for h in history],
                              enqueued, max(stop, enqueued), True)
    assert ours == [list(i) for i in theirs.nthreads_intervals]
    assert math.isclose(sum((b - a) * n for a, b, n in ours), theirs.active_cpu_seconds,
                        abs_tol=1e-12)


def _dask_intervals_at(span, now):
    """Dask's nthreads_intervals of a running span, read at time ``now``."""
    import distributed.spans as spans_module

    real = spans_module.time
    spans_module.time = lambda: now
    try:
        return [list(i) for i in span.nthreads_intervals]
    finally:
        spans_module.time = real


def test_thread_counts_and_idle_seconds_of_a_tree():
    feed = Feed()
    feed(lifecycle("scheduler_start", 99.0, [[99.0, 0], [99.5, 2]]))
    feed(sp("P", ["p"], None, 100.0), sp("C", ["p", "c"], "P", 101.0))
    feed(*computed("a", 101.5, 104.0, "c-1", "c", "C"))
    before = feed.snapshot("C")
    # a worker joins while C runs, then one leaves after it is done
    feed(lifecycle("worker_added", 102.0, [[102.0, 4]]))
    after = feed.snapshot("C")
    assert after["version"] > before["version"]
    assert after["nthreads_intervals"] == [[101.0, 102.0, 2], [102.0, 104.0, 4]]
    assert after["active_cpu_seconds"] == 2 + 8
    feed(lifecycle("worker_removed", 105.0, [[105.0, 2]]))
    assert feed.snapshot("C")["version"] == after["version"]  # after C stopped
    feed({"kind": "worker_digests", "ts": 105.0, "worker": "w", "digests": [
        ["execute", "C", "c", "thread-cpu", "seconds", 2.0],
        ["execute", "C", "c", "thread-noncpu", "seconds", 0.5],
        ["execute", "C", "c", "memory-read", "bytes", 1000]]})
    c, p = feed.snapshot("C"), feed.snapshot("P")
    metrics = {tuple(r[:-1]): r[-1] for r in c["cumulative_worker_metrics"]}
    assert metrics[IDLE_KEY] == 10 - 2.5
    # the parent covers 100..104 with its own enqueued
    assert p["nthreads_intervals"] == [[100.0, 102.0, 2], [102.0, 104.0, 4]]
    assert {tuple(r[:-1]): r[-1] for r in p["cumulative_worker_metrics"]}[IDLE_KEY] == \
        4 + 8 - 2.5
    # the same through Dask's own classes
    history = [(99.0, 0), (99.5, 2), (102.0, 4), (105.0, 2)]
    dp = dask_span(history, 100.0, [])
    dc = dask_span(history, 101.0, [({"memory": 1}, 104.0)], parent=dp)
    dp.children.append(dc)
    dc._cumulative_worker_metrics.update({
        ("execute", "c", "thread-cpu", "seconds"): 2.0,
        ("execute", "c", "thread-noncpu", "seconds"): 0.5,
        ("execute", "c", "memory-read", "bytes"): 1000})
    for ours, theirs in ((c, dc), (p, dp)):
        assert ours["nthreads_intervals"] == [list(i) for i in theirs.nthreads_intervals]
        assert ours["active_cpu_seconds"] == theirs.active_cpu_seconds
        assert {tuple(r[:-1]): r[-1] for r in ours["cumulative_worker_metrics"]} == \
            dict(theirs.cumulative_worker_metrics)


def test_without_a_history_there_are_no_thread_figures():
    feed = Feed()
    feed(sp("S", ["s"], None, 100.0), *computed("a", 101.0, 102.0))
    s = feed.snapshot("S")
    assert s["nthreads_intervals"] == [] and s["active_cpu_seconds"] == 0.0
    assert all(tuple(r[:-1]) != IDLE_KEY for r in s["cumulative_worker_metrics"])


# ------------------------------------------------------------- persistence


def _recover(log, cid="c1"):
    store = {}
    for key, value in log:
        if value is None:
            store.pop(key, None)
        else:
            store[key] = value
    entries = {parse_key(k)[1]: v for k, v in store.items()}
    rec = Journal.recover(cid, entries)
    return rec, ClusterState.from_records(cid, rec.records, 60.0, 1000)


def test_a_checkpoint_restores_the_same_state_with_its_thread_history():
    state, journal, log = ClusterState("c1", 60.0, 1000), Journal("c1"), []
    for i, events in enumerate([
            [lifecycle("scheduler_start", 1.0, [[1.0, 0], [1.5, 2]]),
             sp("P", ["p"], None, 2.0), sp("S", ["p", "s"], "P", 2.5)],
            computed("a", 3.0, 4.0), forgotten("a", 5.0),
            [lifecycle("worker_added", 6.0, [[6.0, 4]]), *computed("b", 6.5, 7.0)]]):
        state.apply(envelope(i, events))
        log += journal.commit(state.take_changes(), state.records, 0)
    _, recovered = _recover(log)
    assert recovered.records() == state.records() and not recovered.problems
    assert recovered.tree.nthreads_times == [1.0, 1.5, 6.0]
    recovered.tree.republish_all()
    state.tree.republish_all()
    strip = lambda snaps: sorted(  # noqa: E731
        ({k: v for k, v in s.items() if k != "updated_at"} for s in snaps),
        key=lambda s: s["span_id"])
    assert strip(recovered.snapshots()) == strip(state.snapshots())


def test_inline_checkpoints_recover_from_a_crash_at_any_message():
    """Checkpoints after every envelope, small ones carried in the marker (inline),
    larger ones as delta parts, then bases: for every cut of the changelog (a crash
    after message i) the recovered state, with the stream applied again (duplicates
    skipped by seq), is the uninterrupted one; and small checkpoints are one message."""
    sizes = {"part_bytes": 600, "compact_min_bytes": 6000, "compact_max_deltas": 4,
             "inline_bytes": 900}
    stream = [envelope(0, [lifecycle("scheduler_start", 1.0, [[1.0, 2]]),
                           sp("P", ["p"], None, 1.5), sp("S", ["p", "s"], "P", 1.6)])]
    for i in range(1, 40):
        events = computed(f"k{i}", 2.0 + i, 2.5 + i)
        if i % 3 == 0:
            events += forgotten(f"k{i - 1}", 3.0 + i)
        stream.append(envelope(i, events))
    state, journal, log, singles = ClusterState("c1", 60.0, 1000), Journal("c1", **sizes), [], 0
    kinds = set()
    for e in stream:
        state.apply(e)
        messages = journal.commit(state.take_changes(), state.records, 0)
        singles += len(messages) == 1
        kinds |= {parse_key(k)[1][0] for k, _ in messages}
        log += messages
    assert kinds == {"M", "D", "B"} and singles > len(stream) // 3, (kinds, singles)
    expected = state.records()
    for cut in range(len(log) + 1):
        store = {}
        for key, value in log[:cut]:
            if value is None:
                store.pop(key, None)
            else:
                store[key] = value
        rec = Journal.recover("c1", {parse_key(k)[1]: v for k, v in store.items()}, **sizes)
        recovered = (ClusterState("c1", 60.0, 1000) if rec.journal is None else
                     ClusterState.from_records("c1", rec.records, 60.0, 1000))
        assert not recovered.problems
        for e in stream:
            recovered.apply(e)
        assert recovered.records() == expected, f"crash after changelog message {cut}"
        if rec.journal is not None and cut == len(log):
            # the next checkpoint carries the recovered inline changes on
            again = rec.journal.commit(recovered.take_changes(), recovered.records, 0)
            rec2, twice = _recover(log + again)
            assert twice.records() == expected


# The changelog today's code (before record formats) wrote for OLD_STREAM, produced
# by dask-blackbox at commit 7388843 (stream_processors.checkpoint.Journal.commit of
# cluster.ClusterState.take_changes after each envelope).
OLD_STREAM = [
    envelope(0, [sp("P", ["outer"], None, 100.0), sp("S", ["outer", "inner"], "P", 100.5),
                 tr("a", "released", "waiting", 101.0),
                 tr("a", "waiting", "processing", 101.1)]),
    envelope(1, [tr("a", "processing", "memory", 102.0, nbytes=800,
                    startstops=[{"action": "compute", "start": 101.2, "stop": 101.9}]),
                 tr("b", "released", "waiting", 102.1, group="own-1", prefix="own",
                    span_id="P")]),
    envelope(0, [{"kind": "worker_digests", "ts": 103.0, "worker": "w",
                  "digests": [["execute", "S", "inc", "thread-cpu", "seconds", 0.5]]}],
             producer="w-1", source="worker"),
]
OLD_FORMAT_CHANGELOG = [
    (b'["c1","D",1,0]',
     b'[["m",{"name":"one","partition":null,"applied":1,"malformed_events":0,"closed_at":null,"producers":{"sched-1":["scheduler",0]},"windows":[{"sched-1":101.1},[["sched-1","S","inc",60.0,0,0,{"waiting":1,"processing":1},{},0,0,0]]],"tree":{"next_group":1,"unattributed":0,"overflowed":false,"groups":[[0,"inc-1","inc","S",1,null]]}}],["s:S",[["outer","inner"],"P",100.5,[],[{"released":0,"waiting":0,"processing":1},{},0,0,0.0,0.0],[],1]],["s:P",[["outer"],null,100.0,["S"],[{},{},0,0,0.0,0.0],[],1]],["k:a",[0,-1]]]'),
    (b'["c1","M"]',
     b'{"epoch":1,"partition":0,"base":null,"deltas":[[1,1]],"base_bytes":0,"delta_bytes":512}'),
    (b'["c1","D",2,0]',
     b'[["m",{"name":"one","partition":null,"applied":2,"malformed_events":0,"closed_at":null,"producers":{"sched-1":["scheduler",1]},"windows":[{"sched-1":102.1},[["sched-1","S","inc",60.0,0,1,{"waiting":1,"processing":1,"memory":1},{"compute":700000},800,0,700000],["sched-1","P","own",60.0,1,1,{"waiting":1},{},0,0,0]]],"tree":{"next_group":2,"unattributed":0,"overflowed":false,"groups":[[0,"inc-1","inc","S",1,null],[1,"own-1","own","P",1,null]]}}],["s:S",[["outer","inner"],"P",100.5,[],[{"released":0,"waiting":0,"processing":0,"memory":1},{"compute":700000},700000,800,101.2,101.9],[],2]],["s:P",[["outer"],null,100.0,["S"],[{"released":0,"waiting":1},{},0,0,0.0,0.0],[],2]],["k:a",[0,800]],["k:b",[1,-1]]]'),
    (b'["c1","M"]',
     b'{"epoch":2,"partition":0,"base":null,"deltas":[[1,1],[2,1]],"base_bytes":0,"delta_bytes":1219}'),
    (b'["c1","D",3,0]',
     b'[["m",{"name":"one","partition":null,"applied":3,"malformed_events":0,"closed_at":null,"producers":{"sched-1":["scheduler",1],"w-1":["worker",0]},"windows":[{"sched-1":102.1,"w-1":103.0},[["sched-1","S","inc",60.0,0,1,{"waiting":1,"processing":1,"memory":1},{"compute":700000},800,0,700000],["sched-1","P","own",60.0,1,1,{"waiting":1},{},0,0,0]]],"tree":{"next_group":2,"unattributed":0,"overflowed":false,"groups":[[0,"inc-1","inc","S",1,null],[1,"own-1","own","P",1,null]]}}],["s:S",[["outer","inner"],"P",100.5,[],[{"released":0,"waiting":0,"processing":0,"memory":1},{"compute":700000},700000,800,101.2,101.9],[["execute","inc","thread-cpu","seconds",0.5]],3]]]'),
    (b'["c1","M"]',
     b'{"epoch":3,"partition":0,"base":null,"deltas":[[1,1],[2,1],[3,1]],"base_bytes":0,"delta_bytes":1884}'),
]


def test_an_old_format_checkpoint_is_read_as_what_it_was():
    """Format 1 (positional span and group lists, no format anywhere) is read and
    converted: the state equals the one this build builds from the same stream, and
    checkpoints written on top of it (format 3, its changes inline in the marker, over
    format 1 deltas) recover."""
    rec, recovered = _recover(OLD_FORMAT_CHANGELOG)
    assert {fmt for fmt, _ in rec.records.values()} == {1}
    assert not recovered.problems
    fresh = ClusterState("c1", 60.0, 1000)
    for e in OLD_STREAM:
        fresh.apply(e)
    assert recovered.records() == fresh.records()

    more = envelope(2, [*computed("c", 104.0, 105.0)])
    recovered.apply(more)
    fresh.apply(more)
    log = OLD_FORMAT_CHANGELOG + rec.journal.commit(
        recovered.take_changes(), recovered.records, 0)
    rec2, again = _recover(log)
    assert {fmt for fmt, _ in rec2.records.values()} == {1, 3}
    assert again.records() == fresh.records() and not again.problems


def test_an_unreadable_record_is_refused_never_guessed():
    # a format-1 span row with a field more (what adding a field did before formats):
    # not silently shifted into the wrong attributes
    key, part = OLD_FORMAT_CHANGELOG[0]
    rows = orjson.loads(part)
    for row in rows:
        if row[0] == "s:S":
            row[1].insert(3, "new field")
    log = [(key, orjson.dumps(rows)), *OLD_FORMAT_CHANGELOG[1:2]]
    _, recovered = _recover(log)
    assert [(rk, "list of 7" in why) for rk, why in recovered.problems] == [("s:S", True)]
    assert "S" not in recovered.tree.spans or recovered.tree.spans["S"].name is None

    # a format this build does not know: a clear error, not a guess
    future = [(key, orjson.dumps({"format": 99, "records": rows})),
              *OLD_FORMAT_CHANGELOG[1:2]]
    with pytest.raises(UnknownFormat, match="format 99; this build reads formats 1, 2, 3"):
        _recover(future)
    marker = orjson.loads(OLD_FORMAT_CHANGELOG[1][1]) | {"format": 4}
    with pytest.raises(UnknownFormat, match="format 4"):
        _recover([OLD_FORMAT_CHANGELOG[0], (OLD_FORMAT_CHANGELOG[1][0], orjson.dumps(marker))])

    # an unreadable meta record: the whole state is refused, naming the record
    rows = [r for r in orjson.loads(part) if r[0] != "m"] + [["m", {"name": "x"}]]
    with pytest.raises(BadRecord, match="record m: .*KeyError"):
        _recover([(key, orjson.dumps(rows)), *OLD_FORMAT_CHANGELOG[1:2]])


def test_a_span_cycle_saved_by_an_older_build_is_cut_on_load():
    """Before spans were checked, a self-parent or two spans each other's parent
    were saved; loading such records cuts the links and reports each."""
    state, journal = ClusterState("c1", 60.0, 1000), Journal("c1")
    state.apply(envelope(0, [sp("A", ["a"], None, 1.0), sp("B", ["b"], None, 1.0),
                             sp("C", ["c"], None, 1.0), sp("D", ["c", "d"], "C", 1.5),
                             *computed("x", 2.0, 3.0, span_id="A")]))
    records = state.records()
    records["s:A"] |= {"parent_id": "B", "children": ["B"]}
    records["s:B"] |= {"parent_id": "A", "children": ["A"]}
    records["s:C"] |= {"parent_id": "C", "children": ["D", "C"]}
    log = journal.commit({}, lambda: records, 0, base=True)
    _, recovered = _recover(log)
    assert sorted(rk for rk, _ in recovered.problems) == ["s:A", "s:B", "s:C"]
    assert all("cycle" in why for _, why in recovered.problems)
    spans = recovered.tree.spans
    assert [spans[s].parent_id for s in "ABCD"] == [None, None, None, "C"]
    assert spans["C"].children == ["D"]
    recovered.tree.republish_all()
    snaps = {s["span_id"]: s for s in recovered.snapshots()}
    assert snaps["A"]["states"] == {"memory": 1}


def test_changelog_keys_name_the_cluster():
    assert parse_key(entry_key("c1", "D", 3, 0)) == ("c1", ("D", 3, 0))


def test_a_span_that_never_computed_has_no_cpu_but_the_idle_entry():
    """Dask: every task erred, so stop == enqueued: no interval, 0 CPU seconds, and
    still the derived entry (0)."""
    feed = Feed()
    feed(lifecycle("scheduler_start", 1.0, [[1.0, 2]]), sp("F", ["f"], None, 10.0))
    feed(tr("x", "released", "waiting", 11.0, span_id="F"),
         tr("x", "waiting", "processing", 11.1), tr("x", "processing", "erred", 11.2))
    f = feed.snapshot("F")
    assert (f["nthreads_intervals"], f["active_cpu_seconds"]) == ([], 0.0)
    assert f["cumulative_worker_metrics"] == [[*IDLE_KEY, 0.0]]
    dask = dask_span([(1.0, 2)], 10.0, [({"erred": 1}, 0.0)])
    assert dict(dask.cumulative_worker_metrics) == {IDLE_KEY: 0.0}
