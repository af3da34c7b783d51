"""The web UI answers its own host only, builds no URL from the request, encodes every
value it puts in a link, pages its cluster list, and answers every bad parameter with
a 400 -- never a 500 or a 502.

One real chDB directory, loaded by the sink's own loader with 260 small clusters
(two of them: a cluster whose task key holds ``&cluster=`` and the cluster that key
names), served by the real app under uvicorn on a loopback port; requests are raw
HTTP, so the ``Host`` header is the test's to choose. The task stream's click is
tried in headless Chromium.
"""

from __future__ import annotations

import asyncio
import http.client
import re
import threading
import time
import urllib.parse

import orjson
import pytest

from dask_blackbox import clickhouse, contract
from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.read import api, backends, panels, web
from dask_blackbox.sinks.batch import Batch
from dask_blackbox.sinks.loader import Loader
from dask_blackbox.sinks.schema import Target, migrate
from dask_blackbox.sinks.tables import Message

N_CLUSTERS = 260
#: A key that, spliced into a URL unencoded, names another cluster.
HOSTILE_KEY = "inc-1&cluster=cluster-other&key=inc-0"
T0 = 1_790_000_000.0


def _cluster_envelope(i: int, cluster_id: str, name: str, keys: list[str]) -> dict:
    t = T0 + 10 * i
    events = [
        {"kind": contract.LIFECYCLE, "ts": t, "action": "scheduler_start", "worker": None,
         "client": None, "reason": None, "stimulus_id": None, "detail": {}},
        {"kind": contract.SPAN, "ts": t, "span_id": f"span-{i}", "name": ["etl"],
         "parent_id": None, "enqueued": t},
    ]
    for j, key in enumerate(keys):
        base = {"kind": contract.TRANSITION, "key": key, "prefix": "inc", "group": key,
                "span_id": f"span-{i}", "worker": None, "nbytes": None, "typename": None,
                "startstops": None, "exception": None, "traceback": None, "cause": None}
        events += [
            {**base, "ts": t + 0.1 + j, "start": "released", "finish": "waiting",
             "stimulus_id": f"update-graph-{i}"},
            {**base, "ts": t + 0.2 + j, "start": "waiting", "finish": "processing",
             "stimulus_id": f"update-graph-{i}"},
            {**base, "ts": t + 0.5 + j, "start": "processing", "finish": "memory",
             "stimulus_id": f"task-finished-{i}-{j}", "worker": "tcp://worker-a:1",
             "nbytes": 28, "typename": "int",
             "startstops": [{"action": "compute", "start": t + 0.25 + j, "stop": t + 0.45 + j}]},
        ]
    return {"schema": contract.SCHEMA_VERSION, "cluster_id": cluster_id, "cluster_name": name,
            "source": "scheduler", "producer_id": f"p-{cluster_id}", "seq": 0,
            "sent_at": t + 1, "events": events}


def _load(dsn: str) -> None:
    client = clickhouse.open_client(dsn)
    try:
        target = Target("blackbox", 90 * 86400)
        migrate(client, target)
        batch = Batch()
        clusters = [("cluster-victim", "victim", [HOSTILE_KEY, "inc-0"]),
                    ("cluster-other", "other", ["inc-0", "inc-1"])]
        clusters += [(f"cluster-{i:04d}", f"run-{i:04d}", ["inc-0"]) for i in range(N_CLUSTERS - 2)]
        for offset, (cid, name, keys) in enumerate(clusters):
            value = orjson.dumps(_cluster_envelope(offset, cid, name, keys))
            batch.add(Message(contract.RAW, "t.raw", 0, offset, cid.encode(), value, 0))
        Loader(client, target, "web-guard").load(batch, {})
    finally:
        client.close()


