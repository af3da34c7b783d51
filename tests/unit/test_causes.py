"""The rules that name a worker's cause of death, the alerter's watcher and its rule
settings, on facts and envelopes shaped as the producers send them (the real
clusters that plant each cause are in test_diagnosis.py; these pin the rules' order
and edge cases, fast)."""

from __future__ import annotations

import dask.config
import pytest

from dask_blackbox.alerts.settings import AlertSettings, Rule
from dask_blackbox.alerts.watch import Watcher
from dask_blackbox.causes import (
    Cause, Closing, Exit, MemoryKill, Removal, TtlTimeout, classify, gather,
)
from dask_blackbox.config import ConfigError

from dask_blackbox.testing.alerts import Cluster

T = 1_800_000_000.0
W = "tcp://10.0.0.1:4000"


def removal(**kw) -> Removal:
    base = dict(cluster_id="c", worker=W, ts=T, stimulus_id=f"handle-worker-cleanup-{T}",
                reason="handle-worker-cleanup", expected=False, processing_tasks=1, pid=42,
                nanny="tcp://10.0.0.1:5000", nanny_known=True, added=T - 100)
    base.update(kw)
    return Removal(**base)


def exit_(code: int, signal: str = "", ts: float = T + 0.1, **kw) -> Exit:
    return Exit(W, kw.pop("pid", 42), ts, code, signal, 10**8, 2 * 10**8, 2**30, 0.95, 2**34,
                2**33, kw.pop("status", "running"))


def verdict(r: Removal, **facts):
    return classify(gather(r, **facts))


@pytest.mark.parametrize("code, signal, cause", [
    (-11, "SIGSEGV", Cause.CRASHED), (-6, "SIGABRT", Cause.CRASHED), (-7, "SIGBUS", Cause.CRASHED),
    (-9, "SIGKILL", Cause.KILLED), (-15, "SIGTERM", Cause.KILLED),
    (3, "", Cause.EXITED), (0, "", Cause.EXITED),
])
def test_an_exit_alone_names_the_cause(code, signal, cause):
    v = verdict(removal(), exits=[exit_(code, signal)], nanny_records=True)
    assert v.cause is cause
    assert [e.source for e in v.evidence] == ["lifecycle", "worker_exits"]
    if code == 3:
        assert "status 3" in v.summary and v.confidence == "high"


def test_the_nannys_memory_kill_wins_over_the_sigterm_it_sent():
    v = verdict(removal(), exits=[exit_(-15, "SIGTERM")], memory_kills=[MemoryKill(W, 42, T - 0.02, 2**30)])
    assert v.cause is Cause.MEMORY_LIMIT and v.confidence == "high"
    assert "1.00 GiB of its 1.00 GiB limit" in v.summary
    # a memory kill of another process (another pid) on the same address says nothing
    v = verdict(removal(), exits=[exit_(-9, "SIGKILL")], memory_kills=[MemoryKill(W, 41, T - 50, 2**30)])
    assert v.cause is Cause.KILLED


def test_worker_ttl_then_the_nannys_sigkill_is_stopped_responding():
    v = verdict(removal(), exits=[exit_(-9, "SIGKILL")], ttls=[TtlTimeout(T - 4, (W,), 5.0)])
    assert v.cause is Cause.UNRESPONSIVE and "SIGKILL" in v.summary
    # without a nanny, Dask removes it itself under the worker-ttl stimulus
    v = verdict(removal(stimulus_id=f"check-worker-ttl-{T}", reason="check-worker-ttl", nanny=None))
    assert v.cause is Cause.UNRESPONSIVE


