"""The web UI, its JSON API and the HTML report, checked in a real browser against a
real recording: the local pipeline (Tansu, faust processors, the sink on chDB)
records two LocalClusters -- one runs nested spans, a task whose key looks like
HTML, a failing task and a task that kills its workers (KilledWorker) -- and both
shut down before anything is looked at. Headless Chromium from Debian
(/usr/bin/chromium) is driven by Playwright's Python package.

What a person would check: the clusters page lists the clusters; the run page's
task stream has one bar per recorded compute; the worker deaths are marked at their
recorded times; the span tree shows the nested spans with Dask's durations; the
report renders offline with no console errors; HTML in a key or a log line is
shown as text; unknown clusters, spans and keys are named, never a stack trace.

Captured from the live cluster as it ran, to check the pages against: what the
scheduler said of each worker as it joined, of each task group as it forgot it and
of each prefix (``GroupCensus``), Dask's own task stream, the span tree, and each
worker's executing / ready / in-flight counts and CPU sampled every 0.1 s
(``LiveSampler``) while planted causes ran: every thread of both workers napping, a
value that takes two seconds to send, one core held on one worker.

Set DASK_BLACKBOX_SCREENSHOTS=DIR to keep screenshots of the Run page there.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid

import dask.array as da
import dask.config
import orjson
import pytest
from distributed import Client, LocalCluster, span, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import KilledWorker
from distributed.utils import key_split_group

from dask_blackbox import producers
from dask_blackbox.deploy.supervisor import LocalPipeline, wait_drained
from dask_blackbox.read import backends

from conftest import pipeline_settings
from cluster_support import live_workers
from dask_blackbox.testing.polling import wait_for
from ui_support import Page, start_ui


pytestmark = [pytest.mark.browser, pytest.mark.integration]

HTML_KEY = "<script>alert(1)</script>"
HTML_LOG = "<b>not bold</b><img src=x onerror=alert(2)>"
KILLER = "complex-computation-0bad"
HTML_SPAN = "<i>graph</i>&span=etl"
SMALL = "ui-small<img src=x onerror=alert(3)>"  # a cluster named like HTML
#: A key whose task group (Dask's ``key_split``: ``a'"><img src=x onerror=alert(4)>``)
#: holds both quotes and a tag.
QUOTE_KEY = "a'\"><img src=x onerror=alert(4)>-1"
LIMIT = 400 * 2**20
THREADS = 2
#: The workers' target fraction: above it, managed memory spills to disk.
SPILL_AT = 0.05
#: Seconds of each ``nap`` task; ``NAPS`` waves of them keep every thread of a worker busy.
NAP, NAPS = 0.25, 8
#: Seconds the worker holding a :class:`SlowToSend` takes to send it.
SEND_SECONDS = 2.0
#: Seconds of a ``spin`` task that the spinning worker's monitor samples, at least,
#: from :data:`MONITOR_LAG` after it began (the task holds its core until then).
SPIN = 1.5
#: Seconds after a change of load before a worker's monitor shows it: its CPU is
#: measured over the previous interval (``distributed.admin.system-monitor.interval``,
#: 500 ms), sampled late on a loaded machine.
MONITOR_LAG = 1.0
#: Live samples of the spinning worker, at least, while its monitor shows the spin.
SPIN_SAMPLES = 10


def inc(x):
    return x + 1


def slow_inc(x):
    time.sleep(0.15)  # long enough to be seen in the task stream
    return x + 1


def div(x, y):
    return x / y


def nap(i):
    time.sleep(NAP)
    return i


def spin(flags: str) -> tuple[float, float]:
    """Hold one core (and the GIL) from when it writes its start time to the file
    ``started`` in ``flags`` until the file ``stop`` is there; its start and end."""
    start = time.time()
    folder = pathlib.Path(flags)
    (folder / "started.tmp").write_text(repr(start))
    (folder / "started.tmp").rename(folder / "started")
    stop, n = folder / "stop", 0
    while True:
        n += 1
        if n % 20_000 == 0 and stop.exists():
            return start, time.time()


class SlowToSend:
    """A value whose pickling, on the worker that sends it to another, takes
    :data:`SEND_SECONDS`: the worker fetching it has a transfer in flight that long."""

    def __reduce__(self):
        time.sleep(SEND_SECONDS)
        return (SlowToSend, ())


def make_slow_to_send() -> SlowToSend:
    return SlowToSend()


def name_of(x) -> str:
    return type(x).__name__


def shout(x):
    logging.getLogger("distributed.worker").warning(HTML_LOG)
    return x


def exceed_memory(limit_bytes: int) -> int:
    """Grow until the nanny kills this worker (see tests/integration/test_end_to_end.py)."""
    logging.getLogger("distributed.worker").warning("about to load the whole partition")
    time.sleep(1.0)
    hoard = []
    while True:
        hoard.append(bytearray(16 * 2**20))
        time.sleep(0.02)
        if len(hoard) * 16 * 2**20 > 4 * limit_bytes:
            os._exit(1)


def _span_truth(cluster: LocalCluster) -> dict[tuple, dict]:
    ext = cluster.scheduler.extensions["spans"]
    return {tuple(s.name): {"id": s.id, "duration": s.duration, "depth": len(s.name) - 1}
            for s in ext.spans.values()}


class WorkerCensus(SchedulerPlugin):
    """What Dask's scheduler says of each worker as it joins (``Scheduler.workers``,
    what its ``/workers`` page shows): threads, memory limit and name, captured while
    the cluster runs."""

    name = "ui-test-census"

    def __init__(self) -> None:
        self.workers: dict[str, dict] = {}

    def add_worker(self, scheduler, worker: str) -> None:
        ws = scheduler.workers[worker]
        self.workers[worker] = {"nthreads": ws.nthreads, "memory_limit": ws.memory_limit,
                                "name": str(ws.name)}


class GroupCensus(SchedulerPlugin):
    """What Dask's scheduler says of each task group (``Scheduler.task_groups``):
    its tasks, compute and transfer seconds (``all_durations``), bytes
    (``nbytes_total``), first compute start and last stop, taken as the scheduler
    forgets the group (its last task forgotten: Dask deletes the group right after
    its plugins hear of that transition) or, for a group still alive, at
    :meth:`finish`; its ``states`` as they were after the last of its tasks
    finished (into memory or erred); and each prefix's ``state_counts``, Dask's
    count of the transitions into each state, which it never forgets.

    A name the scheduler gave two groups in turn (a group forgotten, then made
    again) holds both, as a page shows one group per name."""

    name = "ui-test-groups"

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        #: id of each TaskGroup seen -> (the group, its figures, its states when it finished)
        self._lives: dict[int, list] = {}

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish not in ("memory", "erred", "forgotten"):
            return
        ts = self.scheduler.tasks.get(key)  # a forgotten task is put back for the plugins
        if ts is None:
            return
        tg = ts.group
        life = self._lives.setdefault(id(tg), [tg, None, None])  # holding tg: no id reused
        if finish != "forgotten":
            life[2] = dict(tg.states)
        elif all(n == 0 or state == "forgotten" for state, n in tg.states.items()):
            life[1] = self._figures(tg)

    @staticmethod
    def _figures(tg) -> dict:
        durations = tg.all_durations
        return {"prefix": tg.prefix.name, "tasks": len(tg), "compute": durations.get("compute", 0.0),
                "transfer": durations.get("transfer", 0.0), "nbytes": tg.nbytes_total,
                "start": tg.start, "stop": tg.stop}

    def finish(self) -> tuple[dict[str, dict], dict[str, dict]]:
        """Per group name, its figures summed over the groups of that name (and
        ``lives``, how many); per prefix, ``state_counts``."""
        out: dict[str, dict] = {}
        for tg, figures, states in self._lives.values():
            figures = figures or self._figures(tg)
            seen = out.get(tg.name)
            if seen is None:
                out[tg.name] = {**figures, "states": dict(states or {}), "lives": 1}
                continue
            for k in ("tasks", "compute", "transfer", "nbytes"):
                seen[k] += figures[k]
            for state, n in (states or {}).items():
                seen["states"][state] = seen["states"].get(state, 0) + n
            seen["start"] = min(x for x in (seen["start"], figures["start"]) if x) if (
                seen["start"] or figures["start"]) else 0.0
            seen["stop"] = max(seen["stop"], figures["stop"])
            seen["lives"] += 1
        prefixes = {name: dict(tp.state_counts) for name, tp in self.scheduler.task_prefixes.items()}
        return out, prefixes


def _sample(dask_worker) -> dict:
    """What a worker says of itself now, read on its event loop as the producer reads it."""
    state = dask_worker.state
    return {"t": time.time(), "executing": state.executing_count, "ready": len(state.ready),
            "in_flight": state.in_flight_tasks_count, "incoming": state.transfer_incoming_count,
            "cpu": dask_worker.monitor.recent().get("cpu"), "nthreads": state.nthreads}


class LiveSampler:
    """Samples workers with :func:`_sample` every ``interval`` seconds while it is
    entered, one thread per worker (a worker whose event loop is busy delays its own
    samples only): ``samples[worker]`` in time order."""

    def __init__(self, client: Client, workers: list[str], interval: float = 0.1) -> None:
        self.client, self.workers, self.interval = client, workers, interval
        self.samples: dict[str, list[dict]] = {w: [] for w in workers}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in workers]

    def _run(self, worker: str) -> None:
        while not self._stop.is_set():
            self.samples[worker].append(self.client.run(_sample, workers=[worker])[worker])
            self._stop.wait(self.interval)

    def __enter__(self) -> LiveSampler:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def _planted_activity(client: Client, truth: dict) -> None:
    """Causes the Processing, CPU and transfer views must show, sampled live: both
    workers' threads all napping (restricted tasks are sent ahead, not queued), a
    transfer in flight for :data:`SEND_SECONDS` into the second worker, a core held
    on the first one only, until its monitor has been sampled for :data:`SPIN` seconds."""
    a, b = sorted(live_workers(client))
    with LiveSampler(client, [a, b]) as live:
        time.sleep(0.3)
        start = time.time()
        naps = [client.map(nap, range(100 * i, 100 * i + NAPS * THREADS), workers=[w],
                           allow_other_workers=False) for i, w in enumerate((a, b))]
        client.gather(naps)
        truth["nap_window"] = (start, time.time())
        sent = client.submit(make_slow_to_send, key="slow-to-send", workers=[a], allow_other_workers=False)
        wait(sent)
        start = time.time()
        assert client.submit(name_of, sent, key="receive-slow", workers=[b],
                             allow_other_workers=False).result() == "SlowToSend"
        truth["send_window"] = (start, time.time())
        del sent
        # The core is held until the spinning worker's monitor has been sampled long
        # enough, however slowly this machine runs it.
        flags = pathlib.Path(tempfile.mkdtemp(prefix="spin-"))
        spun = client.submit(spin, str(flags), key="spin-a", workers=[a], allow_other_workers=False)
        began = float(wait_for(lambda: (flags / "started").exists() and (flags / "started").read_text(),
                               120, "the spin to begin"))

        def sampled_enough() -> bool:
            seen = [s["t"] for s in live.samples[a] if s["t"] >= began + MONITOR_LAG]
            return len(seen) >= SPIN_SAMPLES and seen[-1] - seen[0] >= SPIN

        wait_for(sampled_enough, 120, "the spinning worker's monitor to be sampled", interval=0.1)
        (flags / "stop").write_text("")
        truth["spin_window"] = spun.result(timeout=120)
        del spun
        shutil.rmtree(flags, ignore_errors=True)
        time.sleep(0.3)
    truth["live"], truth["live_workers"] = live.samples, (a, b)


def _tree_graph() -> tuple:
    """A delayed reduction tree (8 leaves, pairwise sums): its keys and dependencies
    as Dask itself lists them."""
    import dask
    from dask.core import get_dependencies

    leaves = [dask.delayed(inc, pure=True)(i, dask_key_name=f"leaf-{i}") for i in range(8)]
    level, depth = leaves, 0
    while len(level) > 1:
        depth += 1
        level = [dask.delayed(add, pure=True)(a, b, dask_key_name=f"sum-{depth}-{i}")
                 for i, (a, b) in enumerate(zip(level[::2], level[1::2]))]
    total = level[0]
    graph = dict(total.__dask_graph__())
    edges = {(dep, key) for key in graph for dep in get_dependencies(graph, key)}
    return total, set(graph), edges


def add(a, b):
    return a + b


def _record_killed(truth: dict) -> None:
    import dask.dataframe as dd
    import pandas as pd
    from distributed import get_task_stream

    census = WorkerCensus()
    with LocalCluster(n_workers=2, threads_per_worker=THREADS, processes=True, memory_limit=LIMIT,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        cluster.scheduler.add_plugin(census)
        groups = GroupCensus(cluster.scheduler)
        cluster.scheduler.add_plugin(groups)
        census.workers.update({w: {"nthreads": ws.nthreads, "memory_limit": ws.memory_limit,
                                   "name": str(ws.name)}
                               for w, ws in cluster.scheduler.workers.items()})
        truth["killed_id"] = producers.attach(client, cluster_name="ui-killed", **{
            "producer.flush-interval": "20ms", "producer.metrics-interval": "200ms"})["cluster_id"]
        with get_task_stream(client) as stream:
            with span("etl"):
                with span("load"):
                    x = client.persist(da.ones((400, 400), chunks=100) + 1)
                    wait(x)
                with span("reduce"):
                    assert client.compute(x.sum()).result() == 2 * 400 * 400
            with span(HTML_SPAN):
                total, nodes, edges = _tree_graph()
                assert client.compute(total).result() == sum(range(1, 9))
                truth["tree_nodes"], truth["tree_edges"] = nodes, edges
            # spilled: more managed memory than the workers' target fraction
            spill = client.persist(da.random.random((6, 2**20), chunks=(1, 2**20)))
            wait(spill)
            df = dd.from_pandas(pd.DataFrame({"a": range(4000), "b": range(4000)}), npartitions=4)
            assert len(df.shuffle("a", shuffle_method="p2p").compute()) == 4000
            del spill
            client.gather(client.map(inc, range(8)))
            client.gather(client.map(slow_inc, range(10)))
            _planted_activity(client, truth)
            assert client.submit(inc, 1, key=HTML_KEY).result() == 2
            assert client.submit(inc, 2, key=QUOTE_KEY).result() == 3
            assert client.submit(shout, 3, key="shout-1").result() == 3
            bad = client.submit(div, 1, 0, key="div-bad")
            wait([bad])
            with span("nightly"):
                doomed = client.submit(exceed_memory, LIMIT, key=KILLER)
            with pytest.raises(KilledWorker):
                doomed.result(timeout=120)
            # The results the dead workers held, computed again before they are let go:
            # every task group ends with each of its tasks finished.
            wait(x, timeout=60)
        truth["task_stream"] = [
            {"worker": t["worker"], "thread": t["thread"], "key": t["key"], "status": t["status"],
             "group": key_split_group(t["key"]),
             "start": min((s["start"] for s in t["startstops"] if s["action"] == "compute"), default=None),
             "startstops": [(s["action"], s["start"], s["stop"]) for s in t["startstops"]]}
            for t in stream.data]
        del doomed, bad, x
        removals = [(ts, msg["worker"]) for ts, msg in cluster.scheduler.get_events("all")
                    if msg.get("action") == "remove-worker" and msg.get("expected") is False]
        truth["deaths"] = sorted(ts for ts, _ in removals)
        truth["dead_workers"] = sorted(w for _, w in removals)
        truth["census"] = dict(census.workers)
        client.close()
        time.sleep(0.5)
        truth["killed_spans"] = _span_truth(cluster)
        truth["groups"], truth["prefix_states"] = groups.finish()


def _scheduler_id(dask_scheduler):
    return dask_scheduler.plugins[producers.PLUGIN_NAME].identity["cluster_id"]


def _record_small(truth: dict) -> None:
    """A second cluster recorded by the scheduler plugin alone (a scheduler
    preload without the workers'): no worker metrics, the panels it can."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        settings = producers.ProducerSettings.resolve({"producer.flush-interval": "20ms"},
                                                      cluster_name=SMALL)
        client.register_plugin(producers.BlackboxSchedulerPlugin(settings), name=producers.PLUGIN_NAME)
        truth["small_id"] = client.run_on_scheduler(_scheduler_id)
        with span("etl"):
            client.gather(client.map(inc, range(4)))


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    """Two recorded clusters (gone), the pipeline still serving queries, and a
    `dask-blackbox ui` subprocess over it."""
    prefix = "ui" + uuid.uuid4().hex[:8]
    root = tmp_path_factory.mktemp("ui")
    settings, bb_env = pipeline_settings(broker, prefix, root / "data")
    env = {**os.environ, **bb_env}
    truth: dict = {"root": root, "env": env}
    with dask.config.set({**settings, "optimization.fuse.active": False,
                          "distributed.scheduler.allowed-failures": 1,
                          "distributed.worker.memory.target": SPILL_AT}):
        pipeline = LocalPipeline(kafka=broker)
        pipeline.start(progress=lambda m: None)
        ui = None
        try:
            _record_killed(truth)
            _record_small(truth)
            assert len(truth["deaths"]) == 2  # allowed-failures=1: the second death is fatal
            assert wait_drained(timeout=120), "the pipeline did not drain"
            truth["backend"] = backends.running_sink()
            assert truth["backend"] is not None
            ui, truth["url"], truth["ui_log"] = start_ui(env, root / "ui.log")
            yield truth
        finally:
            if ui is not None:
                ui.terminate()
                ui.wait(30)
            pipeline.stop(drain_timeout=0)


