"""Why was my run slow, against causes planted in real clusters recorded by the real
pipeline (producers -> Tansu -> the sink subprocess -> chDB), with Dask's own numbers
captured while each cluster was alive.

One module-scoped recording holds every cluster (LocalClusters of 2 workers x 2
threads, in-process workers, small graphs of sleeps):

- ``chain``: a planted graph whose longest path is known by construction (six
  0.12 s tasks in a chain, then ``final``; shorter side branches on the other
  threads), in span ``planted``; ``chain-nograph`` the same without its graph
  recorded (``producer.graph-max-tasks: 0``), ``chain-capped`` with part of it;
- ``reg-base`` x 5 and ``reg-slow`` x 2: span ``etl`` with prefixes ``extract``,
  ``transform`` and ``load``, ``transform`` planted 15% slower in ``reg-slow``. Ten
  identical pairs (the base runs two by two) and ten regressed pairs (each base run
  against each slow one) are compared, the other base runs as history.

What is proven:

- the critical path of ``planted`` is exactly the chain and ``final``, from the
  recorded graph, and from the actions alone when the graph was not recorded; its
  parts add up to Dask's ``Span.stop - Span.start`` within 1%, its compute part to
  the planted sleeps;
- every span's CPU seconds and thread-seconds equal Dask's
  ``Span.cumulative_worker_metrics`` and ``Span.active_cpu_seconds`` within 0.5%, and
  the root spans add up to the scheduler's ``cumulative_worker_metrics`` within 1%;
- regressions: the planted prefix is flagged and blamed in at least 9 of 10 pairs
  (and found on the critical path), at most 1 false alarm in 10 identical pairs;
- the CLI answers in units within 120 columns, the JSON API and the Run and Compare
  pages show the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import itertools
import json
import subprocess
import sys
import time
import uuid

import dask
import dask.config
import pytest
from dask import delayed
from distributed import Client, LocalCluster, span

from dask_blackbox import kafka, producers
from dask_blackbox.cli import main as cli
from dask_blackbox.read import api, cost, critical_path, regressions, report, views

from conftest import subprocess_env
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.settings import dask_env
from sink_support import SinkProcess, wait_consumed

CHAIN = [f"chain-{i}" for i in range(6)]
CHAIN_S = 0.12
FINAL_S = 0.05
BASE_RUNS, SLOW_RUNS = 5, 2
PLANTED = 1.15


def work(seconds: float, *deps) -> int:
    time.sleep(seconds)
    return 1


def planted_chain():
    """The chain (known longest path) and shorter branches beside it."""
    node = delayed(work)(CHAIN_S, dask_key_name=CHAIN[0])
    for key in CHAIN[1:]:
        node = delayed(work)(CHAIN_S, node, dask_key_name=key)
    sides = [delayed(work)(0.04, dask_key_name=f"side-{i}") for i in range(6)]
    mids = [delayed(work)(0.08, s, dask_key_name=f"mid-{i}") for i, s in enumerate(sides)]
    return delayed(work)(FINAL_S, node, *mids, dask_key_name="final")


def etl(factor: float):
    """Three prefixes; ``transform`` takes ``factor`` times as long. Its tasks sleep
    0.4 s: a busy machine adds milliseconds (tens, on a 2-core machine running a dozen
    jobs) to a sleep, one-sided and to a few tasks at a time; that must stay well
    under the planted change."""
    extract = [delayed(work)(0.040 * (1 + 0.02 * (i % 4)), dask_key_name=f"extract-{i}")
               for i in range(16)]
    transform = [delayed(work)(0.400 * (1 + 0.02 * (i % 4)) * factor, e,
                               dask_key_name=f"transform-{i}") for i, e in enumerate(extract)]
    return [delayed(work)(0.040, *transform[4 * i:4 * i + 4], dask_key_name=f"load-{i}")
            for i in range(4)]


async def _heartbeat(dask_worker):
    await dask_worker.heartbeat()


def _dask_truth(dask_scheduler) -> dict:
    """Dask's own numbers: every span's, and the scheduler's totals."""
    spans = {}
    for s in dask_scheduler.extensions["spans"].spans.values():
        metrics = s.cumulative_worker_metrics
        spans[s.id] = {
            "name": tuple(s.name), "start": s.start, "stop": s.stop, "enqueued": s.enqueued,
            "parent": s.parent.id if s.parent else None,
            "active_cpu_seconds": s.active_cpu_seconds,
            "cpu": sum(v for k, v in metrics.items() if k[0] == "execute" and k[2] == "thread-cpu"),
            "busy": sum(v for k, v in metrics.items() if k[0] == "execute" and k[-1] == "seconds"
                        and k[1] != "N/A"),
            "idle_or_other": metrics.get(("execute", "N/A", "idle or other spans", "seconds")),
        }
    totals = dask_scheduler.cumulative_worker_metrics
    finished = sum(1 for t in dask_scheduler.transition_log if t[1:3] == ("processing", "memory"))
    return {"spans": spans, "finished": finished,
            "cpu": sum(v for k, v in totals.items() if isinstance(k, tuple) and k[0] == "execute"
                       and k[-2] == "thread-cpu"),
            "busy": sum(v for k, v in totals.items() if isinstance(k, tuple) and k[0] == "execute"
                        and k[-1] == "seconds")}


