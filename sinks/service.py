"""``dask-blackbox sink``: the sink as a foreground process.

Start-up, in order: validate the configuration (data dir and chDB dir writable, DSN
well formed, ClickHouse reachable), apply the schema migrations, create the Kafka
topics, start the consumer and -- for a ``chdb://`` DSN, which only this process may
open -- a loopback query server. Then ``<data-dir>/sink.json`` is written atomically
(``{"pid", "query_url", "dsn", "started_at", "token"}``; mode 0600, the token guards
the query server) and one line ``sink ready ...`` goes to stdout.

SIGTERM or SIGINT stops it cleanly: a batch being inserted is finished and committed,
a batch waiting for ClickHouse is given up uncommitted, then everything is closed and
sink.json removed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import secrets
import signal
import sys
import time

import orjson

from dask_blackbox import config, kafka
from sinks import clickhouse, queries
from sinks.consumer import SinkConsumer
from sinks.loader import Loader, PausePoint
from sinks.query_server import QueryServer
from sinks.schema import MigrationError, Target, migrate

logger = logging.getLogger("sinks.service")


def _settings() -> dict:
    """Every sink setting, validated, before anything starts."""
    group_id = config.get("sink.group-id")
    if not isinstance(group_id, str) or not group_id:
        raise config.ConfigError(f"blackbox.sink.group-id: {group_id!r} must be a non-empty string")
    port = config.get_int("sink.query-port", minimum=0)
    if port > 65535:
        raise config.ConfigError(f"blackbox.sink.query-port: {port} is not a TCP port")
    data_dir = config.data_dir()
    clickhouse.check_writable(data_dir, "blackbox.data-dir")
    config.kafka_client_kwargs()
    return {
        "data_dir": data_dir,
        "dsn": config.clickhouse_dsn(),
        "target": Target.from_config(),
        "group_id": group_id,
        "max_rows": config.get_int("sink.batch-max-rows"),
        "max_wait": config.get_seconds("sink.batch-max-wait"),
        "backoff": config.get_seconds("sink.retry-backoff-max"),
        "session_timeout": config.get_seconds("sink.session-timeout"),
        "port": port,
        "pause": PausePoint(config.get("sink.debug-pause-at", None), data_dir),
    }


def tune_gc() -> None:
    """Collect garbage less often: converting a batch allocates hundreds of thousands
    of short-lived lists and dicts (no reference cycles), and Python's default
    thresholds would rescan the growing heap many times per batch -- more than
    doubling the conversion time."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def _write_sink_file(info: dict) -> None:
    path = queries.sink_file()
    tmp = path.with_name(f".sink.json.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(orjson.dumps(info))
    os.replace(tmp, path)


def _remove_sink_file() -> None:
    path = queries.sink_file()
    try:
        if orjson.loads(path.read_bytes()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, orjson.JSONDecodeError, AttributeError):
        pass


async def _serve() -> None:
    s = _settings()
    client = await asyncio.to_thread(clickhouse.open_client, s["dsn"])
    tune_gc()
    server = reader = consumer = None
    try:
        applied = await asyncio.to_thread(migrate, client, s["target"])
        if applied:
            logger.info("applied migrations %s", ", ".join(applied))
        token = secrets.token_urlsafe(24)
        if config.chdb_path(s["dsn"]) is not None:
            reader = clickhouse.open_client(s["dsn"], owned=True, database=s["target"].database)
            try:
                server = QueryServer(reader, s["port"], token)
            except OSError as e:
                raise config.ConfigError(
                    f"blackbox.sink.query-port: cannot listen on 127.0.0.1:{s['port']}: "
                    f"{e.strerror or e}"
                ) from None
            server.start()
        topics = await kafka.ensure_topics()
        loader = Loader(client, s["target"], s["group_id"], retry_backoff_max=s["backoff"],
                        pause=s["pause"])
        consumer = SinkConsumer(loader, max_rows=s["max_rows"], max_wait=s["max_wait"],
                                session_timeout=s["session_timeout"])
        await consumer.start()
        _write_sink_file({
            "pid": os.getpid(), "query_url": server.url if server else None, "dsn": s["dsn"],
            "started_at": time.time(), "token": token,
        })
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, consumer.stop)
        print(
            f"sink ready: {clickhouse.redact(s['dsn'])} database={s['target'].database} "
            f"group={s['group_id']} topics={','.join(topics)} "
            f"query_url={server.url if server else '-'}",
            flush=True,
        )
        await consumer.run()
        logger.info("stopping after %d batches", consumer.batches_loaded)
    finally:
        _remove_sink_file()
        if consumer is not None:
            await consumer.close()
        if server is not None:
            server.stop()
        if reader is not None:
            reader.close()
        client.close()


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
        asyncio.run(_serve())
    except (config.ConfigError, clickhouse.ClickHouseUnavailable, kafka.KafkaUnreachable,
            MigrationError) as e:
        print(f"dask-blackbox sink: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
