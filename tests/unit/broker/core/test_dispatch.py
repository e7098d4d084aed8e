"""The control dispatch: one table from (role, control type) to a handler, each row
registered with its type's body class; a frame its link's role may not send is refused
with UNSUPPORTED_CONTROL and the link stays open."""

from __future__ import annotations

import itertools

import pytest

from meshbus.address import Multicast, Unicast
from meshbus.broker.core import dispatch as dispatch_module
from meshbus.broker.core import link as link_module
from meshbus.broker.core.dispatch import ControlDispatch, Refused
from meshbus.broker.core.endpoint import CloseReason, LinkRole, LinkState
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox, TrafficStats
from meshbus.broker.replication.streams import member_address
from meshbus.broker.security.permissions import Permissions
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import (
    ROLE_BROKER,
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    Body,
    Empty,
    Error,
    Membership,
    Register,
    Routes,
    StreamRequest,
)
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    Hub,
    broker_side,
    connect_client,
    describe_frame,
    sample_body,
    start_broker,
)

# Each role of an open link, and the HELLO role that opens a link in it.
ROLES = {
    LinkRole.CONNECTOR: ROLE_CONNECTOR,
    LinkRole.OPERATOR: ROLE_OPERATOR,
    LinkRole.PEER: ROLE_BROKER,
}
UNKNOWN_TYPE = 999

# The table of a broker as built; its rows name that broker's handlers, but which pairs
# it lists does not depend on the broker it was built for.
TABLE = Broker().dispatch
UNLISTED = [
    (role, int(ctype))
    for role, ctype in itertools.product(ROLES, ControlType)
    if not TABLE.allows(role, ctype)
]


def pair_id(pair: tuple[LinkRole, int]) -> str:
    role, ctype = pair
    return f"{role.value}-{ControlType(ctype).name}"


@pytest.fixture
async def broker(network: FakeNetwork) -> Broker:
    return await start_broker(network, "a")


async def open_link(network: FakeNetwork, broker: Broker, role: LinkRole) -> FakeClient:
    """A client whose link is open in ``role`` (a peer is a broker named zz), inbox empty."""
    client = connect_client(network, broker, "zz")
    await client.hello(ROLES[role], listen="zz:1", tag=7)
    await network.settle()
    client.take()
    assert broker_side(client).role is role
    return client


def assert_unsupported(client: FakeClient, correlation: int) -> None:
    answer = client.answer(correlation)
    assert answer.type == ControlType.ERROR, describe_frame(answer)
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.UNSUPPORTED_CONTROL, answer.body


async def assert_still_open(client: FakeClient) -> None:
    link = broker_side(client)
    assert link.state is LinkState.OPEN
    assert not client.closed
    pong = await client.ask(ControlType.PING, Empty())
    assert pong.type == ControlType.PONG, describe_frame(pong)


def test_the_table_has_rows_for_open_roles_only_and_each_may_be_refused() -> None:
    # A handshaking link has no row: its frames go to the handshake.
    pairs = itertools.product(LinkRole, ControlType)
    assert {role for role, ctype in pairs if TABLE.allows(role, ctype)} == set(ROLES)
    assert {role for role, _ in UNLISTED} == set(ROLES), "the parametrization below is whole"


@pytest.mark.parametrize("pair", UNLISTED, ids=pair_id)
async def test_a_type_the_table_does_not_list_for_the_role_is_unsupported(
    network: FakeNetwork, broker: Broker, pair: tuple[LinkRole, int]
) -> None:
    role, ctype = pair
    client = await open_link(network, broker, role)
    refused_before = broker.dispatch.refused_frames
    correlation = client.send_control(ctype, sample_body(ControlType(ctype)), 4242)
    await network.settle()
    assert_unsupported(client, correlation)
    assert broker.dispatch.refused_frames == refused_before + 1
    await assert_still_open(client)


@pytest.mark.parametrize("role", list(ROLES), ids=lambda r: r.value)
async def test_a_type_no_broker_knows_is_unsupported_for_every_role(
    network: FakeNetwork, broker: Broker, role: LinkRole
) -> None:
    client = await open_link(network, broker, role)
    client.send_raw_control(UNKNOWN_TYPE, b"\x81\xa1x\x01", 77)
    await network.settle()
    assert_unsupported(client, 77)
    await assert_still_open(client)


