"""What each dead worker was doing: its last stacks before its removal.

Two records answer, whichever there is:

- the nanny's reading of the process from outside (``stacks``, contract ``Stacks``:
  py-spy, taken when the process neared the memory its nanny kills it at or its event
  loop stopped answering): every thread's stack at one moment, which thread held the
  GIL. It is the one word there is on a worker whose task held the GIL, which stops
  Dask's own profiler with everything else;
- the worker's own profile (``profiles``, contract ``Profile``): Dask's samples of its
  last :data:`LAST_CYCLES` profile cycles per task prefix, the frames innermost in
  most of them. The worker ships them every few cycles (about 3 s), so a process that
  is killed loses up to its last ~3 s of samples: the line says how long before the
  removal its last cycle ended.

:func:`of_deaths` reads both for any number of deaths in four statements. Each death
gets a :class:`LastStack` (``as_dict``): the reading of the process (the last one at
the reading nearest to the removal, which may come a moment after it, while the
process is still stuck), the profile's last cycles, and :attr:`LastStack.line`, what the pages and
``why`` print: ``last stack: <prefix or thread> <innermost frames>``, or ``no
samples`` and why.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from dask_blackbox.read.backends import Backend
from dask_blackbox.read.filters import table
from dask_blackbox.read.profiles import frame

#: Profile cycles read per dead worker (the worker publishes 3 at a time).
LAST_CYCLES = 3
#: What a killed worker loses of its profile at most: the cycles not published yet
#: (3 of Dask's 1 s cycles), in seconds.
UNPUBLISHED_S = 3.0
#: How long after a removal a reading of the process still tells what it was doing
#: (a process stuck holding the GIL outlives its removal), and how far a cycle's time
#: (the worker's clock, corrected by Dask for the scheduler's) may pass the removal.
AFTER_S = 60.0
CLOCK_SLACK_S = 1.0
#: Frames shown per stack, the innermost first; prefixes and threads shown per death.
FRAMES_SHOWN = 3
INNERMOST_SHOWN = 3
#: Frames of Dask's worker running a task in a thread (a task's thread, not an idle
#: one), by the versions of distributed that have them.
_TASK_FRAMES = ("_run_task", "_run_task_simple", "_run_actor", "apply_function",
                "apply_function_simple", "apply_function_actor")
#: Where a frame is the library's or Python's own, not the code that was run on Dask.
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python\d+\.\d+/|^<frozen ")


@dataclasses.dataclass
class LastStack:
    """What one dead worker was doing (module docstring)."""

    #: the nanny's reading: ts, reason, memory, memory_limit, silent, error and its
    #: threads that tell something (``threads``: name, thread_id, active, gil, frames
    #: innermost first as {function, location}), the telling first; None without one
    reading: dict | None = None
    #: the profile's last cycles: since, until, cycles, and per prefix (most samples
    #: first) its samples and innermost frames ({function, location, samples}); None
    #: without one
    profile: dict | None = None
    #: why nothing is shown, when nothing is
    missing: str | None = None

    @property
    def source(self) -> str | None:
        if self.reading is not None and self.reading["threads"]:
            return "py-spy"
        return "profile" if self.profile is not None else None

    @property
    def line(self) -> str:
        """``last stack: ...`` or ``no samples: ...``, one line."""
        source = self.source
        if source == "py-spy":
            r = self.reading
            assert r is not None
            t = r["threads"][0]
            held = ", holding the GIL" if t["gil"] else ""
            return (f"last stack (py-spy, {_why(r)}): thread {t['name']}{held}: "
                    f"{_frames(t['frames'])}")
        if source == "profile":
            p = self.profile
            assert p is not None
            parts = [f"{x['prefix']} {_frames(x['innermost'], counted=True)}"
                     for x in p["prefixes"][:INNERMOST_SHOWN]]
            return (f"last stack (Dask's profile, {p['cycles']} cycle(s) ending {p['lag_s']:.1f} s "
                    f"before its removal): " + "; ".join(parts) + p["note"])
        return f"no samples: {self.missing}"

    def as_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "reading": self.reading,
                "profile": self.profile, "missing": self.missing}


def _why(reading: dict) -> str:
    if reading["reason"] == "unresponsive":
        silent = reading["silent"]
        return ("its event loop silent " + (f"{silent:.1f} s" if silent is not None else "")).strip()
    if reading["reason"] == "memory":
        from dask.utils import format_bytes

        memory, limit = reading["memory"], reading["memory_limit"]
        of = f" of its {format_bytes(limit)} limit" if limit else ""
        return f"memory {format_bytes(memory)}{of}" if memory else "memory"
    return str(reading["reason"])


def _frame_text(f: dict) -> str:
    return f"{f['function']} ({f['location'].rsplit('/', 1)[-1]})"


def _frames(frames: list[dict], counted: bool = False) -> str:
    """The innermost frames (of a stack, innermost first; or the hottest innermost
    frames, with their samples), and the innermost frame of the code run on Dask
    when those are all the library's."""
    shown = frames[:FRAMES_SHOWN]
    texts = [_frame_text(f) + (f" x{f['samples']}" if counted else "") for f in shown]
    text = (", " if counted else " < ").join(texts) or "(no Python frame)"
    if not counted and not any(f["own"] for f in shown):
        own = next((f for f in frames if f["own"]), None)
        if own is not None:
            text += f" ... in {_frame_text(own)}"
    return text


