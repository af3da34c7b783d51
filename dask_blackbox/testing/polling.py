"""Waiting for a condition in tests: poll until true, fail with what was awaited."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll ``predicate`` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        out = predicate()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
