"""``dask-blackbox export otlp`` and ``dask-blackbox trace``: a recorded run handed to
the tools platform teams already run.

- ``export otlp --cluster X [--span S] --endpoint URL [--protocol grpc]`` reads the
  run from ClickHouse (:mod:`dask_blackbox.read.runs`) and its worker removals with
  their causes (:func:`dask_blackbox.read.diagnosis.deaths`), builds its trace
  (:func:`run_trace`) and its log records, and sends them to the OTLP receiver
  (:mod:`dask_blackbox.exporters.otlp`);
- ``trace --cluster X [--span S] -o run.json.gz`` writes the run as a Chrome Trace
  Event Format file (:mod:`dask_blackbox.read.tracefile`) for Perfetto.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dask_blackbox.exporters.model import SpanData
    from dask_blackbox.read.backends import Backend
    from dask_blackbox.read.runs import Run


def add_commands(sub, parents: list) -> None:
    export = sub.add_parser("export", parents=parents,
                            help="send a recorded run to another tool (otlp: an OpenTelemetry "
                                 "receiver)")
    targets = export.add_subparsers(dest="target", required=True, metavar="TARGET")
    otlp = targets.add_parser("otlp", parents=parents,
                              help="a run as an OpenTelemetry trace (and its log records) over OTLP")
    otlp.add_argument("--cluster", required=True, help="cluster name or id (its latest run)")
    otlp.add_argument("--span", help="only this span (a tag or a/b path) and its sub-spans")
    otlp.add_argument("--endpoint", help="the OTLP receiver, e.g. http://127.0.0.1:4318 "
                                         "(default blackbox.exporter.endpoint)")
    otlp.add_argument("--protocol", choices=("http/protobuf", "grpc"),
                      help="default blackbox.exporter.protocol (http/protobuf)")
    otlp.add_argument("--no-logs", action="store_true", help="spans only, not the log records")

    trace = sub.add_parser("trace", parents=parents,
                           help="a run as a Chrome Trace Event Format file (Perfetto)")
    trace.add_argument("--cluster", required=True, help="cluster name or id (its latest run)")
    trace.add_argument("--span", help="only this span (a tag or a/b path) and its sub-spans")
    trace.add_argument("-o", "--output", required=True, help="the file (.json or .json.gz)")

    sub.add_parser("exporter", parents=parents,
                   help="run the continuous OpenTelemetry exporter (production service)")


def run_trace(backend: Backend, run: Run, max_task_spans: int) -> list[SpanData]:
    """The trace of a run read back from ClickHouse (:func:`~dask_blackbox.read.runs.read_run`):
    its records, and every removal of its cluster with the verdict the read side gives
    it (:func:`~dask_blackbox.read.diagnosis.deaths`), a death event for each death."""
    from dask_blackbox.causes import Classified
    from dask_blackbox.exporters import traces
    from dask_blackbox.read import diagnosis

    removals = [Classified(d.removal, d.verdict)
                for d in diagnosis.deaths(backend, [run.cluster_id])]
    return traces.build_run(run.cluster_id, run.cluster_name, run.spans, run.transitions,
                            run.lifecycle, max_task_spans, removals=removals,
                            left=run.left_processing)


def export_otlp(args: argparse.Namespace) -> int:
    from dask_blackbox.cli.formatting import working
    from dask_blackbox.exporters import traces
    from dask_blackbox.exporters.model import Item
    from dask_blackbox.exporters.otlp import ExportFailed, OtlpSender
    from dask_blackbox.exporters.settings import OtlpSettings
    from dask_blackbox.read import queries
    from dask_blackbox.read.runs import read_run

    settings = OtlpSettings.from_config(args.endpoint, args.protocol)
    with working("dask-blackbox export otlp: reading ClickHouse"):
        backend = queries.connect()
        run = read_run(backend, args.cluster, args.span, logs=settings.logs and not args.no_logs)
        spans = run_trace(backend, run, settings.max_task_spans)
    resource = traces.resource(run.cluster_id, run.cluster_name)
    items = [Item(resource, span=s) for s in spans]
    items += [Item(resource, log=traces.log_data(run.cluster_id, log, log.get("source")))
              for log in run.logs]
    root = spans[-1]
    sender = OtlpSender(settings)
    n_logs = len(run.logs)
    try:
        with working(f"dask-blackbox export otlp: sending to {sender.where}"):
            try:
                sender.send(items)
            except ExportFailed as e:
                if not e.no_logs:
                    raise
                # the spans went first and were taken: a receiver of traces only
                print(f"dask-blackbox export otlp: {e}: this receiver takes no logs; "
                      "the log records were not exported (--no-logs says so)", file=sys.stderr)
                n_logs = 0
    finally:
        sender.close()
    capped = root.attributes["dask.task_spans.summarised"]
    print(f"exported {len(spans)} spans ({root.attributes['dask.task_spans.exported']} task spans"
          + (f", {capped} more task actions summarised per prefix: "
             f"blackbox.exporter.max-task-spans={settings.max_task_spans}" if capped else "")
          + f") and {n_logs} log records of {run.cluster_name} ({run.cluster_id}) "
          f"to {sender.where}: trace {root.trace_id}")
    return 0


def trace_file(args: argparse.Namespace) -> int:
    from dask_blackbox.cli.formatting import working
    from dask_blackbox.read import queries, tracefile

    with working("dask-blackbox trace: reading ClickHouse"):
        trace = tracefile.trace_events(queries.connect(), args.cluster, args.span)
    try:
        size = tracefile.write(trace, args.output)
    except OSError as e:
        print(f"dask-blackbox: error: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({size:,} bytes): {len(trace.slices)} task actions of "
          f"{trace.other['cluster_name']}; open it in https://ui.perfetto.dev")
    return 0


def exporter(args: argparse.Namespace) -> int:
    from dask_blackbox.cli import exporter as service

    return service.main([])
