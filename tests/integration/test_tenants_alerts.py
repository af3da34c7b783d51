"""The alerter on a recorder many teams share: what a cluster chose (a task key with
a NUL byte, a key of 140 KB, an exception) and what a target answers (a byte every
half second, a redirect, terminal escapes) never stops a delivery for good, never
holds another rule's target, and no secret is printed or handed to a command.

Real ``dask-blackbox alerts`` processes on the session broker, envelopes as the
producers send them (tests/alerts_support.py), webhook servers on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from dask_blackbox.testing.alerts import Cluster, Webhook
from conftest import subprocess_env
from dask_blackbox.testing.polling import wait_for
from test_alerts import AlerterProcess, deaths, publish

SECRET = "s3cr3t-Pa55"


class Drip:
    """An HTTP server on 127.0.0.1 that answers every request ``200 OK`` a byte every
    ``every`` seconds (a 40-byte answer: 20 s at 0.5 s a byte), or, with
    ``location``, at once with a redirect there. It records, per connection, how
    many bytes of the answer it sent before the client went away, and which are
    still open."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"  # 40 bytes

    def __init__(self, every: float = 0.5, location: str | None = None) -> None:
        self.every, self.location = every, location
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.sent: list[int] = []  # bytes sent, per finished connection
        self.open = 0
        self.requests = 0
        self.lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with self.lock:
            self.open += 1
            self.requests += 1
        sent = 0
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            if self.location:
                conn.sendall(f"HTTP/1.1 302 Found\r\nLocation: {self.location}\r\n"
                             "Content-Length: 0\r\n\r\n".encode())
                return
            for byte in self.ANSWER:
                time.sleep(self.every)
                conn.sendall(bytes([byte]))
                sent += 1
        except OSError:
            pass
        finally:
            conn.close()
            with self.lock:
                self.open -= 1
                self.sent.append(sent)

    def close(self) -> None:
        self._closed = True
        self.sock.close()


class Escapes(Webhook):
    """A webhook that answers 500 with terminal escapes in its reason and body."""

    def __init__(self) -> None:
        super().__init__(status=500)
        handler = self.server.RequestHandlerClass
        outer = self

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with outer.lock:
                outer.received.append({"status": 500})
            body = b"\x1b]0;owned\x07\x1b[2J\x1b[31mred\r\nsecond line"
            self.send_response(500, "Bad\x1b[5m")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        handler.do_POST = do_POST


def erred(cluster: Cluster, key: str) -> dict:
    return cluster.envelope([cluster.transition(key, "processing", "erred", f"s-{time.time()}",
                                                prefix="boom", exception="ValueError: no")])


@pytest.fixture
def hook():
    h = Webhook()
    yield h
    h.close()


def test_hostile_task_keys_reach_a_command_rule_whole_on_stdin(bb_config, hook, tmp_path):
    """A NUL byte in a key, and a 140 KB key (more than one environment variable
    holds): each incident is delivered, the summary in the environment stripped and
    capped, the whole key on stdin; the command's environment holds none of the
    alerter's configuration (passwords included)."""
    out = tmp_path / "got.jsonl"
    script = ("import json, os, sys; data = json.load(sys.stdin); "
              f"open({str(out)!r}, 'a').write(json.dumps({{'env': dict(os.environ), 'stdin': data}}) + '\\n')")
    rules = [{"name": "cmd", "when": "task-erred", "prefix": "boom",
              "command": [sys.executable, "-c", script]},
             {"name": "hook", "when": "task-erred", "prefix": "boom", "webhook": hook.url}]
    env = {**bb_config, "DASK_BLACKBOX__CLICKHOUSE__DSN": f"http://blackbox:{SECRET}@127.0.0.1:1",
           "DASK_BLACKBOX__EXPORTER__HEADERS": repr({"authorization": f"Bearer {SECRET}"})}
    alerter = AlerterProcess(env, rules)
    cluster = Cluster(name="team-a")
    nul_key, long_key = "boom-\x00-nul", "boom-" + "k" * 140_000
    try:
        publish([erred(cluster, nul_key), erred(cluster, long_key)])
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) == 2, 30,
                 "both incidents at the command")
        wait_for(lambda: len(hook.received) == 2, 30, "both incidents at the webhook")
        got = sorted((json.loads(line) for line in out.read_text().splitlines()),
                     key=lambda g: len(g["stdin"]["key"]))
        assert [g["stdin"]["key"] for g in got] == [nul_key, long_key]  # whole, on stdin
        assert sorted(p["key"] for p in hook.payloads()) == sorted([nul_key, long_key])
        for g in got:
            summary = g["env"]["BLACKBOX_ALERT_SUMMARY"]
            assert "\x00" not in summary and len(summary) <= 1024
            assert g["stdin"]["summary"].startswith(f"task {g['stdin']['key']} erred")
            assert not [k for k in g["env"] if k.startswith("DASK")], sorted(g["env"])
            assert SECRET not in json.dumps(g["env"])
            assert set(g["env"]) <= {"PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR",
                                     "BLACKBOX_ALERT_ID", "BLACKBOX_ALERT_KEY",
                                     "BLACKBOX_ALERT_RULE", "BLACKBOX_ALERT_SUMMARY"}
        assert got[0]["env"]["BLACKBOX_ALERT_SUMMARY"].startswith("task boom--nul erred")
        log = alerter.stderr()
        assert "Traceback" not in log and "gave up" not in log, log
    finally:
        assert alerter.terminate() == 0


