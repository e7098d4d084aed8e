"""Meshbus services on subjects, the broker's side (meshbus.broker.nats.services), with
raw connectors on the fake network: SUBSCRIBE and UNSUBSCRIBE checked field by field
and answered for that request alone, the interest told to the peers and taken back when
the service unregisters or its link closes, a message to ``SUBJECTS`` routed to the
subscribers with its subject, and permissions read for subjects."""

from __future__ import annotations

from meshbus.address import SUBJECTS, Multicast, Unicast
from meshbus.auth import Credentials
from meshbus.broker.security.users import UserTable
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame, DataFrame
from meshbus.protocol.control import AddressBody, Empty, Error, Register, SubjectInterest
from meshbus.protocol.ext import Ext, split, wrap
from meshbus.protocol.layout import FLAG_EXT, ControlType, ErrorCode
from meshbus.protocol.nats import Publish
from meshbus.protocol.subjects import MAX_SUBJECT
from meshbus.testing import FakeClient, FakeNetwork, build_mesh, connector, describe_frame
from meshbus.testing import start_broker as start_fake_broker
from tests.unit.broker.security.test_quotas_enforced import BROKER_A, signed_in, user


async def subscribe(
    client: FakeClient, member: bytes, subject: bytes, queue: bytes = b""
) -> ControlFrame:
    body = SubjectInterest(member=member, subject=subject, queue=queue)
    return await client.ask(ControlType.SUBSCRIBE, body)


def refused(frame: ControlFrame) -> Error:
    assert isinstance(frame.body, Error), describe_frame(frame)
    return frame.body


def interest_at(broker: Broker, subject: bytes) -> int:
    """How many subscriptions ``broker``'s subject table gives a message on ``subject``."""
    return len(broker.subjects.match(subject).plain)


def messages(client: FakeClient) -> list[tuple[bytes, bytes, bytes]]:
    """(dst, subject, payload) of each data frame ``client`` got."""
    got = []
    for frame in client.take_data():
        assert isinstance(frame, DataFrame)
        assert frame.flags & FLAG_EXT
        block, payload = split(frame.payload)
        got.append((frame.dst, block.subject, payload))
    return got


def publish(client: FakeClient, src: bytes, subject: bytes, payload: bytes) -> None:
    client.send_data(SUBJECTS, src, wrap(Ext(subject=subject), payload), flags=FLAG_EXT)


async def test_a_bad_request_is_refused_alone(network: FakeNetwork) -> None:
    broker = await start_fake_broker(network, "a")
    client = await connector(network, broker)
    svc = await client.register()
    for subject, queue in [(b"a..b", b""), (b"a.>.b", b""), (b"a b", b""), (b"a", b"q q")]:
        assert (
            refused(await subscribe(client, svc, subject, queue)).code == ErrorCode.INVALID_SUBJECT
        )
    other = Multicast("not-mine").to_bytes()
    assert refused(await subscribe(client, other, b"a")).code == ErrorCode.NOT_REGISTERED
    # The link goes on: a good one is taken.
    assert (await subscribe(client, svc, b"game.*.chat")).type == ControlType.OK
    assert interest_at(broker, b"game.eu.chat") == 1


async def test_interest_reaches_the_peers_and_goes_with_its_service(network: FakeNetwork) -> None:
    a, b = await build_mesh(network, 2)
    client = await connector(network, b, synced=True)
    client.send_control(ControlType.REGISTER, Register(server="svc"))
    await network.settle()
    (registered, _) = client.take()
    assert isinstance(registered, ControlFrame)
    assert isinstance(registered.body, AddressBody)
    svc = registered.body.address
    client.send_control(ControlType.SUBSCRIBE, SubjectInterest(member=svc, subject=b"game.>"))
    await network.settle()
    answers = [f.type for f in client.take() if isinstance(f, ControlFrame)]
    assert answers == [ControlType.OK, ControlType.SYNCED]  # SYNCED: a holds it
    assert interest_at(a, b"game.x.y") == 1
    client.send_control(ControlType.UNREGISTER, AddressBody(address=svc))
    await network.settle()
    assert interest_at(a, b"game.x.y") == 0
    assert interest_at(b, b"game.x.y") == 0

    client.send_control(ControlType.REGISTER, Register(server="svc"))
    await network.settle()
    again = next(f.body.address for f in client.take() if isinstance(f.body, AddressBody))
    client.send_control(ControlType.SUBSCRIBE, SubjectInterest(member=again, subject=b"game.>"))
    await network.settle()
    assert interest_at(a, b"game.x.y") == 1
    client.close()
    await network.settle()
    assert interest_at(a, b"game.x.y") == 0
    assert b.service_subjects.subscriptions == 0


