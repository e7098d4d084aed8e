"""Every resource a client can take from a broker is bounded (docs/architecture.md, the
limits): each limit is refused at N+1 with an error naming it and its flag, and the
link stays usable unless the limit is about the link itself."""

from __future__ import annotations

from meshbus.address import Anycast, Multicast, Unicast
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame, encode_control, encode_data
from meshbus.protocol.control import (
    ROLE_OPERATOR,
    DeliveryFailure,
    Empty,
    Error,
    Hello,
    Membership,
    Register,
)
from meshbus.protocol.layout import (
    FLAG_ECHO,
    FLAG_REQUEST,
    FLAG_RESPONSE,
    ControlType,
    ErrorCode,
)
from meshbus.testing import (
    FakeClient,
    FakeClock,
    FakeNetwork,
    broker_side,
    connect_client,
    connector,
    describe_frame,
    start_broker,
)


def refusal(frame: ControlFrame) -> Error:
    assert frame.type == ControlType.ERROR, describe_frame(frame)
    assert isinstance(frame.body, Error)
    return frame.body


async def still_usable(client: FakeClient) -> None:
    frame = await client.ask(ControlType.PING, Empty())
    assert frame.type == ControlType.PONG, describe_frame(frame)
    assert not client.closed


def group(i: int) -> bytes:
    return Multicast(f"g{i}").to_bytes()


# -- services and groups --------------------------------------------------------------------


