"""The pages' colours (read/palette.py): a task prefix takes Dask's own colour, as
``distributed.utils.color_of`` gives it, and the series of one chart never share one."""

from __future__ import annotations

from distributed.utils import color_of as dask_color_of

from dask_blackbox.read import palette

NAMES = ["inc", "add", "sum-aggregate", "getitem", "shuffle-transfer", "p2p-get-output",
         "<script>", "", "ünïcode", "x" * 300] + [f"prefix-{i}" for i in range(500)]


def test_a_prefix_takes_the_colour_dask_gives_it():
    assert [palette.color_of(n) for n in NAMES] == [dask_color_of(n) for n in NAMES]


def test_the_series_of_one_chart_never_share_a_colour():
    names = NAMES[:30]
    colours = palette.distinct(names, fixed={"erred": "black"})
    assert len({c.lower() for c in colours.values()}) == len(colours) == 31
    first = {}  # the first prefix with a Dask colour keeps it
    for n in names:
        first.setdefault(dask_color_of(n), n)
    assert all(colours[n] == c for c, n in first.items())
