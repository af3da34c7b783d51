"""The continuous exporter's journal (exporters/journal.py) on contract records, with
no broker and no receiver: what it derives is the trace ``export otlp`` builds from
the same records (exporters.traces.build_run: same ids, names, times, attributes and
events), whenever the spans finish; a run past the cap is summarised the same way; a
resent envelope adds nothing; a snapshot after its span was exported is counted late;
a second exporter on the same journal is refused. Reopening the journal after a
"crash" (closing it mid-way) keeps offsets and the outbox. A worker's death is an
event only when the rules of dask_blackbox.causes, given the facts every source sent
(the nanny's record of the process's end, a restart), say it was one, and it carries
their cause."""

from __future__ import annotations

import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.causes import Cause, Classified, Exit, Removal, classify, gather
from dask_blackbox.exporters import traces
from dask_blackbox.exporters.journal import Journal, JournalBusy, Record

T0 = 1_790_000_000.0
CLUSTER = "Scheduler-journal"


def envelope(seq: int, events: list, source: str = "scheduler") -> dict:
    return {"schema": contract.SCHEMA_VERSION, "cluster_id": CLUSTER, "cluster_name": "journal",
            "source": source, "producer_id": f"{source}-1", "seq": seq, "sent_at": T0 + seq,
            "events": events}


def transition(key, finish, t, span_id, actions=(), **extra):
    return {"kind": "transition", "ts": t, "key": key, "prefix": key.split("-")[0],
            "group": key, "span_id": span_id, "start": "processing", "finish": finish,
            "stimulus_id": f"s-{key}", "worker": "tcp://w:1", "nbytes": 8, "typename": "int",
            "startstops": [{"action": a, "start": s, "stop": e} for a, s, e in actions] or None,
            "exception": None, "traceback": None, "cause": None, **extra}


def span_state(span_id, name, parent, version, done, start, stop, tasks):
    return {"cluster_id": CLUSTER, "cluster_name": "journal", "span_id": span_id, "name": name,
            "parent_id": parent, "version": version, "enqueued": T0, "start": start,
            "stop": stop, "duration": stop - start, "nbytes_total": 8 * tasks,
            "states": {"memory": tasks}, "all_durations": {"compute": stop - start},
            "cumulative_worker_metrics": [], "done": done, "updated_at": T0,
            "nthreads_intervals": [], "active_cpu_seconds": 1.0}


#: the records' removal (its worker never seen joining), and its verdict by the rules:
#: no nanny recorded anything, so how its process ended is unknown (a death)
REMOVAL = Removal(CLUSTER, "tcp://w:2", T0 + 9, "handle-worker-cleanup-1",
                  "worker-handle-scheduler-connection-broken", False, processing_tasks=2)
REMOVALS = [Classified(REMOVAL, classify(gather(REMOVAL, closes=[T0 + 30])))]


def records():
    """(raw envelopes, span states, the transitions and lifecycle events in them)."""
    trs = [transition(f"inc-{i}", "memory", T0 + 1 + i, "s-load",
                      [("transfer", T0 + i, T0 + i + 0.25), ("compute", T0 + i + 0.25, T0 + 1 + i)])
           for i in range(6)]
    trs.append(transition("div-0", "erred", T0 + 8, "s-fail", [("compute", T0 + 7.5, T0 + 8)],
                          exception="ZeroDivisionError('division by zero')", traceback="tb",
                          cause="div-0"))
    death = {"kind": "lifecycle", "ts": T0 + 9, "action": "worker_removed", "worker": "tcp://w:2",
             "client": None, "reason": "worker-handle-scheduler-connection-broken",
             "stimulus_id": "handle-worker-cleanup-1", "detail": {"expected": False,
                                                                  "processing_tasks": 2}}
    close = {"kind": "lifecycle", "ts": T0 + 30, "action": "scheduler_close", "worker": None,
             "client": None, "reason": None, "stimulus_id": None, "detail": None}
    log = {"kind": "log", "ts": T0 + 3, "logger": "distributed.worker", "level": "WARNING",
           "message": "careful", "process": "tcp://w:1", "exc_text": None}
    raw = [envelope(0, trs[:3] + [log]), envelope(1, trs[3:] + [death]), envelope(2, [close])]
    states = [span_state("s-etl", ["etl"], None, 1, False, T0, T0 + 3, 3),
              span_state("s-load", ["etl", "load"], "s-etl", 1, False, T0, T0 + 3, 3),
              span_state("s-load", ["etl", "load"], "s-etl", 2, True, T0, T0 + 7, 6),
              span_state("s-etl", ["etl"], None, 2, True, T0, T0 + 7, 6),
              span_state("s-fail", ["failing"], None, 1, True, 0.0, 0.0, 1)]
    return raw, states, trs, [death, close]


