"""`dask-blackbox up` supervises: every child but the broker is SIGKILLed in the
middle of a real workload, and ClickHouse still ends up with exactly what Dask knew.

One `up` (Tansu, one faust worker, the sink on chDB) records one LocalCluster. While
the cluster computes -- nested spans, a dask.array reduction, a map of slow tasks --
the sink is SIGKILLed, then (once `up` says it is ready again) the faust worker. `up`
says each time what died and that it restarts it, restarts it, and keeps the broker
(and its port). Once the work is done and released, Dask's truth is read on the live
scheduler and compared with ClickHouse, through the CLI's own backend:

- transitions: the scheduler's ``transition_log``, every (key, start, finish,
  stimulus_id) exactly as many times as Dask logged it (nothing lost, nothing loaded
  twice);
- spans: for every span of ``scheduler.extensions["spans"]``, the ``span_state`` row
  (FINAL) has Dask's name, parent, enqueued, start, stop, duration, nbytes_total,
  states, all_durations, done and cumulative_worker_metrics;
- prefixes: per prefix, the ``prefix_stats`` partials (FINAL) sum to
  ``TaskPrefix.state_counts`` and ``all_durations``;
- no gap and no drop recorded for the cluster, and no dead letter.

Then a SIGTERM stops `up`, which drains and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import dask
import dask.array as da
import psutil
from distributed import Client, LocalCluster, span, wait

from dask_blackbox import producers
from dask_blackbox.deploy.supervisor import pipeline_lag, wait_drained
from dask_blackbox.contract import encode_key
from dask_blackbox.read import queries
from dask_blackbox.testing.processors import dask_truth
from up_process import Up

# Short prefix windows: a window's partials are published once it closes (or its
# producer is silent for a window), which the comparison waits for.
SETTINGS = ("processors.session-timeout=6s", "sink.session-timeout=6s",
            "processors.snapshot-interval=200ms", "processors.commit-interval=1s",
            "processors.prefix-window=2s")


def slowinc(i):
    time.sleep(0.02)
    return i + 1


def child(up: Up, marker: str) -> psutil.Process:
    """The child of `up` whose command line holds ``marker``."""
    found = [p for p in psutil.Process(up.proc.pid).children()
             if marker in " ".join(p.cmdline())]
    assert len(found) == 1, [p.cmdline() for p in psutil.Process(up.proc.pid).children()]
    return found[0]


def phase(client, i: int) -> list:
    """Work of phase ``i``, submitted (not waited for): nested spans, an array
    reduction, a map of slow tasks."""
    with span("workload"):
        with span(f"phase-{i}"):
            x = da.random.RandomState(i).random((400, 400), chunks=50)
            total = client.compute((x + x.T).sum())
            slow = client.map(slowinc, range(i * 100, i * 100 + 100))
    return [total, *slow]


def transition_differences(backend, cluster_id: str, log: list) -> list[str]:
    """How the scheduler transitions in ClickHouse differ from ``log`` (empty: not)."""
    _, rows = backend.query(
        f"SELECT key, start, finish, stimulus_id FROM {backend.database}.transitions "
        "WHERE cluster_id = {c:String} AND source = 'scheduler'", {"c": cluster_id})
    got, want = Counter(rows), Counter(log)
    if got == want:
        return []
    return [f"transitions: {sum((want - got).values())} missing, e.g. {list(want - got)[:3]}; "
            f"{sum((got - want).values())} extra, e.g. {list(got - want)[:3]}"]


def derived_differences(backend, cluster_id: str, truth: dict) -> list[str]:
    """How spans and prefixes in ClickHouse differ from Dask's (empty: not)."""
    db = backend.database
    out = []
    columns, rows = backend.query(
        "SELECT span_id, name, parent_id, toFloat64(enqueued) AS enqueued, "
        "toFloat64(start) AS start, toFloat64(stop) AS stop, duration, nbytes_total, states, "
        "all_durations, done, cumulative_worker_metrics.context AS ctx, "
        "cumulative_worker_metrics.prefix AS pfx, cumulative_worker_metrics.activity AS act, "
        "cumulative_worker_metrics.unit AS unit, cumulative_worker_metrics.value AS val "
        f"FROM {db}.span_state FINAL WHERE cluster_id = {{c:String}}", {"c": cluster_id})
    spans = {r[0]: dict(zip(columns, r)) for r in rows}
    for sid, t in truth["spans"].items():
        s = spans.get(sid)
        if s is None:
            out.append(f"span {t['name']}: not in ClickHouse")
            continue
        us = lambda d: {k: round(v * 1e6) for k, v in d.items()}  # noqa: E731
        metrics = {(c, p, a, u): v for c, p, a, u, v in zip(s["ctx"], s["pfx"], s["act"], s["unit"], s["val"])}
        want_metrics = {tuple(m[:-1]): m[-1] for m in t["cumulative_worker_metrics"]}
        checks = {
            "name": (list(s["name"]), t["name"]),
            "parent": (s["parent_id"] or None, t["parent_id"]),
            "enqueued": (round(s["enqueued"] * 1e6), round(t["enqueued"] * 1e6)),
            "start": (round(s["start"] * 1e6), round(t["start"] * 1e6)),
            "stop": (round(s["stop"] * 1e6), round(t["stop"] * 1e6)),
            "duration": (round(s["duration"] * 1e6), round(t["duration"] * 1e6)),
            "nbytes_total": (s["nbytes_total"], t["nbytes_total"]),
            "states": ({k: v for k, v in s["states"].items() if v}, t["states"]),
            "all_durations": (us(s["all_durations"]), us(t["all_durations"])),
            "done": (bool(s["done"]), t["done"]),
            "cumulative_worker_metrics": (
                metrics.keys() == want_metrics.keys() and all(
                    abs(metrics[k] - want_metrics[k]) <= 1e-9 * max(1.0, abs(want_metrics[k]))
                    for k in want_metrics), True),
        }
        out += [f"span {t['name']} {field}: clickhouse={a!r:.200} dask={b!r:.200}"
                for field, (a, b) in checks.items() if a != b]
    _, rows = backend.query(
        "SELECT prefix, sumMap(finished), sumMap(durations), sum(n_erred) "
        f"FROM {db}.prefix_stats FINAL WHERE cluster_id = {{c:String}} GROUP BY prefix",
        {"c": cluster_id})
    prefixes = {p: (dict(f), {k: round(v * 1e6) for k, v in d.items()}, e) for p, f, d, e in rows}
    for name, t in truth["prefixes"].items():
        want = (t["state_counts"], {k: round(v * 1e6) for k, v in t["all_durations"].items()},
                t["state_counts"].get("erred", 0))
        got = prefixes.get(name)
        got = got and ({k: v for k, v in got[0].items() if v}, got[1], got[2])
        if got != want:
            out.append(f"prefix {name}: clickhouse={got!r:.300} dask={want!r:.300}")
    return out


