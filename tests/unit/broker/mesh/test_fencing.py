"""Fencing on the fake clock: a broker whose loop stalled past the heartbeat budget was
taken for dead by its peers, who may have moved its groups on meanwhile. When it wakes
it hands out nothing that waited out the stall, and binds no message group until it
has linked up with the mesh again.

A stall is this: no timer of b runs while the clock moves (the test runs none), and what
a sent meanwhile waits in a held wire -- the kernel's buffers of a stopped process. On
release b reads it before any timer could run, as a real broker does on SIGCONT."""

from __future__ import annotations

import pytest

from meshbus.address import Anycast
from meshbus.broker.server import Broker
from meshbus.protocol.control import Error, GroupBind, GroupBound
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClock,
    FakeNetwork,
    address_of,
    build_mesh,
    connector,
    routes_everywhere,
    tick,
)

INTERVAL = 0.5
MISSES = 3
BUDGET = INTERVAL * MISSES
POOL = Anycast("pool").to_bytes()


@pytest.fixture
async def pair(network: FakeNetwork) -> list[Broker]:
    return await build_mesh(network, 2, heartbeat_interval=INTERVAL, heartbeat_misses=MISSES)


async def stall_b(network: FakeNetwork, clock: FakeClock, a: Broker) -> None:
    """b stops for longer than the budget; a, running, declares it dead; b wakes."""
    wire = network.wire_between(address_of("a"), address_of("b"))
    wire.hold()
    clock.advance(BUDGET + INTERVAL)
    a.housekeeping()  # a's heartbeat waits in the wire; then a finds b silent, and closes
    await network.settle()
    assert a.peers.names() == []
    wire.release()
    await network.settle()


async def test_frames_that_waited_out_the_budget_are_not_delivered(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    a, b = pair
    on_b = await connector(network, b, "on-b")
    service = await on_b.register("svc", 1)
    on_a = await connector(network, a, "on-a")
    sender = await on_a.register("sender")
    await network.settle()
    network.wire_between(address_of("a"), address_of("b")).hold()
    on_a.send_data(service, sender, b"sent before b stopped", msg_id=1)
    await network.settle()
    network.wire_between(address_of("a"), address_of("b")).release()
    await network.settle()
    assert [f.payload for f in on_b.take_data()] == [b"sent before b stopped"]

    network.wire_between(address_of("a"), address_of("b")).hold()
    on_a.send_data(service, sender, b"waited out the stall", msg_id=2)
    await network.settle()
    await stall_b(network, clock, a)
    assert on_b.take_data() == [], "a frame that waited out the budget was handed out"
    assert b.links.closed["stalled"] == 1
    assert b.mesh.fence.stalls == 1
    assert b.peers.names() == []
    # Linked again (b dials a, which it lost without a goodbye), traffic flows as before.
    for _ in range(6):
        await tick(network, pair, INTERVAL)
    assert (a.peers.names(), b.peers.names()) == (["b"], ["a"])
    on_a.send_data(service, sender, b"after", msg_id=3)
    await network.settle()
    assert [f.payload for f in on_b.take_data()] == [b"after"]


async def test_a_broker_that_stalled_binds_no_group_until_it_is_linked_again(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    a, b = pair
    on_b = await connector(network, b, "on-b")
    member = await on_b.register("worker")
    await on_b.join(member, POOL)
    await network.settle()
    await stall_b(network, clock, a)
    assert b.mesh.fence.fenced()
    refused = await on_b.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=b"g"))
    assert isinstance(refused.body, Error)
    assert refused.body.code == ErrorCode.TRY_AGAIN
    assert "re-linking after a stall" in refused.body.message
    for _ in range(6):
        await tick(network, pair, INTERVAL)
    assert b.peers.names() == ["a"]
    assert not b.mesh.fence.fenced()
    bound = await on_b.ask(ControlType.GROUP_BIND, GroupBind(group=POOL, key=b"g"))
    assert isinstance(bound.body, GroupBound)
    assert bound.body.member == member


async def test_the_fence_lifts_after_two_budgets_when_no_peer_comes_back(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    """A broker left alone (its peers gone for good) must not refuse groups forever."""
    a, b = pair
    await stall_b(network, clock, a)
    network.crash(address_of("a"))
    await network.settle()
    assert b.mesh.fence.fenced()
    clock.advance(2 * BUDGET + 0.1)
    assert not b.mesh.fence.fenced()


async def test_an_address_that_failed_over_stays_with_its_later_link_when_the_old_broker_returns(
    network: FakeNetwork, clock: FakeClock, pair: list[Broker]
) -> None:
    """Connector m registered its address at b. b is cut off (a stall, a partition) with
    m's link still open there -- m's goodbye has not reached it -- and m fails over to a,
    where it registers the same address through a later link of its session (HELLO's
    epoch). When b links up again, its snapshot still announces the address from m's old
    link. Both brokers must keep the later registration; without epochs they swapped
    owners (each took the other's), and b's later REMOVE then took it from everywhere."""
    a, b = pair
    session = b"m-session".ljust(16, b".")
    old = await connector(network, b, "m", session=session, epoch=0)
    address = await old.register("m", 7)
    network.partition(address_of("a"), address_of("b"))
    await network.settle()
    new = await connector(network, a, "m", session=session, epoch=1)
    assert await new.register("m", 7) == address
    network.heal(address_of("a"), address_of("b"))
    for _ in range(6):
        await tick(network, pair, INTERVAL)
    assert (a.peers.names(), b.peers.names()) == (["b"], ["a"])
    assert routes_everywhere(pair, address) == {"a": "local", "b": "a"}
    assert a.sync.stats.stale_adds == 1
    old.close()  # b finally reads m's goodbye on the old link: nothing of it is left to take
    await network.settle()
    assert routes_everywhere(pair, address) == {"a": "local", "b": "a"}
