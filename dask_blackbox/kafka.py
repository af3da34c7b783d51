"""Kafka plumbing every layer shares: reaching the broker, creating the topics,
measuring consumer lag. Each function takes the caller's resolved
:class:`~dask_blackbox.config.KafkaSettings` (None: resolve the current config)."""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from dask_blackbox import config
from dask_blackbox.config import KafkaSettings
from dask_blackbox.contract import TOPICS

# Kafka's "Topic with this name already exists"
_TOPIC_ALREADY_EXISTS = 36


class KafkaUnreachable(ConnectionError):
    """No broker answered at the configured bootstrap servers."""


async def connect_admin(timeout: float = 10.0, settings: KafkaSettings | None = None) -> AIOKafkaAdminClient:
    """An admin client connected to the configured broker, or KafkaUnreachable."""
    kwargs = (settings or KafkaSettings.from_config()).client_kwargs()
    deadline = asyncio.get_running_loop().time() + timeout
    last: Exception | None = None
    while True:
        admin = AIOKafkaAdminClient(**kwargs, request_timeout_ms=max(1000, int(timeout * 1000)))
        try:
            await admin.start()
            return admin
        except (KafkaError, OSError) as e:
            last = e
            await admin.close()
        if asyncio.get_running_loop().time() >= deadline:
            raise KafkaUnreachable(
                f"cannot reach Kafka at {','.join(kwargs['bootstrap_servers'])} "
                f"(blackbox.kafka.bootstrap-servers): {last}"
            )
        await asyncio.sleep(0.2)


async def ensure_topics(timeout: float = 10.0, settings: KafkaSettings | None = None) -> list[str]:
    """Create every contract topic that does not exist yet; return their full names."""
    settings = settings or KafkaSettings.from_config()
    partitions = settings.partitions
    replication = settings.replication_factor
    retention_ms = int(settings.retention_seconds * 1000)
    # Kafka deletes whole segments: roll them often enough for retention to act.
    segment_ms = min(int(config.get_seconds("kafka.segment", minimum=1.0) * 1000),
                     max(retention_ms // 4, 1000))
    topic_configs = {"retention.ms": str(retention_ms), "segment.ms": str(segment_ms),
                     "segment.bytes": str(max(config.get_bytes("kafka.segment-bytes"), 2**20))}
    if settings.min_insync_replicas is not None:
        topic_configs["min.insync.replicas"] = str(settings.min_insync_replicas)
    names = [settings.topic(t) for t in TOPICS]
    admin = await connect_admin(timeout, settings)
    try:
        response = await admin.create_topics(
            [
                NewTopic(n, partitions, replication, topic_configs=topic_configs)
                for n in names
            ]
        )
        for name, code, message in response.topic_errors:
            if code not in (0, _TOPIC_ALREADY_EXISTS):
                raise KafkaError(f"cannot create topic {name}: {message} (error {code})")
    finally:
        await admin.close()
    return names


async def consumer_lag(group_id: str, topics: list[str], timeout: float = 10.0,
                       settings: KafkaSettings | None = None) -> dict[str, int]:
    """Messages of each topic that the consumer group has not committed yet.

    A partition the group never committed counts from its first retained offset; a
    partition ends one past its last record (:func:`record_ends`).
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    settings = settings or KafkaSettings.from_config()
    admin = await connect_admin(timeout, settings)
    consumer = AIOKafkaConsumer(**settings.client_kwargs(), group_id=None)
    try:
        await consumer.start()
        # Ask for these topics' partitions: a consumer without subscriptions knows no
        # topics on Apache Kafka (Tansu tells every client about every topic).
        partitions = [
            TopicPartition(t["topic"], p["partition"])
            for t in await admin.describe_topics(topics) if t["error_code"] == 0
            for p in sorted(t["partitions"], key=lambda p: p["partition"])
        ]
        if not partitions:
            return {t: 0 for t in topics}
        begin = await consumer.beginning_offsets(partitions)
        end = await record_ends(consumer, await consumer.end_offsets(partitions), begin)
        committed = await admin.list_consumer_group_offsets(group_id, partitions=partitions)
    finally:
        await asyncio.sleep(0)  # aiokafka: stop() before its group task ran raises CancelledError
        await consumer.stop()
        await admin.close()
    lag = dict.fromkeys(topics, 0)
    for tp in partitions:
        meta = committed.get(tp)
        done = meta.offset if meta is not None and meta.offset >= 0 else begin[tp]
        lag[tp.topic] += max(end[tp] - done, 0)
    return lag


async def record_ends(consumer, ends: dict, begins: dict, timeout: float = 2.0) -> dict:
    """One past the last record of each partition, where the broker's end offsets
    (``ends``, as ``consumer.end_offsets`` gives them) may say less.

    Tansu reports a partition's end as its last batch's base offset plus one: a
    batch of several records would count as consumed while its later records are
    not. This reads from the reported end less one (a fetch returns that batch
    whole) and takes one past the highest offset it holds; on Apache Kafka that is
    the reported end. A partition that has nothing to read (``begins[tp]`` is its
    first retained offset), or that gives no record within ``timeout`` seconds,
    keeps its reported end. ``consumer`` must have no group: it is assigned these
    partitions."""
    last = {tp: end - 1 for tp, end in ends.items() if end > begins.get(tp, 0)}
    out = dict(ends)
    if not last:
        return out
    consumer.assign(list(last))
    for tp, offset in last.items():
        consumer.seek(tp, offset)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while last and loop.time() < deadline:
        fetched = await consumer.getmany(*last, timeout_ms=200)
        for tp, records in fetched.items():
            if records:
                out[tp] = max(out[tp], records[-1].offset + 1)
                last.pop(tp, None)
    return out


async def committed_offsets(group_id: str, topic: str, partitions: list[int],
                            timeout: float = 5.0,
                            settings: KafkaSettings | None = None) -> dict[int, int]:
    """The offsets consumer group ``group_id`` has committed on these partitions of
    ``topic`` (the next offset it will read; -1 where it never committed), as the
    group coordinator knows them; KafkaUnreachable or a KafkaError otherwise."""
    from aiokafka import TopicPartition

    tps = [TopicPartition(topic, p) for p in partitions]
    admin = await connect_admin(timeout, settings)
    try:
        committed = await admin.list_consumer_group_offsets(group_id, partitions=tps)
    finally:
        await admin.close()
    return {tp.partition: (meta.offset if (meta := committed.get(tp)) is not None else -1)
            for tp in tps}