async def test_register_from_an_operator_is_refused(network: FakeNetwork, broker: Broker) -> None:
    client = await open_link(network, broker, LinkRole.OPERATOR)
    answer = await client.ask(ControlType.REGISTER, Register(server="svc", instance=1))
    assert answer.type == ControlType.ERROR
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.UNSUPPORTED_CONTROL
    assert broker.routing.service_count == 0
    await assert_still_open(client)


@pytest.mark.parametrize(
    ("server", "instance"),
    [
        ("rstream", member_address("orders")[12:16]),  # a replicated stream's own address
        ("rstream", 0),
        ("stream", 0),
        ("stream", 70000),
        ("nats", 0),
        ("nats", 5),
    ],
)
async def test_a_connector_cannot_register_a_name_the_broker_keeps_for_itself(
    network: FakeNetwork, broker: Broker, server: str, instance: int | bytes
) -> None:
    """The addresses of streams' members and of the NATS bridge: a connector holding a
    replicated stream's (drawn from the stream's name, so known beforehand) would take
    what is sent to the stream and acknowledge it, with an epoch of its own choosing
    that no leader's passes."""
    if isinstance(instance, bytes):
        instance = int.from_bytes(instance, "big")
    client = await open_link(network, broker, LinkRole.CONNECTOR)
    answer = await client.ask(ControlType.REGISTER, Register(server=server, instance=instance))
    assert answer.type == ControlType.ERROR
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.INVALID_ADDRESS
    assert answer.body.message == (
        f"cannot register: the server name {server!r} is the broker's own (streams' members "
        "and the NATS bridge); choose another name"
    )
    assert broker.routing.service_count == 0
    await assert_still_open(client)


async def test_routes_from_a_connector_are_refused(network: FakeNetwork, broker: Broker) -> None:
    client = await open_link(network, broker, LinkRole.CONNECTOR)
    forged = Unicast("forged", 1).to_bytes()
    answer = await client.ask(ControlType.ROUTES, Routes(ops=[(1, forged, b"")], seq=1))
    assert answer.type == ControlType.ERROR
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.UNSUPPORTED_CONTROL
    assert broker.routing.owner(forged) is None, "a connector cannot write the table"
    await assert_still_open(client)


async def test_a_refused_request_is_an_error_with_its_correlation(
    network: FakeNetwork, broker: Broker
) -> None:
    client = await open_link(network, broker, LinkRole.CONNECTOR)
    stranger = Unicast("stranger", 1).to_bytes()
    answer = await client.ask(
        ControlType.JOIN, Membership(member=stranger, group=Multicast("chat").to_bytes())
    )
    assert answer.type == ControlType.ERROR
    assert isinstance(answer.body, Error)
    assert answer.body.code == ErrorCode.NOT_REGISTERED
    bad = await client.ask(ControlType.REGISTER, Register(server="x" * 12, instance=1))
    assert isinstance(bad.body, Error)
    assert bad.body.code == ErrorCode.INVALID_ADDRESS
    await assert_still_open(client)


async def test_dispatch_turns_a_handlers_refusal_into_an_error_frame() -> None:
    """ControlDispatch on its own: a handler raising Refused; nothing else is answered."""
    hub = Hub()
    link = hub.connector()
    outbox = Outbox(TrafficStats())
    dispatch = ControlDispatch(outbox)
    handled: list[tuple[int, Body]] = []

    def refuse(link: Link, correlation: int, body: StreamRequest) -> None:
        raise Refused(ErrorCode.STREAM_ERROR, "no, thanks")

    def accept(link: Link, correlation: int, body: Empty) -> None:
        handled.append((correlation, body))

    dispatch.on(LinkRole.CONNECTOR, ControlType.STREAM, StreamRequest, refuse)
    dispatch.on(LinkRole.CONNECTOR, ControlType.PING, Empty, accept)
    dispatch.handle(link, int(ControlType.STREAM), 31, sample_body(ControlType.STREAM))
    dispatch.handle(link, int(ControlType.PING), 32, Empty())
    outbox.flush()
    frames = hub.received(link)
    assert [(f.type, f.correlation) for f in frames if isinstance(f, ControlFrame)] == [
        (ControlType.ERROR, 31)
    ]
    body = frames[0].body if isinstance(frames[0], ControlFrame) else None
    assert isinstance(body, Error)
    assert (body.code, body.message) == (ErrorCode.STREAM_ERROR, "no, thanks")
    assert handled == [(32, Empty())]
    assert dispatch.refused_frames == 0, "a refusal by a handler is not a refused frame"
    assert link.state is LinkState.OPEN


