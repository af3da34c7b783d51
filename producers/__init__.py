"""dask-blackbox producers: what runs inside Dask and publishes to Kafka.

Attach them with ``dask scheduler --preload dask_blackbox.producers.scheduler`` and
``dask worker --preload dask_blackbox.producers.worker --preload-nanny
dask_blackbox.producers.nanny`` (each process's ``blackbox.*`` config), with
``client.register_plugin(BlackboxSchedulerPlugin(...))`` (and the worker's and the
nanny's), or with :func:`attach` (one call, everything, the client's config).

The route of a record: a hook offers an *item* to its process's buffer
(:mod:`.buffer`); a sender thread of the Dask process takes the items, writes each run of
transitions as a *capture* and makes the *row* of every other item (:mod:`.rows`), packs
them into envelopes and delivers them (:mod:`.sender`); :mod:`.transport` composes the
buffer and its sender.

This package imports only distributed, aiokafka, orjson, msgspec (cramjam for
compression) and ``dask_blackbox``'s contract, config and runfiles modules
(``tests/integration/test_packaging.py`` runs it in a venv holding just those). The names below
are imported when first used: importing one module imports neither Dask's scheduler
nor its worker.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {  # each public name's module
    "PLUGIN_NAME": "scheduler", "BlackboxSchedulerPlugin": "scheduler",
    "BlackboxWorkerPlugin": "worker", "BlackboxNannyPlugin": "nanny",
    "ProducerSettings": "settings", "attach": "attaching", "detach": "attaching",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
