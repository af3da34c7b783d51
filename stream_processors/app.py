"""The faust app: ``faust -A dask_blackbox.stream_processors.app worker``.

Everything comes from ``dask.config`` (``blackbox.*``; environment variables such as
``DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS`` work): the broker and its credentials
(``kafka.*``), the app id (``processors.app-id``, also the consumer group), the topic
names (``kafka.topic-prefix``), and the processing settings (``processors.*``)::

    DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS=127.0.0.1:9092 \\
        faust -A dask_blackbox.stream_processors.app worker --web-port 6066 --datadir /tmp/p -l info

Run as many workers as the raw topic has partitions; they share the work by
partition, hence by cluster. State lives in the changelog of the ``cluster-state``
table (memory store), so a worker that restarts, or takes over partitions, rebuilds
it (:mod:`.processor`). ``GET /blackbox/stats/`` on the worker's web port returns
the worker's counters (:meth:`.processor.Processor.stats`).
"""

from __future__ import annotations

import faust

from dask_blackbox import config, contract, kafka

from .processor import Processor


def broker_settings() -> dict:
    """faust ``broker`` and ``broker_credentials`` from ``blackbox.kafka.*``."""
    kwargs = config.kafka_client_kwargs()
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


def app_settings() -> dict:
    """Every faust setting of the app, validated."""
    app_id = config.get("processors.app-id")
    if not app_id or not isinstance(app_id, str):
        raise config.ConfigError(f"blackbox.processors.app-id: {app_id!r} must be a name")
    session = config.get_seconds("processors.session-timeout")
    if session < 1:
        raise config.ConfigError(
            f"blackbox.processors.session-timeout: {session}s is too short (at least 1s)")
    return {
        "id": app_id,
        **broker_settings(),
        "store": "memory://",
        # changelog partitions must match the raw topic's (it decides table partitions)
        "topic_partitions": config.get_int("kafka.partitions"),
        "topic_replication_factor": config.get_int("kafka.replication-factor"),
        "table_standby_replicas": 0,
        "broker_session_timeout": session,
        "broker_heartbeat_interval": min(3.0, session / 4),
        "broker_rebalance_timeout": session,
        "consumer_auto_offset_reset": "earliest",
        # Bytes per partition per fetch: at least one envelope, and large enough that
        # the worker never waits for the broker while there is a backlog.
        "consumer_max_fetch_size": 16 * 1024 * 1024,
        # span snapshots, prefix partials and the checkpoint journal, like raw
        "producer_compression_type": config.compression(),
    }


class BlackboxApp(faust.App):
    async def on_first_start(self) -> None:
        await super().on_first_start()
        # The raw topic must exist, with the configured partitions, before the
        # consumer subscribes: the changelog is created with as many.
        await kafka.ensure_topics()
        await check_raw_partitions()


async def check_raw_partitions() -> None:
    """The raw topic has ``blackbox.kafka.partitions`` partitions, or a ConfigError."""
    name = config.topic(contract.RAW)
    expected = config.get_int("kafka.partitions")
    admin = await kafka.connect_admin()
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


def processing_settings() -> dict:
    """``blackbox.processors.*`` settings of the processing itself, validated."""
    out = {
        "window": config.get_seconds("processors.prefix-window"),
        "snapshot_interval": config.get_seconds("processors.snapshot-interval"),
        "ttl": config.get_seconds("processors.finished-cluster-ttl"),
        "batch_wait": config.get_seconds("processors.batch-max-wait"),
        "batch": config.get_int("processors.batch-max-envelopes"),
        "max_keys": config.get_int("processors.max-live-keys"),
    }
    for name, key in (("window", "prefix-window"), ("snapshot_interval", "snapshot-interval"),
                      ("batch_wait", "batch-max-wait")):
        if not out[name] > 0:
            raise config.ConfigError(f"blackbox.processors.{key} must be more than 0")
    return out


_SETTINGS = processing_settings()
app = BlackboxApp(**app_settings())

# Raw bytes in and out: faust would otherwise JSON-decode every message itself (twice
# the work), and stall on a message that is not JSON instead of dead-lettering it.
_RAW = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw",
        "value_serializer": "raw"}
raw_topic = app.topic(config.topic(contract.RAW), **_RAW)
outputs = {
    name: app.topic(config.topic(name), **_RAW)
    for name in (contract.SPAN_STATE, contract.PREFIX_STATS, contract.GAPS,
                 contract.DEAD_LETTER)
}
state_table = app.Table("cluster-state", key_type=bytes, value_type=bytes)

processor = Processor(
    app, raw_topic.get_topic_name(), state_table, outputs,
    window=_SETTINGS["window"], max_keys=_SETTINGS["max_keys"], ttl=_SETTINGS["ttl"],
)


async def _or_crash(work) -> None:
    """Run ``work``; on any error stop the whole worker, not just this agent or
    timer: the cluster states may be half-updated, and a restart rebuilds them from
    the changelog and re-reads the messages whose offsets were not committed."""
    try:
        await work
    except Exception as exc:
        await app.crash(exc)
        raise


state_table.on_recover(lambda: _or_crash(processor.on_recovered()))


@app.agent(raw_topic)
async def process_raw(stream):
    async for events in stream.take_events(_SETTINGS["batch"], within=_SETTINGS["batch_wait"]):
        await _or_crash(processor.process(events))


@app.timer(_SETTINGS["snapshot_interval"])
async def publish_and_expire():
    await _or_crash(processor.tick())


@app.page("/blackbox/stats/")
async def stats(web, request):
    return web.json(processor.stats())
