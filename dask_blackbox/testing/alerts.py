"""Helpers for the alerts tests and bench/alerts.py: contract envelopes of worker
deaths as the producers send them (scheduler and nanny), and a webhook receiver on
loopback (``http.server`` in a thread) that records every POST."""

from __future__ import annotations

import http.server
import json
import threading
import time
import uuid
from collections import defaultdict

from dask_blackbox import contract


class Cluster:
    """Envelopes of one recorded cluster: a scheduler producer and a nanny producer,
    each with its own sequence."""

    def __init__(self, name: str = "alerts-test", cluster_id: str | None = None):
        self.id = cluster_id or f"Scheduler-{uuid.uuid4()}"
        self.name = name
        self._seq: dict[str, int] = defaultdict(int)
        self._producer = {s: f"{s}-{uuid.uuid4().hex[:8]}" for s in ("scheduler", "nanny")}

    def envelope(self, events: list[dict], source: str = "scheduler") -> dict:
        seq = self._seq[source]
        self._seq[source] += 1
        return {"schema": contract.SCHEMA_VERSION, "cluster_id": self.id, "cluster_name": self.name,
                "source": source, "producer_id": self._producer[source], "seq": seq,
                "sent_at": time.time(), "events": events}

    # --------------------------------------------------------------- events

    @staticmethod
    def added(worker: str, pid: int, nanny: str | None = "tcp://127.0.0.1:1", ts: float | None = None) -> dict:
        return {"kind": contract.LIFECYCLE, "ts": ts or time.time(), "action": "worker_added",
                "worker": worker, "client": None, "reason": None, "stimulus_id": None,
                "detail": {"name": worker, "nthreads": 1, "memory_limit": 2**30, "pid": pid,
                           "nanny": nanny}}

    @staticmethod
    def removed(worker: str, stimulus_id: str, expected: bool = False, processing: int = 1,
                ts: float | None = None) -> dict:
        return {"kind": contract.LIFECYCLE, "ts": ts or time.time(), "action": "worker_removed",
                "worker": worker, "client": None, "reason": stimulus_id.rsplit("-", 1)[0],
                "stimulus_id": stimulus_id,
                "detail": {"expected": expected, "processing_tasks": processing,
                           "lost_computed_tasks": 0, "lost_scattered_tasks": 0}}

    @staticmethod
    def exited(worker: str, pid: int, exitcode: int, ts: float | None = None,
               nanny_status: str = "running") -> dict:
        import signal

        sig = signal.Signals(-exitcode).name if exitcode < 0 else None
        return {"kind": contract.WORKER_EXIT, "ts": ts or time.time(), "worker": worker, "pid": pid,
                "exitcode": exitcode, "signal": sig, "memory": 10**8, "memory_peak": 2 * 10**8,
                "memory_limit": 2**30, "memory_terminate": 0.95, "host_memory": 2**34,
                "host_memory_available": 2**33, "nanny_status": nanny_status, "starts": 1,
                "started": time.time() - 10}

    @staticmethod
    def memory_kill(worker: str, pid: int, rss: int = 2**30, ts: float | None = None) -> dict:
        return {"kind": contract.EVENT, "ts": ts or time.time(), "topic": "worker-restart-memory",
                "msg": {"worker": worker, "pid": pid, "rss": rss}}

    @staticmethod
    def transition(key: str, start: str, finish: str, stimulus_id: str, ts: float | None = None,
                   prefix: str | None = None, span_id: str | None = None, worker: str | None = None,
                   exception: str | None = None) -> dict:
        return {"kind": contract.TRANSITION, "ts": ts or time.time(), "key": key, "start": start,
                "finish": finish, "stimulus_id": stimulus_id, "prefix": prefix or key.split("-")[0],
                "group": None, "span_id": span_id, "worker": worker, "exception": exception}

    @staticmethod
    def span(span_id: str, name: list[str]) -> dict:
        return {"kind": contract.SPAN, "ts": time.time(), "span_id": span_id, "name": name,
                "parent_id": None, "enqueued": time.time()}

    # ------------------------------------------------------------ scenarios

    def death(self, worker: str, pid: int, exitcode: int, key: str | None = None,
              memory: bool = False, nanny: bool = True) -> list[tuple[dict, str]]:
        """(envelope, what) pairs of one worker's life and death: it joins, runs
        ``key`` (if given), its process ends with ``exitcode`` (its nanny says so,
        unless ``nanny`` is False), the scheduler removes it. ``memory``: the nanny's
        memory monitor killed it."""
        stimulus = f"handle-worker-cleanup-{time.time()}"
        out = [(self.envelope([self.added(worker, pid, "tcp://127.0.0.1:1" if nanny else None)]),
                "added")]
        events = []
        if memory:
            events.append(self.memory_kill(worker, pid))
        if key:
            events.append(self.transition(key, "processing", "released", stimulus))
        events.append(self.removed(worker, stimulus, processing=1 if key else 0))
        out.append((self.envelope(events), "removed"))
        if nanny:
            out.append((self.envelope([self.exited(worker, pid, exitcode)], "nanny"), "exited"))
        return out


class Webhook:
    """A webhook receiver on 127.0.0.1: records every POST (arrival time, headers,
    JSON body); answers ``status`` (200 by default), or never answers while
    ``hang`` is set."""

    def __init__(self, status: int = 200):
        self.status = status
        self.hang = threading.Event()
        self.received: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                arrived = time.time()
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unreadable": body.decode("utf-8", "replace")}
                with outer.lock:
                    outer.received.append({"at": arrived, "path": self.path,
                                           "key": self.headers.get("Idempotency-Key"),
                                           "payload": payload, "status": outer.status,
                                           "hung": outer.hang.is_set()})
                if outer.hang.is_set():
                    time.sleep(30)
                    return
                self.send_response(outer.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def payloads(self, ok_only: bool = True) -> list[dict]:
        with self.lock:
            return [r["payload"] for r in self.received
                    if not ok_only or (r["status"] < 300 and not r["hung"])]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
