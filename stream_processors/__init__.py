"""dask-blackbox stream processors: a faust app that rebuilds span trees and
per-prefix aggregates from the raw topic (``faust -A dask_blackbox.stream_processors.app worker``).

Modules, from the wire inwards:

- :mod:`.app`: faust wiring (settings from ``dask.config``, topics, table, agent, timer);
- :mod:`.processor`: one worker's engine (apply, publish, checkpoint, rebalance);
- :mod:`.envelopes`: raw message -> envelope, or dead letter;
- :mod:`.cluster`: one cluster's state and how an envelope changes it;
- :mod:`.sequencing`, :mod:`.span_state`, :mod:`.prefix_stats`: its parts;
- :mod:`.checkpoint`: crash-consistent per-cluster checkpoints on the changelog;
- :mod:`.replay`: re-publish recorded envelopes under new identities (load tests).

Only :mod:`.app` imports faust; the rest is plain Python.
"""
