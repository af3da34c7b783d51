"""Colours of the pages, Dask's own where Dask has them.

- A task prefix is coloured as Dask's task stream and progress bars colour it
  (``distributed.utils.color_of``: a hash of the name into an 18-colour viridis
  palette). Several prefixes drawn together may hash to one colour; :func:`distinct`
  keeps Dask's colour for the first of them and gives each other one the nearest free
  colour of :data:`SPARE`, so that no two series of one chart look alike.
- Fine performance metrics' activities are coloured as Dask's Fine Performance
  Metrics dashboard colours them: the activities shown, sorted, spread over Viridis11
  (``bokeh.palettes.interp_palette``), one colour each (:func:`activities`).
- Task states are Dask's task graph's (:data:`GRAPH_STATES`); task-stream actions
  other than compute Dask's task stream's (:data:`ACTIONS`).
- Categories without a Dask colour (workers) take :data:`SPARE` in order.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable

from bokeh.palettes import Category20, Viridis11, interp_palette, viridis

#: Dask's task stream colours for actions other than compute.
ACTIONS = {"transfer": "red", "disk-write": "orange", "disk-read": "orange", "deserialize": "gray"}
#: Dask's task graph colours per state (distributed.dashboard TaskGraph), with the
#: states a replay also meets.
GRAPH_STATES = {"waiting": "gray", "queued": "yellow", "no-worker": "#8c564b",
                "processing": "green", "memory": "red", "released": "blue", "erred": "black",
                "forgotten": "#bbbbbb"}
#: Colours to fall back on, distinct from each other: Category20's, strong ones first.
SPARE = tuple(Category20[20][0::2] + Category20[20][1::2])


#: ``distributed.utils.palette``, which Dask writes out as ``viridis(18)``.
_PREFIXES = viridis(18)


@functools.cache
def color_of(name: str) -> str:
    """Dask's colour for a task prefix, as ``distributed.utils.color_of`` computes it
    (the read side does not import distributed, a quarter of a second)."""
    n = int(hashlib.md5(str(name).encode(), usedforsecurity=False).hexdigest()[:8], 16)
    return _PREFIXES[n % len(_PREFIXES)]


def distinct(names: Iterable[str], fixed: dict[str, str] | None = None) -> dict[str, str]:
    """A colour per name, no two alike: ``fixed`` ones as given, the others Dask's
    :func:`color_of` unless taken (in the order given), else the first free of
    :data:`SPARE` (then Dask's again, when all are taken)."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for name, color in (fixed or {}).items():
        out[name] = color
        used.add(color.lower())
    spare = iter(SPARE)
    for name in names:
        if name in out:
            continue
        color = color_of(name)
        if color.lower() in used:
            color = next((c for c in spare if c.lower() not in used), color)
        out[name] = color
        used.add(color.lower())
    return out


def categories(names: Iterable[str]) -> dict[str, str]:
    """:data:`SPARE` colours in order, for categories Dask has no colour for."""
    names = list(dict.fromkeys(names))
    return {n: SPARE[i % len(SPARE)] for i, n in enumerate(names)}


def activities(names: Iterable[str]) -> dict[str, str]:
    """Dask's fine performance metrics colours: the activities sorted, spread over
    Viridis11."""
    ordered = sorted(set(names))
    if not ordered:
        return {}
    colors = interp_palette(Viridis11, len(ordered)) if len(ordered) > 1 else (Viridis11[0],)
    return dict(zip(ordered, colors))


def ramp(values: list[float]) -> list[str]:
    """Numeric values as Viridis colours, low dark to high bright (0 to the largest)."""
    from bokeh.palettes import Viridis256

    top = max((v for v in values if v == v), default=0.0) or 1.0
    return [Viridis256[min(255, max(0, int(255 * (v / top))))] if v == v else "#cccccc"
            for v in values]
