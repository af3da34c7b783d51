"""Helpers for the stream processors' tests: faust worker subprocesses, Dask's own
span and prefix figures (the truth), and the derived topics reduced to final form."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import types
import typing
import urllib.request

from aiokafka import AIOKafkaConsumer

from dask_blackbox import config, contract
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.testing.kafka_reader import read_json
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.settings import dask_env

SPAN_FIELDS = ("name", "parent_id", "enqueued", "start", "stop", "duration",
               "nbytes_total", "states", "all_durations", "cumulative_worker_metrics",
               "done", "nthreads_intervals", "active_cpu_seconds")


class FaustWorker:
    """``faust -A dask_blackbox.stream_processors.app worker`` in a subprocess of its own."""

    def __init__(self, env: dict[str, str], workdir: pathlib.Path, name: str = "w"):
        self.env = env
        self.datadir = workdir / f"faust-{name}"
        self.log = workdir / f"faust-{name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> FaustWorker:
        # this interpreter's faust: the dask_blackbox it imports is the one under test
        cmd = [sys.executable, "-m", "faust", "-A", "dask_blackbox.stream_processors.app",
               "--datadir", str(self.datadir),
               "-l", "info", "worker", "--web-port", str(self.port),
               "--web-host", "127.0.0.1"]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        return self

    def stats(self) -> dict | None:
        """The worker's counters, or None while its web server is not up."""
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"faust worker exited; log:\n{self.tail()}")
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/blackbox/stats/", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def kill(self) -> None:
        """SIGKILL: no flush, no commit, no goodbye to the consumer group."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, n: int = 60) -> str:
        try:
            return "".join(self.log.read_text().splitlines(True)[-n:])
        except FileNotFoundError:
            return ""


# ------------------------------------------------------------------ Dask's truth


def dask_truth(dask_scheduler) -> dict:
    """Spans and prefixes as the scheduler knows them (run with run_on_scheduler).

    Spans: every field a snapshot carries, Dask's way (``cumulative_worker_metrics``
    with its derived ``idle or other spans`` entry). Prefixes: ``state_counts`` and
    ``all_durations``.
    """
    ext = dask_scheduler.extensions["spans"]
    spans = {}
    for sid, s in ext.spans.items():
        spans[sid] = {
            "name": list(s.name),
            "parent_id": s.parent.id if s.parent is not None else None,
            "enqueued": s.enqueued,
            "start": s.start,
            "stop": s.stop,
            "duration": s.duration,
            "nbytes_total": s.nbytes_total,
            "states": {k: v for k, v in s.states.items() if v},
            "all_durations": dict(s.all_durations),
            "cumulative_worker_metrics": [
                [*k, v] for k, v in s.cumulative_worker_metrics.items()],
            "done": s.done,
            "nthreads_intervals": [list(i) for i in s.nthreads_intervals],
            "active_cpu_seconds": s.active_cpu_seconds,
        }
    prefixes = {
        name: {"state_counts": {k: v for k, v in tp.state_counts.items() if v},
               "all_durations": dict(tp.all_durations)}
        for name, tp in dask_scheduler.task_prefixes.items()
    }
    return {"spans": spans, "prefixes": prefixes, "n_tasks": len(dask_scheduler.tasks)}


def _us(durations: dict) -> dict:
    """Durations in whole microseconds: Dask keeps them so (TaskGroup.add_duration)
    and a float sum in another order must not count as a difference."""
    return {k: round(v * 1e6) for k, v in durations.items()}


def _metrics(rows: list) -> dict:
    return {tuple(r[:-1]): r[-1] for r in rows}


def span_differences(truth: dict, snapshot: dict | None) -> list[str]:
    """What differs between Dask's span and a snapshot (empty: equal)."""
    if snapshot is None:
        return ["no snapshot"]
    out = []
    for field in SPAN_FIELDS:
        t, s = truth[field], snapshot[field]
        if field in ("duration",):
            same = round(t * 1e6) == round(s * 1e6)
        elif field == "active_cpu_seconds":
            same = abs(t - s) <= 1e-9 * max(1.0, abs(t))
        elif field == "all_durations":
            same = _us(t) == _us(s)
        elif field == "cumulative_worker_metrics":
            tm, sm = _metrics(t), _metrics(s)
            same = tm.keys() == sm.keys() and all(
                abs(tm[k] - sm[k]) <= 1e-9 * max(1.0, abs(tm[k])) for k in tm)
        else:
            same = t == s
        if not same:
            out.append(f"{field}: dask={t!r} pipeline={s!r}")
    return out


def span_diffs(truth: dict, snapshots: dict, cluster_id: str, name=None) -> dict:
    """Per span name: what differs between Dask's spans and the latest snapshots."""
    out = {}
    for sid, t in truth["spans"].items():
        if name is not None and t["name"] != [name]:
            continue
        d = span_differences(t, snapshots.get((cluster_id, sid)))
        if d:
            out[tuple(t["name"])] = d
    return out


