"""The central log search: the recorded log records of the scheduler, the workers and
their nannies, filtered by cluster, window, worker, level, logger and text
(:func:`logs`, :func:`logs_count`; re-exported by :mod:`.queries`).
"""

from __future__ import annotations

from dask_blackbox.read.backends import Backend, Result
from dask_blackbox.read.filters import Filter, TimeBound, build, table

#: Log levels, lowest first: a level filter keeps that level and above.
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: The newest ``limit`` log records matching ``{where}``, newest first.
LOG_RECORDS = ("SELECT ts, level, source, worker, logger, key, message, exc_text, cluster_id, "
               "producer_id, seq, idx FROM {logs} {where} "
               "ORDER BY ts DESC, seq DESC, idx DESC LIMIT {{limit:UInt32}}")
#: How many log records match ``{where}``.
LOG_COUNT = "SELECT count() FROM {logs} {where}"


def _logs_filter(backend: Backend, cluster: str | None, since: TimeBound, until: TimeBound,
                 worker: str | None, level: str | None, logger: str | None,
                 text: str | None) -> Filter:
    f = build(backend, cluster, since, until, "ts")
    if worker == "scheduler":
        f.add("source = 'scheduler' AND worker = ''")
    elif worker:
        # a worker's records and its nanny's (both name it); a process id, as recorded
        f.add("(worker = {worker:String} OR process = {worker:String})", worker=worker)
    if level:
        level = level.upper()
        if level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
        f.add("level IN {levels:Array(String)}", levels=list(LEVELS[LEVELS.index(level):]))
    if logger:
        f.add("(logger = {logger:String} OR startsWith(logger, {logger_dot:String}))",
              logger=logger, logger_dot=logger + ".")
    if text:
        f.add("positionCaseInsensitiveUTF8(concat(message, ' ', exc_text), {text:String}) > 0",
              text=text)
    return f


def logs(backend: Backend, cluster: str | None = None, since: TimeBound = None,
         until: TimeBound = None, worker: str | None = None, level: str | None = None,
         logger: str | None = None, text: str | None = None, limit: int = 500) -> Result:
    """The central log search: the newest ``limit`` log records matching every filter,
    oldest first -- ``ts``, ``level``, ``source`` (scheduler, worker or nanny),
    ``worker`` (the worker a record concerns: its own and its nanny's records name
    it), ``logger``, ``key`` (the task a worker thread was running), ``message``,
    ``exc_text``, then ``cluster_id``, ``producer_id``, ``seq``, ``idx`` (together
    they identify a record).

    ``worker``: a worker's address (its records and its nanny's), "scheduler" (the
    scheduler's), or a process id; ``level``: that level and above; ``logger``: that
    logger and its children (``distributed`` takes ``distributed.worker``); ``text``:
    a case-insensitive substring of the message or the exception text."""
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, not {limit!r}")
    f = _logs_filter(backend, cluster, since, until, worker, level, logger, text)
    f.parameters["limit"] = limit
    columns, rows = backend.query(
        LOG_RECORDS.format(logs=table(backend, "logs"), where=f.where()), f.parameters)
    return columns, rows[::-1]


def logs_count(backend: Backend, cluster: str | None = None, since: TimeBound = None,
               until: TimeBound = None, worker: str | None = None, level: str | None = None,
               logger: str | None = None, text: str | None = None) -> int:
    """How many log records match :func:`logs`'s filters."""
    f = _logs_filter(backend, cluster, since, until, worker, level, logger, text)
    _, rows = backend.query(LOG_COUNT.format(logs=table(backend, "logs"), where=f.where()),
                            f.parameters)
    return rows[0][0]
