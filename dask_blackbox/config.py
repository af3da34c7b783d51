"""Configuration through ``dask.config``, under the ``blackbox`` section.

Defaults ship in ``blackbox.yaml`` beside this file and are registered on import, the
way Dask's own subprojects do it. Users override them in their Dask YAML files, with
``DASK_BLACKBOX__SECTION__KEY`` environment variables, or with CLI flags (which call
``dask.config.set``). Every accessor validates what it reads and raises
:class:`ConfigError` naming the key and the problem.
"""

from __future__ import annotations

import os
import pathlib
import ssl
from typing import Any
from urllib.parse import urlparse

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

_DEFAULTS_FILE = pathlib.Path(__file__).with_name("blackbox.yaml")

with open(_DEFAULTS_FILE) as f:
    DEFAULTS: dict = yaml.safe_load(f)

dask.config.update_defaults(DEFAULTS)


class ConfigError(ValueError):
    """Bad configuration; the message names the ``blackbox.*`` key."""


def get(key: str, default: Any = ...) -> Any:
    """``dask.config.get("blackbox." + key)``; a missing key is a :class:`ConfigError`."""
    try:
        if default is ...:
            return dask.config.get(f"blackbox.{key}")
        return dask.config.get(f"blackbox.{key}", default)
    except KeyError:
        raise ConfigError(f"blackbox.{key} is not set") from None


def get_seconds(key: str) -> float:
    """A duration setting in seconds ("100ms", "1s", 5 are all accepted)."""
    value = get(key)
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"blackbox.{key}: {value!r} is not a duration") from None
    if seconds is None or seconds < 0:
        raise ConfigError(f"blackbox.{key}: {value!r} must be a positive duration")
    return seconds


def get_bytes(key: str) -> int:
    """A size setting in bytes ("64MiB", "16KiB", 1000 are all accepted)."""
    value = get(key)
    try:
        n = value if isinstance(value, int) else parse_bytes(value)
    except (ValueError, TypeError):
        raise ConfigError(f"blackbox.{key}: {value!r} is not a size") from None
    if n <= 0:
        raise ConfigError(f"blackbox.{key}: {value!r} must be a positive size")
    return n


def get_int(key: str, minimum: int = 1) -> int:
    """An integer setting, at least ``minimum``."""
    value = get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"blackbox.{key}: {value!r} must be an integer >= {minimum}")
    return value


def data_dir() -> pathlib.Path:
    """Where the local pipeline keeps its files (not created here)."""
    configured = get("data-dir")
    if configured:
        return pathlib.Path(os.path.expanduser(str(configured)))
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return pathlib.Path(base) / "dask-blackbox"


def topic(name: str) -> str:
    """Full Kafka topic name for a contract topic (see ``dask_blackbox.contract``)."""
    from dask_blackbox.contract import topic_name

    return topic_name(str(get("kafka.topic-prefix") or ""), name)


# ----------------------------------------------------------------------- Kafka

_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")


def bootstrap_servers() -> list[str]:
    """``blackbox.kafka.bootstrap-servers`` as a list of ``host:port``."""
    value = get("kafka.bootstrap-servers")
    servers = value.split(",") if isinstance(value, str) else list(value or ())
    servers = [s.strip() for s in servers if str(s).strip()]
    if not servers:
        raise ConfigError("blackbox.kafka.bootstrap-servers is empty")
    for s in servers:
        host, sep, port = s.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"blackbox.kafka.bootstrap-servers: {s!r} is not host:port"
            )
    return servers


