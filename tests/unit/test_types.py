"""The ground (``dask_blackbox/*.py``), the producers, the local deployment, the
exporters and the CLI's tables type-check: mypy, as pyproject.toml's ``[tool.mypy]``
configures it, finds no error (in them, nor in what they import).

mypy reads the modules under their import names (``dask_blackbox.producers.*``), laid
out as pyproject.toml's package-dir maps them: a tree of links to the checkout's
folders, kept with mypy's cache under ``~/.cache/dask-blackbox/mypy/`` so that a
second run only reads what changed. An editable install's import hook is invisible
to mypy, hence the tree.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: What is checked: the ground's modules and these packages and modules.
PACKAGES = ("dask_blackbox.producers", "dask_blackbox.deploy", "dask_blackbox.exporters")
MODULES = ("dask_blackbox.cli.formatting",)


def mapped_tree() -> pathlib.Path:
    """A directory holding ``dask_blackbox/`` as installed: the ground's modules and
    each package of pyproject.toml's package-dir, as links into the checkout."""
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    tree = (cache / "dask-blackbox" / "mypy"
            / hashlib.sha1(str(ROOT).encode()).hexdigest()[:12] / "tree")
    package = tree / "dask_blackbox"
    package.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (ROOT / "dask_blackbox").glob("*.py")}
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in folders.items():
        if name != "dask_blackbox":
            wanted[name.rpartition(".")[2]] = ROOT / folder
    for link in package.iterdir():
        if link.name not in wanted or link.resolve() != wanted[link.name]:
            link.unlink()
    for name, target in wanted.items():
        if not (package / name).is_symlink():
            (package / name).symlink_to(target)
    return tree


def test_the_ground_and_the_producers_type_check():
    tree = mapped_tree()
    ground = sorted(p.stem for p in (ROOT / "dask_blackbox").glob("*.py"))
    modules = [f"dask_blackbox.{m}" if m != "__init__" else "dask_blackbox" for m in ground]
    modules += MODULES
    args = [a for m in modules for a in ("-m", m)] + [a for p in PACKAGES for a in ("-p", p)]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tree.parent / "cache"), *args],
        cwd=tree, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": "", "MYPYPATH": str(tree)})
    assert out.returncode == 0, out.stdout + out.stderr
