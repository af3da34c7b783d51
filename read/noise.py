"""The statistics behind a regression verdict: is a change larger than the noise?

Two samples of per-task durations (a baseline run's and a candidate's) are compared
by

- :func:`rank_test`: the Mann-Whitney U test, two-sided, with the normal
  approximation and the correction for ties (exact enough from about 8 values a side,
  which is where verdicts start, see :data:`MIN_TASKS`);
- :func:`ratio_interval`: the change as a ratio (candidate / baseline) -- the
  Hodges-Lehmann estimate, the median of the ratios of every candidate task to every
  baseline task -- with its distribution-free confidence interval (Moses: the order
  statistics of those ratios that the U test's critical value points at), the
  interval that inverts the rank test. Unlike an interval of the ratio of medians, a
  few tasks a busy machine delayed move it little: they are a few of the pairs;
- :func:`run_noise`: the run-to-run spread of a median over earlier runs (a robust
  standard deviation of its logarithm), which no within-run statistic can see: a
  machine that is slower one night moves every task of that run.

A change is significant when the rank test rejects at ``alpha`` (Bonferroni-corrected
by the caller for the number of comparisons) *and* the whole interval lies beyond the
noise band (:func:`band`). All functions are deterministic and need only numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

#: Fewer tasks than this on either side: no verdict for that prefix and action.
MIN_TASKS = 5
#: The confidence of the interval.
CONFIDENCE = 0.95
#: At most this many tasks a side enter the interval (every pair of them is a ratio).
PAIRS_SIDE = 1000
#: The smallest change worth calling a change, whatever the noise (a fraction).
MIN_CHANGE = 0.05
#: How many run-to-run standard deviations the band spans.
NOISE_SIGMAS = 3.0


class Interval(NamedTuple):
    """A ratio estimate and its confidence interval."""

    ratio: float
    low: float
    high: float


def rank_test(x: Sequence[float], y: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test that ``x`` and ``y`` come from
    the same distribution (normal approximation, tie-corrected). 1.0 when either is
    empty or every value is equal."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n1, n2 = len(x), len(y)
    if not n1 or not n2:
        return 1.0
    values = np.concatenate([x, y])
    order = values.argsort(kind="mergesort")
    ranks = np.empty(len(values))
    sorted_values = values[order]
    # average ranks of ties
    boundaries = np.flatnonzero(np.diff(sorted_values)) + 1
    starts = np.concatenate([[0], boundaries])
    stops = np.concatenate([boundaries, [len(values)]])
    average = (starts + stops + 1) / 2.0  # 1-based average rank of each run of ties
    ranks[order] = np.repeat(average, stops - starts)
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0
    ties = stops - starts
    n = n1 + n2
    variance = n1 * n2 / 12.0 * ((n + 1) - (ties ** 3 - ties).sum() / (n * (n - 1)))
    if variance <= 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2.0) - 0.5) / math.sqrt(variance)  # continuity correction
    return float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


def ratio_interval(x: Sequence[float], y: Sequence[float],
                   confidence: float = CONFIDENCE) -> Interval:
    """The Hodges-Lehmann ratio of ``y`` to ``x`` (the median of ``y_j / x_i`` over all
    pairs) and its Moses confidence interval: the ``C``-th smallest and largest of
    those ratios, ``C = n1 n2 / 2 - z sqrt(n1 n2 (n1 + n2 + 1) / 12)``. Positive values
    only (at most :data:`PAIRS_SIDE` a side, evenly taken); NaN when either side has
    none."""
    x = _positive(x)
    y = _positive(y)
    if not len(x) or not len(y):
        return Interval(math.nan, math.nan, math.nan)
    logs = (np.log(y)[None, :] - np.log(x)[:, None]).ravel()
    logs.sort()
    n1, n2, pairs = len(x), len(y), len(logs)
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    c = int(math.floor(pairs / 2 - z * math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)))
    c = min(max(c, 0), (pairs - 1) // 2)
    middle = float(np.median(logs))
    return Interval(math.exp(middle), math.exp(logs[c]), math.exp(logs[pairs - 1 - c]))


def _positive(values: Sequence[float]) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    v = np.sort(v[v > 0])
    if len(v) > PAIRS_SIDE:  # evenly spaced order statistics: the same shape, fewer pairs
        v = v[np.linspace(0, len(v) - 1, PAIRS_SIDE).round().astype(int)]
    return v


def run_noise(medians: Sequence[float]) -> float | None:
    """The run-to-run spread of a median, as a standard deviation of its logarithm
    over earlier runs: from the median absolute deviation (times 1.4826) with three
    runs or more, so that one run on a machine that was busy that night does not
    widen the band for all; the sample standard deviation with two. None with fewer
    than two positive medians."""
    logs = np.array([math.log(m) for m in medians if m and m > 0])
    if len(logs) < 2:
        return None
    if len(logs) == 2:
        return float(np.std(logs, ddof=1))
    return float(1.4826 * np.median(np.abs(logs - np.median(logs))))


def band(noise: float | None, min_change: float = MIN_CHANGE,
         sigmas: float = NOISE_SIGMAS) -> float:
    """The fraction a ratio must move beyond 1 to be more than noise:
    ``exp(sigmas * noise) - 1``, at least ``min_change``."""
    if noise is None:
        return min_change
    return max(min_change, math.exp(sigmas * noise) - 1.0)


def beyond(interval: Interval, fraction: float) -> int:
    """+1 when the whole interval lies above ``1 + fraction``, -1 when below
    ``1 / (1 + fraction)``, else 0."""
    if math.isnan(interval.low):
        return 0
    if interval.low > 1.0 + fraction:
        return 1
    if interval.high < 1.0 / (1.0 + fraction):
        return -1
    return 0
