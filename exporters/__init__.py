"""The OpenTelemetry exporters: recorded runs as traces (and log records) over OTLP.

A stage beside the sink: it reads the blackbox topics in a consumer group of its
own and imports the ground only. :mod:`.traces` says what a run's trace is (shared
by both ways of exporting), :mod:`.ids` how its ids are made (deterministic),
:mod:`.otlp` how it is sent (the OpenTelemetry SDK's exporters), :mod:`.journal` and
:mod:`.service` how the continuous exporter (``dask-blackbox exporter``) survives a
crash without losing or repeating a span.
"""
