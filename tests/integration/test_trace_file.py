"""``dask-blackbox trace``: the recorded run (tests/recording_support.py) as a Chrome
Trace Event Format file, checked against the format (every event's fields and types,
begin/end matched and nested, complete events never overlapping on a row, every
process and thread named) and against the recording: its slices are the task
stream's bars, its spans the span tree, the killed worker's death and the erred
tasks instant events."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter, defaultdict

from dask_blackbox.read import critical_path, panels, queries
from dask_blackbox.read.views import task_stream as streams

from conftest import subprocess_env
from recording_support import CLUSTER_NAME

PHASES = {"X", "B", "E", "i", "M", "s", "f"}


def write_trace(run, tmp_path, *args):
    out = tmp_path / "run.json.gz"
    done = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "trace", "--cluster",
                           CLUSTER_NAME, "-o", str(out), *args], env=subprocess_env(run["env"]),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    with gzip.open(out, "rt") as f:
        return json.load(f)


def validate(trace: dict) -> None:
    """The Trace Event Format's JSON object form, as Perfetto and chrome://tracing
    read it; AssertionError naming the first event at fault."""
    assert set(trace) >= {"traceEvents"} and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit") in (None, "ms", "ns")
    named_processes, named_threads, used = set(), set(), set()
    stacks: dict[tuple, list] = defaultdict(list)
    flows: dict[int, list] = defaultdict(list)
    rows: dict[tuple, list] = defaultdict(list)
    last_ts: dict[tuple, float] = {}
    for i, e in enumerate(trace["traceEvents"]):
        where = f"event {i}: {e}"
        assert isinstance(e, dict) and e.get("ph") in PHASES, where
        assert isinstance(e.get("name"), str) and e["name"], where
        assert type(e.get("pid")) is int and type(e.get("tid")) is int, where
        if "cat" in e:
            assert isinstance(e["cat"], str), where
        if "args" in e:
            assert isinstance(e["args"], dict), where
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index",
                                 "thread_sort_index"), where
            if e["name"] == "process_name":
                assert isinstance(e["args"]["name"], str), where
                named_processes.add(e["pid"])
            elif e["name"] == "thread_name":
                assert isinstance(e["args"]["name"], str), where
                named_threads.add((e["pid"], e["tid"]))
            else:
                assert type(e["args"]["sort_index"]) is int, where
            continue
        assert isinstance(e.get("ts"), (int, float)) and e["ts"] >= 0, where
        row = (e["pid"], e["tid"])
        used.add(row)
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0, where
            rows[row].append((e["ts"], e["ts"] + e["dur"], e.get("args")))
        elif e["ph"] == "i":
            assert e.get("s") in ("g", "p", "t"), where
        elif e["ph"] in ("s", "f"):  # flows: an id, bound to a slice of their row
            assert type(e.get("id")) is int and e.get("cat"), where
            flows[e["id"]].append(e)
        else:  # B / E: in time order on their row, E closing the innermost B
            assert e["ts"] >= last_ts.get(row, 0), where
            last_ts[row] = e["ts"]
            if e["ph"] == "B":
                stacks[row].append(e)
            else:
                assert stacks[row], f"{where}: an end without a begin"
                begun = stacks[row].pop()
                assert begun["name"] == e["name"] and begun["ts"] <= e["ts"], where
    assert not any(stacks.values()), "begins without an end"
    for flow_id, ends in flows.items():  # a start, then a finish, each inside a slice
        assert [e["ph"] for e in ends] == ["s", "f"], f"flow {flow_id}: {ends}"
        for e in ends:
            assert any(a <= e["ts"] <= b for a, b, _ in rows[(e["pid"], e["tid"])]), \
                f"flow {flow_id}: {e} is bound to no slice of its row"
    for row, intervals in rows.items():  # complete events on one row never overlap
        intervals.sort(key=lambda i: i[:2])
        for (_, end, a), (start, _, b) in zip(intervals, intervals[1:]):
            assert start >= end, f"overlapping slices on {row}: {a} ends at {end}, {b} starts at {start}"
    assert {pid for pid, _ in used} <= named_processes
    assert {r for r in used if r[1] != 0} <= named_threads


def test_trace_file_is_valid_and_is_the_run(recorded_run, tmp_path):
    trace = write_trace(recorded_run, tmp_path)
    validate(trace)
    other = trace["otherData"]
    assert other["cluster_id"] == recorded_run["cluster_id"] and other["threads"] in ("recorded", "packed")
    epoch = other["epoch_us"]
    events = trace["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert process[0] == "dask spans"

    backend = recorded_run["backend"]
    scope = panels.resolve(backend, recorded_run["cluster_id"])
    stream = streams.task_stream(backend, scope, max_bars=10**6)
    bars = Counter((b["worker"], b["key"], "died" if b["action"] == streams.DIED else b["action"],
                    round(b["start"] * 1e6), round(b["stop"] * 1e6)) for b in stream["bars"])
    slices = Counter((process[e["pid"]], e["args"]["key"], e["cat"], e["ts"] + epoch,
                      e["ts"] + e["dur"] + epoch) for e in events
                     if e["ph"] == "X" and e["cat"] != "span")
    assert slices == bars
    # the tasks Dask said the SIGKILLed worker was running: on its process, a row of their own
    died = [e for e in events if e["ph"] == "X" and e["cat"] == "died"]
    assert sorted(e["args"]["key"] for e in died) == recorded_run["running_at_death"]
    assert {process[e["pid"]] for e in died} == {recorded_run["doomed"]}
    # one process per worker; its computes on the rows of its two threads
    assert other["threads"] == "recorded"
    threads = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"]:
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    last_end: dict[tuple, int] = {}
    for e in sorted((e for e in events if e["ph"] == "X" and e["cat"] == "compute"),
                    key=lambda e: (e["pid"], e["ts"], e["ts"] + e["dur"])):
        thread = (e["pid"], e["args"]["thread"])
        row = threads[(e["pid"], e["tid"])]
        if row.startswith("thread "):  # the row of the thread that ran it
            assert row == f"thread {e['args']['thread']}", e
            last_end[thread] = e["ts"] + e["dur"]
        else:  # elsewhere only when Dask's times overlap the thread's previous compute
            assert row.startswith("other actions") and e["ts"] < last_end[thread], e
    per_worker = Counter(pid for (pid, _), name in threads.items() if name.startswith("thread "))
    assert max(per_worker.values()) == 2 and set(per_worker.values()) <= {1, 2}
    workers = {name for pid, name in process.items() if pid}
    assert len(workers) == len(process) - 1 and {b[0] for b in bars} <= workers
    assert max(len([t for p, t in {(e["pid"], e["tid"]) for e in events
                                   if e["ph"] == "X" and e["pid"]}
                    if p == pid]) for pid in set(process) - {0}) >= 2

    columns, rows = queries.spans(backend, tree=True, cluster=recorded_run["cluster_id"])
    tree = {r[columns.index("span_id")]: dict(zip(columns, r)) for r in rows}
    begins = {e["args"]["span_id"]: e for e in events if e["ph"] in ("B", "X")
              and e["cat"] == "span"}
    assert set(begins) == set(tree)
    for span_id, b in begins.items():
        t = tree[span_id]
        assert b["name"] == t["name"].strip() and b["args"]["tasks"] == t["tasks"]
        assert (b["args"]["parent_id"] or "") == t["parent_id"]
        if t["start"] is not None:
            assert b["ts"] + epoch == round(t["start"].timestamp() * 1e6)
    deaths = [e for e in events if e["ph"] == "i" and e["cat"] == "death"]
    assert [process[d["pid"]] for d in deaths] == [recorded_run["doomed"]]
    assert deaths[0]["args"]["processing_tasks"] == 2
    assert deaths[0]["args"]["cause"] == "killed by the OS"  # the planted SIGKILL
    errors = {e["args"]["key"] for e in events if e["ph"] == "i" and e["cat"] == "error"}
    assert errors == {"div-bad", "inc-after-bad"}
    # the critical path as flows: link to link, the same path the critical-path command finds
    assert_flows_are_the_critical_path(trace, recorded_run)


def assert_flows_are_the_critical_path(trace: dict, run: dict, span: str | None = None) -> int:
    """The trace's flows go link to link along the path the critical-path command
    finds; how many links it has."""
    scope = panels.resolve(run["backend"], run["cluster_id"], span)
    found = critical_path.critical_path(run["backend"], run["cluster_id"], scope.span_ids, span=span)
    keys = [link.key for link in found.links]
    assert trace["otherData"]["critical_path"]["links"] == keys
    starts = sorted((e for e in trace["traceEvents"] if e["ph"] == "s"), key=lambda e: e["id"])
    assert [(e["args"]["from"], e["args"]["to"]) for e in starts] == list(zip(keys, keys[1:]))
    return len(keys)


def test_trace_file_of_one_span(recorded_run, tmp_path):
    trace = write_trace(recorded_run, tmp_path, "--span", "etl")
    validate(trace)
    names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "span" and e["ph"] != "E"}
    assert names == {"etl", "load", "reduce"}
    prefixes = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"}
    assert "inc" not in prefixes and "random_sample" in prefixes
    reduced = write_trace(recorded_run, tmp_path, "--span", "reduce")
    validate(reduced)  # flows bound to slices of their rows
    assert assert_flows_are_the_critical_path(reduced, recorded_run, "reduce") >= 3
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "trace", "--cluster",
                          CLUSTER_NAME, "--span", "nope", "-o", str(tmp_path / "x.json")],
                         env=subprocess_env(recorded_run["env"]), capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"dask-blackbox: error: no span named 'nope' in cluster {recorded_run['cluster_id']}"]