def as_records(raw, states):
    out = [Record("raw", "bb.raw", 0, i, orjson.loads(orjson.dumps(e))) for i, e in enumerate(raw)]
    out += [Record("span-state", "bb.span-state", 1, i, s) for i, s in enumerate(states)]
    return out


def outbox(journal):
    """Every item waiting in the outbox, in order."""
    from dask_blackbox.exporters.model import decode

    return [decode(item) for item, in journal.db.execute("SELECT item FROM outbox ORDER BY seq")]


def sent(journal):
    return {item.span.span_id: item.span for item in outbox(journal) if item.span}


@pytest.mark.parametrize("cap", [100, 4])
def test_the_journal_derives_the_trace_export_otlp_builds(tmp_path, cap):
    raw, states, trs, lifecycle = records()
    journal = Journal(tmp_path / "j", max_task_spans=cap)
    applied = journal.apply(as_records(raw, states), now=100.0)
    assert applied.task_spans == min(cap, 13) and applied.summarised == 13 - min(cap, 13)
    assert applied.logs == 1
    assert journal.offsets() == {("bb.raw", 0): 3, ("bb.span-state", 1): 5}
    # not yet: closed at T0 + 30, but the cluster's records arrived just now
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=101.0) == 0
    moved = journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=106.0)
    got = sent(journal)
    finals = {s["span_id"]: s for s in states}  # the latest version of each
    expected = {s.span_id: s for s in traces.build_run(CLUSTER, "journal", finals.values(),
                                                       trs, lifecycle, cap, removals=REMOVALS)}
    # the Dask spans, the summaries and the run span waited for the run's end
    assert moved == sum(1 for s in expected.values() if "dask.task.key" not in s.attributes)
    assert set(got) == set(expected)
    for span_id, want in expected.items():
        assert got[span_id] == want, want.name
    [run] = [s for s in got.values() if s.parent_id is None]
    assert [e.name for e in run.events] == ["dask.worker.death"] + (
        ["dask.task_spans.capped"] if cap < 13 else [])
    assert run.events[0].attributes["dask.worker.death.cause"] == Cause.UNKNOWN.value
    logs = [item.log for item in outbox(journal) if item.log]
    # a request carries one signal: the oldest items up to the first of another kind
    first = journal.pending(10_000)
    assert len({item.log is None for _, item in first}) == 1
    assert [log.body for log in logs] == ["careful"] and logs[0].trace_id == run.trace_id


def test_quiet_spans_late_snapshots_resends_and_restarts(tmp_path):
    raw, states, trs, _ = records()
    journal = Journal(tmp_path / "j", max_task_spans=100)
    journal.apply(as_records(raw[:2], states[:4]), now=100.0)  # no close yet
    with pytest.raises(JournalBusy, match="another exporter owns the journal"):
        Journal(tmp_path / "j", max_task_spans=100)
    # done and quiet for span-quiet: exported before the run ends
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=60, now=130.0) == 0
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=60, now=161.0) == 2
    names = {s.name for s in sent(journal).values()}
    assert {"etl", "load"} <= names and "run journal" not in names
    # a resent envelope adds nothing; a later snapshot of an exported span is late
    later = span_state("s-load", ["etl", "load"], "s-etl", 3, True, T0, T0 + 9, 7)
    again = journal.apply([Record("raw", "bb.raw", 0, 5, orjson.loads(orjson.dumps(raw[1]))),
                           Record("span-state", "bb.span-state", 1, 9, later)], now=170.0)
    assert again.task_spans == 0 and again.skipped == 1 and again.late == 1
    backlog = journal.backlog()
    journal.close()  # a crash between transactions loses nothing journalled
    journal = Journal(tmp_path / "j", max_task_spans=100)
    assert journal.backlog() == backlog
    assert journal.offsets() == {("bb.raw", 0): 6, ("bb.span-state", 1): 10}
    # no scheduler_close: the run ends after idle-timeout
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=60, now=3000.0) == 0
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=60, now=3771.0) == 1
    [run] = [s for s in sent(journal).values() if s.parent_id is None]
    # the erred task's span was never described: its exception goes to the run
    assert [e.name for e in run.events] == ["exception", "dask.worker.death"]
    assert run.error == "1 worker(s) died"
    done = [seq for seq, _ in journal.pending(5)]
    journal.done(done)
    assert journal.backlog() == backlog + 1 - len(done)
    journal.close()