def _record(name: str, graph, overrides: dict, span_name: str) -> dict:
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None,
                      silence_logs=50) as cluster, Client(cluster) as client:
        identity = producers.attach(client, cluster_name=name, **{
            "producer.flush-interval": "20ms", "producer.metrics-interval": "100ms", **overrides})
        with span(span_name):
            client.compute(graph, sync=True)
        client.run(_heartbeat)  # Dask's span metrics complete, as the producers' are
        truth = client.run_on_scheduler(_dask_truth)
        time.sleep(0.25)  # a metrics sample after the last task
    return {"cluster_id": identity["cluster_id"], "name": name, **truth}


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    prefix = "s" + uuid.uuid4().hex[:10]
    data_dir = tmp_path_factory.mktemp("slowness") / "data"
    settings = {
        "blackbox.kafka.bootstrap-servers": broker,
        "blackbox.kafka.topic-prefix": prefix,
        "blackbox.kafka.partitions": 2,
        "blackbox.data-dir": str(data_dir),
        "blackbox.sink.group-id": f"sink-{prefix}",
    }
    env = dask_env(settings)
    out: dict = {"env": env, "settings": settings, "data_dir": data_dir, "runs": {}}
    started = time.monotonic()
    with dask.config.set({**settings, "optimization.fuse.active": False}):
        asyncio.run(kafka.ensure_topics())
        sink = SinkProcess(env)
        try:
            sink.wait_ready()
            for name, overrides in (("chain", {}), ("chain-nograph", {"producer.graph-max-tasks": 0}),
                                    ("chain-capped", {"producer.graph-max-tasks": 8})):
                out["runs"][name] = [_record(name, planted_chain(), overrides, "planted")]
            # A slow run first, then the base runs, then the other slow run: the
            # command line compares the latest (slow) with the one before (base).
            for i in [BASE_RUNS] + list(range(BASE_RUNS)) + list(range(BASE_RUNS + 1, BASE_RUNS + SLOW_RUNS)):
                name = "reg-base" if i < BASE_RUNS else "reg-slow"
                out["runs"].setdefault(name, []).append(
                    _record(name, etl(1.0 if i < BASE_RUNS else PLANTED), {}, "etl"))
                if i == BASE_RUNS:
                    out["after_first_slow"] = time.time()
            wait_consumed(sink)
            out["backend"] = sink.backend()
            # A scheduler's sender thread may still be sending when the
            # cluster is gone: wait until every run is there as Dask saw it.
            for runs in out["runs"].values():
                for run in runs:
                    wait_for(lambda: _loaded(out["backend"], run), 90,
                             f"the run of {run['name']} to be loaded")
            out["recorded_s"] = time.monotonic() - started
            yield out
        finally:
            sink.terminate()


