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

#: Seconds without a heartbeat before the scheduler restarts a worker, set only while
#: a planted task holds its worker's GIL: far above what a worker on a loaded machine
#: takes to heartbeat (Dask's own floor is 5 s for a few workers, and a retry that
#: lands on a worker timed out with the plant's dies twice: a KilledWorker), well
#: below how long a plant holds the GIL.
GIL_TTL = 20


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
