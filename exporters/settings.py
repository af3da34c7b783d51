"""The exporters' settings: every ``blackbox.exporter.*`` key, read and validated once.

:meth:`ExporterSettings.from_config` is called once, before anything starts (by the
continuous exporter's service, or by ``dask-blackbox export otlp`` with the endpoint
it was given); the frozen result travels down, and nothing below reads configuration.
A bad value is a ``ConfigError`` naming the key and what it must be.
"""

from __future__ import annotations

import dataclasses
import pathlib
from urllib.parse import urlparse

from dask_blackbox import config
from dask_blackbox.config import ConfigError, KafkaSettings

#: The OTLP transports, as OpenTelemetry names them (OTEL_EXPORTER_OTLP_PROTOCOL).
PROTOCOLS = ("http/protobuf", "grpc")
#: Points where ``blackbox.exporter.debug-pause-at`` can stop the exporter: after a
#: batch of Kafka messages is journalled (its offsets with it), and after an export
#: request was acknowledged and the journal has forgotten what it sent.
PAUSE_POINTS = ("after-journal", "after-export")


def check_endpoint(endpoint: str, protocol: str, key: str = "blackbox.exporter.endpoint") -> str:
    """``endpoint`` if it is an http(s) URL with a host, else a ConfigError naming
    ``key``; a trailing ``/`` is removed, and so is ``/v1/traces`` or ``/v1/logs``
    (the signal's path is added to the base URL, never doubled)."""
    shown = config.display_url(endpoint)
    try:
        parsed = urlparse(str(endpoint))
        parsed.port
    except ValueError as e:
        raise ConfigError(f"{key}: {shown!r} is not a URL: {e} "
                          "(e.g. http://127.0.0.1:4318, http://[::1]:4318)") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{key}: {shown!r} is not an http:// or https:// "
                          "URL with a host (e.g. http://127.0.0.1:4318)")
    base = str(endpoint).rstrip("/")
    for suffix in ("/v1/traces", "/v1/logs"):
        if base.endswith(suffix):
            base = base[:-len(suffix)]
    if protocol == "grpc" and urlparse(base).path not in ("", "/"):
        raise ConfigError(f"{key}: {shown!r}: a gRPC endpoint is host:port only (no path)")
    return base


def parse_pause_at(setting) -> tuple[str, int] | None:
    """``"<point>[:<n>]"`` as ``(point, n)``; None when unset."""
    if not setting:
        return None
    point, _, n = str(setting).partition(":")
    if point not in PAUSE_POINTS or (n and (not n.isdigit() or int(n) < 1)):
        raise ConfigError(f"blackbox.exporter.debug-pause-at: {setting!r} is not one of "
                          f"{PAUSE_POINTS} with an optional :<n>")
    return point, int(n or 1)


@dataclasses.dataclass(frozen=True)
class OtlpSettings:
    """Where and how to send: what both the on-demand export and the continuous
    exporter need."""

    #: ``blackbox.exporter.endpoint``
    endpoint: str
    #: ``blackbox.exporter.protocol``: http/protobuf or grpc
    protocol: str = "http/protobuf"
    #: ``blackbox.exporter.headers``
    headers: tuple[tuple[str, str], ...] = ()
    #: ``blackbox.exporter.timeout``: one request, the SDK's retries included
    timeout: float = 10.0
    #: ``blackbox.exporter.max-task-spans``
    max_task_spans: int = 10_000
    #: ``blackbox.exporter.batch-max-spans``
    batch_max_spans: int = 512
    #: ``blackbox.exporter.batch-max-bytes``: a request's protobuf encoding, at most
    batch_max_bytes: int = 3 * 2**20
    #: ``blackbox.exporter.logs``
    logs: bool = True

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"blackbox.exporter.protocol: {self.protocol!r} is not one of "
                              f"{', '.join(PROTOCOLS)}")
        check_endpoint(self.endpoint, self.protocol)
        if not self.timeout > 0:
            raise ConfigError(f"blackbox.exporter.timeout: {self.timeout!r} must be a positive duration")

    @classmethod
    def from_config(cls, endpoint: str | None = None, protocol: str | None = None) -> OtlpSettings:
        """The ``blackbox.exporter.*`` settings; ``endpoint``/``protocol`` override them
        (the CLI's flags). A ConfigError names what is missing or wrong."""
        protocol = str(protocol or config.get("exporter.protocol") or "http/protobuf").lower()
        endpoint = endpoint or config.get("exporter.endpoint")
        if not endpoint:
            raise ConfigError("blackbox.exporter.endpoint is not set: name the OTLP receiver "
                              "(e.g. --endpoint http://127.0.0.1:4318)")
        headers = config.get("exporter.headers") or {}
        if not isinstance(headers, dict):
            raise ConfigError(f"blackbox.exporter.headers: {config.redact(headers)!r} must be a "
                              "mapping of header names to values")
        return cls(
            endpoint=check_endpoint(endpoint, protocol),
            protocol=protocol,
            headers=tuple((str(k), str(v)) for k, v in headers.items()),
            timeout=config.get_seconds("exporter.timeout", minimum=0.001),
            max_task_spans=config.get_int("exporter.max-task-spans", minimum=0),
            batch_max_spans=config.get_int("exporter.batch-max-spans"),
            batch_max_bytes=config.get_bytes("exporter.batch-max-bytes"),
            logs=bool(config.get("exporter.logs")),
        )


