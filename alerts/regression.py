"""A regression between two runs as incidents for the alert rules.

The runs are in ClickHouse, so no stream shows a regression: ``dask-blackbox compare
--alert`` compares them (the read side's :func:`~dask_blackbox.read.regressions.compare`)
and hands the comparison's dict here. :func:`incidents` makes one :class:`Incident`
per ``regression`` rule that matches the candidate run (the rule's ``cluster``, a
name or id; its ``span``, if any, equal to the compared span) when the verdict is
``regression``; :func:`deliver_all` delivers them with the alerter's timeout, retries
and backoff (:mod:`~dask_blackbox.alerts.delivery`).

An incident's id is ``<rule>|<candidate cluster id>|regression|<what>|<baseline run>|
<candidate run>`` (a run: its cluster id and span id): the same comparison alerted
again, say by a job that runs ``compare --alert`` every hour, carries the same
``Idempotency-Key``, so a receiver that remembers keys sees each regression once.
Its payload carries the verdict's sentences, the culprit (prefix, action, change,
interval, p-value, whether it sits on the critical path) and both runs.
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

from dask_blackbox.alerts.delivery import Outcome, deliver
from dask_blackbox.alerts.settings import REGRESSION, AlertSettings, Rule
from dask_blackbox.alerts.watch import Incident


class Alerted(NamedTuple):
    """One rule's incident and what became of it."""

    rule: Rule
    incident: Incident
    outcome: Outcome


def incidents(comparison: dict, span: str | None, rules: tuple[Rule, ...]) -> list[tuple[Rule, Incident]]:
    """The incidents of ``comparison`` (:meth:`Comparison.as_dict`, of ``span`` or of
    whole runs when None) for the regression rules among ``rules`` that match it;
    none unless its verdict is ``regression``."""
    if comparison.get("verdict") != "regression":
        return []
    base, new = comparison["baseline"], comparison["candidate"]
    sentences = comparison.get("sentences") or [comparison["verdict"]]
    detail = {"what": comparison["what"], "verdict": comparison["verdict"],
              "wall_verdict": comparison.get("wall_verdict"), "sentences": sentences,
              "culprit": comparison.get("culprit"),
              "on_critical_path": comparison.get("on_critical_path"),
              "baseline": base, "candidate": new, "span": span}
    out = []
    for rule in rules:
        if rule.when != REGRESSION or not rule.matches_cluster(new["cluster_id"], new["cluster_name"]):
            continue
        if rule.span is not None and rule.span != span:
            continue
        run_ids = (f"{base['cluster_id']}:{base['span_id'] or ''}|"
                   f"{new['cluster_id']}:{new['span_id'] or ''}")
        out.append((rule, Incident(
            f"{rule.name}|{new['cluster_id']}|{REGRESSION}|{comparison['what']}|{run_ids}",
            rule.name, REGRESSION, new["cluster_id"], new["cluster_name"], new["began"],
            time.time(), sentences[0], detail)))
    return out


def deliver_all(pending: list[tuple[Rule, Incident]], settings: AlertSettings) -> list[Alerted]:
    """Deliver every incident of ``pending`` to its rule's target, at once."""
    async def run() -> list[Outcome]:
        return await asyncio.gather(*(
            deliver(incident, rule, settings.timeout, settings.attempts, settings.retry_backoff_max)
            for rule, incident in pending))

    outcomes = asyncio.run(run()) if pending else []
    return [Alerted(rule, incident, outcome)
            for (rule, incident), outcome in zip(pending, outcomes)]