def _loaded(backend, run: dict) -> bool:
    """Whether ClickHouse holds the run as Dask saw it: every task finished, and every
    thread-CPU second the workers reported."""
    _, rows = backend.query(
        "SELECT countIf(start = 'processing' AND finish = 'memory' AND source = 'scheduler') "
        "FROM blackbox.transitions WHERE cluster_id = {c:String}", {"c": run["cluster_id"]})
    _, cpu = backend.query(
        "SELECT sum(value) FROM blackbox.worker_digests WHERE cluster_id = {c:String} "
        "AND context = 'execute' AND activity = 'thread-cpu'", {"c": run["cluster_id"]})
    return rows[0][0] == run["finished"] and (cpu[0][0] or 0) >= run["cpu"] * 0.999


def _span(run: dict, name: tuple) -> tuple[str, dict]:
    [(span_id, truth)] = [(i, s) for i, s in run["spans"].items() if s["name"] == name]
    return span_id, truth


def _tree(run: dict, root: str) -> list[str]:
    out, todo = [], [root]
    while todo:
        sid = todo.pop()
        out.append(sid)
        todo += [i for i, s in run["spans"].items() if s["parent"] == sid]
    return out


@pytest.mark.parametrize("name, basis, found_by", [
    ("chain", "graph", "graph"), ("chain-nograph", "actions", "stimulus"),
    ("chain-capped", "graph and actions", None)])
def test_the_planted_chain_is_the_critical_path(recorded, name, basis, found_by):
    backend = recorded["backend"]
    [run] = recorded["runs"][name]
    span_id, truth = _span(run, ("planted",))
    path = critical_path.critical_path(backend, run["cluster_id"], _tree(run, span_id), span="planted")
    assert [link.key for link in path.links] == CHAIN + ["final"]
    assert path.basis == basis
    if found_by:
        assert [link.found_by for link in path.links[1:]] == [found_by] * len(CHAIN)
    assert path.links[0].found_by in ("root", "not proven")
    # The window is Dask's span, and the links cover it without gap or overlap.
    assert path.wall == pytest.approx(truth["stop"] - truth["start"], rel=0.01)
    assert sum(path.parts.values()) == pytest.approx(path.wall, rel=1e-9)
    for a, b in zip(path.links, path.links[1:]):
        assert a.stop == b.start
    assert path.links[0].start == path.t0 and path.links[-1].stop == path.t1
    # Each link computed what it slept (a busy machine only adds to it): durations of
    # one worker's clock between the scheduler's times. The first and last links meet
    # the window's ends, Dask's Span.start and stop: worker times corrected by an
    # estimate of the worker's clock offset, which a loaded machine can get wrong by
    # tens of milliseconds (Span.start is then raised to the span's enqueued).
    sleeps = [CHAIN_S] * len(CHAIN) + [FINAL_S]
    for link, slept in zip(path.links[1:-1], sleeps[1:-1]):
        assert link.parts["compute"] >= slept, (link.key, link.parts)
    for link, slept in ((path.links[0], sleeps[0]), (path.links[-1], sleeps[-1])):
        assert link.parts["compute"] >= slept / 2, (link.key, link.parts)
    assert path.parts["compute"] <= path.wall


def test_the_whole_run_has_the_same_path(recorded):
    [run] = recorded["runs"]["chain"]
    path = critical_path.critical_path(recorded["backend"], run["cluster_id"])
    assert [link.key for link in path.links] == CHAIN + ["final"]
    assert not path.notes  # a clean recorded graph: nothing to warn about


