"""Rendering query results for a person (a table that fits the terminal), or for a
program (JSON, CSV, or the plain wide table).

``table`` (the default) is drawn by `rich`_ to fit :data:`DEFAULT_WIDTH` columns
(or a narrower terminal): ids are shortened to :data:`ID_CHARS` characters, times
shown as wall-clock times (with the date when it is not today, UTC), durations and
bytes with units (one spelling everywhere: ``µs``, ``ms``, ``s``; ``B``, ``KiB``,
``MiB``, ``GiB``), mappings as their largest few entries, and a span tree (a result
with a ``depth`` column) drawn as a tree. Columns a person rarely needs (a parent's
id, raw start/stop times next to the elapsed time, tracebacks, depth) are left out.
Free text (an exception, a log message, a stimulus id: :data:`_WRAP_COLUMNS`) is
wrapped over lines rather than cut, and gives way first when the table is too wide;
a column a result was filtered on (the same cluster, key, worker or span in every
row) is said once above the table instead of in every row.
``wide`` prints every column and every value as it is, however wide; ``json`` and
``csv`` carry every column with full values, for programs.

Recorded data can hold anything, terminal escape codes too. No format prints a
control character (C0, DEL, C1) as it is: the tables and CSV show each as a visible
escape (``\x1b``; CSV keeps newlines and tabs inside its quoted fields), JSON as
``\u001b``; column names and section titles alike.

.. _rich: https://rich.readthedocs.io
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
import os
import contextlib
import re
import sys
from collections.abc import Iterator, Sequence

FORMATS = ("table", "wide", "json", "csv")

#: Widest default table, in columns.
DEFAULT_WIDTH = 120
#: Characters of an id shown in a table.
ID_CHARS = 8

#: Columns only the wide table, JSON and CSV show.
_DETAIL_COLUMNS = frozenset({"parent_id", "depth", "traceback", "exc_text",
                             "producer_id", "span_id"})
_ID_COLUMNS = frozenset({"cluster_id", "span_id", "parent_id", "producer_id", "partial_id"})
_BYTES_HINTS = ("nbytes", "bytes", "memory")
#: Columns that say what a row is: squeezed last.
_NAME_COLUMNS = frozenset({"name", "key", "cluster", "cluster_name", "prefix", "metric"})
#: Columns at most this wide are never squeezed; wider ones shrink to it at least.
_SHORT = 19
#: Columns of free text: wrapped over lines, never cut; squeezed first (down to 16).
_WRAP_COLUMNS = frozenset({"exception", "cause", "message", "msg", "text", "stimulus_id", "reason",
                           "explanation", "error"})
_WRAP_FLOOR = 16
#: Columns a result is filtered on: one value in every row (of two or more) is said
#: once, above the table.
_SAID_ONCE = ("cluster", "cluster_name", "cluster_id", "span", "key", "worker")


# --------------------------------------------------------------- plain values

#: Control characters: C0, DEL and C1 (a terminal acts on them).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: The same, but newlines and tabs (CSV quotes them).
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escape(match: re.Match) -> str:
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(match[0], f"\\x{ord(match[0]):02x}")


def printable(text: str, lines: bool = False) -> str:
    """``text`` with every control character shown as an escape (``\x1b``, ``\n``);
    ``lines``: newlines and tabs are kept."""
    return (_CONTROL_BUT_LINES if lines else _CONTROL).sub(_escape, text)



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


def _wide(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    columns = [printable(str(c)) for c in columns]
    cells = [[printable(_cell(v)) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.append(_count(len(cells)))
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"({n} row{'s' if n != 1 else ''})"


# ------------------------------------------------------------ human values


def nbytes(value: int) -> str:
    """Bytes in binary units, one spelling: ``512 B``, ``2.00 KiB``, ``1.50 MiB``,
    ``3.25 GiB``, ``1.00 TiB``."""
    sign, n = ("-" if value < 0 else ""), abs(int(value))
    if n < 1024:
        return f"{sign}{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.2f} {unit}"
    raise AssertionError("unreachable")


def seconds(value: float) -> str:
    """A duration with its unit: ``850 µs``, ``12.3 ms``, ``4.56 s``, ``3m 07s``,
    ``2h 05m``."""
    if not math.isfinite(value):
        return str(value)
    sign, value = ("-" if value < 0 else ""), abs(value)
    if value < 1e-3:
        text = f"{value * 1e6:.0f} µs"
    elif value < 1:
        text = f"{value * 1e3:.3g} ms"
    elif value < 60:
        text = f"{value:.3g} s"
    elif value < 3600:
        text = f"{int(value // 60)}m {int(value % 60):02d}s"
    else:
        text = f"{int(value // 3600)}h {int(value % 3600 // 60):02d}m"
    return sign + text


def _time(value: datetime.datetime, today: datetime.date, precise: bool = False) -> str:
    """A UTC wall-clock time, with the date unless it is today; ``precise`` adds
    milliseconds (event times in a story)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    value = value.astimezone(datetime.timezone.utc)
    if value.timestamp() <= 0:
        return ""
    text = value.strftime("%H:%M:%S" if value.date() == today else "%Y-%m-%d %H:%M:%S")
    return text + f".{value.microsecond // 1000:03d}" if precise else text


