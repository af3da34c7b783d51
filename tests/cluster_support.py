"""Reading a live Dask cluster in tests, and planting a failure once.

``Client.scheduler_info()`` fetches every worker, then returns the client's cached
identity; the client's own periodic refresh (which asks for no workers) can land
between the two, and the workers read back empty. ``live_workers`` asks the
scheduler directly.

``first_time`` lets a task fail only the first time it runs (on whichever worker
process): a flag file per name in the directory ``BLACKBOX_TEST_FLAGS`` names.
"""

from __future__ import annotations

import os
import pathlib

from distributed import Client


def first_time(name: str) -> bool:
    """True the first time a task of this name runs (a flag file per name)."""
    flag = pathlib.Path(os.environ["BLACKBOX_TEST_FLAGS"]) / name
    if flag.exists():
        return False
    flag.write_text("")
    return True


def live_workers(client: Client) -> dict:
    """The scheduler's workers now: address -> its identity."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
