"""The local deployment: the brokers ``dask-blackbox up`` runs (Tansu or Apache Kafka,
:mod:`.brokers`) and the supervisor that starts, watches, restarts and drains the
pipeline's processes on one machine (:mod:`.supervisor`).

A floor of its own under the roof, as ``distributed.deploy`` sits apart from
``distributed.cli``: the CLI, the demo, the benchmarks and the tests import it; it
imports the ground and the stages' settings, never the read side or the CLI (it runs
the CLI's commands as processes: ``python -m dask_blackbox.cli sink``).
"""
