"""The workers' own profiles, as recorded: Dask's statistical profiler (a sample of
every executing thread's stack every ``distributed.worker.profile.interval``) per
task prefix and worker-wide, a folded stack per row of the ``profiles`` table
(contract ``Profile``; frames ``file:line:function``, the line where the function
begins, from the outermost, joined by ``;``).

:func:`load` merges the rows of a cluster (a task prefix, or the whole workers'
profile; one worker or all; a time range) into a :class:`Profile`, as
``profile.merge`` merges Dask's trees: the samples of each stack added up. It
outlives the hour a worker keeps, and the worker. :func:`top` is its frames by the
samples in which each was innermost (self) and on the stack (total);
:func:`write` writes it as folded stacks (``.folded``, ``.txt``: Brendan Gregg's
format, what flamegraph.pl and speedscope read), speedscope's JSON
(``.speedscope.json``) or pprof's gzipped ``profile.proto`` (``.pb.gz``: ``go tool
pprof``), the protobuf written here, field by field.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import re
from collections.abc import Iterable

from dask_blackbox.read import filters
from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import TimeBound, table

#: Suffixes :func:`write` knows, and the format each means.
FORMATS = {".folded": "folded", ".txt": "folded", ".speedscope.json": "speedscope",
           ".pb.gz": "pprof"}


class NoProfiles(LookupError):
    """Nothing recorded matches; the message (one line) says what was asked."""


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of a folded stack: ``file:line:function`` read back."""

    file: str
    line: int
    function: str

    @property
    def location(self) -> str:
        """``file:line``, the file from its package on (after ``site-packages/``) or,
        for the standard library, from ``lib/pythonX.Y/`` on."""
        file = self.file
        for marker in ("/site-packages/", "/dist-packages/"):
            if marker in file:
                file = file.rsplit(marker, 1)[1]
                break
        else:
            m = re.search(r"/lib/python\d+\.\d+/", file)
            if m:
                file = file[m.end():]
        return f"{file}:{self.line}"


_FRAME = re.compile(r"(.*):(-?\d+):(.*)", re.DOTALL)


@functools.lru_cache(maxsize=16384)
def frame(text: str) -> Frame:
    """The :class:`Frame` of a frame's text (its whole text as the function's name,
    line 0, if it is not ``file:line:function``)."""
    m = _FRAME.fullmatch(text)
    if m is None:
        return Frame("", 0, text)
    return Frame(m[1], int(m[2]), m[3])


@dataclasses.dataclass
class Profile:
    """Merged samples: folded stack -> samples, and what was asked for."""

    stacks: dict[str, int]
    cluster: str | None = None
    prefix: str = ""
    worker: str | None = None
    #: stacks and samples beyond a ``limit`` of :func:`load` (not in ``stacks``)
    left_off: tuple[int, int] = (0, 0)

    @property
    def samples(self) -> int:
        return sum(self.stacks.values())

    @property
    def title(self) -> str:
        what = f"prefix {self.prefix}" if self.prefix else "every task"
        where = f"worker {self.worker}" if self.worker else "every worker"
        return f"{self.cluster or 'every cluster'}: {what}, {where}"

    def frames(self) -> Iterable[tuple[list[str], int]]:
        """(frame texts from the outermost, samples) of each stack."""
        for stack, n in self.stacks.items():
            yield stack.split(";"), n


#: What :func:`load` reads (from ``{profiles}``; ``{where}`` filled in where it is run).
STACK_COUNTS = "SELECT stack, toUInt64(sum(count)) AS n FROM {profiles} {where} GROUP BY stack"
#: What :func:`load` reads (``{grouped}`` filled in where it is run).
STACK_TOTALS = "SELECT count(), toUInt64(sum(n)) FROM ({grouped})"


