"""The read side: reaching ClickHouse (directly or through a running sink's query
server), the named queries the CLI and the UI run, and the query server itself.

- :mod:`.backends` -- ``connect()``: chDB or a server directly, or a running sink's
  query server; :mod:`.guard` -- every statement is one read, checked by ClickHouse's
  parser and run read-only with limits; :mod:`.server` -- the query server;
- :mod:`.filters`, :mod:`.queries`, :mod:`.failures` -- the named queries;
  :mod:`.diagnosis` -- why each worker died and each KilledWorker's suspect (the
  rules are :mod:`dask_blackbox.causes`, shared with the alerter);
- :mod:`.views` -- the panels of the Run page and of a worker's page, a module each
  (its data, raw and rolled up, and its figures); :mod:`.panels` -- the other pages;
  :mod:`.report`, :mod:`.api`, :mod:`.web`, ``ui/`` -- the web UI, HTML reports and
  the JSON API (Bokeh, Starlette, Jinja2).

It reads what the sink wrote and imports only the ground (:mod:`dask_blackbox`'s
contract, config and ClickHouse connection helpers), never a stage.
"""
