"""Rendering query results for a person (a table that fits the terminal), or for a
program (JSON, CSV, or the plain wide table).

``table`` (the default) is drawn by `rich`_ to fit :data:`DEFAULT_WIDTH` columns
(or a narrower terminal): ids are shortened to :data:`ID_CHARS` characters, times
shown as wall-clock times (with the date when it is not today, UTC), durations and
bytes with units (one spelling everywhere: ``µs``, ``ms``, ``s``; ``B``, ``KiB``,
``MiB``, ``GiB``), mappings as their largest few entries, and a span tree (a result
with a ``depth`` column) drawn as a tree. Columns a person rarely needs (a parent's
id, raw start/stop times next to the elapsed time, tracebacks, depth) are left out.
Nothing that identifies or counts is cut: a header too wide for its column wraps at
its underscores, and numbers, times, addresses, keys and stimulus ids keep their
width. Free text (an exception, a log message: :data:`_WRAP_COLUMNS`) gives way
first, wrapped at word boundaries; when the row still does not fit, the long text
(:data:`_BELOW_COLUMNS`) is printed below its row instead. A column a result was
filtered on (the same cluster, key, worker or span in every row) is said once above
the table instead of in every row; an empty section is one line.
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
#: Columns that say what a row is: squeezed last, and never below :data:`_NAME_FLOOR`.
_NAME_COLUMNS = frozenset({"name", "key", "cluster", "cluster_name", "prefix", "metric"})
_NAME_FLOOR = 40
#: Identifiers and addresses: never cut.
_WHOLE_COLUMNS = frozenset({"worker", "address", "stimulus_id", "group", "topic", "producer",
                            "logger", "source", "host", "cause",
                            # compare's measurements: medians, intervals, p-values
                            "action", "verdict", "median per task", "change [interval]", "p",
                            "band", "total"})
#: Other text at most this wide is never squeezed; wider text shrinks to 8 at least.
_SHORT = 19
#: Columns of free text: wrapped at word boundaries, squeezed first (not below their
#: longest word, up to :data:`_WRAP_FLOOR`).
_WRAP_COLUMNS = frozenset({"exception", "message", "msg", "text", "reason",
                           "explanation", "error", "summary", "by_action"})
_WRAP_FLOOR = 24
#: Free text keeps this width while other columns can still give way.
_WRAP_SOFT = 30
#: Long text printed below its row when the row does not fit with it.
_BELOW_COLUMNS = frozenset({"exception", "message", "msg", "text", "reason",
                            "explanation", "error", "summary"})
#: Between two columns: one space of padding and the separator.
_GAP = 2
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
    sign, n = ("-" if value < 0 else ""), float(abs(int(value)))
    if n < 1024:
        return f"{sign}{int(n)} B"
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


def _fit(naturals: list[int], stages: list[list[int]], names: list[bool], width: int) -> list[int]:
    """Column widths that fit ``width`` if the last stage's floors do. Stage by stage,
    each column gives way down to that stage's width for it, the widest first and
    name-like columns last."""
    budget = width - _GAP * (len(naturals) - 1)
    widths = list(naturals)
    for targets in stages:
        while sum(widths) > budget:
            shrinkable = [j for j in range(len(widths)) if widths[j] > targets[j]]
            if not shrinkable:
                break
            others = [j for j in shrinkable if not names[j]] or shrinkable
            j = max(others, key=lambda k: widths[k])
            widths[j] -= 1
    return widths


def _floor(column: str, cells: list, wrap: bool, numeric: bool) -> int:
    """How narrow a column's values may get: numbers, times, ids and addresses not at
    all; free text down to its longest word; names down to _NAME_FLOOR; other text to 8
    (the header wraps at its underscores, see :func:`_header_floor`)."""
    natural = max([c.cell_len for c in cells] or [0])
    if wrap:
        longest = max([len(w) for c in cells for w in c.plain.split()] or [1])
        return min(natural, max(min(longest, _WRAP_FLOOR), 8))
    if numeric or column in _WHOLE_COLUMNS or column in _ID_COLUMNS or natural <= _SHORT:
        return natural
    if column in _NAME_COLUMNS:
        return min(natural, _NAME_FLOOR)
    return min(natural, 8)


#: The parts a header may break between: after an underscore, at a space.
_HEADER_PARTS = re.compile(r"[^_ ]*_|[^_ ]+ ?| ")


def _header(name: str, width: int) -> str:
    """A column name within ``width``: on lines broken after its underscores (or at
    its spaces)."""
    if len(name) <= width:
        return name
    lines, line = [], ""
    for part in _HEADER_PARTS.findall(name):
        if line and len(line) + len(part.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += part
    return "\n".join(lines + [line.rstrip()])


def _header_floor(name: str) -> int:
    """The width of a header's widest part (see :func:`_header`)."""
    return max([len(p.rstrip()) for p in _HEADER_PARTS.findall(name)] or [0])


