"""A link's role and state, and the only transitions between them
(meshbus.broker.core.endpoint has the table)."""

from __future__ import annotations

import pytest

from meshbus.address import Unicast
from meshbus.broker.core.endpoint import CloseReason, LinkRole, LinkState, PeerInfo
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame, encode_control, encode_data
from meshbus.protocol.control import (
    ROLE_BROKER,
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    Bye,
    Empty,
    Error,
    Hello,
)
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    Hub,
    broker_side,
    build_mesh,
    connect_client,
    describe_frame,
    sample_body,
    start_broker,
)

SESSION = b"s" * 16
UNKNOWN_TYPE = 999  # a control type no broker knows


@pytest.fixture
async def broker(network: FakeNetwork) -> Broker:
    return await start_broker(network, "a")


def closed_with(client: FakeClient, code: ErrorCode) -> None:
    """The broker sent ``client`` exactly an ERROR ``code`` (correlation 0), then closed."""
    frames = client.take()
    assert [describe_frame(f) for f in frames if not isinstance(f, ControlFrame)] == []
    errors = [f for f in frames if isinstance(f, ControlFrame) and f.type == ControlType.ERROR]
    assert len(errors) == 1, [describe_frame(f) for f in frames]
    assert isinstance(errors[0].body, Error)
    assert errors[0].body.code == code
    assert errors[0].correlation == 0
    assert client.closed


async def test_a_new_accepted_link_awaits_hello_and_a_dialled_one_awaits_welcome(
    broker: Broker,
) -> None:
    accepted = broker.new_link()
    assert (accepted.role, accepted.state) == (LinkRole.HANDSHAKING, LinkState.AWAIT_HELLO)
    assert accepted.peer is None
    assert not accepted.is_peer
    dialled = broker.new_link(dialled=True)
    assert (dialled.role, dialled.state) == (LinkRole.HANDSHAKING, LinkState.AWAIT_WELCOME)
    assert dialled.peer is None
    assert not dialled.is_peer


@pytest.mark.parametrize(
    ("role", "expected"),
    [(ROLE_CONNECTOR, LinkRole.CONNECTOR), (ROLE_OPERATOR, LinkRole.OPERATOR)],
)
async def test_hello_opens_the_link_in_the_role_it_names(
    network: FakeNetwork, broker: Broker, role: str, expected: LinkRole
) -> None:
    client = connect_client(network, broker, "tool")
    link = broker_side(client)
    welcome = await client.hello(role, session=SESSION, max_frame=4096, synced=True)
    assert (link.role, link.state) == (expected, LinkState.OPEN)
    assert link.name == "tool"
    assert link.max_frame == welcome.max_frame == 4096
    assert link.peer is None
    assert not link.is_peer
    # Only connectors count (capacity, moves); an operator's link is never one.
    assert (link in broker.links.connectors) == (expected is LinkRole.CONNECTOR)
    if expected is LinkRole.CONNECTOR:
        assert (link.session, link.wants_synced) == (SESSION, True)


async def test_hello_as_a_broker_opens_a_peer_link_with_its_peer_info(
    network: FakeNetwork, broker: Broker
) -> None:
    client = connect_client(network, broker, "zz")
    link = broker_side(client)
    welcome = await client.hello(ROLE_BROKER, listen="zz:1", slot=5, tag=77)
    assert (link.role, link.state) == (LinkRole.PEER, LinkState.OPEN)
    assert link.is_peer
    assert broker.peers.get("zz") is link
    assert link not in broker.links.connectors
    info = link.peer
    assert isinstance(info, PeerInfo)
    # tag_in is the id we gave the peer (told in WELCOME); tag_out the one it gave us.
    assert (info.listen, info.slot, info.tag_in, info.tag_out) == (
        "zz:1",
        5,
        link.link_id,
        (77).to_bytes(4, "big"),
    )
    assert welcome.tag == link.link_id


async def test_peer_info_is_on_peer_links_and_on_no_other(network: FakeNetwork) -> None:
    brokers = await build_mesh(network, 3)
    for broker in brokers:
        await connect_client(network, broker, "conn").hello(ROLE_CONNECTOR)
        await connect_client(network, broker, "op").hello(ROLE_OPERATOR)
    for broker in brokers:
        roles = {link.role for link in broker.links.links.values()}
        assert roles == {LinkRole.CONNECTOR, LinkRole.OPERATOR, LinkRole.PEER}
        for link in broker.links.links.values():
            assert (link.peer is not None) is link.is_peer is (link.role is LinkRole.PEER)
    # Each side's tag_out is the other side's link id: the neighbour identifiers match up.
    by_name = {b.config.name: b for b in brokers}
    for broker in brokers:
        for name, link in broker.peers.items():
            back = by_name[name].peers.get(broker.config.name)
            assert link.peer is not None
            assert back is not None
            assert back.peer is not None
            assert link.peer.tag_out == back.peer.tag_in.to_bytes(4, "big")


