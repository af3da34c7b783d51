"""The scheduler plugin's transition hook in C (``producers/_hotpath.c``) buffers
exactly what the Python hook buffers, in the same order, on a real Scheduler: the
same record fields, the same TaskGroups, the same offered items, the same drops;
and every call that is not its fast case reaches the Python hook."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import deque

import orjson
import pytest
from distributed import Scheduler
from distributed.scheduler import Transition

from dask_blackbox.contract import TRANSITION, expand_events
from dask_blackbox.producers.events import named_rows, tape_rows
from dask_blackbox.producers.scheduler import BlackboxSchedulerPlugin
from dask_blackbox.producers.settings import ProducerSettings

try:
    from dask_blackbox.producers import _hotpath
except ImportError:  # built without a C compiler
    _hotpath = None


def test_the_compiled_hook_is_built():
    """``pip install`` builds it where a C compiler is; CI must have one."""
    if _hotpath is None:
        message = ("dask_blackbox.producers._hotpath is not built (no C compiler at install?): "
                   "the scheduler uses its Python hook")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    assert callable(_hotpath.Hook)


def _parked(compiled: bool, room: int) -> BlackboxSchedulerPlugin:
    """A plugin whose sender never sends (no cluster id, a flush interval of an
    hour): what the hook buffers stays in the buffer to be compared."""
    return BlackboxSchedulerPlugin(ProducerSettings.resolve({
        "producer.sender": "thread", "producer.flush-interval": "1h",
        "producer.metrics-interval": "1h", "producer.buffer-max-events": room,
        "producer.compiled-hook": compiled,
    }))


def _events(plugin: BlackboxSchedulerPlugin) -> tuple:
    """The TRANSITION events the plugin's sender would deliver of what it buffered
    (its own packing, expanded as a reader expands runs), and its drop counts."""
    t = plugin.transport
    events: list = []
    carry: deque = deque()
    while (packed := t._pack(carry)) is not None:
        body, _, weights = packed
        events += expand_events(orjson.loads(body)["events"])
        t._release(weights)
    # transitions only: each plugin's own scheduler_start event has its own time
    transitions = [ev for ev in events if ev["kind"] == TRANSITION]
    return transitions, t.dropped_events, t.dropped_bytes


class _Opaque:
    """A value the tape does not write (a user's type): that call goes to Python."""

    def __repr__(self) -> str:
        return "<opaque>"


@pytest.mark.skipif(_hotpath is None, reason="the compiled hook is not built")
def test_compiled_hook_publishes_what_the_python_hook_publishes(bb_config):
    async def run() -> tuple:
        scheduler = await Scheduler(dashboard_address=":0", validate=False)
        # str, tuple, int, non-ASCII, huge-int keys; one never known to the scheduler
        keys = ["plain-0", ("tuple-key", 1, 2), 42, "naïve-ключ", ("tuple-key", 3),
                ("big", 2 ** 70), "x" * 300]
        for key in keys:
            scheduler.new_task(key, None, "released")
        compiled, python = _parked(True, 10_000), _parked(False, 10_000)
        full_c, full_py = _parked(True, 9), _parked(False, 9)  # room runs out midway
        plugins = (compiled, python, full_c, full_py)
        for plugin in plugins:
            await plugin.start(scheduler)
            plugin.transport.cluster_id = None  # it sends nothing without one
        assert isinstance(compiled.transition, _hotpath.Hook)
        assert not isinstance(python.transition, _hotpath.Hook)
        done = {"worker": "tcp://127.0.0.1:40000", "nbytes": 3_200, "type": b"\x80\x04int",
                "typename": "int", "metadata": {}, "thread": 140_000_000_000,
                "startstops": ({"action": "compute", "start": 1.0, "stop": 1.5},)}
        big = {**done, "nbytes": 5 * 2 ** 40, "startstops": [
            {"action": "transfer", "start": 1.0, "stop": 2.0, "source": "tcp://w:1"},
            {"action": "compute", "start": 2.0, "stop": 2.5, "note": "déjà", "n": -2 ** 40}]}
        opaque = {**done, "startstops": ({"action": "compute", "value": _Opaque()},)}
        erred = {"worker": "tcp://127.0.0.1:40000", "exception_text": "ValueError: x",
                 "traceback_text": "Traceback ...", "cause": "plain-0"}
        calls = []
        for key in keys:
            calls += [(key, "released", "waiting", {}), (key, "waiting", "processing", {}),
                      (key, "processing", "memory", done), (key, "memory", "released", {}),
                      (key, "released", "waiting", {}), (key, "processing", "memory", big),
                      (key, "memory", "released", {"safe": True}),
                      (key, "processing", "memory", opaque),
                      (key, "processing", "erred", erred)]
        calls.append(("never-known", "released", "forgotten", {}))
        log = scheduler.transition_log
        now = time.time()
        for i, (key, start, finish, kwargs) in enumerate(calls):
            log.append(Transition(key, start, finish, {}, f"stimulus-{i}", now + i))
            for plugin in plugins:
                plugin.transition(key, start, finish, stimulus_id=f"stimulus-{i}", **kwargs)
        # not Dask's usual call (after Dask's record): no stimulus_id keyword, an
        # extra positional argument
        log.append(Transition("plain-0", "memory", "released", {}, None, now))
        for plugin in plugins:
            plugin.transition("plain-0", "memory", "released")
        log.append(Transition("plain-0", "memory", "released", {}, "s", now))
        for plugin in plugins:
            plugin.transition("plain-0", "memory", "released", "extra", stimulus_id="s")
        # an unhashable key: the same error from both (Dask logs a plugin's error)
        errors = []
        for plugin in (compiled, python):
            with pytest.raises(TypeError) as raised:
                plugin.transition(["a", "list"], "a", "b", stimulus_id="s")
            errors.append(str(raised.value))
        written = len(compiled.transport._tape)
        out = [_events(plugin) for plugin in plugins]
        for plugin in plugins:
            plugin.transport.cluster_id = scheduler.id
            await plugin.close()
        await scheduler.close()
        return out, errors, len(calls), written

    (c, py, full_c, full_py), errors, n_calls, written = asyncio.run(run())
    assert c == py
    events, dropped, _ = c
    assert len(events) == n_calls + 2 and dropped == 0
    # the tape took all but the erred, the opaque startstops (a task each), the
    # huge key's, the unknown key's and the two unusual calls
    assert written == 6 * 7
    assert [ev["key"] for ev in events[:9]] == ["plain-0"] * 9
    memory = [ev for ev in events if ev["finish"] == "memory"]
    assert memory[1]["nbytes"] == 5 * 2 ** 40
    assert memory[1]["startstops"][1] == {"action": "compute", "start": 2.0, "stop": 2.5,
                                          "note": "déjà", "n": -2 ** 40}
    assert full_c == full_py
    assert full_c[1] > 0  # the full buffer dropped and counted the same transitions
    assert errors[0] == errors[1]


@pytest.mark.skipif(_hotpath is None, reason="the compiled hook is not built")
def test_the_tape_gives_back_what_was_written():
    """Rows come back equal and of the same types, all the way down (marshal's
    types: a tuple stays a tuple, a list a list, True is not 1); a row holding a
    value the tape does not write is refused whole; rows are taken oldest first."""
    values = [None, True, False, 0, -1, 2 ** 31 - 1, -2 ** 31, 2 ** 31, -2 ** 31 - 1,
              2 ** 63 - 1, -2 ** 63, 1.5, float("inf"), -0.0, "", "ascii", "x" * 255,
              "y" * 256, "naïve-ключ", "é" * 300, b"", b"\x00bytes", (), ("a", 1, (2.0,)),
              tuple(range(300)), [], [1, [2, {}]], {}, {"a": {"b": (1,)}, 1: None}]

    def same(a, b) -> bool:
        if type(a) is not type(b):
            return False
        if type(a) in (tuple, list):
            return len(a) == len(b) and all(map(same, a, b))
        if type(a) is dict:
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        return a == b or (a != a and b != b)

    tape = _hotpath.Tape()
    rows = [tuple(values[i:i + 5]) for i in range(0, len(values) - 4, 5)]
    rows.append(tuple(values[:9]))
    for row in rows:
        tape.append(row)
    assert len(tape) == len(rows)
    first = tape_rows(tape.take(2))
    rest = tape_rows(tape.take(len(tape)))
    assert same(first + rest, rows) and len(tape) == 0
    for bad in (_Opaque(), "\ud800", 2 ** 64, {1: {2: {3: {4: {5: {6: {7: {8: {9: {
            10: {11: {12: {13: {14: {15: {16: {17: 0}}}}}}}}}}}}}}}}}):
        tape.append(("k", "a", "b", "s", 1.0))
        with pytest.raises(ValueError, match="not one the tape writes"):
            tape.append(("k", "a", "b", "s", bad))
        assert same(tape_rows(tape.take(len(tape))), [("k", "a", "b", "s", 1.0)])
    with pytest.raises(ValueError, match="take"):
        tape.take(1)
    # Dask's states (interned) are references to one object; an equal str that is
    # not the interned one is held, and comes back equal
    state = sys.intern("processing")
    copy = "".join(["process", "ing"])
    tape.append(("k", state, copy, "s", 1.0))
    (row,) = tape_rows(tape.take(1))
    assert row[1] is state and row[2] == state and row[2] is not state
    # a carried row gets its names in the middle, a plain row at the end
    tape.append(("k", "a", "b", "s", 1.0))
    tape.append(("k", "a", "b", "s", 1.0, "w", 1, "int", ()))
    assert named_rows(tape_rows(tape.take(2)), [("p", "g", None), None]) == [
        ("k", "a", "b", "s", 1.0, ("p", "g", None)),
        ("k", "a", "b", "s", 1.0, None, "w", 1, "int", (), None, None, None)]
    # memory grown while rows were held is given back once they are taken
    for _ in range(200_000):
        tape.append(("k" * 40, "a", "b", "s" * 40, 1.0))
    assert sys.getsizeof(tape) > 16 << 20
    tape.take(len(tape))
    assert sys.getsizeof(tape) < 1 << 20


def test_compiled_hook_setting_is_validated():
    from dask_blackbox.config import ConfigError

    assert ProducerSettings.resolve().compiled_hook is True
    assert ProducerSettings.resolve({"producer.compiled-hook": False}).compiled_hook is False
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=r"blackbox.producer.compiled-hook: .* true or false"):
            ProducerSettings.resolve({"producer.compiled-hook": bad})


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_transition_with_kwargs_is_held_without_them(bb_config, compiled):
    """The hook takes worker, nbytes, typename and startstops out of Dask's kwargs
    (the dict is not held until the hand-over: the compiled hook writes them to its
    tape, the Python hook to a tuple); an erred transition keeps its kwargs (the
    sender reads the error). Either way the event is the one the builder makes from
    the kwargs themselves."""
    if compiled and _hotpath is None:
        pytest.skip("the compiled hook is not built")

    async def run() -> tuple:
        scheduler = await Scheduler(dashboard_address=":0", validate=False)
        scheduler.new_task(("inc", 1), None, "released")
        plugin = _parked(compiled, 10_000)
        await plugin.start(scheduler)
        plugin.transport.cluster_id = None
        cases = [
            ("processing", "memory", {
                "worker": "tcp://127.0.0.1:40000", "nbytes": 3_200, "type": b"\x80\x04int",
                "typename": "int", "metadata": {}, "thread": 1,
                "startstops": ({"action": "compute", "start": 1.0, "stop": 1.5},)}),
            ("memory", "released", {"safe": True}),
            ("processing", "erred", {"worker": "tcp://127.0.0.1:40000",
                                     "exception_text": "ValueError: x",
                                     "traceback_text": "Traceback ...", "cause": ("inc", 1)}),
        ]
        before = len(plugin.transport._buffer)
        for i, (start, finish, kwargs) in enumerate(cases):
            scheduler.transition_log.append(
                Transition(("inc", 1), start, finish, {}, f"s-{i}", 100.0 + i))
            plugin.transition(("inc", 1), start, finish, stimulus_id=f"s-{i}", **kwargs)
        items = list(plugin.transport._buffer)[before:]
        builder = plugin.transport._transitions
        group = scheduler.tasks[("inc", 1)].group
        expected = [builder.event(builder.row((None, 400, ("inc", 1), start, finish, f"s-{i}",
                                               kwargs, group, 100.0 + i)))
                    for i, (start, finish, kwargs) in enumerate(cases)]
        held = [[v for v in item if isinstance(v, dict)] for item in items
                if type(item) is tuple]
        got = _events(plugin)[0][-3:]
        plugin.transport.cluster_id = scheduler.id
        await plugin.close()
        await scheduler.close()
        return got, orjson.loads(orjson.dumps(expected)), held, cases

    got, expected, held, cases = asyncio.run(run())
    assert got == expected
    assert [got[0][field] for field in ("worker", "nbytes", "typename", "startstops")] == [
        "tcp://127.0.0.1:40000", 3_200, "int", [{"action": "compute", "start": 1.0, "stop": 1.5}]]
    assert [got[2][field] for field in ("exception", "traceback", "cause")] == [
        "ValueError: x", "Traceback ...", "('inc', 1)"]
    # no kwargs dict held but the erred one's, as Dask passed it
    assert held == ([[cases[2][2]]] if compiled else [[], [], [cases[2][2]]])
