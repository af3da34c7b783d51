"""The sink layer (write side only): Kafka (raw and derived topics) into ClickHouse.

Modules, in the order data flows:

- :mod:`sinks.settings` -- every sink setting, resolved and validated once
  (:class:`~dask_blackbox.sinks.settings.SinkSettings`) and passed down;
- :mod:`sinks.consumer` -- the Kafka consumer group that batches and commits;
- :mod:`sinks.batch` -- a batch of messages converted to rows, and dead letters for
  whatever cannot be (nothing a message holds stops the sink);
- :mod:`sinks.events` and :mod:`sinks.records` -- one converter per signal (raw event
  kinds; derived records), each checked against :mod:`dask_blackbox.contract` at import;
- :mod:`sinks.typed` (msgspec field kinds, the typed envelope decoder: the fast path)
  and :mod:`sinks.checks` (one value at a time: the checked path; the depth bound before decoding is the ground's :mod:`dask_blackbox.nesting`);
- :mod:`sinks.tables` -- the tables' columns and rows held as columns;
- :mod:`sinks.arrow` -- columns to Arrow, typed after the ClickHouse columns;
- :mod:`sinks.loader` -- insert a batch exactly once (journal, crash recovery,
  retries, dead letters for rejected rows);
- :mod:`sinks.schema` and ``sinks/sql/*.sql`` -- the schema and its migrations;
- :mod:`dask_blackbox.sinks.service` -- the process (``serve``), run by
  ``dask-blackbox sink`` (:mod:`dask_blackbox.cli.sink`, with the read side's query
  server beside it while the sink owns a chDB directory).

Only the ground (:mod:`dask_blackbox.contract`, :mod:`dask_blackbox.config`,
:mod:`dask_blackbox.kafka`, :mod:`dask_blackbox.clickhouse`, :mod:`dask_blackbox.runfiles`)
is imported from outside this package.
"""