def _said_once(columns: list[str], rows: Sequence[Sequence], keep: list[int]) -> list[int]:
    """The kept columns a result was filtered on: the same value in each of its rows."""
    if not rows:
        return []
    return [i for i in keep if columns[i] in _SAID_ONCE
            and all(r[i] == rows[0][i] for r in rows) and rows[0][i] not in (None, "")]


def _table(columns: Sequence[str], rows: Sequence[Sequence], width: int) -> str:
    # rich is imported where a table is drawn: commands that draw none start without it
    from rich.text import Text

    columns = list(columns)
    today = datetime.datetime.now(datetime.timezone.utc).date()
    keep = [i for i, c in enumerate(columns) if c not in _DETAIL_COLUMNS]
    # raw start/stop times are noise next to an elapsed time
    if "elapsed_s" in columns:
        keep = [i for i in keep if columns[i] not in ("start", "stop")]
    once = _said_once(columns, rows, keep)
    keep = [i for i in keep if i not in once]
    said = [f"{printable(columns[i])}: "
            + printable(str(rows[0][i]) if columns[i] in _ID_COLUMNS
                        else _human(columns[i], rows[0][i], today))
            for i in once]
    names = None
    if "depth" in columns and "name" in columns:
        d, n = columns.index("depth"), columns.index("name")
        names = _tree_labels([str(r[n]) for r in rows], [int(r[d] or 0) for r in rows])
    # A result of metric rows (``metric``, then one column per run): each value in
    # the unit of its row's metric.
    by_row = bool(columns) and columns[0] == "metric"
    texts = {i: [printable(names[r_index] if names is not None and columns[i] == "name"
                           else _human(str(row[0]) if by_row and i > 0 else columns[i], row[i],
                                       today))
                 for r_index, row in enumerate(rows)] for i in keep}
    numeric = {i: any(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows)
               for i in keep}
    #: columns of mappings ("compute 1.3 s, transfer 2 ms"): wrapped between entries
    mappings = {i for i in keep if any(isinstance(r[i], dict) for r in rows)}

    def layout(shown: list[int]) -> tuple[list[int], bool]:
        """The widths of the ``shown`` columns, and whether they fit with the long
        text (_BELOW_COLUMNS) no narrower than _WRAP_SOFT (or its own width)."""
        wraps = [columns[i] in _WRAP_COLUMNS or i in mappings for i in shown]
        cells = [[Text(t) for t in texts[i]] for i in shown]
        naturals = [max([len(printable(str(columns[i])))] + [c.cell_len for c in col])
                    for i, col in zip(shown, cells)]
        values = [_floor(columns[i], col, w, numeric[i]) if i not in mappings
                  else max([len(e) for t in texts[i] for e in re.split(r"(?<=,) ", t)] or [0])
                  for i, col, w in zip(shown, cells, wraps)]
        heads = [len(printable(str(columns[i]))) for i in shown]
        floors = [max(v, _header_floor(printable(str(columns[i])))) for i, v in zip(shown, values)]
        # text gives way first (free text down to _WRAP_SOFT), then headers wrap at
        # their underscores, then free text wraps down to its longest word
        stages = [[max(f, _WRAP_SOFT) if w else max(f, h) for f, h, w in zip(floors, heads, wraps)],
                  [max(f, _WRAP_SOFT) if w else f for f, w in zip(floors, wraps)],
                  floors]
        widths = _fit(naturals, stages, [columns[i] in _NAME_COLUMNS for i in shown], width)
        squeezed = any(columns[i] in _BELOW_COLUMNS and w < min(n, _WRAP_SOFT)
                       for i, w, n in zip(shown, widths, naturals))
        return widths, sum(floors) + _GAP * (len(shown) - 1) <= width and not squeezed

    widths, fits = layout(keep)
    below = [i for i in keep if columns[i] in _BELOW_COLUMNS] if not fits else []
    if below:
        keep = [i for i in keep if i not in below]
        widths, fits = layout(keep)
    # still too wide to show whole: the last columns go below their rows too
    while not fits and len(keep) > 2:
        last = next((i for i in reversed(keep) if columns[i] not in _NAME_COLUMNS), keep[-1])
        keep.remove(last)
        below.insert(0, last)
        widths, fits = layout(keep)
    for j, i in enumerate(keep):
        if i in mappings:
            texts[i] = [_entries(t, widths[j]) for t in texts[i]]
    lines = _draw(columns, keep, widths, texts, numeric, mappings, len(rows), width,
                  separated=bool(below))
    if below:
        lines = _with_text_below(lines, [[(columns[i], texts[i][r]) for i in below]
                                         for r in range(len(rows))], width)
    heading: list[str] = []  # what is said once, on as many lines as it takes
    for part in said:
        if heading and len(heading[-1]) + 3 + len(part) <= width:
            heading[-1] += "   " + part
        else:
            heading.append(part if len(part) <= width else part[:width - 1] + "…")
    lines[:0] = heading
    return "\n".join(lines) + "\n" + _count(len(rows))


