"""How fast the UI opens a big run: first panel, an interactive page, the report.

Generates one cluster of ``--tasks`` tasks (default: a 100k-task run and a 1M-task
run) with the generator of ``bench/query_latency.py`` (task stories with
compute/transfer startstops, worker and scheduler metrics, spans, span snapshots,
prefix partials, log lines), loads it through the sink's own loading path
(``sinks.batch.Batch`` + ``sinks.loader.Loader``, so migration 006's materialized
views fill the page aggregates as they would in the sink) into a fresh chDB
directory, serves the web UI over it (uvicorn in this process: chDB is in-process),
then measures, each the median of ``--repeat`` runs, each run on a new app (nothing
kept from the run before: the app's memo of deaths, progress and scope is empty):

- first panel served: ``GET /run`` (the page's shell: heading, navigation, filters)
  then ``GET /api/view/<first panel>`` (its HTML and Bokeh document), as the page's
  script asks for it;
- interactive in Chromium: from navigation start until every panel in the first
  screen (1400x1000) is loaded and drawn (``performance.now()`` in the page), the
  other panels loading as they scroll into view; and every panel of the page loaded;
- each panel served alone (one run, a context of its own): which panels cost what;
- report, warm: :func:`report.write_report` in this process;
- report, cold (after the others, chDB closed): ``dask-blackbox report`` in a new
  Python process (``python -m dask_blackbox.cli report``), from its start to its exit:
  imports, opening the chDB directory, the queries, the file, the interpreter's exit.

Times are wall clock; the load average is printed (the machine is shared).

With ``--baseline REV`` (a git revision, e.g. ``main``) it measures, instead, the
two figures served by a new process as an A/B on the same recorded run: A is
``REV``'s package (its read side and CLI, put first on ``PYTHONPATH``), B this checkout's,
alternating A, B, A, B, ... ``--repeat`` times each:

- first panel served: a new process opens the chDB directory, serves the web UI, asks
  for the shell and the first panel once to warm (as above), then measures one new
  app's shell and first panel three times (each route's figure: the median of every
  run of its processes);
- report, cold: ``dask-blackbox report`` in a new process, as above, with its
  CPU seconds (every thread's: chDB's too), which a loaded machine does not inflate as
  it does wall seconds.

``--bytecode``: the new processes keep the compiled modules of the package as an
installed one has them (``pip install`` compiles them; ``PYTHONDONTWRITEBYTECODE``,
if set, is unset for them, and one unmeasured run per route writes them first).

With ``--keep DIR`` the generated runs are kept in ``DIR``; with ``--baseline`` too,
``DIR/clusters.txt`` names them and a later ``--baseline`` run with the same ``--keep
DIR`` and ``--seed`` reuses them.

    python bench/ui_latency.py                 # 100k and 1M tasks
    python bench/ui_latency.py --tasks 100000  # one size
    python bench/ui_latency.py --tasks 100000 --keep /tmp/ui100k --baseline main --repeat 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from typing import NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from query_latency import ClusterRun  # noqa: E402  (the generator, reused)
from report import report  # noqa: E402

from dask_blackbox import clickhouse, contract  # noqa: E402
from dask_blackbox.read import backends, views, web  # noqa: E402
from dask_blackbox.read import report as html_report  # noqa: E402
from dask_blackbox.sinks.loader import Loader  # noqa: E402
from dask_blackbox.sinks.batch import Batch  # noqa: E402
from dask_blackbox.sinks.schema import Target, migrate  # noqa: E402

CHROMIUM = "/usr/bin/chromium"

TRANSITIONS_PER_TASK = 5.3  # the generator's stories: released..forgotten, 30% queued


def load_cluster(client, target, tasks: int, index: int, seed: int) -> tuple[str, int]:
    """Generate one cluster of about ``tasks`` tasks and load it; (cluster id, transitions)."""
    rng = random.Random(seed * 1000 + index)
    run = ClusterRun(index, int(tasks * TRANSITIONS_PER_TASK), time.time() - 86400 - index * 7200, rng)
    gc.disable()
    t = time.perf_counter()
    run.generate()
    offsets: dict = {}
    messages = run.messages(offsets)
    n_transitions = sum(1 for e in run.scheduler_events if e["kind"] == contract.TRANSITION)
    cluster_id = run.cluster_id
    del run
    gc.enable()
    print(f"  generated {n_transitions:,} transitions in {time.perf_counter() - t:.0f}s", flush=True)
    t = time.perf_counter()
    loader = Loader(client, target, f"bench-ui-{index}")
    batch, starts = Batch(), {}
    for message in messages:
        starts.setdefault((message.kafka_topic, message.partition), message.offset)
        batch.add(message)
        if batch.n_rows >= 200_000:
            loader.prepare(batch)
            loader.load(batch, starts)
            batch, starts = Batch(), {}
    if batch.n_messages:
        loader.prepare(batch)
        loader.load(batch, starts)
    print(f"  loaded through the sink path in {time.perf_counter() - t:.0f}s", flush=True)
    return cluster_id, n_transitions


def median_s(fn, repeat: int) -> tuple[float, list[float], object]:
    """Median wall-clock seconds, every run's, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times, result


