"""Reading a live Dask cluster in tests.

``Client.scheduler_info()`` fetches every worker, then returns the client's cached
identity; the client's own periodic refresh (which asks for no workers) can land
between the two, and the workers read back empty. ``live_workers`` asks the
scheduler directly.
"""

from __future__ import annotations

from distributed import Client


def live_workers(client: Client) -> dict:
    """The scheduler's workers now: address -> its identity."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
