"""A link's permissions, enforced by real brokers on the fake network (docs/security.md,
"Permissions"): refused control requests answer ERROR PERMISSION_DENIED and the link
stays open; denied data frames are dropped, counted, and reported to a sender that
asked; a link without permissions does what it always did. The sign-in sets
``Link.permissions`` when the link opens; these tests set it right after the HELLO."""

from __future__ import annotations

import pytest

from meshbus.address import Anycast, Multicast, Unicast
from meshbus.broker.security.permissions import Permissions
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame
from meshbus.protocol.control import (
    ROLE_OPERATOR,
    DeliveryFailure,
    Drain,
    Empty,
    Error,
    GroupBind,
    Membership,
    MembersRequest,
    Register,
    StatRequest,
    Stats,
    StreamReply,
    StreamRequest,
)
from meshbus.protocol.ext import Ext, ack_frames, wrap
from meshbus.protocol.layout import (
    FLAG_EXT,
    FLAG_NOTIFY_DROP,
    FLAG_RELIABLE,
    FLAG_REQUEST,
    FLAG_RESPONSE,
    ControlType,
    ErrorCode,
)
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    broker_side,
    connect_client,
    connector,
    describe_frame,
    start_broker,
)

CHAT = Multicast("chat").to_bytes()
ADMIN = Multicast("admin").to_bytes()
LOGIN_POOL = Anycast("login").to_bytes()


def as_user(client: FakeClient, table: dict[str, object], user: str = "game") -> Permissions:
    permissions = Permissions.from_table(table, user)
    broker_side(client).permissions = permissions
    return permissions


def denied(frame: ControlFrame) -> str:
    assert frame.type == ControlType.ERROR, describe_frame(frame)
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.PERMISSION_DENIED, frame.body
    return frame.body.message


def failures(client: FakeClient) -> list[DeliveryFailure]:
    found = []
    for frame in client.take(ControlType.NO_ROUTE):
        assert isinstance(frame, ControlFrame)
        assert isinstance(frame.body, DeliveryFailure)
        found.append(frame.body)
    return found


async def still_usable(client: FakeClient) -> None:
    frame = await client.ask(ControlType.PING, Empty())
    assert frame.type == ControlType.PONG, describe_frame(frame)
    assert not client.closed


# -- control requests ----------------------------------------------------------------------


