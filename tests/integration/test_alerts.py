"""The alerter process against a real broker and a real HTTP server on loopback: each
incident is delivered once across a SIGKILL at any point (the checkpoint, the
outbox, the idempotency key), and a webhook that answers 500 or never answers gets
a clear line while the alerter goes on.

The envelopes are those the producers send for a worker's death (dask_blackbox/testing/alerts.py);
test_diagnosis.py runs the alerter under ``up`` on a real cluster's deaths.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time
import uuid

import orjson
import pytest

from dask_blackbox.alerts.service import READY_LINE

from dask_blackbox.testing.alerts import Cluster, Webhook
from conftest import subprocess_env
from dask_blackbox.testing.polling import wait_for
from sink_support import produce


class AlerterProcess:
    """``dask-blackbox alerts`` in a subprocess, with the test's settings."""

    def __init__(self, bb_env: dict, rules: list[dict], **settings: str):
        env = subprocess_env(bb_env)
        env["DASK_BLACKBOX__ALERTS__RULES"] = repr(rules)
        env["DASK_BLACKBOX__ALERTS__EVIDENCE_WAIT"] = "1s"
        # a short session: a killed alerter's partitions come back soon (Tansu takes
        # it; Apache Kafka's group.min.session.timeout.ms would want 6s)
        env["DASK_BLACKBOX__ALERTS__SESSION_TIMEOUT"] = "2s"
        for key, value in settings.items():
            env["DASK_BLACKBOX__ALERTS__" + key.upper()] = value
        self.state_dir = pathlib.Path(bb_env["DASK_BLACKBOX__DATA_DIR"]) / "alerts"
        self.checkpoint = self.state_dir / f"{bb_env['DASK_BLACKBOX__ALERTS__GROUP_ID']}.json"
        self.log = pathlib.Path(bb_env["DASK_BLACKBOX__DATA_DIR"]).parent / f"alerts-{uuid.uuid4().hex[:6]}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(self.log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "dask_blackbox.cli", "alerts"], env=env,
                                     stdout=subprocess.PIPE, stderr=self._err)
        line = self.proc.stdout.readline().decode()
        assert line.startswith(READY_LINE), f"alerter did not start: {line!r}\n{self.stderr()}"

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")

    def wait_paused(self, point: str, timeout: float = 30.0) -> None:
        marker = self.state_dir / f"alerts-paused-at-{point}"
        wait_for(lambda: marker.exists() or self.proc.poll() is not None, timeout,
                 f"the alerter to pause at {point}", interval=0.05)
        assert self.proc.poll() is None, self.stderr()
        marker.unlink()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._err.close()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self._err.close()
        return code


def publish(envelopes: list[dict]) -> None:
    produce([(e["cluster_id"].encode(), orjson.dumps(e)) for e in envelopes])


def deaths(cluster: Cluster, n: int, first: int = 0, exitcode: int = -11) -> list[dict]:
    return [env for i in range(first, first + n)
            for env, _ in cluster.death(f"tcp://10.1.0.{i}:4000", 1000 + i, exitcode, key=f"task-{i}")]


def ids(hook: Webhook) -> list[str]:
    return [p["id"] for p in hook.payloads()]


@pytest.fixture
def hook():
    h = Webhook()
    yield h
    h.close()


def test_a_sigkill_between_checkpoint_and_delivery_loses_nothing(bb_config, hook):
    rules = [{"name": "deaths", "when": "worker-died", "webhook": hook.url}]
    cluster = Cluster()
    alerter = AlerterProcess(bb_config, rules, debug_pause_at="after-outbox")
    try:
        publish(deaths(cluster, 1))
        alerter.wait_paused("after-outbox")  # in the checkpoint's outbox, not sent
        assert hook.received == []
    finally:
        alerter.kill()
    alerter = AlerterProcess(bb_config, rules)
    try:
        wait_for(lambda: len(hook.received) >= 1, 20, "the outbox to be delivered")
        publish(deaths(cluster, 1, first=1))
        wait_for(lambda: len(hook.received) >= 2, 20, "the next death")
        time.sleep(1.5)  # nothing more comes
        assert len(hook.received) == 2 and len(set(ids(hook))) == 2
        assert [p["cause"] for p in hook.payloads()] == ["crashed", "crashed"]
    finally:
        assert alerter.terminate() == 0


def test_a_sigkill_after_the_target_answered_resends_with_the_same_key(bb_config, hook):
    rules = [{"name": "deaths", "when": "worker-died", "webhook": hook.url}]
    cluster = Cluster()
    alerter = AlerterProcess(bb_config, rules, debug_pause_at="after-delivery")
    try:
        publish(deaths(cluster, 1))
        alerter.wait_paused("after-delivery")  # the webhook has it; not yet recorded
        assert len(hook.received) == 1
    finally:
        alerter.kill()
    alerter = AlerterProcess(bb_config, rules)
    try:
        wait_for(lambda: len(hook.received) >= 2, 20, "the resend")
        first, again = hook.received
        assert again["key"] == first["key"] and again["payload"]["id"] == first["payload"]["id"]
        time.sleep(1.5)
        assert len(hook.received) == 2  # recorded now: never a third time
    finally:
        assert alerter.terminate() == 0