class Shared:
    """The bench's backend, lent to each app (an app closes its backend when it stops)."""

    def __init__(self, backend) -> None:
        self.backend, self.database = backend, backend.database

    def query(self, sql, parameters=None):
        return self.backend.query(sql, parameters)

    def close(self) -> None:
        pass


class Server:
    """A new web app over ``backend`` served by uvicorn in a thread of this process."""

    def __init__(self, backend) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(web.create_app(lambda: Shared(backend)), host="127.0.0.1",
                                port=self.port, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}/"

    def __enter__(self) -> "Server":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=300) as r:
        return r.read()


def first_panel(backend, cluster_id: str) -> tuple[float, float, int]:
    """Seconds to the page's shell, to its first panel, and the shell's bytes (one new app)."""
    query = urllib.parse.urlencode({"cluster": cluster_id})
    with Server(backend) as server:
        t = time.perf_counter()
        shell = get(server.url + "run?" + query)
        shell_s = time.perf_counter() - t
        get(server.url + f"api/view/{views.RUN_VIEWS[0].name}?" + query)
        return shell_s, time.perf_counter() - t, len(shell)


def in_chromium(browser, backend, cluster_id: str) -> dict:
    """One page load in a new browser context on a new app: ms to the first screen's
    panels loaded and drawn, ms to every panel, each panel's own ms."""
    query = urllib.parse.urlencode({"cluster": cluster_id})
    with Server(backend) as server:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto(server.url + "run?" + query)
            page.wait_for_function(
                """() => { const shown = [...document.querySelectorAll('section.view')].filter(s => {
                     const r = s.getBoundingClientRect(); return r.top < window.innerHeight && r.bottom > 0; });
                   return shown.length > 0 && shown.every(s => s.dataset.state === 'loaded'
                                                          || s.dataset.state === 'failed'); }""",
                timeout=300_000, polling=20)
            first_screen = page.evaluate("() => performance.now()")
            page.evaluate("() => window.blackbox.loadAll()")
            every = page.evaluate("() => performance.now()")
            states = page.eval_on_selector_all(
                "section.view", "ss => ss.map(s => [s.dataset.view, s.dataset.state, Number(s.dataset.ms)])")
        finally:
            context.close()
    failed = [v for v, state, _ in states if state != "loaded"]
    if failed or errors:
        raise SystemExit(f"panels failed to load: {failed}; page errors: {errors}")
    return {"first_screen": first_screen, "every": every, "panels": {v: ms for v, _, ms in states}}