def test_expected_ends():
    assert verdict(removal(expected=True)).cause is Cause.EXPECTED  # retire_workers
    restart = verdict(removal(), exits=[exit_(0)], closings=[Closing(W, T - 0.01, f"client-restart-{T}")],
                      restarts=[T - 0.05])
    assert restart.cause is Cause.EXPECTED and "client.restart" in restart.summary
    # a restart asked for before the worker even joined does not explain its end
    late = verdict(removal(added=T - 1), exits=[exit_(0)], restarts=[T - 5], nanny_records=True)
    assert late.cause is Cause.EXITED
    closed = verdict(removal(), closings=[Closing(W, T - 0.01, "nanny-close")], nanny_records=True)
    assert closed.cause is Cause.EXPECTED and "nanny-close" in closed.summary
    # the nanny's plugin, torn down as its nanny closes, recorded the process still running
    closing = Exit(W, 42, T - 0.2, None, "", nanny_status="closing")
    by_nanny = verdict(removal(), exits=[closing], closes=[T + 0.3], nanny_records=True)
    assert by_nanny.cause is Cause.EXPECTED and "nanny was closing" in by_nanny.summary
    assert any("still running as its nanny closed" in e.text for e in by_nanny.evidence)
    # a clean exit, the scheduler closing right after: expected
    assert verdict(removal(), exits=[exit_(0)], closes=[T + 0.3]).cause is Cause.EXPECTED
    # the scheduler closing (or a restart) soon after, alone, does not make a removal Dask
    # did not expect an expected one: without the nanny's record it is unknown
    for facts in (dict(closes=[T + 0.3]), dict(closes=[T + 9]), dict(restarts=[T - 1])):
        alone = verdict(removal(), nanny_records=True, **facts)
        assert alone.cause is Cause.UNKNOWN and "no nanny record" in alone.summary, facts
        assert "Dask did not expect it" in alone.summary
    # ... but a crash a moment before the close is still a crash
    assert verdict(removal(), exits=[exit_(-11, "SIGSEGV")], closes=[T + 0.3]).cause is Cause.CRASHED


def test_a_worker_stopped_by_a_signal_from_outside_was_killed():
    # `dask worker` closes cleanly on SIGTERM; its nanny's plugin is gone by the end
    v = verdict(removal(), closings=[Closing(W, T - 0.01, "signal-15")], closes=[T + 7],
                nanny_records=True)
    assert v.cause is Cause.KILLED and "SIGTERM" in v.summary


def test_connection_lost_and_unknown_say_what_is_missing():
    lived_on = verdict(removal(), exits=[exit_(0, ts=T + 30)], nanny_records=True)
    assert lived_on.cause is Cause.CONNECTION_LOST and "30s" in lived_on.summary
    broke = verdict(removal(), closings=[Closing(W, T, "worker-handle-scheduler-connection-broken")])
    assert broke.cause is Cause.CONNECTION_LOST
    # the cluster's nannies record, but none recorded this process's end: a process
    # that died before its nanny's plugin watched it looks the same as one alive
    # behind a broken connection
    unseen = verdict(removal(), nanny_records=True)
    assert unseen.cause is Cause.UNKNOWN and unseen.confidence == "low"
    assert "no nanny record" in unseen.summary and "handle-worker-cleanup" in unseen.summary
    no_nanny = verdict(removal(nanny=None), nanny_records=True)
    assert no_nanny.cause is Cause.UNKNOWN and "had no nanny" in no_nanny.summary
    silent = verdict(removal(), nanny_records=False)
    assert silent.cause is Cause.UNKNOWN and "no nanny record" in silent.summary


def sigkilled(peak: int, limit: int, available: int, total: int = 2**34) -> Exit:
    return Exit(W, 42, T + 0.1, -9, "SIGKILL", peak, peak, limit, 0.95, total, available, "running")


def test_a_sigkill_names_the_oom_killer_only_when_memory_points_at_it():
    far = verdict(removal(), exits=[sigkilled(80 * 2**20, 12 * 2**30, 22 * 2**30, 24 * 2**30)])
    assert far.cause is Cause.KILLED
    assert far.explanation.startswith("not memory: peak 80.00 MiB of its 12.00 GiB limit")
    assert "something outside Dask sent SIGKILL" in far.summary and "OOM" not in far.summary
    near = verdict(removal(), exits=[sigkilled(int(0.9 * 2**30), 2**30, 2**33)])
    assert "near its memory limit" in near.summary and "OOM killer" in near.summary
    short = verdict(removal(), exits=[sigkilled(2**28, 2**32, 2**29)])
    assert "host short of memory" in short.summary and "OOM killer" in short.summary
    between = verdict(removal(), exits=[sigkilled(int(0.6 * 2**30), 2**30, 2**33)])
    assert "not ruled out" in between.summary and "not memory" not in between.summary
    unsampled = verdict(removal(), exits=[Exit(W, 42, T + 0.1, -9, "SIGKILL")])
    assert "not sampled" in unsampled.summary


def test_the_exit_is_matched_by_pid_before_address():
    other = exit_(-11, "SIGSEGV", pid=41, ts=T - 20)  # an earlier process on this address
    mine = exit_(3, pid=42)
    assert verdict(removal(), exits=[other, mine]).cause is Cause.EXITED
    # without pids (an older recording), the exit of that address nearest the removal
    assert verdict(removal(pid=None), exits=[exit_(3, pid=None)]).cause is Cause.EXITED


