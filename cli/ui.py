"""``dask-blackbox ui`` and ``dask-blackbox report``.

``ui [--host 127.0.0.1] [--port 8787] [--trusted-host NAME ...]`` serves the web UI
and its JSON API (:mod:`dask_blackbox.read.web`) over the configured ClickHouse: the
running sink's query server when a local sink owns the chDB directory, else the DSN
directly. It binds to loopback by default; the UI has no authentication, so bind
elsewhere only behind something that has. It answers only requests whose ``Host``
is a loopback name, ``--host`` or a ``--trusted-host`` (the name a proxy in front of
it forwards): a 400 otherwise.

``report --cluster NAME_OR_ID [--span NAME] [--since T] [--until T] -o FILE.html``
writes the Run page as one self-contained HTML file
(:func:`dask_blackbox.read.report.write_report`).
"""

from __future__ import annotations

import argparse
import sys


def _time(text: str):
    from dask_blackbox.read.api import BadParameter, parse_time

    try:
        return parse_time(text, "time")
    except BadParameter:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration like 2h / 30m / 7d, an ISO date-time, "
            "nor seconds since the epoch") from None


def add_commands(subparsers, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``ui`` and ``report`` (``parents``: the connection flags)."""
    ui = subparsers.add_parser("ui", parents=parents,
                               help="web UI and JSON API over the recorded history")
    ui.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=8787, help="port (default 8787; 0: any free port)")
    ui.add_argument("--trusted-host", dest="trusted_hosts", metavar="NAME", action="append",
                    default=[], help="a Host name to answer besides the loopback names and "
                                     "--host (e.g. the name a proxy forwards); repeatable")

    report = subparsers.add_parser("report", parents=parents,
                                   help="write a run's panels as one self-contained HTML file")
    report.add_argument("--cluster", required=True, help="cluster name or id")
    report.add_argument("--span", help="only this span (a tag or a path like etl/load) and its sub-spans")
    report.add_argument("--since", type=_time, help="e.g. 2h or 2026-11-01T00:00")
    report.add_argument("--until", type=_time)
    report.add_argument("-o", "--output", required=True, metavar="FILE.html")


def run(args: argparse.Namespace) -> int:
    from dask_blackbox.read import panels

    try:
        if args.command == "ui":
            return _ui(args)
        return _report(args)
    except panels.NotFound as e:
        print(f"dask-blackbox: error: {e}", file=sys.stderr)
        return 1


def _report(args: argparse.Namespace) -> int:
    import time
    from concurrent.futures import ThreadPoolExecutor

    from dask_blackbox.read import views  # without Bokeh

    started = time.perf_counter()
    # ClickHouse answers in a thread (its queries release the GIL) while Bokeh loads
    # and each view is drawn as its data comes.
    arrivals = views.Arrivals()
    with ThreadPoolExecutor(1, thread_name_prefix="report-read") as pool:
        reading = pool.submit(views.read_run, args.cluster, args.span, args.since, args.until,
                              arrivals=arrivals)
        from dask_blackbox.read import report

        written = report.write_run(args.output, arrivals.data, started, arrivals)
        reading.result()
    print(f"dask-blackbox: wrote {written['path']} ({written['bytes'] / 1e6:.1f} MB) "
          f"in {written['seconds']:.1f}s")
    return 0


def _ui(args: argparse.Namespace) -> int:
    from dask_blackbox.read import backends, web

    first = [backends.connect()]  # fail now, with the usual one-line error, not on a request

    def connect():
        return first.pop() if first else backends.connect()

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"dask-blackbox: warning: the UI has no authentication and binds to {args.host}",
              file=sys.stderr)

    def ready(url: str) -> None:
        print(f"dask-blackbox: UI at {url} (Ctrl-C stops)", flush=True)

    web.serve(args.host, args.port, connect=connect, ready=ready, trusted=args.trusted_hosts)
    return 0
