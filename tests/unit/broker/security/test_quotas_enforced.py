"""Per-user quotas on the fake network (docs/security.md, "Per-user quotas"): each is
the sum over all the user's links, refused at N+1 with LIMIT_EXCEEDED naming the user
and its [[users]] key, while another user goes on; and a user with no use for an
operator link gets none."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from meshbus.address import Multicast
from meshbus.auth import Credentials, public_key_from_text, users_entry
from meshbus.broker.security.permissions import Permissions
from meshbus.broker.security.quotas import Quotas
from meshbus.broker.security.users import User, UserTable
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import (
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    Challenge,
    DeliveryFailure,
    Error,
    Hello,
    Membership,
    Register,
    StreamReply,
    StreamRequest,
    Welcome,
)
from meshbus.protocol.handshake import sign_in_message
from meshbus.protocol.layout import FLAG_REQUEST, FLAG_RESPONSE, ControlType, ErrorCode
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import StreamConfig
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    broker_side,
    connect_client,
    describe_frame,
    start_broker,
)

ALICE, BOB, CAROL, STREAMER = (
    Credentials.generate(name) for name in ("alice", "bob", "carol", "streamer")
)
BROKER_A = Credentials.generate("a")
EVERYTHING = tomllib.loads(users_entry("x", allow_all=True))["users"][0]["permissions"]
SMALL = Quotas(connections=3, services=4, memberships=3, requests=2, stream_bytes=1000)


def user(creds: Credentials, permissions: dict[str, Any], quotas: Quotas | None = None) -> User:
    assert creds.public_key is not None
    return User(
        creds.user,
        public_key=public_key_from_text(creds.public_key),
        permissions=Permissions.from_table(permissions, creds.user),
        quotas=quotas or Quotas(),
    )


def users(alice: Quotas = SMALL) -> UserTable:
    """alice (small quotas), bob (the defaults), carol (no permissions at all), streamer
    (stream permissions only)."""
    return UserTable(
        [
            user(ALICE, EVERYTHING, alice),
            user(BOB, EVERYTHING),
            user(CAROL, {}),
            user(STREAMER, {"streams": {"read": ["*"]}}),
        ]
    )


async def quota_broker(network: FakeNetwork) -> Broker:
    return await start_broker(network, "a", users=users(), broker_key=BROKER_A)


async def sign_in(
    network: FakeNetwork, broker: Broker, creds: Credentials, role: str = ROLE_CONNECTOR
) -> tuple[FakeClient, ControlFrame]:
    """A client that said HELLO as ``creds``'s user and answered the CHALLENGE; and the
    broker's answer to its AUTH (WELCOME, or the ERROR of a refusal)."""
    client = connect_client(network, broker, f"{creds.user}-app")
    client.send_control(ControlType.HELLO, Hello(role=role, name=client.name), 3)
    await network.settle()
    (challenge,) = client.take()
    assert isinstance(challenge, ControlFrame)
    assert isinstance(challenge.body, Challenge), describe_frame(challenge)
    auth = creds.answer(sign_in_message(challenge.body.nonce))
    client.send(encode_control(ControlType.AUTH, auth, 3))
    await network.settle()
    (answer,) = client.take()
    assert isinstance(answer, ControlFrame)
    return client, answer


async def signed_in(
    network: FakeNetwork, broker: Broker, creds: Credentials, role: str = ROLE_CONNECTOR
) -> FakeClient:
    client, answer = await sign_in(network, broker, creds, role)
    assert isinstance(answer.body, Welcome), describe_frame(answer)
    return client


def refusal(frame: ControlFrame) -> Error:
    assert isinstance(frame.body, Error), describe_frame(frame)
    return frame.body


def over_quota(frame: ControlFrame, key: str) -> str:
    error = refusal(frame)
    assert error.code == ErrorCode.LIMIT_EXCEEDED, describe_frame(frame)
    assert f"(quotas.{key} of its [[users]] entry" in error.message, error.message
    assert "user 'alice'" in error.message, error.message
    return error.message


