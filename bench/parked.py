"""A scheduler plugin of each kind for the in-process benches of the hot path.

:class:`NoopPlugin` is side A: a ``transition`` hook that does nothing, so that
both sides pay Dask's cost of calling a plugin. :func:`parked_blackbox` is side
B: the dask-blackbox scheduler plugin started on a real ``Scheduler`` with a
helper-process sender whose relay thread never hands anything over (it waits an
hour, and sends nothing without a cluster id), with room for everything a bench
buffers. :func:`handed_over` does the relay thread's hand-over in the calling
thread, where a bench can count its cost.
"""

from __future__ import annotations

from collections.abc import Iterator

from distributed import Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_blackbox.producers.relay import FRAME_ITEMS
from dask_blackbox.producers.scheduler import BlackboxSchedulerPlugin
from dask_blackbox.producers.settings import ProducerSettings


class NoopPlugin(SchedulerPlugin):
    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs):
        pass


async def parked_blackbox(scheduler: Scheduler) -> BlackboxSchedulerPlugin:
    """The dask-blackbox plugin, started on ``scheduler``, its sender parked. Give
    ``transport.cluster_id`` back (``scheduler.id``) before closing it, so that its
    close delivers as usual."""
    settings = ProducerSettings.resolve({
        "producer.buffer-max-events": 10_000_000, "producer.buffer-max-bytes": "4GiB",
        "producer.flush-interval": "1h", "producer.metrics-interval": "1h",
        "producer.sender": "process",  # its relay thread waits an hour: parked
    })
    blackbox = BlackboxSchedulerPlugin(settings)
    await blackbox.start(scheduler)
    blackbox.transport.cluster_id = None  # it sends nothing without one
    return blackbox


def handed_over(transport) -> Iterator[bytes]:
    """What the relay thread hands to its helper for everything buffered: the
    frames' bytes, without the pipe (``_take_rows`` and ``_encoded``, as
    :mod:`producers.relay` does). The items stay counted held: nothing delivers
    them."""
    while transport._buffer:
        rows, _, _ = transport._take_rows(FRAME_ITEMS)
        yield transport._encoded((None, None, *rows))
