"""dask-blackbox: a flight recorder for Dask clusters.

The modules of this folder are the ground every other part stands on, and import
nothing else of the project: the typed wire contract (:mod:`.contract`), configuration
(:mod:`.config`), Kafka and ClickHouse connection helpers (:mod:`.kafka`,
:mod:`.clickhouse`), the run files through which local processes find each other
(:mod:`.runfiles`), the nesting bound of JSON messages (:mod:`.nesting`) and the
garbage collector's settings of the project's own processes (:mod:`.collector`).

Above it, installed under this name from their own folders (see pyproject.toml):
the stages :mod:`dask_blackbox.producers` (inside Dask),
:mod:`dask_blackbox.stream_processors` (faust) and :mod:`dask_blackbox.sinks`
(ClickHouse), which never import each other; the read side :mod:`dask_blackbox.read`
(queries, query server, web UI, reports); and the roof :mod:`dask_blackbox.cli`
(the ``dask-blackbox`` command, demo, local supervisor).
"""

from dask_blackbox import config as _config  # noqa: F401  registers the YAML defaults

__version__ = "0.1.0"