def test_span_costs_are_dasks_and_add_up_to_the_cluster(recorded):
    backend = recorded["backend"]
    checked = 0
    for runs in recorded["runs"].values():
        for run in runs:
            found = {c.span_id: c for c in cost.span_costs(backend, [run["cluster_id"]])}
            assert set(found) == set(run["spans"])
            for span_id, truth in run["spans"].items():
                c = found[span_id]
                assert c.measures.cpu_s == pytest.approx(truth["cpu"], rel=0.005)
                assert c.measures.busy_s == pytest.approx(truth["busy"], rel=0.005)
                assert c.offered_s == pytest.approx(truth["active_cpu_seconds"], rel=0.005)
                assert c.idle_or_other_s == pytest.approx(truth["idle_or_other"], rel=0.005, abs=1e-6)
                # idle threads of any span: none of the offered seconds more than once
                assert 0 <= c.idle_s <= c.offered_s
                assert sum(c.idle_by_worker.values()) == pytest.approx(c.idle_s, rel=0.01, abs=1e-3)
                checked += 1
            roots = [found[i] for i, s in run["spans"].items() if s["parent"] is None]
            totals = cost.cluster_totals(backend, [run["cluster_id"]])[run["cluster_id"]]
            assert sum(r.measures.cpu_s for r in roots) == pytest.approx(run["cpu"], rel=0.01)
            assert sum(r.measures.busy_s for r in roots) == pytest.approx(run["busy"], rel=0.01)
            fields = ["cpu_s", "busy_s", "memory_byte_s", "spilled_bytes"]
            if run["name"] == "chain-nograph":  # bytes moved are read from the graph
                assert totals.moved_bytes is None and all(r.measures.moved_bytes is None for r in roots)
            else:
                fields.append("moved_bytes")
            for field in fields:
                assert sum(getattr(r.measures, field) for r in roots) == pytest.approx(
                    getattr(totals, field), rel=0.01), field
            assert totals.memory_byte_s > 0
    assert checked >= 10


def _etl_runs(recorded) -> dict[str, regressions.Run]:
    return {r.cluster_id: r for r in regressions.span_runs(recorded["backend"], "etl")}


def test_a_prefix_planted_slower_is_flagged_and_identical_runs_are_not(recorded):
    backend = recorded["backend"]
    by_id = _etl_runs(recorded)
    base = [by_id[r["cluster_id"]] for r in recorded["runs"]["reg-base"]]
    slow = [by_id[r["cluster_id"]] for r in recorded["runs"]["reg-slow"]]
    blamed, on_path, alarms, seen = 0, 0, [], []
    for a, b in itertools.product(base, slow):  # ten regressed pairs
        c = regressions.compare_runs(backend, a, b, [x for x in base if x is not a])
        [t] = [x for x in c.changes if (x.prefix, x.action) == ("transform", "compute")]
        seen.append((c.verdict, round(t.ratio, 3), round(t.low, 3), round(t.high, 3),
                     f"p={t.p_value:.2g}", f"band={t.band:.2f}"))
        if c.verdict == "regression" and (c.culprit.prefix, c.culprit.action) == ("transform", "compute"):
            blamed += 1
            on_path += bool(c.on_path and c.on_path[0])
    for a, b in itertools.combinations(base, 2):  # ten identical pairs
        c = regressions.compare_runs(backend, a, b, [x for x in base if x not in (a, b)])
        if c.verdict in ("regression", "improvement"):  # "inconclusive" claims nothing
            alarms.append(c.sentences())
    assert blamed >= 9, seen
    assert on_path == blamed  # the chain runs through a transform task
    assert len(alarms) <= 1, alarms


