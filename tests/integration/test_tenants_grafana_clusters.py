"""Real clusters with hostile names, recorded through the sink: every panel of "a run",
its variables expanded as Grafana expands them, shows each cluster its own run and
nothing else (tests/unit/test_tenants_grafana.py plants the same names in chDB)."""

from __future__ import annotations

import time

from dask_blackbox.testing.polling import wait_for
from grafana_support import CLAUSE, expand, hostile_names, macros, run_panels, ssrf_target  # noqa: F401


def _inc(x):
    return x + 1


def test_real_clusters_with_hostile_names_see_their_own_run(bb_config, ssrf_target):
    from distributed import Client, LocalCluster

    from dask_blackbox import producers
    from dask_blackbox.read import backends
    from sink_support import SinkProcess

    port, hits = ssrf_target
    names = ["team-a", *hostile_names(port)]
    sink = SinkProcess(bb_config)
    try:
        sink.wait_ready()
        ids = {}
        for name in names:
            with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                              dashboard_address=":0") as cluster, Client(cluster) as client:
                ids[name] = producers.attach(client, cluster_name=name, **{
                    "producer.flush-interval": "20ms"})["cluster_id"]
                assert sum(client.gather(client.map(_inc, range(4)))) == 10
        backend = backends.running_sink()
        wait_for(lambda: backend.query("SELECT count() FROM blackbox.clusters")[1][0][0] == len(names)
                 and backend.query("SELECT count() FROM blackbox.worker_metrics")[1][0][0] > 0,
                 60, "every cluster loaded")
        _, rows = backend.query("SELECT cluster_id, cluster_name FROM blackbox.clusters")
        assert {cid: name for cid, name in rows} == {cid: name for name, cid in ids.items()}
        now = time.time()
        shown = 0
        for name, cid in ids.items():
            for title, sql in run_panels():
                expanded = expand(sql, now - 3600, now + 60, 1, {"cluster": name})
                expected = macros(sql.replace(CLAUSE, f"cluster_id = '{cid}'"), now - 3600, now + 60, 1)
                got = sorted(map(tuple, backend.query(expanded)[1]), key=repr)
                assert got == sorted(map(tuple, backend.query(expected)[1]), key=repr), (title, name)
                shown += len(got)
        assert shown and hits == [], hits
    finally:
        sink.terminate()
