"""What :mod:`.regressions` compares and concludes: a run (:class:`Run`), its
profile (:class:`Profile`: per prefix and action, a :class:`Sample` of task seconds),
a change beyond the noise (:class:`Change`), and the comparison of two runs
(:class:`Comparison`: its verdict and the sentences that state it), with the
thresholds the verdicts are held to.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from dask_blackbox.read import noise

#: Family-wise significance of the rank tests (Holm's step-down correction).
ALPHA = 0.05
#: A change a verdict of "within noise" must rule out (a fraction, both ways): an
#: interval that cannot is "inconclusive".
RESOLVE = 0.15
#: A change must move the run's task seconds (compute, transfer, disk) by this fraction
#: at least: a prefix of a few short tasks can double without making a run slower.
MIN_SHARE = 0.01
#: Tasks a side the statistics look at (sampled by ClickHouse beyond that).
SAMPLE = 2000
#: Earlier runs read for the noise (the latest ones).
HISTORY = 20
#: Prefixes shown by name in the runs side by side (the most compute seconds).
TOP_PREFIXES = 8
ACTIONS = ("compute", "transfer", "disk", "waiting")
WORK = ("compute", "transfer", "disk")
#: The critical path's part that corresponds to an action.
_PATH_PART = {"compute": "compute", "transfer": "transfer", "disk": "disk", "waiting": "thread"}


class NotComparable(LookupError):
    """The runs asked for cannot be compared; the message says why."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One run: a span instance (its tree) or a whole cluster's run."""

    cluster_id: str
    cluster_name: str
    #: the span's id, or None for the whole run
    span_id: str | None
    #: when it began (the span's enqueued, or the cluster's first envelope), epoch seconds
    began: float
    #: the span tree's ids, or None for the whole run
    span_ids: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        import datetime

        when = datetime.datetime.fromtimestamp(self.began, datetime.timezone.utc)
        return f"{self.cluster_name} {when:%Y-%m-%d %H:%M:%S}"

    def as_dict(self) -> dict:
        return {"cluster_id": self.cluster_id, "cluster_name": self.cluster_name,
                "span_id": self.span_id, "began": self.began, "label": self.label}


class Sample(NamedTuple):
    """One prefix and action of one run: tasks, exact total seconds, durations (sampled)."""

    n: int
    total: float
    values: np.ndarray

    @property
    def median(self) -> float:
        return float(np.median(self.values)) if len(self.values) else 0.0


class Profile(NamedTuple):
    """What a run is compared by."""

    wall: float | None
    samples: dict[tuple[str, str], Sample]


