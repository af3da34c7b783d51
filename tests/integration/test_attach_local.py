"""`producers.attach()` with no broker configured records into the pipeline of a
running `dask-blackbox up` on the same data directory.

`up` runs as a subprocess on a fresh data directory; a separate process whose
environment holds nothing of dask-blackbox but ``DASK_BLACKBOX__DATA_DIR`` runs a
LocalCluster, attaches the producers and computes. Its transitions then show up in
the ClickHouse of that `up` (queried through the CLI, as a user would).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dask_blackbox.testing.polling import wait_for
from up_process import Up

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

_CLIENT = r'''
import json

from distributed import Client, LocalCluster

from dask_blackbox import producers


def inc(x):
    return x + 1


def kafka_of_plugin(dask_scheduler):
    settings = dask_scheduler.plugins["dask-blackbox"].settings
    return list(settings.kafka.bootstrap_servers), settings.raw_topic


if __name__ == "__main__":
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        identity = producers.attach(client, cluster_name="x")
        servers, raw_topic = client.run_on_scheduler(kafka_of_plugin)
        assert client.submit(inc, 1, key="attach-local-inc").result() == 2
    print(json.dumps({"identity": identity, "servers": servers, "raw_topic": raw_topic}))
'''


def _clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any dask-blackbox setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_BLACKBOX__")}
    return {**env, **extra}


def _query(data_dir, sql: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "dask_blackbox.cli", "query", sql, "--data-dir", str(data_dir),
         "--format", "json"],
        capture_output=True, text=True, timeout=120, env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_attach_without_a_broker_records_into_the_running_up(tmp_path):
    data_dir = tmp_path / "data"
    up = Up(data_dir, env=_clean_env())
    try:
        up.wait_for("healthy in")
        state = json.loads((data_dir / "up.json").read_text())

        script = tmp_path / "attach_client.py"
        script.write_text(_CLIENT)
        # Nothing of dask-blackbox in the environment but the data directory (and a
        # HOME without Dask config files).
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
               "DASK_BLACKBOX__DATA_DIR": str(data_dir)}
        out = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        # the plugins carry the broker and topic prefix of the running `up`
        assert result["servers"] == state["kafka"].split(",")
        prefix = state["topic_prefix"]
        assert result["raw_topic"] == (f"{prefix}.raw" if prefix else "raw")

        cluster_id = result["identity"]["cluster_id"]
        sql = ("SELECT key, start, finish, source FROM blackbox.transitions "
               f"WHERE cluster_id = '{cluster_id}' AND key = 'attach-local-inc' ORDER BY ts")

        def drained() -> list[dict] | None:  # the key's story is complete once forgotten
            rows = _query(data_dir, sql)
            return rows if any(r["finish"] == "forgotten" for r in rows) else None

        rows = wait_for(drained, 180, "the client's transitions in ClickHouse", interval=1.0)
        assert ("processing", "memory") in {(r["start"], r["finish"]) for r in rows}
        assert {r["source"] for r in rows} == {"scheduler"}
        names = _query(data_dir, "SELECT DISTINCT cluster_name FROM blackbox.envelopes "
                                 f"WHERE cluster_id = '{cluster_id}'")
        assert names == [{"cluster_name": "x"}]
    finally:
        up.terminate()
