"""``dask-blackbox critical-path`` and ``dask-blackbox compare``: why a run was slow.

``critical-path --cluster NAME_OR_ID [--span S] [--since T] [--until T] [--limit N]``
prints the chain of task actions that decided the run's (or span's) wall time
(:mod:`dask_blackbox.read.critical_path`): a heading with the window and what the
path spent its time on, then one row per link (the ``--limit`` longest in the table,
in path order; all of them in json/csv/wide).

``compare [SPAN] [--cluster NAME] [--since T] [--until T]`` compares the latest run of
the span (or, with only ``--cluster``, or a name no span has but a cluster does, the
whole runs of that cluster name) with the one before it (:mod:`dask_blackbox.read.regressions`): the verdicts first, in words,
then the changes per prefix and action, then the frames of the culprit prefix whose
own time grew (:mod:`dask_blackbox.read.function_changes`, at most five, each with its
verdict; one line when no profiles were recorded), then, for a span, its numbers in every run
side by side. Durations, bytes and shares always carry their units. With ``--alert``,
a regression is delivered to the ``regression`` rules of ``blackbox.alerts.rules``
(:mod:`dask_blackbox.alerts.regression`), one line per rule on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import textwrap

from dask_blackbox.cli.formatting import print_result, render, seconds, short_id, terminal_width, working


def add_commands(subparsers, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``critical-path`` (``parents``: connection, format and filter flags)."""
    p = subparsers.add_parser("critical-path", parents=parents,
                              help="the chain of tasks that decided a run's (or span's) wall time")
    p.add_argument("--span", help="only this span (a tag or a path like etl/load) and its sub-spans")
    p.add_argument("--limit", type=int, default=30,
                   help="links shown in the table (the longest, in path order; default 30)")


# ---------------------------------------------------------------- critical path


def critical_path(args: argparse.Namespace, backend) -> int:
    """The command, reading through ``backend``; its exit code."""
    from dask_blackbox.read import panels

    if not args.cluster:
        print("dask-blackbox: error: critical-path needs --cluster NAME_OR_ID", file=sys.stderr)
        return 1
    if args.limit < 1:
        print(f"dask-blackbox: error: --limit must be a positive integer, not {args.limit}",
              file=sys.stderr)
        return 1
    with working("dask-blackbox critical-path: reading ClickHouse"):
        try:
            scope = panels.resolve(backend, args.cluster, args.span, args.since, args.until)
        except panels.NotFound as e:
            print(f"dask-blackbox: error: {e}", file=sys.stderr)
            return 1
        data = panels.critical_path(backend, scope)
    if not data["available"]:
        print(f"dask-blackbox: {data['reason']}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(data, indent=1, default=str))
        return 0
    columns, rows = link_rows(data)
    if args.format in ("wide", "csv"):
        print(render(columns, rows, args.format))
        return 0
    width = terminal_width()
    print(_wrap(heading(data, scope.cluster_name), width))
    kept = set(range(len(rows)))
    if len(rows) > args.limit:
        kept = set(sorted(kept, key=lambda i: -data["links"][i]["seconds"])[:args.limit])
    shown = [rows[i] for i in sorted(kept)]
    keep = [j for j, c in enumerate(columns)
            if not c.endswith("_s") or c == "link_s" or any(r[j] for r in shown)]
    print(render([columns[j] for j in keep], [[r[j] for j in keep] for r in shown], "table", width))
    if len(shown) < len(rows):
        hidden = sum(link["seconds"] for i, link in enumerate(data["links"]) if i not in kept)
        print(f"({len(rows) - len(shown)} shorter links not shown, {seconds(hidden)} in all; "
              "--limit N shows more, --format json all)")
    return 0


def _time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def heading(data: dict, cluster_name: str) -> list[str]:
    """What the path explains, in words: the window, its parts, the notes."""
    what = f"span {data['span']!r}" if data["span"] else "the run"
    basis = {"graph": "from the recorded graph",
             "actions": "from the actions alone (the graph was not recorded)",
             "graph and actions": "from the recorded graph and, where it was not recorded, the actions"}
    wall = data["wall"] or 0.0
    parts = ", ".join(f"{p} {seconds(v)} ({v / wall:.0%})" if wall else f"{p} {seconds(v)}"
                      for p, v in sorted(data["parts"].items(), key=lambda kv: -kv[1]) if v > 0)
    lines = [
        f"Critical path of {what} in {cluster_name} ({short_id(data['cluster_id'])}): "
        f"{len(data['links'])} links, {basis.get(data['basis'], data['basis'])}",
        f"window {_time(data['t0'])} .. {_time(data['t1'])} UTC, {seconds(wall)}; "
        f"the links add up to {seconds(sum(data['parts'].values()))}: {parts}",
    ]
    if data.get("waited_on"):
        lines.append(f"the first link waited on {data['waited_on']!r}, outside the path")
    lines += [f"note: {n}" for n in data["notes"]]
    return lines


def link_rows(data: dict) -> tuple[list[str], list[list]]:
    """One row per link: position, key, prefix, worker, how its predecessor was
    found, the link's seconds and its parts' (None where a part is zero)."""
    parts = list(data["parts"])
    columns = ["#", "key", "prefix", "worker", "found_by", "link_s"] + [f"{p}_s" for p in parts]
    rows = []
    for i, link in enumerate(data["links"], 1):
        worker = link["worker"].split("://", 1)[-1]
        rows.append([i, link["key"], link["prefix"], worker, link["found_by"], link["seconds"]]
                    + [link["parts"][p] or None for p in parts])
    return columns, rows


def _wrap(lines: list[str], width: int) -> str:
    return "\n".join(textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False)
                     for line in lines)


