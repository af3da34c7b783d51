"""``dask-blackbox profile``: where the workers' threads spent their time, from Dask's
own statistical profiler as it was recorded (:mod:`dask_blackbox.read.profiles`),
for a cluster alive or gone.

``profile --cluster NAME_OR_ID [--prefix P] [--worker W] [--since T] [--until T]
[--limit N]`` prints the profile's top frames: samples of their own (the innermost
frame), samples in all (on the stack) and their shares, in at most 120 columns;
``-o FILE`` writes the whole profile instead, in the format the file's suffix names:
folded stacks (``.folded``, ``.txt``), speedscope (``.speedscope.json``) or pprof
(``.pb.gz``, for ``go tool pprof``). A cluster (prefix, worker) with no recorded
profile is said in one line, with exit status 1.
"""

from __future__ import annotations

import argparse
import sys

from dask_blackbox.cli.formatting import print_result, printable, working


def add_commands(subparsers, parents: list[argparse.ArgumentParser], fmt, filters) -> None:
    """Register ``profile``."""
    p = subparsers.add_parser(
        "profile", parents=[*parents, fmt, filters],
        help="the workers' own profile (Dask's sampling profiler): top frames, or a "
             "flame graph file (folded, speedscope, pprof)")
    p.add_argument("--prefix", help="one task prefix (default: every task, the workers' whole profile)")
    p.add_argument("--worker", help="one worker's address (default: every worker)")
    p.add_argument("--limit", type=int, default=20, help="frames in the table (default 20)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the profile to FILE: .folded or .txt (folded stacks), "
                        ".speedscope.json or .pb.gz (pprof)")


def profile(args: argparse.Namespace) -> int:
    from dask_blackbox.cli.runs import latest_run
    from dask_blackbox.read import backends, profiles

    if args.output:
        try:
            profiles.format_of(args.output)
        except ValueError as e:
            print(f"dask-blackbox: error: {printable(str(e))}", file=sys.stderr)
            return 2
    with working("dask-blackbox profile: reading ClickHouse"):
        backend = backends.connect()
        try:
            latest_run(backend, args)
            found = profiles.load(backend, args.cluster, args.prefix, args.worker,
                                  args.since, args.until)
        except profiles.NoProfiles as e:
            print(f"dask-blackbox: {printable(str(e))}", file=sys.stderr)
            return 1
        finally:
            backend.close()
    if args.output:
        fmt = profiles.write(found, args.output)
        print(f"{printable(args.output)}: {fmt}, {len(found.stacks)} stacks, "
              f"{found.samples} samples of {printable(found.title)}")
        return 0
    if args.format in ("table", "wide"):
        print(printable(f"{found.title}: {found.samples} samples"))
    print_result(profiles.top(found, args.limit), args.format)
    return 0