def test_a_span_keeps_its_first_events_and_counts_the_rest():
    """However many tasks of a span erred, its span stays a small request."""
    erred = [transition(f"div-{i}", "erred", T0 + i, "s-fail", exception="E('x' * 16384)",
                        traceback="t" * 16384) for i in range(300)]
    [state] = [s for s in records()[1] if s["span_id"] == "s-fail"]
    spans = traces.build_run(CLUSTER, "journal", [state], erred, [], 10, removals=[])
    [failing] = [s for s in spans if s.name == "failing"]
    assert len(failing.events) == traces.MAX_EVENTS
    assert failing.attributes["dask.events.dropped"] == 300 - traces.MAX_EVENTS
    assert failing.events[0].attributes["dask.task.key"] == "div-0"  # the earliest kept
    assert failing.error == "300 task(s) erred"


def lifecycle_event(ts, action, worker=None, stimulus_id=None, reason=None, detail=None):
    return {"kind": "lifecycle", "ts": ts, "action": action, "worker": worker, "client": None,
            "reason": reason, "stimulus_id": stimulus_id, "detail": detail}


def worker_exit(ts, worker, pid, exitcode, signal):
    return {"kind": "worker_exit", "ts": ts, "worker": worker, "pid": pid, "exitcode": exitcode,
            "signal": signal, "memory": None, "memory_peak": None, "memory_limit": None,
            "memory_terminate": None, "host_memory": None, "host_memory_available": None,
            "nanny_status": "running"}


def test_a_death_is_an_event_with_the_cause_of_every_sources_facts(tmp_path):
    """A SIGKILLed worker (its nanny's record) is killed, a worker a client.restart()
    took down is no death, a worker gone with no end of its process is a lost
    connection: the causes the rules give the same facts. The facts survive a restart
    of the exporter; a removal the cluster's events are FACT_WINDOW_S past is
    classified then, and its facts forgotten."""
    def joined(t, worker, pid):
        return lifecycle_event(t, "worker_added", worker, detail={"pid": pid,
                                                                  "nanny": worker.replace("w", "n")})

    def removed(t, worker, stimulus, expected=False, tasks=0):
        return lifecycle_event(t, "worker_removed", worker, stimulus, stimulus.rsplit("-", 1)[0],
                               {"expected": expected, "processing_tasks": tasks})

    first = [envelope(0, [joined(T0, f"tcp://w:{i}", 100 + i) for i in (1, 2, 3)]
                      + [removed(T0 + 10, "tcp://w:1", "handle-worker-cleanup-1", tasks=2),
                         lifecycle_event(T0 + 20, "restart"),
                         removed(T0 + 21, "tcp://w:2", "handle-worker-cleanup-2")]),
             envelope(0, [worker_exit(T0 + 10.2, "tcp://w:1", 101, -9, "SIGKILL"),
                          worker_exit(T0 + 21.5, "tcp://w:2", 102, 0, "")], source="nanny")]
    second = [envelope(1, [removed(T0 + 400, "tcp://w:3", "handle-worker-cleanup-3"),
                           lifecycle_event(T0 + 420, "scheduler_close")])]
    journal = Journal(tmp_path / "j", max_task_spans=100)
    journal.apply(as_records(first, []), now=100.0)
    journal.close()  # the facts are journalled: a restarted exporter has them
    journal = Journal(tmp_path / "j", max_task_spans=100)
    journal.apply([Record("raw", "bb.raw", 0, 2, orjson.loads(orjson.dumps(second[0])))], now=101.0)
    # the first two removals lie FACT_WINDOW_S behind the newest event: classified now,
    # and the facts about them forgotten
    assert sorted(k for k, in journal.db.execute("SELECT kind FROM events")) == ["death", "removal"]
    [(state,)] = journal.db.execute("SELECT state FROM death_facts").fetchall()
    assert orjson.loads(state)["exits"] == [] and orjson.loads(state)["restarts"] == []
    journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=110.0)
    assert journal.db.execute("SELECT count() FROM death_facts").fetchone() == (0,)
    [run] = [s for s in sent(journal).values() if s.parent_id is None]

    exits = [Exit("tcp://w:1", 101, T0 + 10.2, -9, "SIGKILL", nanny_status="running"),
             Exit("tcp://w:2", 102, T0 + 21.5, 0, "", nanny_status="running")]
    removals = [Removal(CLUSTER, f"tcp://w:{i}", T0 + t, f"handle-worker-cleanup-{i}",
                        "handle-worker-cleanup", False, tasks, 0, 0, 100 + i, f"tcp://n:{i}",
                        True, T0) for i, t, tasks in ((1, 10, 2), (2, 21, 0), (3, 400, 0))]
    classified = [Classified(r, classify(gather(r, exits, restarts=[T0 + 20], closes=[T0 + 420],
                                                nanny_records=True))) for r in removals]
    assert [c.verdict.cause for c in classified] == [Cause.KILLED, Cause.EXPECTED,
                                                     Cause.UNKNOWN]
    lifecycle = [ev for env in first + second for ev in env["events"] if ev["kind"] == "lifecycle"]
    [want] = [s for s in traces.build_run(CLUSTER, "journal", [], [], lifecycle, 100, removals=classified)
              if s.parent_id is None]
    assert run == want
    assert [(e.attributes["dask.worker.address"], e.attributes["dask.worker.death.cause"],
             e.attributes["dask.worker.death.cause_label"]) for e in run.events] == [
        ("tcp://w:1", "killed", "killed by the OS"), ("tcp://w:3", "unknown", "unknown")]
    assert run.events[0].attributes["dask.worker.processing_tasks"] == 2
    assert "SIGKILL" in run.events[0].attributes["dask.worker.death.explanation"]
    assert run.error == "2 worker(s) died"
    journal.close()