# ------------------------------------------------------------------- compare


def compare(args: argparse.Namespace, backend) -> int:
    """The command, reading through ``backend``; its exit code."""
    from dask_blackbox.read import panels

    span = args.span_name
    if not span and not args.cluster:
        print("dask-blackbox: error: compare needs a span name, or --cluster NAME to compare "
              "the whole runs of that cluster name", file=sys.stderr)
        return 1
    with working("dask-blackbox compare: reading ClickHouse"):
        try:
            data = panels.compare(backend, span, args.cluster, args.since, args.until)
        except panels.NotFound as e:
            print(f"dask-blackbox: error: {e}", file=sys.stderr)
            return 1
    verdict = data["verdict"]
    span = data["span"]  # None when the name given is a cluster's: its whole runs
    if not span and "error" in verdict:
        print(f"dask-blackbox: {verdict['error']}", file=sys.stderr)
        return 1
    if "table" in verdict:  # read from the tasks themselves: there without the processors
        runs = (["metric"] + verdict["runs"], verdict["table"])
    else:
        runs = (["metric"] + data["runs"], [[m, *v] for m, v in data["metrics"].items()])
    code = _alert(verdict, span) if getattr(args, "alert", False) else 0
    if args.format == "json":
        print(json.dumps({"verdict": verdict, "runs": [dict(zip(runs[0], r)) for r in runs[1]]},
                         indent=1, default=str))
        return code
    width = terminal_width()
    title = "== verdict" if args.format in ("table", "wide") else "# verdict"
    print(title)
    print(_wrap([verdict["error"]] if "error" in verdict else verdict["sentences"], width))
    print()
    if "error" not in verdict:
        print_result({"changes per prefix and action (baseline -> candidate)":
                      change_rows(verdict)}, args.format)
    functions = verdict.get("functions")
    if functions:
        _print_functions(functions, args.format, width)
    if runs[1]:
        print_result({"the runs side by side, oldest first": runs}, args.format)
    return code


def _print_functions(functions: dict, fmt: str, width: int) -> None:
    """Under the prefix's changes: the frames of the culprit prefix whose own time
    grew, each with its verdict; one line when there are none to compare."""
    if functions["missing"]:
        print(_wrap([functions["missing"]], width))
        print()
        return
    head, *_ = functions["sentences"]
    title = f"frames of prefix {functions['prefix']!r} whose own time grew (baseline -> candidate)"
    print(_wrap([head], width))
    print_result({title: function_rows(functions)}, fmt)


