"""The processors' Prometheus metrics, served at ``GET /metrics`` on each faust
worker's web port (beside ``/blackbox/stats/``):

- ``dask_blackbox_processor_<counter>_total`` for each counter of
  :meth:`~.processor.Processor.stats` (envelopes, events, duplicates,
  dead_letters, gaps, partials, snapshots, ...), since this worker started;
- ``dask_blackbox_processor_clusters``: clusters held in memory;
- ``dask_blackbox_processor_live_keys`` and ``dask_blackbox_processor_refused_keys_total``:
  task keys held, and refused past ``processors.max-live-keys-total`` (:mod:`.bounds`;
  clusters refused past ``max-live-clusters`` are the counters ``refused_clusters`` and
  ``refused_envelopes``);
- ``dask_blackbox_consumer_lag{group, topic}``: raw messages the app's consumer
  group has not committed (asked of the broker at each scrape).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dask_blackbox import contract, kafka, metrics
from dask_blackbox.kafka import KafkaUnreachable


class ProcessorMetrics(Collector):
    def __init__(self, processor, settings) -> None:
        self.processor = processor
        self.settings = settings
        self.lag: dict[str, int] = {}

    def collect(self):
        for name, value in sorted(self.processor.counters.items()):
            yield CounterMetricFamily(f"dask_blackbox_processor_{name}",
                                      f"Processor counter {name} since this worker started",
                                      value=value)
        yield GaugeMetricFamily("dask_blackbox_processor_clusters", "Clusters held in memory",
                                value=len(self.processor.clusters))
        keys = self.processor.keys
        yield GaugeMetricFamily("dask_blackbox_processor_live_keys",
                                "Task keys held across the clusters in memory", value=keys.used)
        yield CounterMetricFamily("dask_blackbox_processor_refused_keys",
                                  "Task keys not tracked past processors.max-live-keys-total",
                                  value=keys.refused)
        lag = GaugeMetricFamily(metrics.LAG, metrics.LAG_HELP, labels=["group", "topic"])
        for topic, n in sorted(self.lag.items()):
            lag.add_metric([self.settings.app_id, topic], n)
        yield lag


def page(app, processor, settings):
    """The faust page handler for ``/metrics``."""
    registry = metrics.registry()
    collector = ProcessorMetrics(processor, settings)
    registry.register(collector)
    raw = settings.kafka.topic(contract.RAW)

    async def handler(web, request):
        try:
            collector.lag = await kafka.consumer_lag(settings.app_id, [raw], timeout=5.0,
                                                     settings=settings.kafka)
        except (KafkaUnreachable, OSError):
            collector.lag = {}
        # aiohttp takes the type without its charset (text/plain is UTF-8 then)
        return web.bytes(generate_latest(registry), content_type=CONTENT_TYPE_LATEST.split(";")[0])

    return handler