# -- typed rows: each registered with its type's body class ---------------------------------


def nothing(link: Link, correlation: int, body: Body) -> None:
    raise AssertionError("not called")


def test_a_row_of_another_class_than_its_types_is_refused_at_registration() -> None:
    dispatch = ControlDispatch(Outbox(TrafficStats()))
    with pytest.raises(TypeError, match=r"^JOIN bodies are Membership, not Register$"):
        dispatch.on(LinkRole.CONNECTOR, ControlType.JOIN, Register, nothing)
    with pytest.raises(TypeError, match=r"^PING bodies are Empty, not Body$"):
        dispatch.on(LinkRole.CONNECTOR, ControlType.PING, Body, nothing)
    assert not dispatch.allows(LinkRole.CONNECTOR, ControlType.JOIN)
    assert not dispatch.allows(LinkRole.CONNECTOR, ControlType.PING)


def test_a_second_handler_for_a_row_is_refused_at_registration() -> None:
    dispatch = ControlDispatch(Outbox(TrafficStats()))
    dispatch.on(LinkRole.PEER, ControlType.PING, Empty, nothing)
    with pytest.raises(ValueError, match=r"^peer already has a handler for PING$"):
        dispatch.on(LinkRole.PEER, ControlType.PING, Empty, nothing)
    dispatch.on(LinkRole.CONNECTOR, ControlType.PING, Empty, nothing)  # another role's row


def test_a_permission_check_of_another_class_is_refused_at_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checks in front of the table are typed like its rows, and matched to them."""
    checks = dispatch_module._CHECKS
    monkeypatch.setitem(checks, ControlType.LEAVE, checks[ControlType.REGISTER])
    dispatch = ControlDispatch(Outbox(TrafficStats()))
    with pytest.raises(TypeError, match=r"^the permission check of LEAVE reads Register bodies$"):
        dispatch.on(LinkRole.CONNECTOR, ControlType.LEAVE, Membership, nothing)


def test_every_row_of_a_broker_takes_its_types_body_class() -> None:
    """Building a broker registers its whole table; a row of the wrong class would raise."""
    broker = Broker()
    assert broker.dispatch.allows(LinkRole.CONNECTOR, ControlType.REGISTER)
    assert broker.dispatch.allows(LinkRole.PEER, ControlType.ROUTES)


async def test_a_handler_gets_the_body_class_it_registered() -> None:
    hub = Hub()
    joined: list[tuple[int, Membership]] = []

    def join(link: Link, correlation: int, body: Membership) -> None:
        joined.append((correlation, body))

    hub.dispatch.on(LinkRole.CONNECTOR, ControlType.JOIN, Membership, join)
    link = hub.connector()
    member, group = Unicast("svc", 1).to_bytes(), Multicast("chat").to_bytes()
    hub.feed(link, encode_control(ControlType.JOIN, Membership(member=member, group=group), 9))
    assert [(c, type(b), b.member, b.group) for c, b in joined] == [(9, Membership, member, group)]
    assert link.state is LinkState.OPEN


async def test_a_body_of_another_class_than_its_rows_is_a_protocol_error_for_its_link_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The codec decodes each type into its class; were a body of another class to reach
    the table, the dispatch refuses it before the permission check and the handler, and
    closes that link alone."""
    hub = Hub()
    joined: list[Body] = []

    def join(link: Link, correlation: int, body: Membership) -> None:
        joined.append(body)

    hub.dispatch.on(LinkRole.CONNECTOR, ControlType.JOIN, Membership, join)
    liar, other = hub.connector("liar"), hub.connector("other")
    liar.permissions = Permissions("liar")  # JOIN's check would read the body first
    monkeypatch.setattr(link_module, "decode_body", lambda ctype, raw: Register(server="svc"))
    member, group = Unicast("svc", 1).to_bytes(), Multicast("chat").to_bytes()
    hub.feed(liar, encode_control(ControlType.JOIN, Membership(member=member, group=group), 9))
    assert joined == []
    [frame] = hub.received(liar)
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error)
    assert (frame.body.code, frame.body.message) == (
        ErrorCode.PROTOCOL_ERROR,
        "a JOIN frame must carry a Membership body, not a Register",
    )
    assert hub.closed == [(liar, CloseReason.PROTOCOL_ERROR)]
    assert other.state is LinkState.OPEN