async def test_a_fixed_address_is_registered_only_by_a_user_allowed_its_server_name(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a")
    squatter = await connector(network, broker, "squatter")
    as_user(squatter, {"register": ["game*"]})
    message = denied(await squatter.ask(ControlType.REGISTER, Register(server="login", instance=1)))
    assert message == (
        "permission denied: user 'game' may not register login:1 (permissions.register)"
    )
    dynamic = await squatter.ask(ControlType.REGISTER, Register(server="login"))
    assert "may not register under 'login'" in denied(dynamic)
    assert broker.routing.owner(Unicast("login", 1).to_bytes()) is None
    await squatter.register("game01", 5)  # its own names, fixed and dynamic
    await squatter.register("game01")
    await still_usable(squatter)
    owner = await connector(network, broker, "login")
    as_user(owner, {"register": ["login"]}, "login")
    assert await owner.register("login", 1) == Unicast("login", 1).to_bytes()


async def test_a_denied_join_is_refused_and_an_allowed_one_is_taken(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a")
    client = await connector(network, broker)
    as_user(client, {"register": ["*"], "join": ["multicast:chat*"]})
    member = await client.register("game01")
    refused = await client.ask(ControlType.JOIN, Membership(member=member, group=ADMIN))
    assert denied(refused) == (
        "permission denied: user 'game' may not join multicast:admin (permissions.join)"
    )
    assert not broker.routing.is_member(member, ADMIN)
    await client.join(member, CHAT)
    assert broker.routing.is_member(member, CHAT)
    await still_usable(client)


async def test_stat_and_drain_take_their_operator_rights(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a")
    operator = connect_client(network, broker, "ops")
    await operator.hello(ROLE_OPERATOR)
    as_user(operator, {"operator": ["stat"]}, "ops")
    brief = await operator.ask(ControlType.STAT, StatRequest(detail=False))
    assert isinstance(brief.body, Stats)
    detailed = await operator.ask(ControlType.STAT, StatRequest(detail=True))
    assert "may not use the operator right 'stat-detail'" in denied(detailed)
    drain = await operator.ask(ControlType.DRAIN, Drain())
    assert denied(drain) == (
        "permission denied: user 'ops' may not use the operator right 'drain' "
        "(permissions.operator)"
    )
    assert not broker.drain_requested.is_set()
    await still_usable(operator)
    # A connector's link is held to the same rights.
    client = await connector(network, broker)
    as_user(client, {})
    assert "'stat'" in denied(await client.ask(ControlType.STAT, StatRequest(detail=False)))


async def test_stream_requests_take_their_stream_permissions(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a")
    admin = await connector(network, broker, "admin")
    for name in ("scores", "orders"):
        added = await admin.ask(
            ControlType.STREAM, StreamRequest(op="add", stream=name, captures=[CHAT])
        )
        assert isinstance(added.body, StreamReply), describe_frame(added)
    client = await connector(network, broker)
    as_user(client, {"streams": {"read": ["scores"]}})
    fetched = await client.ask(ControlType.STREAM, StreamRequest(op="fetch", stream="scores"))
    assert isinstance(fetched.body, StreamReply), describe_frame(fetched)
    refused = await client.ask(ControlType.STREAM, StreamRequest(op="fetch", stream="orders"))
    assert denied(refused) == (
        "permission denied: user 'game' may not fetch stream 'orders' (permissions.streams.read)"
    )
    for op in ("add", "delete", "consumer_add"):
        request = StreamRequest(op=op, stream="scores", consumer="c")
        assert "(permissions.streams." in denied(await client.ask(ControlType.STREAM, request))
    assert "scores" in broker.streams.members, "not deleted"
    listed = await client.ask(ControlType.STREAM, StreamRequest(op="list"))
    assert isinstance(listed.body, StreamReply)
    assert [s["name"] for s in listed.body.streams] == ["scores"], "only what it may read"
    everything = await admin.ask(ControlType.STREAM, StreamRequest(op="list"))
    assert isinstance(everything.body, StreamReply)
    assert [s["name"] for s in everything.body.streams] == ["orders", "scores"]


async def test_members_and_group_binds_take_the_send_permission(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a")
    client = await connector(network, broker)
    as_user(client, {"register": ["*"], "send": ["multicast:chat"]})
    sender = await client.register("game01")
    members = await client.ask(ControlType.MEMBERS, MembersRequest(group=CHAT))
    assert members.type == ControlType.MEMBER_LIST
    refused = await client.ask(ControlType.MEMBERS, MembersRequest(group=LOGIN_POOL, pick=True))
    assert "may not send to anycast:login (permissions.send)" in denied(refused)
    bind = GroupBind(group=LOGIN_POOL, key=b"k", sender=sender)
    assert "(permissions.send)" in denied(await client.ask(ControlType.GROUP_BIND, bind))


# -- data frames ---------------------------------------------------------------------------


async def chat_room(network: FakeNetwork, broker: Broker) -> FakeClient:
    """A listener in multicast:chat and multicast:admin."""
    listener = await connector(network, broker, "listener")
    address = await listener.register("listener", 1)
    await listener.join(address, CHAT)
    await listener.join(address, ADMIN)
    return listener


async def test_a_denied_send_is_dropped_counted_and_reported_when_asked(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a")
    listener = await chat_room(network, broker)
    client = await connector(network, broker)
    as_user(client, {"register": ["game*"], "send": ["multicast:chat"]})
    me = await client.register("game01")
    client.send_data(CHAT, me, b"hello", msg_id=1)
    client.send_data(ADMIN, me, b"quiet", msg_id=2)
    client.send_data(ADMIN, me, b"quiet", msg_id=3)
    client.send_data(ADMIN, me, b"told", msg_id=4, flags=FLAG_NOTIFY_DROP)
    client.send_data(ADMIN, me, b"reliable", msg_id=5, flags=FLAG_RELIABLE | FLAG_NOTIFY_DROP)
    await network.settle()
    assert [f.payload for f in listener.take_data()] == [b"hello"]
    reports = failures(client)
    assert [r.msg_id for r in reports] == [4, 5], "only the sends that asked"
    for report in reports:
        assert report.code == ErrorCode.PERMISSION_DENIED
        assert report.dst == ADMIN
        assert report.src == me
        assert report.reason == (
            "permission denied: user 'game' may not send to multicast:admin (permissions.send)"
        )
    assert broker.stats.dropped_denied == 4
    assert broker.traffic_counters()["dropped_denied"] == 4, "a drop reason meshbus stat shows"
    await still_usable(client)


async def login_pool(network: FakeNetwork) -> tuple[Broker, FakeClient, bytes, FakeClient]:
    """A broker, a connector with login:1 in anycast:login, and another connector."""
    broker = await start_broker(network, "a")
    server = await connector(network, broker, "server")
    login = await server.register("login", 1)
    await server.join(login, LOGIN_POOL)
    return broker, server, login, await connector(network, broker)


async def test_a_denied_request_gets_no_route_with_permission_denied(
    network: FakeNetwork,
) -> None:
    broker, server, login, client = await login_pool(network)
    as_user(client, {"register": ["game*"], "send": ["*"], "request": ["anycast:login"]})
    me = await client.register("game01")
    client.send_data(LOGIN_POOL, me, b"ok?", msg_id=1, flags=FLAG_REQUEST, timeout_ms=5000)
    for msg_id in (2, 3):  # the second from the cached decision
        client.send_data(login, me, b"no", msg_id=msg_id, flags=FLAG_REQUEST, timeout_ms=5000)
    await network.settle()
    assert [f.msg_id for f in server.take_data()] == [1]
    reports = failures(client)
    assert [r.msg_id for r in reports] == [2, 3]
    assert reports[0].code == ErrorCode.PERMISSION_DENIED
    assert reports[0].reason == (
        "permission denied: user 'game' may not send requests to login:1 (permissions.request)"
    )
    assert len(broker.pending) == 1, "a denied request waits for nothing"
    # Answers are never checked: the responder's user may send nothing at all.
    as_user(server, {}, "login")
    server.send_data(me, login, b"yes", msg_id=9, response_for=1, flags=FLAG_RESPONSE)
    await network.settle()
    assert [f.payload for f in client.take_data()] == [b"yes"]


async def test_acks_to_a_unicast_address_pass_and_a_stream_never_stores_one(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a")
    admin = await connector(network, broker, "admin")
    added = await admin.ask(
        ControlType.STREAM, StreamRequest(op="add", stream="chat", captures=[CHAT])
    )
    assert isinstance(added.body, StreamReply)
    stream_member = broker.streams.members["chat"]
    sender = await connector(network, broker, "sender")
    origin = await sender.register("sender", 1)
    receiver = await connector(network, broker, "receiver")
    as_user(receiver, {"register": ["*"]})
    me = await receiver.register("receiver")
    for frame in ack_frames(me, origin, [1, 2]):
        receiver.send(frame)
    for frame in ack_frames(me, stream_member, [1]):
        receiver.send(frame)
    await network.settle()
    assert len(sender.take_data()) == 1, "the ack went through"
    assert broker.streams.store.info("chat").messages == 0
    assert broker.streams.dropped == 1


async def test_a_cached_allowed_destination_is_not_checked_again(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a")
    listener = await chat_room(network, broker)
    client = await connector(network, broker)

    class Counting(Permissions):
        checks = 0

        def may_send(self, dst: bytes) -> bool:
            Counting.checks += 1
            return super().may_send(dst)

    table = {"register": ["*"], "send": ["multicast:chat"]}
    broker_side(client).permissions = Counting.from_table(table, "game")
    me = await client.register("game01")
    for msg_id in range(1, 101):
        client.send_data(CHAT, me, b"x", msg_id=msg_id)
        client.send_data(ADMIN, me, b"x", msg_id=msg_id)
    await network.settle()
    assert len(listener.take_data()) == 100
    assert Counting.checks == 2, "once per destination, denied ones too"
    for msg_id in range(101, 201):
        client.send_data(CHAT, me, b"x", msg_id=msg_id)
    await network.settle()
    assert Counting.checks == 2, "a later read reuses the cached decision"
    await listener.register("other")  # the routing table changes: decided again
    client.send_data(CHAT, me, b"x", msg_id=201)
    await network.settle()
    assert Counting.checks == 3
    assert broker.stats.dropped_denied == 100


async def test_without_permissions_a_link_does_what_it_always_did(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a")
    listener = await chat_room(network, broker)
    client = await connector(network, broker)
    assert broker_side(client).permissions is None
    me = await client.register("login", 2)
    await client.join(me, ADMIN)
    client.send_data(ADMIN, me, b"x", msg_id=1, flags=FLAG_NOTIFY_DROP)
    await network.settle()
    assert [f.payload for f in listener.take_data()] == [b"x"]
    stat = await client.ask(ControlType.STAT, StatRequest(detail=True))
    assert stat.type == ControlType.STATS
    assert broker.stats.dropped_denied == 0
    assert failures(client) == []


@pytest.mark.parametrize(
    ("permission", "request_", "table"),
    [
        ("streams.add", StreamRequest(op="add", stream="fresh", captures=[CHAT]), "add"),
        ("streams.read", StreamRequest(op="info", stream="scores"), "read"),
        (
            "streams.consume",
            StreamRequest(op="consumer_add", stream="scores", consumer="c"),
            "consume",
        ),
        ("streams.delete", StreamRequest(op="delete", stream="scores"), "delete"),
    ],
    ids=["add", "read", "consume", "delete"],
)
async def test_each_stream_permission_is_granted_alone_and_denied_without_it(
    network: FakeNetwork, permission: str, request_: StreamRequest, table: str
) -> None:
    broker = await start_broker(network, "a")
    admin = await connector(network, broker, "admin")
    added = await admin.ask(
        ControlType.STREAM, StreamRequest(op="add", stream="scores", captures=[CHAT])
    )
    assert isinstance(added.body, StreamReply), describe_frame(added)
    without = await connector(network, broker, "without")
    others = [op for op in ("add", "read", "consume", "delete") if op != table]
    as_user(without, {"streams": {op: ["*"] for op in others}})
    assert denied(await without.ask(ControlType.STREAM, request_)).endswith(
        f"(permissions.{permission})"
    )
    with_it = await connector(network, broker, "with")
    # Adding a stream that captures a group also takes the right to join it.
    capture = {"join": ["multicast:chat"]} if table == "add" else {}
    as_user(with_it, {"streams": {table: ["*"]}, **capture})
    granted = await with_it.ask(ControlType.STREAM, request_)
    assert isinstance(granted.body, StreamReply), describe_frame(granted)


async def test_telemetry_streams_are_read_with_the_telemetry_right_alone(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a")
    admin = await connector(network, broker, "admin")
    added = await admin.ask(
        ControlType.STREAM, StreamRequest(op="add", stream="telemetry.a", captures=[CHAT])
    )
    assert isinstance(added.body, StreamReply), describe_frame(added)
    reader = await connector(network, broker, "reader")
    as_user(reader, {"streams": {"read": ["*"]}})
    info = StreamRequest(op="info", stream="telemetry.a")
    assert "'telemetry'" in denied(await reader.ask(ControlType.STREAM, info))
    watcher = await connector(network, broker, "watcher")
    as_user(watcher, {"operator": ["telemetry"]}, "watcher")
    granted = await watcher.ask(ControlType.STREAM, info)
    assert isinstance(granted.body, StreamReply), describe_frame(granted)


async def test_the_send_right_on_a_group_covers_its_members_copies_while_they_are_in_it(
    network: FakeNetwork,
) -> None:
    broker, worker, member, client = await login_pool(network)
    as_user(client, {"register": ["game*"], "send": ["anycast:login"]})
    me = await client.register("game01")
    reliable = FLAG_RELIABLE | FLAG_NOTIFY_DROP | FLAG_EXT

    def copy(msg_id: int, group: bytes = LOGIN_POOL, flags: int = reliable) -> None:
        payload = wrap(Ext(origin=group), b"%d" % msg_id) if flags & FLAG_EXT else b"plain"
        client.send_data(member, me, payload, msg_id=msg_id, flags=flags)

    copy(1, ADMIN)  # a group it may not send to: refused, and not cached as refused
    copy(2)  # the same routing key, for the group: delivered
    copy(3)
    copy(4, flags=FLAG_RELIABLE | FLAG_NOTIFY_DROP)  # not for any group: refused
    await network.settle()
    assert [f.msg_id for f in worker.take_data()] == [2, 3]
    assert [(r.msg_id, r.code) for r in failures(client)] == [
        (1, ErrorCode.PERMISSION_DENIED),
        (4, ErrorCode.PERMISSION_DENIED),
    ]
    # The member leaves the group: its next copy is a stale route, not a refusal (the
    # sender may send to the group, and asks it for a member again).
    worker.send_control(ControlType.LEAVE, Membership(member=member, group=LOGIN_POOL))
    await network.settle()
    copy(5)
    await network.settle()
    assert worker.take_data() == []
    assert [(r.msg_id, r.code, r.reason) for r in failures(client)] == [
        (5, 0, "the route went stale")
    ]
    assert broker.stats.dropped_denied == 2
