"""The read-only profile every query path runs under: the query server
(:mod:`.server`), the direct backend (:mod:`.backends`, what the CLI and
``queries.connect()`` use when no sink runs), and so every named query.

:class:`ReadOnlyClient` wraps a clickhouse-connect client and is the only way the
read side runs SQL. For each statement it:

1. has ClickHouse's own parser read it -- ``SELECT formatQuery({q:String})``, the
   text passed as a bound parameter, so nothing of it runs -- which refuses more than
   one statement (``SELECT 1; DROP TABLE t``) and returns one canonical statement
   without comments, with every string literal in one quoting;
2. checks the canonical text token by token (string literals and quoted identifiers
   are tokens of their own, so neither they nor comments can hide anything): it must
   start with SELECT, WITH, SHOW, DESCRIBE, DESC, EXPLAIN (of a SELECT) or EXISTS; it
   may not contain INTO OUTFILE; it may not call a function that reads files, URLs,
   other servers or the process's memory (every table function ClickHouse lists in
   ``system.table_functions`` except the few that only generate or read local tables,
   :data:`SAFE_TABLE_FUNCTIONS`, and the scalar functions in
   :data:`DENIED_FUNCTIONS`);
3. checks the parameters (:func:`check_parameters`): a mapping whose every name is a
   ``{name:Type}`` placeholder of the canonical text, outside string literals, and no
   ``%(name)s`` form in the text. clickhouse-connect binds parameters on the server
   (``param_<name>``, never spliced into the SQL) only when the text has such a
   placeholder; otherwise it splices them into the text itself (``query % values``,
   or raw bytes after a ``$name$`` marker), which would run text that was never
   checked. So the guard never lets it: with parameters, binding is always
   server-side;
4. runs the canonical text -- what ran is exactly what was checked -- with ClickHouse's
   ``readonly=1`` (no writes, no DDL, no settings changes: a query's own ``SETTINGS``
   cannot lift the limits) and the limits ``blackbox.query.max-execution-time``,
   ``max-memory-usage``, ``max-result-rows`` and ``max-result-bytes``.

A statement refused in steps 1-3 raises :class:`QueryRejected` (one line, saying
why) before it reaches ClickHouse. Every error message goes through
:func:`dask_blackbox.config.redact`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from dask_blackbox import config


class QueryError(RuntimeError):
    """A query failed; the message is ClickHouse's (or the query server's), redacted."""


class QueryRejected(QueryError):
    """The statement is not one read-only statement; refused before it ran."""


#: Table functions that only generate rows or read this server's own tables.
SAFE_TABLE_FUNCTIONS = frozenset({
    "numbers", "numbers_mt", "zeros", "zeros_mt", "values", "generaterandom",
    "generateseries", "generate_series", "null", "view", "merge", "primes",
    # format(FMT, 'inline data') shares its name with the scalar format(); readonly=1
    # refuses the table function (ClickHouse does not mark it readonly-safe).
    "format",
})

#: Denied even when ClickHouse cannot list its table functions (lower case).
DENIED_TABLE_FUNCTIONS = frozenset({
    "file", "filecluster", "url", "urlcluster", "remote", "remotesecure", "cluster",
    "clusterallreplicas", "s3", "s3cluster", "gcs", "oss", "cosn", "hdfs", "hdfscluster",
    "azureblobstorage", "azureblobstoragecluster", "mysql", "postgresql", "mongodb",
    "redis", "sqlite", "jdbc", "odbc", "input", "executable", "python", "dictionary",
    "filesystem", "iceberg", "deltalake", "hudi", "paimon", "ytsaurus", "bigquery",
    "arrowflight", "arrowstream", "loop", "viewifpermitted", "viewexplain",
})

#: Scalar functions that read files or reach other servers (lower case).
DENIED_FUNCTIONS = frozenset({"file", "hascolumnintable"})

_READ_STATEMENTS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS"})
_EXPLAIN_KINDS = frozenset({"AST", "SYNTAX", "QUERY", "TREE", "PLAN", "PIPELINE", "ESTIMATE"})

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>'(?:[^'\\]|\\.)*')
  | (?P<quoted>`(?:[^`\\]|\\.)*`|"(?:[^"\\]|\\.)*")
  | (?P<param>\{\s*[A-Za-z_][A-Za-z0-9_]*\s*:(?:[^{}'`"]|'(?:[^'\\]|\\.)*')*\})
  | (?P<word>[A-Za-z_][A-Za-z0-9_$]*)
  | (?P<number>[0-9][0-9A-Za-z_.]*)
  | (?P<other>.)
""", re.S | re.X)

