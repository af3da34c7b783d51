"""The light install: a Dask node that only publishes needs distributed, aiokafka,
orjson, msgspec and cramjam (pyproject.toml's "light set"), nothing else of the
pipeline.

A fresh virtual environment (no system site-packages) gets exactly those, at the
versions this test environment runs, and this project built as a wheel from a copy
of its sources (the package-dir mapping of pyproject.toml) and installed with
``--no-deps``. There, a LocalCluster with the producers attached publishes to the
session broker, and the events are read back here. faust, ClickHouse, chDB,
pyarrow and pandas are not even importable in that environment, and the run never
imported a module outside what it has.

The environment is built once per test session (a minute or so; pip's cache helps).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dask_blackbox.contract import LIFECYCLE, TRANSITION, WORKER_METRICS
from producers_support import published, seqs_by_producer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
#: pyproject.toml's light set: what a Dask node needs to run the producers.
LIGHT_SET = ("distributed", "aiokafka", "orjson", "msgspec", "cramjam")
#: What the rest of the pipeline needs, and a producer must not.
PIPELINE_ONLY = ("faust", "mode", "clickhouse_connect", "chdb", "pyarrow", "pandas")

_RUN = r'''
import importlib.util, json, sys

FORBIDDEN = {forbidden!r}


def inc(x):
    return x + 1


if __name__ == "__main__":  # the nanny's spawned worker re-imports this file
    missing = [name for name in FORBIDDEN if importlib.util.find_spec(name) is None]

    from distributed import Client, LocalCluster

    import dask_blackbox.producers as producers

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        identity = producers.attach(client, cluster_name="light-install", **{{
            "producer.flush-interval": "50ms",
            "producer.metrics-interval": "200ms",
            "producer.record.worker-transitions": True,
        }})
        assert client.submit(inc, 1, key="light-inc").result() == 2
        worker_modules = list(client.run(lambda: sorted(sys.modules)).values())[0]
    print(json.dumps({{
        "missing": missing,
        "identity": identity,
        "producers_file": producers.__file__,
        "modules": sorted(set(sys.modules) | set(worker_modules)),
    }}))
'''


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="session")
def light_venv(tmp_path_factory) -> Path:
    """The Python of a fresh venv holding only the light set and this project."""
    root = tmp_path_factory.mktemp("light-install")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in LIGHT_SET]
    _run([str(python), "-m", "pip", "install", "-q", *pins], timeout=600)
    # A copy of the sources as pyproject.toml maps them: building in place would
    # write build/ into the checkout.
    source = root / "source"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)], timeout=600)
    return python


def test_producers_run_with_the_light_set_only(light_venv, bb_config, tmp_path):
    script = tmp_path / "light_run.py"
    script.write_text(_RUN.format(forbidden=list(PIPELINE_ONLY)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           **bb_config}
    out = _run([str(light_venv), str(script)], env=env, cwd=tmp_path, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])

    # the pipeline's packages are not installed, and nothing else got imported
    assert sorted(result["missing"]) == sorted(PIPELINE_ONLY)
    top_level = {m.partition(".")[0] for m in result["modules"]}
    assert not top_level & set(PIPELINE_ONLY)
    assert not top_level & {"numpy", "pyarrow"}
    venv_root = light_venv.parent.parent
    assert Path(result["producers_file"]).is_relative_to(venv_root)  # the wheel, not the checkout

    envelopes, events = published()
    assert {e["cluster_name"] for e in envelopes} == {"light-install"}
    assert {e["cluster_id"] for e in envelopes} == {result["identity"]["cluster_id"]}
    assert {"scheduler", "worker"} <= {e["source"] for e in envelopes} <= {
        "scheduler", "worker", "nanny"}
    for producer_id, seqs in seqs_by_producer(envelopes).items():
        assert sorted(seqs) == list(range(len(seqs))), producer_id
    actions = [e["action"] for e in events if e["kind"] == LIFECYCLE]
    assert actions[0] == "scheduler_start" and actions[-1] == "scheduler_close"
    finished = {(e["_source"], e["finish"]) for e in events
                if e["kind"] == TRANSITION and e["key"] == "light-inc"}
    assert {("scheduler", "memory"), ("worker", "memory")} <= finished
    assert any(e["kind"] == WORKER_METRICS for e in events)
