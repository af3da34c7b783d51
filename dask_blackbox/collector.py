"""The garbage collector of dask-blackbox's own long-running processes.

The sink, the stream processors and the ``dask-blackbox`` command allocate much the
same way: long-lived state without reference cycles (a batch's tables, the clusters'
states, a report's figures), and hundreds of thousands of short-lived lists and dicts
freed at once. With CPython's default thresholds (700, 10, 10) the collector rescans
the growing heap over and over; at :data:`THRESHOLDS` it seldom does.
"""

from __future__ import annotations

import gc

#: Collector thresholds of dask-blackbox's processes (CPython's default: 700, 10, 10).
THRESHOLDS = (50_000, 20, 100)


def collect_rarely() -> None:
    """Freeze what the process made so far (never scanned again) and collect at
    :data:`THRESHOLDS` from now on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