def converge(client, cluster_id: str, name=None, timeout=45.0) -> tuple[dict, dict]:
    """Once the cluster is idle, re-read Dask's truth and the pipeline's snapshots
    until they agree (workers report metrics with heartbeats, the producers with their
    own interval); return the truth and the remaining differences."""
    wait_for(lambda: not any(client.processing().values()), 30, "an idle cluster")
    deadline = time.monotonic() + timeout
    while True:
        truth = client.run_on_scheduler(dask_truth)
        snaps = latest_snapshots(read_json(contract.SPAN_STATE, idle=0.3))
        diffs = span_diffs(truth, snaps, cluster_id, name)
        if not diffs or time.monotonic() > deadline:
            return truth, diffs
        time.sleep(0.5)


# ------------------------------------------------------------ the contract


def _type_problem(value, tp) -> str | None:
    """Why ``value`` is not of the declared type ``tp`` (None: it is). ``float``
    takes an int too (PEP 484's numeric tower), never a bool."""
    origin = typing.get_origin(tp)
    if tp is typing.Any:
        return None
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, a) for a in typing.get_args(tp)]
        return None if None in problems else " and ".join(problems)
    if tp is type(None):
        return None if value is None else f"{value!r:.60} is not null"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{value!r:.60} is not a number"
    if tp in (int, str, bool):
        ok = type(value) is tp
        return None if ok else f"{value!r:.60} is not {tp.__name__}"
    if origin is list:
        if not isinstance(value, list):
            return f"{value!r:.60} is not a list"
        (item,) = typing.get_args(tp)
        for i, v in enumerate(value):
            if (p := _type_problem(v, item)) is not None:
                return f"[{i}]: {p}"
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return f"{value!r:.60} is not an object"
        kt, vt = typing.get_args(tp)
        for k, v in value.items():
            if (p := _type_problem(k, kt) or _type_problem(v, vt)) is not None:
                return f"[{k!r}]: {p}"
        return None
    raise TypeError(f"no check for declared type {tp!r}")


def contract_violations(topic: str, records: list[dict]) -> list[str]:
    """What in these records of a derived topic differs from its declaration in
    ``contract.RECORDS``: missing or extra fields, values of another type."""
    declared = contract.field_types(contract.RECORDS[topic])
    out = []
    for r in records:
        if set(r) != set(declared):
            out.append(f"{topic}: fields {sorted(set(r) ^ set(declared))} differ: {r!r:.200}")
            continue
        for field, tp in declared.items():
            if (p := _type_problem(r[field], tp)) is not None:
                out.append(f"{topic}.{field}: {p}")
    return out


# ------------------------------------------------------------ derived topics


def latest_snapshots(records: list[dict]) -> dict[tuple[str, str], dict]:
    """The highest version of every (cluster_id, span_id)."""
    out: dict[tuple[str, str], dict] = {}
    for r in records:
        k = (r["cluster_id"], r["span_id"])
        if k not in out or r["version"] >= out[k]["version"]:
            out[k] = r
    return out


def unique_partials(records: list[dict]) -> list[dict]:
    """One record per partial_id (what a deduplicating sink keeps)."""
    return list({r["partial_id"]: r for r in records}.values())


def prefix_totals(partials: list[dict]) -> dict[str, dict]:
    """Per prefix: ``finished`` counts, ``durations`` in microseconds, ``n_erred``."""
    out: dict[str, dict] = {}
    for p in partials:
        t = out.setdefault(p["prefix"], {"finished": {}, "durations": {}, "n_erred": 0})
        for state, n in p["finished"].items():
            t["finished"][state] = t["finished"].get(state, 0) + n
        for action, us in _us(p["durations"]).items():
            t["durations"][action] = t["durations"].get(action, 0) + us
        t["n_erred"] += p["n_erred"]
    return out


def processor_settings(broker: str, prefix: str, partitions: int = 2, **processors) -> dict:
    """``blackbox.*`` settings for a processor of its own: topics under ``prefix`` on
    ``broker``, the app id ``app-<prefix>``, the 6 s session Kafka allows at least, and
    any ``blackbox.processors.*`` given (``snapshot_interval="200ms"``, ...)."""
    return {
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": partitions,
        "blackbox.processors.app-id": f"app-{prefix}",
        "blackbox.processors.session-timeout": "6s",
        **{f"blackbox.processors.{k.replace('_', '-')}": v for k, v in processors.items()},
    }


def env_for(settings: dict) -> dict[str, str]:
    """os.environ plus ``blackbox.*`` settings as DASK_ environment variables."""
    return {**os.environ, **dask_env(settings)}


def committed_clusters(app_id: str) -> set[str]:
    """Clusters with a checkpoint on the processors' changelog topic (a marker that
    no tombstone followed)."""
    from dask_blackbox.stream_processors.checkpoint import parse_key

    async def read() -> set[str]:
        consumer = AIOKafkaConsumer(
            f"{app_id}-cluster-state-changelog", **config.kafka_client_kwargs(),
            group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        markers = {}
        try:
            while batch := await consumer.getmany(timeout_ms=500):
                for records in batch.values():
                    for r in records:
                        cluster_id, path = parse_key(r.key)
                        if path == ("M",):
                            markers[cluster_id] = r.value
        finally:
            await consumer.stop()
        return {c for c, marker in markers.items() if marker is not None}

    return asyncio.run(read())