@pytest.mark.parametrize("target, fragment", [
    ({"webhook": "http://127.0.0.1:99999/hook"}, "Port out of range"),
    ({"webhook": "http://127.0.0.1:notaport/hook"}, "could not be cast"),
    ({"webhook": "http://[::1/hook"}, "Invalid IPv6 URL"),
    ({"webhook": "http://127.0.0.1:1/a\r\nX-Injected: 1"}, "control character"),
    ({"command": "notify --text 'unclosed"}, "No closing quotation"),
])
def test_a_bad_rule_is_a_one_line_error_at_check(bb_config, target, fragment):
    rules = [{"name": "bad", "when": "worker-died", **target}]
    for args in (["alerts", "--check"], ["alerts"]):
        out = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", *args],
                             env={**subprocess_env(bb_config),
                                  "DASK_BLACKBOX__ALERTS__RULES": repr(rules)},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        [line] = out.stderr.strip().splitlines()
        assert line.startswith("dask-blackbox: error: blackbox.alerts.rules[0] (bad)") and fragment in line


def test_an_attempt_is_bounded_redirects_are_not_followed_and_nothing_secret_is_printed(
        bb_config, hook):
    """``timeout: 1s`` bounds each attempt whole against a server dripping its 200
    answer; a redirect is a failed attempt, its target never reached; an answer's
    terminal escapes are not logged; a webhook's token (in its path, in ``?code=``)
    and credentials are printed neither in failure lines nor by ``--check``."""
    drip, elsewhere = Drip(every=0.5), Webhook()
    redirect, escapes = Drip(location=elsewhere.url), Escapes()
    failing = Webhook(status=500)
    secret_url = (f"http://alice:{SECRET}@127.0.0.1:{failing.server.server_address[1]}"
                  f"/services/T0/B0/{SECRET}?code={SECRET}-code")
    rules = [{"name": "drip", "when": "worker-died", "webhook": drip.url},
             {"name": "redirect", "when": "worker-died", "webhook": redirect.url},
             {"name": "escapes", "when": "worker-died", "webhook": escapes.url},
             {"name": "secret", "when": "worker-died", "webhook": secret_url},
             {"name": "good", "when": "worker-died", "webhook": hook.url}]
    check = subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "alerts", "--check"],
                           env={**subprocess_env(bb_config), "DASK_BLACKBOX__ALERTS__RULES": repr(rules)},
                           capture_output=True, text=True, timeout=60, check=True)
    assert SECRET not in check.stdout + check.stderr and "secret: worker-died -> webhook " \
        f"http://127.0.0.1:{failing.server.server_address[1]}/…" in check.stdout
    alerter = AlerterProcess(bb_config, rules, timeout="1s", attempts="2", retry_backoff_max="200ms")
    try:
        publish(deaths(Cluster(), 1))
        wait_for(lambda: alerter.stderr().count("gave up on incident") >= 4, 60,
                 "the alerter to give up on the four bad targets")
        log = alerter.stderr()
        assert "rule drip: gave up on incident" in log and "no answer within 1s" in log
        wait_for(lambda: len(drip.sent) == 2, 30, "the drip server to see both attempts end")
        with drip.lock:
            assert drip.requests == 2 and all(n < len(Drip.ANSWER) for n in drip.sent)
        assert "rule redirect: gave up" in log and "HTTP 302 Found, a redirect (not followed)" in log
        assert elsewhere.received == []
        assert "rule escapes: gave up" in log and "red second line" in log
        assert "\x1b" not in log and "\x07" not in log
        assert "rule secret: gave up" in log and len(failing.received) == 2
        assert SECRET not in log and "alice" not in log
        assert len(hook.received) == 1 and "Traceback" not in log
    finally:
        assert alerter.terminate() == 0
        for server in (drip, redirect, escapes, failing, elsewhere):
            server.close()


def test_six_slow_deliveries_do_not_hold_another_rules_webhook(bb_config, hook):
    """Six incidents to a webhook dripping its answer over 20 s, with a timeout that
    lets them run: the healthy rule's webhook has all six while all six slow
    attempts are still open (no shared pool they could fill)."""
    drip = Drip(every=0.5)
    rules = [{"name": "slow", "when": "worker-died", "webhook": drip.url},
             {"name": "good", "when": "worker-died", "webhook": hook.url}]
    alerter = AlerterProcess(bb_config, rules, timeout="60s", attempts="1")
    try:
        publish(deaths(Cluster(), 6))
        wait_for(lambda: drip.requests == 6, 60, "six slow attempts")
        wait_for(lambda: len(hook.received) == 6, 60, "the six incidents at the healthy webhook")
        with drip.lock:
            assert drip.open == 6 and drip.sent == [], (drip.open, drip.sent)
    finally:
        assert alerter.terminate() == 0
        drip.close()
