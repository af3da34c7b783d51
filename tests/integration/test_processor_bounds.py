"""A processor holds a bounded number of clusters and task keys, whatever arrives.

One real faust worker with ``max-live-clusters=3`` and ``max-live-keys-total=4``
reads five clusters' envelopes (two each, two new task keys per envelope of the
first three clusters): the first three clusters are held, the other two are refused
-- one dead letter each, naming the setting -- and every envelope of theirs is
counted; of the held clusters' task keys the first four are tracked and the rest
counted as refused. The held clusters' spans are published, the refused ones' are
not.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import dask
import pytest

from dask_blackbox import contract, kafka
from dask_blackbox.testing.kafka_reader import read_json
from dask_blackbox.testing.polling import wait_for
from dask_blackbox.testing.processors import FaustWorker, env_for, processor_settings
from dask_blackbox.testing import replay

T0 = time.time() - 600


def envelopes_of(c: int) -> list[dict]:
    cid = f"bounded-{c}"
    out = []
    for seq in range(2):
        t = T0 + c + seq
        events = [{"kind": contract.SPAN, "ts": t, "span_id": f"span-{c}", "name": ["work"],
                   "parent_id": None, "enqueued": t}] if seq == 0 else []
        for j in range(2):
            events.append({"kind": contract.TRANSITION, "ts": t + 0.1 * j, "key": f"k-{seq}-{j}",
                           "prefix": "k", "group": f"k-{seq}-{j}", "span_id": f"span-{c}",
                           "start": "released", "finish": "waiting", "stimulus_id": "s",
                           "worker": None, "nbytes": None, "typename": None, "startstops": None,
                           "exception": None, "traceback": None, "cause": None})
        out.append({"schema": contract.SCHEMA_VERSION, "cluster_id": cid, "cluster_name": cid,
                    "source": "scheduler", "producer_id": f"p-{c}", "seq": seq, "sent_at": t,
                    "events": events})
    return out


@pytest.fixture
def bounded(broker, tmp_path):
    settings = processor_settings(broker, "b" + uuid.uuid4().hex[:10], 1,
                                  snapshot_interval="200ms", max_live_clusters=3,
                                  max_live_keys_total=4)
    with dask.config.set(settings):
        asyncio.run(kafka.ensure_topics())
        worker = FaustWorker(env_for(settings), tmp_path, "bounded").start()
        try:
            wait_for(worker.stats, 60, "the processor up")
            yield worker
        finally:
            worker.stop()


def test_clusters_and_keys_past_the_bounds_are_refused_and_counted(bounded):
    per_cluster = [envelopes_of(c) for c in range(5)]
    # every cluster's first envelope, then every second: all five are new at once
    messages = [replay.encode(per_cluster[c][i]) for i in range(2) for c in range(5)]
    asyncio.run(replay.publish_raw(messages))
    stats = wait_for(lambda: (s := bounded.stats()) and s["envelopes"] + s["refused_envelopes"] == 10
                     and s, 60, "every envelope read")
    assert stats["clusters"] == 3 and stats["refused_clusters"] == 2, stats
    assert stats["refused_envelopes"] == 4 and stats["envelopes"] == 6, stats
    assert stats["live_keys"] == 4 and stats["refused_keys"] == 8, stats
    dead = wait_for(lambda: read_json(contract.DEAD_LETTER, idle=0.5), 30, "dead letters")
    assert sorted(d["key"] for d in dead) == ["bounded-3", "bounded-4"], dead
    assert all("max-live-clusters=3" in d["reason"] and d["payload"] for d in dead), dead
    spans = wait_for(lambda: read_json(contract.SPAN_STATE, idle=0.5), 30, "span snapshots")
    assert {s["cluster_id"] for s in spans} == {"bounded-0", "bounded-1", "bounded-2"}