def short_id(text: str) -> str:
    """The first ID_CHARS characters of an id's distinctive part: Dask's
    ``Scheduler-<uuid>`` cluster ids lose their common ``Scheduler-``."""
    head, sep, body = text.partition("-")
    if sep and head.isalpha() and body:
        text = body
    return text[:ID_CHARS]


def _is_seconds(column: str) -> bool:
    return column.endswith("_s") or column.startswith(("compute_s", "task_s")) or column in (
        "duration", "elapsed", "max_duration")


def _is_bytes(column: str) -> bool:
    return any(h in column for h in _BYTES_HINTS)


def _is_byte_seconds(column: str) -> bool:
    return column.endswith("_byte_s")


def _human(column: str, value, today: datetime.date) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime.datetime):
        return _time(value, today, precise=column == "ts")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if column == "ts" and isinstance(value, float):
        return _time(datetime.datetime.fromtimestamp(value, datetime.timezone.utc), today, True)
    if isinstance(value, (int, float)):
        if _is_byte_seconds(column):
            return nbytes(int(value)) + "·s"
        if _is_bytes(column):
            return nbytes(int(value))
        if _is_seconds(column):
            return seconds(float(value))
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    if isinstance(value, dict):
        top = sorted(value.items(), key=lambda kv: -kv[1] if isinstance(kv[1], (int, float)) else 0)
        shown = [f"{k} {seconds(v) if _is_seconds(column) or column == 'by_action' else v}"
                 for k, v in top[:3]]
        return ", ".join(shown) + (f" +{len(top) - 3}" if len(top) > 3 else "")
    if isinstance(value, (list, tuple)):
        return " / ".join(map(str, value))
    text = str(value)
    if column in _ID_COLUMNS:
        return short_id(text)
    return text.splitlines()[0] if "\n" in text else text


def _tree_labels(names: list[str], depths: list[int]) -> list[str]:
    """Names drawn as a tree from their depths (rows in depth-first order)."""
    labels = []
    for i, (name, depth) in enumerate(zip(names, depths)):
        if depth <= 0:
            labels.append(name.strip())
            continue
        parts = []
        for level in range(1, depth + 1):
            # is there a later row at this level before the tree closes above it?
            later = next((d for d in depths[i + 1:] if d <= level), None)
            continues = later == level
            if level < depth:
                parts.append("│  " if continues else "   ")
            else:
                parts.append("├─ " if continues else "└─ ")
        labels.append("".join(parts) + name.strip())
    return labels


def _fit(naturals: list[int], names: list[bool], width: int,
         wraps: list[bool] | None = None) -> list[int]:
    """Column widths that fit ``width``: short columns (numbers, times, short ids) keep
    their width; long text gives way: free text that wraps first (down to 16), then
    other text (down to 8), name-like columns last (down to 24), the widest first."""
    wraps = wraps or [False] * len(naturals)
    budget = width - 3 * (len(naturals) - 1)  # a separator and padding between columns
    widths = list(naturals)
    floors = [min(n, _WRAP_FLOOR) if wrap else n if n <= _SHORT else (min(n, 24) if is_name else 8)
              for n, is_name, wrap in zip(naturals, names, wraps)]
    while sum(widths) > budget:
        shrinkable = [j for j in range(len(widths)) if widths[j] > floors[j]]
        if not shrinkable:
            break
        # wrapped text first, then the widest non-name column; names only when nothing else can give
        others = ([j for j in shrinkable if wraps[j]] or [j for j in shrinkable if not names[j]]
                  or shrinkable)
        j = max(others, key=lambda k: widths[k])
        widths[j] -= 1
    return widths


def _said_once(columns: list[str], rows: Sequence[Sequence], keep: list[int]) -> list[int]:
    """The kept columns a result was filtered on: the same value in each of its rows."""
    if len(rows) < 2:
        return []
    return [i for i in keep if columns[i] in _SAID_ONCE
            and all(r[i] == rows[0][i] for r in rows) and rows[0][i] not in (None, "")]