# ------------------------------------------------------------------- watcher

def rules(**extra) -> tuple[Rule, ...]:
    raw = [{"name": "deaths", "when": "worker-died", "webhook": "http://127.0.0.1:9/h"},
           {"name": "oom", "when": "worker-died", "causes": ["memory-limit"], "command": "true"},
           {"name": "kw", "when": "killed-worker", "webhook": "http://127.0.0.1:9/h"},
           {"name": "loads", "when": "task-erred", "prefix": "load", "webhook": "http://127.0.0.1:9/h"},
           {"name": "nightly", "when": "task-erred", "span": "nightly", "command": ["true"]}]
    return tuple(Rule.parse(r, i) for i, r in enumerate(raw))


def test_a_removal_waits_for_its_exit_then_settles():
    c = Cluster()
    w = Watcher(rules(), evidence_wait=2.0)
    (added, _), (removed, _), (exited, _) = c.death("tcp://w:1", 11, -11, key="x-1")
    w.feed(added, 100.0)
    w.feed(removed, 100.0)
    w.tick(100.5)
    assert w.take() == [] and w.waiting() == 1  # no exit yet, evidence-wait not over
    w.feed(exited, 100.6)
    w.tick(100.7)
    assert w.take() == []  # settling
    w.tick(101.0)
    [incident] = w.take()
    assert incident.rule == "deaths" and incident.detail["cause"] == "crashed"
    assert incident.detail["tasks"] == ["x-1"]
    assert incident.id == f"deaths|{c.id}|worker-died|tcp://w:1|{removed['events'][-1]['stimulus_id']}"


def test_a_removal_without_a_nanny_is_decided_after_evidence_wait():
    c = Cluster()
    w = Watcher(rules(), evidence_wait=2.0)
    for env, _ in c.death("tcp://w:2", 12, -9, nanny=False):
        w.feed(env, 10.0)
    w.tick(11.9)
    assert w.take() == []
    w.tick(12.0)
    [incident] = w.take()
    assert incident.detail["cause"] == "unknown" and "no nanny" in incident.summary


def test_memory_kill_killed_worker_and_erred_prefix_and_span():
    c = Cluster()
    w = Watcher(rules(), evidence_wait=2.0)
    w.feed(c.envelope([c.span("s1", ["nightly", "load"])]), 0.0)
    for env, _ in c.death("tcp://w:3", 13, -15, key="hog-1", memory=True):
        w.feed(env, 1.0)
    w.tick(1.5)
    first = sorted(i.rule for i in w.take())
    assert first == ["deaths", "oom"]
    stim = "handle-worker-cleanup-final"
    w.feed(c.envelope([c.added("tcp://w:4", 14)]), 2.0)
    w.feed(c.envelope([
        c.memory_kill("tcp://w:4", 14),
        c.transition("hog-1", "processing", "erred", stim, worker="tcp://w:4",
                     exception="KilledWorker: Attempted to run task 'hog-1' on 2 different workers"),
        c.removed("tcp://w:4", stim)]), 2.0)
    w.tick(2.1)
    # the erred KilledWorker task also matches neither erred rule (prefix hog, no span)
    assert w.take() == []  # the KilledWorker waits for its last death's verdict
    w.feed(c.envelope([c.exited("tcp://w:4", 14, -15)], "nanny"), 2.2)
    w.tick(2.6)
    got = {i.rule: i for i in w.take()}
    assert set(got) == {"deaths", "oom", "kw"}
    assert [d["cause"] for d in got["kw"].detail["deaths"]] == ["memory-limit", "memory-limit"]
    w.feed(c.envelope([
        c.transition("load-7", "processing", "erred", "task-erred-1", exception="OSError: gone"),
        c.transition("agg-1", "processing", "erred", "task-erred-2", span_id="s1",
                     exception="ValueError: bad"),
        c.transition("agg-2", "waiting", "erred", "task-erred-2", span_id="s1")]), 3.0)
    got = sorted((i.rule, i.detail["key"]) for i in w.take())
    assert got == [("loads", "load-7"), ("nightly", "agg-1")]  # a dependent's erred: no incident