async def test_a_users_links_past_its_connections_quota_are_refused(
    network: FakeNetwork,
) -> None:
    broker = await quota_broker(network)
    links = [await signed_in(network, broker, ALICE) for _ in range(2)]
    links.append(await signed_in(network, broker, ALICE, ROLE_OPERATOR))  # operators count
    fourth, answer = await sign_in(network, broker, ALICE)
    message = over_quota(answer, "connections")
    assert "already has 3 links open to this broker, and its quota is 3" in message
    assert fourth.closed
    await signed_in(network, broker, BOB)  # another user still gets in
    links[0].close()  # a closed link gives its connection back
    await network.settle()
    await signed_in(network, broker, ALICE)


async def test_services_and_memberships_count_over_all_the_users_links(
    network: FakeNetwork,
) -> None:
    broker = await quota_broker(network)
    first, second = [await signed_in(network, broker, ALICE) for _ in range(2)]
    addresses = [await first.register("a"), await first.register("a")]
    addresses += [await second.register("b"), await second.register("b")]
    fifth = await second.ask(ControlType.REGISTER, Register(server="b"))
    assert "4 services registered" in over_quota(fifth, "services")
    await first.join(addresses[0], Multicast("g1").to_bytes())
    for group in ("g2", "g3"):
        await second.join(addresses[2], Multicast(group).to_bytes())
    fourth = await first.ask(
        ControlType.JOIN, Membership(member=addresses[0], group=Multicast("g4").to_bytes())
    )
    assert "3 group memberships" in over_quota(fourth, "memberships")
    bob = await signed_in(network, broker, BOB)
    await bob.register("bob")  # the quota is alice's
    await first.unregister(addresses[1])  # room again
    await first.register("a")
    assert broker.usage.used("alice", "services") == 4


async def test_requests_waiting_count_over_all_the_users_links(network: FakeNetwork) -> None:
    broker = await quota_broker(network)
    bob = await signed_in(network, broker, BOB)
    answering = await bob.register("server", 1)
    first, second = [await signed_in(network, broker, ALICE) for _ in range(2)]
    one, two = await first.register("asker"), await second.register("asker")
    for client, asking, msg_id in ((first, one, 1), (second, two, 2), (first, one, 3)):
        client.send_data(
            answering, asking, b"?", msg_id=msg_id, flags=FLAG_REQUEST, timeout_ms=9000
        )
        await network.settle()
    assert [f.msg_id for f in bob.take_data()] == [1, 2], "the third not forwarded"
    (refused,) = first.take(ControlType.NO_ROUTE)
    assert isinstance(refused, ControlFrame)
    assert isinstance(refused.body, DeliveryFailure)
    assert refused.body.msg_id == 3
    assert "(quotas.requests of its [[users]] entry" in refused.body.reason
    # A response makes room.
    bob.send_data(two, answering, b"!", msg_id=9, response_for=2, flags=FLAG_RESPONSE)
    first.send_data(answering, one, b"?", msg_id=4, flags=FLAG_REQUEST, timeout_ms=9000)
    await network.settle()
    assert [f.msg_id for f in bob.take_data()] == [4]
    assert broker.usage.used("alice", "requests") == 2


async def test_stream_bytes_are_the_max_bytes_of_the_streams_the_user_added(
    network: FakeNetwork,
) -> None:
    broker = await quota_broker(network)
    alice = await signed_in(network, broker, ALICE)

    async def add(name: str, max_bytes: int) -> ControlFrame:
        request = StreamRequest(op="add", stream=name, max_bytes=max_bytes)
        return await alice.ask(ControlType.STREAM, request)

    assert isinstance((await add("s1", 600)).body, StreamReply)
    assert isinstance((await add("s1", 600)).body, StreamReply), "the same stream again"
    message = over_quota(await add("s2", 500), "stream_bytes")
    assert "already has 600 bytes of streams" in message
    assert isinstance((await add("s2", 400)).body, StreamReply)
    deleted = await alice.ask(ControlType.STREAM, StreamRequest(op="delete", stream="s1"))
    assert isinstance(deleted.body, StreamReply)
    assert broker.usage.used("alice", "stream_bytes") == 400


