"""``dask-blackbox why`` and ``dask-blackbox logs``.

``why [--cluster X] [--key K] [--since T] [--until T]`` prints one verdict per worker
death and per KilledWorker (:func:`dask_blackbox.read.diagnosis.diagnose`), then the
evidence of each, in at most 120 columns; ``--format json`` prints the diagnosis as
it is.

``logs [--cluster X] [--worker W] [--level L] [--logger N] [--text T] [--since T]
[--until T] [--limit N] [--follow]`` is the central log search
(:func:`dask_blackbox.read.queries.logs`): one record per line, oldest first;
``--follow`` keeps printing records as the sink loads them (polling; records that
arrive late are printed once, when they arrive), until Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import textwrap
import time

from dask_blackbox.cli.formatting import FORMATS, print_result, terminal_width, working

#: How often ``logs --follow`` asks for new records, and how far back it looks again
#: for records the sink loaded late (seconds).
FOLLOW_INTERVAL = 1.0
FOLLOW_OVERLAP = 30.0


def add_commands(subparsers, parents: list[argparse.ArgumentParser], fmt, filters) -> None:
    """Register ``why`` and ``logs``."""
    why = subparsers.add_parser(
        "why", parents=[*parents, fmt, filters],
        help="why each worker died and each task failed with KilledWorker, with the evidence")
    why.add_argument("--key", help="only the KilledWorker of this task (and its deaths)")
    logs = subparsers.add_parser(
        "logs", parents=[*parents, fmt, filters],
        help="search the log records of every scheduler, worker and nanny")
    logs.add_argument("--worker", help="a worker's address: its records and its nanny's "
                                       "('scheduler': the scheduler's)")
    logs.add_argument("--level", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                      help="this level and above")
    logs.add_argument("--logger", help="this logger and its children (e.g. distributed.worker, myjob)")
    logs.add_argument("--text", help="a case-insensitive substring of the message")
    logs.add_argument("--limit", type=int, default=200, help="the newest N records (default 200)")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing new records until Ctrl-C")


# ----------------------------------------------------------------------- why


def why(args: argparse.Namespace) -> int:
    from dask_blackbox.read import diagnosis, queries

    from dask_blackbox.cli.runs import latest_run

    with working("dask-blackbox why: reading ClickHouse"):
        backend = queries.connect()
        latest_run(backend, args)
        result = diagnosis.diagnose(backend, args.cluster, args.key, args.since, args.until)
        names = queries.cluster_names(backend)
    if args.format == "json":
        import json

        print(json.dumps(result, indent=1, default=str))
        return 0
    if args.format not in ("table", "wide"):
        print_result((["cluster_id", "worker", "ts", "cause", "confidence", "summary"],
                      [(d["cluster_id"], d["worker"], d["ts"], d["cause"], d["confidence"],
                        d["summary"]) for d in result["deaths"] + result["expected"]]), args.format)
        return 0
    width = terminal_width() if args.format == "table" else 10_000
    print(render_why(result, names, width))
    return 0


def _t(ts: float | None, day: bool = False) -> str:
    if ts is None:
        return ""
    t = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f" if day else "%H:%M:%S.%f")[:-3]


def _bytes(n: int | None) -> str:
    from dask_blackbox.cli.formatting import nbytes

    return nbytes(n) if n else "?"


def render_why(result: dict, names: dict[str, str], width: int = 120) -> str:
    """The text of ``why``: a header per cluster, one line per verdict, then the
    evidence of each, every line at most ``width`` columns."""
    out: list[str] = []

    def say(text: str, indent: int = 0, hang: int = 2) -> None:
        out.extend(textwrap.wrap(text, width, initial_indent=" " * indent,
                                 subsequent_indent=" " * (indent + hang), break_long_words=True,
                                 break_on_hyphens=False) or [""])

    deaths, expected, killed = result["deaths"], result["expected"], result["killed_workers"]
    clusters = sorted({d["cluster_id"] for d in deaths + expected} | {k["cluster_id"] for k in killed})
    if not clusters:
        return "No worker left and no task failed with KilledWorker in what was recorded."
    for cluster_id in clusters:
        mine = [d for d in deaths if d["cluster_id"] == cluster_id]
        fine = [d for d in expected if d["cluster_id"] == cluster_id]
        kws = [k for k in killed if k["cluster_id"] == cluster_id]
        name = names.get(cluster_id, "")
        say(f"Cluster {name} ({cluster_id}): {len(mine)} worker death(s), {len(kws)} KilledWorker, "
            f"{len(fine)} worker(s) left as expected")
        out.append("")
        n = 0
        for k in kws:
            n += 1
            suspect = k["suspects"][0] if k["suspects"] else None
            who = f"suspect {suspect['key']} (prefix {suspect['prefix']})" if suspect else "no suspect"
            say(f"[{n}] {_t(k['ts'])}  KilledWorker {k['key']}: {who} [{k['confidence']}]: "
                f"{k['summary']}", 0, 6)
        for d in mine:
            n += 1
            say(f"[{n}] {_t(d['ts'])}  {d['worker']}  {d['label']} [{d['confidence']}]: "
                f"{d['explanation']}", 0, 6)
            _say_last_stack(say, d)
        if fine:
            out.append("left as expected:")
            for d in fine:
                say(f"{_t(d['ts'])}  {d['worker']}  {d['explanation']}", 4, 6)
        out.append("")
        n = 0
        for k in kws:
            n += 1
            say(f"[{n}] KilledWorker {k['key']} at {_t(k['ts'], day=True)} UTC "
                f"({len(k['deaths'])} death(s) counted against it):")
            for i, d in enumerate(k["deaths"]):
                peak = k["peak_memory"][i] if i < len(k["peak_memory"]) else None
                say(f"{_t(d['ts'])}  {d['worker']}  {d['label']} [{d['confidence']}], peak memory "
                    f"{_bytes(peak)} of {_bytes(d.get('memory_limit'))}: {d['explanation']}", 4, 4)
            for s in k["suspects"]:
                held = ", ".join(f"{v:.1f}s" for v in s["processing_s"])
                result_size = (f"largest result of its prefix {_bytes(s['prefix_result_nbytes_max'])} "
                               f"({s['prefix_results']} results)" if s["prefix_results"]
                               else "no task of its prefix finished")
                say(f"suspect {s['key']} (prefix {s['prefix']}): processing at {s['chain_deaths']} of "
                    f"{len(k['deaths'])} of these deaths ({s['cluster_deaths']} deaths in the run), "
                    f"for {held} before each; {result_size}", 4, 4)
            if k["prefixes"]:
                say(f"prefixes processing at every one of these deaths: {', '.join(k['prefixes'])}", 4, 4)
            out.append("")
        for d in mine:
            n += 1
            say(f"[{n}] {d['worker']} died at {_t(d['ts'], day=True)} UTC: {d['label']} "
                f"[{d['confidence']}]")
            if d["tasks"]:
                say("running: " + ", ".join(f"{t['key']} (then {t['finish']})" for t in d["tasks"]), 4, 4)
            _say_held_memory(say, d)
            for e in d["timeline"]:
                say(f"{_t(e['ts'])}  {e['source']:<12} {e['text']}", 4, 26)
            out.append("")
    return "\n".join(line.rstrip() for line in out).rstrip() + "\n"


def _say_held_memory(say, death: dict) -> None:
    """What the dying worker held (one or two lines, :mod:`dask_blackbox.read.held_memory`)."""
    for line in (death.get("held_memory") or {}).get("lines", []):
        say(line, 4, 4)


def _say_last_stack(say, death: dict) -> None:
    """Below a death's verdict: what it was doing (read/last_stacks.py)."""
    last = death.get("last_stack")
    if last:
        say(last["line"], 6, 4)


