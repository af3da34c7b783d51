"""What one processor holds at most, so that a flood degrades instead of swamping it.

Two settings bound a processor's memory whatever arrives:

- ``processors.max-live-clusters``: clusters held at once. The envelope of a cluster
  the processor does not hold yet, while it holds that many, is refused
  (:class:`ClusterAdmission`): the cluster's first refused envelope becomes one dead
  letter naming the setting, and every refused envelope is counted
  (``refused_envelopes``; ``refused_clusters`` counts the clusters). A refused cluster
  stays refused while the processor remembers it (as many as the bound), so it never
  gets derived figures that start in its middle; its raw events still reach
  ClickHouse through the sink.
- ``processors.max-live-keys-total``: live task keys held across all the processor's
  clusters (:class:`KeyBudget`), on top of each cluster's ``max-live-keys``. Past it a
  new key is not tracked, exactly as past ``max-live-keys`` (the cluster is marked
  ``overflowed``, its later transitions count as new tasks), and each such key is
  counted (``refused_keys``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

logger = logging.getLogger(__name__)


class KeyBudget:
    """Live keys held by every span tree of one processor, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: keys held now
        self.used = 0
        #: keys refused because the budget was spent
        self.refused = 0
        self._warned = False

    def take(self) -> bool:
        """One more key, if the budget allows (then True)."""
        if self.used < self.limit:
            self.used += 1
            return True
        self.refused += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "this processor holds %d live task keys (blackbox.processors."
                "max-live-keys-total): new keys are no longer tracked, so their clusters' "
                "later transitions count as new tasks (counted as refused_keys)", self.limit)
        return False

    def give_back(self, n: int = 1) -> None:
        self.used = max(0, self.used - n)


class ClusterAdmission:
    """Decides whether a cluster the processor does not hold may start: while fewer
    than ``limit`` are held. Remembers up to ``limit`` refused clusters (the oldest
    forgotten first), which stay refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._refused: OrderedDict[str, None] = OrderedDict()

    def admit(self, cluster_id: str, held: int) -> tuple[bool, bool]:
        """``(admitted, first refusal)`` for a cluster not held, ``held`` being how
        many are."""
        if cluster_id in self._refused:
            return False, False
        if held < self.limit:
            return True, False
        self._refused[cluster_id] = None
        if len(self._refused) > self.limit:
            self._refused.popitem(last=False)
        return False, True

    def reason(self, cluster_id: str) -> str:
        return (f"cluster {cluster_id} refused: this processor already holds "
                f"blackbox.processors.max-live-clusters={self.limit} live clusters; its "
                "envelopes are not processed (no span or prefix figures for it), its raw "
                "events are still loaded")
