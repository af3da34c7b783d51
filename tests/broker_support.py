"""Local brokers for tests that run their own (to kill and restart them): Tansu or
Apache Kafka behind one interface (:class:`dask_blackbox.deploy.brokers.LocalBroker`)."""

from __future__ import annotations

import os

from dask_blackbox.deploy.brokers import KafkaBroker, LocalBroker, TansuBroker, kafka_home


def broker_for(kind: str, data_dir, port: int = 0) -> LocalBroker:
    """A restartable local broker of ``kind`` ("tansu" or "kafka"), not started.
    Kafka keeps its data in ``data_dir`` (a restart keeps it; ``.persistent``) and runs
    with a small heap (DASK_BLACKBOX__LOCAL__KAFKA_HEAP, default 384MiB)."""
    if kind == "tansu":
        return TansuBroker(port)
    return KafkaBroker(data_dir, port=port, home=kafka_home(),
                       heap=os.environ.get("DASK_BLACKBOX__LOCAL__KAFKA_HEAP", "384MiB"))
