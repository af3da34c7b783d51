"""Nothing a producer (or anyone with write access to the topics) publishes can stop
the sink: each message below crashed it before; now each is loaded (a
graph without task rows) or dead-lettered with a reason naming the message, event and
field, and the sink goes on loading what comes after.

Real broker, the real sink subprocess, real chDB.
"""

from __future__ import annotations

import time

import orjson

from dask_blackbox import config, contract

from sink_support import SinkProcess, count, envelope, produce, transition, wait_consumed

NOW = time.time()


def deep_envelope(depth: int, seq: int) -> bytes:
    """An envelope whose one structured event's ``msg`` nests ``depth`` lists deep."""
    head = orjson.dumps(envelope([{"kind": contract.EVENT, "ts": NOW, "topic": "deep", "msg": 0}],
                                 producer_id="deep", seq=seq))
    return head.replace(b'"msg":0', b'"msg":' + b"[" * depth + b"]" * depth)


def test_poison_messages_are_dead_letters_and_the_sink_keeps_loading(bb_config):
    # Producers send a graph with no tasks when graph-max-tasks is 0, or when the first
    # task alone is too big: it loads (a graphs row, no graph_tasks rows).
    empty_graph = {"kind": contract.GRAPH, "ts": NOW - 5, "client": "Client-1",
                   "stimulus_id": "update-graph-empty", "n_tasks": 1000, "keys": ["k"],
                   "tasks": [], "annotations": {}}
    poison = [
        (b"c1", orjson.dumps(envelope([empty_graph], producer_id="graph", seq=0))),
        # An event kind that is not a string (unhashable: it broke the kind dispatch).
        (b"c1", orjson.dumps(envelope([transition("ok-before", "waiting", "processing", NOW - 4),
                                       {"kind": ["transition"], "ts": NOW - 4},
                                       {"kind": {"k": 1}, "ts": NOW - 4}],
                                      producer_id="kinds", seq=0))),
        # Deeper than orjson writes (255), than it reads (1024), and deep enough for a
        # RecursionError in msgspec's decoding.
        (b"c1", deep_envelope(300, 0)),
        (b"c1", deep_envelope(2_000, 1)),
        (b"c1", deep_envelope(200_000, 2)),
    ]
    # Derived topics too: a span snapshot nested too deep, and one whose new fields
    # have the wrong shape.
    deep_state = b'{"cluster_id": "c1", "span_id": "s", "version": 1, "enqueued": 1.0, "name": ' \
        + b"[" * 5_000 + b"]" * 5_000 + b"}"
    bad_intervals = orjson.dumps({"cluster_id": "c1", "span_id": "s2", "version": 1,
                                  "enqueued": NOW - 9, "nthreads_intervals": [[NOW - 9, NOW - 8]]})
    produce(poison)
    produce([(b"c1", deep_state), (b"c1", bad_intervals)], contract.SPAN_STATE)
    sink = SinkProcess(bb_config)
    try:
        sink.wait_ready()
        wait_consumed(sink)
        # A good envelope published afterwards loads.
        produce([(b"c1", orjson.dumps(envelope(
            [transition("after-poison", "waiting", "processing", NOW - 1)],
            producer_id="good", seq=0)))])
        wait_consumed(sink)
        assert sink.proc.poll() is None, sink.stderr()
        backend = sink.backend()
        _, keys = backend.query("SELECT key FROM blackbox.transitions ORDER BY key")
        assert keys == [("after-poison",), ("ok-before",)]
        _, graphs = backend.query("SELECT stimulus_id, n_tasks FROM blackbox.graphs")
        assert graphs == [("update-graph-empty", 1000)]
        assert count(backend, "graph_tasks") == 0
        _, letters = backend.query(
            "SELECT topic, offset, reason, payload FROM blackbox.dead_letters ORDER BY topic, offset, reason")
        raw, state = config.topic(contract.RAW), config.topic(contract.SPAN_STATE)
        reasons = [(t, o, r) for t, o, r, _ in letters]
        assert reasons == [
            (raw, 1, "event 1: kind: expected a string, got list"),
            (raw, 1, "event 2: kind: expected a string, got dict"),
            (raw, 2, "nested 303 deep; the sink decodes at most 100 levels of arrays and objects"),
            (raw, 3, "nested 2003 deep; the sink decodes at most 100 levels of arrays and objects"),
            (raw, 4, "nested 200003 deep; the sink decodes at most 100 levels of arrays and objects"),
            (state, 0, "nested 5001 deep; the sink decodes at most 100 levels of arrays and objects"),
            (state, 1, "span-state: nthreads_intervals: each entry must be a list [begin, end, "
                       f"nthreads], got {[NOW - 9, NOW - 8]!r}"),
        ]
        payloads = {(t, o, r): p for t, o, r, p in letters}
        assert orjson.loads(payloads[reasons[0]]) == {"kind": ["transition"], "ts": NOW - 4}
        # The payload of a message too deep to decode is its raw text, cut to the cap.
        assert payloads[reasons[4]].startswith('{"schema":%d' % contract.SCHEMA_VERSION)
        assert len(payloads[reasons[4]]) == contract.DEAD_LETTER_PAYLOAD_MAX
        assert sink.terminate() == 0
    finally:
        sink.kill()
