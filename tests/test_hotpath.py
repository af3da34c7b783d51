"""The scheduler plugin's transition hook in C (``producers/_hotpath.c``) buffers
exactly what the Python hook buffers, in the same order, on a real Scheduler: the
same record fields, the same TaskGroups, the same offered items, the same drops;
and every call that is not its fast case reaches the Python hook."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from distributed import Scheduler
from distributed.scheduler import Transition

from dask_blackbox.producers.scheduler import BlackboxSchedulerPlugin
from dask_blackbox.producers.settings import ProducerSettings
from dask_blackbox.producers.transport import ready

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


def _contents(plugin: BlackboxSchedulerPlugin) -> tuple:
    t = plugin.transport
    # transitions only: each plugin's own scheduler_start event has its own time
    items = [item if type(item) is not tuple else item[2:] for item in t._buffer
             if type(item) is not tuple or item[0] is not ready]
    return items, list(t._record_fields), t.dropped_events, t.dropped_bytes


@pytest.mark.skipif(_hotpath is None, reason="the compiled hook is not built")
def test_compiled_hook_buffers_what_the_python_hook_buffers(bb_config):
    async def run() -> tuple:
        scheduler = await Scheduler(dashboard_address=":0", validate=False)
        # str, tuple, int, non-ASCII keys; one never known to the scheduler
        keys = ["plain-0", ("tuple-key", 1, 2), 42, "naïve-ключ", ("tuple-key", 3)]
        for key in keys:
            scheduler.new_task(key, None, "released")
        compiled, python = _parked(True, 10_000), _parked(False, 10_000)
        full_c, full_py = _parked(True, 7), _parked(False, 7)  # room runs out midway
        plugins = (compiled, python, full_c, full_py)
        for plugin in plugins:
            await plugin.start(scheduler)
            plugin.transport.cluster_id = None  # it sends nothing without one
        assert isinstance(compiled.transition, _hotpath.Hook)
        assert not isinstance(python.transition, _hotpath.Hook)
        done = {"worker": "tcp://127.0.0.1:40000", "nbytes": 3_200, "typename": "int",
                "startstops": ({"action": "compute", "start": 1.0, "stop": 1.5},)}
        erred = {"worker": "tcp://127.0.0.1:40000", "exception_text": "ValueError: x",
                 "traceback_text": "Traceback ...", "cause": "plain-0"}
        calls = []
        for i, key in enumerate(keys):
            calls += [(key, "released", "waiting", {}), (key, "waiting", "processing", {}),
                      (key, "processing", "memory", done), (key, "memory", "released", {}),
                      (key, "processing", "erred", erred)]
        calls.append(("never-known", "released", "forgotten", {}))
        log = scheduler.transition_log
        now = time.time()
        for i, (key, start, finish, kwargs) in enumerate(calls):
            log.append(Transition(key, start, finish, {}, f"stimulus-{i}", now + i))
            for plugin in plugins:
                plugin.transition(key, start, finish, stimulus_id=f"stimulus-{i}", **kwargs)
        # not Dask's usual call: no stimulus_id keyword, an extra positional argument
        for plugin in plugins:
            plugin.transition("plain-0", "memory", "released")
            plugin.transition("plain-0", "memory", "released", "extra", stimulus_id="s")
        # an unhashable key: the same error from both (Dask logs a plugin's error)
        errors = []
        for plugin in (compiled, python):
            with pytest.raises(TypeError) as raised:
                plugin.transition(["a", "list"], "a", "b", stimulus_id="s")
            errors.append(str(raised.value))
        out = [_contents(plugin) for plugin in plugins]
        for plugin in plugins:
            plugin.transport.cluster_id = scheduler.id
            await plugin.close()
        await scheduler.close()
        return out, errors, len(calls)

    (c, py, full_c, full_py), errors, n_calls = asyncio.run(run())
    assert c == py
    items, fields, dropped, _ = c
    assert len(items) == n_calls + 2 and dropped == 0
    assert len(fields) == 5 * sum(1 for item in items if type(item) is not tuple)
    assert full_c == full_py
    assert full_c[2] > 0  # the full buffer dropped and counted the same transitions
    assert errors[0] == errors[1]


def test_compiled_hook_setting_is_validated():
    from dask_blackbox.config import ConfigError

    assert ProducerSettings.resolve().compiled_hook is True
    assert ProducerSettings.resolve({"producer.compiled-hook": False}).compiled_hook is False
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=r"blackbox.producer.compiled-hook: .* true or false"):
            ProducerSettings.resolve({"producer.compiled-hook": bad})


def test_a_transition_with_kwargs_is_held_without_them(bb_config):
    """The hook takes worker, nbytes, typename and startstops out of Dask's kwargs
    (the dict is not held until the hand-over); an erred transition keeps its kwargs
    (the sender reads the error). Either way the row is the one the builder makes
    from the kwargs themselves."""
    async def run() -> tuple:
        scheduler = await Scheduler(dashboard_address=":0", validate=False)
        scheduler.new_task(("inc", 1), None, "released")
        plugin = _parked(True, 10_000)
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
        expected = [builder.row((None, 400, ("inc", 1), start, finish, f"s-{i}", kwargs, group,
                                 100.0 + i)) for i, (start, finish, kwargs) in enumerate(cases)]
        got = [builder.row(item) for item in items]
        held = [[v for v in item if isinstance(v, dict)] for item in items]
        plugin.transport.cluster_id = scheduler.id
        await plugin.close()
        await scheduler.close()
        return got, expected, held, cases

    got, expected, held, cases = asyncio.run(run())
    assert got == expected
    assert got[0][6:10] == ("tcp://127.0.0.1:40000", 3_200, "int", cases[0][2]["startstops"])
    assert got[2][10:] == ("ValueError: x", "Traceback ...", "('inc', 1)")
    assert held[0] == [] and held[1] == []  # no kwargs dict held
    assert held[2] == [cases[2][2]]  # the erred one's, as Dask passed it