class Served:
    """The app under uvicorn in a thread, on 127.0.0.1:port."""

    def __init__(self, dsn: str, hosts=()) -> None:
        import uvicorn

        self.port = free_port()
        client = clickhouse.open_client(dsn, owned=True, database="blackbox")
        app = web.create_app(lambda: backends.DirectBackend(client, "blackbox"), hosts=hosts)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def get(self, path: str, host: str | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.putrequest("GET", path, skip_host=True)
            conn.putheader("Host", f"127.0.0.1:{self.port}" if host is None else host)
            conn.endheaders()
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    dsn = f"chdb://{tmp_path_factory.mktemp('web-guard') / 'clickhouse'}"
    _load(dsn)
    ui = Served(dsn, hosts=["blackbox.internal"])
    try:
        yield ui
    finally:
        ui.stop()


def test_only_its_own_host_is_answered(served):
    """DNS rebinding: a page of attacker.example whose name now points at 127.0.0.1
    sends ``Host: attacker.example``; nothing is served to it, files neither."""
    for path in ("/", "/api/clusters", "/run?cluster=victim", "/api", "/static/js/bokeh.min.js",
                 "/nope"):
        for host in ("attacker.example", "attacker.example:8787", "127.0.0.1.nip.io",
                     "localhost.attacker.example", "", "[::2]:1"):
            status, body = served.get(path, host=host)
            assert status == 400, (path, host, status)
            assert b"not one this UI answers to" in body, body[:200]
    for host in (f"127.0.0.1:{served.port}", f"localhost:{served.port}", "LOCALHOST",
                 f"[::1]:{served.port}", "blackbox.internal", "blackbox.internal:443"):
        status, body = served.get("/api/clusters?limit=1", host=host)
        assert status == 200, (host, body[:200])


def test_asset_urls_are_relative(served):
    for path in ("/run?cluster=victim", "/compare?span=etl", "/"):
        status, body = served.get(path, host="blackbox.internal")
        assert status == 200, (path, body[:300])
        page = body.decode()
        assert "blackbox.internal" not in page and "127.0.0.1" not in page, path
        assert not re.search(r"""(?:src|href)=["'](?:https?:)?//""", page), path
        if path != "/":
            assert re.search(r"""src=["']\./static/js/bokeh[^"']*\.js""", page), path


def _hrefs(page: str) -> list[str]:
    return [h.replace("&amp;", "&") for h in re.findall(r'href="([^"]*)"', page)]


def test_keys_are_encoded_in_every_link(served):
    status, body = served.get("/task?" + urllib.parse.urlencode(
        {"cluster": "victim", "key": "inc-0"}))
    assert status == 200, body[:300]
    status, body = served.get("/task?" + urllib.parse.urlencode(
        {"cluster": "victim", "key": HOSTILE_KEY}))
    assert status == 200, body[:300]
    page = body.decode()
    for href in _hrefs(page):
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(href).query)
        assert query.get("cluster", ["cluster-victim"]) == ["cluster-victim"], href
        if "key" in query:
            assert query["key"] == [HOSTILE_KEY], href


def test_every_bad_parameter_is_a_400(served):
    bad_times = ["nan", "inf", "-inf", "1e400", "99999999999999d", "1e15", "-99999999999",
                 "0001-01-01", "9999-12-31T23:59:59", "2026-13-01", "yesterday-ish",
                 "2026-01-01T00:00:00+99:00", "\x00"]
    bad_ints = ["x", "0x10", "1e3", "-1", "99999999999999999999999", "\x00", " "]
    cases = []
    for name in ("since", "until"):
        for value in bad_times:
            q = {name: value}
            cases += [("/api/clusters", q), ("/", q),
                      ("/api/run/summary", {"cluster": "victim", **q}),
                      ("/api/run/task_stream", {"cluster": "victim", **q}),
                      ("/run", {"cluster": "victim", **q}),
                      ("/report", {"cluster": "victim", **q}),
                      ("/api/compare", {"span": "etl", **q}), ("/compare", {"span": "etl", **q})]
    for value in bad_ints[:-1]:
        cases += [("/api/clusters", {"limit": value}), ("/api/clusters", {"offset": value}),
                  ("/", {"limit": value}),
                  ("/api/run/logs", {"cluster": "victim", "limit": value}),
                  ("/api/run/task_stream", {"cluster": "victim", "max_bars": value})]
    cases += [("/api/clusters", {"limit": "1001"}), ("/api/run/logs", {"cluster": "victim", "level": "LOUD"}),
              ("/api/run/summary", {}), ("/api/task", {"cluster": "victim"}), ("/api/compare", {}),
              ("/run", {}), ("/task", {"key": "x"})]
    wrong = []
    for path, q in cases:
        status, body = served.get(path + "?" + urllib.parse.urlencode(q))
        if status != 400:
            wrong.append((path, q, status, body[:160]))
    assert not wrong, wrong
    # Odd but valid values are names that match nothing: 404 or an empty answer.
    for value in ("\x00", "'", "\\", "%FF", "{c:String}", "x" * 5000, "\u202e"):
        for path, q in (("/api/run/summary", {"cluster": value}), ("/api/task", {"cluster": "victim", "key": value}),
                        ("/api/clusters", {"name": value}), ("/api/compare", {"span": value}),
                        ("/api/run/logs", {"cluster": "victim", "text": value, "worker": value})):
            status, body = served.get(path + "?" + urllib.parse.urlencode(q))
            assert status in (200, 404), (path, q, status, body[:200])


