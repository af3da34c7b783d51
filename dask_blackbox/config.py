"""Configuration through ``dask.config``, under the ``blackbox`` section.

Defaults ship in ``blackbox.yaml`` beside this file and are registered on import, the
way Dask's own subprojects do it. Users override them in their Dask YAML files, with
``DASK_BLACKBOX__SECTION__KEY`` environment variables, or with CLI flags (which call
``dask.config.set``). Every accessor validates what it reads and raises
:class:`ConfigError` naming the key and the problem.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import ssl
from typing import Any
from urllib.parse import urlparse

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

_DEFAULTS_FILE = pathlib.Path(__file__).with_name("blackbox.yaml")

with open(_DEFAULTS_FILE) as f:
    # libyaml's safe loader where PyYAML has it (a tenth of the pure-Python one's
    # time, which every command would pay on start): the same documents, the same values
    DEFAULTS: dict = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))

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


def get_seconds(key: str, minimum: float = 0.0) -> float:
    """A duration setting in seconds ("100ms", "1s", 5 are all accepted), at least
    ``minimum`` seconds. Pass a positive ``minimum`` where 0 makes no sense (an
    interval, a timeout): then 0 is refused here, and callers need not re-check."""
    value = get(key)
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"blackbox.{key}: {value!r} is not a duration") from None
    if seconds is None or seconds < 0:
        raise ConfigError(f"blackbox.{key}: {value!r} must be a positive duration")
    if seconds < minimum:
        raise ConfigError(f"blackbox.{key}: {value!r} must be at least {minimum:g}s")
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


def get_int(key: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An integer setting, at least ``minimum`` (and at most ``maximum``)."""
    value = get(key)
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ConfigError(f"blackbox.{key}: {value!r} must be an integer {bound}")
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
    return KafkaSettings.from_config().topic(name)


# ------------------------------------------------------------------ secrets

#: A secret's name in ``name=value``, ``name: value`` or JSON text.
_SECRET_NAMES = (r"(?:password|passwd|pwd|(?<![A-Za-z0-9])pass|token|secret|sasl[-_]password"
                 r"|(?:access|secret|api|private)[-_]?key)")
#: An unquoted value: up to a separator, also across spaces to words that are not the
#: next ``name=``.
_BARE_VALUE = r"[^&\s\",'}]+(?:[ \t]+(?![A-Za-z_][\w.-]*[ \t]*[=:])[^&\s\",'}]+)*"

_SECRET_PATTERNS = (
    # scheme://user:password@host: up to the last @ of the authority, the password
    # may hold spaces and newlines
    (re.compile(r"(?P<pre>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)(?P<secret>[^/?#]*)(?P<post>@)"),
     "***"),
    # Authorization: Basic <base64> (or Bearer, Digest ...): the credentials
    (re.compile(r"(?P<pre>\bauthorization[\"']?\s*[=:]\s*[\"']?(?:[A-Za-z-]+[ \t]+)?)"
                r"(?P<secret>[^\s\"',}]+)(?P<post>)", re.I), "***"),
    # password=..., pass=..., token=..., secret=..., access_key=... in query strings,
    # key=value text, YAML and JSON; a quoted value is hidden whole (newlines and
    # escaped quotes included)
    (re.compile(r"(?P<pre>" + _SECRET_NAMES + r"[\"']?\s*[=:][ \t]*)"
                r"(?P<secret>\"(?:[^\"\\]|\\.)*\"?|'(?:[^'\\]|\\.)*'?|" + _BARE_VALUE
                + r")(?P<post>)", re.I), "***"),
)


def redact(text: Any) -> str:
    """``text`` with every password, token and secret replaced by ``***``: user
    info in URLs (``http://bob:secret@host``, the password may hold spaces and
    newlines), the credentials of an ``Authorization:`` header, and the values of
    ``password``, ``passwd``, ``pwd``, ``pass``, ``token``, ``secret``,
    ``sasl-password``, ``access_key``, ``secret_key``, ``api_key`` and
    ``private_key`` in query strings, ``key=value`` text, YAML and JSON (a quoted
    value whole; an unquoted one across spaces up to the next ``name=``). The one
    redaction used for anything printed, logged, raised or written where others can
    read it."""
    out = str(text)
    for pattern, replacement in _SECRET_PATTERNS:
        out = pattern.sub(lambda m: m.group("pre") + replacement + m.group("post"), out)
    return out


