"""Serving a component's Prometheus metrics (``/metrics``) with prometheus_client.

Each component (the sink, the exporter; the processors serve theirs on faust's web
server) keeps its metrics in a registry of its own (:func:`registry`) and serves it
with :func:`serve` on ``<component>.metrics-host``:``<component>.metrics-port`` (0: a
free port). Metric names start with ``dask_blackbox_``. Consumer lag is one family
for every component: ``dask_blackbox_consumer_lag{group, topic}``, messages of the
topic the group has not consumed yet.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from dask_blackbox import config

LAG = "dask_blackbox_consumer_lag"
LAG_HELP = "Messages of the topic the consumer group has not consumed yet"


def registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def serve(registry: CollectorRegistry, host: str, port: int, key: str):
    """Serve ``registry`` on ``host:port``; returns (the server, its URL). A port that
    cannot be had is a ConfigError naming ``key`` (the port setting)."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise config.ConfigError(f"{key}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = server.server_address[1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return server, f"http://{shown}:{bound}/metrics"


def consumer_lag(consumer, positions: dict[tuple[str, int], int],
                 ends: dict | None = None) -> dict[str, int]:
    """topic -> messages not consumed yet, for the partitions an aiokafka ``consumer``
    is assigned: the partition's end (from ``ends``, a TopicPartition -> offset map
    as ``end_offsets`` returns; else its high watermark as of the consumer's last
    fetch) less ``positions`` (the next offset the caller will process; where
    unknown, the partition counts 0)."""
    lag: dict[str, int] = {}
    for tp in consumer.assignment():
        high = ends.get(tp) if ends is not None else consumer.highwater(tp)
        position = positions.get((tp.topic, tp.partition))
        lag.setdefault(tp.topic, 0)
        if high is not None and position is not None:
            lag[tp.topic] += max(high - position, 0)
    return lag
