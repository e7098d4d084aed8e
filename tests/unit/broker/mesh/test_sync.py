"""Route sync between in-process brokers: every broker holds the whole table, a change is
confirmed (SYNCED) once every peer has applied it, and a service that goes leaves every
table."""

from __future__ import annotations

import asyncio

import pytest

from meshbus.address import Multicast, Unicast
from meshbus.broker.core import slices
from meshbus.broker.mesh.sync import ROUTES_CHUNK, ROUTES_CHUNK_BYTES, _chunks
from meshbus.broker.server import Broker
from meshbus.protocol.control import (
    OP_INTEREST,
    OP_JOIN,
    AddressBody,
    Membership,
    Register,
    interest_extra,
)
from meshbus.protocol.layout import ControlType
from meshbus.testing import (
    FakeNetwork,
    address_of,
    broker_side,
    build_mesh,
    connector,
    describe_frame,
    routes_everywhere,
    start_broker,
)

CHAT = Multicast("chat").to_bytes()


@pytest.fixture
async def mesh3(network: FakeNetwork) -> list[Broker]:
    return await build_mesh(network, 3)


def members_everywhere(brokers: list[Broker], group: bytes) -> dict[str, list[bytes]]:
    return {b.config.name: sorted(b.routing.members(group)) for b in brokers}


@pytest.mark.parametrize("instance", [0, 7], ids=["dynamic", "fixed"])
async def test_a_register_on_one_broker_is_routable_from_the_others(
    network: FakeNetwork, mesh3: list[Broker], instance: int
) -> None:
    a, _, c = mesh3
    owner = await connector(network, a, "owner")
    address = await owner.register("svc", instance)
    await network.settle()
    assert routes_everywhere(mesh3, address) == {"a": "local", "b": "a", "c": "a"}
    sender = await connector(network, c, "sender")
    source = await sender.register("sender")
    await network.settle()
    sender.send_data(address, source, b"across the mesh", msg_id=3)
    await network.settle()
    frames = owner.take_data()
    assert [(f.payload, f.src, f.msg_id) for f in frames] == [(b"across the mesh", source, 3)]


async def test_a_joining_broker_takes_every_peers_table(network: FakeNetwork) -> None:
    a, b = await build_mesh(network, 2)
    on_a = await connector(network, a, "on-a")
    on_b = await connector(network, b, "on-b")
    from_a = await on_a.register("svc", 1)
    from_b = await on_b.register("svc", 2)
    await on_b.join(from_b, CHAT)
    c = await start_broker(network, "c", seeds=[address_of("b")])
    assert c.mesh.ready
    assert routes_everywhere([c], from_a) == {"c": "a"}
    assert routes_everywhere([c], from_b) == {"c": "b"}
    assert c.routing.members(CHAT) == [from_b]


