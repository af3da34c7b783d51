"""Dask's own worker profiles, recorded: a real LocalCluster (two worker processes) on
the real local pipeline (Tansu, the sink on chDB), whose tasks spend their time in a
planted hot function, compared with what Dask itself says while the cluster lives.

Dask's profile (``Client.profile``) is read before the cluster closes; the recorded one
after, from ClickHouse, once the workers are gone (the cycle in progress is published
at teardown). A second cluster records with ``producer.record.profiles`` off. Then
``dask-blackbox profile`` reads them: its table, and its files as their own tools
read them (``go tool pprof``, speedscope's schema).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import dask.array as da
import dask.config
import numpy as np
import pytest
from distributed import Client, LocalCluster

from dask_blackbox import producers
from dask_blackbox.producers.worker import profile_events

from conftest import pipeline_settings
from recording_support import recorded_through_pipeline
from dask_blackbox.testing.polling import wait_for
from ui_support import Page, start_ui

pytestmark = pytest.mark.slow
#: CPU seconds each planted task spends in planted_hot, and how many there are
HOT_SECONDS = 0.3
HOT_TASKS = 8
#: A frame whose function name is HTML and not ASCII (sampled while it sleeps)
ODD_NAME = "<b>hé☃ & \"co\"</b>"


def planted_hot(seconds: float) -> int:
    """A pure-Python busy loop for ``seconds`` of this thread's CPU."""
    n, end = 0, time.thread_time() + seconds
    while time.thread_time() < end:
        n += 1
    return n


def planted_task(block: np.ndarray) -> np.ndarray:
    planted_hot(HOT_SECONDS)
    return block * 2


def odd_named(seconds: float) -> None:
    time.sleep(seconds)


odd_named.__code__ = odd_named.__code__.replace(co_name=ODD_NAME)


def odd_task(x: int) -> int:
    odd_named(0.5)
    return x


def dask_share(tree: dict, name: str) -> float:
    """The share of the samples in Dask's tree ``tree`` (a worker's: the innermost
    frame is not counted, ``Worker.trigger_profile``) in which ``name`` was on the
    stack, for a ``name`` that is its caller's only callee: every sample its caller
    counts."""
    through, todo = 0, [tree]
    while todo:
        node = todo.pop()
        named = [c for c in node["children"].values() if c["description"]["name"] == name]
        if named:
            assert len(node["children"]) == 1, "the planted function has callers of its own"
            through += node["count"]
        else:
            todo.extend(node["children"].values())
    return through / tree["count"]


def recorded_stacks(backend, cluster_id: str, prefix: str) -> dict[str, int]:
    _, rows = backend.query(
        "SELECT stack, sum(count) FROM profiles WHERE cluster_id = {c:String} "
        "AND prefix = {p:String} GROUP BY stack", {"c": cluster_id, "p": prefix})
    return dict(rows)


def share(stacks: dict[str, int], name: str) -> float:
    def frames(stack: str):
        return [f.rsplit(":", 1)[1] for f in stack.split(";")]
    return sum(n for s, n in stacks.items() if name in frames(s)) / sum(stacks.values())


