"""The read side: reaching ClickHouse (directly or through a running sink's query
server), the named queries the CLI and the UI run, and the query server itself.

It reads what the sink wrote and imports only the ground (:mod:`dask_blackbox`'s
contract, config and ClickHouse connection helpers), never a stage.
"""
