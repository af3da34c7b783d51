"""Settings written as ``DASK_*`` environment variables (what the tests and benchmarks
hand their faust workers, sinks and CLI runs) are what a child process reads back with
``dask.config``: names, nesting and values, text that looks like a literal included."""

import pathlib

import dask.config

from dask_blackbox.config import DEFAULTS
from dask_blackbox.testing.settings import dask_env

SETTINGS = {
    "blackbox": {
        "kafka": {"bootstrap-servers": "127.0.0.1:9092", "partitions": 2,
                  "idempotence": True, "topic-prefix": "t0a1b2c3"},
        "processors": {"session-timeout": "6s", "snapshot-interval": "300ms"},
        "data-dir": "/tmp/bb data/x",
        "alerts": {"rules": [{"name": "erred", "min": 1.5}, "other"]},
    },
    "blackbox.sink.group-id": "sink-t0a1b2c3",
    "blackbox.sink.metrics-port": 0,
    "blackbox.exporter.otlp-endpoint": None,
    "blackbox.query.socket-timeout": 0.25,
    "optimization.fuse.active": False,
    # Text dask.config would read back as something else unless quoted.
    "blackbox.odd.looks-true": "true",
    "blackbox.odd.looks-none": "None",
    "blackbox.odd.looks-int": "2",
    "blackbox.odd.looks-list": "[1]",
    "blackbox.odd.empty": "",
}


def _dotted(settings, within=""):
    for key, value in settings.items():
        key = f"{within}.{key}" if within else key
        if isinstance(value, dict):
            yield from _dotted(value, key)
        else:
            yield key, value


def _read_back(env: dict[str, str]) -> dict:
    """The configuration a child process starts with: the product's defaults, then
    its environment."""
    config: dict = {}
    dask.config.refresh(config=config, defaults=[DEFAULTS], paths=[], env=env)
    return config


def test_names_are_dask_prefixed_upper_case_and_nested_with_double_underscores():
    env = dask_env({"blackbox.kafka.bootstrap-servers": "b:1",
                    "blackbox": {"processors": {"app-id": "a"}}})
    assert env == {"DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS": "b:1",
                   "DASK_BLACKBOX__PROCESSORS__APP_ID": "a"}


def test_a_nested_dict_round_trips_through_collect_env():
    env = dask_env(SETTINGS)
    assert all(type(v) is str for v in env.values())
    config = _read_back(env)
    for key, value in _dotted(SETTINGS):
        got = dask.config.get(key, config=config)
        assert got == value and type(got) is type(value), (key, env, got)


def test_plain_values_are_written_as_plain_text():
    env = dask_env({"a.port": 0, "a.on": True, "a.off": None, "a.path": "/x/y",
                    "a.wait": "200ms", "a.dir": pathlib.Path("/d/e")})
    assert env == {"DASK_A__PORT": "0", "DASK_A__ON": "True", "DASK_A__OFF": "None",
                   "DASK_A__PATH": "/x/y", "DASK_A__WAIT": "200ms", "DASK_A__DIR": "/d/e"}
    assert dask.config.collect_env(env) == {
        "a": {"port": 0, "on": True, "off": None, "path": "/x/y", "wait": "200ms",
              "dir": "/d/e"}}
