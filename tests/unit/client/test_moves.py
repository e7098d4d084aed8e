"""A real connector sent elsewhere by its broker, in one process (meshbus.testing.connect_over):
a MOVE when its broker drains or a new broker joins, and a REDIRECT when the broker it
dials is full or draining (docs/mesh.md §6, §7).

A move is make before break: the connector links to the new broker, registers its
services and joins its groups there, switches its sends over, then says BYE to the
old broker -- it is no failover.
"""

from __future__ import annotations

import asyncio

from meshbus.address import Multicast
from meshbus.testing import FakeNetwork, address_of, build_mesh, routes_everywhere, start_broker
from tests.unit.client.conftest import Connect, received, served_by

NEWS = Multicast("news")


async def test_a_draining_broker_moves_its_connector_with_its_services_and_groups(
    network: FakeNetwork, connect: Connect
) -> None:
    mesh = await build_mesh(network, 3)
    a = mesh[0]
    member = await connect(address_of("a"), "member")
    service = await member.register(7)
    await service.join(NEWS)
    sender = await (await connect(address_of("b"), "sender")).register()

    drained = asyncio.ensure_future(a.mesh.drain(5.0))
    await network.settle()

    assert drained.done(), "every connector left: the drain did not wait for its grace"
    assert (member.moves, member.failovers) == (1, 0)
    new = member.broker_name
    assert new in ("b", "c")
    assert not a.links.connectors
    assert routes_everywhere(mesh, service.address.to_bytes()) == served_by(mesh, new)
    await sender.send(service.address, b"direct")
    await sender.send(NEWS, b"news")
    await network.settle()
    assert await received(service) == [b"direct", b"news"]


async def test_a_joining_broker_takes_the_newest_connector_of_a_full_one(
    network: FakeNetwork, connect: Connect
) -> None:
    a = await start_broker(network, "a")
    first = await connect(address_of("a"), "first")
    second = await connect(address_of("a"), "second")
    one = await first.register()
    two = await second.register()

    b = await start_broker(network, "b", seeds=[address_of("a")])
    await network.settle()

    assert (first.broker_name, first.moves) == ("a", 0)
    assert (second.broker_name, second.moves) == ("b", 1)
    assert len(a.links.connectors) == len(b.links.connectors) == 1
    await one.send(two.address, b"across")
    await two.send(one.address, b"back")
    await network.settle()
    assert await received(two) == [b"across"]
    assert await received(one) == [b"back"]


async def test_a_full_broker_redirects_a_connector_to_one_with_room(
    network: FakeNetwork, connect: Connect
) -> None:
    await build_mesh(network, 2, max_connectors=1)
    first = await connect(address_of("a"), "first")
    second = await connect(address_of("a"), "second")  # a is the only address it knows

    assert first.broker_name == "a"
    assert second.broker_name == "b"
    assert second.failovers == second.moves == 0


async def test_a_draining_broker_redirects_a_new_connector(
    network: FakeNetwork, connect: Connect
) -> None:
    a, _ = await build_mesh(network, 2)
    draining = asyncio.ensure_future(a.mesh.drain(5.0))
    await network.settle()

    late = await connect(address_of("a"), "late")

    assert late.broker_name == "b"
    assert draining.done()
