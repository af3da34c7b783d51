"""The sink as a service: :func:`serve` runs it until SIGTERM or SIGINT.

Start-up, in order: resolve and validate the configuration once
(:meth:`~dask_blackbox.sinks.settings.SinkSettings.from_config`: data dir writable,
DSN well formed, every ``blackbox.sink.*`` value; what follows reads no configuration
but these settings), open ClickHouse (chDB dir writable, server reachable), apply
the schema migrations, start the *companion* the caller passed, if any (``dask-blackbox sink`` passes the read side's
query server for a ``chdb://`` DSN, which only this process may open), create the
Kafka topics, start the consumer, serve ``/metrics`` when ``blackbox.sink.metrics-port``
is set (:mod:`.metrics`). Then ``<data-dir>/sink.json`` is written (``{"pid",
"query_url", "dsn", "started_at", "token", "metrics_url", "loading"}``; mode 0600, the
token guards the query server; see :mod:`dask_blackbox.runfiles`) with ``loading``
false: queries are served. Ready means loading: once the consumer group has given the
sink its partitions and they are prepared (a crash repaired, :mod:`.consumer`),
sink.json says ``loading: true`` and one line ``sink ready ...`` goes to stdout.

SIGTERM or SIGINT stops it cleanly: a batch being inserted is finished and committed,
a batch waiting for ClickHouse is given up uncommitted, then everything is closed and
sink.json removed.

The ``dask-blackbox sink`` command itself is :mod:`dask_blackbox.cli.sink`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from typing import Protocol

from aiokafka.errors import InvalidSessionTimeoutError

from dask_blackbox import clickhouse, collector, config, kafka, metrics, runfiles
from dask_blackbox.sinks.consumer import SinkConsumer
from dask_blackbox.sinks.metrics import SinkMetrics
from dask_blackbox.sinks.loader import Loader, PausePoint
from dask_blackbox.sinks.schema import MigrationError, migrate
from dask_blackbox.sinks.settings import SinkSettings

#: Errors that stop the sink at start-up with a one-line message.
START_ERRORS = (config.ConfigError, clickhouse.ClickHouseUnavailable, kafka.KafkaUnreachable,
                MigrationError)

logger = logging.getLogger("dask_blackbox.sinks.service")


def tune_gc() -> None:
    """Collect garbage less often: converting a batch allocates hundreds of thousands
    of short-lived lists and dicts (no reference cycles), and Python's default
    thresholds would rescan the growing heap many times per batch -- more than
    doubling the conversion time."""
    collector.collect_rarely()


class Companion(Protocol):
    """Something served beside the sink on its ClickHouse client (the query server)."""

    url: str

    def start(self) -> None: ...

    def stop(self) -> None: ...


#: Builds the companion from (a client of the sink's own ClickHouse, the port setting,
#: the token that guards it, and ``open_client=``: a callable opening one more such
#: client); may raise OSError (port in use).
CompanionFactory = Callable[..., Companion]


async def serve(companion: CompanionFactory | None = None) -> None:
    """Run the sink until SIGTERM/SIGINT; raises one of START_ERRORS if it cannot start."""
    s = SinkSettings.from_config()
    client = await asyncio.to_thread(clickhouse.open_client, s.dsn)
    tune_gc()
    server = reader = consumer = metrics_server = None
    try:
        applied = await asyncio.to_thread(migrate, client, s.target)
        if applied:
            logger.info("applied migrations %s", ", ".join(applied))
        token = secrets.token_urlsafe(24)
        if companion is not None and config.chdb_path(s.dsn) is not None:
            reader = clickhouse.open_client(s.dsn, owned=True, database=s.target.database)
            try:
                server = companion(reader, s.query_port, token, open_client=lambda: (
                    clickhouse.open_client(s.dsn, owned=True, database=s.target.database)))
            except OSError as e:
                raise config.ConfigError(
                    f"blackbox.sink.query-port: cannot listen on 127.0.0.1:{s.query_port}: "
                    f"{e.strerror or e}"
                ) from None
            server.start()
        topics = await kafka.ensure_topics(settings=s.kafka)
        loader = Loader(client, s.target, s.group_id, retry_backoff_max=s.retry_backoff_max,
                        # a chDB directory is this process's alone
                        exclusive=config.chdb_path(s.dsn) is not None,
                        pause=PausePoint(s.pause_at, s.data_dir))
        consumer = SinkConsumer(loader, s)
        try:
            await consumer.start()
        except InvalidSessionTimeoutError:
            raise config.ConfigError(
                f"blackbox.sink.session-timeout: {s.session_timeout:g}s is outside what the "
                "broker accepts (its group.min.session.timeout.ms .. group.max.session.timeout.ms; "
                "Apache Kafka's default minimum is 6s)") from None
        metrics_url = None
        if s.metrics_port is not None:
            registry = metrics.registry()
            registry.register(SinkMetrics(consumer))
            metrics_server, metrics_url = metrics.serve(registry, s.metrics_host, s.metrics_port,
                                                        "blackbox.sink.metrics-port")
        info = {"pid": os.getpid(), "query_url": server.url if server else None,
                "dsn": config.redact(s.dsn), "started_at": time.time(), "token": token,
                "metrics_url": metrics_url, "loading": False}
        runfiles.write(s.data_dir, runfiles.SINK, info)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, consumer.stop)
        running = asyncio.ensure_future(consumer.run())
        ready = asyncio.ensure_future(consumer.loading.wait())
        await asyncio.wait([running, ready], return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            runfiles.write(s.data_dir, runfiles.SINK, {**info, "loading": True})
            print(
                f"sink ready: {clickhouse.redact(s.dsn)} database={s.target.database} "
                f"group={s.group_id} topics={','.join(topics)} "
                f"query_url={server.url if server else '-'}",
                flush=True,
            )
        else:
            ready.cancel()
        await running
        logger.info("stopping after %d batches", consumer.batches_loaded)
    finally:
        runfiles.remove(s.data_dir, runfiles.SINK)
        if metrics_server is not None:
            metrics_server.shutdown()
        if consumer is not None:
            await consumer.close()
        if server is not None:
            server.stop()
        if reader is not None:
            reader.close()
        client.close()
