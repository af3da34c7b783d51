"""Helpers for the stream processors' tests: faust worker subprocesses, Dask's own
span and prefix figures (the truth), and the derived topics reduced to final form."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import urllib.request

from aiokafka import AIOKafkaConsumer

from dask_blackbox import config
from dask_blackbox.cli.tansu import free_port

SPAN_FIELDS = ("name", "parent_id", "enqueued", "start", "stop", "duration",
               "nbytes_total", "states", "all_durations", "cumulative_worker_metrics",
               "done")


class FaustWorker:
    """``faust -A dask_blackbox.stream_processors.app worker`` in a subprocess of its own."""

    def __init__(self, env: dict[str, str], workdir: pathlib.Path, name: str = "w"):
        self.env = env
        self.datadir = workdir / f"faust-{name}"
        self.log = workdir / f"faust-{name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> FaustWorker:
        cmd = ["faust", "-A", "dask_blackbox.stream_processors.app", "--datadir", str(self.datadir),
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

    Spans: every field a snapshot carries, Dask's way; ``cumulative_worker_metrics``
    without the synthetic ``idle or other spans`` entry (derived from the thread-count
    history, not published). Prefixes: ``state_counts`` and ``all_durations``.
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
                [*k, v] for k, v in s.cumulative_worker_metrics.items()
                if k != ("execute", "N/A", "idle or other spans", "seconds")
            ],
            "done": s.done,
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


def env_for(settings: dict) -> dict[str, str]:
    """os.environ plus ``blackbox.*`` settings as DASK_ environment variables."""
    return {**os.environ, **{
        "DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v)
        for k, v in settings.items()
    }}


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
