"""A browser and the UI for tests: Debian's Chromium driven by Playwright, a page
that records console errors, page errors and dialogs, and a `dask-blackbox ui`
subprocess."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys

import playwright.sync_api as playwright_sync
import pytest

from dask_blackbox.deploy.brokers import free_port
from dask_blackbox.testing.polling import wait_for

CHROMIUM = "/usr/bin/chromium"


def start_ui(env: dict, log: pathlib.Path) -> tuple[subprocess.Popen, str, pathlib.Path]:
    """A `dask-blackbox ui` subprocess, listening: (process, its URL, its log)."""
    port = free_port()
    with open(log, "wb") as out:
        ui = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli", "ui", "--port", str(port)],
                              env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: "UI at" in log.read_text() or ui.poll() is not None, 60, "the UI to listen")
    assert ui.poll() is None, log.read_text()
    return ui, f"http://127.0.0.1:{port}/", log


@contextlib.contextmanager
def chromium():
    """Debian's Chromium, headless, through Playwright (tests/conftest.py's ``browser``)."""
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
        """Open ``url``; with ``charts``, every panel loaded (a web page loads them as
        they scroll into view: all of them here) and its charts drawn."""
        response = self.page.goto(url)
        if charts:
            self.load_all()
        return response

    def load(self, *views: str) -> None:
        """Load these panels of a web page (its sections ``data-view``) and wait for them."""
        self.page.evaluate("""(views) => Promise.all(views.map(v => window.blackbox.load(
            document.querySelector(`section.view[data-view="${v}"]`))))""", list(views))
        states = self.page.eval_on_selector_all(
            "section.view", "ss => Object.fromEntries(ss.map(s => [s.dataset.view, s.dataset.state]))")
        assert all(states[v] == "loaded" for v in views), states

    def load_all(self) -> None:
        self.page.evaluate("() => window.blackbox ? window.blackbox.loadAll() : null")
        self.page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                                    timeout=60_000)

    def model(self, name: str) -> dict:
        """The data of the Bokeh data source named ``name`` (JSON-able columns), in
        whichever of the page's Bokeh documents holds it."""
        return self.page.evaluate(
            """(name) => { let m = null;
                 for (const d of Bokeh.documents) { m = d.get_model_by_name(name); if (m) break; }
                 if (!m) return null; const out = {};
                 const entries = m.data instanceof Map ? [...m.data.entries()] : Object.entries(m.data);
                 for (const [k, v] of entries) out[k] = Array.from(v); return out; }""", name)

    def close(self):
        self.context.close()
