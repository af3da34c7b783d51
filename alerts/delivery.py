"""Delivering one incident to its rule's target, with retries.

A **webhook** gets ``POST <url>`` with the incident's JSON
(:meth:`~dask_blackbox.alerts.watch.Incident.payload`), ``Content-Type:
application/json`` and ``Idempotency-Key: <the incident's key>`` (the same on every
attempt and after a restart of the alerter: a receiver that remembers keys sees each
incident once). Any 2xx answer within ``timeout`` seconds delivers it; a redirect is
not followed (it is a failed attempt: a rule's URL is the one place alerts go).

A **command** runs with the JSON on its standard input and a minimal environment:
``PATH``, ``HOME``, ``LANG``, ``LC_ALL``, ``TZ`` and ``TMPDIR`` as the alerter has
them, and ``BLACKBOX_ALERT_ID``, ``BLACKBOX_ALERT_KEY``, ``BLACKBOX_ALERT_RULE`` and
``BLACKBOX_ALERT_SUMMARY`` -- never the alerter's own configuration (Dask passes its
whole resolved configuration, passwords included, to child processes in
``DASK_INTERNAL_INHERIT_CONFIG``; ``DASK_*`` variables hold settings). Values are
text a cluster chose (a task key can be anything): NUL bytes are removed and each
value is cut to :data:`ENV_MAX` characters (the summary whole is on stdin). Exit
status 0 within ``timeout`` seconds delivers it (a command that outlives it is
killed).

``timeout`` bounds an attempt's wall time, the connection, the request and the whole
answer included: a target that answers a byte at a time fails like one that never
answers. Each attempt runs on the event loop (no shared thread pool), so a slow
target delays only its own rule's incidents.

An attempt that fails (an error status, a refused or reset connection, no answer in
time, a non-zero exit, or anything else an attempt raises) is retried after 0.5 s,
then twice as long each time up to ``retry_backoff_max``, ``attempts`` times in all.
Each failure is one line on the ``dask_blackbox.alerts`` logger naming the rule, the
target (a URL as ``scheme://host:port/…``: tokens live in webhook paths and queries)
and what went wrong, with the target's control characters removed; the outcome is
:class:`Outcome`: delivered, or given up with the last reason.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import ssl
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

import orjson

from dask_blackbox import config
from dask_blackbox.alerts.settings import Rule
from dask_blackbox.alerts.watch import Incident

logger = logging.getLogger("dask_blackbox.alerts")

#: The first wait between two attempts (doubling after each).
FIRST_BACKOFF = 0.5
#: Bytes of a failing answer (or a command's stderr) quoted in the line.
QUOTED = 200
#: Characters of one environment value of a command (the whole is on its stdin).
ENV_MAX = 1024
#: What a command inherits from the alerter's environment.
INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
#: Bytes of an answer's status line and headers read at most.
_HEAD_MAX = 64 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


class Outcome(NamedTuple):
    delivered: bool
    attempts: int
    reason: str


class AttemptFailed(Exception):
    """One attempt failed; the message says how, in one line."""


def printable(text: str) -> str:
    """``text`` as one printable line: control characters (terminal escapes,
    newlines) replaced by a space."""
    return _CONTROL.sub(" ", text).strip()


async def deliver(incident: Incident, rule: Rule, timeout: float, attempts: int,
                  backoff_max: float) -> Outcome:
    """Deliver ``incident`` to ``rule``'s target (module docstring)."""
    wait = FIRST_BACKOFF
    reason = ""
    for attempt in range(1, attempts + 1):
        try:
            body = orjson.dumps(incident.payload(), option=orjson.OPT_NON_STR_KEYS, default=str)
            if rule.webhook:
                await asyncio.wait_for(_post(rule.webhook, body, incident.key), timeout)
            else:
                await _run(rule.command or (), body, incident, timeout)
            return Outcome(True, attempt, "")
        except AttemptFailed as e:
            reason = str(e)
        except (asyncio.TimeoutError, TimeoutError):
            reason = f"no answer within {timeout:g}s"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # anything else an attempt raises is a failed attempt
            reason = f"{type(e).__name__}: {e}"
        reason = printable(config.redact(reason))[:2 * QUOTED + 100]
        if attempt < attempts:
            logger.warning("rule %s: %s failed for incident %s: %s (attempt %d of %d; again in %.1fs)",
                           rule.name, rule.target, incident.id, reason, attempt, attempts, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, backoff_max)
    logger.error("rule %s: gave up on incident %s after %d attempts: %s: %s", rule.name,
                 incident.id, attempts, rule.target, reason)
    return Outcome(False, attempts, reason)


