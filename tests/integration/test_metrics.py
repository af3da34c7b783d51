"""``/metrics`` of the sink and the processors (Prometheus text format, parsed with
prometheus_client's own parser), on the recorded run's pipeline
(tests/recording_support.py): rows loaded per table equal the rows ClickHouse holds,
the processors counted every envelope, nothing is left to consume, and a message that
is not an envelope shows up as one more dead letter on both."""

from __future__ import annotations

import urllib.request

import dask.config
from prometheus_client.parser import text_string_to_metric_families

from dask_blackbox import config, runfiles

from dask_blackbox.testing.polling import wait_for
from sink_support import count, produce


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_sink_and_processor_metrics(recorded_run):
    run = recorded_run
    backend = run["backend"]
    with dask.config.set(run["settings"]):
        sink_url = runfiles.read(config.data_dir(), runfiles.SINK)["metrics_url"]
        raw, group = config.topic("raw"), config.get("sink.group-id")
        topics = [config.topic(t) for t in ("raw", "span-state", "prefix-stats", "gaps", "dead-letter")]
        app_id = config.get("processors.app-id")
    processor_url = f"http://127.0.0.1:{run['faust'].port}/metrics"

    sink = scrape(sink_url)
    for table in ("transitions", "envelopes", "logs", "lifecycle", "worker_metrics", "spans"):
        assert sink[("dask_blackbox_sink_rows_loaded_total", (("table", table),))] == count(backend, table)
    assert sink[("dask_blackbox_sink_dead_letters_total", ())] == count(backend, "dead_letters")
    dropped = backend.query("SELECT sum(dropped_events) FROM drops")[1][0][0]
    assert sink[("dask_blackbox_producer_dropped_events_total", ())] == dropped
    for topic in topics:
        assert sink[("dask_blackbox_consumer_lag", (("group", group), ("topic", topic)))] == 0

    processors = scrape(processor_url)
    assert processors[("dask_blackbox_processor_envelopes_total", ())] == count(backend, "envelopes")
    assert processors[("dask_blackbox_consumer_lag", (("group", app_id), ("topic", raw)))] == 0

    with dask.config.set(run["settings"]):
        produce([(b"garbage", b"not an envelope")])
    # one dead letter from the sink itself, one from the processors' dead-letter topic
    before = sink[("dask_blackbox_sink_dead_letters_total", ())]
    wait_for(lambda: scrape(sink_url)[("dask_blackbox_sink_dead_letters_total", ())] == before + 2
             == count(backend, "dead_letters"), 30, "the sink's and the processors' dead letters")
    wait_for(lambda: scrape(processor_url)[("dask_blackbox_processor_dead_letters_total", ())]
             == processors[("dask_blackbox_processor_dead_letters_total", ())] + 1, 30,
             "the processors' dead letter")