@pytest.fixture(scope="module")
def recorded(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("profiles")
    settings, env = pipeline_settings(broker, "f" + uuid.uuid4().hex[:8], root / "data")
    out: dict = {"env": env, "settings": settings}
    # no stream processors: nothing here reads spans
    with recorded_through_pipeline(broker, {**settings, "optimization.fuse.active": False},
                                   lambda: _record(out)) as backend:
        out["backend"] = backend
        yield out


def _record(out: dict) -> None:
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        out["cluster_id"] = producers.attach(client, cluster_name="profiles-test", **{
            "producer.flush-interval": "20ms"})["cluster_id"]
        x = da.ones((HOT_TASKS, 100), chunks=(1, 100))
        # persisted alone: its tasks keep their prefix (not fused into the sum's)
        y = client.persist(x.map_blocks(planted_task, dtype=float, name="planted"))
        assert float(y.sum().compute()) == 2 * x.size
        assert client.submit(odd_task, 1, key="odd-1").result() == 1
        out["dask"] = client.profile()
        out["dask_planted"] = client.profile(key="planted")
        out["workers"] = sorted(client.scheduler_info()["workers"])
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        out["unprofiled_id"] = producers.attach(client, cluster_name="unprofiled", **{
            "producer.flush-interval": "20ms", "producer.record.profiles": False})[
            "cluster_id"]
        assert client.submit(odd_task, 2, key="odd-2").result() == 2
        # Dask profiled it (its profile says so once a cycle has ended)
        wait_for(lambda: client.profile()["count"] > 0, 30, "a profile cycle")


def test_the_recorded_profile_gives_the_hot_function_the_share_dask_gives_it(recorded):
    backend, cluster_id = recorded["backend"], recorded["cluster_id"]
    whole = recorded_stacks(backend, cluster_id, "")
    planted = recorded_stacks(backend, cluster_id, "planted")
    # every sample Dask took is recorded, worker-wide and for the prefix
    assert sum(whole.values()) == recorded["dask"]["count"]
    assert sum(planted.values()) == recorded["dask_planted"]["count"]
    expected = dask_share(recorded["dask"], "planted_hot")
    assert expected > 0.5  # the planted tasks are most of the run
    assert abs(share(whole, "planted_hot") - expected) < 0.03
    assert abs(share(planted, "planted_hot")
               - dask_share(recorded["dask_planted"], "planted_hot")) < 0.03


def test_the_hot_function_is_the_hottest_frame_of_its_prefix_not_dask_s_own(recorded):
    planted = recorded_stacks(recorded["backend"], recorded["cluster_id"], "planted")
    own: dict[str, int] = {}
    for stack, n in planted.items():
        leaf = stack.rsplit(";", 1)[-1]
        own[leaf] = own.get(leaf, 0) + n
    users = {f: n for f, n in own.items() if "/dask/" not in f and "/distributed/" not in f}
    hottest = max(users, key=users.__getitem__)
    assert hottest == f"{__file__}:{planted_hot.__code__.co_firstlineno}:planted_hot"


def cli(recorded, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "profile", *args,
                           "--data-dir", recorded["env"]["DASK_BLACKBOX__DATA_DIR"]],
                          env={**os.environ, **recorded["env"]}, capture_output=True,
                          text=True, timeout=120)


def test_profile_prints_the_top_frames_in_120_columns(recorded):
    out = cli(recorded, "--cluster", "profiles-test", "--prefix", "planted")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 120
    assert lines[0].startswith("profiles-test: prefix planted, every worker: ")
    first = next(line for line in lines if "planted_hot" in line or "%" in line)
    # the top frame, with the share of the prefix's samples Dask's own tree gives it
    # (nearly all: a sample may land in the task after the planted function returned)
    expected = f"{100 * dask_share(recorded['dask_planted'], 'planted_hot'):.1f}%"
    assert "planted_hot" in first and expected in first, (expected, first)
    whole = cli(recorded, "--cluster", "profiles-test", "--format", "json", "--limit", "500")
    assert whole.returncode == 0, whole.stderr
    rows = json.loads(whole.stdout)
    hot = next(r for r in rows if r["function"] == "planted_hot")
    share = float(hot["total_share"].rstrip("%")) / 100
    assert abs(share - dask_share(recorded["dask"], "planted_hot")) < 0.001


def test_a_cluster_without_profiles_says_so_in_one_line(recorded):
    _, rows = recorded["backend"].query(
        "SELECT count() FROM profiles WHERE cluster_id = {c:String}",
        {"c": recorded["unprofiled_id"]})
    assert rows == [(0,)]  # producer.record.profiles off
    _, rows = recorded["backend"].query(
        "SELECT count() FROM worker_metrics WHERE cluster_id = {c:String}",
        {"c": recorded["unprofiled_id"]})
    assert rows[0][0] > 0  # ...though its workers recorded
    out = cli(recorded, "--cluster", "unprofiled")
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1
    assert "no profile was recorded for cluster 'unprofiled'" in out.stderr
    prefix = cli(recorded, "--cluster", "profiles-test", "--prefix", "nope")
    assert prefix.returncode == 1 and len(prefix.stderr.strip().splitlines()) == 1
    assert "prefixes profiled: " in prefix.stderr and "planted" in prefix.stderr