def _computes(backend, cluster_id: str) -> int:
    _, rows = backend.query(
        f"SELECT count() FROM {backend.database}.transitions ARRAY JOIN startstops AS ss "
        "WHERE cluster_id = {c:String} AND source = 'scheduler' AND ss.action = 'compute'",
        {"c": cluster_id})
    return rows[0][0]


def _recorded_deaths(backend, cluster_id: str, workers: list[str]) -> list[float]:
    """When the lifecycle table says these workers were removed."""
    _, rows = backend.query(
        f"SELECT toFloat64(ts) FROM {backend.database}.lifecycle WHERE cluster_id = {{c:String}} "
        "AND action = 'worker_removed' AND worker IN {w:Array(String)} ORDER BY ts",
        {"c": cluster_id, "w": workers})
    return [r[0] for r in rows]


def _check_run_page(page: Page, recorded: dict) -> None:
    backend, cluster_id = recorded["backend"], recorded["killed_id"]
    # One bar per recorded compute, counted in ClickHouse.
    stream = page.model("task-stream")
    assert stream is not None, "no task stream on the page"
    computes = _computes(backend, cluster_id)
    assert computes > 30
    assert stream["action"].count("compute") == computes
    assert HTML_KEY in stream["key"]
    # Worker deaths marked at their recorded times (and those are Dask's).
    marks = page.model("markers")
    deaths = sorted(x for x, kind in zip(marks["x"], marks["kind"]) if kind == "death")
    recorded_deaths = _recorded_deaths(backend, cluster_id, recorded["dead_workers"])
    assert len(recorded_deaths) == 2
    assert deaths == pytest.approx([t * 1000 for t in recorded_deaths], abs=1e-3)
    assert [t / 1000 for t in deaths] == pytest.approx(recorded["deaths"], abs=1.0)
    # The same marks are drawn on every time axis.
    drawn = page.page.evaluate(
        """() => { let n = 0;
             for (const d of Bokeh.documents) for (const m of d.all_models)
               if (m.data_source && m.data_source.name === 'markers') n++;
             return n; }""")
    assert drawn >= 6  # task stream, progress, states, memory (2), spans
    # The span tree: nested spans with Dask's own durations.
    rows = page.page.eval_on_selector_all(
        "#span-tree tr.span", "rows => rows.map(r => [r.dataset.spanId, r.dataset.depth, r.dataset.taskS,"
        " r.querySelector('td').innerText.trim()])")
    by_id = {span_id: (int(depth), float(task_s) if task_s else None, text)
             for span_id, depth, task_s, text in rows}
    for name, want in recorded["killed_spans"].items():
        depth, task_s, text = by_id[want["id"]]
        assert depth == want["depth"], name
        assert text.startswith(name[-1]), (name, text)
        assert task_s == pytest.approx(want["duration"], abs=1e-5), name
    assert {("etl",), ("etl", "load"), ("etl", "reduce"), ("nightly",)} <= set(recorded["killed_spans"])
    # Failures: the killer erred with KilledWorker, on the two workers it killed.
    failures = page.page.inner_text("#failures ~ table#erred-tasks")
    assert KILLER in failures and "KilledWorker" in failures and "div-bad" in failures
    assert len(page.page.query_selector_all(".dead-worker")) == 2
    # HTML in a log line is text.
    assert HTML_LOG in page.page.inner_text("#logs-table")
    assert not page.dialogs and not page.errors, (page.dialogs, page.errors)


