"""From raw envelopes to incidents: what the alerter knows of each cluster, and when
a rule's incident is complete. Plain Python: no Kafka, no I/O, no clock of its own
(every call says what time it is), so it is tested without a broker.

What it keeps per cluster (forgotten :data:`FORGET_CLOSED_S` after the scheduler
closed, or :data:`FORGET_IDLE_S` after the cluster was last heard from): the facts of
its removals (:class:`dask_blackbox.death_facts.DeathFacts`: the workers that joined,
and the exits, memory kills, worker-ttl timeouts, close reasons, restarts and closes
of the last :data:`~dask_blackbox.death_facts.FACT_WINDOW_S` seconds), the span
names, which removal released which task, and the verdicts of its deaths.

When an incident is complete:

- **worker-died**: a removal waits for its nanny's record of the process's end (then
  :data:`SETTLE_S` more, for the scheduler's events about it), or for
  ``evidence_wait`` seconds without it; Dask's expected removals are decided at once.
  The cause is :meth:`DeathFacts.verdict <dask_blackbox.death_facts.DeathFacts.verdict>`
  of the facts known then: the same rules the read side and the continuous exporter
  apply.
- **killed-worker**: the task's erred transition waits for the verdict of the removal
  that made it fatal (its stimulus), at most ``evidence_wait`` + 1 seconds; its
  chain is the deaths decided here that released it before.
- **task-erred**: at once, for a task that erred with its own exception (dependents
  that erred because of it carry none) in a rule's prefix or span.

An incident's ``id`` names the rule and what happened (cluster, worker and removal
stimulus; cluster, task and erred stimulus): the same incident read twice (a replay
after a crash) has the same id, which is how the alerter delivers it once.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import NamedTuple

from dask_blackbox import contract
from dask_blackbox.alerts.settings import KILLED_WORKER, TASK_ERRED, WORKER_DIED, Rule
from dask_blackbox.causes import Removal, Verdict
from dask_blackbox.death_facts import FACT_WINDOW_S, DeathFacts

#: A removal whose process's end is known waits this long more for the scheduler's
#: events about it.
SETTLE_S = 0.3
#: How often stale facts are forgotten (seconds).
PRUNE_S = 5.0
#: Forget a cluster this long after its scheduler closed, or after it was last heard.
FORGET_CLOSED_S = 600.0
FORGET_IDLE_S = 3600.0
#: Tasks released from processing are kept this long (event time) for the removal
#: that follows them (in the same envelope, or the next).
RELEASED_WINDOW_S = 60.0
#: Bounds per cluster: spans named; deaths remembered (with their verdicts) and tasks
#: with the deaths that released them (a KilledWorker's chain may span hours).
MAX_SPANS = 100_000
MAX_DEATHS = 10_000
MAX_CHAINS = 100_000


class Incident(NamedTuple):
    """One notification to deliver."""

    id: str
    rule: str
    kind: str
    cluster_id: str
    cluster_name: str | None
    #: when it happened (the producer's clock), and when the alerter completed it
    ts: float
    detected_at: float
    summary: str
    detail: dict

    @property
    def key(self) -> str:
        """The idempotency key: a digest of the id (the same for every attempt and
        after a restart)."""
        return hashlib.sha256(self.id.encode()).hexdigest()[:32]

    def payload(self) -> dict:
        """What a webhook receives (JSON) and a command reads on its stdin."""
        return {"id": self.id, "idempotency_key": self.key, "rule": self.rule, "kind": self.kind,
                "cluster_id": self.cluster_id, "cluster_name": self.cluster_name, "ts": self.ts,
                "detected_at": self.detected_at, "summary": self.summary, **self.detail}


class _Pending(NamedTuple):
    removal: Removal
    arrived: float
    tasks: list


class _Cluster:
    """What the alerter knows of one cluster: the facts of its removals
    (:class:`~dask_blackbox.death_facts.DeathFacts`) and what its incidents need."""

    def __init__(self, cluster_id: str, name: str | None, now: float):
        self.id = cluster_id
        self.name = name
        self.heard = now
        self.closed_at: float | None = None
        self.newest = 0.0  # newest event time seen
        self.facts = DeathFacts(cluster_id)
        self.spans: dict[str, str] = {}
        #: stimulus -> [event time, tasks it released from processing] (recent ones);
        #: task -> the removals (stimuli) that released it
        self.released: dict[str, list] = {}
        self.chains: dict[str, list[str]] = defaultdict(list)
        #: removal stimulus -> [worker, ts, cause, label, confidence, summary]
        self.verdicts: dict[str, list] = {}
        self.pending: list[_Pending] = []
        self.exit_seen: dict[str, float] = {}  # worker address -> when its exit arrived
        self.killed: list[list] = []  # [key, prefix, stimulus, ts, exception, worker, arrived]

    # ------------------------------------------------------------ state

    def state(self) -> dict:
        return {"id": self.id, "name": self.name, "heard": self.heard, "closed_at": self.closed_at,
                "newest": self.newest, **self.facts.state(), "spans": self.spans, "released": self.released,
                "chains": dict(self.chains), "verdicts": self.verdicts,
                "pending": [[list(p.removal), p.arrived, p.tasks] for p in self.pending],
                "exit_seen": self.exit_seen, "killed": self.killed}

    @classmethod
    def from_state(cls, s: dict) -> _Cluster:
        c = cls(s["id"], s["name"], s["heard"])
        c.closed_at, c.newest = s["closed_at"], s["newest"]
        c.facts = DeathFacts.from_state(c.id, s)
        c.spans = s["spans"]
        c.released = s["released"]
        c.chains = defaultdict(list, s["chains"])
        c.verdicts = s["verdicts"]
        c.pending = [_Pending(Removal(*r), arrived, tasks) for r, arrived, tasks in s["pending"]]
        c.exit_seen, c.killed = s["exit_seen"], s["killed"]
        return c

    def prune(self) -> None:
        """Forget facts older than FACT_WINDOW_S behind the newest event."""
        self.facts.prune(self.newest - FACT_WINDOW_S)
        recent = self.newest - RELEASED_WINDOW_S
        self.released = {s: r for s, r in self.released.items() if r[0] >= recent}
        if len(self.verdicts) > MAX_DEATHS:  # oldest first (insertion order)
            self.verdicts = dict(list(self.verdicts.items())[-MAX_DEATHS:])
        if len(self.chains) > MAX_CHAINS:
            self.chains = defaultdict(list, list(self.chains.items())[-MAX_CHAINS:])


class Watcher:
    """Reads envelopes (:meth:`feed`), completes incidents (:meth:`tick`), and hands
    them over (:meth:`take`). ``now`` is seconds since the epoch, the caller's."""

    def __init__(self, rules: tuple[Rule, ...], evidence_wait: float = 2.0):
        self.rules = rules
        self.evidence_wait = evidence_wait
        self.clusters: dict[str, _Cluster] = {}
        self._ready: list[Incident] = []
        #: events that could not be read, by reason (never raised: a message cannot
        #: stop the alerter)
        self.unreadable: dict[str, int] = defaultdict(int)
        self._pruned_at = 0.0

    # ------------------------------------------------------------- state

    def state(self) -> dict:
        return {"clusters": {cid: c.state() for cid, c in self.clusters.items()}}

    def restore(self, state: dict) -> None:
        self.clusters = {cid: _Cluster.from_state(s) for cid, s in state.get("clusters", {}).items()}

    # -------------------------------------------------------------- feed

    def feed(self, envelope: dict, now: float) -> None:
        """Read one valid envelope (``contract.validate_envelope``'s answer)."""
        cid = envelope["cluster_id"]
        c = self.clusters.get(cid)
        if c is None:
            c = self.clusters[cid] = _Cluster(cid, envelope.get("cluster_name"), now)
        c.heard = now
        c.name = envelope.get("cluster_name") or c.name
        c.facts.envelope(envelope["source"])
        for event in envelope["events"]:
            try:
                self._event(c, event, now)
            except (contract.InvalidEvent, KeyError, TypeError, ValueError, AttributeError) as e:
                self.unreadable[f"{event.get('kind')!r:.40}: {type(e).__name__}"] += 1

    def _event(self, c: _Cluster, ev: dict, now: float) -> None:
        kind = ev["kind"]
        ts = ev["ts"]
        if isinstance(ts, (int, float)) and ts > c.newest:
            c.newest = float(ts)
        if kind == contract.TRANSITION_RUN or kind == contract.CAPTURE:
            columns = contract.packed_columns(ev)
            for i, (start, finish) in enumerate(zip(columns["start"], columns["finish"])):
                if finish == "erred" or (start == "processing" and finish == "released"):
                    self._transition(c, {name: columns[name][i] for name in _TRANSITION_FIELDS}, now)
        elif kind == contract.TRANSITION:
            if ev.get("finish") == "erred" or (ev.get("start") == "processing"
                                               and ev.get("finish") == "released"):
                self._transition(c, {**{n: ev.get(n) for n in _TRANSITION_FIELDS}, "ts": ts}, now)
        elif kind == contract.LIFECYCLE:
            self._lifecycle(c, ev, now)
        elif kind == contract.WORKER_EXIT:
            x = c.facts.worker_exit(ev)
            if x.worker:
                c.exit_seen[x.worker] = now
            for p in c.pending:
                if x.pid is not None and p.removal.pid == x.pid:
                    c.exit_seen[p.removal.worker] = now
        elif kind == contract.EVENT:
            c.facts.structured(ev)
        elif kind == contract.SPAN:
            if len(c.spans) < MAX_SPANS and isinstance(ev.get("name"), list):
                c.spans[str(ev["span_id"])] = "/".join(map(str, ev["name"]))

    def _lifecycle(self, c: _Cluster, ev: dict, now: float) -> None:
        removal = c.facts.lifecycle(ev)
        if removal is not None:
            stimulus = removal.stimulus_id
            tasks = list(c.released.get(stimulus, [0.0, []])[1])
            for key in tasks:
                if stimulus not in c.chains[key]:
                    c.chains[key].append(stimulus)
            c.pending.append(_Pending(removal, now, tasks))
        elif ev.get("action") == "scheduler_close":
            c.closed_at = now

    def _transition(self, c: _Cluster, t: dict, now: float) -> None:
        key, stimulus = str(t["key"]), str(t.get("stimulus_id") or "")
        if t.get("start") == "processing" and stimulus:
            c.released.setdefault(stimulus, [float(t["ts"]), []])[1].append(key)
        exception = t.get("exception")
        if t.get("finish") != "erred" or not isinstance(exception, str) or not exception:
            return
        prefix, span_path = str(t.get("prefix") or ""), c.spans.get(str(t.get("span_id") or ""), "")
        ts = float(t["ts"])
        for rule in self.rules:
            if rule.when != TASK_ERRED or not rule.matches_cluster(c.id, c.name):
                continue
            if prefix in rule.prefixes or (rule.span and _in_span(span_path, rule.span)):
                where = f"prefix {prefix}" if prefix in rule.prefixes else f"span {span_path}"
                self._ready.append(Incident(
                    f"{rule.name}|{c.id}|{TASK_ERRED}|{key}|{stimulus}", rule.name, TASK_ERRED, c.id,
                    c.name, ts, now, f"task {key} erred in {where}: {_first_line(exception)}",
                    {"key": key, "prefix": prefix, "span": span_path, "worker": t.get("worker"),
                     "exception": exception, "stimulus_id": stimulus}))
        if exception.startswith("KilledWorker") and any(r.when == KILLED_WORKER for r in self.rules):
            c.killed.append([key, prefix, stimulus, ts, exception, t.get("worker"), now])

    # -------------------------------------------------------------- tick

    def tick(self, now: float) -> None:
        """Decide what is due at ``now``; forget what is stale (every PRUNE_S)."""
        prune = now - self._pruned_at >= PRUNE_S
        if prune:
            self._pruned_at = now
        for cid, c in list(self.clusters.items()):
            self._decide_removals(c, now)
            self._decide_killed(c, now)
            if not prune:
                continue
            c.prune()
            if not c.pending and not c.killed and (
                    (c.closed_at is not None and now - c.closed_at > FORGET_CLOSED_S)
                    or now - c.heard > FORGET_IDLE_S):
                del self.clusters[cid]

    def _decide_removals(self, c: _Cluster, now: float) -> None:
        waiting = []
        for p in c.pending:
            r = p.removal
            seen = c.exit_seen.get(r.worker)
            exit_in = seen is not None and seen >= p.arrived - 60.0
            if not (r.expected is True or now >= p.arrived + self.evidence_wait
                    or (exit_in and now >= max(seen, p.arrived) + SETTLE_S)):
                waiting.append(p)
                continue
            verdict = c.facts.verdict(r)
            c.verdicts[r.stimulus_id] = [r.worker, r.ts, verdict.cause.value, verdict.cause.label,
                                         verdict.confidence, verdict.explanation]
            self._death_incidents(c, p, verdict, now)
        c.pending = waiting

    def _death_incidents(self, c: _Cluster, p: _Pending, v: Verdict, now: float) -> None:
        r = p.removal
        for rule in self.rules:
            if rule.when != WORKER_DIED or v.cause.value not in rule.causes \
                    or not rule.matches_cluster(c.id, c.name):
                continue
            self._ready.append(Incident(
                f"{rule.name}|{c.id}|{WORKER_DIED}|{r.worker}|{r.stimulus_id}", rule.name, WORKER_DIED,
                c.id, c.name, r.ts, now, f"worker {r.worker} died: {v.summary}",
                {"worker": r.worker, "stimulus_id": r.stimulus_id, "cause": v.cause.value,
                 "label": v.cause.label, "confidence": v.confidence, "explanation": v.explanation,
                 "evidence": [e._asdict() for e in v.evidence], "tasks": p.tasks,
                 "pid": r.pid, "nanny": r.nanny}))

    def _decide_killed(self, c: _Cluster, now: float) -> None:
        waiting = []
        for item in c.killed:
            key, prefix, stimulus, ts, exception, worker, arrived = item
            if stimulus not in c.verdicts and now < arrived + self.evidence_wait + 1.0:
                waiting.append(item)
                continue
            deaths = [{"stimulus_id": s, "worker": v[0], "ts": v[1], "cause": v[2], "label": v[3],
                       "confidence": v[4], "explanation": v[5]}
                      for s in c.chains.get(key, []) if (v := c.verdicts.get(s)) is not None]
            causes = sorted({d["label"] for d in deaths})
            why = f" ({', '.join(causes)})" if causes else ""
            for rule in self.rules:
                if rule.when != KILLED_WORKER or not rule.matches_cluster(c.id, c.name):
                    continue
                self._ready.append(Incident(
                    f"{rule.name}|{c.id}|{KILLED_WORKER}|{key}|{stimulus}", rule.name, KILLED_WORKER,
                    c.id, c.name, ts, now,
                    f"task {key} failed with KilledWorker after {len(deaths)} worker death(s){why}",
                    {"key": key, "prefix": prefix, "worker": worker, "exception": exception,
                     "stimulus_id": stimulus, "deaths": deaths}))
        c.killed = waiting

    def take(self) -> list[Incident]:
        """The incidents completed since the last call."""
        ready, self._ready = self._ready, []
        return ready

    def waiting(self) -> int:
        """Removals and KilledWorkers still waiting for their evidence."""
        return sum(len(c.pending) + len(c.killed) for c in self.clusters.values())


_TRANSITION_FIELDS = ("key", "start", "finish", "stimulus_id", "ts", "prefix", "span_id", "worker",
                      "exception")


def _in_span(path: str, span: str) -> bool:
    """Whether a span (its '/'-joined name) is ``span`` (a tag of it, or its path, or
    a path it lies under)."""
    return bool(path) and (span in path.split("/") or path == span or path.startswith(span + "/"))


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 200 else line[:200] + "..."