def test_the_tasks_a_death_took_out_of_processing_are_died_spans(tmp_path):
    """Two tasks running on a worker that died leave processing with its removal's
    stimulus: a ``died`` span each, from when it last entered processing to that
    transition, the same the trace ``export otlp`` builds; a task stolen before (it
    left processing with another stimulus) and a task that finished are none, and so
    are the tasks a removal that was no death (a restart) took. The journal's
    bookkeeping is gone once the run ended."""
    def move(key, start, finish, t, stimulus):
        return transition(key, finish, t, "s-load", start=start, stimulus_id=stimulus)

    def removed(t, worker, stimulus, expected):
        return lifecycle_event(t, "worker_removed", worker, stimulus, stimulus.rsplit("-", 1)[0],
                               {"expected": expected, "processing_tasks": 2})

    events = [move("inc-0", "waiting", "processing", T0 + 1, "u"),
              move("inc-1", "waiting", "processing", T0 + 1.5, "u"),
              move("inc-2", "waiting", "processing", T0 + 1.6, "u"),
              move("inc-3", "waiting", "processing", T0 + 1.7, "u"),
              move("inc-1", "processing", "released", T0 + 2, "steal-1"),  # stolen
              move("inc-1", "released", "waiting", T0 + 2, "steal-1"),
              move("inc-1", "waiting", "processing", T0 + 3, "steal-1"),  # its last entry
              move("inc-3", "processing", "memory", T0 + 3.5, "done-3"),
              move("inc-0", "processing", "released", T0 + 9, "handle-worker-cleanup-1"),
              move("inc-1", "processing", "released", T0 + 9, "handle-worker-cleanup-1"),
              removed(T0 + 9.1, "tcp://w:1", "handle-worker-cleanup-1", False),
              move("inc-2", "processing", "released", T0 + 20, "handle-worker-cleanup-2"),
              removed(T0 + 20.1, "tcp://w:2", "handle-worker-cleanup-2", True),
              lifecycle_event(T0 + 30, "scheduler_close")]
    journal = Journal(tmp_path / "j", max_task_spans=100)
    journal.apply(as_records([envelope(0, events)], []), now=100.0)
    journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=110.0)
    died = {s.attributes["dask.task.key"]: s for s in sent(journal).values()
            if s.attributes.get("dask.task.action") == "died"}
    assert sorted(died) == ["inc-0", "inc-1"]
    assert [(died[k].start_ns, died[k].end_ns) for k in ("inc-0", "inc-1")] == [
        (traces.ns(T0 + 1), traces.ns(T0 + 9)), (traces.ns(T0 + 3), traces.ns(T0 + 9))]
    assert {s.attributes["dask.worker.address"] for s in died.values()} == {"tcp://w:1"}
    assert {s.name for s in died.values()} == {"died inc"}
    assert all(s.error.startswith("running when its worker died: ") for s in died.values())
    # the same spans the trace of the same records read back has
    transitions = [ev for ev in events if ev["kind"] == "transition"]
    lifecycle = [ev for ev in events if ev["kind"] == "lifecycle"]
    removals = [Classified(r, classify(gather(r, closes=[T0 + 30]))) for r in (
        Removal(CLUSTER, "tcp://w:1", T0 + 9.1, "handle-worker-cleanup-1",
                "handle-worker-cleanup", False, 2),
        Removal(CLUSTER, "tcp://w:2", T0 + 20.1, "handle-worker-cleanup-2",
                "handle-worker-cleanup", True, 2))]
    left = [traces.LeftProcessing("inc-0", "inc", "inc-0", "s-load", "handle-worker-cleanup-1",
                                  T0 + 1, T0 + 9),
            traces.LeftProcessing("inc-1", "inc", "inc-1", "s-load", "handle-worker-cleanup-1",
                                  T0 + 3, T0 + 9),
            traces.LeftProcessing("inc-2", "inc", "inc-2", "s-load", "handle-worker-cleanup-2",
                                  T0 + 1.6, T0 + 20)]
    want = {s.span_id: s for s in traces.build_run(CLUSTER, "journal", [], transitions, lifecycle,
                                                   100, removals=removals, left=left)
            if s.attributes.get("dask.task.action") == "died"}
    assert {s.span_id: s for s in died.values()} == want
    for table in ("processing", "left_processing"):
        assert journal.db.execute(f"SELECT count() FROM {table}").fetchone() == (0,)
    journal.close()


