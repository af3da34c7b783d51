"""The faust app: ``faust -A dask_blackbox.stream_processors.app worker``.

:func:`create_app` builds the app, its topics, table, agent and timer from one
:class:`~.settings.ProcessorSettings`; the module-level ``app`` is built from the
current ``dask.config`` (``blackbox.*``; environment variables such as
``DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS`` work), resolved once at import: the broker
and its credentials (``kafka.*``), the app id (``processors.app-id``, also the
consumer group), the topic names (``kafka.topic-prefix``), and the processing
settings (``processors.*``)::

    DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS=127.0.0.1:9092 \\
        faust -A dask_blackbox.stream_processors.app worker --web-port 6066 --datadir /tmp/p -l info

Run as many workers as the raw topic has partitions; they share the work by
partition, hence by cluster. State lives in the changelog of the ``cluster-state``
table (memory store), so a worker that restarts, or takes over partitions, rebuilds
it (:mod:`.processor`). ``GET /blackbox/stats/`` on the worker's web port returns
the worker's counters (:meth:`.processor.Processor.stats`), ``GET /metrics`` the
same and the consumer lag for Prometheus (:mod:`.metrics`).
"""

from __future__ import annotations

import faust

from dask_blackbox import collector, config, contract, kafka
from dask_blackbox.config import KafkaSettings

from . import metrics
from .processor import Processor
from .settings import ProcessorSettings
from .transport import Transport


def broker_settings(kafka_settings: KafkaSettings) -> dict:
    """faust ``broker`` and ``broker_credentials`` from the Kafka settings."""
    kwargs = kafka_settings.client_kwargs()
    protocol = kwargs["security_protocol"]
    if protocol.startswith("SASL"):
        credentials = faust.SASLCredentials(
            username=kwargs["sasl_plain_username"],
            password=kwargs["sasl_plain_password"],
            mechanism=kwargs["sasl_mechanism"],
            ssl_context=kwargs.get("ssl_context"),
        )
    elif protocol == "SSL":
        credentials = faust.SSLCredentials(kwargs["ssl_context"])
    else:
        credentials = None
    return {
        "broker": [f"kafka://{server}" for server in kwargs["bootstrap_servers"]],
        "broker_credentials": credentials,
    }


def app_settings(settings: ProcessorSettings) -> dict:
    """Every faust setting of the app."""
    session = settings.session_timeout
    return {
        "id": settings.app_id,
        **broker_settings(settings.kafka),
        "store": "memory://",
        # changelog partitions must match the raw topic's (it decides table partitions)
        "topic_partitions": settings.kafka.partitions,
        "topic_replication_factor": settings.kafka.replication_factor,
        "table_standby_replicas": 0,
        # faust refuses to recover a changelog partition whose offset read so far is
        # past the end offset the broker reports (a RocksDB file ahead of its topic).
        # The store is in memory, so only this process's own reading can be ahead,
        # and on Tansu it is, after any batch of several records: Tansu reports the
        # end as the last batch's base offset plus one (see read_changelog in
        # processor.py). The check then stopped a worker at its next rebalance.
        "recovery_consistency_check": False,
        "broker_session_timeout": session,
        "broker_heartbeat_interval": min(3.0, session / 4),
        "broker_rebalance_timeout": session,
        "broker_commit_interval": settings.commit_interval,
        "consumer_auto_offset_reset": "earliest",
        # Bytes per partition per fetch: at least one envelope, and large enough that
        # the worker never waits for the broker while there is a backlog.
        "consumer_max_fetch_size": 16 * 1024 * 1024,
        # span snapshots, prefix partials and the checkpoint journal, like raw
        "producer_compression_type": settings.kafka.compression,
        # The worker's web server (/metrics, /blackbox/stats/, and faust's own
        # /router/, /table/) listens on loopback unless told otherwise (faust worker
        # --web-bind): --web-host is only the name it advertises.
        "web_bind": "127.0.0.1",
    }


