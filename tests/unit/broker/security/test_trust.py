"""The mesh trusts only its brokers, on the fake network: brokers with keys link and route
as before; a process that says it is a broker without proving it gets nothing of the mesh
-- no WELCOME, no routes, no broker list -- and replaces no link; a broker with a key the
mesh does not list, or one that does not prove itself, is not linked to."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature

from meshbus.auth import Credentials, public_key_from_text
from meshbus.broker.config import BrokerConfig
from meshbus.broker.mesh.membership import MeshJoinError
from meshbus.broker.security.users import User, UserTable
from meshbus.broker.server import Broker
from meshbus.errors import InvalidArgument
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import NONCE_SIZE, ROLE_BROKER, Challenge, Error, Hello
from meshbus.protocol.handshake import broker_proof_message, sign_in_message
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import (
    FakeClient,
    FakeNetwork,
    address_of,
    connect_client,
    connector,
    describe_frame,
    routes_everywhere,
    start_broker,
)

KEYS = {name: Credentials.generate(name) for name in ("a", "b", "c")}
NONCE = bytes(range(NONCE_SIZE))


def brokers_table(*names: str) -> UserTable:
    """[[brokers]] listing ``names`` with their keys of ``KEYS``."""
    listed = []
    for name in names:
        text = KEYS[name].public_key
        assert text is not None
        listed.append(User(name, public_key=public_key_from_text(text)))
    return UserTable(listed)


async def trusting(
    network: FakeNetwork, name: str, *, key: Credentials | None = None, **settings: Any
) -> Broker:
    """A broker whose [[brokers]] are a, b and c, with its key (``KEYS[name]`` unless
    given)."""
    settings.setdefault("brokers", brokers_table("a", "b", "c"))
    return await start_broker(network, name, broker_key=key or KEYS[name], **settings)


async def trusting_mesh(network: FakeNetwork) -> list[Broker]:
    first = await trusting(network, "a")
    rest = [await trusting(network, n, seeds=[address_of("a")]) for n in ("b", "c")]
    return [first, *rest]


async def broker_hello(client: FakeClient, name: str, nonce: bytes = NONCE) -> None:
    client.send_control(ControlType.HELLO, Hello(role=ROLE_BROKER, name=name, nonce=nonce), 1)
    await client.network.settle()


async def test_brokers_that_prove_themselves_form_a_mesh_and_share_routes(
    network: FakeNetwork,
) -> None:
    brokers = await trusting_mesh(network)
    for broker in brokers:
        assert sorted(broker.peers.names()) == sorted({"a", "b", "c"} - {broker.config.name})
        assert broker.stat.brief()["mesh_trust"] is True
    client = await connector(network, brokers[2])
    address = await client.register("svc", 5)
    assert routes_everywhere(brokers, address) == {"a": "c", "b": "c", "c": "local"}


async def test_a_broker_hello_without_a_nonce_gets_one_error_and_nothing_else(
    network: FakeNetwork,
) -> None:
    broker = await trusting(network, "a")
    client = connect_client(network, broker)
    await broker_hello(client, "b", nonce=b"")
    (frame,) = client.take()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error), describe_frame(frame)
    assert frame.body.code == ErrorCode.AUTH_FAILED
    assert "--broker-key" in frame.body.message
    assert client.closed
    assert broker.peers.names() == []


async def test_a_brokers_challenge_proves_it_and_waits_for_the_dialler_to(
    network: FakeNetwork,
) -> None:
    broker = await trusting(network, "a")
    client = connect_client(network, broker)
    await broker_hello(client, "b")
    (frame,) = client.take()  # a CHALLENGE: no WELCOME, no BROKERS, no ROUTES
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Challenge), describe_frame(frame)
    assert frame.body.broker == "a"
    key = public_key_from_text(KEYS["a"].public_key or "")
    key.verify(frame.body.proof, broker_proof_message(NONCE, "b"))
    with pytest.raises(InvalidSignature):  # bound to the name the dialler claimed
        key.verify(frame.body.proof, broker_proof_message(NONCE, "c"))
    assert len(broker.links.handshaking) == 1  # the handshake timeout still runs for it
    assert broker.peers.names() == []


async def test_a_hello_in_a_linked_brokers_name_with_another_key_replaces_nothing(
    network: FakeNetwork,
) -> None:
    a, b, _ = await trusting_mesh(network)
    link_to_b = a.peers.get("b")
    client = connect_client(network, a, "impostor")
    await broker_hello(client, "b")
    (frame,) = client.take()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Challenge)
    forged = Credentials.generate("b").answer(sign_in_message(frame.body.nonce))
    client.send(encode_control(ControlType.AUTH, forged, 1))
    await network.settle()
    (refusal,) = client.take()
    assert isinstance(refusal, ControlFrame)
    assert isinstance(refusal.body, Error), describe_frame(refusal)
    assert refusal.body.code == ErrorCode.AUTH_FAILED
    assert client.closed
    assert a.peers.get("b") is link_to_b
    assert link_to_b is not None
    assert not link_to_b.closed
    # Traffic still crosses the real link.
    sender, receiver = await connector(network, a, "s"), await connector(network, b, "r")
    source = await sender.register("s", 1)
    target = await receiver.register("r", 1)
    sender.send_data(target, source, b"still linked")
    await network.settle()
    assert [f.payload for f in receiver.take_data()] == [b"still linked"]


async def test_a_broker_whose_key_the_mesh_does_not_list_cannot_join(
    network: FakeNetwork,
) -> None:
    a = await trusting(network, "a", brokers=brokers_table("a", "b"))
    with pytest.raises(MeshJoinError, match="did not prove itself with a key"):
        await trusting(network, "c", seeds=[address_of("a")])
    assert a.peers.names() == []


async def test_a_trusting_broker_does_not_link_to_one_that_welcomes_without_a_proof(
    network: FakeNetwork,
) -> None:
    plain = await start_broker(network, "a")
    service = await (await connector(network, plain)).register("secret", 1)
    with pytest.raises(MeshJoinError, match="without proving itself"):
        await trusting(network, "b", seeds=[address_of("a")])
    await network.settle()
    # The plain broker took the dial for a link and sent its WELCOME and routes; the
    # trusting one closed it at once, having sent nothing after its HELLO.
    assert plain.peers.names() == []
    assert not any(w.labels == ("b:1", "a:1") and not w.broken for w in network.wires)
    assert routes_everywhere([plain], service) == {"a": "local"}


async def test_a_broker_with_users_and_no_brokers_refuses_every_peer(
    network: FakeNetwork,
) -> None:
    alice = Credentials.generate("alice")
    users = UserTable([User("alice", public_key=public_key_from_text(alice.public_key or ""))])
    a = await start_broker(network, "a", users=users, broker_key=KEYS["a"])
    assert a.stat.brief()["mesh_trust"] is True
    with pytest.raises(MeshJoinError, match=r"lists no \[\[brokers\]\]"):
        await trusting(network, "b", seeds=[address_of("a")])
    assert a.peers.names() == []


async def test_without_trust_a_broker_takes_any_peer_as_before(network: FakeNetwork) -> None:
    a = await start_broker(network, "a")
    assert a.stat.brief()["mesh_trust"] is False
    client = connect_client(network, a)
    welcome = await client.hello(ROLE_BROKER, name="x")
    assert welcome.broker == "a"


def test_a_trusting_broker_needs_its_key_and_a_key_for_its_name() -> None:
    with pytest.raises(InvalidArgument, match="--broker-key"):
        Broker(BrokerConfig(brokers=brokers_table("a")))
    token = Credentials("a", token="t")
    with pytest.raises(InvalidArgument, match="holds a token"):
        Broker(BrokerConfig(brokers=brokers_table("a"), broker_key=token))
    broker = Broker(BrokerConfig(brokers=brokers_table("a", "b"), broker_key=KEYS["a"]))
    with pytest.raises(InvalidArgument, match="give --name a"):
        broker.trust.check_name("b")
    other = Broker(BrokerConfig(brokers=brokers_table("a"), broker_key=Credentials.generate("a")))
    with pytest.raises(InvalidArgument, match="is not the public_key"):
        other.trust.check_name("a")