#: A server-side placeholder as clickhouse-connect routes it: a name and a type.
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*):([^{}]+)\}", re.S)
#: Python's mapping format (``%(name)s``), what client-side binding substitutes.
_PYFORMAT = re.compile(r"%\([^)]*\)")

_BIND = ("parameters are bound by ClickHouse only, each to a {name:Type} placeholder "
         "outside string literals")
_WHAT_RUNS = ("only read-only statements are served: one SELECT, WITH, SHOW, DESCRIBE, "
              "EXPLAIN or EXISTS")


@dataclasses.dataclass(frozen=True)
class Token:
    kind: str  # word, quoted, string, param, number, other
    text: str

    @property
    def name(self) -> str:
        """A word, or a quoted identifier without its quotes (lower case)."""
        text = self.text[1:-1] if self.kind == "quoted" else self.text
        return re.sub(r"\\(.)", r"\1", text).lower() if self.kind == "quoted" else text.lower()

    def is_word(self, *words: str) -> bool:
        return self.kind == "word" and self.text.upper() in words


def tokens(sql: str) -> list[Token]:
    """ClickHouse SQL as tokens, whitespace dropped. Meant for ClickHouse's canonical
    text (``formatQuery``), which has no comments; an unterminated quote is an
    ``other`` token, which :func:`check_canonical` refuses."""
    out = []
    for m in _TOKEN.finditer(sql):
        if m.lastgroup != "space":
            out.append(Token(m.lastgroup, m.group()))
    return out


def check_canonical(sql: str, denied: frozenset[str]) -> None:
    """Raise QueryRejected unless ``sql`` (one canonical statement) only reads.
    ``denied``: lower-case names of functions it may not call."""
    toks = tokens(sql)
    for t in toks:
        if t.kind == "other" and t.text in "'\"`":
            raise QueryRejected(f"query refused: an unterminated quote; {_WHAT_RUNS}")
    first = next((t for t in toks if t.text != "("), None)
    if first is None or not first.is_word(*_READ_STATEMENTS):
        kind = first.text.upper() if first is not None else "an empty statement"
        raise QueryRejected(f"query refused: {kind} is not a read; {_WHAT_RUNS}")
    for i, t in enumerate(toks):
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if t.is_word("INTO") and nxt is not None and nxt.is_word("OUTFILE"):
            raise QueryRejected(f"query refused: INTO OUTFILE writes a file; {_WHAT_RUNS}")
        if t.kind in ("word", "quoted") and nxt is not None and nxt.text == "(" and t.name in denied:
            raise QueryRejected(
                f"query refused: {t.name}() is not allowed (nothing that reaches files, URLs, "
                f"other servers or process memory); {_WHAT_RUNS}")
        if t.is_word("EXPLAIN"):
            _check_explain(toks, i + 1)


def placeholders(sql: str) -> set[str]:
    """Names of the ``{name:Type}`` placeholders of ``sql`` outside string literals and
    quoted identifiers."""
    return {m[1] for t in tokens(sql) if t.kind == "param" and (m := _PLACEHOLDER.fullmatch(t.text))}


def check_parameters(sql: str, parameters) -> dict | None:
    """The parameters to send with the canonical statement ``sql``, checked so that
    they can only be bound on the server: None or a mapping (empty: None) whose every
    name is a ``{name:Type}`` placeholder of ``sql`` (:func:`placeholders`), and, with
    parameters, no ``%(name)s`` anywhere in ``sql``. QueryRejected otherwise."""
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise QueryRejected(
            f"query refused: parameters must be a mapping of names to values, not a "
            f"{type(parameters).__name__}; {_BIND}")
    if not parameters:
        return None
    if _PYFORMAT.search(sql):
        raise QueryRejected(f"query refused: %(name)s placeholders are not bound; {_BIND}")
    named = placeholders(sql)
    stray = sorted(repr(k)[:60] for k in parameters if not isinstance(k, str) or k not in named)
    if stray:
        raise QueryRejected(
            f"query refused: parameter {', '.join(stray)} is not a {{name:Type}} placeholder "
            f"of the statement; {_BIND}")
    return parameters


