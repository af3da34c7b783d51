"""The CLI's tables for people: they fit 120 columns, shorten ids, show times,
durations and bytes with units, draw span trees as trees; --wide, json and csv keep
every column and value."""

from __future__ import annotations

import datetime
import json
import re

import pytest

from dask_blackbox.cli.formatting import FORMATS, render, seconds, short_id

NOW = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=250_000)
SPAN_COLUMNS = ["cluster", "name", "span_id", "parent_id", "enqueued", "start", "stop",
                "elapsed_s", "task_s", "tasks", "nbytes", "by_action", "done", "depth"]


def span(name, depth, sid, parent=None, elapsed=1.5, nbytes=2048):
    return ("demo-alice", name, sid * 36, parent and parent * 36, NOW, NOW, NOW, elapsed,
            0.25, 10, nbytes, {"compute": 0.2, "transfer": 0.05}, True, depth)


SPANS = [span("Alice's workflow", 0, "a"), span("data load", 1, "b", "a"),
         span("read", 2, "c", "b"), span("Model training", 1, "d", "a"),
         span("a name far too long to be shown whole in a table of this width " * 3, 0, "e")]


def test_units_and_ids():
    assert [seconds(v) for v in (0.0004, 0.0123, 4.5, 187, 7500)] == [
        "400 us", "12.3 ms", "4.5 s", "3m 07s", "2h 05m"]
    assert short_id("Scheduler-1c2b3a4d-9f00-4b7e") == "1c2b3a4d"
    assert short_id("0123456789abcdef") == "01234567"


def test_a_span_tree_fits_120_columns_and_is_drawn_as_a_tree():
    text = render(SPAN_COLUMNS, SPANS)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120
    assert lines[-1] == "(5 rows)"
    body = "\n".join(lines)
    assert "├─ data load" in body and "│  └─ read" in body and "└─ Model training" in body
    assert "a" * 36 not in body  # ids are not shown whole
    assert "1.5 s" in body and "2.00 kiB" in body and NOW.strftime("%H:%M:%S") in body
    assert "…" in body  # the overlong name is cut, not wrapped
    assert len(lines) == 2 + len(SPANS) + 1


def test_a_narrow_terminal_gets_a_narrow_table():
    assert max(map(len, render(SPAN_COLUMNS, SPANS, width=90).splitlines())) <= 90


def test_markup_and_html_in_values_are_printed_as_they_are():
    text = render(["key", "exception"], [("<script>alert(1)</script>", "[bold]x[/bold]")])
    assert "<script>alert(1)</script>" in text and "[bold]x[/bold]" in text


def test_wide_json_and_csv_keep_every_column_and_value():
    wide = render(SPAN_COLUMNS, SPANS, "wide")
    assert "a" * 36 in wide and all(c in wide.splitlines()[0] for c in SPAN_COLUMNS)
    rows = json.loads(render(SPAN_COLUMNS, SPANS, "json"))
    assert rows[1]["span_id"] == "b" * 36 and rows[1]["depth"] == 1
    assert rows[0]["by_action"] == {"compute": 0.2, "transfer": 0.05}
    csv_lines = render(SPAN_COLUMNS, SPANS, "csv").splitlines()
    assert csv_lines[0] == ",".join(SPAN_COLUMNS) and len(csv_lines) == 1 + len(SPANS)


def test_story_times_keep_milliseconds():
    text = render(["key", "start", "finish", "ts"], [("x", "released", "waiting", NOW.timestamp())])
    assert NOW.strftime("%H:%M:%S") + ".250" in text


#: What a terminal acts on: C0 (but the newline between lines), DEL and C1.
TERMINAL_CONTROLS = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_format_passes_terminal_escapes(fmt):
    """Recorded names, keys and messages reach the terminal through every format
    without a control character the terminal would act on (a title change, a colour,
    a carriage return over the line); they stay visible as escapes."""
    hostile = "a\x1b]0;owned\x07b\x1b[31mc\x9b2Jd\re\x00f"
    columns = ["key\x1b[8m", "exception"]
    text = render(columns, [(hostile, {"x\x1b": hostile}), ("\x7f", None)], fmt)
    found = TERMINAL_CONTROLS.findall(text.replace("\t", "") if fmt == "csv" else text)
    assert not found, (fmt, found, text)
    assert ("\\x1b" if fmt != "json" else "\\u001b") in text
    if fmt == "json":
        assert json.loads(text)[0]["key\x1b[8m"] == hostile  # the value itself is kept