def test_clusters_and_run_page_in_a_browser(recorded, browser):
    page = Page(browser)
    try:
        page.goto(recorded["url"], charts=False)
        listed = page.page.eval_on_selector_all("#clusters tr.cluster", "rows => rows.map(r => r.dataset.clusterId)")
        assert {recorded["killed_id"], recorded["small_id"]} <= set(listed)
        assert "ui-killed" in page.page.inner_text("#clusters")
        page.page.click("text=ui-killed")
        page.goto(page.page.url)
        assert page.page.inner_text("#cluster-name") == "ui-killed"
        _check_run_page(page, recorded)
        shots = os.environ.get("DASK_BLACKBOX_SCREENSHOTS")
        if shots:
            out = pathlib.Path(shots)
            out.mkdir(parents=True, exist_ok=True)
            page.page.wait_for_timeout(1000)  # let every canvas paint
            page.page.screenshot(path=str(out / "run-page.png"), full_page=True)
            for section, name in (("#task-stream", "run-task-stream"), ("#memory", "run-memory"),
                                  ("#spans", "run-spans"), ("#failures", "run-failures")):
                page.page.locator(section).scroll_into_view_if_needed()
                page.page.wait_for_timeout(300)
                page.page.screenshot(path=str(out / f"{name}.png"))
        # The task page of the HTML-looking key shows it as text, with its story.
        response = page.page.goto(recorded["url"] + "task?" + urllib.parse.urlencode(
            {"cluster": recorded["killed_id"], "key": HTML_KEY}))
        assert response.status == 200, (page.page.content(), recorded["ui_log"].read_text())
        assert page.page.inner_text("#task-key") == HTML_KEY
        assert "memory" in page.page.inner_text("#story")
        # The killer's page: its story and the log line of the worker it killed.
        page.page.goto(recorded["url"] + "task?" + urllib.parse.urlencode(
            {"cluster": "ui-killed", "key": KILLER}))
        story = page.page.inner_text("#story")
        assert "erred" in story and "about to load the whole partition" in story
        # A cluster without metrics shows the panels it can.
        page.goto(recorded["url"] + "run?" + urllib.parse.urlencode({"cluster": SMALL}))
        assert page.page.inner_text("#cluster-name") == SMALL
        assert page.page.query_selector("#no-memory") is not None
        assert page.model("task-stream")["action"].count("compute") == _computes(
            recorded["backend"], recorded["small_id"])
        # Compare: the span "etl" in both clusters.
        page.goto(recorded["url"] + "compare?span=etl")
        header = page.page.inner_text("#compare tr")
        assert "ui-killed" in header and "ui-small" in header
        assert not page.dialogs and not page.errors, (page.dialogs, page.errors)
    finally:
        page.close()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_unknown_names_and_json_api(recorded):
    url, cid = recorded["url"], recorded["killed_id"]
    status, body = _get(url + "api/run/task_stream?" + urllib.parse.urlencode({"cluster": "ui-killed"}))
    assert status == 200
    stream = orjson.loads(body)
    assert stream["mode"] == "bars"
    assert sum(b["action"] == "compute" for b in stream["bars"]) == _computes(recorded["backend"], cid)
    status, body = _get(url + "api/run/spans?" + urllib.parse.urlencode({"cluster": cid, "span": "etl"}))
    assert status == 200
    names = {s["name"] for s in orjson.loads(body)["spans"]}
    assert names == {"etl", "load", "reduce"}
    for path, status_code, text in [
        ("api/run/summary?cluster=nope", 404, "no recorded cluster is named 'nope'"),
        (f"api/run/summary?cluster={cid}&span=nope", 404, "no span named 'nope'"),
        (f"api/task?cluster={cid}&key=nope", 404, "no task 'nope'"),
        (f"api/run/logs?cluster={cid}&level=LOUD", 400, "level must be one of"),
        (f"api/run/summary?cluster={cid}&since=yesterday-ish", 400, "since="),
        ("api/compare?span=nope", 404, "no span named 'nope'"),
    ]:
        status, body = _get(url + path)
        assert status == status_code, (path, body)
        assert text in orjson.loads(body)["error"], (path, body)
    # Pages name what is missing, escaped, without a stack trace.
    status, body = _get(url + "run?" + urllib.parse.urlencode({"cluster": HTML_KEY}))
    assert status == 404
    assert b"no recorded cluster is named &#39;&lt;script&gt;alert(1)&lt;/script&gt;&#39;" in body
    assert b"Traceback" not in body and b"<script>alert(1)" not in body
    status, body = _get(url + "task?" + urllib.parse.urlencode({"cluster": cid, "key": "nope"}))
    assert status == 404 and b"no task &#39;nope&#39;" in body
    # `dask-blackbox ui` answers its own host only (DNS rebinding reads nothing).
    import http.client

    port = urllib.parse.urlsplit(url).port
    for host, expected in (("attacker.example", 400), (f"localhost:{port}", 200)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.putrequest("GET", "/api/clusters", skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        assert conn.getresponse().status == expected, host
        conn.close()


def test_report_renders_offline(recorded, browser):
    out = recorded["root"] / "report.html"
    done = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "report", "--cluster", "ui-killed",
                           "-o", str(out)], env=recorded["env"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    missing = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "report", "--cluster", "nope",
                              "-o", str(out) + ".x"], env=recorded["env"], capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 1
    assert missing.stderr.strip() == ("dask-blackbox: error: no recorded cluster is named 'nope' "
                                      "or has that id")
    copy = recorded["root"] / "elsewhere" / "report.html"  # nothing next to it to load
    copy.parent.mkdir()
    shutil.copy(out, copy)
    page = Page(browser, offline=True)
    try:
        page.goto(copy.as_uri())
        assert [u for u in page.requests if not u.startswith("file:")] == []
        _check_run_page(page, recorded)
    finally:
        page.close()
    # the report embeds its document without Bokeh's validation: run it here, on the
    # same figures, and it finds nothing
    from bokeh.core.validation.check import check_integrity

    from dask_blackbox.read import report, views

    drawn = report.run_document(views.run_data(recorded["backend"], "ui-killed"))
    assert len(drawn.doc.roots) == len(drawn.names) > 5
    # each view drawn as its data comes (what the command does): the same page as the
    # same data drawn after it all came, even when the critical path's own view comes
    # late (the task stream, read before it, outlines the reduction tree's chain of sums)
    from concurrent.futures import ThreadPoolExecutor

    class LateCriticalPath(views.Arrivals):
        def add(self, name: str, values: dict) -> None:
            if name == "critical_path":
                time.sleep(0.5)
            super().add(name, values)

    arrivals = LateCriticalPath()
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(views.read_run, "ui-killed", HTML_SPAN, backend=recorded["backend"],
                              arrivals=arrivals)
        streamed = report.render_run(arrivals.data, arrivals=arrivals)
        reading.result()
    assert '"critical-path"' in streamed
    assert _same_page(streamed) == _same_page(report.render_run(arrivals.data))
    issues = check_integrity(list(drawn.doc.models))
    assert (issues.error, issues.warning) == ([], [])


def _same_page(html: str) -> str:
    """A report's HTML without what differs between two drawings of the same data: the
    time it was generated, its elements' random ids, and Bokeh's model ids (numbered
    on in a process), numbered here in the order they appear."""
    html = re.sub(r"generated [0-9: -]+\.[0-9]+ UTC", "generated", html)
    html = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "uuid", html)
    ids: dict[str, str] = {}
    return re.sub(r"\bp[0-9]{4,}\b", lambda m: ids.setdefault(m[0], f"model{len(ids)}"), html)


