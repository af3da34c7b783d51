"""Why-was-it-slow on bad or thin input, and the statistics underneath, on a real chDB
holding small synthetic runs written as the sink writes them (no cluster, no broker).

- a cycle in a recorded graph is named (with the cycle) and the path is still found;
- a dependency naming a task never recorded is reported, not followed;
- a span with no tasks, and runs that share nothing, get a one-line answer from the
  panels, the JSON API and the command line, never a stack trace;
- the rank test and the bootstrap interval give the textbook values; a link's parts
  cover it exactly.
"""

from __future__ import annotations

import datetime
import math
from typing import NamedTuple

import numpy as np
import pytest

from dask_blackbox import clickhouse
from dask_blackbox.cli import formatting, slowness
from dask_blackbox.cli.main import build_parser
from dask_blackbox.read import api, backends, critical_path, noise, panels, regressions
from dask_blackbox.read.views import cost as cost_view
from dask_blackbox.sinks.schema import Target, migrate

T0 = 1_790_000_000.0


class Task(NamedTuple):
    """A task of a synthetic run: times in seconds after T0."""

    key: str
    begin: float
    end: float
    deps: tuple[str, ...] = ()
    prefix: str = ""
    worker: str = "tcp://127.0.0.1:1"
    span_id: str = "s-etl"


