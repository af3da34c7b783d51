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
- no module imports, directly or through others, itself (no import circle). Importing
  ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first, so an import of a
  module is one of its parent packages too (but for the packages the importing module
  itself lives in: they are run before it), and a package's ``__init__`` that imports
  its modules by name (``importlib.import_module(f"{__name__}.{name}")``) imports
  every one of them. An import under ``if TYPE_CHECKING:`` runs nothing: it is an
  arrow to the module it names, not to that module's packages.
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


def modules(root: pathlib.Path = ROOT, parts: dict = PARTS) -> dict[str, pathlib.Path]:
    """Dotted module name -> its file, for every module of the ``parts`` under ``root``
    (a package by its ``__init__.py``)."""
    found = {}
    for folder, (package, _) in parts.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
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


def parents(module: str) -> list[str]:
    """The packages a dotted module name lives in, outermost first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports(module: str, path: pathlib.Path, known: dict) -> set[str]:
    """The project modules ``module`` imports (resolved to known module names), with
    the packages each of them lives in (their ``__init__`` runs first)."""
    out = set()
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test).endswith("TYPE_CHECKING")
                   for stmt in node.body for sub in ast.walk(stmt)}
    for node in ast.walk(tree):
        names = []
        if is_package and _imports_its_modules(node):
            names = [m for m in known if m.rpartition(".")[0] == module]
        elif isinstance(node, ast.Import):
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
                if id(node) not in typing_only:
                    out.update(p for p in parents(name) if p in known)
    # the packages ``module`` lives in ran before it: not an arrow worth drawing
    return out - set(parents(module)) - {module}


def _imports_its_modules(node: ast.AST) -> bool:
    """Whether ``node`` is a package's ``importlib.import_module(f"{__name__}.…")``."""
    if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
            and node.args and isinstance(node.args[0], ast.JoinedStr)):
        return False
    head = node.args[0].values[0]
    return isinstance(head, ast.FormattedValue) and ast.unparse(head.value) == "__name__"


#: read/views/ module -> floor (every other module of read/views/ is a view: VIEW_FLOOR)
VIEWS_FLOORS = {"scope": 0, "page": 1, "registry": 2, "render": 4, "": 5}
VIEW_FLOOR = 3
VIEWS = "dask_blackbox.read.views"


def views_floor(module: str) -> int | None:
    """The floor of a module of read/views/ (None for a module outside it)."""
    if module != VIEWS and not module.startswith(VIEWS + "."):
        return None
    return VIEWS_FLOORS.get(module[len(VIEWS) + 1:], VIEW_FLOOR)


def graph(known: dict[str, pathlib.Path] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports (:func:`imports`), of ``known`` (the
    project's :func:`modules` by default)."""
    known = modules() if known is None else known
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


def circles(g: dict[str, set[str]]) -> list[str]:
    """The import circles of the graph ``g``, each as ``a -> b -> ... -> a``."""
    state: dict[str, int] = {}
    found = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                found.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_circle():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(found)


def _planted(root: pathlib.Path, files: dict[str, str]) -> dict[str, set[str]]:
    """The graph of a tree of two packages ``a`` and ``b`` (``dask_blackbox.a``,
    ``dask_blackbox.b``) holding ``files`` (path -> source)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return graph(modules(root, {"a": ("dask_blackbox.a", 1), "b": ("dask_blackbox.b", 1)}))


def test_a_circle_through_a_packages_init_is_found(tmp_path):
    """``a/__init__`` imports ``a.x``, ``a.x`` imports ``b.y``, and ``b.y`` imports
    ``a.z``: importing ``a.z`` runs ``a/__init__`` first, a circle although no module
    names ``a`` itself; nor is one when ``a/__init__`` imports its modules by name."""
    files = {"a/__init__.py": "from dask_blackbox.a import x\n",
             "a/x.py": "from dask_blackbox.b import y\n", "a/z.py": "",
             "b/__init__.py": "", "b/y.py": "import dask_blackbox.a.z\n"}
    found = circles(_planted(tmp_path / "static", files))
    assert found == ["dask_blackbox.a -> dask_blackbox.a.x -> dask_blackbox.b.y -> dask_blackbox.a"]

    files["a/__init__.py"] = ("import importlib, pkgutil\n"
                              "for m in pkgutil.iter_modules(__path__):\n"
                              "    importlib.import_module(f\"{__name__}.{m.name}\")\n")
    found = circles(_planted(tmp_path / "by_name", files))
    assert found == ["dask_blackbox.a -> dask_blackbox.a.x -> dask_blackbox.b.y -> dask_blackbox.a"]


def test_a_package_importing_its_own_modules_is_no_circle(tmp_path):
    """A module of ``a`` runs after ``a/__init__``: its imports of ``a``'s other
    modules (and of ``a`` itself) close no circle with the ``__init__`` importing
    it."""
    g = _planted(tmp_path, {"a/__init__.py": "from dask_blackbox.a import x\n",
                            "a/x.py": "from dask_blackbox.a import z\nimport dask_blackbox.a\n",
                            "a/z.py": "from dask_blackbox.b import y\n",
                            "b/__init__.py": "", "b/y.py": ""})
    assert g["dask_blackbox.a.z"] == {"dask_blackbox.b", "dask_blackbox.b.y"}
    assert not circles(g)


def test_an_import_for_the_type_checker_runs_no_package(tmp_path):
    """``b.y`` imports ``a.z`` only for the type checker: ``a/__init__`` does not run,
    no circle; ``b.y`` still names ``a.z``."""
    g = _planted(tmp_path, {"a/__init__.py": "from dask_blackbox.a import x\n",
                            "a/x.py": "from dask_blackbox.b import y\n", "a/z.py": "",
                            "b/__init__.py": "",
                            "b/y.py": "from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from dask_blackbox.a.z import Z\n"})
    assert g["dask_blackbox.b.y"] == {"dask_blackbox.a.z"}
    assert not circles(g)


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