def _rows_of(page: Page, selector: str, attrs: list[str]) -> dict[str, dict]:
    return page.page.eval_on_selector_all(
        selector, "(rows, attrs) => Object.fromEntries(rows.map(r => [r.dataset.worker, "
        "Object.fromEntries(attrs.map(a => [a, r.dataset[a]]))]))", attrs)


def test_workers_threads_and_graph_against_dask(recorded, browser):
    """The Workers panel against what Dask's scheduler said of each worker while the
    cluster ran (its ``/workers`` figures: threads, memory limit) and against Dask's own
    task stream (tasks each worker ran); the task stream's rows against the threads
    that ran tasks (``get_task_stream``'s ``thread``), ordered by each worker's first
    task, dead workers labelled; a worker's page reached from its address; the task
    graph of the span named like HTML against the graph Dask built (nodes and edges)."""
    census, ran = recorded["census"], recorded["task_stream"]
    tasks_of: dict[str, int] = {}
    erred_of: dict[str, int] = {}
    threads_of: dict[str, list] = {}
    first_of: dict[str, float] = {}
    for t in ran:
        tasks_of[t["worker"]] = tasks_of.get(t["worker"], 0) + 1
        erred_of[t["worker"]] = erred_of.get(t["worker"], 0) + (t["status"] == "error")
        if t["thread"] not in threads_of.setdefault(t["worker"], []):
            threads_of[t["worker"]].append(t["thread"])
        if t["start"] is not None:
            first_of[t["worker"]] = min(first_of.get(t["worker"], t["start"]), t["start"])
    assert len(census) >= 3 and sum(erred_of.values()) == 1  # 2 dead, a replacement (or two); div-bad
    page = Page(browser)
    try:
        page.goto(recorded["url"] + "run?" + urllib.parse.urlencode({"cluster": recorded["killed_id"]}),
                  charts=False)
        page.load("workers", "task_stream")
        rows = _rows_of(page, "#workers-table tr.worker", ["threads", "memoryLimit", "tasks", "died"])
        assert set(census) <= set(rows)
        for worker, live in census.items():
            assert int(rows[worker]["threads"]) == live["nthreads"] == THREADS, worker
            assert int(rows[worker]["memoryLimit"]) == live["memory_limit"] == LIMIT, worker
            assert int(rows[worker]["tasks"]) == tasks_of.get(worker, 0), worker
        assert sorted(w for w, r in rows.items() if r["died"] == "true") == recorded["dead_workers"]
        # Task-stream rows: one per thread that ran a task, workers in the order they began.
        labels = page.page.evaluate(
            """() => { for (const d of Bokeh.documents) { const f = d.get_model_by_name('task_stream');
                 if (f) { const o = f.left[0].major_label_overrides;
                          return o instanceof Map ? Object.fromEntries(o) : o; } } return null; }""")
        assert labels is not None
        rows_in_order = [labels[str(i)] for i in range(len(labels))]
        expected = []
        for worker in sorted(threads_of, key=lambda w: first_of[w]):
            died = " (died)" if worker in recorded["dead_workers"] else ""
            expected += [f"{worker} thread {i + 1}{died}" for i in range(len(threads_of[worker]))]
            assert len(threads_of[worker]) <= census[worker]["nthreads"]
        assert rows_in_order == expected
        # A worker's page, from its address: its facts and its own task stream.
        dead = recorded["dead_workers"][0]
        page.page.click(f"#workers-table tr.worker[data-worker='{dead}'] a.worker-link")
        page.page.wait_for_url("**/worker?**")
        page.load_all()
        assert page.page.inner_text("#worker-address") == dead
        facts = page.page.eval_on_selector("#worker-panel", "p => ({...p.dataset})")
        assert int(facts["threads"]) == THREADS and int(facts["memoryLimit"]) == LIMIT
        assert int(facts["tasks"]) == tasks_of[dead]
        assert "died" in page.page.inner_text("#worker-ended")
        stream = page.model("task-stream")
        assert set(stream["worker"]) == {dead}
        assert stream["action"].count("compute") == tasks_of[dead]
        # The page of the worker that logged HTML: the line is its own, shown as text.
        shouter = next(t["worker"] for t in ran if t["key"] == "shout-1")
        page.goto(recorded["url"] + "worker?" + urllib.parse.urlencode(
            {"cluster": recorded["killed_id"], "worker": shouter}), charts=False)
        page.load("worker", "worker_logs")
        assert HTML_LOG in page.page.inner_text("#logs-table")
        # A cluster named like HTML: its Workers panel and a worker's page show the name as text.
        page.goto(recorded["url"] + "run?" + urllib.parse.urlencode({"cluster": SMALL}), charts=False)
        page.load("workers")
        small = page.page.eval_on_selector_all("#workers-table tr.worker", "rs => rs.map(r => r.dataset.worker)")
        assert len(small) == 1
        page.page.click("#workers-table a.worker-link")
        page.page.wait_for_url("**/worker?**")
        page.load("worker")
        assert SMALL in page.page.inner_text("#run-header")
        assert page.page.inner_text("#worker-address") == small[0]
        # The task graph of the span named like HTML: Dask's own graph, as text.
        page.goto(recorded["url"] + "run?" + urllib.parse.urlencode(
            {"cluster": recorded["killed_id"], "span": HTML_SPAN}), charts=False)
        page.load("graph")
        assert page.page.inner_text("#span-name") == HTML_SPAN
        panel = page.page.eval_on_selector("#graph-panel", "p => ({...p.dataset})")
        nodes, edges = recorded["tree_nodes"], recorded["tree_edges"]
        assert panel["level"] == "task"
        assert int(panel["tasks"]) == int(panel["nodes"]) == len(nodes) == 15
        assert int(panel["edges"]) == int(panel["drawnEdges"]) == len(edges) == 14
        drawn = page.model("graph-nodes")
        assert set(drawn["key"]) == nodes
        assert set(drawn["state"]) == {"memory"}
        lines = page.model("graph-edges")
        assert set(zip(lines["source"], lines["target"])) == edges
        assert not page.dialogs and not page.errors, (page.dialogs, page.errors)
    finally:
        page.close()