def _cli(recorded, *args, process: bool = False) -> subprocess.CompletedProcess:
    """The command line's answer: in a process of its own, or (faster) called here
    with the recording's settings."""
    if process:
        env = subprocess_env(recorded["env"])
        return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args], env=env,
                              capture_output=True, text=True, timeout=120)
    out, err = io.StringIO(), io.StringIO()
    with dask.config.set(recorded["settings"]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_command_line_answers_in_units_within_120_columns(recorded):
    out = _cli(recorded, "critical-path", "--cluster", "chain", "--span", "planted", process=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("Critical path of span 'planted' in chain")
    assert "from the recorded graph" in lines[0] and " ms" in out.stdout
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)
    keys = [line.split()[1] for line in lines if line.split() and line.split()[0].isdigit()]
    assert keys == CHAIN + ["final"]
    as_json = json.loads(_cli(recorded, "critical-path", "--cluster", "chain-nograph", "--format",
                              "json").stdout)
    assert [link["key"] for link in as_json["links"]] == CHAIN + ["final"]
    assert as_json["basis"] == "actions" and as_json["notes"]

    # Since the first slow run: the latest (slow) against the base run before it.
    since = datetime.datetime.fromtimestamp(recorded["after_first_slow"], datetime.timezone.utc)
    out = _cli(recorded, "compare", "etl", "--since", since.isoformat())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "== verdict" and lines[1].startswith("REGRESSION: span 'etl' took ")
    assert any(line.startswith("culprit: prefix 'transform', compute: +") for line in lines)
    assert "on the critical path" in out.stdout and "Mann-Whitney U" in out.stdout
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)
    table = out.stdout[out.stdout.index("== the runs side by side"):]
    assert "elapsed_s" in table and " s " in table and "compute_s transform" in table
    # The whole runs of a cluster name: the last two base runs, no change.
    out = _cli(recorded, "compare", "--cluster", "reg-base")
    assert out.returncode == 0, out.stderr
    headline = out.stdout.splitlines()[1]
    assert headline.split(":")[0] in ("NO CHANGE BEYOND NOISE", "INCONCLUSIVE", "WALL TIME SLOWER",
                                      "WALL TIME FASTER"), headline
    assert ": the run of 'reg-base'" in headline

    out = _cli(recorded, "spans", "--cluster", "reg-slow", "--tree")
    assert out.returncode == 0, out.stderr
    assert "== what each span tree cost" in out.stdout and "memory_byte_s" in out.stdout
    assert all(len(line) <= 120 for line in out.stdout.splitlines())
    # --cluster NAME is the latest run of that name, and says so; --all-runs is every run
    assert "the latest of its 2 runs" in out.stderr and "--all-runs" in out.stderr, out.stderr
    latest = recorded["runs"]["reg-slow"][-1]
    assert latest["cluster_id"] in out.stderr
    as_json = json.loads(_cli(recorded, "spans", "--cluster", "reg-slow", "--format", "json").stdout)
    assert sorted(s["cpu_s"] for s in as_json) == pytest.approx(sorted(
        s["cpu"] for s in latest["spans"].values()), rel=1e-3)
    every = json.loads(_cli(recorded, "spans", "--cluster", "reg-slow", "--all-runs",
                            "--format", "json").stdout)
    assert sorted(s["cpu_s"] for s in every) == pytest.approx(sorted(
        s["cpu"] for run in recorded["runs"]["reg-slow"] for s in run["spans"].values()), rel=1e-3)
    out = _cli(recorded, "prefixes", "--cluster", "reg-slow", "--cost")
    assert out.returncode == 0, out.stderr