def test_a_sigkill_mid_stream_loses_and_repeats_nothing(bb_config, hook):
    rules = [{"name": "deaths", "when": "worker-died", "webhook": hook.url}]
    cluster = Cluster()
    alerter = AlerterProcess(bb_config, rules)
    try:
        publish(deaths(cluster, 12))
        wait_for(lambda: len(hook.received) >= 4, 30, "some deliveries")
    finally:
        alerter.kill()  # mid-stream: some delivered, some in the outbox, some unread
    checkpoint = orjson.loads(alerter.checkpoint.read_bytes())
    recorded = set(checkpoint["settled"])  # what the killed alerter had recorded as delivered
    publish(deaths(cluster, 8, first=12))
    alerter = AlerterProcess(bb_config, rules)
    try:
        wait_for(lambda: len(set(ids(hook))) >= 20, 40, "every death")
        time.sleep(1.5)
        got = ids(hook)
        assert len(set(got)) == 20
        # what was recorded as delivered was never sent again; a repeat can only be an
        # incident the SIGKILL caught between the target's answer and its record, and
        # it came with the same idempotency key
        repeated = {i for i in got if got.count(i) > 1}
        assert recorded and not repeated & recorded
        assert all(got.count(i) == 1 for i in recorded)
        assert len({r["key"] for r in hook.received}) == 20
    finally:
        assert alerter.terminate() == 0


def test_a_webhook_that_fails_or_hangs_gets_a_line_and_the_alerter_goes_on(bb_config, hook, tmp_path):
    failing, hanging = Webhook(status=500), Webhook()
    hanging.hang.set()
    out = tmp_path / "command.jsonl"
    rules = [{"name": "failing", "when": "worker-died", "webhook": failing.url},
             {"name": "hanging", "when": "worker-died", "webhook": hanging.url},
             {"name": "good", "when": "worker-died", "webhook": hook.url},
             {"name": "cmd", "when": "worker-died", "command": [
                 sys.executable, "-c", f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + '\\n')"]}]
    cluster = Cluster()
    alerter = AlerterProcess(bb_config, rules, timeout="500ms", attempts="2", retry_backoff_max="200ms")
    try:
        publish(deaths(cluster, 1))
        wait_for(lambda: hook.received, 15, "the good webhook")  # not held up by the others
        wait_for(lambda: "gave up on incident" in alerter.stderr() and alerter.stderr().count("gave up") >= 2,
                 20, "the alerter to give up on the failing and the hanging webhook")
        log = alerter.stderr()
        assert "rule failing: gave up on incident" in log and "HTTP 500" in log
        assert "rule hanging: gave up on incident" in log and "no answer within 0.5s" in log
        assert len(failing.received) == 2 and len(hanging.received) == 2  # 2 attempts each
        publish(deaths(cluster, 1, first=1, exitcode=3))
        wait_for(lambda: len(hook.received) >= 2, 15, "the next death, after the failures")
        assert hook.payloads()[1]["cause"] == "exited"
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 2, 15, "the command")
        assert [orjson.loads(line)["rule"] for line in out.read_text().splitlines()] == ["cmd", "cmd"]
        assert alerter.proc.poll() is None
    finally:
        assert alerter.terminate() == 0
        failing.close()
        hanging.close()


def test_bad_messages_on_the_raw_topic_do_not_stop_it(bb_config, hook):
    rules = [{"name": "deaths", "when": "worker-died", "webhook": hook.url}]
    cluster = Cluster()
    alerter = AlerterProcess(bb_config, rules)
    try:
        produce([(b"x", b"not json"), (b"x", orjson.dumps({"schema": 99})),
                 (cluster.id.encode(), orjson.dumps(cluster.envelope([
                     {"kind": "lifecycle", "ts": "later", "action": "worker_removed"},
                     {"kind": "transition_run", "ts": 1.0, "key": 5}])))])
        publish(deaths(cluster, 1))
        wait_for(lambda: hook.received, 15, "the death after the bad messages")
    finally:
        assert alerter.terminate() == 0
    with pytest.raises(subprocess.CalledProcessError) as e:
        subprocess.run([sys.executable, "-m", "dask_blackbox.cli", "alerts", "--check"],
                       env={**subprocess_env(bb_config), "DASK_BLACKBOX__ALERTS__RULES":
                            repr([{"name": "x", "when": "worker-died", "causes": ["oom"],
                                   "webhook": hook.url}])},
                       capture_output=True, text=True, check=True, timeout=60)
    assert e.value.stderr.startswith("dask-blackbox: error: blackbox.alerts.rules[0] (x).causes")
    assert len(e.value.stderr.strip().splitlines()) == 1
