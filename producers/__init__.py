"""dask-blackbox producers: what runs inside Dask and publishes to Kafka.

Attach them with ``dask scheduler --preload dask_blackbox.producers.scheduler`` and
``dask worker --preload dask_blackbox.producers.worker --preload-nanny
dask_blackbox.producers.nanny`` (each process's ``blackbox.*`` config), with
``client.register_plugin(BlackboxSchedulerPlugin(...))`` (and the worker's and the
nanny's), or with :func:`attach` (one call, everything, the client's config).

The route of a record: a hook offers an *item* to its process's buffer
(:mod:`.buffer`); the drain makes its *row* (:mod:`.rows`) and a sender packs rows into
envelopes and delivers them (:mod:`.sender`), in a thread of the Dask process or in a
helper process (:mod:`.relay`); :mod:`.transport` composes the buffer and its drain.

This package imports only distributed, aiokafka, orjson, msgspec (cramjam for
compression) and ``dask_blackbox``'s contract, config and runfiles modules
(``tests/test_packaging.py`` runs it in a venv holding just those). The names below
are imported when first used, so that the relay's helper process, which imports
:mod:`.relay`, does not import Dask's scheduler and worker.
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
