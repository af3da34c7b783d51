"""The processors' settings: ``blackbox.processors.*`` and ``blackbox.kafka.*``,
resolved from ``dask.config`` once and validated (:meth:`ProcessorSettings.from_config`).

Nothing else in the stream processors reads the configuration: the faust app
(:mod:`.app`) is built from one :class:`ProcessorSettings`, and hands the parts each
piece needs to :class:`~.processor.Processor` and :class:`~.cluster.ClusterState`.
"""

from __future__ import annotations

import dataclasses

from dask_blackbox import config
from dask_blackbox.config import ConfigError, KafkaSettings


@dataclasses.dataclass(frozen=True)
class ProcessorSettings:
    """Everything the processors are configured with (durations in seconds)."""

    #: ``processors.app-id``: the faust app id, also its consumer group and the
    #: prefix of its changelog topic
    app_id: str
    #: ``processors.prefix-window``: tumbling window of the prefix partials
    prefix_window: float
    #: ``processors.snapshot-interval``: span snapshots are published this often
    snapshot_interval: float
    #: ``processors.finished-cluster-ttl``: a cluster is forgotten this long after
    #: its scheduler_close was applied
    finished_cluster_ttl: float
    #: ``processors.idle-cluster-ttl``: a cluster none of whose producers sent
    #: anything for this long is forgotten even without scheduler_close, and a
    #: producer silent this long is forgotten by its cluster
    idle_cluster_ttl: float
    #: ``processors.max-live-keys``: live task keys tracked per cluster
    max_live_keys: int
    #: ``processors.max-live-clusters``: clusters one processor holds at once; a new
    #: cluster past it is refused (:mod:`.bounds`)
    max_live_clusters: int
    #: ``processors.max-live-keys-total``: live task keys one processor tracks across
    #: its clusters (:mod:`.bounds`)
    max_live_keys_total: int
    #: ``processors.batch-max-envelopes`` and ``batch-max-wait``: raw messages
    #: processed and checkpointed together, and the longest wait for a batch to fill
    batch_max_envelopes: int
    batch_max_wait: float
    #: ``processors.session-timeout``: the consumer group's session timeout
    session_timeout: float
    #: ``processors.commit-interval``: processed raw offsets are committed this often
    commit_interval: float
    kafka: KafkaSettings

    def __post_init__(self) -> None:
        if not self.app_id or not isinstance(self.app_id, str):
            raise ConfigError(
                f"blackbox.processors.app-id: {self.app_id!r} must be a name")
        for name, minimum in (("prefix_window", 0), ("snapshot_interval", 0),
                              ("batch_max_wait", 0), ("finished_cluster_ttl", 0),
                              ("idle_cluster_ttl", 0), ("session_timeout", 1),
                              ("commit_interval", 0)):
            value = getattr(self, name)
            if not value > minimum if minimum == 0 else not value >= minimum:
                key = name.replace("_", "-")
                bound = "more than 0s" if minimum == 0 else f"at least {minimum}s"
                raise ConfigError(f"blackbox.processors.{key}: {value!r}s must be {bound}")
        for name in ("max_live_keys", "batch_max_envelopes", "max_live_clusters",
                     "max_live_keys_total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                key = name.replace("_", "-")
                raise ConfigError(
                    f"blackbox.processors.{key}: {value!r} must be an integer >= 1")

    @property
    def sweep_interval(self) -> float:
        """How often :meth:`.processor.Processor.tick` looks at every cluster (the
        time-driven work: closing idle producers' partials, the TTLs); in between it
        looks only at the clusters that changed: a tenth of the shortest of
        prefix-window, idle-cluster-ttl and finished-cluster-ttl, at least
        snapshot-interval."""
        shortest = min(self.prefix_window, self.idle_cluster_ttl, self.finished_cluster_ttl)
        return max(self.snapshot_interval, shortest / 10)

    @classmethod
    def from_config(cls) -> ProcessorSettings:
        """Read and validate the settings (a ConfigError names the key to fix)."""
        # a positive minimum refuses 0 where it makes no sense
        tiny = 1e-3
        return cls(
            app_id=config.get("processors.app-id"),
            prefix_window=config.get_seconds("processors.prefix-window", minimum=tiny),
            snapshot_interval=config.get_seconds("processors.snapshot-interval",
                                                 minimum=tiny),
            finished_cluster_ttl=config.get_seconds("processors.finished-cluster-ttl",
                                                    minimum=tiny),
            idle_cluster_ttl=config.get_seconds("processors.idle-cluster-ttl",
                                                minimum=tiny),
            max_live_keys=config.get_int("processors.max-live-keys"),
            max_live_clusters=config.get_int("processors.max-live-clusters"),
            max_live_keys_total=config.get_int("processors.max-live-keys-total"),
            batch_max_envelopes=config.get_int("processors.batch-max-envelopes"),
            batch_max_wait=config.get_seconds("processors.batch-max-wait", minimum=tiny),
            session_timeout=config.get_seconds("processors.session-timeout", minimum=1.0),
            commit_interval=config.get_seconds("processors.commit-interval", minimum=tiny),
            kafka=KafkaSettings.from_config(),
        )
