"""The CLI's tables for people: they fit 120 columns, shorten ids, show times,
durations and bytes with units, draw span trees as trees; --wide, json and csv keep
every column and value."""

from __future__ import annotations

import datetime
import json
import re

import pytest

from dask_blackbox.cli.formatting import FORMATS, nbytes, render, seconds, short_id

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
        "400 µs", "12.3 ms", "4.5 s", "3m 07s", "2h 05m"]
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
    assert "1.5 s" in body and "2.00 KiB" in body and NOW.strftime("%H:%M:%S") in body
    assert "…" in body  # the overlong name is cut, not wrapped
    assert lines[0] == "cluster: demo-alice"  # one cluster: said once, not in every row
    # what each span did wraps at word boundaries, never cut: two lines a row at most
    assert body.count("transfer") == len(SPANS) and "transfer…" not in body
    assert len(lines) <= 1 + 3 + 2 * len(SPANS) + 1  # a header may wrap at its underscore


def test_binary_units_one_spelling():
    assert [nbytes(v) for v in (512, 2048, 1536 * 2**10, 3.25 * 2**30, -2048)] == [
        "512 B", "2.00 KiB", "1.50 MiB", "3.25 GiB", "-2.00 KiB"]


def test_failures_at_120_columns_wrap_the_exception_whole():
    exception = ("ValueError: could not convert the column 'amount' of partition 17 to float64: "
                 "found 'n/a' in row 40213")
    columns = ["cluster_id", "key", "ts", "worker", "prefix", "exception", "cause", "traceback"]
    rows = [("Scheduler-1c2b3a4d-9f00", f"('parse-csv-0f3e', {i})", NOW, "tcp://10.0.0.7:40123",
             "parse-csv", exception, "('parse-csv-0f3e', 0)", "Traceback ...") for i in range(2)]
    text = render(columns, rows, width=120)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120
    assert lines[0] == "cluster_id: Scheduler-1c2b3a4d-9f00   worker: tcp://10.0.0.7:40123"
    assert "…" not in text  # nothing cut
    words = " ".join(text.split())
    for word in exception.split():
        assert word in words or word[:10] in words, word  # folded over lines, not dropped
    assert "ValueError: could not convert" in text


def test_a_story_keeps_its_stimulus_ids_and_says_its_key_once():
    columns = ["key", "start", "finish", "stimulus_id", "ts", "cluster_id", "worker", "source"]
    stimuli = [f"compute-task-{1_700_000_000.123456 + i:.6f}-with-a-long-tail" for i in range(3)]
    rows = [("('shuffle-transfer-aaaa', 3)", a, b, stim, NOW.timestamp(), "c1", f"tcp://w{i}:1", "scheduler")
            for i, (a, b, stim) in enumerate(zip(["released", "waiting", "processing"],
                                                 ["waiting", "processing", "memory"], stimuli))]
    text = render(columns, rows, width=120)
    assert max(map(len, text.splitlines())) <= 120
    assert text.splitlines()[0].startswith("key: ('shuffle-transfer-aaaa', 3)")
    flat = "".join(text.split())
    assert all(stim in flat for stim in stimuli)


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


def test_at_120_columns_no_header_count_or_address_is_cut():
    """The clusters listing at 120 columns: every header whole (wrapped at its
    underscores when its column is narrow), every count and address whole."""
    columns = ["cluster_name", "cluster_id", "first_seen", "last_seen", "workers", "tasks",
               "errors", "workers_removed", "workers_lost", "producers", "envelopes", "scheduler"]
    rows = [(f"nightly-etl-{i}", f"Scheduler-{i:08d}-aaaa", NOW, NOW, 12, 1_234_567, 3, 4, 1, 27,
             98_765, f"tcp://10.0.0.{i}:8786") for i in range(3)]
    text = render(columns, rows, width=120)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120 and "…" not in text
    rule = lines.index(next(line for line in lines if set(line) == {"─"}))
    words = set(" ".join(lines[:rule]).split())
    for name in columns[:-1]:  # whole, or its parts, each whole, on lines of their own
        assert name in words or set(re.findall(r"[^_]*_|[^_]+", name)) <= words, name
    # what does not fit whole goes below its row, whole
    assert sum(line.startswith("    scheduler: tcp://10.0.0.") for line in lines) == 3
    for i in range(3):
        assert f"tcp://10.0.0.{i}:8786" in text and "1234567" in text and "98765" in text


def test_long_text_goes_below_its_row_and_an_empty_section_is_one_line(capsys):
    from dask_blackbox.cli.formatting import print_result

    columns = ["worker", "removed_at", "stimulus_id", "expected", "tasks_running", "cause",
               "confidence", "summary"]
    summary = ("the nanny terminated the process at 95% of its memory limit while it ran "
               "hog-killed-3 and two other tasks; the scheduler then rescheduled them")
    rows = [(f"tcp://127.0.0.1:4{i}123", NOW, f"handle-worker-cleanup-{1_700_000_000 + i}.123456",
             False, 3, "memory", 0.9, summary) for i in range(2)]
    print_result({"dead workers": (columns, rows), "dead worker logs": (["ts", "message"], [])},
                 "table")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 120 and "…" not in out
    at = [k for k, line in enumerate(lines) if line.startswith("tcp://127.0.0.1:4")]
    assert len(at) == 2 and lines[at[0] + 1].startswith("    summary: the nanny terminated")
    assert " ".join(" ".join(lines[at[0] + 1:at[1]]).split()) == "summary: " + summary
    assert "== dead worker logs: (0 rows)" in lines
    assert lines[lines.index("== dead worker logs: (0 rows)") - 1] == ""


def test_what_cannot_fit_whole_goes_below_its_row_whole():
    columns = ["prefix", "action", "verdict", "median per task", "change [interval]", "p",
               "band", "total"]
    rows = [("transform", "compute", "slower", "12.3 ms → 45.6 ms", "+270% [+110%, +430%]",
             "0.00012", "±12%", "12.3 s → 45.6 s")]
    text = render(columns, rows, width=70)
    assert max(map(len, text.splitlines())) <= 70 and "…" not in text
    for value in rows[0]:
        assert value in text
