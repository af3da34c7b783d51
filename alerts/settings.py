"""The alerter's settings: ``blackbox.alerts.*`` (and the Kafka and data-dir settings
it uses), read and validated once by :meth:`AlertSettings.from_config`. A bad value
is a ``ConfigError`` naming the key (``blackbox.alerts.rules[2].causes``) and what it
must be."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from dask_blackbox import config
from dask_blackbox.causes import Cause
from dask_blackbox.config import ConfigError, KafkaSettings

#: What a rule watches for: the alerter watches the stream for the first three;
#: ``dask-blackbox compare --alert`` raises a regression (the runs are in ClickHouse).
WORKER_DIED, KILLED_WORKER, TASK_ERRED = "worker-died", "killed-worker", "task-erred"
REGRESSION = "regression"
STREAM_KINDS = (WORKER_DIED, KILLED_WORKER, TASK_ERRED)
KINDS = (*STREAM_KINDS, REGRESSION)
#: The causes a worker-died rule matches when it names none: every death.
DEATH_CAUSES = tuple(c.value for c in Cause if c.is_death)
#: Points where ``blackbox.alerts.debug-pause-at`` can stop the alerter (crash tests).
PAUSE_POINTS = ("after-outbox", "after-delivery")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_RULE_KEYS = frozenset({"name", "when", "causes", "prefix", "span", "cluster", "webhook", "command"})


@dataclasses.dataclass(frozen=True)
class Rule:
    """One alert rule: what it matches, and where its incidents go."""

    name: str
    when: str
    #: worker-died: the causes that match (Cause values)
    causes: tuple[str, ...] = DEATH_CAUSES
    #: task-erred: task prefixes, and/or a span (a tag, or a '/'-joined path);
    #: regression: only comparisons of this span (None: any comparison)
    prefixes: tuple[str, ...] = ()
    span: str | None = None
    #: only clusters with this name or id (None: every cluster)
    cluster: str | None = None
    #: exactly one of these: a URL to POST to, or a command (argv)
    webhook: str | None = None
    command: tuple[str, ...] | None = None

    @property
    def target(self) -> str:
        """The target as a person reads it: a webhook as ``scheme://host:port/…``
        (tokens live in webhook paths and query strings, credentials before the host)."""
        if self.webhook:
            return f"webhook {config.display_url(self.webhook)}"
        return f"command {shlex.join(self.command or ())}"

    def matches_cluster(self, cluster_id: str, cluster_name: str | None) -> bool:
        return self.cluster is None or self.cluster in (cluster_id, cluster_name)

    @classmethod
    def parse(cls, raw: Any, i: int) -> Rule:
        """A rule from its config mapping (``i``: its index, for the error message)."""
        where = f"blackbox.alerts.rules[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: {raw!r} must be a mapping (name, when, webhook or command...)")
        unknown = sorted(set(map(str, raw)) - _RULE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; a rule has "
                              f"{', '.join(sorted(_RULE_KEYS))}")
        name = raw.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"{where}.name: {name!r} must be 1-100 letters, digits, '_', '.' or '-'")
        where = f"blackbox.alerts.rules[{i}] ({name})"
        when = raw.get("when")
        if when not in KINDS:
            raise ConfigError(f"{where}.when: {when!r} must be one of {', '.join(KINDS)}")
        causes = raw.get("causes")
        if causes is not None and when != WORKER_DIED:
            raise ConfigError(f"{where}.causes: only a {WORKER_DIED} rule has causes")
        if causes is None:
            causes = DEATH_CAUSES
        if isinstance(causes, str):
            causes = [causes]
        valid = [c.value for c in Cause]
        if not isinstance(causes, (list, tuple)) or not causes or any(c not in valid for c in causes):
            raise ConfigError(f"{where}.causes: {raw.get('causes')!r} must name causes among "
                              f"{', '.join(valid)}")
        prefixes = raw.get("prefix")
        if isinstance(prefixes, str):
            prefixes = [prefixes]
        if prefixes is not None and (not isinstance(prefixes, (list, tuple)) or not prefixes
                                     or not all(isinstance(p, str) and p for p in prefixes)):
            raise ConfigError(f"{where}.prefix: {raw.get('prefix')!r} must be a task prefix or a list of them")
        span = raw.get("span")
        if span is not None and (not isinstance(span, str) or not span):
            raise ConfigError(f"{where}.span: {span!r} must be a span tag or a path like etl/load")
        if prefixes and when != TASK_ERRED:
            raise ConfigError(f"{where}: prefix belongs to a {TASK_ERRED} rule")
        if span and when not in (TASK_ERRED, REGRESSION):
            raise ConfigError(f"{where}: span belongs to a {TASK_ERRED} or {REGRESSION} rule")
        if when == TASK_ERRED and not (prefixes or span):
            raise ConfigError(f"{where}: a {TASK_ERRED} rule names a prefix or a span")
        cluster = raw.get("cluster")
        if cluster is not None and (not isinstance(cluster, str) or not cluster):
            raise ConfigError(f"{where}.cluster: {cluster!r} must be a cluster name or id")
        webhook, command = raw.get("webhook"), raw.get("command")
        if (webhook is None) == (command is None):
            raise ConfigError(f"{where}: give exactly one of webhook (a URL) or command")
        if webhook is not None:
            webhook = _check_webhook(webhook, f"{where}.webhook")
        if command is not None:
            if isinstance(command, str):
                try:
                    command = shlex.split(command)
                except ValueError as e:
                    raise ConfigError(f"{where}.command: {command!r} is not a command line: "
                                      f"{e} (quote it as a shell would, or give a list)") from None
            if (not isinstance(command, (list, tuple)) or not command
                    or not all(isinstance(a, str) for a in command)):
                raise ConfigError(f"{where}.command: {raw.get('command')!r} must be a command line "
                                  "or a list of arguments")
            if any("\x00" in a for a in command):
                raise ConfigError(f"{where}.command: an argument holds a NUL byte")
            command = tuple(command)
        return cls(name, when, tuple(causes), tuple(prefixes or ()), span, cluster, webhook, command)


@dataclasses.dataclass(frozen=True)
class AlertSettings:
    """What the alerter runs with; validated on construction."""

    rules: tuple[Rule, ...]
    #: ``blackbox.kafka.*``
    kafka: KafkaSettings | None = None
    #: where the checkpoint lives (``blackbox.alerts.state-dir``)
    state_dir: pathlib.Path = pathlib.Path(".")
    group_id: str = "dask-blackbox-alerts"
    #: one attempt's limit, the attempts, the longest wait between two (seconds)
    timeout: float = 5.0
    attempts: int = 5
    retry_backoff_max: float = 10.0
    #: how long a removal waits for its nanny's record (seconds)
    evidence_wait: float = 2.0
    #: the consumer group session (seconds)
    session_timeout: float = 10.0
    #: ``blackbox.alerts.debug-pause-at``: (point, n), or None
    pause_at: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        names = [r.name for r in self.rules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"blackbox.alerts.rules: rule name(s) {', '.join(twice)} used twice")

    @classmethod
    def from_config(cls) -> AlertSettings:
        """Read and validate every setting the alerter uses (ConfigError naming the key)."""
        raw = config.get("alerts.rules") or []
        if not isinstance(raw, (list, tuple)):
            raise ConfigError(f"blackbox.alerts.rules: {raw!r} must be a list of rules")
        state_dir = config.get("alerts.state-dir", None)
        return cls(
            rules=tuple(Rule.parse(r, i) for i, r in enumerate(raw)),
            kafka=KafkaSettings.from_config(),
            state_dir=pathlib.Path(state_dir) if state_dir else config.data_dir() / "alerts",
            group_id=_group(config.get("alerts.group-id")),
            timeout=config.get_seconds("alerts.timeout", minimum=0.001),
            attempts=config.get_int("alerts.attempts", minimum=1, maximum=100),
            retry_backoff_max=config.get_seconds("alerts.retry-backoff-max", minimum=0.001),
            evidence_wait=config.get_seconds("alerts.evidence-wait", minimum=0.0),
            session_timeout=config.get_seconds("alerts.session-timeout", minimum=0.1),
            pause_at=parse_pause_at(config.get("alerts.debug-pause-at", None)),
        )


def _check_webhook(webhook: Any, where: str) -> str:
    """``webhook`` if it is an http(s) URL with a host and a valid port, without
    spaces or control characters; else a one-line ConfigError naming ``where``."""
    shown = config.display_url(webhook) if isinstance(webhook, str) else repr(webhook)
    if not isinstance(webhook, str):
        raise ConfigError(f"{where}: {shown} must be an http:// or https:// URL")
    if re.search(r"[\x00-\x20\x7f]", webhook):
        raise ConfigError(f"{where}: {shown!r} holds a space or a control character")
    try:
        parsed = urlparse(webhook)
        port = parsed.port
    except ValueError as e:
        raise ConfigError(f"{where}: {shown!r} is not a URL: {e} (a port is 1-65535)") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{where}: {shown!r} must be an http:// or https:// URL")
    if port == 0:
        raise ConfigError(f"{where}: {shown!r}: port 0 is not a port (1-65535)")
    return webhook


def rules_configured() -> bool:
    """Whether ``blackbox.alerts.rules`` holds a rule the alerter watches the stream
    for (what makes ``up`` run it); regression rules alone do not."""
    raw = config.get("alerts.rules", None) or []
    if not isinstance(raw, (list, tuple)):
        return True  # the alerter names the problem when it starts
    return any(not isinstance(r, Mapping) or r.get("when") != REGRESSION for r in raw)


def _group(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"blackbox.alerts.group-id: {value!r} must be a non-empty string")
    return value


def parse_pause_at(setting: Any) -> tuple[str, int] | None:
    """``"<point>[:<n>]"`` as ``(point, n)`` (n defaults to 1); None when unset."""
    if not setting:
        return None
    point, _, n = str(setting).partition(":")
    if point not in PAUSE_POINTS or (n and (not n.isdigit() or int(n) < 1)):
        raise ConfigError(f"blackbox.alerts.debug-pause-at: {setting!r} is not one of "
                          f"{PAUSE_POINTS} with an optional :<n>")
    return point, int(n or 1)
