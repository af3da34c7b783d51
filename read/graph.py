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
from typing import Any

from dask_blackbox.read import aggregates
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table as _t

#: Nodes drawn one by one at most; above, the graph is drawn by group, then prefix.
MAX_NODES = 1500
#: How it ended, for the state colouring: Dask's task graph states.
STATES = ("waiting", "queued", "no-worker", "processing", "memory", "released", "erred", "forgotten")


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
    _, counted = backend.query(
        "SELECT uniqExact(key), uniqExact(task_group), uniqExact(prefix), uniqExact(stimulus_id), "
        f"countIf(n_dependencies > length(dependencies)) FROM {g} WHERE {where}", p)
    n_keys, n_groups, n_prefixes, n_submissions, capped = counted[0] if counted else (0, 0, 0, 0, 0)
    out: dict[str, Any] = {"n_tasks": int(n_keys), "n_submissions": int(n_submissions),
                           "capped": int(capped), "critical": critical_keys is not None,
                           "max_nodes": max_nodes, "n_groups": int(n_groups)}
    if not n_keys:
        out.update(level="task", nodes=[], edges=[], n_edges=0, outside=0)
        return out
    # Edges between tasks, counted once, whatever the level drawn.
    _, counted = backend.query(
        "WITH nodes AS (SELECT DISTINCT cityHash64(key) AS kh FROM " + g + " WHERE " + where + ") "
        "SELECT countIf(dh IN nodes), countIf(dh NOT IN nodes) FROM ("
        f" SELECT DISTINCT cityHash64(key) AS kh, cityHash64(arrayJoin(dependencies)) AS dh FROM {g} "
        f" WHERE {where})", p)
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
    _, rows = backend.query(
        "SELECT key, argMax(prefix, ts), argMax(task_group, ts), argMax(dependencies, ts) "
        f"FROM {g} WHERE {where} GROUP BY key ORDER BY key", p)
    keys = [r[0] for r in rows]
    _, ran = backend.query(
        "SELECT key, argMaxIf(worker, ts, finish IN ('memory', 'erred')), groupArray(finish), "
        "sum(arraySum(arrayMap((a, b, e) -> if(a = 'compute', toFloat64(e) - toFloat64(b), 0.), "
        "startstops.action, startstops.start, startstops.stop))) "
        f"FROM (SELECT key, worker, finish, startstops, ts FROM {t} WHERE cluster_id = {{c:String}} "
        "AND key IN {keys:Array(String)} AND source = 'scheduler' ORDER BY ts, seq, idx) GROUP BY key",
        {"c": scope.cluster_id, "keys": keys})
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
    _, rows = backend.query(
        f"SELECT {by}, any(prefix), uniqExact(key), min(key) FROM {g} WHERE {where} "
        f"GROUP BY {by} ORDER BY {by}", p)
    _, links = backend.query(
        f"WITH owner AS (SELECT cityHash64(key) AS kh, any({by}) AS node FROM {g} WHERE {where} GROUP BY kh) "
        "SELECT o.node, e.node, count() FROM ("
        f" SELECT DISTINCT cityHash64(key) AS kh, cityHash64(arrayJoin(dependencies)) AS dh, {by} AS node "
        f" FROM {g} WHERE {where}) AS e INNER JOIN owner AS o ON o.kh = e.dh "
        "WHERE o.node != e.node GROUP BY o.node, e.node", p)
    # Per node: the worker that ran most of its tasks, a tie going to the first
    # address (the same run always draws the same colours), and its finishes.
    _, workers = backend.query(
        "SELECT node, argMin(worker, (-toInt64(n), worker)), sum(erred), sum(memory) FROM ("
        f" SELECT {by} AS node, worker, count() AS n, countIf(finish = 'erred') AS erred, "
        f" countIf(finish = 'memory') AS memory FROM {t} WHERE cluster_id = {{c:String}} "
        " AND source = 'scheduler' AND finish IN ('memory', 'erred')"
        + (" AND span_id IN {ids:Array(String)}" if "ids" in p else "")
        + " GROUP BY node, worker) GROUP BY node", {k: v for k, v in p.items() if k in ("c", "ids")})
    ran = {node: (worker, erred, memory) for node, worker, erred, memory in workers}
    compute: dict[str, float] = defaultdict(float)
    for grp in aggregates.groups(backend, scope.cluster_id, scope.span_ids):
        compute[grp["group"] if by == "task_group" else grp["prefix"]] += grp["compute_s"]
    critical: Counter = Counter()
    if critical_keys:
        _, owners = backend.query(
            f"SELECT {by} FROM {g} WHERE {where} AND key IN {{ck:Array(String)}}",
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