def test_pprof_output_is_read_by_go_tool_pprof(recorded, tmp_path):
    go = shutil.which("go") or "/usr/local/go/bin/go"
    path = tmp_path / "planted.pb.gz"
    out = cli(recorded, "--cluster", "profiles-test", "-o", str(path))
    assert out.returncode == 0, out.stderr
    assert gzip.decompress(path.read_bytes())  # gzip-compressed protobuf
    # Go's own build cache, where run-tests built pprof: a HOME of its own would build it
    # again, for minutes on a loaded machine.
    cache = subprocess.run([go, "env", "GOCACHE"], capture_output=True, text=True,
                           check=True).stdout.strip()
    top = subprocess.run([go, "tool", "pprof", "-top", str(path)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "GOTOOLCHAIN": "local",
                                                      "HOME": str(tmp_path), "GOCACHE": cache})
    assert top.returncode == 0, top.stderr
    rows = [line.split() for line in top.stdout.splitlines() if "planted_hot" in line]
    assert rows, top.stdout
    # its flat share is the samples Dask counted in it (pprof prints flat first)
    total = sum(recorded_stacks(recorded["backend"], recorded["cluster_id"], "").values())
    assert int(rows[0][0]) == round(share(recorded_stacks(
        recorded["backend"], recorded["cluster_id"], ""), "planted_hot") * total)