def panel_costs(backend, cluster_id: str) -> dict[str, float]:
    """Each Run page panel served alone (its data and its HTML and Bokeh document, on
    a context of its own: nothing shared with the other panels), in ms."""
    costs = {}
    for view in views.RUN_VIEWS:
        t = time.perf_counter()
        ctx = views.context(backend, {"cluster": cluster_id}, views.Memo())
        views.render_view(view.name, ctx)
        costs[view.name] = (time.perf_counter() - t) * 1000
    return costs


def first_panel_child(chdb: str, cluster_id: str, runs: int) -> None:
    """In a new process (``--child-first-panel``): open ``chdb``, warm once, then print
    ``runs`` measures of :func:`first_panel` (a new app each) as JSON. The collector's
    thresholds are those of a ``dask-blackbox ui`` process (``cli.main.run``)."""
    import dask_blackbox
    from dask_blackbox import collector

    gc.set_threshold(*collector.THRESHOLDS)

    client = clickhouse.open_client(f"chdb://{chdb}")
    try:
        backend = backends.DirectBackend(client, "blackbox")
        first_panel(backend, cluster_id)  # warm: first reads of each column's parts
        measured = [first_panel(backend, cluster_id)[:2] for _ in range(runs)]
    finally:
        client.close()
    print(json.dumps({"runs": measured, "location": dask_blackbox.__file__}))


#: Whether the new processes keep compiled modules (``--bytecode``).
BYTECODE = False