async def test_a_users_streams_read_back_at_start_count_against_its_quota(
    network: FakeNetwork, tmp_path: Path
) -> None:
    """A broker that starts on a store holding alice's stream (a restart) counts its
    max_bytes against her stream_bytes, as the add did: a restart is no way past a quota."""
    store = SqliteStreamStore(tmp_path / "streams.db")
    store.add_stream(StreamConfig(name="kept", captures=(), max_bytes=700, owner="alice"))
    store.add_stream(StreamConfig(name="nobodys", captures=(), max_bytes=900))
    store.close()
    broker = await start_broker(
        network, "a", users=users(), broker_key=BROKER_A, data_dir=str(tmp_path)
    )
    try:
        assert broker.usage.used("alice", "stream_bytes") == 700
        alice = await signed_in(network, broker, ALICE)
        request = StreamRequest(op="add", stream="more", max_bytes=400)
        message = over_quota(await alice.ask(ControlType.STREAM, request), "stream_bytes")
        assert "already has 700 bytes of streams" in message
        deleted = await alice.ask(ControlType.STREAM, StreamRequest(op="delete", stream="kept"))
        assert isinstance(deleted.body, StreamReply)
        assert broker.usage.used("alice", "stream_bytes") == 0
    finally:
        await broker.stop()  # gives back the data directory's lock and the store


async def test_a_user_with_no_use_for_an_operator_link_gets_none(network: FakeNetwork) -> None:
    broker = await quota_broker(network)
    client, answer = await sign_in(network, broker, CAROL, ROLE_OPERATOR)
    error = refusal(answer)
    assert error.code == ErrorCode.PERMISSION_DENIED
    assert error.message == (
        "permission denied: user 'carol' may not open an operator link: it has no operator "
        "right (permissions.operator) and no stream permission (permissions.streams) in the "
        "broker's config"
    )
    assert client.closed
    assert len(broker.links.operators) == 0
    await signed_in(network, broker, CAROL)  # a connector's link it may open
    await signed_in(network, broker, STREAMER, ROLE_OPERATOR)  # the stream commands' link
    await signed_in(network, broker, BOB, ROLE_OPERATOR)


async def test_a_reload_that_lowers_a_quota_keeps_what_the_user_holds(
    network: FakeNetwork,
) -> None:
    lowered = [users()]
    broker = await start_broker(
        network, "a", users=users(), broker_key=BROKER_A, reread_users=lambda: lowered[0]
    )
    first, second = [await signed_in(network, broker, ALICE) for _ in range(2)]
    lowered[0] = users(Quotas(connections=1))
    broker.sign_in.reload()
    await network.settle()
    assert not first.closed, "held links are kept"
    assert not second.closed
    _, answer = await sign_in(network, broker, ALICE)
    assert "its quota is 1" in over_quota(answer, "connections")
    assert broker.usage.used("alice", "connections") == 2
    assert broker_side(first).user == "alice"


async def test_stat_shows_each_configured_users_usage_and_quotas(network: FakeNetwork) -> None:
    broker = await quota_broker(network)
    alice = await signed_in(network, broker, ALICE)
    await alice.register("a")
    shown = broker.stat.brief()["users"]
    assert set(shown) == {"alice", "bob", "carol", "streamer"}
    assert shown["alice"]["connections"] == {"used": 1, "quota": 3}
    assert shown["alice"]["services"] == {"used": 1, "quota": 4}
    assert shown["bob"]["services"] == {"used": 0, "quota": 100_000}
    assert shown["bob"]["stream_bytes"] == {"used": 0, "quota": None}


async def test_without_users_there_are_no_quotas(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a")
    for _ in range(5):
        client = connect_client(network, broker, "anon")
        await client.hello(ROLE_OPERATOR)
    assert broker.stat.brief()["users"] == {}