def display_url(url: Any) -> str:
    """``url`` as it may be printed: ``scheme://host[:port]`` and ``/…`` when it has a
    path, query or fragment. Webhook tokens live in paths (Slack, Discord) and query
    strings (``?code=``, ``?sig=``, ``?key=``), credentials before the host: none of
    them is printed. Something that is not a URL with a host prints as ``<not a URL>``."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(str(url).strip())
        host = parts.hostname
    except ValueError:
        return "<not a URL>"
    if not parts.scheme or not host:
        return "<not a URL>"
    try:
        port = "" if parts.port is None else f":{parts.port}"
    except ValueError:
        port = ":<bad port>"
    host = f"[{host}]" if ":" in host else host
    rest = "/…" if parts.path.strip("/") or parts.query or parts.fragment else ""
    return f"{parts.scheme}://{host}{port}{rest}"


# ----------------------------------------------------------------------- Kafka

_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")


#: The broker used when none is configured and no local pipeline runs.
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def running_up() -> dict | None:
    """The run file of a live ``dask-blackbox up`` on this data directory, or None."""
    from dask_blackbox import runfiles

    return runfiles.read(data_dir(), runfiles.UP)


def bootstrap_servers() -> list[str]:
    """``blackbox.kafka.bootstrap-servers`` as a list of ``host:port``.

    When it is not set (null, the default), the broker of a live ``dask-blackbox up``
    on the same data directory is used, and failing that ``127.0.0.1:9092``: a
    configured value always wins."""
    value = get("kafka.bootstrap-servers")
    if value is None:
        value = (running_up() or {}).get("kafka") or DEFAULT_BOOTSTRAP
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


def idempotence() -> bool:
    """``blackbox.kafka.idempotence``: true, false, or auto -- true when the broker
    is that of a running ``dask-blackbox up`` that runs Apache Kafka (its run file
    says ``"broker": "kafka"``), false otherwise (Tansu refuses idempotent
    producers)."""
    value = get("kafka.idempotence", "auto")
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    if str(value).lower() != "auto":
        raise ConfigError(f"blackbox.kafka.idempotence: {value!r} must be true, false or auto")
    if get("kafka.bootstrap-servers") is not None:
        return False
    return (running_up() or {}).get("broker") == "kafka"


def kafka_client_kwargs() -> dict[str, Any]:
    """Connection and security keyword arguments for any aiokafka client, from the
    current config (:meth:`KafkaSettings.client_kwargs`)."""
    return KafkaSettings.from_config().client_kwargs()


def kafka_producer_kwargs() -> dict[str, Any]:
    """:func:`kafka_client_kwargs` plus the ``compression_type`` of every blackbox
    producer (raw envelopes, replays)."""
    return KafkaSettings.from_config().producer_kwargs()


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


def _ssl_context(cafile: str | None, certfile: str | None, keyfile: str | None) -> ssl.SSLContext:
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


def topic_prefix() -> str:
    """``blackbox.kafka.topic-prefix``; when no broker is configured and a local
    ``up`` runs, that pipeline's prefix (see :func:`bootstrap_servers`)."""
    if get("kafka.bootstrap-servers") is None and (up := running_up()) is not None:
        return str(up.get("topic_prefix") or "")
    return str(get("kafka.topic-prefix") or "")