async def test_a_message_to_subjects_reaches_the_subscribers_once(network: FakeNetwork) -> None:
    a, b = await build_mesh(network, 2)
    here, there = await connector(network, a, "here"), await connector(network, b, "there")
    pub, near = await here.register(), await here.register()
    far = await there.register()
    await subscribe(here, near, b"x.*")
    await subscribe(there, far, b"x.*")
    await subscribe(there, far, b"x.>")  # matches too: still one copy
    await network.settle()
    here.take()
    there.take()
    publish(here, pub, b"x.long-enough-to-be-no-group-name", b"hi")
    await network.settle()
    subject = b"x.long-enough-to-be-no-group-name"
    assert messages(here) == [(near, subject, b"hi")]
    assert messages(there) == [(far, subject, b"hi")]
    # What no connector of this version sends is dropped and counted, the link kept.
    publish(here, pub, b"x.*", b"a wildcard")
    here.send_data(SUBJECTS, pub, b"no block")
    await network.settle()
    assert messages(there) == []
    assert a.service_subjects.stats.dropped == 2
    assert (await here.ask(ControlType.PING, Empty())).type == ControlType.PONG


async def test_permissions_are_read_for_subjects(network: FakeNetwork) -> None:
    """``join`` of ``multicast:S`` permits subscribing to S, ``send`` publishing to it."""
    dave = Credentials.generate("dave")
    permissions = {
        "register": ["*"],
        "join": ["multicast:game.*"],
        "send": ["multicast:game.*"],
    }
    broker = await start_fake_broker(
        network, "a", users=UserTable([user(dave, permissions)]), broker_key=BROKER_A
    )
    client = await signed_in(network, broker, dave)
    svc = await client.register()
    assert (await subscribe(client, svc, b"game.>")).type == ControlType.OK
    denied = refused(await subscribe(client, svc, b"admin.>"))
    assert denied.code == ErrorCode.PERMISSION_DENIED
    assert "may not subscribe to subject 'admin.>' (permissions.join)" in denied.message
    publish(client, svc, b"admin.reset", b"no")
    await network.settle()
    assert broker.service_subjects.stats.dropped == 1
    publish(client, svc, b"game.start", b"yes")
    await network.settle()
    assert broker.service_subjects.stats.published == 1


async def test_a_subject_too_long_for_a_frame_is_not_sent_to_services(
    network: FakeNetwork,
) -> None:
    """A message on a subject longer than a service's frames carry (a NATS client's,
    say) matched by ``>`` is dropped for the service and counted, not sent broken."""
    broker = await start_fake_broker(network, "a")
    client = await connector(network, broker)
    svc = await client.register()
    await subscribe(client, svc, b">")
    client.take()
    broker.nats_router.route(Publish(b"s" * (MAX_SUBJECT + 1), b"", 0, b"x"))
    await network.settle()
    assert client.take_data() == []
    assert broker.service_subjects.stats.dropped == 1


async def test_a_service_taken_to_another_broker_is_no_subscriber_here(
    network: FakeNetwork,
) -> None:
    """A connector that moved its service to broker b (same session, a later link) and
    subscribed there gets each message once, through b: the subscription its old link
    still held at a ends when a finds the address owned by b."""
    a, b = await build_mesh(network, 2)
    session = b"s" * 16
    old = await connector(network, a, "old", session=session, epoch=0)
    svc = await old.register()
    await subscribe(old, svc, b"t.>")
    new = await connector(network, b, "new", session=session, epoch=1)
    address = Unicast.from_bytes(svc)
    assert await new.register(address.server, address.instance) == svc
    await subscribe(new, svc, b"t.>")
    await network.settle()
    pub = await connector(network, a, "pub")
    src = await pub.register()
    old.take()
    new.take()
    publish(pub, src, b"t.x", b"once")
    publish(pub, src, b"t.y", b"again")
    await network.settle()
    assert old.take_data() == []
    assert messages(new) == [(svc, b"t.x", b"once"), (svc, b"t.y", b"again")]
    assert a.service_subjects.subscriptions == 0


async def test_a_queue_group_of_services_gets_each_message_once(network: FakeNetwork) -> None:
    a, b = await build_mesh(network, 2)
    here, there = await connector(network, a, "here"), await connector(network, b, "there")
    members = [(here, await here.register()), (there, await there.register())]
    for client, member in members:
        await subscribe(client, member, b"jobs.*", b"workers")
    await network.settle()
    pub = await connector(network, a, "pub")
    src = await pub.register()
    for client, _ in members:
        client.take()
    for i in range(40):
        publish(pub, src, b"jobs.%d" % i, b"job")
    await network.settle()
    got = [len(messages(client)) for client, _ in members]
    assert sum(got) == 40
    assert all(got), f"each member gets some: {got}"
