"""The Postina verbs on a two-broker mesh: publish/subscribe/unsubscribe on subjects,
reliable publish and priority, broadcast, subscribe_other/unsubscribe_other, listeners
and NoQueue, JoinFailed.

A service that must *not* get a message is checked with a marker: the sender sends it
afterwards on the same path, and it must be the very next message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

import meshbus
from meshbus.errors import JoinFailed, NoQueue
from tests.conftest import BrokerProcess, start_mesh, stop_all
from tests.integration.helpers import IO_TIMEOUT, assert_next_is, wait_members, wait_until


@dataclass
class Bus:
    """A publisher ``pub`` and ``s1`` on broker A (one connector); ``s2`` and ``s3`` on
    broker B (one connector); ``s4`` on broker B (a connector of its own)."""

    brokers: list[BrokerProcess]
    conns: list[meshbus.Connector]
    pub: meshbus.Service
    s1: meshbus.Service
    s2: meshbus.Service
    s3: meshbus.Service
    s4: meshbus.Service

    async def marker(self, *services: meshbus.Service) -> None:
        """Each of ``services`` has nothing queued before a marker sent now."""
        for service in services:
            await self.pub.send(service.address, b"marker")
            await assert_next_is(service, b"marker")


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    brokers = await start_mesh(2)
    a, b = brokers
    conns = [
        await meshbus.connect(a.address, server="pa", failover=False),
        await meshbus.connect(b.address, server="pb", failover=False),
        await meshbus.connect(b.address, server="pc", failover=False),
    ]
    try:
        pub = await conns[0].register()
        s1 = await conns[0].register()
        s2 = await conns[1].register()
        s3 = await conns[1].register()
        s4 = await conns[2].register()
        yield Bus(brokers, conns, pub, s1, s2, s3, s4)
    finally:
        for conn in conns:
            await conn.close()
        await stop_all(brokers)


async def test_publish_reaches_subscribers_of_the_subject(bus: Bus) -> None:
    """subscribe takes one subject or a list; publish reaches exactly the subscribers of
    its subject, across brokers, each once, with the subject it was published on, from
    the broker's bridge address; unsubscribe (a list too) stops it."""
    await bus.s1.subscribe(["news", "sport"])
    await bus.s2.subscribe("news")
    await bus.s3.subscribe(["sport"])
    assert bus.s1.subjects == {"news", "sport"}
    assert bus.s1.groups == frozenset()

    await bus.pub.publish("news", b"n1")
    await bus.pub.publish("sport", b"s1")
    for service, expected in [
        (bus.s1, [(b"n1", "news"), (b"s1", "sport")]),
        (bus.s2, [(b"n1", "news")]),
        (bus.s3, [(b"s1", "sport")]),
    ]:
        got = [await service.recv(timeout=IO_TIMEOUT) for _ in expected]
        assert [(m.payload, m.subject) for m in got] == expected
        assert all(m.src.server == "nats" and m.dst == service.address for m in got)
    await bus.marker(bus.s1, bus.s2, bus.s3, bus.s4)

    await bus.s1.unsubscribe(["news", "sport"])
    assert bus.s1.subjects == frozenset()
    await bus.pub.publish("news", b"n2")
    await bus.pub.publish("sport", b"s2")
    msg = await bus.s2.recv(timeout=IO_TIMEOUT)
    assert (msg.payload, msg.subject) == (b"n2", "news")
    await assert_next_is(bus.s3, b"s2")
    await bus.marker(bus.s1, bus.s2, bus.s3)


async def test_reliable_publish_and_priority_on_plain_sends(bus: Bus) -> None:
    """publish(reliable=True) on a group name reaches each member of the group once, with
    its priority; a unicast send carries its priority too, and a send without one has
    priority 0."""
    await bus.s2.join(meshbus.Multicast("alerts"))
    await bus.s4.join(meshbus.Multicast("alerts"))
    await wait_members(bus.brokers, meshbus.Multicast("alerts"), 2)
    await bus.pub.publish("alerts", b"fire", priority=9, reliable=True)
    await bus.conns[0].wait_acked(IO_TIMEOUT)
    for service in (bus.s2, bus.s4):
        msg = await service.recv(timeout=IO_TIMEOUT)
        assert (msg.payload, msg.priority, msg.src) == (b"fire", 9, bus.pub.address)
    await bus.pub.send(bus.s3.address, b"urgent", priority=7)
    await bus.pub.send(bus.s3.address, b"normal")
    got = [await bus.s3.recv(timeout=IO_TIMEOUT) for _ in range(2)]
    assert [(m.payload, m.priority) for m in got] == [(b"urgent", 7), (b"normal", 0)]
    await bus.marker(bus.s2, bus.s4)


