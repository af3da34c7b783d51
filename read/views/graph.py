"""The executed task graph of a run or span, as the dask-log-server prototype draws it:
the graph the client submitted (``graph_tasks``), each node coloured by a choice of
duration, worker, prefix, state or critical-path membership.

Nodes and edges. The nodes are the distinct keys the scope's submissions recorded (a
span scope: the tasks submitted in its spans; a window: the submissions made in it),
the edges every recorded dependency between two of them (``dependency -> dependent``,
once). A dependency list the producer capped (``n_dependencies`` above the
recorded list) is counted in ``capped``; a dependency outside the nodes (data of an
earlier submission outside the scope, or never recorded) in ``outside``.

Levels. Above :data:`MAX_NODES` keys single tasks cannot be read: the graph is drawn
by task group, as Dask's Groups view does (a node per group sized by its tasks, an
edge between two groups when a task of one depends on a task of the other, weighted
by how many such dependencies), and above :data:`MAX_NODES` groups by prefix.
``level`` says which: "task", "group" or "prefix".

What a node is coloured by, per level (every choice is computed, the page switches
between them without asking again):

``duration``   seconds of compute (a group or prefix: per task, on average);
``worker``     the worker that ran it (last put it in memory or erred; a group or
               prefix: the worker that ran most of its tasks, the first address of
               those that ran as many);
``prefix``     its prefix;
``state``      how it ended: erred, memory (computed), or the last state it reached
               (released, waiting, processing, ... when it never finished); a group or
               prefix: erred if any of its tasks erred, else memory if any finished;
``critical``   on the scope's critical path (:mod:`.critical_path`, when it was
               computed for the page; a group or prefix: holding a link of it).

Layout (:func:`layout`): layered like Dask's graph layout, left to right in
dependency order: a node's column is one more than its deepest dependency's (roots
in column 0), and within a column nodes are ordered by the mean row of their
dependencies (then by name) and placed at that mean row, or just below the node
before: most edges stay short and uncrossed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from dask_blackbox.read import aggregates, palette
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t
from dask_blackbox.read.templates import fmt_s
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, number, register

if TYPE_CHECKING:
    from dask_blackbox.read.figures import Figures

#: Nodes drawn one by one at most; above, the graph is drawn by group, then prefix.
MAX_NODES = 1500
#: How it ended, for the state colouring: Dask's task graph states.
STATES = ("waiting", "queued", "no-worker", "processing", "memory", "released", "erred", "forgotten")


#: What the graph holds (``{where}``: the scope, in ``{graph_tasks}``): its keys, groups,
#: prefixes, submissions, and the tasks with more dependencies than were recorded.
COUNTS = ("SELECT uniqExact(key), uniqExact(task_group), uniqExact(prefix), uniqExact(stimulus_id), "
          "countIf(n_dependencies > length(dependencies)) FROM {graph_tasks} WHERE {where}")

#: The dependencies between the graph's tasks, counted once: those inside it, those
#: on a task outside it.
EDGES = ("WITH nodes AS (SELECT DISTINCT cityHash64(key) AS kh FROM {graph_tasks} WHERE {where}) "
         "SELECT countIf(dh IN nodes), countIf(dh NOT IN nodes) FROM ("
         " SELECT DISTINCT cityHash64(key) AS kh, cityHash64(arrayJoin(dependencies)) AS dh "
         "FROM {graph_tasks}  WHERE {where})")

#: Each task of the graph: its prefix, group and dependencies as last submitted.
TASKS = ("SELECT key, argMax(prefix, ts), argMax(task_group, ts), argMax(dependencies, ts) "
         "FROM {graph_tasks} WHERE {where} GROUP BY key ORDER BY key")

#: Each of the tasks ``keys``: the worker it last finished on, its scheduler
#: transitions' finishes in order and its compute seconds.
RAN = ("SELECT key, argMaxIf(worker, ts, finish IN ('memory', 'erred')), groupArray(finish), "
       "sum(arraySum(arrayMap((a, b, e) -> if(a = 'compute', toFloat64(e) - toFloat64(b), 0.), "
       "startstops.action, startstops.start, startstops.stop))) "
       "FROM (SELECT key, worker, finish, startstops, ts FROM {transitions} WHERE cluster_id = {{c:String}} "
       "AND key IN {{keys:Array(String)}} AND source = 'scheduler' ORDER BY ts, seq, idx) GROUP BY key")

#: Per ``{by}`` (task_group or prefix): a prefix, its tasks and its first key.
GROUPS = ("SELECT {by}, any(prefix), uniqExact(key), min(key) FROM {graph_tasks} WHERE {where} "
          "GROUP BY {by} ORDER BY {by}")

#: The dependencies between the ``{by}`` nodes: (node depended on, node, how many).
LINKS = ("WITH owner AS (SELECT cityHash64(key) AS kh, any({by}) AS node FROM {graph_tasks} "
         "WHERE {where} GROUP BY kh) "
         "SELECT o.node, e.node, count() FROM ("
         " SELECT DISTINCT cityHash64(key) AS kh, cityHash64(arrayJoin(dependencies)) AS dh, {by} AS node "
         " FROM {graph_tasks} WHERE {where}) AS e INNER JOIN owner AS o ON o.kh = e.dh "
         "WHERE o.node != e.node GROUP BY o.node, e.node")

#: Per ``{by}`` node: the worker that ran most of its tasks, a tie going to the first
#: address (the same run always draws the same colours), and its finishes into
#: erred and memory (``{in_span}``: the span tree's condition, if any).
NODE_WORKERS = ("SELECT node, argMin(worker, (-toInt64(n), worker)), sum(erred), sum(memory) FROM ("
                " SELECT {by} AS node, worker, count() AS n, countIf(finish = 'erred') AS erred, "
                " countIf(finish = 'memory') AS memory FROM {transitions} WHERE cluster_id = {{c:String}} "
                " AND source = 'scheduler' AND finish IN ('memory', 'erred')"
                "{in_span} GROUP BY node, worker) GROUP BY node")

#: The ``{by}`` node of each of the tasks ``ck`` (those on the critical path).
CRITICAL_NODES = "SELECT {by} FROM {graph_tasks} WHERE {where} AND key IN {{ck:Array(String)}}"


def data(ctx: Context) -> dict:
    max_nodes = number(ctx.params.get("max_nodes"), MAX_NODES)
    return {"graph": graph(ctx.backend, ctx.scope, ctx.critical_keys(), max_nodes)}


def _scope_where(scope, p: dict) -> str:
    where = "cluster_id = {c:String}"
    p["c"] = scope.cluster_id
    if scope.span_ids is not None:
        where += " AND span_id IN {ids:Array(String)}"
        p["ids"] = list(scope.span_ids)
    if scope.since is not None or scope.until is not None:
        where += (" AND ts >= toDateTime64({t0:Float64}, 6, 'UTC') "
                  "AND ts <= toDateTime64({t1:Float64}, 6, 'UTC')")
        p.update(t0=scope.t0, t1=scope.t1)
    return where


def graph(backend: Backend, scope, critical_keys: set[str] | None = None,
          max_nodes: int = MAX_NODES) -> dict:
    """The scope's executed graph (see the module docstring): ``level``, ``nodes``
    (``id``, ``label``, ``prefix``, ``tasks``, ``duration``, ``worker``, ``state``,
    ``critical``, ``key`` (a key to open: the task's, or a group's first), ``x``,
    ``y``), ``edges`` (``source``, ``target``, ``weight``), ``n_tasks``, ``n_edges``
    (between tasks, whatever the level), ``capped``, ``outside``,
    ``n_submissions``, ``critical`` (whether the critical path is known)."""
    p: dict[str, Any] = {}
    where = _scope_where(scope, p)
    g = _t(backend, "graph_tasks")
    _, counted = backend.query(COUNTS.format(graph_tasks=g, where=where), p)
    n_keys, n_groups, n_prefixes, n_submissions, capped = counted[0] if counted else (0, 0, 0, 0, 0)
    out: dict[str, Any] = {"n_tasks": int(n_keys), "n_submissions": int(n_submissions),
                           "capped": int(capped), "critical": critical_keys is not None,
                           "max_nodes": max_nodes, "n_groups": int(n_groups)}
    if not n_keys:
        out.update(level="task", nodes=[], edges=[], n_edges=0, outside=0)
        return out
    # Edges between tasks, counted once, whatever the level drawn.
    _, counted = backend.query(EDGES.format(graph_tasks=g, where=where), p)
    out["n_edges"], out["outside"] = (int(counted[0][0]), int(counted[0][1])) if counted else (0, 0)
    if n_keys <= max_nodes:
        nodes, edges = _tasks(backend, scope, where, p, critical_keys)
        out["level"] = "task"
    elif n_groups <= max_nodes:
        nodes, edges = _grouped(backend, scope, where, p, "task_group", critical_keys)
        out["level"] = "group"
    else:
        nodes, edges = _grouped(backend, scope, where, p, "prefix", critical_keys)
        out["level"] = "prefix"
    positions = layout([n["id"] for n in nodes], [(e["source"], e["target"]) for e in edges])
    for n in nodes:
        n["x"], n["y"] = positions[n["id"]]
    out.update(nodes=nodes, edges=edges)
    return out


def _outcome(finishes: list[str]) -> str:
    """How a task ended, from its scheduler transitions' finishes in order."""
    if not finishes:
        return "waiting"
    if finishes[-1] == "erred" or ("erred" in finishes and "memory" not in finishes):
        return "erred"
    if "memory" in finishes:
        return "memory"
    last = [f for f in finishes if f != "forgotten"]
    return last[-1] if last else "forgotten"