class Change(NamedTuple):
    """One prefix and action, baseline against candidate."""

    prefix: str
    action: str
    #: "slower", "faster", "within noise", "inconclusive", "too few tasks", "new", "gone"
    verdict: str
    n_base: int
    n_new: int
    median_base: float
    median_new: float
    total_base: float
    total_new: float
    ratio: float
    low: float
    high: float
    p_value: float
    #: the band a ratio must leave (a fraction), and how many earlier runs set it
    band: float
    history: int

    @property
    def delta(self) -> float:
        return self.total_new - self.total_base

    def described(self) -> str:
        """"+4.1 % [-8.2 %, +18.0 %], 10 / 10 tasks": the change, its interval, the tasks."""
        return (f"{self.ratio - 1:+.1%} [{self.low - 1:+.1%}, {self.high - 1:+.1%}], "
                f"{self.n_base} / {self.n_new} tasks")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A candidate run against its baseline, with the verdicts first."""

    what: str
    baseline: Run
    candidate: Run
    history: tuple[Run, ...]
    wall_base: float | None
    wall_new: float | None
    wall_band: float
    changes: tuple[Change, ...]
    culprit: Change | None
    #: the culprit on the candidate's critical path: (links of its prefix with time in
    #: its action, seconds of that action on the path); None when the path is unknown
    on_path: tuple[int, float] | None
    comparisons: int
    notes: tuple[str, ...] = ()
    #: every run read (history, baseline, candidate: oldest first) side by side:
    #: (metric, one value per run) rows -- elapsed_s, task_s, tasks, compute_s <prefix>
    table: tuple[tuple, ...] = ()

    @property
    def wall_verdict(self) -> str:
        if not self.wall_base or not self.wall_new:
            return "unknown"
        ratio = self.wall_new / self.wall_base
        return "slower" if ratio > 1 + self.wall_band else \
            "faster" if ratio < 1 / (1 + self.wall_band) else "within noise"

    @property
    def verdict(self) -> str:
        """"regression" when a prefix and action got slower beyond the noise,
        "improvement" when one got faster and none slower; with neither, the wall
        time's own test: "wall time slower" / "wall time faster" when it left its band
        (no task prefix is blamed: a machine busier one night, time outside the tasks);
        else "inconclusive" when a prefix and action's interval could not rule out a
        change (:data:`RESOLVE`), else "no change beyond noise"."""
        verdicts = {c.verdict for c in self.changes}
        if "slower" in verdicts:
            return "regression"
        if "faster" in verdicts:
            return "improvement"
        if self.wall_verdict in ("slower", "faster"):
            return f"wall time {self.wall_verdict}"
        if "inconclusive" in verdicts:
            return "inconclusive"
        return "no change beyond noise"

    @property
    def method(self) -> str:
        return (f"per prefix and action, the per-task durations of both runs: Mann-Whitney U "
                f"rank test (two-sided, alpha {ALPHA} family-wise, Holm-corrected over "
                f"{self.comparisons} comparisons) and the Hodges-Lehmann ratio with its "
                f"{noise.CONFIDENCE:.0%} confidence interval; a change counts when the test "
                f"rejects and the interval lies beyond the noise band "
                f"({noise.NOISE_SIGMAS:g} run-to-run standard deviations of the median over "
                f"{len(self.history)} earlier run(s) and the baseline, at least "
                f"{noise.MIN_CHANGE:.0%}) and it moves the run's task seconds by "
                f"{MIN_SHARE:.0%} at least; no change is claimed where the interval cannot "
                f"rule out {RESOLVE:.0%} (or the band) either way: inconclusive")

    def sentences(self) -> list[str]:
        """The verdict in words, most important first."""
        out = []
        what = self.what
        base, new = self.baseline.label, self.candidate.label
        if self.wall_base and self.wall_new:
            change = self.wall_new / self.wall_base - 1
            out.append(f"{self.verdict.upper()}: {what} took {_s(self.wall_new)} in {new} "
                       f"against {_s(self.wall_base)} in {base} ({change:+.1%}; wall-time noise "
                       f"band ±{self.wall_band:.0%}: {self.wall_verdict})")
        else:
            out.append(f"{self.verdict.upper()}: {what}, {new} against {base}")
        c = self.culprit
        if c is not None:
            changed = sum(x.delta for x in self.changes if x.delta > 0 and x.action in WORK) or 1.0
            path = ("unknown whether on the critical path" if self.on_path is None
                    else "on the critical path ({} link(s), {} of {} there)".format(
                        self.on_path[0], _s(self.on_path[1]), c.action)
                    if self.on_path[0] else "not on the critical path")
            out.append(f"culprit: prefix {c.prefix!r}, {c.action}: {c.ratio - 1:+.1%} per task "
                       f"(median {_s(c.median_base)} -> {_s(c.median_new)}, interval "
                       f"{c.low - 1:+.1%} .. {c.high - 1:+.1%}, p={c.p_value:.2g}, band "
                       f"±{c.band:.0%}); {_s(c.delta, signed=True)} task seconds, "
                       f"{max(0.0, c.delta) / changed:.0%} of the work that grew; {path}")
        for x in self.changes:
            if x is not c and x.verdict in ("slower", "faster"):
                out.append(f"also {x.verdict}: prefix {x.prefix!r}, {x.action}: "
                           f"{x.ratio - 1:+.1%} per task (interval {x.low - 1:+.1%} .. "
                           f"{x.high - 1:+.1%}, p={x.p_value:.2g})")
        unsure = [x for x in self.changes if x.verdict == "inconclusive"]
        for x in unsure:
            out.append(f"inconclusive: prefix {x.prefix!r}, {x.action}: {x.described()}: the "
                       f"interval spans both the noise band (±{x.band:.0%}) and a change of "
                       f"{max(RESOLVE, x.band):.0%}; more tasks or runs would tell")
        if c is None and self.verdict.startswith("wall time"):
            out.append(f"no prefix and action changed beyond the noise{' it can resolve' if unsure else ''}: "
                       "the wall time moved outside the tasks compared (the scheduler, "
                       "workers lost, a busier machine, tasks that did not finish)")
        elif c is None and self.verdict == "no change beyond noise":
            out.append("no prefix and action changed beyond the noise")
        out += list(self.notes)
        out.append("method: " + self.method)
        return out

    def as_dict(self) -> dict:
        return {"what": self.what, "verdict": self.verdict, "wall_verdict": self.wall_verdict,
                "sentences": self.sentences(), "baseline": self.baseline.as_dict(),
                "candidate": self.candidate.as_dict(),
                "history": [r.as_dict() for r in self.history], "wall_base": self.wall_base,
                "wall_new": self.wall_new, "wall_band": self.wall_band,
                "culprit": self.culprit._asdict() if self.culprit else None,
                "on_critical_path": self.on_path, "method": self.method,
                "changes": [c._asdict() for c in self.changes],
                "runs": [r.label for r in (*self.history, self.baseline, self.candidate)],
                "table": [list(row) for row in self.table]}


def _s(seconds: float, signed: bool = False) -> str:
    sign = ("+" if seconds >= 0 else "-") if signed else ("-" if seconds < 0 else "")
    v = abs(seconds)
    text = f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s" if v < 60 else f"{v / 60:.1f} min"
    return sign + text