def test_a_regression_is_delivered_to_its_rules_once_per_comparison(recorded, tmp_path):
    """compare --alert hands the planted regression to a command rule, with the culprit;
    the same comparison twice carries the same idempotency key; a rule for another
    span and a comparison without a regression notify nobody."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write = ("import os, pathlib, sys; d = pathlib.Path(sys.argv[1]); "
             "(d / str(len(list(d.iterdir())))).write_bytes(sys.stdin.buffer.read())")
    rules = [{"name": "etl-slower", "when": "regression", "cluster": "reg-slow", "span": "etl",
              "command": [sys.executable, "-c", write, str(inbox)]},
             {"name": "other-span", "when": "regression", "span": "elsewhere",
              "command": [sys.executable, "-c", write, str(inbox)]}]
    since = datetime.datetime.fromtimestamp(recorded["after_first_slow"], datetime.timezone.utc)
    with dask.config.set({"blackbox.alerts.rules": rules}):
        first = _cli(recorded, "compare", "etl", "--since", since.isoformat(), "--alert")
        again = _cli(recorded, "compare", "etl", "--since", since.isoformat(), "--alert",
                     "--format", "json")
        calm = _cli(recorded, "compare", "--cluster", "reg-base", "--alert")
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    assert "alert etl-slower: delivered to command" in first.stderr
    assert "other-span" not in first.stderr + again.stderr
    assert calm.returncode == 0 and "alert" not in calm.stderr
    sent = [json.loads(p.read_bytes()) for p in sorted(inbox.iterdir())]
    assert len(sent) == 2
    assert sent[0]["kind"] == "regression" and sent[0]["rule"] == "etl-slower"
    assert sent[0]["culprit"]["prefix"] == "transform" and sent[0]["culprit"]["action"] == "compute"
    assert sent[0]["candidate"]["cluster_name"] == "reg-slow"
    assert sent[0]["summary"].startswith("REGRESSION: span 'etl' took ")
    assert sent[0]["idempotency_key"] == sent[1]["idempotency_key"]
    with dask.config.set({"blackbox.alerts.rules": [{"name": "bad", "when": "regression",
                                                     "prefix": "x", "command": "true"}]}):
        bad = _cli(recorded, "compare", "etl", "--since", since.isoformat(), "--alert")
    assert bad.returncode == 1
    assert "blackbox.alerts.rules[0] (bad): prefix belongs to a task-erred rule" in bad.stderr


def test_run_page_api_and_compare_page(recorded):
    backend = recorded["backend"]
    data = api.run_panel(backend, "critical_path", {"cluster": "chain", "span": "planted"})
    assert [link["key"] for link in data["links"]] == CHAIN + ["final"]
    priced = api.run_panel(backend, "cost", {"cluster": "reg-slow"})
    assert {s["name"][0] for s in priced["spans"]} == {"etl"}
    assert set(priced["prefixes"]) == {"extract", "transform", "load"}
    html = report.render_run(views.run_data(backend, "chain", span="planted"))
    assert html.count('class="link"') == len(CHAIN) + 1
    assert '"critical-path"' in html and 'id="cost-spans"' in html
    compared = api.compare(backend, {"span": "etl", "since": str(recorded["after_first_slow"])})
    assert compared["verdict"]["verdict"] == "regression"
    page = report.render_page("compare.html", web=False, cmp=compared, spans=[], query={},
                              generated=0, page_title="compare",
                              figures=report.compare_figures(compared))
    assert 'data-verdict="regression"' in page and 'data-prefix="transform"' in page


def test_compare_cuts_no_median_or_p_value_at_120_columns(recorded):
    """The regression's changes as rich draws them at 120 columns: every median, change,
    p-value and total whole (on its row, or below it), the header whole."""
    since = datetime.datetime.fromtimestamp(recorded["after_first_slow"], datetime.timezone.utc)
    out = _cli(recorded, "compare", "etl", "--since", since.isoformat())
    assert out.returncode == 0, out.stderr
    assert all(len(line) <= 120 for line in out.stdout.splitlines())
    assert "…" not in out.stdout
    verdict = json.loads(_cli(recorded, "compare", "etl", "--since", since.isoformat(),
                              "--format", "json").stdout)["verdict"]
    table = out.stdout[out.stdout.index("== changes per prefix"):]
    for change in verdict["changes"]:
        assert change["prefix"] in table
        if change["p_value"] is not None and change["p_value"] == change["p_value"]:
            assert f"{change['p_value']:.2g}" in table
    assert "median per task" in table or {"median", "per", "task"} <= set(table.split())
