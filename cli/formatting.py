"""Rendering query results as a text table, JSON or CSV."""

from __future__ import annotations

import csv
import datetime
import io
import json
from collections.abc import Sequence

FORMATS = ("table", "json", "csv")


def _plain(value):
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _cell(value) -> str:
    value = _plain(value)
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def render(columns: Sequence[str], rows: Sequence[Sequence], fmt: str = "table") -> str:
    """The result as text in ``fmt`` (one of FORMATS)."""
    if fmt == "json":
        return json.dumps([dict(zip(columns, map(_plain, r))) for r in rows], indent=1)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([_cell(v) for v in r] for r in rows)
        return out.getvalue().rstrip("\n")
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.append(f"({len(cells)} row{'s' if len(cells) != 1 else ''})")
    return "\n".join(lines)


def print_result(result, fmt: str) -> None:
    """Print ``(columns, rows)`` or a mapping of titled ``(columns, rows)`` sections."""
    if isinstance(result, dict):
        for title, (columns, rows) in result.items():
            print(f"== {title}" if fmt == "table" else f"# {title}")
            print(render(columns, rows, fmt))
            print()
    else:
        print(render(*result, fmt))