def _drawn_steps(page: Page, name: str) -> dict[str, list[tuple[float, float, float]]]:
    """The steps a person sees in the multi_line chart whose data source is ``name``:
    per series label, its flat stretches (start s, end s, value), in drawing order."""
    data = page.page.evaluate(
        """(name) => { for (const d of Bokeh.documents) { const m = d.get_model_by_name(name + '-steps');
             if (!m) continue; const get = k => m.data instanceof Map ? m.data.get(k) : m.data[k];
             return {label: Array.from(get('label')), xs: Array.from(get('xs'), a => Array.from(a)),
                     ys: Array.from(get('ys'), a => Array.from(a))}; } return null; }""", name)
    assert data is not None, f"no chart {name!r} on the page"
    out: dict[str, list] = {}
    for label, xs, ys in zip(data["label"], data["xs"], data["ys"]):
        steps = out.setdefault(label, [])
        for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
            if None in (x0, x1, y0, y1) or any(v != v for v in (x0, x1, y0, y1)):
                continue  # a break in the line
            if x1 > x0 and y0 == y1:
                steps.append((x0 / 1000, x1 / 1000, y0))
    return out


def _inside(steps: list[tuple], start: float, stop: float) -> list[float]:
    """The values of the steps drawn wholly within [start, stop]."""
    return [v for x0, x1, v in steps if x0 >= start and x1 <= stop]