def _entries(text: str, width: int) -> str:
    """A mapping's ``"a 1 s, b 2 ms"`` on lines of at most ``width``, broken between
    its entries (within an entry only if it is wider than ``width`` by itself)."""
    lines: list[str] = []
    for entry in re.split(r"(?<=,) ", text):
        if lines and len(lines[-1]) + 1 + len(entry) <= width:
            lines[-1] += " " + entry
        else:
            lines.append(entry)
    return "\n".join(lines)


def _draw(columns: list[str], keep: list[int], widths: list[int], texts: dict, numeric: dict,
          mappings: set[int],
          n_rows: int, width: int, separated: bool) -> list[str]:
    """The table's lines as rich draws them; ``separated``: a blank line after each row."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False,
                  padding=(0, 1, 0, 0), show_lines=separated)
    for j, i in enumerate(keep):
        wrap = columns[i] in _WRAP_COLUMNS or i in mappings
        table.add_column(_header(printable(str(columns[i])), widths[j]),
                         justify="right" if numeric[i] else "left",
                         overflow="fold" if wrap else "ellipsis", no_wrap=not wrap,
                         width=widths[j])
    for r in range(n_rows):
        table.add_row(*[Text(texts[i][r], no_wrap=not (columns[i] in _WRAP_COLUMNS or i in mappings),
                             overflow="fold" if columns[i] in _WRAP_COLUMNS or i in mappings
                             else "ellipsis")
                        for i in keep])
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, legacy_windows=False,
                      emoji=False, highlight=False, soft_wrap=False)
    console.print(table)
    return [line.rstrip() for line in out.getvalue().rstrip("\n").splitlines()]


def _with_text_below(lines: list[str], below: list[list[tuple[str, str]]], width: int) -> list[str]:
    """``lines`` of a table drawn with a blank line after each row, each blank line
    replaced by that row's long text, wrapped at word boundaries and indented."""
    import textwrap

    rule = next(k for k, line in enumerate(lines) if line and set(line) <= {"─", " "})
    out, row = lines[:rule + 1], 0
    for line in lines[rule + 1:] + [""]:
        if line or row >= len(below):
            out.append(line) if line else None
            continue
        for name, text in below[row]:
            if text:
                out += textwrap.wrap(f"{name}: {text}", width, initial_indent="    ",
                                     subsequent_indent="      ", break_on_hyphens=False)
        row += 1
    return out


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
            if not rows and fmt in ("table", "wide"):  # an empty section is one line
                print(f"== {title}: {_count(0)}")
                continue
            print(f"== {title}" if fmt in ("table", "wide") else f"# {title}")
            print(render(columns, rows, fmt))
            print()
    else:
        columns, rows = result
        print(render(columns, rows, fmt))


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
