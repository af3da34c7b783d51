"""The producers' settings, resolved once and carried inside the plugin objects.

Plugins are pickled from the client to the scheduler and the workers, whose own Dask
configuration may differ from the client's. So the ``blackbox.*`` values, the broker's
included (:meth:`dask_blackbox.config.KafkaSettings.from_config`), are read and validated
where the plugin is *built* (the client for :func:`producers.attach`, the Dask process
itself for ``--preload``) and travel with it as plain data.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dask.config

from dask_blackbox import config
from dask_blackbox.contract import MAX_ENVELOPE_BYTES, RAW
from dask_blackbox.config import ConfigError, KafkaSettings

#: Largest accepted ``blackbox.producer.max-value-bytes``: several must fit in an envelope.
MAX_VALUE_BYTES_LIMIT = MAX_ENVELOPE_BYTES // 8


@dataclass(frozen=True)
class Recorded:
    """What ``blackbox.producer.record`` says to record (each a bool)."""

    transitions: bool = True
    worker_transitions: bool = False
    graphs: bool = True
    events: bool = True
    metrics: bool = True
    fine_metrics: bool = True
    logs: bool = True
    profiles: bool = True

    @classmethod
    def from_config(cls) -> Recorded:
        section = config.get("producer.record")
        if not isinstance(section, Mapping):
            raise ConfigError(f"blackbox.producer.record: {section!r} must be a mapping of "
                              "kinds to true or false")
        values = {}
        for key, value in section.items():
            name = str(key).replace("-", "_")
            if name not in cls.__dataclass_fields__:
                kinds = ", ".join(f.replace("_", "-") for f in cls.__dataclass_fields__)
                raise ConfigError(f"blackbox.producer.record.{key} is not a kind of record "
                                  f"(one of {kinds})")
            if not isinstance(value, bool):
                raise ConfigError(f"blackbox.producer.record.{key}: {value!r} must be true "
                                  "or false")
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class ProducerSettings:
    """Validated ``blackbox.*`` values a producer needs, as plain picklable data."""

    cluster_name: str | None
    kafka: KafkaSettings
    raw_topic: str
    buffer_max_events: int
    buffer_max_bytes: int
    flush_interval: float
    metrics_interval: float
    graph_max_tasks: int
    max_value_bytes: int
    record: Recorded
    #: ``(logger name, level)`` of the loggers shipped, the most specific first, "root" last
    loggers: tuple[tuple[str, int], ...]
    close_timeout: float
    reconnect_backoff_max: float

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | None = None,
                cluster_name: str | None = None) -> ProducerSettings:
        """Read the current Dask config with ``overrides`` on top: ``blackbox.*`` keys
        relative to ``blackbox.``, dotted (``{"producer.flush-interval": "50ms"}``) or
        nested (``{"producer": {"flush-interval": "50ms"}}``). An unknown key or a bad
        value raises :class:`~dask_blackbox.config.ConfigError` naming it."""
        flat = {f"blackbox.{k}": v for k, v in _flatten(overrides or {}).items()}
        for key in flat:
            _check_known(key)
        # A logger's name may hold dots: one entry of the mapping, not nested keys.
        named = {key[len(_LOGGERS):]: flat.pop(key) for key in list(flat)
                 if key[:len(_LOGGERS)].replace("_", "-") == _LOGGERS}
        if named:
            flat["blackbox.producer.loggers"] = {**config.get("producer.loggers"), **named}
        if cluster_name is not None:
            flat["blackbox.cluster-name"] = cluster_name
        with dask.config.set(flat):
            kafka = KafkaSettings.from_config()  # validated here, not remotely
            name = config.get("cluster-name")
            max_value_bytes = config.get_bytes("producer.max-value-bytes")
            if max_value_bytes > MAX_VALUE_BYTES_LIMIT:
                raise ConfigError(f"blackbox.producer.max-value-bytes: {max_value_bytes} is "
                                  f"larger than {MAX_VALUE_BYTES_LIMIT} (an eighth of an envelope)")
            return cls(
                cluster_name=str(name) if name else None,
                kafka=kafka,
                raw_topic=kafka.topic(RAW),
                buffer_max_events=config.get_int("producer.buffer-max-events"),
                buffer_max_bytes=config.get_bytes("producer.buffer-max-bytes"),
                flush_interval=config.get_seconds("producer.flush-interval", minimum=0.001),
                metrics_interval=config.get_seconds("producer.metrics-interval", minimum=0.001),
                graph_max_tasks=config.get_int("producer.graph-max-tasks", minimum=0),
                max_value_bytes=max_value_bytes,
                record=Recorded.from_config(),
                loggers=_loggers(config.get("producer.loggers")),
                close_timeout=config.get_seconds("producer.close-timeout"),
                reconnect_backoff_max=config.get_seconds("producer.reconnect-backoff-max",
                                                         minimum=0.05),
            )


def _flatten(overrides: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"blackbox override key {key!r} is not a setting name")
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_LOGGERS = "blackbox.producer.loggers."


def _check_known(key: str) -> None:
    """A ConfigError unless ``key`` (``blackbox.x.y``) is a shipped setting, or under one
    whose value maps names of the user's choosing (``blackbox.producer.loggers``)."""
    canonical = key.replace("_", "-")
    if canonical.startswith(_LOGGERS):
        return
    node: Any = config.DEFAULTS
    for part in canonical.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{key} is not a dask-blackbox setting")
        node = node[part]


def _loggers(section: Any) -> tuple[tuple[str, int], ...]:
    """``blackbox.producer.loggers`` as ``(name, level)``, the most specific first."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"blackbox.producer.loggers: {section!r} must be a mapping of "
                          "logger names to levels")
    out = []
    for name, value in section.items():
        if value is None or value is False:
            continue
        level = logging.getLevelName(value.upper()) if isinstance(value, str) else value
        if isinstance(level, bool) or not isinstance(level, int):
            raise ConfigError(f"blackbox.producer.loggers.{name}: {value!r} is not a logging "
                              "level (DEBUG, INFO, WARNING, ERROR, CRITICAL or a number)")
        out.append((str(name), level))
    # longest name first, "root" last: the first that matches a record's logger wins
    return tuple(sorted(out, key=lambda e: (e[0] == "root", -e[0].count("."), -len(e[0]))))
