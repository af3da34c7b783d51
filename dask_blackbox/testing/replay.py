"""Recorded envelopes, published again under new identities.

Load tests and benchmarks record the raw topic of a real workload once, then publish
it many times as if it came from many clusters: :func:`renamed` gives a copy a new
``cluster_id`` (and ``cluster_name``) and suffixes every ``producer_id``, so each
copy is processed as distinct clusters and producers, with its own sequences.

Test and benchmark code only: ``from dask_blackbox.testing import replay``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import orjson
from aiokafka import AIOKafkaProducer

from dask_blackbox import config, contract
from dask_blackbox.testing.kafka_reader import read_topic


def renamed(envelope: dict, cluster_id: str, producer_suffix: str) -> dict:
    """A copy of ``envelope`` from cluster ``cluster_id`` whose producer id ends with
    ``producer_suffix`` (events are shared, not copied)."""
    return {**envelope, "cluster_id": cluster_id, "cluster_name": cluster_id,
            "producer_id": f"{envelope['producer_id']}{producer_suffix}"}


async def read_raw(idle: float = 1.0, timeout: float = 120.0) -> list[tuple[bytes | None, bytes]]:
    """``(key, value)`` of every message on the raw topic, in partition order, read
    until nothing new arrives for ``idle`` seconds."""
    records = await read_topic(config.topic(contract.RAW), idle, timeout)
    return [(r.key, r.value) for r in records]


async def publish_raw(messages: Iterable[tuple[bytes | None, bytes]]) -> int:
    """Publish ``(key, value)`` messages to the raw topic, in order; return how many."""
    producer = AIOKafkaProducer(
        **config.kafka_producer_kwargs(), linger_ms=20, max_batch_size=1 << 20,
        max_request_size=1 << 20,
    )
    await producer.start()
    n = 0
    try:
        topic = config.topic(contract.RAW)
        pending = []
        for key, value in messages:
            pending.append(await producer.send(topic, value=value, key=key))
            n += 1
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return n


def encode(envelope: dict, msgpack: bool = False) -> tuple[bytes, bytes]:
    """``(key, value)`` of an envelope as producers publish it: JSON, or ``msgpack``
    (a version 3 envelope as decoded, ``contract.decode_envelope``)."""
    import msgspec

    value = msgspec.msgpack.encode(envelope) if msgpack else orjson.dumps(envelope)
    return envelope["cluster_id"].encode(), value


def as_version_2(value: bytes) -> bytes:
    """A raw message as a version 2 producer sent it: the JSON envelope of the same
    events, each CAPTURE as the TRANSITION_RUN of the same transitions (what
    ``producers.sender.encode_rows`` packed). Anything but a version 3 envelope is
    returned as it is."""
    from dask_blackbox.producers.rows import TransitionRow, run_event

    if not contract.is_msgpack(value):
        return value
    envelope = contract.decode_envelope(value)
    names = contract.fields(contract.Transition)[1:]
    events = [run_event([TransitionRow(*map(event.__getitem__, names))
                         for event in contract.unpack(ev)])
              if type(ev) is dict and ev.get("kind") == contract.CAPTURE else ev
              for ev in envelope["events"]]
    return orjson.dumps({**envelope, "schema": 2, "events": events})