def kafka_client_kwargs() -> dict[str, Any]:
    """Connection and security keyword arguments for any aiokafka client."""
    protocol = str(get("kafka.security-protocol") or "PLAINTEXT").upper()
    if protocol not in _PROTOCOLS:
        raise ConfigError(
            f"blackbox.kafka.security-protocol: {protocol!r} is not one of {_PROTOCOLS}"
        )
    kwargs: dict[str, Any] = {
        "bootstrap_servers": bootstrap_servers(),
        "security_protocol": protocol,
    }
    if protocol.startswith("SASL"):
        mechanism = str(get("kafka.sasl-mechanism") or "").upper()
        if mechanism not in _SASL_MECHANISMS:
            raise ConfigError(
                f"blackbox.kafka.sasl-mechanism: {mechanism or None!r} must be one of "
                f"{_SASL_MECHANISMS} with security-protocol {protocol}"
            )
        user, password = get("kafka.sasl-username"), get("kafka.sasl-password")
        if not user or password is None:
            raise ConfigError(
                "blackbox.kafka.sasl-username and sasl-password are required with "
                f"security-protocol {protocol}"
            )
        kwargs.update(
            sasl_mechanism=mechanism,
            sasl_plain_username=str(user),
            sasl_plain_password=str(password),
        )
    if protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = _ssl_context()
    return kwargs


def kafka_producer_kwargs() -> dict[str, Any]:
    """:func:`kafka_client_kwargs` plus the ``compression_type`` of every blackbox
    producer (raw envelopes, replays)."""
    return {**kafka_client_kwargs(), "compression_type": compression()}


def compression() -> str | None:
    """``blackbox.kafka.compression`` as aiokafka's ``compression_type`` (None for
    none), checked against the codecs this process has."""
    name = str(get("kafka.compression") or "none").lower()
    if name not in _COMPRESSIONS:
        raise ConfigError(f"blackbox.kafka.compression: {name!r} is not one of {_COMPRESSIONS}")
    if name == "none":
        return None
    from aiokafka import codec

    if not getattr(codec, f"has_{name}")():
        raise ConfigError(
            f"blackbox.kafka.compression: {name} needs the cramjam package "
            "(pip install cramjam), or set it to gzip or none"
        )
    return name


def _ssl_context() -> ssl.SSLContext:
    cafile, certfile, keyfile = (
        get(f"kafka.ssl-{k}") for k in ("cafile", "certfile", "keyfile")
    )
    for key, path in (("cafile", cafile), ("certfile", certfile), ("keyfile", keyfile)):
        if path and not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(f"blackbox.kafka.ssl-{key}: no file at {path!r}")
    if keyfile and not certfile:
        raise ConfigError("blackbox.kafka.ssl-keyfile needs blackbox.kafka.ssl-certfile")
    context = ssl.create_default_context(
        cafile=os.path.expanduser(cafile) if cafile else None
    )
    if certfile:
        context.load_cert_chain(
            os.path.expanduser(certfile),
            os.path.expanduser(keyfile) if keyfile else None,
        )
    return context


# ------------------------------------------------------------------ ClickHouse

_DSN_SCHEMES = ("chdb", "http", "https", "clickhouse", "clickhouses")


def clickhouse_dsn() -> str:
    """The ClickHouse DSN, validated; defaults to chDB under the data dir."""
    dsn = get("clickhouse.dsn")
    if not dsn:
        return f"chdb://{data_dir() / 'clickhouse'}"
    dsn = str(dsn)
    parsed = urlparse(dsn)
    if parsed.scheme not in _DSN_SCHEMES:
        raise ConfigError(
            f"blackbox.clickhouse.dsn: {dsn!r} must start with one of "
            + ", ".join(s + "://" for s in _DSN_SCHEMES)
        )
    if parsed.scheme == "chdb":
        if not (parsed.netloc or parsed.path):
            raise ConfigError(f"blackbox.clickhouse.dsn: {dsn!r} names no directory")
    else:
        if not parsed.hostname:
            raise ConfigError(f"blackbox.clickhouse.dsn: {dsn!r} names no host")
        try:
            parsed.port
        except ValueError:
            raise ConfigError(f"blackbox.clickhouse.dsn: {dsn!r} has a bad port") from None
    return dsn


def chdb_path(dsn: str) -> pathlib.Path | None:
    """The directory of a ``chdb://`` DSN, or None for a server DSN."""
    parsed = urlparse(dsn)
    if parsed.scheme != "chdb":
        return None
    return pathlib.Path(os.path.expanduser(parsed.netloc + parsed.path))