def tune_gc() -> None:
    """Collect garbage less often. The clusters' states are long-lived containers
    (hundreds of thousands under a flood of clusters) that hold no reference cycles,
    and most of what a batch allocates is acyclic and freed at once: with Python's
    default thresholds the collector rescans the growing state over and over (a
    fifth to a quarter of the processors' own work under a flood of 10,000 clusters).
    What the worker made while starting is frozen (never scanned)."""
    collector.collect_rarely()


class BlackboxApp(faust.App):
    #: set by :func:`create_app`
    blackbox: ProcessorSettings
    processor: Processor

    def _new_transport(self) -> Transport:
        # faust's Kafka transport, its consumer handing messages over more cheaply
        return Transport(self.conf.broker_consumer, self)

    async def on_stop(self) -> None:
        await self.processor.outbox.stop()
        await super().on_stop()

    async def on_first_start(self) -> None:
        await super().on_first_start()
        tune_gc()
        # The raw topic must exist, with the configured partitions, before the
        # consumer subscribes: the changelog is created with as many.
        await kafka.ensure_topics(settings=self.blackbox.kafka)
        await check_raw_partitions(self.blackbox.kafka)


async def check_raw_partitions(kafka_settings: KafkaSettings) -> None:
    """The raw topic has ``blackbox.kafka.partitions`` partitions, or a ConfigError."""
    name = kafka_settings.topic(contract.RAW)
    expected = kafka_settings.partitions
    admin = await kafka.connect_admin(settings=kafka_settings)
    try:
        (described,) = await admin.describe_topics([name])
    finally:
        await admin.close()
    actual = len(described["partitions"])
    if actual != expected:
        raise config.ConfigError(
            f"topic {name} has {actual} partitions but blackbox.kafka.partitions is "
            f"{expected}: set it to {actual} (the processors' changelog has as many "
            "partitions as the raw topic)"
        )


# Raw bytes in and out: faust would otherwise JSON-decode every message itself (twice
# the work), and stall on a message that is not JSON instead of dead-lettering it.
_RAW = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw",
        "value_serializer": "raw"}


def create_app(settings: ProcessorSettings) -> BlackboxApp:
    """The faust app, its topics, table, agent, timer and stats page."""
    app = BlackboxApp(**app_settings(settings))
    app.blackbox = settings
    topic = settings.kafka.topic
    raw_topic = app.topic(topic(contract.RAW), **_RAW)
    outputs = {
        name: app.topic(topic(name), **_RAW)
        for name in (contract.SPAN_STATE, contract.PREFIX_STATS, contract.GAPS,
                     contract.DEAD_LETTER)
    }
    state_table = app.Table("cluster-state", key_type=bytes, value_type=bytes)
    processor = app.processor = Processor(
        app, settings, raw_topic.get_topic_name(), state_table, outputs)

    async def or_crash(work) -> None:
        """Run ``work``; on any error stop the whole worker, not just this agent or
        timer: the cluster states may be half-updated, and a restart rebuilds them
        from the changelog and re-reads the messages whose offsets were not
        committed."""
        try:
            await work
        except Exception as exc:
            await app.crash(exc)
            raise

    state_table.on_recover(lambda: or_crash(processor.on_recovered()))

    @app.agent(raw_topic)
    async def process_raw(stream):
        async for events in stream.take_events(settings.batch_max_envelopes,
                                               within=settings.batch_max_wait):
            await or_crash(processor.process(events))

    @app.timer(settings.snapshot_interval)
    async def publish_and_expire():
        await or_crash(processor.tick())

    @app.page("/blackbox/stats/")
    async def stats(web, request):
        return web.json(processor.stats())

    prometheus = metrics.page(app, processor, settings)

    @app.page("/metrics")
    async def serve_metrics(web, request):
        return await prometheus(web, request)

    return app


app = create_app(ProcessorSettings.from_config())
