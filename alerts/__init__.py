"""dask-blackbox alerts: notifications on Dask semantics, from the raw topic.

A stage beside the stream processors and the sink: it reads the raw topic in a
consumer group of its own and imports the ground only (the contract, the config,
:mod:`dask_blackbox.causes`, which it shares with the read side so that a death has
one cause wherever it is shown).

- :mod:`.settings` -- the rules (``blackbox.alerts.rules``): a worker death with a
  given cause, a KilledWorker, a task erred in a named prefix or span; each to a
  webhook or a command;
- :mod:`.watch` -- envelopes to incidents (plain Python, no I/O);
- :mod:`.delivery` -- one incident to its target, with retries and backoff;
- :mod:`.checkpoint` -- offsets, state and outbox, written atomically;
- :mod:`.service` -- the loop that ties them, once per incident across crashes.

Run it with ``dask-blackbox alerts``; ``dask-blackbox up`` runs it as a child when
rules are configured.
"""