def child_env(package: str | None) -> dict:
    """The environment of a new process: ``package`` first on its PYTHONPATH (the
    baseline's read side); with :data:`BYTECODE`, modules' bytecode written and read."""
    env = dict(os.environ)
    if package:
        env["PYTHONPATH"] = os.pathsep.join([package, env.get("PYTHONPATH", "")])
    if BYTECODE:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def in_child(args: list[str], package: str | None) -> dict:
    """Run this script with ``args`` in a new process (:func:`child_env`); its last
    line of output, parsed."""
    env = child_env(package)
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tempfile.gettempdir())
    if done.returncode:
        raise SystemExit(f"the child {args[0]} failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if package and not result["location"].startswith(package):
        raise SystemExit(f"route A imported {result['location']}, not the baseline")
    return result


def baseline_ab(root: pathlib.Path, loaded: list[tuple[str, str]], revision: str, repeat: int) -> None:
    """The A/B of ``--baseline`` (see the module docstring) for each loaded run."""
    from sink_ingest import baseline_package

    with tempfile.TemporaryDirectory() as base:
        package = str(baseline_package(revision, pathlib.Path(base)))
        routes = (("A", f"baseline {revision}", package), ("B", "this checkout", None))
        if BYTECODE:  # one unmeasured run per route writes its modules' bytecode
            for _, _, pkg in routes:
                cold_report(root / "chdb", root / "cold-warm.html", loaded[0][1], pkg)
        for label, cluster_id in loaded:
            first: dict[str, list] = {"A": [], "B": []}
            cold: dict[str, list] = {"A": [], "B": []}
            for _ in range(repeat):
                for route, _, pkg in routes:
                    first[route] += in_child(["--child-first-panel", str(root / "chdb"), cluster_id],
                                             pkg)["runs"]
                    cold[route].append(cold_report(root / "chdb", root / f"cold-{label}-{route}.html",
                                                   cluster_id, pkg))
            load = os.getloadavg()
            for route, name, _ in routes:
                print(f"  {label}, {route} ({name}): first panel runs "
                      f"{[round(f * 1000) for _, f in first[route]]} ms (shell "
                      f"{[round(s * 1000) for s, _ in first[route]]} ms); cold report runs "
                      f"{[round(c.wall, 2) for c in cold[route]]} s (its report, as it says "
                      f"{[c.work for c in cold[route]]} s; CPU "
                      f"{[round(c.cpu, 2) for c in cold[route]]} s), {cold[route][-1].size / 1e6:.2f} MB",
                      flush=True)
            print(f"  {repeat} processes per route, alternating"
                  f"{', compiled modules kept' if BYTECODE else ''}; load average "
                  f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores", flush=True)
            big = label.endswith("M")
            kept = ", compiled modules kept" if BYTECODE else ""
            for route, name, _ in routes:
                report(f"Run page first panel served (new process{kept}), {label}-task run, {route}: {name} "
                       f"(median of {len(first[route])})", round(statistics.median(f for _, f in first[route]) * 1000),
                       "ms", (1000 if big else 300) if route == "B" else None)
                report(f"report written cold (new process{kept}), {label}-task run, {route}: {name} "
                       f"(median of {repeat})", round(statistics.median(c.wall for c in cold[route]), 2), "s",
                       None if big or route == "A" else 3)
                report(f"report written cold, CPU seconds of its process{kept}, {label}-task run, {route}: {name} "
                       f"(median of {repeat})", round(statistics.median(c.cpu for c in cold[route]), 2), "s",
                       None)


class Cold(NamedTuple):
    """One cold report: the seconds the command says its report took (opening
    ClickHouse, the queries, the file; to a tenth), the process's wall seconds and
    CPU seconds (user + system, every thread: chDB's too), the file's bytes."""

    work: float
    wall: float
    cpu: float
    size: int


def cold_report(chdb: pathlib.Path, out: pathlib.Path, cluster_id: str,
                package: str | None = None) -> Cold:
    """``dask-blackbox report`` in a new process (``python -m dask_blackbox.cli``;
    ``package`` first on its PYTHONPATH: the baseline's), on an empty data directory
    (no running sink to ask: the chDB directory is opened directly)."""
    env = child_env(package)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as data_dir:
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "report", "--clickhouse",
                               f"chdb://{chdb}", "--data-dir", data_dir, "--cluster", cluster_id,
                               "-o", str(out)],
                              capture_output=True, text=True, timeout=600, env=env,
                              cwd=tempfile.gettempdir())
        wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    said = re.search(r" in ([0-9.]+)s$", done.stdout.strip())
    if done.returncode or not said:
        raise SystemExit(f"the cold report failed: {done.stdout[-500:]} {done.stderr[-2000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Cold(float(said[1]), wall, cpu, out.stat().st_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, action="append",
                        help="tasks in a generated cluster (repeatable; default 100000 and 1000000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per median")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--keep", help="keep the chDB directory here")
    parser.add_argument("--quick", action="store_true", help="one 20k-task cluster, 2 runs")
    parser.add_argument("--baseline", metavar="REV",
                        help="instead: A/B of the first panel and the cold report, REV against this checkout")
    parser.add_argument("--bytecode", action="store_true",
                        help="new processes keep compiled modules, as an installed package has them")
    parser.add_argument("--child-first-panel", nargs=2, metavar=("CHDB", "CLUSTER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    global BYTECODE
    BYTECODE = args.bytecode
    if args.child_first_panel:
        first_panel_child(*args.child_first_panel, runs=3)
        return
    if args.quick:
        args.tasks, args.repeat = args.tasks or [20_000], 2
    sizes = args.tasks or [100_000, 1_000_000]
    root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="bb-ui-bench-"))
    kept = root / "clusters.txt"  # "tasks seed cluster_id" per kept run
    known = {}
    if args.keep and kept.exists():
        known = {(int(t), int(s)): c for t, s, c in (line.split() for line in kept.read_text().splitlines())}
    client = clickhouse.open_client(f"chdb://{root / 'chdb'}")
    target = Target("blackbox", 90 * 86400)
    migrate(client, target)
    backend = backends.DirectBackend(client, "blackbox")
    if args.baseline:
        loaded = []
        for index, tasks in enumerate(sizes):
            label = f"{tasks // 1000}k" if tasks < 1_000_000 else f"{tasks / 1e6:g}M"
            if (tasks, args.seed) not in known:
                print(f"{label}-task cluster:", flush=True)
                known[(tasks, args.seed)] = load_cluster(client, target, tasks, index, args.seed)[0]
                if args.keep:
                    kept.write_text("".join(f"{t} {s} {c}\n" for (t, s), c in known.items()))
            loaded.append((label, known[(tasks, args.seed)]))
        client.close()
        try:
            baseline_ab(root, loaded, args.baseline, args.repeat)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        return
    import playwright.sync_api as playwright_sync

    loaded: list[tuple[str, str]] = []
    try:
        with playwright_sync.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--headless"])
            for index, tasks in enumerate(sizes):
                label = f"{tasks // 1000}k" if tasks < 1_000_000 else f"{tasks / 1e6:g}M"
                print(f"{label}-task cluster:", flush=True)
                cluster_id, n_transitions = load_cluster(client, target, tasks, index, args.seed)
                loaded.append((label, cluster_id))
                computes = backend.query(
                    "SELECT countIf(ss.action = 'compute') FROM blackbox.transitions "
                    "ARRAY JOIN startstops AS ss WHERE cluster_id = {c:String}", {"c": cluster_id})[1][0][0]
                first_panel(backend, cluster_id)  # warm: first reads of each column's parts
                runs = [first_panel(backend, cluster_id) for _ in range(args.repeat)]
                shell_s = statistics.median(r[0] for r in runs)
                first_s = statistics.median(r[1] for r in runs)
                loads = [in_chromium(browser, backend, cluster_id) for _ in range(args.repeat)]
                screen_ms = statistics.median(r["first_screen"] for r in loads)
                every_ms = statistics.median(r["every"] for r in loads)
                slowest = sorted(loads[-1]["panels"].items(), key=lambda kv: -kv[1])[:5]
                costs = panel_costs(backend, cluster_id)
                print("  each panel alone (ms, one run): " + ", ".join(
                    f"{v} {ms:.0f}" for v, ms in costs.items()), flush=True)
                out = root / f"report-{label}.html"
                report_s, _, written = median_s(
                    lambda: html_report.write_report(out, cluster_id, backend=backend), args.repeat)
                print(f"  {computes:,} computes recorded, {n_transitions:,} transitions; shell "
                      f"{runs[-1][2] / 1e3:.0f} kB; first panel runs "
                      f"{[round(r[1] * 1000) for r in runs]} ms; first screen runs "
                      f"{[round(r['first_screen']) for r in loads]} ms; slowest panels (last run) "
                      f"{', '.join(f'{v} {ms:.0f} ms' for v, ms in slowest)}; medians of {args.repeat} runs; "
                      f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
                big = tasks >= 1_000_000
                report(f"Run page shell served, {label}-task run (median)", round(shell_s * 1000), "ms", None)
                report(f"Run page first panel served, {label}-task run (median)", round(first_s * 1000), "ms",
                       1000 if big else 300)
                report(f"Run page interactive in Chromium (first screen), {label}-task run (median)",
                       round(screen_ms), "ms", None if big else 2000)
                report(f"Run page, every panel loaded in Chromium, {label}-task run (median)",
                       round(every_ms), "ms", None)
                report(f"report written warm, {label}-task run (median)", round(report_s, 2), "s", None)
                report(f"report size, {label}-task run", round(written["bytes"] / 1e6, 2), "MB", 10)
            browser.close()
    finally:
        client.close()
    try:
        for label, cluster_id in loaded:
            runs = [cold_report(root / "chdb", root / f"cold-{label}.html", cluster_id)
                    for _ in range(args.repeat)]
            print(f"  cold report, {label}: process wall runs {[round(r.wall, 2) for r in runs]} s "
                  f"(its report, as it says {[r.work for r in runs]} s; CPU "
                  f"{[round(r.cpu, 2) for r in runs]} s); {runs[-1].size / 1e6:.2f} MB", flush=True)
            report(f"report written cold (new process), {label}-task run (median)",
                   round(statistics.median(r.wall for r in runs), 2), "s", None if label.endswith("M") else 3)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
