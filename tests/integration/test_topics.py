"""The topics of the contract exist on a real broker, each under the configured
prefix, and creating them again is no error."""

from __future__ import annotations

import pytest

from dask_blackbox import config


@pytest.mark.both_brokers
def test_topics_are_created_on_the_real_broker(bb_config):
    import asyncio

    from dask_blackbox import kafka
    from dask_blackbox.contract import TOPICS

    async def listed():
        admin = await kafka.connect_admin()
        try:
            return set(await admin.list_topics())
        finally:
            await admin.close()

    names = asyncio.run(kafka.ensure_topics())  # second call: already there, no error
    assert set(names) <= asyncio.run(listed())
    assert names == [config.topic(t) for t in TOPICS]