async def test_a_data_frame_before_hello_closes_the_link_with_not_handshaken(
    network: FakeNetwork, broker: Broker
) -> None:
    client = connect_client(network, broker)
    link = broker_side(client)
    address = Unicast("svc", 1).to_bytes()
    client.send(encode_data(address, address, b"too early"))
    await network.settle()
    closed_with(client, ErrorCode.NOT_HANDSHAKEN)
    assert (link.role, link.state) == (LinkRole.HANDSHAKING, LinkState.CLOSED)
    assert broker.links.closed["protocol-error"] == 1
    assert link.link_id not in broker.links.links


@pytest.mark.parametrize(
    "ctype",
    [t for t in ControlType if t is not ControlType.HELLO] + [UNKNOWN_TYPE],
    ids=lambda t: ControlType(t).name if t != UNKNOWN_TYPE else f"unknown-{t}",
)
async def test_any_control_frame_but_hello_before_the_handshake_closes_the_link(
    network: FakeNetwork, broker: Broker, ctype: int
) -> None:
    client = connect_client(network, broker)
    link = broker_side(client)
    if ctype == UNKNOWN_TYPE:
        client.send_raw_control(ctype, b"\x80", 5)
    else:
        client.send_control(ctype, sample_body(ControlType(ctype)), 5)
    await network.settle()
    closed_with(client, ErrorCode.NOT_HANDSHAKEN)
    assert (link.role, link.state) == (LinkRole.HANDSHAKING, LinkState.CLOSED)
    assert broker.peers.names() == []


async def test_a_second_hello_is_refused_and_the_link_stays_open(
    network: FakeNetwork, broker: Broker
) -> None:
    client = connect_client(network, broker)
    link = broker_side(client)
    await client.hello()
    answer = await client.ask(ControlType.HELLO, Hello(role=ROLE_OPERATOR))
    assert answer.type == ControlType.ERROR
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.ALREADY_HANDSHAKEN
    assert (link.role, link.state) == (LinkRole.CONNECTOR, LinkState.OPEN), "no role change"
    assert (await client.ask(ControlType.PING, Empty())).type == ControlType.PONG


async def test_a_refused_hello_closes_a_link_that_never_opened(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a", max_connectors=1)
    await connect_client(network, broker, "first").hello()
    second = connect_client(network, broker, "second")
    link = broker_side(second)
    second.send(encode_control(ControlType.HELLO, Hello(name="second"), 1))
    await network.settle()
    closed_with(second, ErrorCode.REDIRECT)
    assert (link.role, link.state) == (LinkRole.HANDSHAKING, LinkState.CLOSED)
    assert len(broker.links.connectors) == 1


async def test_a_closed_link_keeps_its_role(network: FakeNetwork, broker: Broker) -> None:
    client = connect_client(network, broker)
    link = broker_side(client)
    await client.hello()
    client.close()
    await network.settle()
    assert (link.role, link.state) == (LinkRole.CONNECTOR, LinkState.CLOSED)
    assert link not in broker.links.connectors
    assert broker.links.closed["client-eof"] == 1


async def test_a_link_opens_once() -> None:
    hub = Hub()
    link = hub.connector("conn")
    with pytest.raises(RuntimeError):
        link.open_as_connector("again", b"", 4096, False)
    with pytest.raises(RuntimeError):
        link.open_as_operator("op", 4096)
    with pytest.raises(RuntimeError):
        link.open_as_peer(
            "zz", PeerInfo("zz:1", 1, link.link_id, bytes(4), clock=lambda: 0.0, budget=1.5), 4096
        )
    assert (link.role, link.name, link.peer) == (LinkRole.CONNECTOR, "conn", None)


async def test_a_closed_link_cannot_open() -> None:
    hub = Hub()
    link = hub.link()
    link.close(CloseReason.CLIENT_EOF)
    with pytest.raises(RuntimeError):
        link.open_as_connector("late", b"", 4096, False)
    assert (link.role, link.state) == (LinkRole.HANDSHAKING, LinkState.CLOSED)


async def test_a_transport_closed_under_an_open_link_is_not_written_to(
    broker: Broker, network: FakeNetwork
) -> None:
    """The socket can close before its link hears ``connection_lost`` (a loop turn later).
    uvloop's transport raises on a write then; ``stop`` sent its BYE into one and the
    broker died on SIGTERM with a RuntimeError."""
    client = connect_client(network, broker)
    await client.hello()
    link = broker_side(client)
    assert link.transport is not None

    def closed_handle(data: object) -> None:
        raise RuntimeError("unable to perform operation: the handler is closed")

    link.transport.write = closed_handle  # type: ignore[method-assign]
    link.transport.closing = True  # type: ignore[attr-defined]
    link.send(encode_control(ControlType.BYE, Bye(reason="late")))  # nothing is written
    await broker.stop()
