"""Per-producer sequence numbers: duplicates are skipped, gaps are reported.

A producer numbers its envelopes 0, 1, 2, ... (``contract``). For each producer of a
cluster the processors keep the last ``seq`` they applied:

- ``seq <= last``: a duplicate (the producer re-sent it, or the raw topic is being
  re-read after a processor crash); it is not applied again.
- ``seq == last + 1``: the next envelope; applied.
- ``seq > last + 1``: envelopes ``last + 1 .. seq - 1`` never arrived; a gap is
  reported and the envelope is applied. For a producer seen for the first time,
  ``last`` is taken as -1, so a first envelope with ``seq > 0`` reports ``0 .. seq - 1``
  missing. An envelope that arrives after its gap was reported is a duplicate by the
  rule above; the gap record stands.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    """Envelopes ``missing_from .. missing_to`` (inclusive) of a producer are lost."""

    producer_id: str
    source: str
    missing_from: int
    missing_to: int

    def record(self, cluster_id: str) -> dict:
        """The GAPS record (``contract.GAP_FIELDS``)."""
        return {
            "cluster_id": cluster_id,
            "producer_id": self.producer_id,
            "source": self.source,
            "missing_from": self.missing_from,
            "missing_to": self.missing_to,
            "detected_at": time.time(),
        }


class ProducerSequences:
    """The last applied ``seq`` of every producer of one cluster."""

    def __init__(self, last: dict[str, list] | None = None):
        #: producer_id -> [source, last applied seq]
        self.last: dict[str, list] = last if last is not None else {}

    def admit(self, producer_id: str, source: str, seq: int) -> tuple[bool, Gap | None]:
        """Whether to apply this envelope, and the gap it reveals (if any).

        An admitted envelope becomes the producer's last one.
        """
        entry = self.last.get(producer_id)
        previous = -1 if entry is None else entry[1]
        if seq <= previous:
            return False, None
        gap = Gap(producer_id, source, previous + 1, seq - 1) if seq > previous + 1 else None
        self.last[producer_id] = [source, seq]
        return True, gap

    def forget(self, producer_id: str) -> None:
        """Drop a producer: if it sends again it is seen for the first time."""
        self.last.pop(producer_id, None)
