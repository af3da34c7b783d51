"""The statistics behind a regression verdict: is a change larger than the noise?

Two samples of per-task durations (a baseline run's and a candidate's) are compared
by

- :func:`rank_test`: the Mann-Whitney U test, two-sided, with the normal
  approximation and the correction for ties (exact enough from about 8 values a side,
  which is where verdicts start, see :data:`MIN_TASKS`);
- :func:`ratio_interval`: a percentile bootstrap interval of the ratio of the
  medians (candidate / baseline), resampling tasks within each run, with a fixed
  seed so the same data always gives the same interval;
- :func:`run_noise`: the run-to-run spread of a median over earlier runs (the
  sample standard deviation of its logarithm), which no within-run resampling can
  see: a machine that is slower one night moves every task of that run.

A change is significant when the rank test rejects at ``alpha`` (Bonferroni-corrected
by the caller for the number of comparisons) *and* the whole bootstrap interval lies
beyond the noise band (:func:`band`). All functions are deterministic and need only
numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

#: Fewer tasks than this on either side: no verdict for that prefix and action.
MIN_TASKS = 5
#: Bootstrap resamples, and the confidence of the interval.
RESAMPLES = 1000
CONFIDENCE = 0.95
#: The smallest change worth calling a change, whatever the noise (a fraction).
MIN_CHANGE = 0.05
#: How many run-to-run standard deviations the band spans.
NOISE_SIGMAS = 3.0


class Interval(NamedTuple):
    """A ratio estimate and its bootstrap interval."""

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


def ratio_interval(x: Sequence[float], y: Sequence[float], resamples: int = RESAMPLES,
                   confidence: float = CONFIDENCE, seed: int = 0) -> Interval:
    """median(y) / median(x) and its percentile bootstrap interval. Both samples
    must hold at least one positive median; NaN otherwise."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    mx, my = float(np.median(x)) if len(x) else 0.0, float(np.median(y)) if len(y) else 0.0
    if mx <= 0 or my <= 0:
        return Interval(math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    bx = np.median(x[rng.integers(0, len(x), (resamples, len(x)))], axis=1)
    by = np.median(y[rng.integers(0, len(y), (resamples, len(y)))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = by / bx
    ratios = ratios[np.isfinite(ratios)]
    tail = (1 - confidence) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail]) if len(ratios) else (math.nan, math.nan)
    return Interval(my / mx, float(low), float(high))


def run_noise(medians: Sequence[float]) -> float | None:
    """The run-to-run spread of a median: the sample standard deviation of the log
    of the medians of earlier runs (None with fewer than two positive medians)."""
    logs = [math.log(m) for m in medians if m and m > 0]
    if len(logs) < 2:
        return None
    return float(np.std(logs, ddof=1))


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
