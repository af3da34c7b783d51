"""The hand-over to a helper process, and the helper's supervision.

With ``producer.sender: process`` (``auto`` for the scheduler) the Dask process keeps only
the hand-over: a :class:`Relay` thread takes items from the buffer, makes them portable
(:meth:`~producers.rows.RowMaker.rows`: a transition or graph item goes with its groups'
names, every other item as its row, so a user's object is sanitized here, never sent on)
and writes them to a helper process
(:func:`main`) whose buffer the same :class:`~producers.sender.Sender` drains under the
same producer id: the delivery semantics of :mod:`producers.sender`, without holding the
GIL Dask's event loop needs.

The hand-over, at the sender's linger and when closing: a :class:`Frame` of at most
:data:`FRAME_ITEMS` items and rows, the buffer's drops since the last frame (the helper
reports them) and the identity if it changed, msgpack-encoded behind a 4-byte little-endian
length, one ``write`` to the helper's stdin. What msgpack cannot encode goes as the JSON the
thread sender would have sent (:func:`encodable`).

The helper writes a JSON status line at most every :data:`STATUS_INTERVAL` while anything
changes: rows done (delivered or given up), its sender's counters, its collections. The
relay gives buffer room back for done rows only, so ``buffer-max-events`` and
``buffer-max-bytes`` bound what the two processes hold together.

Failures:

- If the helper cannot start or dies, the relay logs a warning and becomes a thread Sender
  on the same buffer (what is buffered is kept), under a new producer id if the helper may
  have used the old one (no ``seq`` is reused). The rows a dead helper held (also counted
  ``abandoned``) and the drops handed to it that it had not reported are counted dropped,
  which the thread sender reports.
- The helper ignores SIGINT and SIGTERM. At the end of its stdin (closed by the Dask
  process, or by its death) it delivers what it holds within ``close-timeout`` and exits.
  The relay's close hands over what is left, closes that stdin and waits for the exit
  (``close-timeout`` plus :data:`CLOSE_GRACE`); ``lost_at_close`` comes from the last status.

The helper adds ``producer.helper-niceness`` to the Dask process's niceness and, like the
relay and status threads, runs under ``SCHED_BATCH`` (Linux). It freezes what it made while
starting and collects rarely (:data:`HELPER_GC_THRESHOLDS`: what it allocates is acyclic
and short-lived). It imports neither Dask's distributed nor the pipeline's other packages.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec
import orjson

try:
    import fcntl
except ImportError:  # not POSIX: the pipe keeps its size
    fcntl = None  # type: ignore[assignment]

from dask_blackbox.contract import TRANSITION
from dask_blackbox.producers.buffer import Buffer, DropCount
from dask_blackbox.producers.encode import encode_event
from dask_blackbox.producers.rows import (
    GraphItem, Ready, RowMaker, TransitionItem, TransitionRow,
)
from dask_blackbox.producers.sender import (
    THREAD_PREFIX, Drain, Identity, Sender, new_producer_id, yield_on_wakeup,
)
from dask_blackbox.producers.settings import ProducerSettings

logger = logging.getLogger(__name__)

FRAME_ITEMS = 20_000
STATUS_INTERVAL = 0.05  # seconds
#: The helper's input pipe's size (Linux): frames it has not read yet wait there.
PIPE_BYTES = 1 << 20
HELPER_GC_THRESHOLDS = (20_000, 20, 20)  # CPython's default: 700, 10, 10
CLOSE_GRACE = 2.0  # seconds
_HEADER = struct.Struct("<I")
_HELPER_MAIN = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from dask_blackbox.producers.relay import main; main()")
#: The sender counters the relay sums over the helper and the thread sender it became.
_SUMMED = ("sent_envelopes", "sent_events", "sent_drop_reports", "reported_drops",
           "build_errors", "lost_at_close")


class Frame(msgspec.Struct, array_like=True, gc=False):
    """What the relay writes to the helper at once (module docstring)."""

    rows: list[TransitionItem | GraphItem | TransitionRow | Ready]  # type: ignore[valid-type]
    drops: DropCount | None = None
    identity: tuple[str, str | None] | None = None


_encode_frame = msgspec.msgpack.Encoder().encode
_decode_frame = msgspec.msgpack.Decoder(Frame).decode


def encodable(row: Any, maker: RowMaker) -> Any:
    """What msgpack can encode of a portable item or a row: itself, else the row of an
    item, else its event as the JSON the thread sender would have sent
    (:func:`~producers.encode.encode_event`)."""
    with contextlib.suppress(Exception):
        _encode_frame(row)
        return row
    if type(row) is TransitionItem or type(row) is GraphItem:  # its row holds text only
        return encodable(maker.make(row), maker)
    event = row.event if type(row) is Ready else {"kind": TRANSITION,
                                                  **msgspec.structs.asdict(row)}
    return Ready(orjson.loads(encode_event(event, maker.max_chars)), row.weight)


class Helper:
    """One helper process, started with ``hello`` (OSError if it cannot be): its pipes,
    and its status (read by a thread of its own)."""

    def __init__(self, relay: Relay, hello: bytes):
        self.relay = relay
        self.producer_id = relay.identity.producer_id
        self.lock = threading.Lock()  # the relay thread vs the status thread
        self.forwarded = 0  # rows written to it
        self.done = 0  # of those, finished by it
        self.batches: deque[tuple[int, int, int]] = deque()  # (forwarded after, n, weight)
        self.drops_handed = 0  # drops handed to it
        self.status: dict[str, Any] = {}
        self.started = False  # it wrote its first status line
        self.ended = threading.Event()  # its stdout ended
        # Isolated (-I): it imports from this process's sys.path, never a module that
        # shadows ours from wherever it was started.
        path = [os.path.abspath(p) for p in sys.path]
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-c", _HELPER_MAIN, json.dumps(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        with contextlib.suppress(AttributeError, OSError):
            fcntl.fcntl(self.process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            self.write(hello)
        except OSError:  # it exited at start
            self.kill()
            raise
        threading.Thread(target=self._read_status, daemon=True,
                         name=f"{THREAD_PREFIX}{relay.identity.source}-relay-status").start()

    def write(self, data: bytes) -> None:
        stdin = self.process.stdin
        stdin.write(_HEADER.pack(len(data)))
        stdin.write(data)
        stdin.flush()

    def close_input(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.close_input()

    def _read_status(self) -> None:
        yield_on_wakeup()
        try:
            for line in self.process.stdout:
                try:
                    status = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                self.started = True
                with self.lock:  # give back the room of the rows it did
                    self.status = status
                    self.done = min(status.get("done", 0), self.forwarded)
                    while self.batches and self.batches[0][0] <= self.done:
                        _, n, weight = self.batches.popleft()
                        self.relay.buffer.release(n, weight)
        except Exception:
            logger.exception("dask-blackbox: reading its helper's status failed")
        finally:
            self.ended.set()
            self.relay.wake()


class Relay(Drain):
    """Drains ``buffer`` into a helper process that sends (module docstring)."""

    role = "relay"

    def __init__(self, buffer: Buffer, settings: ProducerSettings, identity: Identity,
                 rows: RowMaker):
        super().__init__(buffer, settings, identity, rows)
        self.woken = threading.Event()
        self.helper: Helper | None = None
        self.ended_status: dict[str, Any] = {}  # of the helper, once it ended
        self.fallback: Sender | None = None  # the thread sender it became
        self.identity_handed: tuple | None = None
        self.abandoned = 0  # rows a dead helper took with it

    def wake(self) -> None:
        self.woken.set()

    def close(self, deadline: float) -> None:
        if self.fallback is not None:
            self.fallback.close(deadline)
        super().close(deadline)

    def _main(self) -> None:
        yield_on_wakeup()
        try:
            if self._relay():
                return
        except Exception:
            logger.exception("dask-blackbox %s: the relay to its helper process failed",
                             self.identity.producer_id)
        self._send_here()

    def _relay(self) -> bool:
        """Hand over until closed (True), or False when no helper can be used."""
        identity = self.identity
        self.identity_handed = (identity.cluster_id, identity.cluster_name)
        hello = pickle.dumps({"settings": self.settings, "source": identity.source,
                              "producer_id": identity.producer_id,
                              "identity": self.identity_handed}, protocol=5)
        try:
            self.helper = helper = Helper(self, hello)
        except OSError as e:
            logger.warning("dask-blackbox %s: cannot use its helper process (%s); sending from "
                           "the %s process instead", identity.producer_id, e, identity.source)
            return False
        linger = self.settings.flush_interval
        while True:
            if not self.closing:
                self.woken.wait(linger)
                self.woken.clear()
            closing = self.closing
            if helper.ended.is_set():  # it died: this process sends from now on
                return False
            try:
                handed = self._hand_over()
            except OSError:  # its stdin is gone: it died
                helper.ended.wait(1.0)
                continue
            linger = self.linger(handed)
            if closing and not self.buffer.waiting:  # it delivers what it holds, and exits
                helper.close_input()
                try:
                    helper.process.wait(
                        max(self.close_deadline - time.monotonic(), 0) + CLOSE_GRACE)
                except subprocess.TimeoutExpired:
                    helper.kill()
                helper.ended.wait(1.0)
                return True

    def _hand_over(self) -> int:
        """One frame of what waits (an empty frame when only drops or the identity
        changed); how many rows it held."""
        buffer, helper = self.buffer, self.helper
        taken = buffer.take(FRAME_ITEMS, 1 << 62)
        rows, failed = self.make_rows(taken.items, portable=True)
        failed_weight = sum(item.weight for item in failed)
        buffer.release(len(failed), failed_weight)  # given up
        weight = taken.weight - failed_weight
        drops = buffer.unreported_drops()
        identity = (self.identity.cluster_id, self.identity.cluster_name)
        if identity == self.identity_handed or identity[0] is None:
            identity = None
        if not rows and drops is None and identity is None:
            return 0
        frame = Frame(rows, drops, identity)
        try:
            data = _encode_frame(frame)
        except Exception:
            frame.rows = [encodable(row, self.rows) for row in rows]
            data = _encode_frame(frame)
        with helper.lock:
            helper.forwarded += len(rows)
            if rows:
                helper.batches.append((helper.forwarded, len(rows), weight))
            if drops is not None:
                helper.drops_handed += drops.events
        try:
            helper.write(data)
        finally:
            if identity is not None:
                self.identity_handed = identity
        return len(rows)

    def _send_here(self) -> None:
        """Become a thread sender (module docstring, Failures)."""
        helper = self.helper
        if helper is not None:
            helper.kill()
            helper.ended.wait(1.0)
            with helper.lock:
                lost = helper.forwarded - helper.done
                held = sum(n for _, n, _ in helper.batches)
                weight = sum(w for _, _, w in helper.batches)
                helper.batches.clear()
                self.buffer.release(held, weight)
                if lost:
                    self.buffer.drop(weight, lost)
                self.abandoned += lost
                unreported = helper.drops_handed - helper.status.get("reported_drops", 0)
                if unreported > 0:
                    self.buffer.drop(0, unreported)
                self.helper = None
                self.ended_status = helper.status
            self.identity.producer_id = new_producer_id(self.identity.source)
            logger.warning(
                "dask-blackbox: the helper process of %s ended (code %s) with %d undelivered "
                "event(s), counted as dropped; the %s process sends from now on, as %s",
                helper.producer_id, helper.process.returncode, lost, self.identity.source,
                self.identity.producer_id)
        sender = Sender(self.buffer, self.settings, self.identity, self.rows)
        if self.closing:
            sender.close(self.close_deadline)
        self.fallback = sender
        sender._main()

    def stats(self) -> dict[str, Any]:
        helper, fallback = self.helper, self.fallback
        status = helper.status if helper else {}
        here = fallback.stats() if fallback else {}
        senders = (self.ended_status, status, here)
        out: dict[str, Any] = {name: sum(s.get(name, 0) for s in senders) for name in _SUMMED}
        out["build_errors"] += self.build_errors
        live = here if fallback else status
        out.update(next_seq=live.get("next_seq", 0), connected=bool(live.get("connected")),
                   sender="thread" if fallback else "process", abandoned=self.abandoned,
                   relay_pid=helper.process.pid if helper else None,
                   relay_ready=helper is not None and helper.started,
                   relay_gc_collections=(status if helper else self.ended_status).get("gc"))
        return out


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes of ``fd``; None at the end of the input."""
    parts = []
    while n:
        if not (chunk := os.read(fd, n)):
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> bytes | None:
    header = _read_exact(fd, _HEADER.size)
    return None if header is None else _read_exact(fd, _HEADER.unpack(header)[0])