# ---------------------------------------------------------------------- logs


def _line(row: dict, width: int) -> str:
    who = row["worker"] or row["source"]
    if row["source"] == "nanny":
        who += " (nanny)"
    task = f" [{row['key']}]" if row["key"] else ""
    text = row["message"] + (f"\n{row['exc_text']}" if row["exc_text"] else "")
    ts = row["ts"]
    stamp = ts.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if isinstance(ts, datetime.datetime) else _t(ts, True)
    first = f"{stamp} {row['level']:<8} {who} {row['logger']}{task}: "
    lines = text.splitlines() or [""]
    wrapped = textwrap.wrap(first + lines[0], width, subsequent_indent=" " * 4) or [first]
    for more in lines[1:]:
        wrapped += textwrap.wrap(more, width, initial_indent=" " * 4, subsequent_indent=" " * 4) or [""]
    return "\n".join(wrapped)


def logs(args: argparse.Namespace) -> int:
    from dask_blackbox.read import queries

    if args.limit < 1:
        print("dask-blackbox: error: --limit must be a positive number of records", file=sys.stderr)
        return 2
    backend = queries.connect()
    from dask_blackbox.cli.runs import latest_run

    latest_run(backend, args)
    filters = {"cluster": args.cluster, "worker": args.worker, "level": args.level,
               "logger": args.logger, "text": args.text}
    with working("dask-blackbox logs: reading ClickHouse"):
        columns, rows = queries.logs(backend, since=args.since, until=args.until, limit=args.limit,
                                     **filters)
    if args.format != "table" and not args.follow:
        print_result((columns, rows), args.format)
        return 0
    width = terminal_width()
    seen: set[tuple] = set()
    last = None

    def show(batch):
        nonlocal last
        for row in batch:
            r = dict(zip(columns, row))
            identity = (r["cluster_id"], r["producer_id"], r["seq"], r["idx"])
            if identity in seen:
                continue
            seen.add(identity)
            print(_line(r, width), flush=True)
            ts = r["ts"].timestamp() if isinstance(r["ts"], datetime.datetime) else float(r["ts"])
            last = ts if last is None else max(last, ts)

    show(rows)
    if not args.follow:
        if not rows:
            print("(no log record matches)")
        return 0
    start = time.time() - FOLLOW_OVERLAP if last is None else last
    try:
        while True:
            time.sleep(FOLLOW_INTERVAL)
            since = (last if last is not None else start) - FOLLOW_OVERLAP
            columns, rows = queries.logs(backend, since=since, until=args.until, limit=10_000, **filters)
            show(rows)
            if len(seen) > 200_000:  # forget what is far behind the overlap window
                seen.clear()
                seen.update((r[columns.index("cluster_id")], r[columns.index("producer_id")],
                             r[columns.index("seq")], r[columns.index("idx")]) for r in rows)
    except KeyboardInterrupt:
        return 0


__all__ = ["add_commands", "why", "logs", "render_why", "FORMATS"]
