"""A worker's page's transfers: the bytes it fetched from and sent to each peer
(from the recorded graph, :meth:`.page.Context.moved`), the seconds and transfers it
spent fetching from each, and its digests of sending and gathering data."""

from __future__ import annotations

from dask_blackbox.read import aggregates
from dask_blackbox.read.views.page import Context
from dask_blackbox.read.views.registry import View, register


def data(ctx: Context) -> dict:
    moved = ctx.moved()
    peers: dict[str, dict] = {}
    for (sender, receiver), n in (moved or {}).items():
        if receiver == ctx.worker:
            peers.setdefault(sender, {"in": 0, "out": 0, "seconds_in": 0.0, "transfers_in": 0})["in"] += n
        elif sender == ctx.worker:
            peers.setdefault(receiver, {"in": 0, "out": 0, "seconds_in": 0.0, "transfers_in": 0})["out"] += n
    for sender, receiver, seconds, count in aggregates.transfers(ctx.backend, ctx.scope):
        if receiver == ctx.worker and sender:
            p = peers.setdefault(sender, {"in": 0, "out": 0, "seconds_in": 0.0, "transfers_in": 0})
            p["seconds_in"] += seconds
            p["transfers_in"] += count
    sent = [r for r in aggregates.digests(ctx.backend, ctx.scope.cluster_id, ctx.worker)
            if r[0] in ("get-data", "gather-dep")]
    return {"transfers": {"peers": dict(sorted(peers.items())), "graph": moved is not None,
                          "bytes_deferred": not ctx.count_bytes(),
                          "digests": [dict(zip(("context", "prefix", "activity", "unit", "value"), r))
                                      for r in sorted(sent)]}}


VIEW = register(View("worker_transfers", "Transfers", data, "panel_worker_transfers.html",
                     page="worker", order=40))