class Receiver:
    """The helper's side: frames in, their items and rows offered to its buffer, which its
    sender drains (making the items' rows)."""

    def __init__(self, hello: dict, out: Any = None):
        self.settings = settings = hello["settings"]
        self.buffer = Buffer(1 << 62, 1 << 62)  # the Dask process bounds what it hands over
        identity = Identity(hello["source"], *hello["identity"],
                            producer_id=hello["producer_id"])
        self.sender = Sender(self.buffer, settings, identity,
                             RowMaker(settings.max_value_bytes))
        self.out = out  # where status lines go
        self._last_status: bytes | None = None

    def apply(self, data: bytes) -> None:
        frame = _decode_frame(data)
        identity = self.sender.identity
        if frame.identity is not None:
            identity.cluster_id, identity.cluster_name = frame.identity
        if frame.drops is not None:
            self.buffer.add_drops(frame.drops)
        offer = self.buffer.offer
        for row in frame.rows:
            offer(row)
        self.sender.wake()

    def report(self, force: bool = False) -> None:
        """Write the status line to :attr:`out` if it changed (or ``force``)."""
        status = {"done": self.buffer.released, **self.sender.stats()}
        line = orjson.dumps(status)
        if line == self._last_status and not force:
            return
        self._last_status = line
        status["gc"] = [s["collections"] for s in gc.get_stats()]
        self.out.write(orjson.dumps(status) + b"\n")
        self.out.flush()


