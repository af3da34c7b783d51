"""``dask-blackbox sink``: the sink as a foreground process (the production service).

It runs :func:`dask_blackbox.sinks.service.serve` with the read side's query server
as its companion, so that while the sink owns a chDB directory other processes can
still read it (see :mod:`dask_blackbox.read.server`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from dask_blackbox.read.server import QueryServer
from dask_blackbox.sinks import service


def main(argv: list[str] | None = None) -> int:
    """Run the sink until SIGTERM/SIGINT; 0 after a clean stop, 1 on a start-up error
    (printed as one line on stderr)."""
    parser = argparse.ArgumentParser(
        prog="dask-blackbox sink",
        description="Load the blackbox Kafka topics into ClickHouse until stopped. "
                    "Configured by the blackbox.* Dask config (blackbox.sink.*, "
                    "blackbox.clickhouse.*, blackbox.kafka.*).",
    )
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(service.serve(companion=QueryServer))
    except service.START_ERRORS as e:
        print(f"dask-blackbox sink: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
