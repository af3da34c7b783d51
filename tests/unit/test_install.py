"""Install by role: pyproject.toml's default dependencies are the light set a Dask node
needs to record, every extra is what the CLI says it is (``cli.main.EXTRAS``), and
``complete`` (which the test extra holds) is all of them. A fresh venv holding only
the light set records a cluster: tests/integration/test_packaging.py."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

from dask_blackbox.cli.main import COMMAND_EXTRAS, EXTRAS, build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LIGHT_SET = {"distributed", "aiokafka", "cramjam", "orjson", "msgspec", "py-spy"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return _normal(re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0])


def _own_extras(requirement: str) -> list[str]:
    """The extras a ``dask-blackbox[...]`` requirement names (none for another project's)."""
    if _name(requirement) != "dask-blackbox":
        return []
    return [e.strip() for e in requirement.partition("[")[2].partition("]")[0].split(",")]


def _distributions(extra: str) -> set[str]:
    """Every distribution an extra installs, its references to other extras followed."""
    out = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        own = _own_extras(requirement)
        out |= set().union(*map(_distributions, own)) if own else {_name(requirement)}
    return out


def test_the_default_install_is_the_light_set_with_floors():
    dependencies = PROJECT["dependencies"]
    assert {_name(r) for r in dependencies} == LIGHT_SET
    assert all(">=" in r for r in dependencies), dependencies


def test_each_extra_installs_the_modules_the_cli_checks_for():
    provided = importlib.metadata.packages_distributions()  # module -> distributions
    extras = set(PROJECT["optional-dependencies"])
    assert set(EXTRAS) == extras - {"complete", "test"}
    for extra, modules in EXTRAS.items():
        wanted = _distributions(extra)
        for module in modules:
            top = module.partition(".")[0]
            assert {_normal(d) for d in provided.get(top, ())} & wanted, (
                f"{module} (extra {extra!r}) is installed by none of {sorted(wanted)}")
        # and each distribution of the extra is there for a module the CLI checks for
        checked = {_normal(d) for m in modules for d in provided.get(m.partition(".")[0], ())}
        assert wanted - checked <= {"dask", "dask-blackbox"} | (
            _distributions("pipeline") if extra == "demo" else set()), (extra, wanted - checked)


def test_complete_is_every_extra_and_the_tests_install_it():
    extras = set(EXTRAS)
    assert _own_extras(PROJECT["optional-dependencies"]["complete"][0]) and set(
        _own_extras(PROJECT["optional-dependencies"]["complete"][0])) == extras
    assert any(_own_extras(r) == ["complete"] for r in PROJECT["optional-dependencies"]["test"])


def test_every_command_names_extras_that_exist():
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert set(COMMAND_EXTRAS) <= commands
    assert {e for extras in COMMAND_EXTRAS.values() for e in extras} <= set(EXTRAS)
