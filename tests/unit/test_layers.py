"""The house reads as the data flows: ground -> stages -> read side -> deployment -> roof.

Parses every module's imports (including those inside functions) and checks:

- the ground (``dask_blackbox/``: contract, config, Kafka and ClickHouse helpers, run
  files) imports no other part of the project;
- the stages (``producers/``, ``stream_processors/``, ``sinks/``, ``exporters/``,
  ``alerts/``) import the ground and themselves, never each other, the read side or
  the roof;
- the read side (``read/``) imports the ground and itself only; within it, the views
  (``read/views/``) read as a page is made: the scope of a page, what a page's views
  share, the registry of views, the views (a view may draw on another, a worker's
  page's on the Run page's), then the rendering and the package;
- the local deployment (``deploy/``: brokers, supervisor) imports the ground and the
  stages, never the read side or the roof;
- nothing imports the roof (``cli/``) but the roof;
- nothing imports the test support (``dask_blackbox/testing/``) but itself (and the
  tests and benchmarks), and no benchmark reaches into ``tests/``;
- no module imports, directly or through others, itself (no import circle).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: folder -> (import name, floor)
PARTS = {
    "dask_blackbox": ("dask_blackbox", 0),
    "producers": ("dask_blackbox.producers", 1),
    "stream_processors": ("dask_blackbox.stream_processors", 1),
    "sinks": ("dask_blackbox.sinks", 1),
    "alerts": ("dask_blackbox.alerts", 1),
    "exporters": ("dask_blackbox.exporters", 1),
    "read": ("dask_blackbox.read", 2),
    "deploy": ("dask_blackbox.deploy", 3),
    "cli": ("dask_blackbox.cli", 4),
    "dask_blackbox/testing": ("dask_blackbox.testing", 5),
}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, (package, _) in PARTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def part_of(module: str) -> str:
    """The folder (part) a dotted module name belongs to."""
    best = "dask_blackbox"
    for folder, (package, _) in PARTS.items():
        if (module == package or module.startswith(package + ".")) and len(package) > len(PARTS[best][0]):
            best = folder
    return best


def imports(module: str, path: pathlib.Path, known: dict) -> set[str]:
    """The project modules ``module`` imports (resolved to known module names)."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith("dask_blackbox"):
                out.add(name)
    # importing a package runs its parents' __init__: not an arrow worth drawing
    return {m for m in out if not module.startswith(m + ".")}


#: read/views/ module -> floor (every other module of read/views/ is a view: VIEW_FLOOR)
VIEWS_FLOORS = {"scope": 0, "page": 1, "registry": 2, "render": 4, "": 5}
VIEW_FLOOR = 3
VIEWS = "dask_blackbox.read.views"


def views_floor(module: str) -> int | None:
    """The floor of a module of read/views/ (None for a module outside it)."""
    if module != VIEWS and not module.startswith(VIEWS + "."):
        return None
    return VIEWS_FLOORS.get(module[len(VIEWS) + 1:], VIEW_FLOOR)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_every_part_is_found():
    parts = {part_of(m) for m in modules()}
    assert parts == set(PARTS)


def test_no_import_runs_against_the_flow():
    wrong = []
    for module, targets in graph().items():
        src = part_of(module)
        for target in targets:
            dst = part_of(target)
            if dst == src:
                continue
            floor_src, floor_dst = PARTS[src][1], PARTS[dst][1]
            if (floor_dst >= floor_src or (src == "read" and floor_dst != 0)
                    or (src == "deploy" and dst == "read")):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the flow:\n" + "\n".join(sorted(wrong))


def test_the_views_import_down_their_floors():
    """A module of read/views/ imports those of a lower floor, a view module also other
    views (never a view the rendering or the package, nor the scope what a page
    shares)."""
    wrong = []
    for module, targets in graph().items():
        src = views_floor(module)
        if src is None:
            continue
        for target in targets:
            dst = views_floor(target)
            if dst is None or dst < src or dst == src == VIEW_FLOOR:
                continue
            wrong.append(f"{module} (floor {src}) -> {target} (floor {dst})")
    assert not wrong, "imports up the views' floors:\n" + "\n".join(sorted(wrong))


def test_no_benchmark_reaches_into_the_tests():
    """bench/ imports the test support as ``dask_blackbox.testing``: never ``tests``
    by name, nor by putting ``tests/`` on ``sys.path``."""
    wrong = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.name}: import {n}" for n in names if n.partition(".")[0] == "tests"]
            if (isinstance(node, ast.Call) and "sys.path" in ast.unparse(node.func)
                    and "tests" in ast.unparse(node)):
                wrong.append(f"{path.name}: {ast.unparse(node)}")
    assert not wrong, "benchmarks reaching into tests/:\n" + "\n".join(wrong)


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}
    circles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_a_users_own_modules_named_like_our_stages_do_not_shadow_them(tmp_path):
    """Why everything installs under ``dask_blackbox.*``: the stage folders have
    generic names that a user's project may well use itself (a Kafka project with its
    own ``producers`` package, a ``sinks.py``...). Python puts the working directory
    first on ``sys.path`` for ``python -c``/``-m`` and for ``dask worker --preload``
    run from a project checkout, so top-level ``producers`` would have been theirs."""
    import subprocess
    import sys

    for name in ("producers", "sinks", "stream_processors", "exporters", "read", "deploy", "cli"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user s own module')\n")
    def run(code):
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    ours = run("import dask_blackbox.producers, dask_blackbox.sinks.service, "
               "dask_blackbox.stream_processors.cluster, dask_blackbox.exporters.traces, "
               "dask_blackbox.read.queries, dask_blackbox.deploy.supervisor, "
               "dask_blackbox.cli.main")
    assert ours.returncode == 0, ours.stderr
    # the bare names are the user's, as they should be
    theirs = run("import producers")
    assert theirs.returncode != 0 and "the user s own module" in theirs.stderr
