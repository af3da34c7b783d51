"""The ClickHouse schema: rendering the ``sql/NNN_name.sql`` migrations and applying them.

A migration file is plain ClickHouse SQL with a few ``{placeholders}`` (documented at
the top of each file) so a user can read it and run it by hand. :func:`render` fills
them from the configuration; :func:`migrate` applies, in version order, every
migration not yet recorded in ``<database>.schema_migrations``. Every statement is
idempotent (``IF NOT EXISTS``), so re-running a migration that was interrupted half
way is safe; a migration whose file changed after it was applied is an error, because
ClickHouse would silently keep the old definition.

Cluster mode (``blackbox.clickhouse.cluster`` set): DDL runs ``ON CLUSTER``, engines
become ``Replicated*``, each table is stored as ``<table>_local`` on every node and a
``Distributed`` table ``<table>`` (sharded by ``cluster_id``) is what the sink inserts
into and the queries read. Lines starting with ``--cluster: `` hold that extra DDL.

Lines starting with ``--backfill: `` are not DDL but statements that fill a table the
migration creates from rows loaded before it (an ``INSERT ... SELECT``, written to
count nothing twice if run again): :func:`migrate` runs them after the migration's
DDL (:func:`backfills`), in both modes; :func:`render` leaves them as comments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import re
from collections.abc import Iterator

from dask_blackbox.clickhouse import Target

__all__ = ["SQL_DIR", "PLACEHOLDERS", "MigrationError", "Migration", "Target", "migrations", "render",
           "statements", "backfills", "applied", "migrate"]

SQL_DIR = pathlib.Path(__file__).with_name("sql")

#: Placeholders a migration may use; anything else in braces is an error.
PLACEHOLDERS = ("database", "ttl", "rollup_ttl", "on_cluster", "replicated", "local", "cluster")

_CLUSTER_LINE = "--cluster: "
_BACKFILL_LINE = "--backfill: "
_MIGRATION_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


class MigrationError(RuntimeError):
    """A migration cannot be applied; the message names the file and the problem."""


@dataclasses.dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def migrations(directory: pathlib.Path = SQL_DIR) -> list[Migration]:
    """Every migration file, in version order; misnamed or duplicate versions are an error."""
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _MIGRATION_NAME.match(path.name)
        if not match:
            raise MigrationError(f"{path}: migration files are named NNN_snake_case.sql")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"{path}: version {version} is also {found[version].name}")
        found[version] = Migration(version, path.name, path.read_text())
    return [found[v] for v in sorted(found)]


def _filler(target: Target):
    values = target.placeholders

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise MigrationError(f"unknown placeholder {{{name}}}; known: {PLACEHOLDERS}")
        return values[name]

    return fill


def render(text: str, target: Target) -> str:
    """Fill the placeholders of a migration for ``target``; ``--cluster:`` lines are
    kept (unmarked) in cluster mode and dropped otherwise. Comments (``--backfill:``
    lines among them) are left as they are (they talk about placeholders, and about
    ClickHouse's own ``{macros}``)."""
    fill = _filler(target)
    lines = []
    for line in text.splitlines():
        if line.startswith(_CLUSTER_LINE):
            if target.cluster is None:
                continue
            line = line[len(_CLUSTER_LINE):]
        if not line.lstrip().startswith("--"):
            line = _PLACEHOLDER.sub(fill, line)
        lines.append(line)
    return "\n".join(lines)


def backfills(text: str, target: Target) -> list[str]:
    """The ``--backfill:`` statements of a migration, placeholders filled."""
    fill = _filler(target)
    body = "\n".join(_PLACEHOLDER.sub(fill, line[len(_BACKFILL_LINE):])
                     for line in text.splitlines() if line.startswith(_BACKFILL_LINE))
    return list(statements(body))


def statements(sql: str) -> Iterator[str]:
    """The statements of rendered SQL: comment lines removed, split at ``;``.

    Migrations keep ``;`` out of string literals and trailing comments, which is
    what makes this simple split exact.
    """
    body = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    for statement in body.split(";"):
        if statement.strip():
            yield statement.strip()


def applied(client, target: Target) -> dict[int, str]:
    """``{version: checksum}`` of the migrations recorded in ``target``'s database
    (empty when the database or the table does not exist yet)."""
    exists = client.query(
        "SELECT count() FROM system.tables WHERE database = {db:String} "
        "AND name = 'schema_migrations'",
        parameters={"db": target.database},
    ).result_rows[0][0]
    if not exists:
        return {}
    rows = client.query(
        f"SELECT version, checksum FROM {target.table('schema_migrations')} FINAL"
    ).result_rows
    return {int(version): checksum for version, checksum in rows}


def migrate(client, target: Target) -> list[str]:
    """Apply every pending migration to ``client``; return the names applied."""
    done = applied(client, target)
    ran = []
    for migration in migrations():
        if migration.version in done:
            if done[migration.version] != migration.checksum:
                raise MigrationError(
                    f"{migration.name} was changed after it was applied to "
                    f"{target.database}; schema changes go in a new migration file"
                )
            continue
        for statement in [*statements(render(migration.text, target)),
                          *backfills(migration.text, target)]:
            try:
                client.command(statement)
            except Exception as e:
                raise MigrationError(f"{migration.name}: {e}\nstatement: {statement[:300]}") from e
        client.insert(
            target.table("schema_migrations"),
            [[migration.version, migration.name, migration.checksum]],
            column_names=["version", "name", "checksum"],
        )
        ran.append(migration.name)
    return ran