def _table(columns: Sequence[str], rows: Sequence[Sequence], width: int) -> str:
    # rich is imported where a table is drawn: commands that draw none start without it
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    columns = list(columns)
    today = datetime.datetime.now(datetime.timezone.utc).date()
    keep = [i for i, c in enumerate(columns) if c not in _DETAIL_COLUMNS]
    # raw start/stop times are noise next to an elapsed time
    if "elapsed_s" in columns:
        keep = [i for i in keep if columns[i] not in ("start", "stop")]
    once = _said_once(columns, rows, keep)
    keep = [i for i in keep if i not in once]
    heading = "   ".join(
        f"{printable(columns[i])}: "
        + printable(str(rows[0][i]) if columns[i] in _ID_COLUMNS else _human(columns[i], rows[0][i], today))
        for i in once)
    names = None
    if "depth" in columns and "name" in columns:
        d, n = columns.index("depth"), columns.index("name")
        names = _tree_labels([str(r[n]) for r in rows], [int(r[d] or 0) for r in rows])
    # A result of metric rows (``metric``, then one column per run): each value in
    # the unit of its row's metric.
    by_row = bool(columns) and columns[0] == "metric"
    wraps = [columns[i] in _WRAP_COLUMNS for i in keep]
    cells = [
        [Text(printable(names[r_index] if names is not None and columns[i] == "name"
                        else _human(str(row[0]) if by_row and i > 0 else columns[i], row[i],
                                    today)),
              no_wrap=not wrap, overflow="fold" if wrap else "ellipsis")
         for i, wrap in zip(keep, wraps)]
        for r_index, row in enumerate(rows)
    ]
    naturals = [max([len(printable(str(columns[i])))] + [c[j].cell_len for c in cells]) for j, i in enumerate(keep)]
    widths = _fit(naturals, [columns[i] in _NAME_COLUMNS for i in keep], width, wraps)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
    for j, i in enumerate(keep):
        numeric = any(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows)
        table.add_column(printable(str(columns[i])), justify="right" if numeric else "left",
                         overflow="fold" if wraps[j] else "ellipsis", no_wrap=not wraps[j],
                         width=widths[j])
    for row_cells in cells:
        table.add_row(*row_cells)
    console = Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False,
                      emoji=False, highlight=False, soft_wrap=False)
    console.print(table)
    text = console.file.getvalue().rstrip("\n")
    lines = [line.rstrip() for line in text.splitlines()]
    if heading:
        lines.insert(0, heading if len(heading) <= width else heading[:width - 1] + "…")
    return "\n".join(lines) + "\n" + _count(len(rows))


def terminal_width() -> int:
    """The width tables are drawn to: the terminal's, at most DEFAULT_WIDTH."""
    try:
        columns = os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (OSError, ValueError):
        columns = 0
    return min(columns or DEFAULT_WIDTH, DEFAULT_WIDTH)


def render(columns: Sequence[str], rows: Sequence[Sequence], fmt: str = "table",
           width: int | None = None) -> str:
    """The result as text in ``fmt`` (one of FORMATS)."""
    if fmt == "json":
        return json.dumps([dict(zip(columns, map(_plain, r))) for r in rows], indent=1)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([printable(str(c), lines=True) for c in columns])
        writer.writerows([printable(_cell(v), lines=True) for v in r] for r in rows)
        return out.getvalue().rstrip("\n")
    if fmt == "wide":
        return _wide(columns, rows)
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    return _table(columns, rows, width or terminal_width())


def split_columns(result, keys: Sequence[str], moved: Sequence[str], title: str,
                  second: str) -> dict:
    """``(columns, rows)`` as two titled sections for the table: ``title`` without the
    ``moved`` columns, and ``second`` with the ``keys`` columns (those present) and the
    ``moved`` ones -- a result too wide for one table at 120 columns."""
    columns, rows = result
    moved_at = [i for i, c in enumerate(columns) if c in moved]
    if not moved_at:
        return {title: result}
    kept = [i for i in range(len(columns)) if i not in moved_at]
    key_at = [i for i, c in enumerate(columns) if c in keys]
    return {title: ([columns[i] for i in kept], [[r[i] for i in kept] for r in rows]),
            second: ([columns[i] for i in key_at + moved_at],
                     [[r[i] for i in key_at + moved_at] for r in rows])}


def print_result(result, fmt: str) -> None:
    """Print ``(columns, rows)`` or a mapping of titled ``(columns, rows)`` sections."""
    if isinstance(result, dict):
        for title, (columns, rows) in result.items():
            title = printable(str(title))
            print(f"== {title}" if fmt in ("table", "wide") else f"# {title}")
            print(render(columns, rows, fmt))
            print()
    else:
        print(render(*result, fmt))


@contextlib.contextmanager
def working(what: str) -> Iterator[None]:
    """A spinner saying ``what`` is going on, on a terminal's stderr while the block
    runs (nothing when stderr is not a terminal, so output stays clean for programs)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(what):
        yield