def _short_location(location: str) -> str:
    """``file:line`` with at most the file's folder before its name (the whole path is
    in the JSON): ``integration/test_x.py:12``."""
    path, _, line = location.rpartition(":")
    return "/".join(path.split("/")[-2:]) + ":" + line


def function_rows(functions: dict) -> tuple[list[str], list[list]]:
    """The frames whose time grew (at most five), each value with its unit (their
    shares of the prefix's samples in the JSON and on the Compare page)."""
    columns = ["function", "location", "verdict", "own time", "change [interval]", "p"]
    rows = []

    def pct(ratio: float) -> str:
        return f"{ratio - 1:+.0%}" if abs(ratio - 1) >= 0.1 else f"{ratio - 1:+.1%}"

    for c in functions["grown"]:
        change = ""
        if c["ratio"] == c["ratio"]:
            change = pct(c["ratio"])
            if c["low"] == c["low"]:
                change += f" [{pct(c['low'])}, {pct(c['high'])}]"
        rows.append([
            c["function"], _short_location(c["location"]), c["verdict"],
            f"{seconds(c['seconds_base'])} → {seconds(c['seconds_new'])}",
            change, "" if c["p_value"] != c["p_value"] else f"{c['p_value']:.2g}",
        ])
    return columns, rows


def _alert(verdict: dict, span: str | None) -> int:
    """Notify the regression rules of a regression (one line each on stderr); 1 if
    one could not be delivered or the rules are invalid."""
    from dask_blackbox import config
    from dask_blackbox.alerts import regression
    from dask_blackbox.alerts.settings import AlertSettings

    if verdict.get("verdict") != "regression":
        return 0
    try:
        settings = AlertSettings.from_config()
    except config.ConfigError as e:
        print(f"dask-blackbox: error: {e}", file=sys.stderr)
        return 1
    pending = regression.incidents(verdict, span, settings.rules)
    if not pending:
        print("dask-blackbox: a regression, but no 'regression' rule in blackbox.alerts.rules "
              "matches it: nobody was notified", file=sys.stderr)
        return 0
    code = 0
    for done in regression.deliver_all(pending, settings):
        if done.outcome.delivered:
            print(f"alert {done.rule.name}: delivered to {done.rule.target}", file=sys.stderr)
        else:
            code = 1
            print(f"dask-blackbox: error: alert {done.rule.name}: not delivered to "
                  f"{done.rule.target} after {done.outcome.attempts} attempt(s): "
                  f"{done.outcome.reason}", file=sys.stderr)
    return code


def change_rows(verdict: dict) -> tuple[list[str], list[list]]:
    """The changes per prefix and action, each value with its unit."""
    columns = ["prefix", "action", "verdict", "median per task", "change [interval]", "p",
               "band", "total"]
    rows = []

    def num(x):
        return None if x is None or x != x else x

    def pair(a, b) -> str:
        return " → ".join("-" if num(v) is None else seconds(v) for v in (a, b))

    def pct(ratio: float) -> str:
        return f"{ratio - 1:+.0%}" if abs(ratio - 1) >= 0.1 else f"{ratio - 1:+.1%}"

    for c in verdict["changes"]:
        change = ""
        if num(c["ratio"]) is not None:
            change = pct(c["ratio"])
            if num(c["low"]) is not None:
                change += f" [{pct(c['low'])}, {pct(c['high'])}]"
        rows.append([
            c["prefix"], c["action"], c["verdict"], pair(c["median_base"], c["median_new"]),
            change, "" if num(c["p_value"]) is None else f"{c['p_value']:.2g}",
            "" if num(c["band"]) is None else f"±{c['band']:.0%}",
            pair(c["total_base"], c["total_new"]),
        ])
    return columns, rows
