"""Compatibility names for the local Tansu broker; the brokers live in
:mod:`dask_blackbox.cli.brokers` (Tansu and Apache Kafka behind one interface)."""

from dask_blackbox.cli.brokers import TansuBroker, free_port, port_open, start_broker


def broker_command(port: int) -> list[str]:
    """The command line of a Tansu broker on 127.0.0.1:``port``."""
    return TansuBroker(port).command()


__all__ = ["TansuBroker", "broker_command", "free_port", "port_open", "start_broker"]
