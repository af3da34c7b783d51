"""Per-prefix partials: additive aggregates per (span, prefix, tumbling window).

Every scheduler transition ``start -> finish`` with ``start != finish`` adds to the
open partial of (producer, span of the task's group, task prefix, window of the
transition's ``ts``):

- ``finished[finish] += 1`` (so summed over partials, ``finished`` equals Dask's
  ``TaskPrefix.state_counts``: how many times a task of the prefix entered a state);
- ``n_erred += 1`` when ``finish == "erred"``;
- for ``processing -> memory``: every startstop adds its duration, rounded to whole
  microseconds exactly like ``TaskGroup.add_duration``, to ``durations[action]``
  (summed: ``TaskPrefix.all_durations``); the longest single ``compute`` is
  ``max_duration``; ``nbytes`` grows by the task's change of ``nbytes``
  (summed over a span tree: ``Span.nbytes_total``).

When a partial is closed it is emitted once, with a ``partial_id`` that is a hash of
(cluster, producer, first and last ``seq`` it covers, span, prefix, window): the same
input always closes the same partials, so a replay after a crash emits the same ids
and a sink that keeps one row per ``partial_id`` sums every contribution exactly once.

When partials close (all deterministic in the input, except the idle rule):

- after each envelope, a producer's windows that end at or before its *watermark*
  (the latest event ``ts`` it has sent) close;
- an event whose window is already closed opens a *late* partial, closed at the end of
  the same envelope;
- all windows of a cluster close when its scheduler closes;
- ``close_producer`` closes a producer's windows when it has been silent for longer
  than a window (the processor decides when; whatever it decides is checkpointed
  before it is acknowledged, so replays agree with it).
"""

from __future__ import annotations

import hashlib
import math


class Partial:
    """Aggregates of one (producer, span, prefix, window) over envelopes
    ``first_seq .. last_seq``."""

    __slots__ = (
        "first_seq", "last_seq", "finished", "durations_us", "nbytes", "n_erred",
        "max_compute_us",
    )

    def __init__(self, seq: int):
        self.first_seq = seq
        self.last_seq = seq
        self.finished: dict[str, int] = {}
        self.durations_us: dict[str, int] = {}
        self.nbytes = 0
        self.n_erred = 0
        self.max_compute_us = 0

    def to_list(self) -> list:
        return [self.first_seq, self.last_seq, self.finished, self.durations_us,
                self.nbytes, self.n_erred, self.max_compute_us]

    @classmethod
    def from_list(cls, row: list) -> Partial:
        p = cls(row[0])
        (p.last_seq, p.finished, p.durations_us, p.nbytes, p.n_erred,
         p.max_compute_us) = row[1:]
        return p


#: (producer_id, span_id, prefix, window_start)
PartialKey = tuple[str, "str | None", "str | None", float]


class PrefixWindows:
    """The open partials of one cluster."""

    def __init__(self, width: float):
        if not width > 0:
            raise ValueError(f"prefix window must be a positive duration, got {width!r}")
        self.width = float(width)
        self.open: dict[PartialKey, Partial] = {}
        #: producer_id -> latest event ts seen
        self.watermark: dict[str, float] = {}
        # The key and partial of the previous call: most consecutive transitions
        # go to the same one.
        self._last: tuple | None = None
        # The earliest window start of an open partial (inf: none): a watermark
        # before its end closes nothing, without looking at every partial.
        self._earliest = math.inf

    def partial(
        self, producer_id: str, seq: int, span_id: str | None, prefix: str | None,
        ts: float,
    ) -> Partial:
        """The open partial a transition of envelope ``seq`` at ``ts`` adds to."""
        start = math.floor(ts / self.width) * self.width
        last = self._last
        if (last is not None and last[3] == start and last[2] == prefix
                and last[1] == span_id and last[0] == producer_id):
            p = last[4]
            p.last_seq = seq
            return p
        key = (producer_id, span_id, prefix, start)
        p = self.open.get(key)
        if p is None:
            p = self.open[key] = Partial(seq)
            if start < self._earliest:
                self._earliest = start
        else:
            p.last_seq = seq
        self._last = (producer_id, span_id, prefix, start, p)
        return p

    def advance(self, producer_id: str, ts: float) -> list[tuple[PartialKey, Partial]]:
        """A producer's envelope, whose latest event is at ``ts``, has been applied:
        close its windows that end at or before its watermark."""
        mark = max(ts, self.watermark.get(producer_id, ts))
        self.watermark[producer_id] = mark
        if self._earliest + self.width > mark:
            return []
        return self._close(lambda k: k[0] == producer_id and k[3] + self.width <= mark)

    def close_producer(self, producer_id: str) -> list[tuple[PartialKey, Partial]]:
        return self._close(lambda k: k[0] == producer_id)

    def forget(self, producer_id: str) -> None:
        """Drop a producer's watermark (after :meth:`close_producer`)."""
        self.watermark.pop(producer_id, None)

    def close_all(self) -> list[tuple[PartialKey, Partial]]:
        return self._close(lambda k: True)

    def _close(self, which) -> list[tuple[PartialKey, Partial]]:
        if not self.open:
            return []
        closed = [(k, p) for k, p in self.open.items() if which(k)]
        for k, _ in closed:
            del self.open[k]
        if closed:
            self._last = None
            self._earliest = min((k[3] for k in self.open), default=math.inf)
        return closed

    def to_list(self) -> list:
        return [self.watermark, [[*k, *p.to_list()] for k, p in self.open.items()]]

    def load(self, row: list) -> None:
        self.watermark = row[0]
        self.open = {tuple(r[:4]): Partial.from_list(r[4:]) for r in row[1]}
        self._earliest = min((k[3] for k in self.open), default=math.inf)


def partial_id(cluster_id: str, key: PartialKey, p: Partial) -> str:
    """Deterministic id of a closed partial (see the module docstring)."""
    producer_id, span_id, prefix, window_start = key
    text = "\x1f".join(
        map(str, (cluster_id, producer_id, p.first_seq, p.last_seq, span_id, prefix,
                  repr(window_start)))
    )
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def partial_record(cluster_id: str, cluster_name: str | None, key: PartialKey,
                   p: Partial) -> dict:
    """The PREFIX_STATS record (``contract.PREFIX_STATS_FIELDS``) of a closed partial."""
    _, span_id, prefix, window_start = key
    return {
        "cluster_id": cluster_id,
        "cluster_name": cluster_name,
        "span_id": span_id,
        "prefix": prefix,
        "window_start": window_start,
        "partial_id": partial_id(cluster_id, key, p),
        "finished": p.finished,
        "durations": {a: us / 1e6 for a, us in p.durations_us.items()},
        "nbytes": p.nbytes,
        "n_erred": p.n_erred,
        "max_duration": p.max_compute_us / 1e6,
    }
