"""Failover of a real connector, in one process: in-process brokers on the fake network,
fake time, the connector's random choices seeded (meshbus.testing.connect_over).

When its broker crashes, its link is cut or its broker goes silent, the connector links
to another broker (or to the same one, back on its address), registers every service
there with the same address and joins the same groups (docs/mesh.md §7).
"""

from __future__ import annotations

import pytest

from meshbus.address import Anycast, Multicast
from meshbus.broker.server import Broker
from meshbus.client.connector import Connector
from meshbus.client.service import Service
from meshbus.errors import ConnectionLost
from meshbus.testing import (
    FakeNetwork,
    address_of,
    build_mesh,
    routes_everywhere,
    start_broker,
    tick,
)
from tests.unit.client.conftest import Connect, received, served_by

NEWS = Multicast("news")
POOL = Anycast("pool")
INTERVAL = 0.5  # the brokers' heartbeat and the connector's keepalive


def where(brokers: list[Broker], service: Service) -> dict[str, str | None]:
    return routes_everywhere(brokers, service.address.to_bytes())


async def member_with_services(connect: Connect) -> tuple[Connector, Service, Service]:
    """A connector on broker a with a fixed and a dynamic service: both in "news", the
    fixed one also in the anycast group "pool"."""
    member = await connect(address_of("a"), "member")
    fixed = await member.register(7)
    dynamic = await member.register()
    await fixed.join(NEWS)
    await fixed.join(POOL)
    await dynamic.join(NEWS)
    return member, fixed, dynamic


async def reaches_both(
    network: FakeNetwork, sender: Service, fixed: Service, dynamic: Service
) -> None:
    """Unicast, multicast and anycast from ``sender`` reach the member's services."""
    await sender.send(dynamic.address, b"direct")
    await sender.send(NEWS, b"news")
    await sender.send(POOL, b"pooled")
    await network.settle()
    assert await received(fixed) == [b"news", b"pooled"]
    assert await received(dynamic) == [b"direct", b"news"]


async def test_a_crashed_broker_s_connector_comes_back_through_another_with_its_services_and_groups(
    network: FakeNetwork, connect: Connect
) -> None:
    mesh = await build_mesh(network, 3)
    member, fixed, dynamic = await member_with_services(connect)
    addresses = (fixed.address, dynamic.address)
    sender = await (await connect(address_of("c"), "sender")).register()
    await reaches_both(network, sender, fixed, dynamic)

    network.crash(address_of("a"))
    await network.settle()

    assert member.failovers == 1
    assert member.broker_address in (address_of("b"), address_of("c"))
    assert address_of("a") not in member.brokers
    survivors = mesh[1:]
    new = served_by(survivors, member.broker_name)
    assert where(survivors, fixed) == where(survivors, dynamic) == new
    assert (fixed.address, dynamic.address) == addresses, "the same addresses"
    assert fixed.groups == {NEWS, POOL}
    assert dynamic.groups == {NEWS}
    for broker in survivors:
        assert sorted(broker.routing.members(NEWS.to_bytes())) == sorted(
            a.to_bytes() for a in addresses
        )
        assert broker.routing.members(POOL.to_bytes()) == [fixed.address.to_bytes()]
    await reaches_both(network, sender, fixed, dynamic)


async def test_a_cut_link_is_followed_by_a_failover_and_the_old_broker_routes_to_the_new_one(
    network: FakeNetwork, connect: Connect
) -> None:
    mesh = await build_mesh(network, 3)
    member, fixed, dynamic = await member_with_services(connect)
    sender = await (await connect(address_of("a"), "sender")).register()

    network.wire_between("member", address_of("a")).cut()
    await network.settle()

    assert member.failovers == 1
    new = member.broker_name
    assert new in ("b", "c"), "the broker it lost is tried last"
    # a withdrew the services of the link it lost, and the new broker's ADDs (a takeover
    # by the connector's session) won everywhere, whichever came first.
    assert where(mesh, fixed) == served_by(mesh, member.broker_name)
    await reaches_both(network, sender, fixed, dynamic)


async def test_a_silent_broker_is_left_after_three_keepalive_intervals(
    network: FakeNetwork, connect: Connect
) -> None:
    mesh = await build_mesh(network, 3, heartbeat_interval=INTERVAL)
    _, b, c = mesh
    member = await connect(address_of("a"), "quiet", keepalive=INTERVAL)
    service = await member.register(9)
    sender = await (await connect(address_of("b"), "sender")).register()

    network.pause(address_of("a"))  # SIGSTOP: its links stay open, and say nothing
    for _ in range(3):
        await tick(network, [b, c], INTERVAL)
    assert member.failovers == 0, "silent for 1.5 s: pinged, not given up on yet"
    for _ in range(4):
        await tick(network, [b, c], INTERVAL)
    assert member.failovers == 1
    assert member.broker_name in ("b", "c")
    assert where([b, c], service)[member.broker_name] == "local"
    await sender.send(service.address, b"found")
    await network.settle()
    assert await received(service) == [b"found"]


async def test_a_lone_broker_that_restarts_on_its_address_gets_its_connector_back(
    network: FakeNetwork, connect: Connect
) -> None:
    await start_broker(network, "a")
    member = await connect(address_of("a"), "member")
    service = await member.register(7)
    await service.join(NEWS)

    network.crash(address_of("a"))
    await network.advance(2.0)  # rounds of dials that find nothing, 50 ms to 1 s apart
    assert member.failovers == 0
    assert member.broker_address == ""
    restarted = await start_broker(network, "a")
    await network.advance(1.0)  # the next round finds it

    assert member.failovers == 1
    assert restarted.routing.members(NEWS.to_bytes()) == [service.address.to_bytes()]
    other = await (await connect(address_of("a"), "other")).register()
    await other.send(NEWS, b"back")
    await network.settle()
    assert await received(service) == [b"back"]


async def test_no_broker_within_failover_timeout_loses_the_mesh(
    network: FakeNetwork, connect: Connect
) -> None:
    await start_broker(network, "a")
    member = await connect(address_of("a"), "member", failover_timeout=3.0)
    service = await member.register()

    network.crash(address_of("a"))
    await network.advance(2.9)
    assert service.queued == 0
    await network.advance(0.2)

    with pytest.raises(ConnectionLost, match=r"no broker took this connector within failover"):
        await service.recv()
