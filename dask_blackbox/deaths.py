"""Which worker removals are deaths: the one rule the read side (the Run page's
markers) and the exporters (span events) share.

A death is a removal Dask did not expect (its remove-worker event says ``expected:
false``, which the scheduler producer copies into the lifecycle event's ``detail``)
that cost something -- tasks the worker was running, or results or scattered data
only it held -- or, if it cost nothing, that was not part of the cluster shutting
down (no scheduler close within :data:`SHUTDOWN_S` after it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: An idle worker lost this long before the scheduler closed was part of the shutdown.
SHUTDOWN_S = 10.0
#: The counts of a removal's ``detail`` that say what the death cost.
LOST = ("processing_tasks", "lost_computed_tasks", "lost_scattered_tasks")


def lost(detail: Any) -> dict[str, int]:
    """``detail``'s counts of :data:`LOST` (0 where absent or not a mapping)."""
    info = detail if isinstance(detail, Mapping) else {}
    return {k: int(info.get(k) or 0) for k in LOST}


def is_death(detail: Any, ts: float, closes: Iterable[float]) -> bool:
    """Whether a ``worker_removed`` lifecycle event (its parsed ``detail``, its time
    ``ts``) was a death, given the times of the cluster's scheduler closes."""
    if not isinstance(detail, Mapping) or detail.get("expected") is not False:
        return False
    if any(lost(detail).values()):
        return True
    return not any(0 <= close - ts <= SHUTDOWN_S for close in closes)