async def test_synced_comes_only_after_every_peer_confirmed(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    a = mesh3[0]
    client = await connector(network, a, "client", synced=True)
    network.wire_between(address_of("a"), address_of("c")).hold()
    correlation = client.send_control(ControlType.REGISTER, Register(server="svc", instance=0))
    await network.settle()
    # Answered at once; SYNCED waits for c, which has not even seen the change.
    registered = client.answer(correlation)
    assert registered.type == ControlType.REGISTERED
    assert isinstance(registered.body, AddressBody)
    address = registered.body.address
    assert client.take(ControlType.SYNCED) == []
    assert routes_everywhere(mesh3, address) == {"a": "local", "b": "a", "c": None}
    network.wire_between(address_of("a"), address_of("c")).release()
    await network.settle()
    assert routes_everywhere(mesh3, address)["c"] == "a"
    synced = client.answer(correlation)
    assert synced.type == ControlType.SYNCED


async def test_a_lost_peer_no_longer_holds_up_synced(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    a = mesh3[0]
    client = await connector(network, a, "client", synced=True)
    wire = network.wire_between(address_of("a"), address_of("c"))
    wire.hold()
    correlation = client.send_control(ControlType.REGISTER, Register(server="svc", instance=0))
    await network.settle()
    assert client.answer(correlation).type == ControlType.REGISTERED
    assert client.take(ControlType.SYNCED) == []
    wire.cut()
    await network.settle()
    assert client.answer(correlation).type == ControlType.SYNCED
    assert a.peers.names() == ["b"]


async def test_synced_is_not_sent_to_a_connector_that_did_not_ask(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    client = await connector(network, mesh3[0], "client")
    correlation = client.send_control(ControlType.REGISTER, Register(server="svc", instance=0))
    await network.settle()
    assert client.answer(correlation).type == ControlType.REGISTERED
    assert [describe_frame(f) for f in client.take(ControlType.SYNCED)] == []


async def test_unregister_removes_the_route_everywhere(
    network: FakeNetwork, mesh3: list[Broker]
) -> None:
    client = await connector(network, mesh3[1], "client")
    address = await client.register("svc", 5)
    await client.join(address, CHAT)
    await network.settle()
    assert members_everywhere(mesh3, CHAT) == {"a": [address], "b": [address], "c": [address]}
    await client.unregister(address)
    await network.settle()
    assert routes_everywhere(mesh3, address) == {"a": None, "b": None, "c": None}
    assert members_everywhere(mesh3, CHAT) == {"a": [], "b": [], "c": []}


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_a_closed_connectors_services_leave_every_broker(
    network: FakeNetwork, mesh3: list[Broker], how: str
) -> None:
    client = await connector(network, mesh3[2], "client")
    fixed = await client.register("svc", 5)
    dynamic = await client.register("svc")
    await client.join(dynamic, CHAT)
    await network.settle()
    assert routes_everywhere(mesh3, dynamic) == {"a": "c", "b": "c", "c": "local"}
    client.close() if how == "close" else client.abort()
    await network.settle()
    for address in (fixed, dynamic):
        assert routes_everywhere(mesh3, address) == {"a": None, "b": None, "c": None}
    assert members_everywhere(mesh3, CHAT) == {"a": [], "b": [], "c": []}
    for broker in mesh3:
        assert broker.routing.route_count == 0


async def test_a_snapshot_written_in_slices_while_the_table_changes_ends_equal(
    network: FakeNetwork, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big table goes to a joining broker one ROUTES chunk per loop turn (here every
    chunk is its own slice), while its owner unregisters services and joins others to a
    group, one change per turn: the joiner ends with exactly the owner's table."""
    monkeypatch.setattr(slices, "SLICE", 0.0)
    a = await start_broker(network, "a")
    on_a = await connector(network, a, "on-a")
    link = broker_side(on_a)
    addresses = [Unicast("svc", i).to_bytes() for i in range(1, 20_001)]
    for address in addresses:
        a.routing.add_service(address, link, on_a.name.encode().ljust(16, b"."))
    for address in addresses[::2]:
        a.routing.join(address, CHAT)

    async def churn() -> None:
        """Changes to addresses at the end of the table: their turn in the snapshot comes
        after the changes went out as operations."""
        for address in addresses[-300:]:
            on_a.send_control(ControlType.UNREGISTER, AddressBody(address=address))
            await asyncio.sleep(0)
        for address in addresses[-901:-300:2]:  # not members yet
            on_a.send_control(ControlType.JOIN, Membership(member=address, group=CHAT))
            await asyncio.sleep(0)

    changes = asyncio.create_task(churn())
    c = await start_broker(network, "c", seeds=[address_of("a")])
    await changes
    await network.settle()
    assert a.sync.stats.route_ops_out > ROUTES_CHUNK  # more than one chunk went out
    assert c.routing.members(CHAT) == a.routing.members(CHAT)
    assert {x for x, _ in c.routing.services()} == {x for x, _ in a.routing.services()}
    assert routes_everywhere([a, c], addresses[-1]) == {"a": None, "c": None}
    assert routes_everywhere([a, c], addresses[0]) == {"a": "local", "c": "a"}
    assert addresses[-301] in c.routing.members(CHAT)


def test_route_operations_go_in_chunks_of_bounded_count_and_bytes() -> None:
    """A NATS interest's subject may be as long as a control line: a turn's operations
    are cut by bytes too, so no ROUTES frame nears the peer's max_frame."""
    long = [(OP_INTEREST, b"s" * 4000 + b".%d" % i, interest_extra(1, b"")) for i in range(200)]
    short = [(OP_JOIN, bytes(16), bytes(16))] * (ROUTES_CHUNK + 1)
    chunks = list(_chunks(long + short))
    assert [op for chunk in chunks for op in chunk] == long + short  # all, in order
    assert all(len(chunk) <= ROUTES_CHUNK for chunk in chunks)
    assert all(sum(len(a) + len(e) for _, a, e in chunk) <= ROUTES_CHUNK_BYTES for chunk in chunks)
    assert len(chunks) >= 4
    huge = [(OP_INTEREST, b"h" * (ROUTES_CHUNK_BYTES + 1), interest_extra(1, b""))]
    assert list(_chunks(huge)) == [huge]  # one too large still goes, alone
