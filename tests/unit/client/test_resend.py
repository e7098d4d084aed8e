"""After a lost link a real connector resends what was not acknowledged, in one process
(meshbus.testing.connect_over): each reliable message reaches its receiver exactly once,
those lost on the way and those whose acknowledgement was lost alike; a request in
flight through the lost broker fails (docs/guarantees.md, docs/mesh.md §7).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from meshbus.errors import ConnectionLost
from meshbus.testing import FakeNetwork, address_of, build_mesh
from tests.unit.client.conftest import Connect


async def turns_until(done: Callable[[], bool], what: str, limit: int = 100) -> None:
    """Run loop turns, one at a time, until ``done()`` -- no further: the test acts on the
    state of that very turn."""
    for _ in range(limit):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not {what} after {limit} loop turns")


async def test_reliable_sends_are_delivered_once_after_the_sender_s_link_is_lost(
    network: FakeNetwork, connect: Connect
) -> None:
    await build_mesh(network, 3)
    sender_conn = await connect(address_of("a"), "sender")
    sender = await sender_conn.register()
    receiver = await (await connect(address_of("b"), "receiver")).register()
    got: list[bytes] = []
    receiver.add_listener(lambda message: got.append(message.payload))

    for n in range(5):
        await sender.send(receiver.address, b"early %d" % n, reliable=True)
    await turns_until(lambda: len(got) == 5, "delivered")
    assert sender_conn.unacked == 5, "the acknowledgements are still on their way"
    network.wire_between("sender", address_of("a")).cut()  # ... and lost
    for n in range(5):  # written to the cut link: lost too
        await sender.send(receiver.address, b"late %d" % n, reliable=True)
    assert sender_conn.unacked == 10
    await network.settle()

    assert sender_conn.failovers == 1
    assert sender_conn.unacked == 0
    assert got == [b"early %d" % n for n in range(5)] + [b"late %d" % n for n in range(5)]
    assert sender_conn.refused_acks == 0


async def test_a_reliable_send_made_while_failing_over_waits_and_arrives_once(
    network: FakeNetwork, connect: Connect
) -> None:
    await build_mesh(network, 3)
    sender_conn = await connect(address_of("a"), "sender")
    sender = await sender_conn.register()
    receiver = await (await connect(address_of("b"), "receiver")).register()

    network.crash(address_of("a"))
    await asyncio.sleep(0)  # the link is lost: the connector fails over
    assert sender_conn.broker_address == ""
    await sender.send_reliable(receiver.address, b"meanwhile")  # returns once acknowledged

    assert sender_conn.failovers == 1
    assert (await receiver.recv()).payload == b"meanwhile"
    assert receiver.queued == 0


async def test_a_request_in_flight_through_a_crashed_broker_fails(
    network: FakeNetwork, connect: Connect
) -> None:
    await build_mesh(network, 3)
    asker_conn = await connect(address_of("a"), "asker")
    asker = await asker_conn.register()
    responder = await (await connect(address_of("b"), "responder")).register()

    request = asyncio.ensure_future(asker.request(responder.address, b"?", timeout=5.0))
    await network.settle()
    assert (await responder.recv()).is_request  # it never answers
    network.crash(address_of("a"))
    await network.settle()

    with pytest.raises(ConnectionLost, match="lost the link to broker a"):
        await request
    assert asker_conn.failovers == 1