def _mean_over(steps: list[tuple], start: float, stop: float) -> float:
    """The time-weighted mean of the steps over [start, stop] (where drawn)."""
    covered = [(min(x1, stop) - max(x0, start), v) for x0, x1, v in steps if x1 > start and x0 < stop]
    seconds = sum(d for d, _ in covered)
    assert seconds > 0, (start, stop)
    return sum(d * v for d, v in covered) / seconds


def _stretch(samples: list[dict], window: tuple[float, float], holds) -> tuple[float, float]:
    """The first and last of the longest run of consecutive live samples within
    ``window`` for which ``holds`` is true."""
    best: list = []
    run: list = []
    for s in samples:
        if window[0] <= s["t"] <= window[1] and holds(s):
            run.append(s["t"])
            best = run if len(run) > len(best) else best
        else:
            run = []
    assert len(best) >= 2, f"the live samples never showed it in {window}: {samples}"
    return best[0], best[-1]


def _seconds_in(stream: list[dict], action: str, start: float, stop: float) -> float:
    """Seconds of ``action`` within [start, stop] in Dask's own task stream."""
    return sum(max(0.0, min(e, stop) - max(b, start))
               for t in stream for a, b, e in t["startstops"] if a == action)


def _utc(text: str) -> float | None:
    import datetime

    if not text.strip():
        return None
    return datetime.datetime.strptime(text.strip(), "%Y-%m-%d %H:%M:%S.%f").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def _check_groups(page: Page, recorded: dict) -> None:
    """Each task group in the table (opened as a person opens it) and in the chart
    against Dask's scheduler's TaskGroup and TaskPrefix figures."""
    from dask_blackbox.read.templates import fmt_bytes

    truth, stream = recorded["groups"], recorded["task_stream"]
    page.page.click("#groups-details summary")
    cells = page.page.eval_on_selector_all(
        "#groups-table tr.group", "rs => rs.map(r => Array.from(r.cells, c => c.innerText))")
    header = page.page.eval_on_selector_all("#groups-table th", "hs => hs.map(h => h.innerText)")
    table = {row[0]: dict(zip(header, row)) for row in cells}
    assert len(table) == len(cells)  # one row per group
    assert set(table) == set(truth)  # every group Dask made (fewer than the panel's limit)
    assert {key_split_group(HTML_KEY), key_split_group(QUOTE_KEY)} <= set(table)  # names as text
    made: dict[str, int] = {}
    failed: dict[str, int] = {}
    for name, dask in truth.items():
        row, states = table[name], dask["states"]
        erred_runs = [t for t in stream if t["group"] == name and t["status"] == "error"]
        assert dask["lives"] == 1, name  # each name one TaskGroup in this run
        assert row["prefix"] == dask["prefix"], name
        assert int(row["tasks"].replace(",", "")) == dask["tasks"], name
        assert int(row["computed"].replace(",", "")) == sum(
            states.get(s, 0) for s in ("memory", "released", "forgotten")), (name, states)
        assert int(row["erred"].replace(",", "")) == states.get("erred", 0), (name, states)
        made[dask["prefix"]] = made.get(dask["prefix"], 0) + int(row["computed"].replace(",", "")) + int(
            row["recomputed"].replace(",", ""))
        failed[dask["prefix"]] = failed.get(dask["prefix"], 0) + int(row["erred"].replace(",", ""))
        # Dask's durations leave out the actions of erred tasks; the table counts them.
        for column, action in (("compute", "compute"), ("transfer", "transfer")):
            expected = dask[action] + sum(e - b for t in erred_runs for a, b, e in t["startstops"] if a == action)
            assert float(row[column].rstrip(" s").replace(",", "")) == pytest.approx(expected, abs=1.5e-3), (
                name, column, row[column], expected)
        assert row["bytes"] == fmt_bytes(dask["nbytes"]), (name, row["bytes"], dask["nbytes"])
        computes = [(b, e) for t in erred_runs for a, b, e in t["startstops"] if a == "compute"]
        start = min([dask["start"]] * bool(dask["start"]) + [b for b, _ in computes], default=None)
        stop = max([dask["stop"]] * bool(dask["stop"]) + [e for _, e in computes], default=None)
        for column, want in (("first compute (UTC)", start), ("last", stop)):
            shown = _utc(row[column])
            assert (shown is None) == (want is None), (name, column, row[column])
            if want is not None:
                assert shown == pytest.approx(want, abs=1.5e-3), (name, column, row[column], want)
    # Dask's own count of the transitions into memory and erred of each prefix.
    prefix_states = recorded["prefix_states"]
    assert made == {p: c.get("memory", 0) for p, c in prefix_states.items() if p in made}
    assert failed == {p: c.get("erred", 0) for p, c in prefix_states.items() if p in failed}
    assert any(int(r["recomputed"]) for r in table.values())  # the dead workers' results, made again
    assert table["complex-computation"]["erred"] == "1"  # the killer's group, never computed, listed
    # The chart: a bar per group that computed, from its first compute to its last.
    bars = page.model("group-bars")
    timed = {n for n, r in table.items() if r["first compute (UTC)"].strip()}
    assert set(bars["group"]) == timed and len(bars["group"]) == len(timed)
    for i, name in enumerate(bars["group"]):
        row = table[name]
        assert bars["left"][i] / 1000 == pytest.approx(_utc(row["first compute (UTC)"]), abs=1.5e-3), name
        assert bars["right"][i] / 1000 == pytest.approx(max(_utc(row["last"]), _utc(row["first compute (UTC)"])
                                                        + 1e-3), abs=1.5e-3), name
        assert (bars["tasks"][i], bars["memory"][i], bars["erred"][i]) == (
            int(row["tasks"]), int(row["computed"]), int(row["erred"])), name


