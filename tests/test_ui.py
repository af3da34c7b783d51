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

Set DASK_BLACKBOX_SCREENSHOTS=DIR to keep screenshots of the Run page there.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid

import dask.array as da
import dask.config
import orjson
import pytest
from distributed import Client, LocalCluster, span, wait
from distributed.scheduler import KilledWorker

from dask_blackbox import producers
from dask_blackbox.cli.supervisor import LocalPipeline, wait_drained
from dask_blackbox.read import backends

from conftest import pipeline_settings
from polling import wait_for

import playwright.sync_api as playwright_sync  # noqa: E402  (a test dependency)

pytestmark = [pytest.mark.browser, pytest.mark.integration]

CHROMIUM = "/usr/bin/chromium"
HTML_KEY = "<script>alert(1)</script>"
HTML_LOG = "<b>not bold</b><img src=x onerror=alert(2)>"
KILLER = "complex-computation-0bad"
LIMIT = 400 * 2**20


def inc(x):
    return x + 1


def slow_inc(x):
    time.sleep(0.15)  # long enough to be seen in the task stream
    return x + 1


def div(x, y):
    return x / y


def shout(x):
    logging.getLogger("distributed.worker").warning(HTML_LOG)
    return x


def exceed_memory(limit_bytes: int) -> int:
    """Grow until the nanny kills this worker (see tests/test_end_to_end.py)."""
    logging.getLogger("distributed.worker").warning("about to load the whole partition")
    time.sleep(1.0)
    hoard = []
    while True:
        hoard.append(bytearray(16 * 2**20))
        time.sleep(0.02)
        if len(hoard) * 16 * 2**20 > 4 * limit_bytes:
            os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _span_truth(cluster: LocalCluster) -> dict[tuple, dict]:
    ext = cluster.scheduler.extensions["spans"]
    return {tuple(s.name): {"id": s.id, "duration": s.duration, "depth": len(s.name) - 1}
            for s in ext.spans.values()}


def _record_killed(truth: dict) -> None:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=LIMIT,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        truth["killed_id"] = producers.attach(client, cluster_name="ui-killed", **{
            "producer.flush-interval": "20ms", "producer.metrics-interval": "200ms"})["cluster_id"]
        with span("etl"):
            with span("load"):
                x = client.persist(da.ones((400, 400), chunks=100) + 1)
                wait(x)
            with span("reduce"):
                assert client.compute(x.sum()).result() == 2 * 400 * 400
        client.gather(client.map(inc, range(8)))
        client.gather(client.map(slow_inc, range(10)))
        assert client.submit(inc, 1, key=HTML_KEY).result() == 2
        assert client.submit(shout, 3, key="shout-1").result() == 3
        bad = client.submit(div, 1, 0, key="div-bad")
        wait([bad])
        with span("nightly"):
            doomed = client.submit(exceed_memory, LIMIT, key=KILLER)
        with pytest.raises(KilledWorker):
            doomed.result(timeout=120)
        del doomed, bad, x
        removals = [(ts, msg["worker"]) for ts, msg in cluster.scheduler.get_events("all")
                    if msg.get("action") == "remove-worker" and msg.get("expected") is False]
        truth["deaths"] = sorted(ts for ts, _ in removals)
        truth["dead_workers"] = sorted(w for _, w in removals)
        client.close()
        time.sleep(0.5)
        truth["killed_spans"] = _span_truth(cluster)


def _scheduler_id(dask_scheduler):
    return dask_scheduler.plugins[producers.PLUGIN_NAME].identity["cluster_id"]


def _record_small(truth: dict) -> None:
    """A second cluster recorded by the scheduler plugin alone (a scheduler
    preload without the workers'): no worker metrics, the panels it can."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        settings = producers.ProducerSettings.resolve({"producer.flush-interval": "20ms"},
                                                      cluster_name="ui-small")
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
                          "distributed.scheduler.allowed-failures": 1}):
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
            port = _free_port()
            log = root / "ui.log"
            with open(log, "wb") as out:
                ui = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli", "ui", "--port", str(port)],
                                      env=env, stdout=out, stderr=subprocess.STDOUT)
            wait_for(lambda: "UI at" in log.read_text() or ui.poll() is not None, 60, "the UI to listen")
            assert ui.poll() is None, log.read_text()
            truth["url"] = f"http://127.0.0.1:{port}/"
            truth["ui_log"] = log
            yield truth
        finally:
            if ui is not None:
                ui.terminate()
                ui.wait(30)
            pipeline.stop(drain_timeout=0)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        # Not a skip: a browser test that did not run must not look like one that passed.
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)")
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--headless"])
        yield b
        b.close()


class Page:
    """A browser page that records console errors, page errors and dialogs (an
    alert() would mean HTML from the data was run)."""

    def __init__(self, browser, offline: bool = False):
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        if offline:
            def route(r):
                self.requests.append(r.request.url)
                if r.request.url.startswith("file:"):
                    r.continue_()
                else:
                    r.abort()
            self.page.route("**/*", route)

    def goto(self, url: str, charts: bool = True):
        response = self.page.goto(url)
        if charts:
            self.page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                                        timeout=30_000)
        return response

    def model(self, name: str) -> dict:
        """The data of the Bokeh data source named ``name`` (JSON-able columns)."""
        return self.page.evaluate(
            """(name) => { const m = Bokeh.documents[0].get_model_by_name(name);
                 if (!m) return null; const out = {};
                 const entries = m.data instanceof Map ? [...m.data.entries()] : Object.entries(m.data);
                 for (const [k, v] of entries) out[k] = Array.from(v); return out; }""", name)

    def close(self):
        self.context.close()


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
             for (const m of Bokeh.documents[0].all_models)
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
        page.goto(recorded["url"] + "run?cluster=ui-small")
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
