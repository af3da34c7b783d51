"""dask-blackbox: a flight recorder for Dask clusters.

This package holds what every layer shares: the wire contract (:mod:`.contract`),
configuration (:mod:`.config`) and Kafka connection settings (:mod:`.kafka`), plus
the ``dask-blackbox`` command line. The layers themselves are the top-level packages
``producers`` (inside Dask), ``stream_processors`` (faust) and ``sinks`` (ClickHouse).
"""

from dask_blackbox import config as _config  # noqa: F401  registers the YAML defaults

__version__ = "0.1.0"
