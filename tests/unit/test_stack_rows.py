"""STACKS events (a nanny's py-spy reading of its worker process's threads) as
``stacks`` rows (sinks.events), loaded into chDB by the sink's own Batch and Loader."""

from __future__ import annotations

import time

import orjson
import pytest

from dask_blackbox import contract
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.tables import COLUMNS, Message

from sink_support import envelope, loaded

NOW = time.time()


def message(events: list, offset: int = 0) -> Message:
    return Message(contract.RAW, "t.raw", 0, offset, b"c1",
                   orjson.dumps(envelope(events, source="nanny")), 1000)


def stacks_event(**changes) -> dict:
    event = {"kind": contract.STACKS, "ts": NOW - 5, "worker": "tcp://w:1", "pid": 41,
             "reason": "unresponsive", "memory": 1 << 28, "memory_limit": 1 << 30,
             "silent": 3.25, "threads": ["MainThread", "Dask-Default-Threads-41-0"],
             "thread_ids": [41, 2**40], "stacks": ["a.py:3:main", "t.py:9:run;b.py:7:<b>é</b>"],
             "active": [False, True], "gil": [False, True], "error": None}
    return {**event, **changes}


def rows(batch: Batch) -> list[dict]:
    return [dict(zip(COLUMNS["stacks"], values)) for values in zip(*batch.tables["stacks"].columns)]


def test_a_stacks_event_is_a_row_per_thread_on_either_path(monkeypatch):
    events = [stacks_event(), stacks_event(threads=[], thread_ids=[], stacks=[], active=[],
                                           gil=[], error="py-spy: no such process",
                                           reason="memory", silent=None)]
    typed = Batch()
    typed.add(message(events), NOW)
    assert not [r for r in typed.tables["dead_letters"].columns[0]]
    got = [(r["thread"], r["thread_id"], r["active"], r["gil"], r["stack"], r["reason"],
            r["error"]) for r in rows(typed)]
    assert got == [("MainThread", 41, 0, 0, "a.py:3:main", "unresponsive", None),
                   ("Dask-Default-Threads-41-0", 2**40, 1, 1, "t.py:9:run;b.py:7:<b>é</b>",
                    "unresponsive", None),
                   (None, 0, 0, 0, None, "memory", "py-spy: no such process")]
    assert {(r["pid"], r["worker"], r["producer_id"]) for r in rows(typed)} == {
        (41, "tcp://w:1", rows(typed)[0]["producer_id"])}
    monkeypatch.setattr(Batch, "_add_typed", lambda self, message, now: False)
    checked = Batch()
    checked.add(message(events), NOW)
    assert rows(checked) == rows(typed)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"threads": ["a"]}, "lengths"),
    ({"active": [1, 0]}, "active[0]"),
    ({"thread_ids": [-1, 2]}, "thread_ids[0]"),
    ({"pid": None}, "pid"),
    ({"stacks": ["a", None]}, "stacks[1]"),
])
def test_a_bad_stacks_event_is_a_dead_letter_naming_the_field(changes, reason):
    batch = Batch()
    batch.add(message([stacks_event(**changes)]), NOW)
    [dead] = [r for r in batch.tables["dead_letters"].columns[5]]
    assert dead.startswith("event 0: stacks: ") and reason in dead, dead
    assert not rows(batch)


def test_stacks_load_into_clickhouse(tmp_path):
    with loaded(tmp_path / "ch", [message([stacks_event(), stacks_event(
            threads=[], thread_ids=[], stacks=[], active=[], gil=[], error="gone")])]) as client:
        assert client.query(
            "SELECT thread, thread_id, active, gil, stack, error, silent FROM blackbox.stacks "
            "ORDER BY thread").result_rows == [
            ("", 0, 0, 0, "", "gone", 3.25), ("Dask-Default-Threads-41-0", 2**40, 1, 1,
                                              "t.py:9:run;b.py:7:<b>é</b>", "", 3.25),
            ("MainThread", 41, 0, 0, "a.py:3:main", "", 3.25)]