def _check_explain(toks: list[Token], i: int) -> None:
    """EXPLAIN [kind] [setting = value, ...] must explain a SELECT."""
    while i < len(toks) and toks[i].is_word(*_EXPLAIN_KINDS):
        i += 1
    while (i + 2 < len(toks) and toks[i].kind == "word" and toks[i + 1].text == "="):
        i += 3
        if i < len(toks) and toks[i].text == ",":
            i += 1
    if i >= len(toks) or not (toks[i].text == "(" or toks[i].is_word("SELECT", "WITH")):
        raise QueryRejected(f"query refused: EXPLAIN of something other than a SELECT; {_WHAT_RUNS}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """``blackbox.query.*``: what one query may use."""

    max_execution_time: float
    max_memory_usage: int
    max_result_rows: int
    #: bytes of one result (uncompressed, as ClickHouse counts them): what a reader
    #: can make the process answering it hold
    max_result_bytes: int = 256 * 2**20

    @classmethod
    def from_config(cls) -> Limits:
        return cls(config.get_seconds("query.max-execution-time", minimum=0.001),
                   config.get_bytes("query.max-memory-usage"),
                   config.get_int("query.max-result-rows"),
                   config.get_bytes("query.max-result-bytes"))

    @property
    def settings(self) -> dict:
        """The read-only profile: ClickHouse settings sent with every read query."""
        return {
            "readonly": 1,
            "max_execution_time": self.max_execution_time,
            "max_memory_usage": self.max_memory_usage,
            "max_result_rows": self.max_result_rows,
            "max_result_bytes": self.max_result_bytes,
            "result_overflow_mode": "throw",
            "allow_introspection_functions": 0,  # chDB turns them on
        }


def _clickhouse_message(error: BaseException) -> str:
    """ClickHouse's message, one line, without the echo of our formatQuery wrapper."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.split(r":? In scope SELECT formatQuery\(", text)[0]
    return config.redact(text)


#: What :func:`ReadOnlyClient` reads.
TABLE_FUNCTIONS = "SELECT name FROM system.table_functions"
#: What :func:`ReadOnlyClient` reads.
FORMAT_QUERY = "SELECT formatQuery({q:String})"


class ReadOnlyClient:
    """Runs one checked, read-only statement at a time on a clickhouse-connect client
    (see the module docstring). Nothing else of the client is reachable through it."""

    def __init__(self, client, limits: Limits | None = None) -> None:
        self._client = client
        self.limits = limits or Limits.from_config()
        self._denied: frozenset[str] | None = None
        self.check = functools.lru_cache(maxsize=512)(self._check)

    def _denied_names(self) -> frozenset[str]:
        if self._denied is None:
            listed: set[str] = set()
            try:
                result = self._client.query(TABLE_FUNCTIONS,
                                            settings=self.limits.settings)
                listed = {str(r[0]).lower() for r in result.result_rows}
            except Exception:  # an old or restricted server: the static lists still apply
                pass
            self._denied = frozenset((listed - SAFE_TABLE_FUNCTIONS) | DENIED_TABLE_FUNCTIONS
                                     | DENIED_FUNCTIONS)
        return self._denied

    def _check(self, sql: str) -> str:
        """The canonical text of ``sql`` if it is one read-only statement; else
        QueryRejected (QueryError if ClickHouse cannot parse it)."""
        if not isinstance(sql, str) or not sql.strip():
            raise QueryRejected(f"query refused: no SQL given; {_WHAT_RUNS}")
        try:
            result = self._client.query(FORMAT_QUERY, parameters={"q": sql},
                                        settings=self.limits.settings)
        except Exception as e:
            message = _clickhouse_message(e)
            if "Multi-statements are not allowed" in message:
                raise QueryRejected(f"query refused: more than one statement; {_WHAT_RUNS}") from None
            raise QueryError(message) from None
        canonical = result.result_rows[0][0]
        check_canonical(canonical, self._denied_names())
        return canonical

    def query(self, sql: str, parameters: dict | None = None):
        """clickhouse-connect's QueryResult of ``sql`` run read-only; QueryRejected
        before it runs if it is not one read, QueryError if ClickHouse fails it."""
        canonical = self.check(sql)
        bound = check_parameters(canonical, parameters)
        try:
            return self._client.query(canonical, parameters=bound,
                                      settings=self.limits.settings)
        except Exception as e:
            raise QueryError(_clickhouse_message(e)) from None

    def close(self) -> None:
        self._client.close()
