"""Each table's SQL is written once: the read side's SQL statements are named queries
(module-level constants or small functions) that every caller uses, never the same
statement typed out again beside another.

The audit reads every module of ``read/`` with :mod:`ast`, takes each string literal
and f-string (implicit concatenation and ``+`` of literals read as one) whose text
starts with ``SELECT`` or ``WITH``, and normalizes it: whitespace collapsed, every
table-name placeholder (``{table(backend, 'lifecycle')}``, ``{_t(backend,
'lifecycle')}``, a local ``{lifecycle}``, a ``.format`` field ``{lifecycle}``) read as
``{lifecycle}``, and any other interpolated expression by its source text. Two
statements that then read alike but for their conditions (:func:`shape`) are one
query written twice as well. In every module of read/ each statement is a named
query, the value of a module-level assignment (:func:`inline` finds the others). To
read what it finds:
``python tests/unit/test_named_queries.py``.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
READ = ROOT / "read"

#: shapes (:func:`shape`) of different queries that read alike, each with why
DIFFERENT_QUERIES_ALIKE: dict[str, str] = {}


def _placeholder(node: ast.expr) -> str:
    """How an interpolated expression reads in a normalized statement: a table name
    (the string argument of ``table``/``_t``, or a bare name) as ``{name}``, anything
    else by its source."""
    if isinstance(node, ast.Call):
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if len(names) == 1 and not node.keywords:
            return "{" + names[0] + "}"
    if isinstance(node, ast.Name):
        return "{" + node.id + "}"
    return "{" + ast.unparse(node) + "}"


def _text(node: ast.expr) -> str | None:
    """The text of a string literal, an f-string or a ``+`` of them (None otherwise)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        # a literal ``.format``-ed later writes ``{{``: read as the braces it becomes
        return node.value.replace("{{", "{").replace("}}", "}")
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                assert isinstance(value, ast.FormattedValue)
                parts.append(_placeholder(value.value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is not None or right is not None:  # a literal + an expression
            return ((_placeholder(node.left) if left is None else left)
                    + (_placeholder(node.right) if right is None else right))
    return None


def normalize(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\(\s+", "(", text)
    return re.sub(r"\s+\)", ")", text)


def statements() -> list[tuple[str, str, int]]:
    """(normalized text, module, line) of every SQL statement written in read/."""
    found = []
    for path in sorted(READ.rglob("*.py")):
        found += [(sql, str(path.relative_to(ROOT)), line) for sql, line in written(path.read_text())]
    return found


def written(source: str) -> list[tuple[str, int]]:
    """(normalized text, line) of every SQL statement written in a module's source."""
    return [(sql, node.lineno) for node, sql in _sql_nodes(ast.parse(source))]


def inline(source: str) -> list[tuple[str, int]]:
    """(normalized text, line) of the SQL statements of a module's source written
    where they are run, not as a named query (the value of a module-level
    assignment)."""
    tree = ast.parse(source)
    named = {id(sub) for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             and node.value is not None for sub in ast.walk(node.value)}
    return [(sql, node.lineno) for node, sql in _sql_nodes(tree) if id(node) not in named]


def _sql_nodes(tree: ast.AST) -> list[tuple[ast.expr, str]]:
    """(node, normalized text) of every SQL statement written in a parsed module."""
    found = []
    inner: set[int] = set()  # the parts of a ``+`` already read with its whole
    for node in ast.walk(tree):
        if id(node) in inner or not isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)):
            continue
        text = _text(node)
        if text is None:
            continue
        for sub in ast.walk(node):
            inner.add(id(sub))
        sql = normalize(text)
        if re.match(r"\(*\s*(SELECT|WITH)\s+\S", sql):
            found.append((node, sql))
    return found


def shape(sql: str) -> str:
    """A statement with its conditions left out (each ``WHERE ...`` up to its
    ``GROUP BY``/``ORDER BY``/``LIMIT``/``UNION``/closing parenthesis, and each
    interpolated filter such as ``{f.where()}``): two statements of one shape read the
    same columns of the same table, filtered differently (or the same)."""
    sql = re.sub(r"\{[^{}]*(where|and_|condition|in_span|only)[^{}]*\}", " ", sql)
    out, i = [], 0
    while (m := re.compile(r"\bWHERE\b").search(sql, i)):
        out.append(sql[i:m.start()])
        i, depth = m.end(), 0
        while i < len(sql) and not (depth == 0 and _END.match(sql, i)):
            depth += {"(": 1, ")": -1}.get(sql[i], 0)
            if depth < 0:
                break
            i += 1
    return normalize("".join(out) + sql[i:])


#: what ends a WHERE clause at its own depth
_END = re.compile(r"\s(GROUP BY|ORDER BY|LIMIT|UNION|HAVING|SETTINGS)\b")


def alike() -> dict[str, list[str]]:
    """Shape (:func:`shape`) -> where statements of it are written, for those of one
    shape written more than once (the same text or not)."""
    where = collections.defaultdict(list)
    for sql, module, line in statements():
        where[shape(sql)].append(f"{module}:{line}")
    return {s: places for s, places in where.items() if len(places) > 1}


def duplicates() -> dict[str, list[str]]:
    """Normalized statement -> where it is written, for those written more than once."""
    where = collections.defaultdict(list)
    for sql, module, line in statements():
        where[sql].append(f"{module}:{line}")
    return {sql: places for sql, places in where.items() if len(places) > 1}


def test_the_audit_finds_the_read_sides_statements():
    """The audit reads what it should: many statements across read/ and its views."""
    found = statements()
    modules = {m for _, m, _ in found}
    assert len(found) > 100
    assert "read/queries.py" in modules and any(m.startswith("read/views/") for m in modules)


def test_the_audit_reads_one_statement_however_it_is_written():
    """One statement, its table named by ``table``, ``_t`` or a ``.format`` field, its
    lines broken anywhere: one text; the same columns filtered otherwise: one shape."""
    source = """
a = (f"SELECT key, ts FROM {table(backend, 'transitions')} "
     "WHERE cluster_id = {c:String} ORDER BY ts")
b = f"SELECT key,  ts\\nFROM {_t(backend, 'transitions')} WHERE cluster_id = {{c:String}} ORDER BY ts"
C = "SELECT key, ts FROM {transitions} WHERE cluster_id = {{c:String}} ORDER BY ts"
d = ("SELECT key, ts FROM " + t + " {where} ORDER BY ts")
e = f"SELECT key, ts FROM {_t(backend, 'transitions')} WHERE key IN {{k:Array(String)}} ORDER BY ts"
FROZEN = frozenset({"SELECT", "WITH"})
"""
    found = [sql for sql, _ in written(source)]
    assert len(found) == 5
    assert len(set(found[:3])) == 1
    assert {shape(sql) for sql in found[:3] + found[4:]} == {"SELECT key, ts FROM {transitions} ORDER BY ts"}


def test_the_audit_tells_inline_sql_from_a_named_query():
    source = """
NAMED = ("SELECT key FROM {transitions} WHERE cluster_id = {{c:String}} "
         "ORDER BY ts")
def f(backend, t):
    backend.query(NAMED.format(transitions=t), {})
    backend.query(f"SELECT key FROM {_t(backend, 'transitions')} ORDER BY ts", {})
    backend.query("SELECT count() " + t, {})
"""
    assert len(written(source)) == 3
    assert [line for _, line in inline(source)] == [6, 7]


def inline_in_read() -> list[str]:
    """Where a module of read/ (its views too) writes a statement inline."""
    return [f"{path.relative_to(ROOT)}:{line}: {sql[:100]}"
            for path in sorted(READ.rglob("*.py")) for sql, line in inline(path.read_text())]


def test_no_module_of_the_read_side_writes_its_sql_inline():
    """The read side's SQL is named queries: a module-level constant of the module
    that runs it (or of :mod:`.queries` or :mod:`.statements` when several modules run
    it), formatted with its tables and conditions where it is run. A view's as well as
    the CLI's, the reports' and the API's."""
    found = inline_in_read()
    assert not found, "SQL written inline in read/ (name it a module-level query):\n" + \
        "\n".join(found)


def test_no_sql_statement_is_written_twice():
    dup = duplicates()
    assert not dup, "SQL statements written more than once (name one query, use it everywhere):\n" + \
        "\n".join(f"{', '.join(places)}:\n    {sql}" for sql, places in sorted(dup.items()))


def test_no_two_statements_read_the_same_columns_of_a_table_but_for_their_conditions():
    """Statements of one shape (:func:`shape`) are one query written twice with other
    conditions: one named query with a slot for its conditions, used by both."""
    dup = {s: places for s, places in alike().items() if s not in DIFFERENT_QUERIES_ALIKE}
    assert not dup, "SQL statements alike (one named query, its conditions a slot):\n" + \
        "\n".join(f"{', '.join(places)}:\n    {sql}" for sql, places in sorted(dup.items()))


if __name__ == "__main__":  # the audit, to read: python tests/unit/test_named_queries.py
    print("written twice:")
    for sql, places in sorted(duplicates().items()):
        print(" ", ", ".join(places))
        print("     ", sql)
    print("inline in read/:")
    for place in inline_in_read():
        print(" ", place)
    print("alike (the same columns of the same table, other conditions):")
    for sql, places in sorted(alike().items()):
        print(" ", ", ".join(places))
        print("     ", sql)
