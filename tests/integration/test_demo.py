"""`dask-blackbox demo`, the newcomer's first command: it brings up the pipeline,
records two real clusters, and what it prints comes from ClickHouse, where the rows
stay after everything has stopped."""

import json
import subprocess
import sys


def cli(*args, timeout=600):
    out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def query(data_dir, sql):
    return json.loads(cli("query", sql, "--format", "json", "--data-dir", str(data_dir)))


def test_demo_prints_what_clickhouse_knows_and_the_rows_stay(tmp_path):
    data_dir = tmp_path / "data"
    printed = cli("demo", "--data-dir", str(data_dir))
    for section in ("== clusters", "== span trees", "== top task prefixes",
                    "== story of the failed task"):
        assert section in printed
    for text in ("demo-alice", "demo-bob", "Alice's workflow", "data load",
                 "random_sample", "erred"):
        assert text in printed, text
    assert not (data_dir / "up.json").exists(), "demo stops the pipeline it started"
    too_wide = [line for line in printed.splitlines() if len(line) > 120]
    assert not too_wide, f"{len(too_wide)} lines wider than 120 columns, e.g. {too_wide[0]!r}"
    assert "…" not in printed  # no header, count, identifier or address cut to fit
    clusters = printed[printed.index("== clusters"):printed.index("== span trees")]
    for name in ("cluster_name", "first_seen", "tasks", "errors", "producers", "envelopes"):
        assert name in clusters, name

    # Nothing runs any more: these queries open the chDB directory directly.
    clusters = {r["cluster_name"]: r for r in query(
        data_dir, "SELECT cluster_name, any(cluster_id) AS id FROM envelopes GROUP BY cluster_name")}
    assert set(clusters) == {"demo-alice", "demo-bob"}

    spans = query(data_dir, f"""
        SELECT s.name AS name, p.name AS parent
        FROM spans AS s LEFT JOIN spans AS p
          ON p.span_id = s.parent_id AND p.cluster_id = s.cluster_id
        WHERE s.cluster_id = '{clusters["demo-alice"]["id"]}'""")
    tree = {tuple(r["name"]): tuple(r["parent"]) for r in spans}
    root = ("Alice's workflow",)
    assert tree == {root: (), root + ("data load",): root,
                    root + ("ML preprocessing",): root, root + ("Model training",): root}

    story = query(data_dir, """
        SELECT start, finish FROM transitions
        WHERE key = 'failing_task-demo' ORDER BY ts, seq, idx""")
    assert [(r["start"], r["finish"]) for r in story][:3] == [
        ("released", "waiting"), ("waiting", "processing"), ("processing", "erred")]

    [row] = query(data_dir, """
        SELECT count() AS n, countIf(finish = 'memory') AS in_memory FROM transitions""")
    assert row["n"] > 500 and row["in_memory"] > 100
