"""The sink layer: Kafka (raw and derived topics) into ClickHouse, and reading it back.

Modules, in the order data flows:

- :mod:`sinks.rows` -- decode and check messages, turn them into rows per table;
- :mod:`sinks.loader` -- insert a batch exactly once (journal, crash recovery,
  retries, dead letters for rejected rows);
- :mod:`sinks.consumer` -- the Kafka consumer group that batches and commits;
- :mod:`sinks.schema` and ``sinks/sql/*.sql`` -- the schema and its migrations;
- :mod:`sinks.clickhouse` -- opening chDB or a ClickHouse server, error classes;
- :mod:`dask_blackbox.sinks.service` -- ``dask-blackbox sink``, the process (``main``);
- :mod:`dask_blackbox.read.server` -- read-only SQL over loopback HTTP while the sink owns a
  chDB directory;
- :mod:`dask_blackbox.read.queries` -- ``connect()`` and the named queries (story, spans, ...).

Only :mod:`dask_blackbox.contract`, :mod:`dask_blackbox.config` and
:mod:`dask_blackbox.kafka` are imported from outside this package.
"""