def test_speedscope_and_folded_files_keep_an_odd_frame_name_as_text(recorded, tmp_path):
    path = tmp_path / "odd.speedscope.json"
    out = cli(recorded, "--cluster", "profiles-test", "--prefix", "odd", "-o", str(path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(path.read_text("utf-8"))
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    frames = doc["shared"]["frames"]
    assert all(isinstance(f["name"], str) for f in frames)
    [profile] = doc["profiles"]
    assert {"type", "name", "unit", "startValue", "endValue", "samples", "weights"} <= set(profile)
    assert profile["type"] == "sampled" and profile["unit"] == "none"
    assert len(profile["samples"]) == len(profile["weights"])
    assert all(0 <= i < len(frames) for stack in profile["samples"] for i in stack)
    assert profile["endValue"] == sum(profile["weights"])
    names = {f["name"] for f in frames}
    assert ODD_NAME in names
    odd = next(f for f in frames if f["name"] == ODD_NAME)
    assert odd["file"] == __file__ and odd["line"] == odd_named.__code__.co_firstlineno
    folded = tmp_path / "odd.folded"
    assert cli(recorded, "--cluster", "profiles-test", "--prefix", "odd", "-o",
               str(folded)).returncode == 0
    lines = folded.read_text("utf-8").splitlines()
    assert any(f":{ODD_NAME} " in line or f":{ODD_NAME};" in line for line in lines)
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in lines)
    table = cli(recorded, "--cluster", "profiles-test", "--prefix", "odd", "--wide")
    assert table.returncode == 0 and ODD_NAME in table.stdout


def _published_in_calls(dask_worker, at_most: int) -> dict:
    """On the worker's event loop: publish its profile a few cycles a call until
    nothing is left, then the cycle in progress; what each call gave."""
    calls = []
    while True:
        events = profile_events(dask_worker, False, 16384, at_most)
        if not events:
            break
        calls.append(events)
    final = profile_events(dask_worker, True, 16384)
    return {"calls": calls, "final": final,
            "again": profile_events(dask_worker, True, 16384),
            "samples": sum(t["count"] for _, t in dask_worker.profile_history)
            + dask_worker.profile_recent["count"]}


def test_each_cycle_is_published_once_a_few_cycles_at_a_time():
    """A worker that profiled several cycles before anything was published (a plugin
    attached late) gives them a few at a time, oldest first, each once."""
    with dask.config.set({"distributed.worker.profile.cycle": "100ms"}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        assert client.submit(odd_task, 3, key="odd-3").result() == 3
        [out] = client.run(_published_in_calls, at_most=2).values()
    assert len(out["calls"]) >= 2  # half a second of 100ms cycles, two at a time
    seen = []
    for events in out["calls"]:
        cycles = sorted({e["ts"] for e in events})
        assert len(cycles) <= 2
        seen += cycles
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    published = [e for events in out["calls"] for e in events] + out["final"]
    assert sum(sum(e["counts"]) for e in published if e["prefix"] == "") == out["samples"]
    assert {e["prefix"] for e in published} == {"", "odd"}
    assert out["again"] == []  # the cycle in progress, published once


# ---------------------------------------------------------------- the profile view


def view_data(recorded, name: str = "profile", worker: str | None = None, **params) -> dict:
    from dask_blackbox.read import views

    ctx = views.context(recorded["backend"], {"cluster": recorded["cluster_id"], **params},
                        worker=worker)
    return views.VIEWS[name].data(ctx)["profile"]


def test_the_profile_view_names_the_planted_function_with_the_samples_profiles_gives(recorded):
    from dask_blackbox.read import profiles

    backend, cluster_id = recorded["backend"], recorded["cluster_id"]
    for prefix in ("planted", ""):
        shown = view_data(recorded, prefix=prefix)
        merged = profiles.load(backend, cluster_id, prefix)
        _, rows = profiles.top(merged, 25)
        assert shown["samples"] == merged.samples == sum(
            recorded_stacks(backend, cluster_id, prefix).values())
        assert shown["left_off"] == [0, 0]  # fewer stacks than the view draws
        first = shown["top"][0]
        assert first["function"] == "planted_hot"  # the hottest frame, by its own samples
        assert (first["self"], first["total"]) == (rows[0][2], rows[0][4])
        assert [tuple(r.values()) for r in shown["top"]] == rows
        # its rectangles: as wide as its share of the samples, with its samples
        flame = shown["flame"]
        hot = [i for i, n in enumerate(flame["name"]) if n == "planted_hot"]
        assert hot and sum(flame["samples"][i] for i in hot) == first["total"]
        width = sum(flame["right"][i] - flame["left"][i] for i in hot)
        assert abs(width - first["total"] / merged.samples) < 1e-9
    assert [p for p, _ in view_data(recorded)["prefixes"]][:1] == ["planted"]
    # a worker's page: that worker's profile; the workers' add up to the run's
    per_worker = [view_data(recorded, "worker_profile", worker=w) for w in recorded["workers"]]
    assert [p["samples"] for p in per_worker] == [
        profiles.load(backend, cluster_id, worker=w).samples for w in recorded["workers"]]
    assert sum(p["samples"] for p in per_worker) == view_data(recorded)["samples"]


def test_a_run_without_profiles_says_so_in_its_view(recorded):
    from dask_blackbox.read import templates, views
    from dask_blackbox.read.views.page import page_variables

    ctx = views.context(recorded["backend"], {"cluster": recorded["unprofiled_id"]})
    data = views.VIEWS["profile"].data(ctx)
    assert data["profile"]["samples"] == 0 and data["profile"]["flame"] is None
    html = templates.env().get_template("panel_profile.html").render(
        data=data, roots={}, profile_figure=None, **page_variables(ctx, True))
    assert "No profiles were recorded for this run" in html


def test_the_report_holds_the_profile_view(recorded):
    from dask_blackbox.read import report, views

    html = report.render_run(views.run_data(recorded["backend"], recorded["cluster_id"]))
    assert 'id="profile-top"' in html and "planted_hot" in html


#: A headless Chromium (the UI's tests' fixture)


@pytest.fixture(scope="module")
def ui(recorded, tmp_path_factory):
    process, url, log = start_ui({**os.environ, **recorded["env"]},
                                  tmp_path_factory.mktemp("profile-ui") / "ui.log")
    yield url
    process.terminate()
    process.wait(30)


#: The text of the Bokeh tooltips shown in an element, and the <b> elements in them
#: (Bokeh draws its figures in shadow DOMs: walked here)
TOOLTIPS = """(selector) => { const out = [];
  const walk = (root) => { for (const e of root.querySelectorAll('*')) {
      if (String(e.className).includes('bk-tooltip-content'))
        out.push([e.textContent, e.querySelectorAll('b').length]);
      if (e.shadowRoot) walk(e.shadowRoot); } };
  walk(document.querySelector(selector)); return out; }"""


def test_the_profile_view_in_a_browser(recorded, ui, browser):
    import urllib.parse

    page = Page(browser)
    try:
        page.goto(ui + "run?" + urllib.parse.urlencode(
            {"cluster": recorded["cluster_id"], "prefix": "planted"}), charts=False)
        page.load("profile")
        page.page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                                    timeout=60_000)
        hottest = view_data(recorded, prefix="planted")["top"][0]
        first = page.page.inner_text("#profile-top tr.frame >> nth=0").split("\t")
        assert first[0] == "planted_hot", first
        assert first[2:] == [f"{hottest['self']:,}", hottest["self_share"],
                             f"{hottest['total']:,}", hottest["total_share"]], first
        frames = page.model("profile-frames")
        assert frames is not None, "no flame graph on the page"
        hot = [i for i, n in enumerate(frames["name"]) if n == "planted_hot"]
        assert hot and sum(frames["samples"][i] for i in hot) == hottest["total"]
        # its figure drawn: a canvas in the view's section (Bokeh's shadow DOM pierced)
        assert page.page.locator("#view-profile canvas").count() > 0
        shots = os.environ.get("DASK_BLACKBOX_SCREENSHOTS")
        if shots:
            os.makedirs(shots, exist_ok=True)
            page.page.wait_for_timeout(1000)  # let the canvas paint
            page.page.locator("#view-profile").screenshot(path=os.path.join(shots, "run-profile.png"))
        # a frame named in HTML is text: in the table, the figure's data and its hover
        page.goto(ui + "run?" + urllib.parse.urlencode(
            {"cluster": recorded["cluster_id"], "prefix": "odd"}), charts=False)
        page.load("profile")
        assert ODD_NAME in page.page.inner_text("#profile-top")
        assert page.page.query_selector("#profile-top b") is None
        page.page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                                    timeout=60_000)
        assert ODD_NAME in page.model("profile-frames")["name"]
        # a worker's page: that worker's profile
        worker = recorded["workers"][0]
        page.goto(ui + "worker?" + urllib.parse.urlencode(
            {"cluster": recorded["cluster_id"], "worker": worker}), charts=False)
        page.load("worker_profile")
        assert page.page.query_selector("#profile-top tr.frame") is not None
        assert not page.dialogs and not page.errors, (page.dialogs, page.errors)
    finally:
        page.close()


