"""What every named query shares: time bounds, the WHERE builder, and naming clusters.

A named query takes ``cluster`` (a cluster name or id; None: all clusters), ``since``
and ``until`` (a ``datetime``, naive ones taken as UTC, or seconds since the epoch;
None: unbounded) and turns them into a :class:`Filter` of conditions with
server-side bound parameters (``{name:Type}``), never SQL spliced from values.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from dask_blackbox.read.backends import Backend

TimeBound = datetime.datetime | float | int | None


class UnknownCluster(LookupError):
    """``--cluster`` names no cluster that was ever recorded."""


def epoch(value: TimeBound, name: str) -> float | None:
    """``value`` as seconds since the epoch (None stays None); TypeError naming
    ``name`` for anything else."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} must be a datetime or seconds since the epoch, not {value!r}")


@dataclasses.dataclass
class Filter:
    """WHERE conditions and their parameters, built up per query."""

    conditions: list[str] = dataclasses.field(default_factory=list)
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add(self, condition: str, **parameters) -> None:
        self.conditions.append(condition)
        self.parameters.update(parameters)

    def where(self) -> str:
        return ("WHERE " + " AND ".join(self.conditions)) if self.conditions else ""

    def and_(self) -> str:
        """The word that adds one more condition after :meth:`where`."""
        return "AND" if self.conditions else "WHERE"


def table(backend: Backend, name: str) -> str:
    """``database.name`` for the backend's database."""
    return f"{backend.database}.{name}"


#: What :func:`cluster_ids_sql` reads (from ``{envelopes}``, ``{clusters}``).
#: A cluster whose envelopes expired, by its last name (the roll-ups keep it)
CLUSTER_IDS_SQL = ("SELECT DISTINCT cluster_id FROM {envelopes} WHERE cluster_id = "
                   "{{c:String}} OR cluster_name = {{c:String}} UNION DISTINCT SELECT "
                   "cluster_id FROM {clusters} WHERE cluster_id = {{c:String}} OR "
                   "cluster_name = {{c:String}}")


def cluster_ids_sql(backend: Backend) -> str:
    """A statement selecting the distinct ids of the cluster(s) named or identified by
    the parameter ``c`` (several runs may share a name), to run or to embed."""
    return (
        CLUSTER_IDS_SQL.format(envelopes=table(backend, 'envelopes'), clusters=table(backend, 'clusters'))
    )


def cluster_ids(backend: Backend, cluster: str | None) -> list[str] | None:
    """The ids of the cluster(s) named or identified by ``cluster`` (several runs may
    share a name); None for "all"; UnknownCluster if nothing matches."""
    if cluster is None:
        return None
    _, rows = backend.query(cluster_ids_sql(backend), {"c": cluster})
    if not rows:
        raise UnknownCluster(f"no recorded cluster is named {cluster!r} or has that id")
    return sorted(r[0] for r in rows)


def build(backend: Backend, cluster: str | None, since: TimeBound, until: TimeBound,
          time_column: str | None, cluster_column: str = "cluster_id") -> Filter:
    """The filter for ``cluster`` on ``cluster_column`` and [since, until) on
    ``time_column`` (None: no time condition)."""
    f = Filter()
    ids = cluster_ids(backend, cluster)
    if ids is not None:
        f.add(f"{cluster_column} IN {{clusters:Array(String)}}", clusters=ids)
    start, stop = epoch(since, "since"), epoch(until, "until")
    if time_column and start is not None:
        f.add(f"{time_column} >= toDateTime64({{since:Float64}}, 6, 'UTC')", since=start)
    if time_column and stop is not None:
        f.add(f"{time_column} < toDateTime64({{until:Float64}}, 6, 'UTC')", until=stop)
    return f


def pairs(first: str, second: str, values: list[tuple[str, str]]) -> tuple[str, dict]:
    """SQL matching rows whose (first, second) columns are one of ``values``: two
    parallel array parameters (tuples do not survive the query server's JSON)."""
    return (f"has(arrayZip({{{first}s:Array(String)}}, {{{second}s:Array(String)}}), ({first}, {second}))",
            {f"{first}s": [a for a, _ in values], f"{second}s": [b for _, b in values]})


#: What :func:`cluster_names` reads (from ``{clusters}``).
CLUSTER_NAMES = "SELECT cluster_id, cluster_name FROM {clusters}"


def cluster_names(backend: Backend) -> dict[str, str]:
    """cluster_id -> latest cluster name."""
    _, rows = backend.query(CLUSTER_NAMES.format(clusters=table(backend, 'clusters')))
    return dict(rows)


def clusters_condition(ids: list[str] | None, column: str = "cluster_id") -> tuple[str, dict]:
    """The condition that keeps the clusters ``ids`` (None: every cluster) on
    ``column``, and its parameters."""
    if ids is None:
        return "1", {}
    return f"{column} IN {{clusters:Array(String)}}", {"clusters": ids}