def load(backend: Backend, cluster: str | None, prefix: str | None = None,
         worker: str | None = None, since: TimeBound = None,
         until: TimeBound = None, limit: int | None = None) -> Profile:
    """The recorded profile of ``cluster`` (a name's runs, or an id): of task prefix
    ``prefix`` (None or "": every task, the workers' whole profile), of ``worker``
    (an address; None: every worker), of the cycles dated in [since, until); with
    ``limit``, its ``limit`` most sampled stacks (``Profile.left_off``: the others).
    :class:`NoProfiles` when none was recorded (the message says which prefixes
    were, if the prefix is what is missing); ``filters.UnknownCluster`` for a
    cluster never recorded."""
    f = filters.build(backend, cluster, since, until, "ts")
    base, params = f.where(), dict(f.parameters)
    f.add("prefix = {prefix:String}", prefix=prefix or "")
    if worker:
        f.add("worker = {worker:String}", worker=worker)
    grouped = STACK_COUNTS.format(profiles=table(backend, 'profiles'), where=f.where())
    bound = "" if limit is None else f" LIMIT {int(limit)}"
    _, rows = backend.query(f"{grouped} ORDER BY n DESC, stack{bound}", f.parameters)
    if not rows:
        timed = since is not None or until is not None
        raise NoProfiles(_nothing(backend, cluster, prefix, worker, base, params, timed))
    stacks = {stack: int(n) for stack, n in rows}
    left_off = (0, 0)
    if limit is not None and len(rows) >= limit:
        _, [(n_stacks, n_samples)] = backend.query(
            STACK_TOTALS.format(grouped=grouped), f.parameters)
        left_off = (int(n_stacks) - len(stacks), int(n_samples) - sum(stacks.values()))
    return Profile(stacks, cluster, prefix or "", worker, left_off)


#: What :func:`prefixes` reads (from ``{profiles}``; ``{where}``, ``{limit}`` filled in
#: where it is run).
PREFIXES = ("SELECT prefix, toUInt64(sum(count)) AS n FROM {profiles} {where} GROUP BY prefix "
            "ORDER BY n DESC, prefix LIMIT {limit}")


def prefixes(backend: Backend, cluster: str | None, worker: str | None = None,
             since: TimeBound = None, until: TimeBound = None,
             limit: int = 100) -> list[tuple[str, int]]:
    """The task prefixes profiled (of ``worker``, in [since, until)) with their
    samples, the most sampled first, at most ``limit``."""
    f = filters.build(backend, cluster, since, until, "ts")
    f.add("prefix != ''")
    if worker:
        f.add("worker = {worker:String}", worker=worker)
    _, rows = backend.query(
        PREFIXES.format(profiles=table(backend, 'profiles'), where=f.where(), limit=int(limit)), f.parameters)
    return [(p, int(n)) for p, n in rows]


#: What :func:`_nothing` reads (from ``{profiles}``; ``{where}`` filled in where it is run).
NOTHING = "SELECT DISTINCT prefix FROM {profiles} {where} ORDER BY prefix LIMIT 11"


def _nothing(backend: Backend, cluster: str | None, prefix: str | None, worker: str | None,
             where: str, params: dict, timed: bool) -> str:
    """What :class:`NoProfiles` says: that the cluster has no profile at all, or which
    prefixes it has when the one asked for is not among them."""
    what = f"cluster {cluster!r}" if cluster else "any cluster"
    when = " in that time" if timed else ""
    _, rows = backend.query(
        NOTHING.format(profiles=table(backend, 'profiles'), where=where), params)
    if not rows:
        return (f"no profile was recorded for {what}{when} (its workers recorded none: "
                "blackbox.producer.record.profiles was off, or no task ran)")
    known = [p for p, in rows if p]
    if prefix and prefix not in known:
        listed = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "")
        return (f"no profile of prefix {prefix!r} was recorded for {what}{when} "
                f"(prefixes profiled: {listed or 'none'})")
    of = f" of prefix {prefix!r}" if prefix else ""
    on = f" on worker {worker!r}" if worker else ""
    return f"no profile{of} was recorded for {what}{on}{when}"


# ------------------------------------------------------------------------ top


TOP_COLUMNS = ("function", "location", "self", "self_share", "total", "total_share")


