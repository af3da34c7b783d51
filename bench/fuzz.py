"""The long fuzzing run: a million (or more) mutated real messages, nothing may crash.

Mutates the messages real producers and processors published (tests/data/
sink_corpus.json, recorded by tests/data/record_sink_corpus.py) -- a value anywhere
replaced by a random JSON value (deeply nested and beyond-64-bit ones included), a
field dropped, nesting far past the limits, bytes cut, flipped, inserted, two messages
spliced -- and drives each through a target:

- ``--target sink``: ``sinks.batch.Batch.add``. A *crash* is any exception out of it;
  a message is *unaccounted* when it left neither a row nor a dead letter.
- ``--target processors``: ``dask_blackbox.testing.processor_feed.ProcessorFeed``, which
  applies, publishes and checkpoints each message as ``stream_processors.processor``
  does (decode or dead letter, ``ClusterState.apply``, refused events as dead
  letters, gap and partial records, a checkpoint per message; every 25 messages
  span snapshots, idle partials and a checkpoint round trip). The raw messages are
  taken in corpus order (so transitions meet their tasks and spans their parents),
  each with its ``seq`` renumbered before it is mutated (so mutated envelopes are
  applied, not skipped as duplicates) and keyed by the original cluster_id; one in
  twenty is a derived record instead (a dead letter on the raw topic). Half the
  messages are mutated as for the sink, half only structurally (values inside events
  replaced, dropped or swapped for another of the message's: still JSON, so they
  reach ``apply``). After every
  pass over the corpus its clusters are forgotten (final snapshots and partials).
  A *crash* is any exception, an assertion of the feed included: a published record
  off the contract, a span cycle, a recovered state unlike the state, a dead letter
  without a reason.

Prints, every 100k messages and at the end: messages tried, crashes, unaccounted,
dead letters, messages/s (the processors target also what became of the messages:
applied, duplicates, dead letters, refused events, records published, checkpoint
round trips). One run gives one figure; crashes are written (topic and
value) to ``--crashes`` for replay. Exit status 1 if anything crashed.

    nice python bench/fuzz.py --messages 1000000
    nice python bench/fuzz.py --target processors --messages 1000000
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import random
import sys
import time
import traceback
from typing import Protocol

import orjson

from report import report as bench_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "sink_corpus.json"


# ------------------------------------------------------------------- mutations

def random_scalar(rng: random.Random):
    pick = rng.randrange(9)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(["", "x", "memory", "erred", "\u00e9\u4e2d", "\x00", "a" * rng.randrange(300)])
    if pick == 3:
        return rng.randrange(-(2**70), 2**70)
    if pick == 4:
        return rng.choice([0, 1, -1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 2**64])
    if pick == 5:
        return rng.choice([0.0, -0.0, 1e-300, 1e300, 1.7976931348623157e308, 946684799.0, 4e9, 1e10 + 1])
    if pick == 6:
        return rng.uniform(-1e12, 1e12)
    if pick == 7:
        return time.time() + rng.uniform(-1e6, 1e6)
    return rng.choice(["transition", "graph", "span", "lifecycle", "log", "worker_digests", "drops"])


def random_value(rng: random.Random, budget: int = 6):
    if budget <= 0 or rng.random() < 0.5:
        return random_scalar(rng)
    if rng.random() < 0.5:
        return [random_value(rng, budget - 2) for _ in range(rng.randrange(4))]
    return {rng.choice(["kind", "ts", "key", "x", "", "tasks", "events", "digests"]):
            random_value(rng, budget - 2) for _ in range(rng.randrange(4))}


def _paths(value, path=(), out=None):
    out = [] if out is None else out
    out.append(path)
    if type(value) is dict:
        for k, v in value.items():
            _paths(v, (*path, k), out)
    elif type(value) is list:
        for i, v in enumerate(value):
            _paths(v, (*path, i), out)
    return out


def _set(value, path, new, drop=False):
    if not path:
        return new
    container = value
    for step in path[:-1]:
        container = container[step]
    if drop:
        del container[path[-1]]
    else:
        container[path[-1]] = new
    return value


_DEPTHS = (99, 100, 101, 254, 256, 1023, 1025, 5_000, 200_000)


def mutate(rng: random.Random, topic: str, value: bytes, seeds: list[tuple[str, bytes]]) -> bytes:
    """``value`` mutated one to three times."""
    for _ in range(rng.randrange(1, 4)):
        how = rng.random()
        if how < 0.55:
            try:
                decoded = orjson.loads(value)
                paths = _paths(decoded)
            except (orjson.JSONDecodeError, RecursionError):  # (a deep one, mutated before)
                how = 0.9
        if how < 0.4:  # replace a value anywhere
            decoded = _set(decoded, rng.choice(paths), random_value(rng))
            value = json.dumps(decoded, separators=(",", ":")).encode()  # any int size
        elif how < 0.5:  # drop a field or an item
            if paths[1:]:
                decoded = _set(decoded, rng.choice(paths[1:]), None, drop=True)
            value = json.dumps(decoded, separators=(",", ":")).encode()
        elif how < 0.55:  # nest past the limits (and past orjson's, msgspec's, Python's)
            path = rng.choice(paths)
            marker = "\x00deep\x00"
            depth = rng.choice(_DEPTHS)
            value = json.dumps(_set(decoded, path, marker)).encode().replace(
                json.dumps(marker).encode(), b"[" * depth + b"]" * depth)
        elif how < 0.7:  # truncate
            value = value[:rng.randrange(len(value) + 1)]
        elif how < 0.8 and value:  # flip a bit
            i = rng.randrange(len(value))
            value = value[:i] + bytes([value[i] ^ (1 << rng.randrange(8))]) + value[i + 1:]
        elif how < 0.9:  # insert bytes
            i = rng.randrange(len(value) + 1)
            value = value[:i] + rng.randbytes(rng.randrange(1, 9)) + value[i:]
        else:  # splice with another message
            _, other = rng.choice(seeds)
            value = value[:rng.randrange(len(value) + 1)] + other[rng.randrange(len(other) + 1):]
    return value


def structural(rng: random.Random, value: bytes) -> bytes:
    """``value`` (JSON) with one to three values replaced, dropped or swapped for
    another of the same message (an id, a parent, a key), mostly inside an event:
    still JSON, so it reaches what comes after decoding."""
    try:
        decoded = orjson.loads(value)
    except orjson.JSONDecodeError:
        return value
    for _ in range(rng.randrange(1, 4)):
        paths = _paths(decoded)[1:]
        if not paths:
            break
        inside = [p for p in paths if len(p) > 2 and p[0] == "events"]  # an event's
        path = rng.choice(inside if inside and rng.random() < 0.8 else paths)
        how = rng.random()
        if how < 0.5:
            decoded = _set(decoded, path, random_value(rng))
        elif how < 0.7:
            decoded = _set(decoded, path, None, drop=True)
        else:
            other = decoded
            for step in rng.choice(paths):
                other = other[step]
            decoded = _set(decoded, path, copy.deepcopy(other))
    return json.dumps(decoded, separators=(",", ":")).encode()


# --------------------------------------------------------------------- targets

class Target(Protocol):
    def seed(self, rng: random.Random, seeds: list[tuple[str, bytes]]) -> tuple[str, bytes]:
        """The next message to mutate."""

    def add(self, topic: str, value: bytes) -> bool:
        """Drive one message through; False when it was not accounted for. Raises
        what the code under test raises (a crash)."""

    def dead_letters(self) -> int: ...


class SinkTarget:
    """sinks.batch.Batch, a fresh batch every 2,000 messages (as the sink's batches)."""

    def __init__(self) -> None:
        from dask_blackbox.sinks.batch import Batch
        from dask_blackbox.sinks.tables import Message

        self.Batch, self.Message = Batch, Message
        self.batch = Batch()
        self.offset = 0
        self.n_dead = 0

    def seed(self, rng: random.Random, seeds: list[tuple[str, bytes]]) -> tuple[str, bytes]:
        return rng.choice(seeds)

    def add(self, topic: str, value: bytes) -> bool:
        if self.batch.n_messages >= 2_000:
            self.n_dead += len(self.batch.tables["dead_letters"])
            self.batch = self.Batch()
        self.offset += 1
        before = self.batch.n_rows
        self.batch.add(self.Message(topic, f"fuzz.{topic}", 0, self.offset, b"k", value, 0))
        return self.batch.n_rows > before

    def dead_letters(self) -> int:
        return self.n_dead + len(self.batch.tables["dead_letters"])


class ProcessorsTarget:
    """:class:`dask_blackbox.testing.processor_feed.ProcessorFeed` (see the module docstring)."""

    def __init__(self) -> None:
        from dask_blackbox import contract
        from dask_blackbox.testing.processor_feed import ProcessorFeed, key_of, renumbered

        self.key_of, self.renumbered = key_of, renumbered
        self.raw = contract.RAW
        self.feed = ProcessorFeed(check_every=25)
        self.seqs: dict[str, int] = {}
        self.at = 0
        self.key: bytes | None = None

    def seed(self, rng: random.Random, seeds: list[tuple[str, bytes]]) -> tuple[str, bytes]:
        raw = [v for t, v in seeds if t == self.raw]
        if rng.randrange(20) == 0:
            topic, value = rng.choice([(t, v) for t, v in seeds if t != self.raw])
            self.key = self.key_of(value)
            return topic, value
        if self.at == len(raw):  # a pass is over: its clusters are forgotten
            self.feed.expire()
            self.at, self.seqs = 0, {}
        value = raw[self.at]
        self.at += 1
        self.key = self.key_of(value) if rng.randrange(10) else None
        return self.raw, self.renumbered(value, self.seqs)

    def mutate(self, rng: random.Random, topic: str, value: bytes,
               seeds: list[tuple[str, bytes]]) -> bytes:
        """Half the messages mutated as for the sink, half only structurally."""
        if rng.random() < 0.5:
            return mutate(rng, topic, value, seeds)
        return structural(rng, value)

    def add(self, topic: str, value: bytes) -> bool:
        return self.feed.add(self.key, value) in ("applied", "duplicate", "dead")

    def dead_letters(self) -> int:
        return self.feed.counts["dead_letters"]

    def details(self) -> str:
        c = self.feed.counts
        return (f"messages applied {c['applied']:,}, duplicates {c['duplicate']:,}, dead "
                f"letters {c['dead']:,}; refused events {c['rejected_events']:,}; published "
                f"{c['gaps']:,} gaps, {c['partials']:,} partials, {c['snapshots']:,} "
                f"snapshots; {c['round_trips']:,} checkpoint round trips")


TARGETS = {"sink": SinkTarget, "processors": ProcessorsTarget}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["sink", "processors"], default="sink")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", type=pathlib.Path, default=CORPUS)
    parser.add_argument("--crashes", type=pathlib.Path, default=pathlib.Path("fuzz-crashes.jsonl"))
    parser.add_argument("--quick", action="store_true", help="20,000 messages a target")
    args = parser.parse_args()
    if args.quick:
        args.messages = 20_000
    if args.target not in TARGETS:
        parser.error(f"--target {args.target}: not implemented yet; add it to bench/fuzz.py TARGETS")
    corpus = json.loads(args.corpus.read_text())
    seeds = [(topic, v.encode()) for topic, values in corpus.items() for v in values]
    if args.target == "sink":
        from dask_blackbox.sinks.service import tune_gc

        tune_gc()
    target = TARGETS[args.target]()
    rng = random.Random(args.seed)
    mutator = getattr(target, "mutate", mutate)
    crashes = unaccounted = 0
    start = time.perf_counter()
    print(f"fuzzing {args.target} with {args.messages:,} mutated messages from {len(seeds)} "
          f"recorded ones ({args.corpus.name}), seed {args.seed}", flush=True)

    def report(n: int) -> None:
        elapsed = time.perf_counter() - start
        print(f"{n:>10,} messages tried  {crashes} crashes  {unaccounted} unaccounted  "
              f"{target.dead_letters():,} dead letters  {n / elapsed:,.0f} messages/s  "
              f"({elapsed:.0f}s)", flush=True)

    for n in range(1, args.messages + 1):
        topic, value = target.seed(rng, seeds)
        try:
            value = mutator(rng, topic, value, seeds)
        except RecursionError:  # the mutator's own limit (json.dumps), not the target's
            pass
        try:
            if not target.add(topic, value):
                unaccounted += 1
                if unaccounted <= 10:
                    print(f"unaccounted: {topic} {value[:200]!r}", flush=True)
        except Exception:  # a crash: what the fuzzing is looking for
            crashes += 1
            with open(args.crashes, "a") as f:
                f.write(json.dumps({"topic": topic, "value": value.decode("utf-8", "replace"),
                                    "error": traceback.format_exc()}) + "\n")
            if crashes <= 10:
                traceback.print_exc()
        if n % 100_000 == 0:
            report(n)
    if args.messages % 100_000:
        report(args.messages)
    if hasattr(target, "details"):
        print(target.details(), flush=True)
    elapsed = time.perf_counter() - start
    bench_report(f"fuzzing the {args.target}: crashes in {args.messages:,} mutated messages",
                 crashes + unaccounted, "crashes", 0)
    bench_report(f"fuzzing the {args.target}: messages a second", round(args.messages / elapsed),
                 "msg/s", None, better="higher")
    return 1 if crashes or unaccounted else 0


if __name__ == "__main__":
    sys.exit(main())
