"""The workload of compare by function: tasks of prefix ``fnwork`` that spend their
time in two functions, ``steady`` and ``slowed``, in turns; a run planted slower gives
``slowed`` more. The two are distinct frames (Dask's profiler attributes a sample to
the frames on the stack), each a pure-Python busy loop for an amount of the thread's
CPU time: the profiler samples a thread when it runs, so on a machine that runs other
jobs the samples follow CPU time while wall time stretches with the load.

Worker processes import this module by name to run the tasks."""

from __future__ import annotations

import time

#: turns of the two functions a task
ROUNDS = 5


def _tick(n: int) -> int:
    for _ in range(2):
        n += 1
    return n


def steady(seconds: float) -> int:
    """A pure-Python busy loop for ``seconds`` of this thread's CPU. It calls a Python function: Dask's
    worker counts a sample in the frames that called another (``Worker.trigger_profile``
    does not count the innermost), so a loop that calls none is seen only through its
    caller, shared with every other function it calls."""
    n, end = 0, time.thread_time() + seconds
    while time.thread_time() < end:
        n = _tick(n)
    return n


def slowed(seconds: float) -> int:
    """The same loop, a frame of its own (the one planted slower)."""
    n, end = 0, time.thread_time() + seconds
    while time.thread_time() < end:
        n = _tick(n)
    return n


def fnwork(i: int, spin: float, factor: float, rounds: int = ROUNDS) -> int:
    """``spin`` CPU seconds in ``steady`` and ``factor`` times as long in ``slowed``, in
    ``rounds`` turns (as a loop over records calls its steps): whatever else the
    machine runs meets both alike."""
    n = i
    for _ in range(rounds):
        n += steady(spin / rounds) + slowed(spin * factor / rounds)
    return n
