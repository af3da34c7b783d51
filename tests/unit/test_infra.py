"""The production compose file, checked with what runs here (no Docker engine): it
parses, Compose itself accepts it, its services run the CLI commands the tests run,
and every environment variable it sets is a real blackbox setting. Its defaults are
safe: no default ClickHouse password, published ports on 127.0.0.1 only, topics never
auto-created, and an override puts Kafka's external listener behind SASL_SSL. The
Maven file that fetches Apache Kafka pins the version the compose file runs."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from dask_blackbox.cli.main import build_parser
from dask_blackbox.config import DEFAULTS
from dask_blackbox.deploy.supervisor import PROCESSOR_ARGS, SINK_ARGS

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "docker-compose.yml"
SASL = ROOT / "infra" / "docker-compose.sasl.yml"
SECRETS = {"CLICKHOUSE_PASSWORD": "pw", "CLICKHOUSE_GRAFANA_PASSWORD": "ro-pw",
           "KAFKA_EXTERNAL_HOST": "kafka.example.org",
           "KAFKA_SASL_PASSWORD": "sasl-pw", "KAFKA_SSL_PASSWORD": "ssl-pw",
           "GRAFANA_ADMIN_PASSWORD": "grafana-pw"}
#: What every run of compose needs (no default passwords).
REQUIRED = {"CLICKHOUSE_PASSWORD": "pw", "CLICKHOUSE_GRAFANA_PASSWORD": "ro-pw",
            "GRAFANA_ADMIN_PASSWORD": "grafana-pw"}


def compose_config(*files, **env):
    """`docker-compose config` of ``files`` with only ``env`` set: (returncode,
    resolved config or None, stderr)."""
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose (Debian package) is needed to lint the compose file"
    base = {k: v for k, v in os.environ.items() if k not in SECRETS and k not in (
        "KAFKA_BIND", "CLICKHOUSE_BIND", "GRAFANA_BIND")}
    args = [a for f in files for a in ("-f", str(f))]
    out = subprocess.run([tool, *args, "config"], capture_output=True, text=True,
                         env={**base, **env})
    return out.returncode, yaml.safe_load(out.stdout) if out.returncode == 0 else None, out.stderr


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def _our_services(compose):
    return {n: s for n, s in compose["services"].items() if "build" in s}


def test_compose_is_valid_for_compose_itself():
    code, _, err = compose_config(COMPOSE, **REQUIRED)
    assert code == 0, err
    code, _, err = compose_config(COMPOSE, SASL, **SECRETS)
    assert code == 0, err


def test_no_default_clickhouse_password():
    code, _, err = compose_config(COMPOSE, GRAFANA_ADMIN_PASSWORD="g", CLICKHOUSE_GRAFANA_PASSWORD="r")
    assert code != 0 and "set CLICKHOUSE_PASSWORD" in err
    code, _, err = compose_config(COMPOSE, GRAFANA_ADMIN_PASSWORD="g", CLICKHOUSE_PASSWORD="pw")
    assert code != 0 and "set CLICKHOUSE_GRAFANA_PASSWORD" in err
    assert "blackbox}" not in COMPOSE.read_text()  # no fallback value anywhere
    code, _, err = compose_config(COMPOSE, CLICKHOUSE_PASSWORD="pw", CLICKHOUSE_GRAFANA_PASSWORD="r")
    assert code != 0 and "set GRAFANA_ADMIN_PASSWORD" in err
    _, resolved, _ = compose_config(COMPOSE, CLICKHOUSE_PASSWORD="s3cret", GRAFANA_ADMIN_PASSWORD="g",
                                    CLICKHOUSE_GRAFANA_PASSWORD="r")
    assert resolved["services"]["clickhouse"]["environment"]["CLICKHOUSE_PASSWORD"] == "s3cret"
    assert "blackbox:s3cret@" in resolved["services"]["sink"]["environment"][
        "DASK_BLACKBOX__CLICKHOUSE__DSN"]


def _published(resolved):
    out = {}
    for name, service in resolved["services"].items():
        for port in service.get("ports", ()):
            text = port if isinstance(port, str) else (
                f"{port.get('host_ip', '')}:{port['published']}:{port['target']}")
            host_ip, published, _target = re.fullmatch(
                r"(?:(.*):)?(\d+):(\d+)(?:/tcp)?", text).groups()
            out[(name, int(published))] = host_ip
    return out


def test_only_what_users_reach_is_published_and_on_loopback_by_default():
    _, resolved, _ = compose_config(COMPOSE, **REQUIRED)
    published = _published(resolved)
    assert published == {("kafka", 29092): "127.0.0.1", ("clickhouse", 8123): "127.0.0.1",
                         ("grafana", 3000): "127.0.0.1"}
    _, resolved, _ = compose_config(COMPOSE, **REQUIRED, KAFKA_BIND="0.0.0.0")
    assert _published(resolved)[("kafka", 29092)] == "0.0.0.0"  # when the user says so


def test_topics_are_never_auto_created(compose):
    assert compose["services"]["kafka"]["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_external_listener_with_sasl_ssl():
    _, resolved, _ = compose_config(COMPOSE, SASL, **SECRETS)
    env = resolved["services"]["kafka"]["environment"]
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert protocols["EXTERNAL"] == "SASL_SSL" and protocols["INTERNAL"] == "PLAINTEXT"
    assert "EXTERNAL://kafka.example.org:29092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert 'user_blackbox="sasl-pw"' in env["KAFKA_LISTENER_NAME_EXTERNAL_PLAIN_SASL_JAAS_CONFIG"]
    assert env["KAFKA_SSL_KEYSTORE_PASSWORD"] == "ssl-pw"
    # Only the external listener is published; the internal plaintext one is not.
    assert _published(resolved) == {("kafka", 29092): "127.0.0.1",
                                    ("clickhouse", 8123): "127.0.0.1",
                                    ("grafana", 3000): "127.0.0.1"}
    code, _, err = compose_config(COMPOSE, SASL, **REQUIRED)
    assert code != 0 and "KAFKA_" in err  # no secret, no start


def test_maven_fetches_the_kafka_the_compose_file_runs(compose):
    pom = (ROOT / "infra" / "kafka" / "pom.xml").read_text()
    version = re.search(r"<kafka.version>([\d.]+)</kafka.version>", pom)[1]
    assert version.startswith("4.")
    assert compose["services"]["kafka"]["image"] == f"apache/kafka:{version}"
    assert "<artifactId>kafka_2.13</artifactId>" in pom
    installer = (ROOT / "run-tests").read_text()
    assert "infra/kafka/pom.xml" in installer and "DASK_BLACKBOX__LOCAL__KAFKA_HOME" in installer


def test_ci_runs_exactly_readme_command_two():
    """CI runs README command 2 and nothing else; it installs what pip cannot."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith("#")]
    assert ci[-1] == "exec ./run-tests"
    readme = (ROOT / "README.md").read_text()
    assert "./run-tests" in readme
    installer = (ROOT / "run-tests").read_text()
    for needed in ("chromium", "openjdk-17-jre-headless", "maven", "sudo",
                   "pip install -q -e '.[test]'", "exec python -m pytest"):
        assert needed in installer, needed


