"""What ``--cluster NAME`` means on the command line: the latest run of that name.

Several runs (clusters) may share a name. Every command that reads one run's records
(``story``, ``spans``, ``prefixes``, ``metrics``, ``failures``, ``why``, ``logs``,
``critical-path``) reads the latest run of the name given, as the web UI does, and
says so on stderr when there were others; ``--all-runs`` reads every run of the name,
and a run's id names that run. ``clusters`` lists every run of the name, and
``compare`` compares them: both are about the runs of a name.
"""

from __future__ import annotations

import argparse
import datetime
import sys


def latest_run(backend, args: argparse.Namespace) -> None:
    """Narrow ``args.cluster`` to the latest run of that name (unless ``--all-runs``),
    with a line on stderr naming the run and how to read the others."""
    from dask_blackbox.read import panels

    name = getattr(args, "cluster", None)
    if not name or getattr(args, "all_runs", False):
        return
    try:
        cluster_id, _, others = panels.latest_run(backend, name)
    except panels.NotFound:
        return  # the command itself says the name is unknown
    if not others or cluster_id == name:
        return
    args.cluster = cluster_id
    print(f"dask-blackbox: --cluster {name}: the latest of its {len(others) + 1} runs, "
          f"{cluster_id} (last seen {_utc(panels.last_seen(backend, cluster_id))}); "
          "--all-runs for every run, or a run's id for another", file=sys.stderr)


def _utc(ts: float | None) -> str:
    if not ts:
        return "?"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