def _samples(recorded: dict, window: tuple[float, float]) -> list:
    """The recorded worker metrics around ``window`` (for a failure's message)."""
    _, rows = recorded["backend"].query(
        f"SELECT worker, round(toFloat64(ts) - {{t:Float64}}, 2), executing, ready, in_flight "
        f"FROM {recorded['backend'].database}.worker_metrics WHERE cluster_id = {{c:String}} "
        "AND toFloat64(ts) BETWEEN {t:Float64} - 1 AND {u:Float64} + 1 ORDER BY ts",
        {"c": recorded["killed_id"], "t": window[0], "u": window[1]})
    return rows


def _check_activity(page: Page, recorded: dict) -> None:
    """The Run page's Processing, CPU and transfer charts against Dask: the workers'
    own counts sampled live while the planted causes ran, the threads the scheduler
    gave them, and Dask's task stream's actions."""
    census, stream, live = recorded["census"], recorded["task_stream"], recorded["live"]
    a, b = recorded["live_workers"]
    proc = _drawn_steps(page, "activity_processing")
    cpu = _drawn_steps(page, "activity_cpu")
    acts = _drawn_steps(page, "activity_transfer")
    # The series cover the run, from its first compute to its last (to a cell: the
    # workers' first and last samples may come a little after and before them).
    computes = [(s, e) for t in stream for act, s, e in t["startstops"] if act == "compute"]
    drawn = proc["executing"]
    cell = drawn[0][1] - drawn[0][0]
    assert drawn[0][0] <= min(s for s, _ in computes) + cell, (drawn[:3], min(computes))
    assert drawn[-1][1] >= max(e for _, e in computes) - cell, (drawn[-3:], max(e for _, e in computes))
    # Both workers napping on every thread: the cells wholly within it show all their
    # threads (a cell missing a worker's sample shows the other's alone), never more.
    naps = [_stretch(live[w], recorded["nap_window"], lambda s: s["executing"] == s["nthreads"]) for w in (a, b)]
    both = (max(n[0] for n in naps), min(n[1] for n in naps))
    full = census[a]["nthreads"] + census[b]["nthreads"]
    assert max(_inside(proc["executing"], *both), default=None) == full, (
        both, [s for s in proc["executing"] if s[1] > both[0] - 1 and s[0] < both[1] + 1],
        {w: [(round(s["t"] - both[0], 2), s["executing"]) for s in live[w]] for w in (a, b)},
        _samples(recorded, both))
    queued = [_stretch(live[w], recorded["nap_window"], lambda s: s["ready"] > 0) for w in (a, b)]
    assert all(v > 0 for v in _inside(proc["ready"], max(q[0] for q in queued), min(q[1] for q in queued)))
    assert max(_inside(proc["executing"], *recorded["nap_window"])) == full  # never more
    assert set(_inside(cpu["threads offered"], *recorded["nap_window"])) == {full}
    # One transfer in flight into b for as long as a took to send it.
    sending = _stretch(live[b], recorded["send_window"], lambda s: s["in_flight"] >= 1)
    assert max(_inside(proc["in flight"], *sending), default=None) == 1, (sending, proc["in flight"])
    assert all(v <= 1 for v in _inside(proc["in flight"], *recorded["send_window"]))
    # Each action's threads at once, bucket by bucket, as Dask's task stream has them.
    threads_ever = sum(c["nthreads"] for c in census.values())
    for action in ("compute", "transfer"):
        for x0, x1, value in acts[action]:
            expected = _seconds_in(stream, action, x0, x1) / (x1 - x0)
            assert value == pytest.approx(expected, abs=1e-3), (action, x0, x1, value, expected)
            assert value <= threads_ever + 1e-3
    assert max(v for _, _, v in acts["transfer"]) >= 0.99  # the slow send, a whole bucket long


