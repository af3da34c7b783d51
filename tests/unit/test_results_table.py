"""bench/RESULTS.md is a results table, not a notebook: one row a figure, every row with
its value, range, runs, target, date and its own command, no cell over 200
characters, and little prose around it. What experiments concluded lives in
docs/performance.md as dated decisions of at most 5 lines each."""

from __future__ import annotations

import datetime
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "RESULTS.md"
DECISIONS = ROOT / "docs" / "performance.md"
HEADER = ["figure", "value", "range", "runs", "target", "date", "command"]
MAX_CELL = 200


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` is a pipe inside a cell)."""
    inner = line.strip()[1:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def table() -> tuple[list[str], list[list[str]], list[str]]:
    """The header, the rows, and the lines outside the table."""
    lines = RESULTS.read_text().splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("|")]
    assert rows == list(range(rows[0], rows[-1] + 1)), "one table, in one block"
    outside = lines[:rows[0]] + lines[rows[-1] + 1:]
    return cells(lines[rows[0]]), [cells(lines[i]) for i in rows[2:]], outside


def test_the_results_are_one_table_of_figures():
    header, rows, outside = table()
    assert header == HEADER
    assert len(rows) >= 10
    assert len([line for line in outside if line.strip()]) <= 12, "prose belongs in docs/"
    figures = [r[0] for r in rows]
    assert len(set(figures)) == len(figures), "one row a figure"
    for row in rows:
        assert len(row) == len(HEADER), row[0]
        for name, cell in zip(HEADER, row):
            assert cell, f"{row[0]}: no {name}"
            assert len(cell) <= MAX_CELL, f"{row[0]}: {name} is {len(cell)} characters"
        datetime.date.fromisoformat(row[HEADER.index("date")])
        command = row[HEADER.index("command")]
        assert re.fullmatch(r"`(nice -n -?\d+ )?python bench/\w+\.py[^`]*`", command), (
            f"{row[0]}: its own command, not {command!r}")
        script = re.search(r"bench/(\w+\.py)", command)[1]
        assert (ROOT / "bench" / script).exists(), command


def test_conclusions_are_dated_decisions_of_five_lines():
    entries: list[list[str]] = []
    for line in DECISIONS.read_text().splitlines():
        if line.startswith("- "):
            entries.append([line])
        elif line.startswith("  ") and entries:
            entries[-1].append(line)
        elif not line.strip() and entries:
            entries.append([])  # a blank line ends an entry
    entries = [e for e in entries if e]
    assert len(entries) >= 10
    for entry in entries:
        m = re.match(r"- \*\*(\d{4}-\d\d-\d\d) — [^*]+\*\*", entry[0])
        assert m, f"not a dated decision: {entry[0]!r}"
        datetime.date.fromisoformat(m[1])
        assert len(entry) <= 5, f"{entry[0]!r}: {len(entry)} lines"