def _tasks(backend: Backend, scope, where: str, p: dict, critical_keys) -> tuple[list, list]:
    g, t = _t(backend, "graph_tasks"), _t(backend, "transitions")
    _, rows = backend.query(TASKS.format(graph_tasks=g, where=where), p)
    keys = [r[0] for r in rows]
    _, ran = backend.query(RAN.format(transitions=t), {"c": scope.cluster_id, "keys": keys})
    facts = {k: (w, _outcome(list(f)), d) for k, w, f, d in ran}
    nodes, edges, known = [], [], set(keys)
    for key, prefix, group, deps in rows:
        worker, state, duration = facts.get(key, ("", "waiting", 0.0))
        nodes.append({"id": key, "label": key, "key": key, "prefix": prefix, "group": group,
                      "tasks": 1, "duration": duration, "worker": worker, "state": state,
                      "critical": bool(critical_keys and key in critical_keys)})
        for dep in dict.fromkeys(deps):
            if dep in known:
                edges.append({"source": dep, "target": key, "weight": 1})
    return nodes, edges


def _grouped(backend: Backend, scope, where: str, p: dict, by: str,
             critical_keys) -> tuple[list, list]:
    """Nodes per ``by`` (task_group or prefix) with their tasks' facts, and the edges
    between them weighted by the dependencies between their tasks."""
    g, t = _t(backend, "graph_tasks"), _t(backend, "transitions")
    _, rows = backend.query(GROUPS.format(by=by, graph_tasks=g, where=where), p)
    _, links = backend.query(LINKS.format(by=by, graph_tasks=g, where=where), p)
    _, workers = backend.query(
        NODE_WORKERS.format(by=by, transitions=t,
                            in_span=" AND span_id IN {ids:Array(String)}" if "ids" in p else ""),
        {k: v for k, v in p.items() if k in ("c", "ids")})
    ran = {node: (worker, erred, memory) for node, worker, erred, memory in workers}
    compute: dict[str, float] = defaultdict(float)
    for grp in aggregates.groups(backend, scope.cluster_id, scope.span_ids):
        compute[grp["group"] if by == "task_group" else grp["prefix"]] += grp["compute_s"]
    critical: Counter = Counter()
    if critical_keys:
        _, owners = backend.query(CRITICAL_NODES.format(by=by, graph_tasks=g, where=where),
                                  {**p, "ck": sorted(critical_keys)})
        critical.update(r[0] for r in owners)
    nodes = []
    for node, prefix, n, first_key in rows:
        worker, erred, memory = ran.get(node, ("", 0, 0))
        nodes.append({"id": node, "label": f"{node} ({n:,})", "key": first_key, "prefix": prefix,
                      "group": node if by == "task_group" else "", "tasks": int(n),
                      "duration": compute.get(node, 0.0) / max(int(n), 1), "worker": worker,
                      "state": "erred" if erred else "memory" if memory else "waiting",
                      "critical": critical[node] > 0})
    edges = [{"source": a, "target": b, "weight": int(w)} for a, b, w in links]
    return nodes, edges