def _described(text: str) -> dict:
    """A frame's function and location, and whether it is of the code run on Dask
    (``own``: not the libraries' nor Python's)."""
    f = frame(text)
    return {"function": f.function, "location": f.location, "own": not _LIBRARY.search(f.file)}


#: What :func:`of_deaths` reads (from ``{profiles}``).
OF_DEATHS = ("SELECT DISTINCT cluster_id FROM {profiles} WHERE cluster_id IN "
             "{{cs:Array(String)}}")


def of_deaths(backend: Backend, deaths: Sequence[Any]) -> list[LastStack]:
    """The :class:`LastStack` of each death (in order): any objects with
    ``cluster_id``, ``worker``, ``pid`` (None if not known), ``ts`` (the removal) and
    ``added`` (when it joined, None if not known), as :class:`.diagnosis.Death`."""
    if not deaths:
        return []
    n = len(deaths)
    p = {"cs": [d.cluster_id for d in deaths], "ws": [d.worker for d in deaths],
         "ps": [d.pid or 0 for d in deaths], "ts": [float(d.ts) for d in deaths],
         "ss": [float(d.added) - CLOCK_SLACK_S if d.added is not None else 0.0 for d in deaths],
         "after": AFTER_S}
    each = "range(1, length({ws:Array(String)}) + 1)"
    readings = _readings(backend, p, each, n)
    profiles = _profiles(backend, p, each, n)
    _, rows = backend.query(
        OF_DEATHS.format(profiles=table(backend, 'profiles')), {"cs": sorted(set(p["cs"]))})
    profiled = {c for c, in rows}
    out = []
    for i, d in enumerate(deaths):
        last = LastStack(readings[i], profiles[i])
        if last.source is None:
            last.missing = _missing(d, d.cluster_id in profiled, readings[i])
        out.append(last)
    return out


#: What :func:`_readings` reads (from ``{stacks}``; ``{each}`` filled in where it is run).
READINGS = ("SELECT i, toFloat64(ts) AS t, reason, memory, memory_limit, silent, error, "
            "thread, thread_id, active, gil, stack FROM {stacks} ARRAY JOIN arrayFilter(i -> "
            "cluster_id = {{cs:Array(String)}}[i] AND (worker = {{ws:Array(String)}}[i] OR "
            "(worker = '' AND pid = {{ps:Array(UInt32)}}[i])) AND ({{ps:Array(UInt32)}}[i] = "
            "0 OR pid = {{ps:Array(UInt32)}}[i]) AND toFloat64(ts) >= "
            "{{ss:Array(Float64)}}[i] AND toFloat64(ts) <= {{ts:Array(Float64)}}[i] + "
            "{{after:Float64}}, {each}) AS i WHERE cluster_id IN {{cs:Array(String)}} ORDER "
            "BY i, t, thread_id")


def _readings(backend: Backend, p: dict, each: str, n: int) -> list[dict | None]:
    """Per death, the nanny's reading of its process that tells most: of those that
    read threads, the nearest to the removal (before it on a tie: a process stuck
    when it was removed is still stuck a moment later, and an earlier stall, a first
    task's imports, is not what it died of); else the last that failed (its error)."""
    _, rows = backend.query(READINGS.format(stacks=table(backend, 'stacks'), each=each), p)
    grouped: dict[int, dict[tuple, dict]] = defaultdict(dict)
    for i, t, reason, memory, limit, silent, error, thread, tid, active, gil, stack in rows:
        reading = grouped[i - 1].setdefault((t, reason), {
            "ts": t, "reason": reason, "memory": memory, "memory_limit": limit,
            "silent": silent, "error": error or None, "threads": []})
        if thread or stack:
            frames = [_described(text) for text in reversed(stack.split(";"))] if stack else []
            reading["threads"].append({"name": thread, "thread_id": tid, "active": bool(active),
                                       "gil": bool(gil), "frames": frames,
                                       "task": any(f["function"] in _TASK_FRAMES for f in frames)})
    out: list[dict | None] = [None] * n
    for i, readings in grouped.items():
        removal = p["ts"][i]
        good = [r for r in readings.values() if r["threads"]]
        chosen = (min(good, key=lambda r: (abs(r["ts"] - removal), r["ts"] > removal)) if good
                  else list(readings.values())[-1])
        chosen["threads"] = _telling(chosen["threads"], chosen["reason"])
        out[i] = chosen
    return out