def test_run_tests_builds_the_collector_the_export_tests_use():
    """README command 2 builds infra/otel (the OTLP receiver of the export tests) into
    the cache the tests look in, and says so in one line when Go is missing."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from otel_support import VERSION

    script = (ROOT / "run-tests").read_text()
    assert "infra/otel" in script and "otelcol-$OTELCOL_VERSION" in script
    assert 'die "Go is missing' in script
    main_go = (ROOT / "infra" / "otel" / "main.go").read_text()
    assert f'Version:     "{VERSION}"' in main_go
    go_mod = (ROOT / "infra" / "otel" / "go.mod").read_text()
    assert f"go.opentelemetry.io/collector/receiver/otlpreceiver v{VERSION}" in go_mod
    assert f"opentelemetry-collector-contrib/exporter/fileexporter v{VERSION}" in go_mod
    # every collector module of the 0.x line at the one release
    zero = re.findall(r"go\.opentelemetry\.io/collector/\S+ (v0\.\d+\.\d+)", go_mod)
    assert zero and set(zero) == {f"v{VERSION}"}


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
    for package in ("dask_blackbox", "producers", "stream_processors", "sinks", "exporters",
                    "read", "cli"):
        assert f"COPY {package} " in text


def test_grafana_provisions_the_dashboards_as_code(compose):
    """The grafana service mounts the provisioning files and the dashboards that
    infra/grafana/dashboards.py builds, for the ClickHouse service's database."""
    grafana = compose["services"]["grafana"]
    assert "build" not in grafana and grafana["image"].startswith("grafana/grafana-oss:")
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    provisioning = (COMPOSE.parent / mounts["/etc/grafana/provisioning"]).resolve()
    boards = (COMPOSE.parent / mounts["/var/lib/grafana/dashboards/dask-blackbox"]).resolve()
    assert provisioning == ROOT / "infra" / "grafana" / "provisioning"
    assert boards == ROOT / "infra" / "grafana" / "dashboards"
    assert "grafana-clickhouse-datasource" in grafana["environment"]["GF_INSTALL_PLUGINS"]
    [source] = yaml.safe_load((provisioning / "datasources" / "clickhouse.yaml").read_text())["datasources"]
    assert source["type"] == "grafana-clickhouse-datasource"
    assert source["jsonData"]["host"] == "clickhouse" and source["jsonData"]["port"] == 8123
    # the read-only user of infra/clickhouse/users.d (tests/test_tenants_grafana.py), not the sink's
    clickhouse = compose["services"]["clickhouse"]
    assert source["jsonData"]["username"] == "grafana" != clickhouse["environment"]["CLICKHOUSE_USER"]
    assert source["secureJsonData"]["password"] == "$CLICKHOUSE_GRAFANA_PASSWORD"
    assert "CLICKHOUSE_PASSWORD" not in grafana["environment"]
    assert ("./clickhouse/users.d/grafana.xml:/etc/clickhouse-server/users.d/grafana.xml:ro"
            in clickhouse["volumes"])
    [provider] = yaml.safe_load((provisioning / "dashboards" / "blackbox.yaml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/dask-blackbox"
    import json

    uids = {json.loads(p.read_text())["uid"] for p in boards.glob("*.json")}
    assert uids == {"blackbox-clusters", "blackbox-run", "blackbox-failures", "blackbox-pipeline"}


def test_every_benchmark_is_in_the_suite_and_has_a_quick_size():
    """bench/ is a suite: every script that prints a figure runs under run_all.py,
    with --quick; the others are its helper modules."""
    bench = ROOT / "bench"
    helpers = {"run_all.py", "report.py", "local_broker.py", "process_cluster.py"}
    scripts = {p.name for p in bench.glob("*.py")} - helpers
    run_all = (bench / "run_all.py").read_text()
    listed = set(re.findall(r'"([a-z_]+\.py)"', run_all[run_all.index("BENCHMARKS"):]))
    assert scripts == listed
    for name in scripts:
        text = (bench / name).read_text()
        assert "--quick" in text and "report(" in text, name
    assert (bench / "RESULTS.md").exists()