def test_every_child_but_the_broker_dies_mid_workload_and_nothing_is_lost(tmp_path, long_story):
    data = tmp_path / "data"
    up = Up(data, *(a for s in SETTINGS for a in ("--set", s)))
    try:
        up.wait_for("healthy in")
        broker = child(up, "tansu")
        config = dask.config.set({"blackbox.data-dir": str(data), "optimization.fuse.active": False})
        with config, LocalCluster(n_workers=2, threads_per_worker=2, processes=False,
                                  dashboard_address=None) as cluster, Client(cluster) as client:
            cluster_id = producers.attach(client, cluster_name="survivor", **{
                "producer.flush-interval": "50ms", "producer.metrics-interval": "200ms"})["cluster_id"]
            held = phase(client, 0)
            wait(held)
            held += phase(client, 1)
            # The sink dies while the cluster computes and publishes.
            child(up, "dask_blackbox.cli sink").send_signal(signal.SIGKILL)
            assert "restarting it in" in up.wait_for("sink was killed by SIGKILL")
            held += phase(client, 2)
            up.wait_for("sink ready again", timeout=90)
            wait(held)
            held += phase(client, 3)
            # Then the faust worker, likewise.
            child(up, "stream_processors.app").send_signal(signal.SIGKILL)
            up.wait_for("processor-0 was killed by SIGKILL")
            held += phase(client, 4)
            up.wait_for("processor-0 ready again", timeout=120)
            wait(held)
            held += phase(client, 5)
            wait(held)
            del held
            scheduler = cluster.scheduler
            deadline = time.monotonic() + 30
            while scheduler.tasks:  # released and forgotten: the truth stops changing
                assert time.monotonic() < deadline, len(scheduler.tasks)
                time.sleep(0.05)
            assert broker.is_running() and child(up, "tansu").pid == broker.pid
            # Spans and prefixes: Dask's truth on the live (idle) cluster and
            # ClickHouse's, until the last heartbeats' metrics are in both.
            backend = queries.connect()
            deadline = time.monotonic() + 90
            while True:
                truth = dask_truth(scheduler)
                diffs = derived_differences(backend, cluster_id, truth)
                if not diffs or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert diffs == [], diffs
            assert len(truth["spans"]) >= 6, truth["spans"]
        with dask.config.set({"blackbox.data-dir": str(data)}):
            # Transitions: every one the scheduler logged, until it closed.
            log = [(encode_key(k), start, finish, stimulus)
                   for k, start, finish, _, stimulus, _ in scheduler.transition_log]
            assert len(log) > 3000
            assert wait_drained(timeout=90), (
                f"the pipeline did not drain: {asyncio.run(pipeline_lag())}\n{''.join(up.output)}")
            _, letters = backend.query(  # the data dir is this test's own
                f"SELECT topic, reason FROM {backend.database}.dead_letters LIMIT 3", {})
            assert letters == [], letters  # what the producers sent, the sink takes
            assert transition_differences(backend, cluster_id, log) == []
            _, rows = queries.gaps_and_drops(backend, cluster_id)
            # missing, gaps reported, events dropped: none, for every producer
            assert rows and all(not r[7] and not r[8] and not r[9] for r in rows), rows
        assert "".join(up.output).count("ready again") == 2
        up.terminate(timeout=150)
        assert up.proc.returncode == 0, "".join(up.output)
        assert "dask-blackbox: stopped" in "".join(up.output)
    finally:
        up.stop()
