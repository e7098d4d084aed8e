"""The broker's side of the sign-in, on the fake network: what it decides only after the
AUTH passed, what it records, and the frames pipelined behind an AUTH (key pairs; tokens,
checked in a worker thread, are in tests/integration/test_auth.py)."""

from __future__ import annotations

import tomllib

from meshbus.auth import Credentials, public_key_from_text, users_entry
from meshbus.broker.security.permissions import Permissions
from meshbus.broker.security.users import User, UserTable
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import (
    ROLE_OPERATOR,
    AddressBody,
    Challenge,
    Error,
    Hello,
    Register,
    Welcome,
)
from meshbus.protocol.handshake import sign_in_message
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    broker_side,
    connect_client,
    connector,
    describe_frame,
    start_broker,
)

ALICE = Credentials.generate("alice")
# A broker with users trusts only its brokers, and proves itself with a key of its own.
BROKER_A = Credentials.generate("a")


def users() -> UserTable:
    assert ALICE.public_key is not None
    everything = tomllib.loads(users_entry("alice", allow_all=True))["users"][0]["permissions"]
    return UserTable(
        [
            User(
                "alice",
                public_key=public_key_from_text(ALICE.public_key),
                permissions=Permissions.from_table(everything, "alice"),
            )
        ]
    )


async def challenged(
    network: FakeNetwork, broker: Broker, role: str = "connector"
) -> tuple[FakeClient, bytes]:
    """A client that said HELLO, and the nonce of the CHALLENGE, the broker's one answer."""
    client = connect_client(network, broker, "alice-app")
    client.send_control(ControlType.HELLO, Hello(role=role, name="alice-app"), 3)
    await network.settle()
    (frame,) = client.take()
    assert isinstance(frame, ControlFrame)
    assert frame.type == ControlType.CHALLENGE, describe_frame(frame)
    assert isinstance(frame.body, Challenge)
    return client, frame.body.nonce


def auth_frame(nonce: bytes) -> bytes:
    return encode_control(ControlType.AUTH, ALICE.answer(sign_in_message(nonce)), 3)


async def test_frames_behind_the_auth_are_handled_after_the_welcome_as_the_user(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a", users=users(), broker_key=BROKER_A)
    client, nonce = await challenged(network, broker)
    link = broker_side(client)
    assert link in broker.links.handshaking  # the handshake timeout still runs
    register = encode_control(ControlType.REGISTER, Register(server="svc"), 4)
    client.send(auth_frame(nonce) + register)  # pipelined in one write
    await network.settle()
    welcome, registered = client.take()
    assert isinstance(welcome, ControlFrame)
    assert isinstance(welcome.body, Welcome), describe_frame(welcome)
    assert welcome.correlation == 3
    assert isinstance(registered, ControlFrame)
    assert isinstance(registered.body, AddressBody), describe_frame(registered)
    assert link.user == "alice"
    assert link not in broker.links.handshaking


async def test_a_full_broker_redirects_only_after_the_sign_in(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a", users=users(), broker_key=BROKER_A, max_connectors=1)
    first, nonce = await challenged(network, broker)
    first.send(auth_frame(nonce))
    await network.settle()
    assert isinstance(first.take()[0], ControlFrame)

    second, nonce = await challenged(network, broker)  # a CHALLENGE, not yet the REDIRECT
    second.send(auth_frame(nonce))
    await network.settle()
    (frame,) = second.take()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.REDIRECT
    assert second.closed


async def test_the_operator_limit_is_decided_after_the_sign_in(network: FakeNetwork) -> None:
    broker = await start_broker(network, "a", users=users(), broker_key=BROKER_A, max_operators=1)
    first, nonce = await challenged(network, broker, ROLE_OPERATOR)
    first.send(auth_frame(nonce))
    second, nonce = await challenged(network, broker, ROLE_OPERATOR)
    second.send(auth_frame(nonce))
    await network.settle()
    (frame,) = second.take()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.LIMIT_EXCEEDED
    assert broker_side(first).user == "alice"


async def test_without_users_nobody_is_challenged_and_no_user_is_recorded(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a")
    client = await connector(network, broker)
    assert broker_side(client).user is None


MALLORY = Credentials.generate("mallory")
SESSION = bytes(range(16))


async def signed_in(network: FakeNetwork, broker: Broker, who: Credentials) -> FakeClient:
    """A connector of session ``SESSION`` signed in as ``who``."""
    client = connect_client(network, broker, who.user)
    client.send_control(ControlType.HELLO, Hello(name=who.user, session=SESSION), 3)
    await network.settle()
    (frame,) = client.take()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Challenge), describe_frame(frame)
    client.send(encode_control(ControlType.AUTH, who.answer(sign_in_message(frame.body.nonce)), 3))
    await network.settle()
    (welcome,) = client.take()
    assert isinstance(welcome, ControlFrame)
    assert isinstance(welcome.body, Welcome), describe_frame(welcome)
    return client


async def test_a_session_is_its_users_so_another_user_replaying_it_takes_nothing(
    network: FakeNetwork,
) -> None:
    everything = tomllib.loads(users_entry("x", allow_all=True))["users"][0]["permissions"]
    table = UserTable(
        User(
            who.user,
            public_key=public_key_from_text(who.public_key or ""),
            permissions=Permissions.from_table(everything, who.user),
        )
        for who in (ALICE, MALLORY)
    )
    broker = await start_broker(network, "a", users=table, broker_key=BROKER_A)
    alice = await signed_in(network, broker, ALICE)
    address = await alice.register("login", 1)
    alice_again = await signed_in(network, broker, ALICE)  # her failover: takes it back
    assert await alice_again.register("login", 1) == address
    mallory = await signed_in(network, broker, MALLORY)
    frame = await mallory.ask(ControlType.REGISTER, Register(server="login", instance=1))
    assert isinstance(frame.body, Error), describe_frame(frame)
    assert frame.body.code == ErrorCode.ADDRESS_IN_USE
    assert broker.routing.owner(address) is broker_side(alice_again)
    assert broker_side(mallory).session != broker_side(alice_again).session
    assert len(broker_side(mallory).session) == len(SESSION)
