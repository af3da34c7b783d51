"""dask-blackbox stream processors: a faust app that rebuilds span trees and
per-prefix aggregates from the raw topic (``faust -A dask_blackbox.stream_processors.app worker``).

Modules, from the wire inwards:

- :mod:`.settings`: :class:`~.settings.ProcessorSettings`, resolved from ``dask.config`` once;
- :mod:`.app`: faust wiring (:func:`~.app.create_app`: topics, table, agent, timer);
- :mod:`.processor`: one worker's engine (apply, publish, checkpoint, rebalance);
- :mod:`.envelopes`: raw message -> envelope, or dead letter;
- :mod:`.cluster`: one cluster's state and how an envelope changes it;
- :mod:`.sequencing`, :mod:`.span_state`, :mod:`.prefix_stats`: its parts;
- :mod:`.checkpoint`: crash-consistent, format-versioned per-cluster checkpoints on the
  changelog.

Only :mod:`.app` imports faust; the rest is plain Python.
"""