def test_a_span_described_after_its_run_ended_still_goes_out(tmp_path):
    """The processors' snapshots of a span can trail the scheduler's close past the
    settle time: the span is exported on its own, under the run span, once its
    snapshots settled, from the latest; a snapshot after that is late."""
    raw, states, trs, lifecycle = records()
    journal = Journal(tmp_path / "j", max_task_spans=100)
    journal.apply(as_records(raw, [s for s in states if s["span_id"] != "s-load"]), now=100.0)
    journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=106.0)
    before = sent(journal)
    [run] = [s for s in before.values() if s.parent_id is None]
    [etl] = [s for s in before.values() if s.name == "etl"]
    assert "load" not in {s.name for s in before.values()}

    trailing = [s for s in states if s["span_id"] == "s-load"]
    applied = journal.apply([Record("span-state", "bb.span-state", 1, 10 + i, s)
                             for i, s in enumerate(trailing)], now=110.0)
    assert applied.late == 0
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=112.0) == 0
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=115.0) == 1
    [load] = [s for s in sent(journal).values() if s.name == "load"]
    assert load == traces.dask_span(CLUSTER, trailing[-1])
    assert load.parent_id == etl.span_id and load.trace_id == run.trace_id

    later = span_state("s-load", ["etl", "load"], "s-etl", 3, True, T0, T0 + 9, 7)
    again = journal.apply([Record("span-state", "bb.span-state", 1, 20, later)], now=120.0)
    assert again.late == 1
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=200.0) == 0


def test_quiet_time_counts_only_while_reading(tmp_path):
    """A run whose scheduler closed but whose last messages Kafka still held when the
    exporter stopped: reopened long after, the journal ends it only once reading has
    been quiet for ``settle`` (:meth:`Journal.reading`), and what arrives in between is
    in its run span, as in the trace ``export otlp`` builds from every record."""
    raw, states, trs, lifecycle = records()
    late = transition("inc-9", "memory", T0 + 31, "s-load", [("compute", T0 + 30.5, T0 + 31)])
    journal = Journal(tmp_path / "j", max_task_spans=100)
    journal.apply(as_records(raw, states), now=100.0)
    journal.close()  # stopped with the close journalled, the run's last envelope unread

    journal = Journal(tmp_path / "j", max_task_spans=100)
    journal.reading(now=500.0)  # restarted: nothing of the run read for 400 s
    assert journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=501.0) == 0
    journal.apply([Record("raw", "bb.raw", 0, 3, envelope(3, [late]))], now=502.0)
    journal.finish_ready(settle=5, idle_timeout=3600, span_quiet=None, now=508.0)
    [run] = [s for s in sent(journal).values() if s.parent_id is None]
    finals = {s["span_id"]: s for s in states}
    [want] = [s for s in traces.build_run(CLUSTER, "journal", finals.values(), trs + [late],
                                          lifecycle, 100, removals=REMOVALS) if s.parent_id is None]
    assert run == want
    assert run.attributes["dask.task_spans.exported"] == 14
    journal.close()