def test_the_flame_graph_s_hover_shows_an_html_named_frame_as_text(recorded, browser, tmp_path):
    """The view's figure of the recorded profile of the oddly named frame, on its own
    page: hovering its innermost frame shows the name as text."""
    import types

    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    from dask_blackbox.read import profiles
    from dask_blackbox.read.views import profile as view

    merged = profiles.load(recorded["backend"], recorded["cluster_id"], "odd")
    figs = types.SimpleNamespace(figures={})
    view.figure(figs, view.flame(merged))
    path = tmp_path / "flame.html"
    path.write_text(file_html(figs.figures["profile"], INLINE, "profile"), "utf-8")
    page = Page(browser)
    try:
        page.goto(path.as_uri(), charts=False)
        page.page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                                    timeout=60_000)
        box = page.page.locator(".bk-Canvas").first.bounding_box()
        tips: list = []
        for dy in range(5, int(box["height"]), 8):  # from the lowest row (the innermost) up
            page.page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] - dy)
            page.page.wait_for_timeout(100)
            tips = page.page.evaluate(TOOLTIPS, "body")
            if tips:
                break
        assert tips, "no tooltip over the flame graph"
        [(text, bold)] = tips
        assert f"function: {ODD_NAME} " in text and bold == 0, tips
        assert not page.dialogs and not page.errors, (page.dialogs, page.errors)
    finally:
        page.close()
