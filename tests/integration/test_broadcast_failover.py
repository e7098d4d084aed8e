"""A connector that failed over is still reached by broadcasts.

One service of each connector is the member of the broadcast group for all of its
services; after a failover that membership comes back with the service's other
groups, on the new broker.
"""

from __future__ import annotations

import asyncio

import meshbus
from meshbus.address import BROADCAST_GROUP
from tests.conftest import start_mesh, stop_all
from tests.integration.helpers import IO_TIMEOUT, wait_members, wait_until


async def test_broadcasts_reach_a_connector_after_it_failed_over() -> None:
    a, b = await start_mesh(2)
    moving = await meshbus.connect(a.address, server="moving")
    staying = await meshbus.connect(b.address, server="staying", failover=False)
    try:
        svc = await moving.register()
        await svc.join("multicast:other")
        sender = await staying.register()
        await wait_members([a, b], BROADCAST_GROUP, 2)
        a.process.kill()  # kill -9

        async def failed_over() -> bool:
            return moving.failovers == 1

        await wait_until(failed_over, "the connector to fail over", IO_TIMEOUT)
        await wait_members([b], BROADCAST_GROUP, 2)
        await sender.broadcast(b"still there?")
        assert (await svc.recv(timeout=IO_TIMEOUT)).payload == b"still there?"
        assert svc.groups == frozenset({meshbus.Multicast("other")})
    finally:
        await asyncio.gather(moving.close(), staying.close())
        await stop_all([a, b])
