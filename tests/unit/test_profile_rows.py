"""Dask's profile trees as folded stacks (producers.worker.folded) and PROFILE events as
``profiles`` rows (sinks.events), loaded into chDB by the sink's own Batch and Loader."""

from __future__ import annotations

import sys
import threading
import time

import orjson
import pytest
from distributed import profile

from dask_blackbox import contract
from dask_blackbox.producers.worker import FRAME_MAX_CHARS, folded, frame_text
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.tables import COLUMNS, Message

from sink_support import envelope, loaded

NOW = time.time()


def planted_wait(event: threading.Event) -> None:
    event.wait()


def planted_outer(event: threading.Event) -> None:
    planted_wait(event)


def sampled_tree(samples: int) -> dict:
    """Dask's own profile of a thread blocked in planted_wait, ``samples`` times, made
    as a worker makes it (``Worker.trigger_profile``: each frame processed as a
    caller)."""
    release = threading.Event()
    thread = threading.Thread(target=planted_outer, args=(release,))
    thread.start()
    try:
        while "planted_wait" not in [f.f_code.co_name for f in _frames(thread.ident)]:
            time.sleep(0.01)
        state = profile.create()
        for _ in range(samples):
            profile.process(sys._current_frames()[thread.ident], True, state)
        return state
    finally:
        release.set()
        thread.join()


def _frames(ident):
    frame = sys._current_frames().get(ident)
    while frame is not None:
        yield frame
        frame = frame.f_back


def test_a_dask_profile_folds_into_stacks_whose_counts_are_its_samples():
    tree = sampled_tree(7)
    merged = profile.merge(tree, sampled_tree(3))
    stacks, counts = folded(merged, 16384)
    assert sum(counts) == merged["count"] == 10
    hot = [(s, c) for s, c in zip(stacks, counts) if "planted_wait" in s]
    assert sum(c for _, c in hot) == 10
    for stack, _ in hot:
        frames = stack.split(";")
        names = [f.rsplit(":", 1)[1] for f in frames]
        assert names.index("planted_outer") + 1 == names.index("planted_wait")
        outer = frames[names.index("planted_outer")]
        assert outer == f"{__file__}:{planted_outer.__code__.co_firstlineno}:planted_outer"


def node(identifier: str, count: int, *children: dict) -> dict:
    return {"count": count, "identifier": identifier, "children": {c["identifier"]: c for c in children},
            "description": {"filename": "", "name": "", "line_number": 0, "line": ""}}


def test_samples_dask_counts_in_a_caller_end_in_its_children_that_were_innermost():
    """A worker's tree counts a sample in every frame but the innermost: a caller's
    samples beyond its children's go to its children never seen calling (equally),
    else to its children by their counts."""
    tree = node("root", 10, node("a;a.py;1", 10,
                                 node("hot;h.py;2", 0), node("cold;c.py;3", 0),
                                 node("mid;m.py;4", 3, node("leaf;l.py;5", 0))))
    assert sorted(zip(*folded(tree, 1000))) == [
        ("a.py:1:a;c.py:3:cold", 3), ("a.py:1:a;h.py:2:hot", 4),
        ("a.py:1:a;m.py:4:mid;l.py:5:leaf", 3)]
    calls = node("root", 9, node("a;a.py;1", 9, node("b;b.py;2", 2, node("c;c.py;3", 0)),
                                 node("d;d.py;4", 1, node("e;e.py;5", 0))))
    assert sorted(zip(*folded(calls, 1000))) == [
        ("a.py:1:a;b.py:2:b", 4), ("a.py:1:a;b.py:2:b;c.py:3:c", 2),
        ("a.py:1:a;d.py:4:d", 2), ("a.py:1:a;d.py:4:d;e.py:5:e", 1)]


def test_a_frame_keeps_its_text_but_the_separators_and_long_stacks_are_cut():
    assert frame_text("f;a;b.py;12", "a;b.py", "f", 14) == "a,b.py:12:f"
    assert frame_text("<lambda>", "x.py", "<b>é\nü</b>", 3) == "x.py:3:<b>é ü</b>"
    assert len(frame_text("g;" + "d/" * 1000 + ";1", "", "", 0)) < FRAME_MAX_CHARS + 40
    deep = profile.create()
    node = deep
    for i in range(60):
        node["count"] += 1
        child = {"count": 0, "children": {}, "identifier": f"f{i};/long/path/module.py;{i}",
                 "description": {"filename": "", "name": "", "line_number": 0, "line": ""}}
        node["children"][child["identifier"]] = child
        node = child
    [stack], [count] = folded(deep, 400)
    assert count == 1 and len(stack) <= 400
    assert stack.startswith("…[") and stack.endswith(";/long/path/module.py:59:f59")


def message(events: list, offset: int = 0) -> Message:
    return Message(contract.RAW, "t.raw", 0, offset, b"c1",
                   orjson.dumps(envelope(events, source="worker")), 1000)


def profile_event(prefix: str, stacks: list, counts: list, ts: float = NOW - 5) -> dict:
    return {"kind": contract.PROFILE, "ts": ts, "worker": "tcp://w:1", "prefix": prefix,
            "stacks": stacks, "counts": counts}


def rows(batch: Batch, table: str) -> list[dict]:
    return [dict(zip(COLUMNS[table], values)) for values in zip(*batch.tables[table].columns)]


def test_a_profile_event_is_a_row_per_stack_on_either_path(monkeypatch):
    events = [profile_event("inc", ["a.py:1:f;b.py:2:g", "a.py:1:f"], [3, 1]),
              profile_event("", ["a.py:1:f;b.py:2:g"], [4]), profile_event("x", [], [])]
    typed = Batch()
    typed.add(message(events), NOW)
    assert typed.n_checked == 0 and not rows(typed, "dead_letters")
    assert [(r["prefix"], r["stack"], r["count"], r["worker"]) for r in rows(typed, "profiles")] == [
        ("inc", "a.py:1:f;b.py:2:g", 3, "tcp://w:1"), ("inc", "a.py:1:f", 1, "tcp://w:1"),
        ("", "a.py:1:f;b.py:2:g", 4, "tcp://w:1")]
    monkeypatch.setattr(Batch, "_add_typed", lambda self, message, now: False)
    checked = Batch()
    checked.add(message(events), NOW)
    assert rows(checked, "profiles") == rows(typed, "profiles")


@pytest.mark.parametrize(("stacks", "counts", "reason"), [
    (["a"], [1, 2], "1 stacks for 2 counts"),
    (["a", {"x": 1}], [1, 2], "stacks[1]"),
    (["a"], [-1], "counts[0]"),
])
def test_a_bad_profile_event_is_a_dead_letter_naming_the_field(stacks, counts, reason):
    batch = Batch()
    batch.add(message([profile_event("p", stacks, counts)]), NOW)
    [dead] = [r["reason"] for r in rows(batch, "dead_letters")]
    assert dead.startswith("event 0: profile: ") and reason in dead
    assert not rows(batch, "profiles")


def test_profiles_load_into_clickhouse(tmp_path):
    with loaded(tmp_path / "ch", [message([
            profile_event("inc", ["a.py:1:<b>é</b>;b.py:2:g"], [3]),
            profile_event("inc", ["a.py:1:<b>é</b>;b.py:2:g"], [2], NOW - 4)])]) as client:
        assert client.query("SELECT prefix, stack, sum(count) FROM blackbox.profiles "
                            "GROUP BY prefix, stack").result_rows == [
            ("inc", "a.py:1:<b>é</b>;b.py:2:g", 5)]
