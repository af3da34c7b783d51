"""Delivering one incident to its rule's target, with retries.

A **webhook** gets ``POST <url>`` with the incident's JSON
(:meth:`~dask_blackbox.alerts.watch.Incident.payload`), ``Content-Type:
application/json`` and ``Idempotency-Key: <the incident's key>`` (the same on every
attempt and after a restart of the alerter: a receiver that remembers keys sees each
incident once). Any 2xx answer within ``timeout`` seconds delivers it.

A **command** runs with the JSON on its standard input and ``BLACKBOX_ALERT_ID``,
``BLACKBOX_ALERT_KEY``, ``BLACKBOX_ALERT_RULE`` and ``BLACKBOX_ALERT_SUMMARY`` in its
environment; exit status 0 within ``timeout`` seconds delivers it (a command that
outlives it is killed).

An attempt that fails (an error status, a refused or reset connection, no answer in
time, a non-zero exit) is retried after 0.5 s, then twice as long each time up to
``retry_backoff_max``, ``attempts`` times in all. Each failure is one line on the
``dask_blackbox.alerts`` logger naming the rule, the target and what went wrong; the
outcome is :class:`Outcome`: delivered, or given up with the last reason.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import ssl
from typing import NamedTuple
from urllib.parse import urlparse

import orjson

from dask_blackbox import config
from dask_blackbox.alerts.settings import Rule
from dask_blackbox.alerts.watch import Incident

logger = logging.getLogger("dask_blackbox.alerts")

#: The first wait between two attempts (doubling after each).
FIRST_BACKOFF = 0.5
#: Bytes of a failing answer (or a command's stderr) quoted in the line.
QUOTED = 200


class Outcome(NamedTuple):
    delivered: bool
    attempts: int
    reason: str


class AttemptFailed(Exception):
    """One attempt failed; the message says how, in one line."""


async def deliver(incident: Incident, rule: Rule, timeout: float, attempts: int,
                  backoff_max: float) -> Outcome:
    """Deliver ``incident`` to ``rule``'s target (module docstring)."""
    body = orjson.dumps(incident.payload(), option=orjson.OPT_NON_STR_KEYS, default=str)
    wait = FIRST_BACKOFF
    reason = ""
    for attempt in range(1, attempts + 1):
        try:
            if rule.webhook:
                await asyncio.to_thread(_post, rule.webhook, body, incident.key, timeout)
            else:
                await _run(rule.command or (), body, incident, timeout)
            return Outcome(True, attempt, "")
        except AttemptFailed as e:
            reason = str(e)
        if attempt < attempts:
            logger.warning("rule %s: %s failed for incident %s: %s (attempt %d of %d; again in %.1fs)",
                           rule.name, rule.target, incident.id, reason, attempt, attempts, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, backoff_max)
    logger.error("rule %s: gave up on incident %s after %d attempts: %s: %s", rule.name,
                 incident.id, attempts, rule.target, reason)
    return Outcome(False, attempts, reason)


def _post(url: str, body: bytes, key: str, timeout: float) -> None:
    """One POST; AttemptFailed unless a 2xx answer came within ``timeout``."""
    parts = urlparse(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        headers = {"Content-Type": "application/json", "Idempotency-Key": key,
                   "User-Agent": "dask-blackbox-alerts"}
        if parts.username is not None:
            import base64

            token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        try:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            answer = response.read(QUOTED)
        finally:
            conn.close()
    except TimeoutError:
        raise AttemptFailed(f"no answer within {timeout:g}s") from None
    except (OSError, http.client.HTTPException) as e:
        raise AttemptFailed(config.redact(f"{type(e).__name__}: {e}")) from None
    if not 200 <= response.status < 300:
        text = answer.decode("utf-8", "replace").strip().replace("\n", " ")
        raise AttemptFailed(f"HTTP {response.status} {response.reason}" + (f": {text}" if text else ""))


async def _run(command: tuple[str, ...], body: bytes, incident: Incident, timeout: float) -> None:
    """One run of the command; AttemptFailed unless it exits 0 within ``timeout``."""
    env = {**os.environ, "BLACKBOX_ALERT_ID": incident.id, "BLACKBOX_ALERT_KEY": incident.key,
           "BLACKBOX_ALERT_RULE": incident.rule, "BLACKBOX_ALERT_SUMMARY": incident.summary}
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env)
    except OSError as e:
        raise AttemptFailed(f"cannot run {command[0]!r}: {e.strerror or e}") from None
    try:
        _, err = await asyncio.wait_for(proc.communicate(body), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise AttemptFailed(f"still running after {timeout:g}s (killed)") from None
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] if err else []
        raise AttemptFailed(f"exit status {proc.returncode}" + (f": {tail[0][:QUOTED]}" if tail else ""))
