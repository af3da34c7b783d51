"""``dask-blackbox exporter``: the continuous OpenTelemetry exporter as a foreground
process (the production service; :mod:`dask_blackbox.exporters.service`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from dask_blackbox.exporters import service


def main(argv: list[str] | None = None) -> int:
    """Run the exporter until SIGTERM/SIGINT; 0 after a clean stop, 1 on a start-up
    error (one line on stderr)."""
    argparse.ArgumentParser(
        prog="dask-blackbox exporter",
        description="Export every recorded run as an OpenTelemetry trace over OTLP as it "
                    "happens. Configured by blackbox.exporter.* (endpoint, protocol, ...).",
    ).parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        asyncio.run(service.serve())
    except service.START_ERRORS as e:
        print(f"dask-blackbox exporter: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
