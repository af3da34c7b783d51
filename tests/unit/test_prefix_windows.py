"""Prefix partials alone (``PrefixWindows``), fed by hand: no cluster, no broker."""

from __future__ import annotations

import orjson
import pytest

from dask_blackbox.stream_processors.prefix_stats import (
    Partial, PrefixWindows, partial_id, partial_record,
)


def keys(closed):
    return [k for k, _ in closed]


def test_a_partial_per_producer_span_prefix_and_window():
    w = PrefixWindows(60.0)
    a = w.partial("p1", 0, "S", "inc", 10.0)
    assert w.partial("p1", 1, "S", "inc", 59.9) is a  # same window
    assert a.first_seq == 0 and a.last_seq == 1
    assert w.partial("p1", 2, "S", "inc", 60.0) is not a  # next window
    assert w.partial("p1", 2, "S", "dec", 10.0) is not a
    assert w.partial("p1", 2, "T", "inc", 10.0) is not a
    assert w.partial("p2", 2, "S", "inc", 10.0) is not a
    assert w.partial("p1", 3, "S", "inc", 10.0) is a and a.last_seq == 3
    assert set(w.open) == {("p1", "S", "inc", 0.0), ("p1", "S", "inc", 60.0),
                           ("p1", "S", "dec", 0.0), ("p1", "T", "inc", 0.0),
                           ("p2", "S", "inc", 0.0)}
    # windows of negative or huge timestamps are still windows
    assert w.partial("p1", 4, None, None, -30.0) is w.open[("p1", None, None, -60.0)]


def test_windows_close_at_the_producers_watermark_only():
    w = PrefixWindows(10.0)
    w.partial("p1", 0, "S", "inc", 1.0)
    w.partial("p1", 0, "S", "inc", 12.0)
    w.partial("p2", 0, "S", "inc", 1.0)
    assert w.advance("p1", 9.9) == []
    assert keys(w.advance("p1", 10.0)) == [("p1", "S", "inc", 0.0)]
    # p2's own watermark is behind: its window stays open
    assert ("p2", "S", "inc", 0.0) in w.open
    # a watermark never goes back
    assert w.advance("p1", 3.0) == [] and w.watermark["p1"] == 10.0


def test_a_late_event_opens_a_late_partial_closed_with_its_envelope():
    w = PrefixWindows(10.0)
    w.partial("p1", 0, "S", "inc", 1.0)
    first = w.advance("p1", 25.0)
    late = w.partial("p1", 1, "S", "inc", 2.0)
    (closed,) = w.advance("p1", 2.0)
    assert closed == (("p1", "S", "inc", 0.0), late)
    # the two partials of one window have different ids
    (k0, p0), = first
    assert partial_id("c", k0, p0) != partial_id("c", *closed)


def test_close_producer_close_all_and_forget():
    w = PrefixWindows(10.0)
    for p in ("p1", "p2"):
        w.partial(p, 0, "S", "inc", 1.0)
        w.advance(p, 1.0)
    assert keys(w.close_producer("p1")) == [("p1", "S", "inc", 0.0)]
    w.forget("p1")
    assert set(w.watermark) == {"p2"}
    assert keys(w.close_all()) == [("p2", "S", "inc", 0.0)]
    assert w.open == {} and w.close_all() == []


def test_partial_ids_depend_on_the_input_only():
    def run():
        w = PrefixWindows(10.0)
        w.partial("p1", 3, "S", "inc", 1.0).finished["memory"] = 2
        w.partial("p1", 4, "S", "inc", 2.0)
        return w.close_all()

    (k1, p1), = run()
    (k2, p2), = run()
    assert partial_id("c", k1, p1) == partial_id("c", k2, p2)
    assert partial_id("c", k1, p1) != partial_id("other", k1, p1)
    p2.last_seq = 5
    assert partial_id("c", k1, p1) != partial_id("c", k2, p2)


def test_the_published_record():
    p = Partial(7)
    p.finished = {"memory": 3, "erred": 1}
    p.durations_us = {"compute": 1_500_000, "transfer": 1}
    p.nbytes, p.n_erred, p.max_compute_us = 100, 1, 900_000
    rec = partial_record("c", "name", ("p1", "S", "inc", 60.0), p)
    assert rec == {"cluster_id": "c", "cluster_name": "name", "span_id": "S",
                   "prefix": "inc", "window_start": 60.0,
                   "partial_id": partial_id("c", ("p1", "S", "inc", 60.0), p),
                   "finished": {"memory": 3, "erred": 1},
                   "durations": {"compute": 1.5, "transfer": 1e-6}, "nbytes": 100,
                   "n_erred": 1, "max_duration": 0.9}


def test_round_trip_through_the_checkpoint_form():
    w = PrefixWindows(10.0)
    w.partial("p1", 0, "S", "inc", 1.0).finished["memory"] = 1
    w.partial("p2", 1, None, None, 15.0).durations_us["compute"] = 5
    w.advance("p1", 1.0)
    w.advance("p2", 15.0)
    again = PrefixWindows(10.0)
    again.load(orjson.loads(orjson.dumps(w.to_list())))
    assert again.to_list() == w.to_list()
    assert [(k, p.to_list()) for k, p in again.close_all()] == \
        [(k, p.to_list()) for k, p in w.close_all()]


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="positive duration"):
        PrefixWindows(0)