def main() -> None:
    """The helper process (module docstring): frames from stdin, status to stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format="%(asctime)s - dask-blackbox relay %(process)d - %(levelname)s - %(message)s")
    stdin, out = sys.stdin.fileno(), sys.stdout.buffer
    data = _read_frame(stdin)
    if data is None:
        return
    hello = pickle.loads(data)
    with contextlib.suppress(OSError):
        os.nice(hello["settings"].helper_niceness)
    yield_on_wakeup()  # before any thread starts: they inherit it and the niceness
    receiver = Receiver(hello, out)
    receiver.sender.start()
    gc.freeze()
    gc.set_threshold(*HELPER_GC_THRESHOLDS)
    receiver.report(force=True)
    selector = selectors.DefaultSelector()
    selector.register(stdin, selectors.EVENT_READ)
    next_status = 0.0
    try:
        while True:
            if selector.select(STATUS_INTERVAL):
                data = _read_frame(stdin)
                if data is None:
                    break
                receiver.apply(data)
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_INTERVAL
                receiver.report()
    except BrokenPipeError:  # the Dask process is gone: deliver what is held
        pass
    sender = receiver.sender
    sender.close(time.monotonic() + receiver.settings.close_timeout)
    sender.thread.join(receiver.settings.close_timeout + 1.0)
    with contextlib.suppress(BrokenPipeError, ValueError):
        receiver.report(force=True)
