"""The sink's settings: every ``blackbox.sink.*`` key (and the Kafka, ClickHouse and
data-dir settings it uses), read and validated once.

:meth:`SinkSettings.from_config` is called once, by sinks.service, before anything
starts; the frozen result is passed down to the consumer and the loader, which read
no configuration of their own. A bad value is a ``ConfigError`` naming the key and
what it must be.
"""

from __future__ import annotations

import dataclasses
import pathlib

from dask_blackbox import clickhouse, config
from dask_blackbox.clickhouse import Target
from dask_blackbox.config import ConfigError, KafkaSettings

#: Points where ``blackbox.sink.debug-pause-at`` can stop the sink (for crash tests):
#: after the ``begin`` journal rows, after the first table's rows, after the
#: ``loaded`` row (before the Kafka commit), and after the Kafka commit.
PAUSE_POINTS = ("after-begin", "between-tables", "after-load", "after-commit")


@dataclasses.dataclass(frozen=True)
class SinkSettings:
    """What the sink runs with; validated on construction."""

    #: ``blackbox.data-dir``: where sink.json (and pause markers) go
    data_dir: pathlib.Path
    #: ``blackbox.clickhouse.dsn``, validated
    dsn: str
    #: ``blackbox.clickhouse.*``: database, retention, cluster
    target: Target
    #: ``blackbox.kafka.*``
    kafka: KafkaSettings
    #: ``blackbox.sink.group-id``: the Kafka consumer group
    group_id: str = "dask-blackbox-sink"
    #: ``blackbox.sink.batch-max-rows``: a batch closes at this many rows...
    batch_max_rows: int = 250_000
    #: ``blackbox.sink.batch-max-wait``: ...or this many seconds after its first message
    batch_max_wait: float = 0.5
    #: ``blackbox.sink.batch-min-wait``: ...or, once the sink has caught up and nothing
    #: is being loaded, this many seconds after its first message
    batch_min_wait: float = 0.05
    #: ``blackbox.sink.retry-backoff-max``: longest wait between retries (ClickHouse,
    #: Kafka commits)
    retry_backoff_max: float = 10.0
    #: ``blackbox.sink.session-timeout``: the consumer group session, in seconds
    session_timeout: float = 10.0
    #: ``blackbox.sink.query-port``: the read side's loopback port (0: any free one)
    query_port: int = 0
    #: ``blackbox.sink.debug-pause-at``: ``(point, n)``, or None (see sinks.loader)
    pause_at: tuple[str, int] | None = None
    #: ``blackbox.sink.metrics-port``: /metrics (None: not served; 0: a free port)
    metrics_port: int | None = None
    #: ``blackbox.sink.metrics-host``
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, str) or not self.group_id:
            raise ConfigError(f"blackbox.sink.group-id: {self.group_id!r} must be a non-empty string")
        if isinstance(self.batch_max_rows, bool) or not isinstance(self.batch_max_rows, int) \
                or self.batch_max_rows < 1:
            raise ConfigError(f"blackbox.sink.batch-max-rows: {self.batch_max_rows!r} must be an "
                              "integer >= 1")
        for key, value in (("batch-max-wait", self.batch_max_wait),
                           ("batch-min-wait", self.batch_min_wait),
                           ("retry-backoff-max", self.retry_backoff_max),
                           ("session-timeout", self.session_timeout)):
            if not value > 0:
                raise ConfigError(f"blackbox.sink.{key}: {value!r} must be a positive duration")
        if not 0 <= self.query_port <= 65535:
            raise ConfigError(f"blackbox.sink.query-port: {self.query_port} is not a TCP port")
        if self.pause_at is not None and (self.pause_at[0] not in PAUSE_POINTS
                                          or self.pause_at[1] < 1):
            raise ConfigError(f"blackbox.sink.debug-pause-at: {self.pause_at!r} is not one of "
                              f"{PAUSE_POINTS} with an optional :<n>")

    @classmethod
    def from_config(cls) -> SinkSettings:
        """Read and validate every setting the sink uses (ConfigError naming the key).
        Creates the data directory, and proves it writable."""
        data_dir = config.data_dir()
        clickhouse.check_writable(data_dir, "blackbox.data-dir")
        return cls(
            data_dir=data_dir,
            dsn=config.clickhouse_dsn(),
            target=Target.from_config(),
            kafka=KafkaSettings.from_config(),
            group_id=config.get("sink.group-id"),
            batch_max_rows=config.get_int("sink.batch-max-rows"),
            batch_max_wait=config.get_seconds("sink.batch-max-wait", minimum=0.001),
            batch_min_wait=config.get_seconds("sink.batch-min-wait", minimum=0.001),
            retry_backoff_max=config.get_seconds("sink.retry-backoff-max", minimum=0.001),
            session_timeout=config.get_seconds("sink.session-timeout", minimum=0.1),
            query_port=config.get_int("sink.query-port", minimum=0),
            pause_at=parse_pause_at(config.get("sink.debug-pause-at", None)),
            metrics_port=(None if config.get("sink.metrics-port", None) is None else
                          config.get_int("sink.metrics-port", minimum=0, maximum=65535)),
            metrics_host=str(config.get("sink.metrics-host", None) or "127.0.0.1"),
        )


def parse_pause_at(setting) -> tuple[str, int] | None:
    """``"<point>[:<n>]"`` as ``(point, n)`` (n defaults to 1); None when unset."""
    if not setting:
        return None
    point, _, n = str(setting).partition(":")
    if point not in PAUSE_POINTS or (n and not n.isdigit()) or (n and int(n) < 1):
        raise ConfigError(f"blackbox.sink.debug-pause-at: {setting!r} is not one of "
                          f"{PAUSE_POINTS} with an optional :<n>")
    return point, int(n or 1)