@dataclasses.dataclass(frozen=True)
class ExporterSettings:
    """What the continuous exporter runs with."""

    otlp: OtlpSettings
    kafka: KafkaSettings
    #: ``blackbox.data-dir``: the journal lives in ``<data-dir>/exporter/``
    data_dir: pathlib.Path
    #: ``blackbox.exporter.group-id``
    group_id: str = "dask-blackbox-exporter"
    #: ``blackbox.exporter.backlog-max``
    backlog_max: int = 100_000
    #: ``blackbox.exporter.retry-backoff-max``
    retry_backoff_max: float = 30.0
    #: ``blackbox.exporter.settle``
    settle: float = 5.0
    #: ``blackbox.exporter.idle-timeout``
    idle_timeout: float = 3600.0
    #: ``blackbox.exporter.span-quiet`` (None: only at the run's end)
    span_quiet: float | None = 300.0
    #: ``blackbox.exporter.metrics-port`` (None: no /metrics)
    metrics_port: int | None = None
    #: ``blackbox.exporter.metrics-host``
    metrics_host: str = "127.0.0.1"
    #: ``blackbox.exporter.debug-pause-at``
    pause_at: tuple[str, int] | None = None

    @property
    def journal_dir(self) -> pathlib.Path:
        return self.data_dir / "exporter"

    @classmethod
    def from_config(cls) -> ExporterSettings:
        """Every setting the continuous exporter uses (ConfigError naming the key);
        creates the data directory and proves it writable."""
        from dask_blackbox import clickhouse

        data_dir = config.data_dir()
        clickhouse.check_writable(data_dir, "blackbox.data-dir")
        group = config.get("exporter.group-id")
        if not isinstance(group, str) or not group:
            raise ConfigError(f"blackbox.exporter.group-id: {group!r} must be a non-empty string")
        quiet = config.get("exporter.span-quiet")
        port = config.get("exporter.metrics-port")
        return cls(
            otlp=OtlpSettings.from_config(),
            kafka=KafkaSettings.from_config(),
            data_dir=data_dir,
            group_id=group,
            backlog_max=config.get_int("exporter.backlog-max"),
            retry_backoff_max=config.get_seconds("exporter.retry-backoff-max", minimum=0.001),
            settle=config.get_seconds("exporter.settle"),
            idle_timeout=config.get_seconds("exporter.idle-timeout", minimum=0.001),
            span_quiet=None if quiet is None else config.get_seconds("exporter.span-quiet"),
            metrics_port=None if port is None else config.get_int("exporter.metrics-port",
                                                                   minimum=0, maximum=65535),
            metrics_host=str(config.get("exporter.metrics-host") or "127.0.0.1"),
            pause_at=parse_pause_at(config.get("exporter.debug-pause-at", None)),
        )