def top(profile: Profile, limit: int = 20) -> tuple[list[str], list[tuple]]:
    """The ``limit`` frames with most samples of their own (innermost), then most in
    all (on the stack; a recursive frame counted once a sample), with their shares of
    the profile's samples, as a result (columns, rows)."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    for frames, n in profile.frames():
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for text in set(frames):
            total[text] = total.get(text, 0) + n
    whole = profile.samples or 1
    ranked = sorted(total, key=lambda t: (-own.get(t, 0), -total[t], t))[:limit]
    rows = []
    for text in ranked:
        f = frame(text)
        rows.append((f.function, f.location, own.get(text, 0), _percent(own.get(text, 0) / whole),
                     total[text], _percent(total[text] / whole)))
    return list(TOP_COLUMNS), rows


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


# ---------------------------------------------------------------------- files


def folded_text(profile: Profile) -> str:
    """One line per stack, ``frames count``, the most sampled first."""
    return "".join(f"{stack} {n}\n" for stack, n in profile.stacks.items())


def speedscope(profile: Profile) -> dict:
    """speedscope's file format (https://www.speedscope.app/file-format-schema.json):
    one sampled profile, a sample per stack weighted by its samples (unit "none")."""
    index: dict[str, int] = {}
    frames: list[dict] = []
    samples: list[list[int]] = []
    weights: list[int] = []
    for texts, n in profile.frames():
        stack = []
        for text in texts:
            i = index.get(text)
            if i is None:
                f = frame(text)
                i = index[text] = len(frames)
                frames.append({"name": f.function, "file": f.file, "line": f.line})
            stack.append(i)
        samples.append(stack)
        weights.append(n)
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [{"type": "sampled", "name": profile.title, "unit": "none",
                      "startValue": 0, "endValue": sum(weights), "samples": samples,
                      "weights": weights}],
        "name": f"dask-blackbox profile of {profile.title}",
        "activeProfileIndex": 0,
        "exporter": "dask-blackbox",
    }


def pprof(profile: Profile) -> bytes:
    """pprof's ``profile.proto`` (github.com/google/pprof, proto/profile.proto),
    gzip-compressed: sample type ``samples``/``count``, a Location (and a Function)
    per distinct frame, a Sample per stack, its locations from the innermost."""
    strings: dict[str, int] = {"": 0}

    def s(text: str) -> int:
        if text not in strings:
            strings[text] = len(strings)
        return strings[text]

    functions: dict[tuple[str, str, int], int] = {}
    locations: dict[str, int] = {}
    body = bytearray()
    body += _field(1, _message((1, s("samples")), (2, s("count"))))  # sample_type
    location_msgs = bytearray()
    function_msgs = bytearray()
    for texts, n in profile.frames():
        ids = []
        for text in reversed(texts):
            lid = locations.get(text)
            if lid is None:
                f = frame(text)
                key = (f.function, f.file, f.line)
                fid = functions.get(key)
                if fid is None:
                    fid = functions[key] = len(functions) + 1
                    function_msgs += _field(5, _message(
                        (1, fid), (2, s(f.function)), (3, s(f.function)), (4, s(f.file)),
                        (5, f.line)))
                lid = locations[text] = len(locations) + 1
                location_msgs += _field(4, _message((1, lid)) + _field(4, _message(
                    (1, fid), (2, f.line))))
            ids.append(lid)
        body += _field(2, _field(1, _packed(ids)) + _field(2, _packed([n])))  # sample
    body += location_msgs + function_msgs
    for text in strings:  # string_table, in index order (dicts keep insertion order)
        body += _field(6, text.encode("utf-8"))
    body += _field(11, _message((1, s("samples")), (2, s("count"))))  # period_type
    body += _key(12, 0) + _varint(1)  # period
    return gzip.compress(bytes(body), mtime=0)


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a message, a string, packed numbers)."""
    return _key(number, 2) + _varint(len(payload)) + payload


def _message(*numbers: tuple[int, int]) -> bytes:
    """A message of integer fields (varints); zero values left out, as proto3 does."""
    return b"".join(_key(k, 0) + _varint(v) for k, v in numbers if v)


def _packed(values: list[int]) -> bytes:
    return b"".join(map(_varint, values))


def format_of(path: str) -> str:
    """The format a file's suffix names (:data:`FORMATS`); ValueError naming the
    suffixes for another."""
    name = str(path)
    for suffix, fmt in sorted(FORMATS.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return fmt
    raise ValueError(f"{name}: the file's suffix names no format; one of {', '.join(FORMATS)}")


def write(profile: Profile, path: str) -> str:
    """Write ``profile`` to ``path`` in the format its suffix names (:data:`FORMATS`);
    returns the format. ValueError naming the suffixes for another."""
    name = str(path)
    fmt = format_of(name)
    if fmt == "folded":
        data = folded_text(profile).encode("utf-8")
    elif fmt == "speedscope":
        data = json.dumps(speedscope(profile), ensure_ascii=False).encode("utf-8")
    else:
        data = pprof(profile)
    with open(name, "wb") as out:
        out.write(data)
    return fmt