def _t(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(T0 + seconds, datetime.timezone.utc)


def write_run(client, cluster_id: str, name: str, tasks: list[Task],
              graph: dict[str, list[str]] | None = None,
              spans: dict[str, tuple[str, ...]] | None = None) -> None:
    """The rows a recorded run leaves: an envelope, each task's transitions (released
    -> waiting -> processing -> memory with its compute, released by the stimulus
    that put its last dependency in memory), the graph (``graph``: key ->
    dependencies as recorded, default the tasks' own; {} for none) and the spans."""
    first = min(t.begin for t in tasks)
    client.insert("blackbox.envelopes", [[cluster_id, name, "scheduler", "p", 0, _t(first)]],
                  column_names=["cluster_id", "cluster_name", "source", "producer_id", "seq", "sent_at"])
    arrived = {t.key: t.end + 0.002 for t in tasks}
    rows = []
    for t in tasks:
        prefix = t.prefix or t.key.rstrip("0123456789-")
        last = max(t.deps, key=lambda d: arrived.get(d, -1), default=None)
        released = f"task-finished-{last}" if last in arrived else "update-graph-1"
        entered = max([arrived.get(d, 0.0) for d in t.deps] + [t.begin - 0.0015]) + 0.0005
        common = [cluster_id, t.key, "scheduler", prefix, prefix, t.span_id]
        rows += [
            common + [_t(first), "released", "waiting", "update-graph-1", "", [], [], []],
            common + [_t(entered), "waiting", "processing", released, "", [], [], []],
            common + [_t(arrived[t.key]), "processing", "memory", f"task-finished-{t.key}",
                      t.worker, ["compute"], [_t(t.begin)], [_t(t.end)]],
        ]
    client.insert("blackbox.transitions", rows, column_names=[
        "cluster_id", "key", "source", "prefix", "task_group", "span_id", "ts", "start", "finish",
        "stimulus_id", "worker", "startstops.action", "startstops.start", "startstops.stop"])
    graph = {t.key: list(t.deps) for t in tasks} if graph is None else graph
    if graph:
        client.insert("blackbox.graph_tasks",
                      [[cluster_id, key, _t(0), deps] for key, deps in graph.items()],
                      column_names=["cluster_id", "key", "ts", "dependencies"])
    spans = {"s-etl": ("etl",)} if spans is None else spans
    client.insert("blackbox.spans", [[cluster_id, sid, list(n), "", _t(first), _t(first)]
                                     for sid, n in spans.items()],
                  column_names=["cluster_id", "span_id", "name", "parent_id", "enqueued", "ts"])


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slowness") / "ch"
    client = clickhouse.open_client(f"chdb://{directory}")
    migrate(client, Target("blackbox", 90 * 86400))
    chain = [Task("a-1", 0.01, 1.0), Task("b-1", 1.1, 2.0, ("a-1",)), Task("c-1", 2.1, 3.0, ("b-1",))]
    # the graph as recorded says a-1 needs c-1 too: a cycle a -> c -> b -> a
    write_run(client, "cycle", "cyclic", chain, graph={"a-1": ["c-1"], "b-1": ["a-1"], "c-1": ["b-1"]})
    write_run(client, "dangling", "dangling", chain[:2],
              graph={"a-1": [], "b-1": ["a-1", "ghost-7"]})
    write_run(client, "empty", "empty", chain, spans={"s-etl": ("etl",), "s-none": ("nothing",)})
    # no graph, and each task names the other's completion as what released it
    write_run(client, "loop", "loop", [Task("p-1", 0.01, 1.0, ("q-1",)), Task("q-1", 1.1, 2.0, ("p-1",))],
              graph={})
    write_run(client, "x-run", "nightly", [Task(f"x-{i}", i * 0.1, i * 0.1 + 0.09) for i in range(8)])
    write_run(client, "y-run", "nightly",
              [Task(f"y-{i}", 100 + i * 0.1, 100 + i * 0.1 + 0.09) for i in range(8)])
    b = backends.DirectBackend(client, "blackbox")
    yield b
    b.close()


def _run_cli(argv: list[str], backend, capsys) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    command = slowness.critical_path if args.command == "critical-path" else slowness.compare
    code = command(args, backend)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_cycle_in_the_recorded_graph_is_named_and_the_path_still_found(backend, capsys):
    path = critical_path.critical_path(backend, "cycle")
    assert [link.key for link in path.links] == ["a-1", "b-1", "c-1"]
    assert path.issues.cycle == ("a-1", "c-1", "b-1", "a-1")
    assert path.issues.n_backwards == 1
    [note] = path.notes
    assert note.startswith("the recorded graph has a cycle (a-1 -> c-1 -> b-1 -> a-1)")
    assert sum(path.parts.values()) == pytest.approx(path.wall)
    code, out, err = _run_cli(["critical-path", "--cluster", "cyclic"], backend, capsys)
    assert code == 0 and not err
    assert "note: the recorded graph has a cycle" in out


def test_a_dangling_dependency_is_reported_not_followed(backend):
    data = panels.critical_path(backend, panels.resolve(backend, "dangling"))
    assert [link["key"] for link in data["links"]] == ["a-1", "b-1"]
    assert data["links"][1]["found_by"] == "graph"
    assert any("name a task this cluster never recorded (e.g. 'b-1' on 'ghost-7')" in n
               for n in data["notes"])


def test_a_span_with_no_tasks_gets_a_clear_answer(backend, capsys):
    scope = panels.resolve(backend, "empty", span="nothing")
    data = panels.critical_path(backend, scope)
    assert data == {"available": False, "reason": "no task of span 'nothing' in cluster empty "
                    "finished with recorded actions (startstops): there is no path to show"}
    assert api.run_panel(backend, "critical_path", {"cluster": "empty", "span": "nothing"}) == data
    priced = cost_view.cost(backend, scope)
    assert cost_view.cost(backend, panels.resolve(backend, "empty"))["prefixes"]  # no metrics: no sort key
    [empty] = priced["spans"]
    # no fine performance metrics were recorded: their measures are unknown, not zero
    assert (empty["cpu_s"], empty["busy_s"], empty["memory_byte_s"]) == (None, None, 0.0)
    assert empty["start"] is None and empty["offered_s"] is None
    code, out, err = _run_cli(["critical-path", "--cluster", "empty", "--span", "nothing"],
                              backend, capsys)
    assert code == 1 and not out and err.count("\n") == 1 and "no task of span 'nothing'" in err
    # and the span that did run has its path
    assert panels.critical_path(backend, panels.resolve(backend, "empty", span="etl"))["available"]


def test_stimulus_ids_that_lead_in_a_circle_stop_the_walk(backend):
    path = critical_path.critical_path(backend, "loop")
    assert path.basis == "actions"
    assert [(link.key, link.found_by) for link in path.links] == [("p-1", "not proven"),
                                                                   ("q-1", "stimulus")]
    assert any(n.startswith("the walk stopped at 'p-1': its dependency's result did not arrive")
               for n in path.notes)
    assert sum(path.parts.values()) == pytest.approx(path.wall)


def test_runs_with_nothing_in_common_get_a_clear_answer(backend, capsys):
    with pytest.raises(regressions.NotComparable, match=r"the runs share no task prefix: nightly .* "
                       r"ran x, nightly .* ran y; nothing to compare"):
        regressions.compare(backend, cluster="nightly")
    code, out, err = _run_cli(["compare", "--cluster", "nightly"], backend, capsys)
    assert code == 1 and not out and err.count("\n") == 1 and "share no task prefix" in err
    # one run of a span: nothing to compare it with, said as the verdict
    data = panels.compare(backend, "nothing", None)
    assert data["verdict"] == {"error": "span 'nothing' was recorded 1 time(s): at least two "
                                        "runs are needed to compare"}
    code, out, err = _run_cli(["compare", "nothing"], backend, capsys)
    assert code == 0 and "at least two runs are needed" in out
    with pytest.raises(panels.NotFound, match="no span named 'nope'"):
        panels.compare(backend, "nope", None)


def test_rank_test_and_interval_give_the_textbook_values():
    # Mann-Whitney U, normal approximation with continuity correction: U = 0 for
    # 5 against 5 separated values gives p = 0.01219 (SciPy's asymptotic method)
    assert noise.rank_test([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(0.012186, abs=1e-5)
    assert noise.rank_test([1, 2, 3], [1, 2, 3]) == 1.0
    assert noise.rank_test([2.0] * 6, [2.0] * 6) == 1.0  # every value tied
    # ties across samples, by hand: U = 1, mean 18, variance 36/12 * (13 - 48/132) =
    # 37.909, z = (17 - 0.5) / 6.157 = 2.680, p = 0.00736
    assert noise.rank_test([1, 1, 2, 2, 3, 3], [3, 4, 4, 5, 5, 6]) == pytest.approx(0.007365, abs=1e-5)
    rng = np.random.default_rng(1)
    x = rng.lognormal(0, 0.05, 200)
    y = 1.15 * rng.lognormal(0, 0.05, 200)
    interval = noise.ratio_interval(x, y)
    assert interval.low < 1.15 < interval.high and interval.high - interval.low < 0.05
    assert noise.ratio_interval(x, y) == interval  # deterministic
    exact = noise.ratio_interval([1.0, 2.0, 4.0], [1.15, 2.3, 4.6])
    assert exact.ratio == pytest.approx(1.15)  # the median of every new / old ratio
    # a few tasks a busy machine delayed move it little
    delayed = np.concatenate([x[:180], x[180:] * 1.5])
    assert noise.ratio_interval(delayed, y).low > 1.08
    assert noise.beyond(interval, 0.05) == 1 and noise.beyond(noise.ratio_interval(y, x), 0.05) == -1
    assert math.isnan(noise.ratio_interval([], y).ratio)
    assert noise.band(None) == noise.MIN_CHANGE
    assert noise.band(noise.run_noise([1.0, 1.1, 0.9, 1.05])) > 0.2
    # one run of five on a busy machine does not widen the band
    assert noise.band(noise.run_noise([1.0, 1.01, 0.99, 1.0, 1.4])) < 0.06


def test_a_links_parts_cover_it_exactly():
    task = critical_path._Task(
        "k", "p", "w", "s", arrived=10.9, entered=2.0, submitted=0.0,
        actions=[("transfer", 2.5, 3.0), ("transfer", 2.8, 3.5), ("disk-read", 4.0, 4.5),
                 ("compute", 5.0, 9.0), ("disk-write", 9.0, 10.0)], evidence=())
    segments = critical_path.link_segments(task, 1.0, 10.9, 1.5, "scheduler")
    assert [s.part for s in segments] == ["scheduler", "transfer", "thread", "disk", "compute",
                                          "disk"]
    assert all(a.stop == b.start for a, b in zip(segments, segments[1:]))
    assert segments[0].start == 1.0 and segments[-1].stop == 10.9

    def parts(segments):
        out = {}
        for s in segments:
            out[s.part] = out.get(s.part, 0) + s.stop - s.start
        return out

    # transfers overlap: their union; the worker's durations; the rest is the wait
    assert parts(segments) == pytest.approx({"scheduler": 1.0, "transfer": 1.0, "thread": 2.4,
                                             "disk": 1.5, "compute": 4.0})
    # the last link ends at the compute's stop: the disk-write after it is not in it
    assert parts(critical_path.link_segments(task, 1.0, 9.0, None, "client", last=True)) == \
        pytest.approx({"scheduler": 1.0, "transfer": 1.0, "thread": 1.5, "disk": 0.5,
                       "compute": 4.0})
    # a worker whose clock put more work in the link than the scheduler saw: the
    # parts shrink in proportion, nothing is counted twice
    squeezed = critical_path.link_segments(task, 1.5, 5.0, None, "client")
    assert sum(s.stop - s.start for s in squeezed) == pytest.approx(3.5)
    assert parts(squeezed)["compute"] == pytest.approx(4.0 * 3.0 / 6.5)


def test_metric_rows_carry_their_units():
    text = formatting.render(["metric", "run a", "run b"],
                             [["elapsed_s", 1.5, 0.000097], ["nbytes", 2688200320, 10],
                              ["tasks", 36, 40], ["memory_byte_s", 2**30, 0]], "table", 120)
    assert "1.5 s" in text and "97 µs" in text and "2.50 GiB" in text and "1.00 GiB·s" in text
    assert "2688200320" not in text and "9.7e-05" not in text