def layout(nodes: list[str], edges: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    """(column, row) of every node (see the module docstring). A cycle (which a
    recorded graph should not hold) is broken where it is met."""
    deps: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        deps[b].append(a)
    column: dict[str, int] = {}
    for start in nodes:
        if start in column:
            continue
        stack, visiting = [(start, iter(deps[start]))], {start}
        while stack:
            node, pending = stack[-1]
            for dep in pending:
                if dep not in column and dep not in visiting:
                    visiting.add(dep)
                    stack.append((dep, iter(deps[dep])))
                    break
            else:
                stack.pop()
                visiting.discard(node)
                column[node] = 1 + max((column[d] for d in deps[node] if d in column), default=-1)
    by_column: dict[int, list[str]] = defaultdict(list)
    for node in nodes:
        by_column[column[node]].append(node)
    row: dict[str, float] = {}
    out: dict[str, tuple[float, float]] = {}
    for c in sorted(by_column):
        def rank(node: str) -> tuple:
            placed = [row[d] for d in deps[node] if d in row]
            return (sum(placed) / len(placed) if placed else float("inf"), node)
        previous = -1.0
        for node in sorted(by_column[c], key=rank):
            target = rank(node)[0]
            y = max(previous + 1.0, target if target != float("inf") else previous + 1.0)
            row[node] = previous = y
            out[node] = (float(c), y)
    return out


#: The graph's colour choice: the nodes' fill colour field, and the legend shown.
_RECOLOR = """
renderer.glyph.fill_color = {field: "color_" + select.value};
for (const el of document.querySelectorAll(".graph-legend"))
    el.style.display = el.dataset.by === select.value ? "" : "none";
"""


def figures(figs: Figures, g: dict) -> dict[str, dict[str, str]]:
    """The task graph: nodes in layers, edges as lines; a choice of colouring (a
    Select, switched in the page without asking the server again); a click on a
    node opens its task page. Returns the legend of each colouring
    (``{by: {label: colour}}``)."""
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, CustomJS, HoverTool, Range1d, Select, TapTool
    from bokeh.plotting import figure

    from dask_blackbox.read.figures import OPEN_TASK, num

    nodes, edges = g["nodes"], g["edges"]
    if not nodes:
        return {}
    pos = {n["id"]: (n["x"], n["y"]) for n in nodes}
    prefix_colors = palette.distinct(dict.fromkeys(n["prefix"] for n in nodes))
    worker_colors = palette.categories(sorted({n["worker"] for n in nodes if n["worker"]}))
    durations = [n["duration"] for n in nodes]
    by = {
        "duration": palette.ramp(durations),
        "worker": [worker_colors.get(n["worker"], "#cccccc") for n in nodes],
        "prefix": [prefix_colors[n["prefix"]] for n in nodes],
        "state": [palette.GRAPH_STATES.get(n["state"], "#cccccc") for n in nodes],
        "critical": ["#d62728" if n["critical"] else "#dddddd" for n in nodes],
    }
    top = max(durations, default=0.0)
    legends = {
        "duration": {"0 s": palette.ramp([0.0, top])[0], fmt_s(top): palette.ramp([top, top])[0]},
        "worker": worker_colors, "prefix": prefix_colors,
        "state": {s: palette.GRAPH_STATES[s] for s in sorted({n["state"] for n in nodes})
                  if s in palette.GRAPH_STATES},
        "critical": {"on the critical path": "#d62728", "not on it": "#dddddd"}
        if g.get("critical") else {"critical path not computed": "#dddddd"},
    }
    most = max(n["tasks"] for n in nodes)
    size = [6 + 10 * min(1.0, (n["tasks"] / most) ** 0.5) if g["level"] != "task" else 9
            for n in nodes]
    node_source = ColumnDataSource(name="graph-nodes", data={
        "x": num(n["x"] for n in nodes), "y": num(n["y"] for n in nodes),
        "id": [n["id"] for n in nodes], "key": [n["key"] for n in nodes],
        "label": [n["label"] for n in nodes], "prefix": [n["prefix"] for n in nodes],
        "worker": [n["worker"] for n in nodes], "state": [n["state"] for n in nodes],
        "tasks": num(n["tasks"] for n in nodes), "size": num(size),
        "duration": [fmt_s(n["duration"]) for n in nodes],
        **{f"color_{k}": v for k, v in by.items()}})
    edge_source = ColumnDataSource(name="graph-edges", data={
        "xs": [num([pos[e["source"]][0], pos[e["target"]][0]]) for e in edges],
        "ys": [num([pos[e["source"]][1], pos[e["target"]][1]]) for e in edges],
        "source": [e["source"] for e in edges], "target": [e["target"] for e in edges],
        "weight": num(e["weight"] for e in edges)})
    width = max(x for x, _ in pos.values()) + 1
    height = max(y for _, y in pos.values()) + 1
    fig = figure(name="graph", height=int(min(900, max(260, 22 * height + 60))),
                 sizing_mode="stretch_width", tools="pan,wheel_zoom,box_zoom,reset",
                 toolbar_location="above", x_range=Range1d(-0.5, width - 0.5),
                 y_range=Range1d(height - 0.5, -0.5),
                 title=f"Task graph: {len(nodes):,} {g['level']} nodes, {len(edges):,} edges "
                       "(dependencies left, dependents right)")
    fig.multi_line(xs="xs", ys="ys", source=edge_source, line_color="#888888", line_alpha=0.5,
                   line_width=1)
    glyph = fig.scatter(x="x", y="y", size="size", source=node_source, fill_color="color_duration",
                        line_color="#444444", line_width=0.5)
    fig.add_tools(HoverTool(renderers=[glyph], tooltips=[
        (g["level"], "@label"), ("prefix", "@prefix"), ("worker", "@worker"), ("state", "@state"),
        ("compute" + (" per task" if g["level"] != "task" else ""), "@duration"),
        ("tasks", "@tasks{0,0}")]))
    if figs.web:
        fig.add_tools(TapTool(renderers=[glyph], callback=CustomJS(
            args={"source": node_source, "cluster": figs.scope.cluster_id}, code=OPEN_TASK)))
    fig.axis.visible = False
    fig.grid.grid_line_color = None
    select = Select(title="colour by", value="duration", options=list(by), name="graph-color",
                    width=200)
    select.js_on_change("value", CustomJS(args={"renderer": glyph, "select": select}, code=_RECOLOR))
    figs.figures["graph"] = column(select, fig, sizing_mode="stretch_width", name="graph")
    return legends


def draw(figs: Figures, data: dict, ctx: Context | None) -> dict:
    return {"graph_legends": figures(figs, data["graph"])}


VIEW = register(View("graph", "Task graph", data, "panel_graph.html", draw, order=70,
                     about="the executed task graph: nodes (by task, group or prefix) and edges, laid out",
                     params="&max_nodes="))