def _check_worker_activity(page: Page, recorded: dict, worker: str) -> dict:
    """One worker's page: its executing never above its threads (Dask's), all of
    them during its naps, its transfer in flight only on the receiving worker.
    Returns its CPU steps."""
    census, live = recorded["census"], recorded["live"]
    a, b = recorded["live_workers"]
    proc = _drawn_steps(page, "worker_processing")
    threads = census[worker]["nthreads"]
    assert max(v for _, _, v in proc["executing"]) <= threads
    nap = _stretch(live[worker], recorded["nap_window"], lambda s: s["executing"] == s["nthreads"])
    assert _inside(proc["executing"], *nap) and set(_inside(proc["executing"], *nap)) == {threads}, (
        worker, nap, proc["executing"])
    sending = _stretch(live[b], recorded["send_window"], lambda s: s["in_flight"] >= 1)
    if worker == b:
        assert set(_inside(proc["in flight"], *sending)) == {1}, (sending, proc["in flight"])
    else:
        assert all(v == 0 for x0, x1, v in proc["in flight"] if x1 > sending[0] and x0 < sending[1])
    return _drawn_steps(page, "worker_cpu")


def test_groups_and_activity_against_dask(recorded, browser):
    """The Task groups view against Dask's scheduler's own figures for each group
    (tasks, states, durations, bytes, start and stop) and prefix (its count of the
    transitions into memory and erred), read from the table a person opens and the
    chart; the Processing, CPU and transfer views against the workers' counts
    sampled live during planted causes (all threads napping, a slow transfer, a core
    held on one worker) and against Dask's task stream; names holding HTML and
    quotes shown as text."""
    _groups_and_activity(browser, recorded, recorded["url"])


def _groups_and_activity(browser, recorded: dict, url: str) -> None:
    cid, (a, b) = recorded["killed_id"], recorded["live_workers"]
    page = Page(browser)
    try:
        page.goto(url + "run?" + urllib.parse.urlencode({"cluster": cid}), charts=False)
        page.load("groups", "activity")
        _check_groups(page, recorded)
        _check_activity(page, recorded)
        # Each worker's page: its own processing, and its CPU against its monitor's live samples.
        spin = (recorded["spin_window"][0] + MONITOR_LAG, recorded["spin_window"][1])
        busy = {}
        for worker in (a, b):
            page.goto(url + "worker?" + urllib.parse.urlencode({"cluster": cid, "worker": worker}),
                      charts=False)
            page.load("worker_metrics")
            steps = _check_worker_activity(page, recorded, worker)["CPU (cores busy)"]
            live = [s["cpu"] / 100 for s in recorded["live"][worker] if spin[0] <= s["t"] <= spin[1]]
            busy[worker] = (_mean_over(steps, *spin), sum(live) / len(live))
            assert max(v for x0, x1, v in steps if x1 > spin[0] and x0 < spin[1]) <= 1.1  # one thread: a core
        (drawn_a, live_a), (drawn_b, live_b) = busy[a], busy[b]
        assert live_a - live_b >= 0.1, f"the spinning worker's monitor did not show it: {busy}"
        assert drawn_a == pytest.approx(live_a, abs=0.3) and drawn_b == pytest.approx(live_b, abs=0.3), busy
        assert drawn_a - drawn_b >= 0.5 * (live_a - live_b), busy
        # Scopes whose names hold HTML: a span, a cluster; their groups and activity as text.
        page.goto(url + "run?" + urllib.parse.urlencode({"cluster": cid, "span": HTML_SPAN}),
                  charts=False)
        page.load("groups", "activity")
        assert page.page.inner_text("#span-name") == HTML_SPAN
        groups = page.page.eval_on_selector_all("#groups-table tr.group", "rs => rs.map(r => r.dataset.group)")
        assert sorted(groups) == ["leaf", "sum"]
        page.goto(url + "run?" + urllib.parse.urlencode({"cluster": SMALL}), charts=False)
        page.load("groups", "activity")
        assert SMALL in page.page.inner_text("#run-header")
        assert page.model("group-bars")["tasks"] == [4]
        assert not page.dialogs and not page.errors, (page.dialogs, page.errors)
    finally:
        page.close()