def _telling(threads: list[dict], reason: str) -> list[dict]:
    """The threads that tell what the process was doing, the telling first: for a
    process that stopped answering, the one holding the GIL; for one near its memory
    kill, those running a task (what allocates; Dask's own collection of garbage may
    hold the GIL then); then the others running."""
    shown = [t for t in threads if t["gil"] or t["task"] or t["active"]]
    if reason == "memory":
        return sorted(shown, key=lambda t: (not t["task"], not t["gil"], not t["active"]))
    return sorted(shown, key=lambda t: (not t["gil"], not t["task"], not t["active"]))


#: What :func:`_profiles` reads (``{profiles}``, ``{where}``, ``{LAST_CYCLES}`` filled in
#: where it is run).
LAST_CYCLES_OF = ("SELECT i, toFloat64(ts) AS t FROM {profiles} ARRAY JOIN {where} GROUP BY i, t "
                  "ORDER BY i, t DESC LIMIT {LAST_CYCLES} BY i")
#: What :func:`_profiles` reads (``{profiles}``, ``{where}`` filled in where it is run).
STACKS_OF = ("SELECT i, prefix, stack, toUInt64(sum(count)) FROM {profiles} ARRAY JOIN "
             "{where} GROUP BY i, prefix, stack")


def _profiles(backend: Backend, p: dict, each: str, n: int) -> list[dict | None]:
    """Per death, its worker's last LAST_CYCLES profile cycles (of task prefixes) up
    to its removal: per prefix, its samples and the frames innermost in most."""
    profiles = table(backend, "profiles")
    where = ("arrayFilter(i -> cluster_id = {cs:Array(String)}[i] AND worker = {ws:Array(String)}[i] "
             "AND toFloat64(ts) >= {lo:Array(Float64)}[i] AND toFloat64(ts) <= {hi:Array(Float64)}[i], "
             f"{each}) AS i WHERE cluster_id IN {{cs:Array(String)}} AND worker IN {{ws:Array(String)}} "
             "AND prefix != ''")
    _, cycles = backend.query(
        LAST_CYCLES_OF.format(profiles=profiles, where=where, LAST_CYCLES=LAST_CYCLES),
        {"cs": p["cs"], "ws": p["ws"], "lo": p["ss"], "hi": [t + CLOCK_SLACK_S for t in p["ts"]]})
    times: dict[int, list[float]] = defaultdict(list)
    for i, t in cycles:
        times[i - 1].append(t)
    out: list[dict | None] = [None] * n
    if not times:
        return out
    lo = [min(times[i]) if i in times else 0.0 for i in range(n)]
    hi = [max(times[i]) if i in times else -1.0 for i in range(n)]
    _, rows = backend.query(
        STACKS_OF.format(profiles=profiles, where=where), {"cs": p["cs"], "ws": p["ws"], "lo": lo, "hi": hi})
    samples: dict[int, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for i, prefix, stack, count in rows:
        samples[i - 1][prefix][stack.rsplit(";", 1)[-1]] += int(count)
    for i, by_prefix in samples.items():
        prefixes = []
        for prefix, innermost in by_prefix.items():
            prefixes.append({"prefix": prefix, "samples": sum(innermost.values()), "innermost": [
                {**_described(text), "samples": count}
                for text, count in sorted(innermost.items(), key=lambda kv: (-kv[1], kv[0]))[:INNERMOST_SHOWN]]})
        prefixes.sort(key=lambda x: (-x["samples"], x["prefix"]))
        lag = max(p["ts"][i] - hi[i], 0.0)
        note = (f" (what it did in its last {lag:.1f} s was not published: a killed worker "
                f"loses up to its last ~{UNPUBLISHED_S:.0f} s)" if lag > CLOCK_SLACK_S else "")
        out[i] = {"since": lo[i], "until": hi[i], "cycles": len(times[i]), "lag_s": lag,
                  "prefixes": prefixes, "note": note}
    return out


def _missing(death: Any, profiled: bool, reading: dict | None) -> str:
    """Why a death has no stack to show, honestly."""
    said = []
    if reading is not None and reading.get("error"):
        said.append(f"its nanny could not read its stacks ({reading['error']})")
    if not profiled:
        said.append("its cluster recorded no profile (blackbox.producer.record.profiles off, "
                    "or no task ran)")
    else:
        said.append(f"no profile cycle of a task of it was published before its removal "
                    f"(a worker publishes its samples every ~{UNPUBLISHED_S:.0f} s: a killed "
                    f"one loses up to its last ~{UNPUBLISHED_S:.0f} s)")
    if reading is None:
        said.append("its nanny read no stacks (it reads them when the process nears its "
                    "memory kill or stops answering)")
    return "; ".join(said)