@dataclasses.dataclass(frozen=True)
class KafkaSettings:
    """The ``blackbox.kafka`` section, resolved and validated once; plain picklable
    data (the SSL context is built by :meth:`client_kwargs` where it is used).
    Secrets stay out of ``repr``."""

    bootstrap_servers: tuple[str, ...]
    topic_prefix: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = dataclasses.field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    compression: str | None = "zstd"
    partitions: int = 1
    replication_factor: int = 1
    retention_seconds: float = 86400.0
    #: min.insync.replicas of the topics created (None: the broker's default)
    min_insync_replicas: int | None = None
    #: whether producers of envelopes are idempotent (``blackbox.kafka.idempotence``)
    idempotence: bool = False

    @classmethod
    def from_config(cls) -> KafkaSettings:
        """Read and validate ``blackbox.kafka.*`` (ConfigError naming the key)."""
        protocol = str(get("kafka.security-protocol") or "PLAINTEXT").upper()
        if protocol not in _PROTOCOLS:
            raise ConfigError(
                f"blackbox.kafka.security-protocol: {protocol!r} is not one of {_PROTOCOLS}"
            )
        mechanism = user = password = None
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
            user, password = str(user), str(password)
        cafile, certfile, keyfile = (get(f"kafka.ssl-{k}") for k in ("cafile", "certfile", "keyfile"))
        if protocol in ("SSL", "SASL_SSL"):
            _ssl_context(cafile, certfile, keyfile)  # a bad file fails here, naming its key
        return cls(
            bootstrap_servers=tuple(bootstrap_servers()),
            topic_prefix=topic_prefix(),
            security_protocol=protocol,
            sasl_mechanism=mechanism,
            sasl_username=user,
            sasl_password=password,
            ssl_cafile=cafile,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            compression=compression(),
            partitions=get_int("kafka.partitions"),
            replication_factor=get_int("kafka.replication-factor"),
            retention_seconds=get_seconds("kafka.retention", minimum=1.0),
            min_insync_replicas=(None if get("kafka.min-insync-replicas", None) is None
                                 else get_int("kafka.min-insync-replicas")),
            idempotence=idempotence(),
        )

    def topic(self, name: str) -> str:
        """Full Kafka topic name for a contract topic."""
        from dask_blackbox.contract import topic_name

        return topic_name(self.topic_prefix, name)

    def client_kwargs(self) -> dict[str, Any]:
        """Connection and security keyword arguments for any aiokafka client."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": list(self.bootstrap_servers),
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol.startswith("SASL"):
            kwargs.update(sasl_mechanism=self.sasl_mechanism,
                          sasl_plain_username=self.sasl_username,
                          sasl_plain_password=self.sasl_password)
        if self.security_protocol in ("SSL", "SASL_SSL"):
            kwargs["ssl_context"] = _ssl_context(self.ssl_cafile, self.ssl_certfile,
                                                 self.ssl_keyfile)
        return kwargs

    def producer_kwargs(self) -> dict[str, Any]:
        """:meth:`client_kwargs` plus the ``compression_type`` of blackbox producers."""
        return {**self.client_kwargs(), "compression_type": self.compression}


# ------------------------------------------------------------------ ClickHouse

_DSN_SCHEMES = ("chdb", "http", "https", "clickhouse", "clickhouses")


def clickhouse_dsn() -> str:
    """The ClickHouse DSN, validated; defaults to chDB under the data dir."""
    dsn = get("clickhouse.dsn")
    if not dsn:
        return f"chdb://{data_dir() / 'clickhouse'}"
    dsn = str(dsn)
    parsed = urlparse(dsn)
    shown = redact(dsn)  # error messages never echo the password
    if parsed.scheme not in _DSN_SCHEMES:
        raise ConfigError(
            f"blackbox.clickhouse.dsn: {shown!r} must start with one of "
            + ", ".join(s + "://" for s in _DSN_SCHEMES)
        )
    if parsed.scheme == "chdb":
        if not (parsed.netloc or parsed.path):
            raise ConfigError(f"blackbox.clickhouse.dsn: {shown!r} names no directory")
    else:
        if not parsed.hostname:
            raise ConfigError(f"blackbox.clickhouse.dsn: {shown!r} names no host")
        try:
            parsed.port
        except ValueError:
            raise ConfigError(f"blackbox.clickhouse.dsn: {shown!r} has a bad port") from None
    return dsn


def chdb_path(dsn: str) -> pathlib.Path | None:
    """The directory of a ``chdb://`` DSN, or None for a server DSN."""
    parsed = urlparse(dsn)
    if parsed.scheme != "chdb":
        return None
    return pathlib.Path(os.path.expanduser(parsed.netloc + parsed.path))
