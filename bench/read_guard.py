"""What the read-only guard costs per query (dask_blackbox.read.guard).

On a fresh in-process chDB directory with a 1,000-row table, one parametrised
SELECT is run ``--rounds`` times (default 1500) three ways, interleaved A/B/C so
that the machine's noise hits all three alike:

- raw: the bare clickhouse-connect client (what the read side did before);
- guarded, first sight: a text the guard has not seen (ClickHouse parses it with
  ``formatQuery``, the canonical text is checked, then run under the read-only
  profile);
- guarded, cached: the same text again (the named queries' case: the check is
  remembered, only the read-only settings are added).

Prints the median of each, in milliseconds, and how many rounds it is from.

    python bench/read_guard.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import clickhouse_connect

from dask_blackbox.read import guard
from report import report

SQL = "SELECT a, s FROM bb.t WHERE a < {n:UInt32} ORDER BY a LIMIT 10"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--quick", action="store_true", help="200 rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 200
    client = clickhouse_connect.get_client(dsn=f"chdb://{tempfile.mkdtemp()}")
    client.command("CREATE DATABASE bb")
    client.command("CREATE TABLE bb.t (a Int32, s String) ENGINE = MergeTree ORDER BY a")
    client.command("INSERT INTO bb.t SELECT number, toString(number) FROM numbers(1000)")
    reader = guard.ReadOnlyClient(client)
    raw, first, cached = [], [], []
    for i in range(args.rounds):
        t = time.perf_counter()
        client.query(SQL, parameters={"n": 5})
        raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        reader.query(SQL + f" -- round {i}", {"n": 5})
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        reader.query(SQL, {"n": 5})
        cached.append(time.perf_counter() - t)
    client.close()

    def median_ms(xs):
        return statistics.median(xs) * 1e3

    print(f"read guard, {args.rounds} interleaved rounds, median per query: "
          f"raw {median_ms(raw):.3f} ms, guarded first sight {median_ms(first):.3f} ms, "
          f"guarded cached {median_ms(cached):.3f} ms")
    report(f"read guard, a new statement text, added per query (median of {args.rounds})",
           round(median_ms(first) - median_ms(raw), 3), "ms", None)
    report(f"read guard, a statement seen before, added per query (median of {args.rounds})",
           round(median_ms(cached) - median_ms(raw), 3), "ms", None)


if __name__ == "__main__":
    main()