async def _post(url: str, body: bytes, key: str) -> None:
    """One POST; AttemptFailed unless a 2xx answer comes (the caller bounds its time)."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    host, port = parts.hostname, parts.port or (443 if secure else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {"Host": parts.netloc.rpartition("@")[2], "Content-Type": "application/json",
               "Content-Length": str(len(body)), "Idempotency-Key": key,
               "User-Agent": "dask-blackbox-alerts", "Connection": "close"}
    if parts.username is not None:
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(token.encode()).decode()
    try:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ssl.create_default_context() if secure else None,
            server_hostname=host if secure else None, limit=_HEAD_MAX)
    except (OSError, ssl.SSLError) as e:
        raise AttemptFailed(f"cannot connect to {host}:{port}: "
                            f"{getattr(e, 'strerror', None) or e}") from None
    try:
        head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(head.encode("latin-1", "replace") + b"\r\n" + body)
        await writer.drain()
        try:
            answer = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            raise AttemptFailed("the connection closed before an answer"
                                + (f": {printable(e.partial[:QUOTED].decode('utf-8', 'replace'))}"
                                   if e.partial else "")) from None
        except asyncio.LimitOverrunError:
            raise AttemptFailed(f"an answer whose headers exceed {_HEAD_MAX} bytes") from None
        status_line = answer.split(b"\r\n", 1)[0].decode("latin-1")
        m = re.match(r"HTTP/\d(?:\.\d)? (\d{3})(?: (.*))?$", status_line)
        if m is None:
            raise AttemptFailed(f"not an HTTP answer: {printable(status_line[:QUOTED])}")
        status = int(m.group(1))
        if not 200 <= status < 300:
            try:
                text = await asyncio.wait_for(reader.read(QUOTED), 1.0)
            except (asyncio.TimeoutError, OSError):
                text = b""
            quoted = printable(text.decode("utf-8", "replace"))
            reason = printable(m.group(2) or "")
            what = "a redirect (not followed)" if 300 <= status < 400 else ""
            raise AttemptFailed(f"HTTP {status} {reason}".rstrip() + (f", {what}" if what else "")
                                + (f": {quoted}" if quoted else ""))
    except (ConnectionError, OSError) as e:
        raise AttemptFailed(f"{type(e).__name__}: {e}") from None
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (Exception, asyncio.CancelledError):
            pass


def _env_value(text: object) -> str:
    value = str(text).replace("\x00", "")
    return value if len(value) <= ENV_MAX else value[:ENV_MAX - 1] + "…"


def command_env(incident: Incident) -> dict[str, str]:
    """The environment of a command rule's process (module docstring)."""
    env = {k: os.environ[k] for k in INHERITED if k in os.environ}
    env.update({"BLACKBOX_ALERT_ID": _env_value(incident.id),
                "BLACKBOX_ALERT_KEY": _env_value(incident.key),
                "BLACKBOX_ALERT_RULE": _env_value(incident.rule),
                "BLACKBOX_ALERT_SUMMARY": _env_value(incident.summary)})
    return env


async def _run(command: tuple[str, ...], body: bytes, incident: Incident, timeout: float) -> None:
    """One run of the command; AttemptFailed unless it exits 0 within ``timeout``."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=command_env(incident))
    except (OSError, ValueError) as e:
        raise AttemptFailed(f"cannot run {command[0]!r}: "
                            f"{getattr(e, 'strerror', None) or e}") from None
    try:
        _, err = await asyncio.wait_for(proc.communicate(body), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise AttemptFailed(f"still running after {timeout:g}s (killed)") from None
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] if err else []
        raise AttemptFailed(f"exit status {proc.returncode}"
                            + (f": {printable(tail[0])[:QUOTED]}" if tail else ""))
