"""Run every benchmark and print one table of figures against their targets.

    python bench/run_all.py            # all of them
    python bench/run_all.py --quick    # each with its --quick flag (smaller sizes)

Each benchmark is a script in this directory that prints ``BENCH {...}`` lines
(see report.py); they run one after another so they don't compete for the 2 cores.
Each script's whole output (its tables and curves besides the figures) is kept in
``<logs>/<script>.log``; the directory is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from report import PREFIX, meets

HERE = pathlib.Path(__file__).parent
#: Every script here that prints a figure.
BENCHMARKS = [
    "scheduler_overhead.py",
    "processor_throughput.py",
    "processor_ttl.py",
    "flood.py",
    "query_latency.py",
    "sink_ingest.py",
    "history.py",
    "critical_path.py",
    "regressions.py",
    "function_regressions.py",
    "trace_file.py",
    "freshness.py",
    "alerts.py",
    "ui_latency.py",
    "group_views.py",
    "read_guard.py",
    "fuzz.py",
    "soak.py",
    "profile_cost.py",
    "held_memory.py",
    "sender_cost.py",
]


def run(script: str, quick: bool, logs: pathlib.Path) -> tuple[list[dict], str]:
    cmd = [sys.executable, str(HERE / script)] + (["--quick"] if quick else [])
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True)
    (logs / f"{script}.log").write_text(out.stdout + out.stderr)
    figures = [json.loads(line[len(PREFIX):]) for line in out.stdout.splitlines()
               if line.startswith(PREFIX)]
    status = "ok" if out.returncode == 0 else f"exit {out.returncode}"
    if out.returncode != 0:
        sys.stderr.write(f"--- {script} failed:\n{out.stderr[-3000:]}\n")
    return figures, f"{status}, {time.monotonic() - t0:.0f}s"


def bound(figure: dict) -> str:
    """The target as "<= 1.05" / ">= 1e+05", or "-" for a figure shown for context."""
    if figure["target"] is None:
        return "-"
    return ("<= " if figure["better"] == "lower" else ">= ") + f"{figure['target']:g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--logs", type=pathlib.Path, help="directory for each script's output")
    parser.add_argument("only", nargs="*", help="run only these scripts")
    args = parser.parse_args()
    logs = args.logs or pathlib.Path(tempfile.mkdtemp(prefix="blackbox-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    for script in args.only or BENCHMARKS:
        print(f"running {script} ...", flush=True)
        figures, status = run(script, args.quick, logs)
        failed |= not status.startswith("ok") or not figures
        for f in figures:
            target, aim = meets(f, f["target"]), meets(f, f["aim"])
            failed |= target is False
            rows.append((script, f["metric"], f"{f['value']:.4g} {f['unit']}", bound(f),
                         "-" if target is None else ("met" if target else "MISSED"),
                         "-" if aim is None else ("met" if aim else "not yet")))
        if not figures:
            rows.append((script, "(no figures)", status, "", "", ""))
    header = ("benchmark", "figure", "value", "target", "target", "aim")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print()
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"\neach benchmark's whole output: {logs}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