def test_the_cluster_list_is_paged(served):
    status, body = served.get("/api/clusters")
    assert status == 200
    first = orjson.loads(body)
    assert first["total"] == N_CLUSTERS and len(first["clusters"]) == panels.CLUSTERS_PAGE
    # Newest first: the last loaded cluster leads.
    assert first["clusters"][0]["cluster_id"] == f"cluster-{N_CLUSTERS - 3:04d}"
    seen = [c["cluster_id"] for c in first["clusters"]]
    offset = panels.CLUSTERS_PAGE
    while offset < N_CLUSTERS:
        status, body = served.get(f"/api/clusters?offset={offset}")
        page = orjson.loads(body)
        seen += [c["cluster_id"] for c in page["clusters"]]
        offset += panels.CLUSTERS_PAGE
    assert len(seen) == len(set(seen)) == N_CLUSTERS
    status, body = served.get("/api/clusters?name=RUN-001&limit=5&offset=3")
    page = orjson.loads(body)
    assert page["total"] == 10 and [c["cluster_name"] for c in page["clusters"]] == [
        f"run-{i:04d}" for i in (16, 15, 14, 13, 12)]
    # The front page shows one page and links to the next, filters kept.
    status, body = served.get("/?" + urllib.parse.urlencode({"name": "run-00", "limit": 50}))
    html = body.decode()
    assert html.count('class="cluster"') == 50
    assert "clusters 1-50 of 100" in html
    nxt = [h for h in _hrefs(html) if "offset=50" in h]
    assert nxt, _hrefs(html)
    status, body = served.get("/" + nxt[0].removeprefix("./"))
    assert status == 200 and body.decode().count('class="cluster"') == 50
    assert "clusters 51-100 of 100" in body.decode()


@pytest.mark.browser
def test_a_task_stream_click_opens_the_key_it_shows(served):
    import os

    import playwright.sync_api as playwright_sync

    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        pytest.fail(f"{chromium} is missing: apt-get install chromium (.ci/run does)")
    base = f"http://127.0.0.1:{served.port}/"
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--headless"])
        try:
            page = browser.new_page()
            page.goto(base + "run?cluster=victim")
            page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                                   timeout=30_000)
            # The click on the hostile key's bar, as a TapTool runs it.
            page.evaluate("""(key) => {
                const source = Bokeh.documents[0].get_model_by_name("task-stream");
                const i = Array.from(source.data.get ? source.data.get("key") : source.data.key).indexOf(key);
                source.selected.indices = [i];
                for (const m of Bokeh.documents[0].all_models)
                    if (m.type === "TapTool" || (m.constructor && m.constructor.__name__ === "TapTool"))
                        m.callback.execute(m, {source});
            }""", HOSTILE_KEY)
            page.wait_for_url(re.compile(r".*/task\?.*"), timeout=30_000)
            assert page.inner_text("#task-key") == HOSTILE_KEY
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(page.url).query)
            assert query == {"cluster": ["cluster-victim"], "key": [HOSTILE_KEY]}
        finally:
            browser.close()


def test_bad_times_are_refused_with_the_parameter_named():
    for value in ("nan", "1e400", "99999999999999d", "0001-01-01"):
        with pytest.raises(api.BadParameter, match="since="):
            api.parse_time(value, "since")
    assert api.parse_time("2026-01-01T00:00:00", "since") == 1767225600.0