async def test_register_past_max_services_is_refused_and_the_link_stays(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a", max_services=3)
    client = await connector(network, broker)
    owned = [await client.register("svc") for _ in range(2)]
    owned.append(await client.register("fixed", 7))
    for body in (Register(server="svc"), Register(server="fixed", instance=8)):
        error = refusal(await client.ask(ControlType.REGISTER, body))
        assert error.code == ErrorCode.LIMIT_EXCEEDED
        assert "3 services" in error.message
        assert "--max-services" in error.message
    await still_usable(client)
    assert broker.routing.owned_count(broker_side(client)) == 3
    # Room again once one goes; another connector has its own allowance.
    await client.unregister(owned[0])
    await client.register("svc")
    other = await connector(network, broker, "other")
    await other.register("svc")


async def test_join_past_max_groups_per_service_is_refused(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a", max_groups_per_service=2)
    client = await connector(network, broker)
    one, two = await client.register("one"), await client.register("two")
    await client.join(one, group(1))
    await client.join(one, Anycast("pool").to_bytes())
    error = refusal(await client.ask(ControlType.JOIN, Membership(member=one, group=group(3))))
    assert error.code == ErrorCode.LIMIT_EXCEEDED
    assert "--max-groups-per-service" in error.message
    await client.join(one, group(1))  # already a member: not a new membership
    await client.join(two, group(3))  # another service has its own allowance
    await still_usable(client)
    assert len(broker.routing.groups_of(one)) == 2


async def test_join_past_max_groups_per_connector_is_refused(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a", max_groups=3)
    client = await connector(network, broker)
    one, two = await client.register("one"), await client.register("two")
    await client.join(one, group(1))
    await client.join(one, group(2))
    await client.join(two, group(1))
    for member in (one, two):
        body = Membership(member=member, group=group(9))
        error = refusal(await client.ask(ControlType.JOIN, body))
        assert error.code == ErrorCode.LIMIT_EXCEEDED
        assert "--max-groups)" in error.message
    await still_usable(client)
    # Leaving makes room; unregistering a service gives back its memberships too.
    frame = await client.ask(ControlType.LEAVE, Membership(member=one, group=group(2)))
    assert frame.type == ControlType.OK
    await client.join(two, group(9))
    await client.unregister(two)
    await client.join(one, group(5))
    await client.join(one, group(6))
    assert broker.routing.memberships_of(broker_side(client)) == 3


# -- requests ---------------------------------------------------------------------------------


async def requester_and_responder(
    network: FakeNetwork, broker: Broker
) -> tuple[FakeClient, bytes, FakeClient, bytes]:
    requester = await connector(network, broker, "requester")
    asking = await requester.register("asker")
    responder = await connector(network, broker, "responder")
    answering = await responder.register("server", 1)
    return requester, asking, responder, answering


def failures(client: FakeClient, type_: ControlType) -> list[DeliveryFailure]:
    found = []
    for frame in client.take(type_):
        assert isinstance(frame, ControlFrame)
        assert isinstance(frame.body, DeliveryFailure)
        found.append(frame.body)
    return found


async def test_a_request_past_max_requests_gets_no_route_at_once(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a", max_requests=2)
    requester, asking, responder, answering = await requester_and_responder(network, broker)
    pool = Anycast("pool").to_bytes()
    await responder.join(answering, pool)
    # Unicast (a cached decision after the first) and anycast (the general path).
    for msg_id, dst in ((1, answering), (2, answering), (3, answering), (4, pool)):
        requester.send_data(dst, asking, b"?", msg_id=msg_id, flags=FLAG_REQUEST, timeout_ms=9000)
    await network.settle()
    assert [f.msg_id for f in responder.take_data()] == [1, 2], "refused ones not forwarded"
    refused = failures(requester, ControlType.NO_ROUTE)
    assert [f.msg_id for f in refused] == [3, 4]
    assert all("--max-requests" in f.reason for f in refused)
    assert "2 requests" in refused[0].reason
    assert broker.pending.count(broker_side(requester)) == 2
    # An answer makes room, and the link carries on.
    responder.send_data(asking, answering, b"!", msg_id=1, response_for=1, flags=FLAG_RESPONSE)
    requester.send_data(answering, asking, b"?", msg_id=5, flags=FLAG_REQUEST, timeout_ms=9000)
    await network.settle()
    assert [f.payload for f in requester.take_data()] == [b"!"]
    assert [f.msg_id for f in responder.take_data()] == [5]
    assert failures(requester, ControlType.NO_ROUTE) == []


async def test_a_longer_timeout_is_cut_to_max_request_timeout(
    network: FakeNetwork, clock: FakeClock
) -> None:
    broker = await start_broker(network, "a", max_request_timeout=10.0)
    requester, asking, _, answering = await requester_and_responder(network, broker)
    forty_nine_days = 0xFFFFFFFF
    requester.send_data(
        answering, asking, b"?", msg_id=1, flags=FLAG_REQUEST, timeout_ms=forty_nine_days
    )
    requester.send_data(answering, asking, b"?", msg_id=2, flags=FLAG_REQUEST, timeout_ms=3000)
    await network.settle()
    clock.advance(3.0)
    broker.expire_requests()
    await network.settle()
    assert [f.msg_id for f in failures(requester, ControlType.TIMEOUT)] == [2]
    clock.advance(7.0)
    broker.expire_requests()
    await network.settle()
    assert [f.msg_id for f in failures(requester, ControlType.TIMEOUT)] == [1]
    assert len(broker.pending) == 0


# -- handshakes and operators -----------------------------------------------------------------


async def test_a_connection_that_never_says_hello_is_closed_at_the_timeout(
    network: FakeNetwork, clock: FakeClock
) -> None:
    broker = await start_broker(network, "a", handshake_timeout=5.0)
    silent = connect_client(network, broker, "silent")
    polite = connect_client(network, broker, "polite")
    await network.settle()
    assert len(broker_side(silent)._buf) <= 4096, "no 256 KiB buffer before HELLO"
    clock.advance(4.0)
    await polite.hello()
    assert len(broker_side(polite)._buf) == 256 * 1024
    broker.housekeeping()
    await network.settle()
    assert not silent.closed
    clock.advance(1.0)
    broker.housekeeping()
    await network.settle()
    assert silent.closed
    (error,) = [refusal(f) for f in silent.take(ControlType.ERROR)]
    assert error.code == ErrorCode.NOT_HANDSHAKEN
    assert "--handshake-timeout" in error.message
    assert not polite.closed
    await still_usable(polite)
    assert broker.links.handshaking == {}


async def test_connections_past_max_handshaking_are_closed_at_once(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a", max_handshaking=2)
    first, second = connect_client(network, broker, "1"), connect_client(network, broker, "2")
    third = connect_client(network, broker, "3")
    await network.settle()
    assert third.closed
    assert not first.closed
    assert not second.closed
    (error,) = [refusal(f) for f in third.take(ControlType.ERROR)]
    assert error.code == ErrorCode.LIMIT_EXCEEDED
    assert "--max-handshaking" in error.message
    await first.hello()  # no longer waiting: room for one more
    fourth = connect_client(network, broker, "4")
    await network.settle()
    assert not fourth.closed
    await fourth.hello()
    await still_usable(first)


async def test_operator_links_past_max_operators_are_refused(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a", max_operators=1)
    first = connect_client(network, broker, "op1")
    await first.hello(ROLE_OPERATOR)
    second = connect_client(network, broker, "op2")
    second.send_control(ControlType.HELLO, Hello(role=ROLE_OPERATOR, name="op2"))
    await network.settle()
    (error,) = [refusal(f) for f in second.take(ControlType.ERROR)]
    assert error.code == ErrorCode.LIMIT_EXCEEDED
    assert "--max-operators" in error.message
    assert second.closed
    await connector(network, broker, "conn")  # connectors are not operators
    await still_usable(first)
    first.close()
    await network.settle()
    third = connect_client(network, broker, "op3")
    await third.hello(ROLE_OPERATOR)


async def test_frames_pipelined_behind_hello_outgrow_the_small_buffer(
    network: FakeNetwork,
) -> None:
    """HELLO, REGISTER, JOIN and a 40 KiB send in one write: the link starts with its
    small buffer, takes the big one at HELLO, and loses nothing of the read."""
    broker = await start_broker(network, "a")
    client = connect_client(network, broker, "eager")
    own = Unicast("eager", 1).to_bytes()
    topic = group(1)
    payload = bytes(range(256)) * 160
    await network.settle()
    assert len(broker_side(client)._buf) <= 4096
    client.send(
        encode_control(ControlType.HELLO, Hello(name="eager"), 1)
        + encode_control(ControlType.REGISTER, Register(server="eager", instance=1), 2)
        + encode_control(ControlType.JOIN, Membership(member=own, group=topic), 3)
        + encode_data(topic, own, payload, flags=FLAG_ECHO)
    )
    await network.settle()
    assert [f.type for f in client.controls()] == [
        ControlType.WELCOME,
        ControlType.REGISTERED,
        ControlType.OK,
    ]
    assert [f.payload for f in client.take_data()] == [payload]
    assert not client.closed
    assert len(broker_side(client)._buf) >= 256 * 1024