async def test_broadcast_reaches_every_service_but_the_sender(bus: Bus) -> None:
    """broadcast reaches every service on every connector of every broker once -- the
    sender's neighbour on its own connector too -- and not the sender."""
    await bus.pub.broadcast(b"hear ye", priority=3)
    for service in (bus.s1, bus.s2, bus.s3, bus.s4):
        msg = await service.recv(timeout=IO_TIMEOUT)
        assert (msg.payload, msg.priority, msg.src) == (b"hear ye", 3, bus.pub.address)
    await bus.marker(bus.s1, bus.s2, bus.s3, bus.s4, bus.pub)


async def test_subscribe_other_and_unsubscribe_other(bus: Bus) -> None:
    """A master service subscribes another (on another broker) to a subject: it gets what
    is published there afterwards; unsubscribe_other stops that."""
    await bus.pub.subscribe_other("weather", bus.s3.address)

    async def subscribed() -> bool:
        return bus.s3.subjects == {"weather"}

    await wait_until(subscribed, "s3 to be subscribed", IO_TIMEOUT)
    await bus.pub.publish("weather", b"rain")
    msg = await bus.s3.recv(timeout=IO_TIMEOUT)
    assert (msg.payload, msg.subject) == (b"rain", "weather")
    await bus.marker(bus.s3, bus.s2)  # the command itself is not delivered as a message

    await bus.pub.unsubscribe_other("weather", str(bus.s3.address))

    async def unsubscribed() -> bool:
        return not bus.s3.subjects

    await wait_until(unsubscribed, "s3 to be unsubscribed", IO_TIMEOUT)
    await bus.pub.publish("weather", b"sun")
    await bus.marker(bus.s3)


async def test_listeners_get_messages_and_the_queue_is_off(bus: Bus) -> None:
    """add_listener: a message queued before it goes to the first listener; from then on a
    sync and an async listener each get every message; recv/next_message raise NoQueue."""
    await bus.pub.send(bus.s2.address, b"queued")

    async def queued() -> bool:
        return bus.s2.queued == 1

    await wait_until(queued, "the first message to be queued", IO_TIMEOUT)
    sync_got: list[bytes] = []
    async_got: list[bytes] = []

    async def on_async(msg: meshbus.Message) -> None:
        await asyncio.sleep(0)
        async_got.append(msg.payload)

    bus.s2.add_listener(lambda msg: sync_got.append(msg.payload))
    assert sync_got == [b"queued"], "the queue is handed to the listener at once"
    bus.s2.add_listener(on_async)
    for i in range(3):
        await bus.pub.send(bus.s2.address, b"L%d" % i)
    live = [b"L0", b"L1", b"L2"]

    async def all_heard() -> bool:
        return len(sync_got) >= 4 and len(async_got) >= 3

    await wait_until(all_heard, "both listeners to hear every message", IO_TIMEOUT)
    await bus.marker(bus.s3)  # anything more for s2 would have come before this
    assert sync_got == [b"queued", *live]
    assert sorted(async_got) == live
    with pytest.raises(NoQueue):
        await bus.s2.next_message(timeout=0.1)
    with pytest.raises(NoQueue):
        await bus.s2.recv(timeout=0.1)
    # Another service on the same connector keeps its queue.
    await bus.pub.send(bus.s3.address, b"queue")
    assert (await bus.s3.next_message(timeout=IO_TIMEOUT)).payload == b"queue"


async def test_subscribe_of_an_unregistered_service_raises_join_failed(bus: Bus) -> None:
    """The broker refuses a subscribe for a service it no longer has: JoinFailed (a
    RegistrationError), for unsubscribe too; a bad topic name fails before any I/O."""
    gone = await bus.conns[1].register()
    await gone.unregister()
    with pytest.raises(JoinFailed):
        await gone.subscribe("late")
    with pytest.raises(JoinFailed):
        await gone.unsubscribe(["late"])
    with pytest.raises(ValueError, match="no valid subject"):
        await bus.s2.subscribe("x..y")
