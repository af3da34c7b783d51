"""The production compose file, checked with what runs here (no Docker engine): it
parses, Compose itself accepts it, its services run the CLI commands the tests run,
and every environment variable it sets is a real blackbox setting."""

import pathlib
import shutil
import subprocess

import pytest
import yaml

from dask_blackbox.cli.main import build_parser
from dask_blackbox.config import DEFAULTS
from dask_blackbox.cli.supervisor import PROCESSOR_ARGS, SINK_ARGS

ROOT = pathlib.Path(__file__).parent.parent
COMPOSE = ROOT / "infra" / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def _our_services(compose):
    return {n: s for n, s in compose["services"].items() if "build" in s}


def test_compose_is_valid_for_compose_itself():
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose (Debian package) is needed to lint the compose file"
    out = subprocess.run([tool, "-f", str(COMPOSE), "config", "-q"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_services_run_the_commands_the_tests_run(compose):
    services = _our_services(compose)
    assert set(services) == {"topics", "processors", "sink"}
    assert services["sink"]["command"] == ["dask-blackbox", *SINK_ARGS]
    processors = services["processors"]["command"]
    assert processors[: 1 + len(PROCESSOR_ARGS)] == ["faust", *PROCESSOR_ARGS]
    assert "worker" in processors
    parser = build_parser()
    for name, service in services.items():
        cmd = service["command"]
        if cmd[0] == "dask-blackbox":
            parser.parse_args(cmd[1:])  # exits (fails the test) on an unknown command
    assert (ROOT / "infra" / "Dockerfile").is_file()
    assert services["processors"]["build"]["dockerfile"] == "infra/Dockerfile"


def _config_keys(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _config_keys(v, prefix + (k,))
        yield prefix + (k,)


def test_every_environment_name_is_a_real_setting(compose):
    known = {tuple(p.replace("-", "_").upper() for p in key) for key in _config_keys(DEFAULTS)}
    names = set()
    for service in _our_services(compose).values():
        names |= set(service["environment"])
    assert names, "the services are configured through the environment"
    for name in names:
        assert name.startswith("DASK_BLACKBOX__"), name
        parts = tuple(name.removeprefix("DASK_").split("__"))
        assert parts in known, f"{name} is not a blackbox.* setting"


def test_dockerfile_copies_every_layer():
    text = (ROOT / "infra" / "Dockerfile").read_text()
    for package in ("dask_blackbox", "producers", "stream_processors", "sinks"):
        assert f"COPY {package} " in text
