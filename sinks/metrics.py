"""The sink's Prometheus metrics, read when scraped (``/metrics`` on
``blackbox.sink.metrics-host``:``metrics-port``; the URL is in sink.json):

- ``dask_blackbox_sink_rows_loaded_total{table}``: rows of each table the sink
  loaded (a batch counts once ClickHouse has it; dead letters included);
- ``dask_blackbox_sink_dead_letters_total``: what could not be loaded as data;
- ``dask_blackbox_sink_batches_total``: batches loaded and committed or journalled;
- ``dask_blackbox_producer_dropped_events_total``: the events the producers reported
  dropping (their buffer full), as loaded into ``drops``;
- ``dask_blackbox_consumer_lag{group, topic}``: messages of each topic the sink's
  group has not committed (the high watermark its consumer last saw, less the
  committed offset).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dask_blackbox import metrics


class SinkMetrics(Collector):
    def __init__(self, consumer) -> None:
        #: a sinks.consumer.SinkConsumer
        self.sink = consumer

    def collect(self):
        loader = self.sink.loader
        rows = CounterMetricFamily("dask_blackbox_sink_rows_loaded", "Rows the sink loaded",
                                   labels=["table"])
        for table, n in sorted(loader.rows_loaded.items()):
            rows.add_metric([table], n)
        yield rows
        yield CounterMetricFamily("dask_blackbox_sink_dead_letters",
                                  "Messages and events that could not be loaded as data",
                                  value=loader.dead_letters)
        yield CounterMetricFamily("dask_blackbox_sink_batches", "Batches loaded",
                                  value=loader.batches)
        yield CounterMetricFamily("dask_blackbox_producer_dropped_events",
                                  "Events the producers reported dropping (buffer full)",
                                  value=loader.dropped_events)
        lag = GaugeMetricFamily(metrics.LAG, metrics.LAG_HELP, labels=["group", "topic"])
        positions = dict(self.sink.committed)
        for topic, n in sorted(metrics.consumer_lag(self.sink.consumer, positions).items()):
            lag.add_metric([self.sink.settings.group_id, topic], n)
        yield lag