def test_the_watchers_state_survives_a_restart():
    c = Cluster()
    w = Watcher(rules(), evidence_wait=2.0)
    (added, _), (removed, _), (exited, _) = c.death("tcp://w:5", 15, 3, key="x-5")
    w.feed(added, 1.0)
    w.feed(removed, 1.0)
    import orjson

    state = orjson.loads(orjson.dumps(w.state()))
    again = Watcher(rules(), evidence_wait=2.0)
    again.restore(state)
    again.feed(exited, 5.0)
    again.tick(6.0)
    [incident] = again.take()
    assert incident.detail["cause"] == "exited" and incident.detail["tasks"] == ["x-5"]


def test_unreadable_events_are_counted_never_raised():
    c = Cluster()
    w = Watcher(rules())
    w.feed(c.envelope([{"kind": "transition_run", "ts": 1.0, "key": "not a list"},
                       {"kind": "lifecycle", "ts": "soon", "action": "worker_removed"},
                       {"kind": "worker_exit", "ts": 1.0}]), 1.0)
    w.tick(10.0)
    assert sum(w.unreadable.values()) >= 2


# ------------------------------------------------------------------ settings

@pytest.mark.parametrize("rule, message", [
    ({"name": "x", "when": "worker-died"}, "exactly one of webhook"),
    ({"name": "x", "when": "worker-died", "causes": ["oom"], "command": "true"}, "rules[0] (x).causes"),
    ({"name": "x", "when": "died", "command": "true"}, "when: 'died' must be one of"),
    ({"name": "x", "when": "task-erred", "command": "true"}, "names a prefix or a span"),
    ({"name": "x", "when": "worker-died", "webhook": "ftp://h/x"}, "http:// or https:// URL"),
    ({"name": "x y", "when": "worker-died", "command": "true"}, "rules[0].name"),
    ({"name": "x", "when": "worker-died", "command": "true", "colour": "red"}, "unknown key(s) colour"),
])
def test_a_bad_rule_is_one_line_naming_it(rule, message):
    with dask.config.set({"blackbox.alerts.rules": [rule]}):
        with pytest.raises(ConfigError, match=None) as e:
            AlertSettings.from_config()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_killed_workers_chain_spans_more_than_the_fact_window():
    """The first death of a KilledWorker's chain may be long before its last one."""
    import time as _time

    c = Cluster()
    w = Watcher(rules(), evidence_wait=1.0)
    t0 = _time.time()
    w.feed(c.envelope([c.added("tcp://w:7", 17, ts=t0)]), 1.0)
    w.feed(c.envelope([c.transition("slow-1", "processing", "released", "handle-worker-cleanup-a", ts=t0 + 1),
                       c.removed("tcp://w:7", "handle-worker-cleanup-a", ts=t0 + 1)]), 1.0)
    w.feed(c.envelope([c.exited("tcp://w:7", 17, -11, ts=t0 + 1.1)], "nanny"), 1.0)
    w.tick(2.0)
    w.take()
    later = t0 + 3600  # an hour of other work: every fact of the first death is stale
    w.feed(c.envelope([c.added("tcp://w:8", 18, ts=later)]), 3.0)
    w.feed(c.envelope([
        c.transition("slow-1", "processing", "erred", "handle-worker-cleanup-b", ts=later + 1,
                     exception="KilledWorker: Attempted to run task 'slow-1' on 2 different workers"),
        c.removed("tcp://w:8", "handle-worker-cleanup-b", ts=later + 1)]), 3.0)
    w.feed(c.envelope([c.exited("tcp://w:8", 18, -11, ts=later + 1.1)], "nanny"), 3.0)
    w.tick(4.0)
    [kw] = [i for i in w.take() if i.rule == "kw"]
    assert [d["worker"] for d in kw.detail["deaths"]] == ["tcp://w:7", "tcp://w:8"]
    assert [d["cause"] for d in kw.detail["deaths"]] == ["crashed", "crashed"]


def test_workers_there_before_the_recording_are_known_from_scheduler_start():
    c = Cluster()
    w = Watcher(rules(), evidence_wait=1.0)
    start = {"kind": "lifecycle", "ts": 1.0, "action": "scheduler_start", "worker": None,
             "client": None, "reason": None, "stimulus_id": None,
             "detail": {"workers": {"tcp://w:9": {"name": "0", "nthreads": 1, "pid": 19, "nanny": None}}}}
    w.feed(c.envelope([start]), 1.0)
    w.feed(c.envelope([c.removed("tcp://w:9", "handle-worker-cleanup-x", processing=0)]), 1.0)
    w.tick(2.5)
    [incident] = w.take()
    assert incident.detail["cause"] == "unknown" and "had no nanny" in incident.summary
    assert incident.detail["pid"] == 19
