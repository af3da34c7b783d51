"""Every server ``dask-blackbox up`` starts listens on loopback: the broker, the
faust workers' web servers (/metrics, /blackbox/stats/, /router/, /table/: faust
binds ``web_bind``, and ``--web-host`` is only the name it advertises), the sink's
query server and /metrics, the exporter's /metrics. Read from the kernel's table of
listening sockets of every process of a real ``up`` (psutil), not from settings."""

from __future__ import annotations

import ipaddress

import psutil

from up_process import Up


def _listening(root: psutil.Process) -> dict[tuple[str, int], str]:
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline()[1:5])
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = name
        except psutil.NoSuchProcess:
            pass
    return out


def test_every_server_up_starts_listens_on_loopback(tmp_path):
    up = Up(tmp_path / "data", "--processors", "2", "--set", "sink.metrics-port=0")
    try:
        up.wait_for("healthy in")
        listening = _listening(psutil.Process(up.proc.pid))
        faust = [a for a, name in listening.items() if "faust" in name]
        assert len(faust) >= 2, listening  # both workers' web servers
        public = {a: n for a, n in listening.items() if not ipaddress.ip_address(a[0]).is_loopback}
        assert public == {}, public
    finally:
        up.terminate()
