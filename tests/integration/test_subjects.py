"""Meshbus services on subjects, on real brokers: ``publish``/``subscribe`` take subjects of
any length with ``*`` and ``>``, routed by the subject layer the NATS clients use, so
Python services and nats.py clients share one topic space (docs/nats.md, "NATS and
meshbus services").

A service that must *not* get a message is checked with a marker published after it on a
subject it does get: it must be the very next message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
from nats.aio.msg import Msg

import meshbus
from bench.nats_py import flushed
from meshbus.errors import InvalidArgument, JoinFailed
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.helpers import IO_TIMEOUT, assert_next_is, wait_members, wait_until

LONG = "game.eu-west-zone7.chat"  # 23 bytes: no group name


@dataclass
class Mesh:
    """Two brokers; a connector on each (``conns``), a NATS listener on each
    (``nats_urls``)."""

    brokers: list[BrokerProcess]
    conns: list[meshbus.Connector]
    nats_urls: list[str]


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    first = await start_broker("--nats-listen", "127.0.0.1:0")
    brokers = [first]
    conns: list[meshbus.Connector] = []
    try:
        brokers.append(await start_broker("--nats-listen", "127.0.0.1:0", "--seed", first.address))
        for i, broker in enumerate(brokers):
            conns.append(await meshbus.connect(broker.address, server=f"s{i}", failover=False))
        yield Mesh(brokers, conns, [f"nats://{b.nats_address}" for b in brokers])
    finally:
        for conn in conns:
            await conn.close()
        await stop_all(brokers)


async def test_wildcard_subscribers_get_a_publish_on_a_long_subject_once(mesh: Mesh) -> None:
    """``game.*.chat`` and ``game.>`` on another broker get a publish on a 23-byte subject,
    with its subject, headers and JSON; a service whose two patterns match gets it once;
    the publisher does not get its own message, nor does a service whose pattern does not
    match."""
    pub = await mesh.conns[0].register()
    one = await mesh.conns[1].register()
    rest = await mesh.conns[1].register()
    both = await mesh.conns[0].register()
    other = await mesh.conns[1].register()
    await one.subscribe("game.*.chat")
    await rest.subscribe("game.>")
    await both.subscribe(["game.*.chat", "game.>"])
    await other.subscribe("news.>")
    await pub.subscribe("game.>")
    assert both.subjects == {"game.*.chat", "game.>"}

    await pub.publish(LONG, json={"say": "gg"}, headers={"Zone": "7"})
    for service in (one, rest, both):
        msg = await service.recv(timeout=IO_TIMEOUT)
        assert (msg.subject, msg.json(), msg.headers) == (LONG, {"say": "gg"}, {"Zone": "7"})
        assert msg.dst == service.address
    await pub.publish("game.lobby", b"marker")
    await assert_next_is(rest, b"marker")
    await assert_next_is(both, b"marker")  # one copy of the first message, not two
    await pub.publish("news.today", b"marker")
    await assert_next_is(other, b"marker")
    await pub.publish("game.lobby", b"echo", echo=True)
    await assert_next_is(pub, b"echo")  # only with echo: nothing came before it


async def test_unsubscribe_stops_delivery(mesh: Mesh) -> None:
    pub = await mesh.conns[0].register()
    sub = await mesh.conns[1].register()
    await sub.subscribe(["a.*", "b.>"])
    await pub.publish("a.one", b"1")
    await assert_next_is(sub, b"1")
    await sub.unsubscribe("a.*")
    assert sub.subjects == {"b.>"}
    await pub.publish("a.one", b"2")
    await pub.publish("b.x.y", b"marker")
    await assert_next_is(sub, b"marker")


async def test_nats_clients_and_services_share_one_topic_space(mesh: Mesh) -> None:
    """A nats.py subscriber gets a service's publish across brokers, headers included;
    a service gets a nats.py client's publish across brokers, with its subject."""
    svc = await mesh.conns[0].register()
    await svc.subscribe("orders.>")
    got: list[Msg] = []

    async def take(msg: Msg) -> None:
        got.append(msg)

    nc = await nats.connect(mesh.nats_urls[1], allow_reconnect=False)
    try:
        await nc.subscribe("metrics.*", cb=take)
        await flushed(nc)
        await svc.publish("metrics.cpu", b"42", headers={"Host": "a"})

        async def arrived() -> bool:
            return bool(got)

        await wait_until(arrived, "the NATS subscriber to get the service's message", IO_TIMEOUT)
        assert (got[0].subject, got[0].data, got[0].headers) == (
            "metrics.cpu",
            b"42",
            {"Host": "a"},
        )

        await nc.publish("orders.eu.new", b"order", headers={"Id": "7"})
        await nc.flush()
        msg = await svc.recv(timeout=IO_TIMEOUT)
        assert (msg.subject, msg.payload, msg.headers) == ("orders.eu.new", b"order", {"Id": "7"})
    finally:
        await nc.close()


async def test_group_names_meet_multicast_members_both_ways(mesh: Mesh) -> None:
    """A publish on a subject that is a group name reaches the members of
    ``multicast:NAME``; a send to ``multicast:NAME`` reaches the subject subscribers
    whose pattern matches NAME; ``reliable=True`` is the reliable multicast."""
    member = await mesh.conns[1].register()
    await member.join(meshbus.Multicast("chat.lobby"))
    subscriber = await mesh.conns[1].register()
    await subscriber.subscribe("chat.*")
    pub = await mesh.conns[0].register()
    await wait_members(mesh.brokers, meshbus.Multicast("chat.lobby"), 1)

    await pub.publish("chat.lobby", b"hello")
    assert (await member.recv(timeout=IO_TIMEOUT)).payload == b"hello"
    assert (await subscriber.recv(timeout=IO_TIMEOUT)).subject == "chat.lobby"

    await pub.send(meshbus.Multicast("chat.lobby"), b"sent")
    assert (await member.recv(timeout=IO_TIMEOUT)).payload == b"sent"
    msg = await subscriber.recv(timeout=IO_TIMEOUT)
    assert (msg.subject, msg.payload) == ("chat.lobby", b"sent")

    await pub.publish("chat.lobby", b"sure", reliable=True, priority=3)
    await mesh.conns[0].wait_acked(IO_TIMEOUT)
    msg = await member.recv(timeout=IO_TIMEOUT)
    assert (msg.payload, msg.priority) == (b"sure", 3)
    assert (await subscriber.recv(timeout=IO_TIMEOUT)).payload == b"sure"


async def test_subscribe_other_takes_a_subject(mesh: Mesh) -> None:
    master = await mesh.conns[0].register()
    player = await mesh.conns[1].register()
    await master.subscribe_other("zone.7.>", player.address)

    async def subscribed() -> bool:
        return player.subjects == {"zone.7.>"}

    await wait_until(subscribed, "the player to be subscribed", IO_TIMEOUT)

    # The player's connector has subscribed once its broker answered; the master's
    # broker knows it once the interest came over the peer link (subscribe_other
    # returns before either): publish until one arrives.
    async def roared() -> bool:
        await master.publish("zone.7.dragon", b"roar")
        try:
            return (await player.recv(timeout=0.1)).subject == "zone.7.dragon"
        except meshbus.Timeout:
            return False

    await wait_until(roared, "a publish to reach the player", IO_TIMEOUT)
    await master.unsubscribe_other("zone.7.>", player.address)

    async def unsubscribed() -> bool:
        return not player.subjects

    await wait_until(unsubscribed, "the player to be unsubscribed", IO_TIMEOUT)


BAD = {
    "publish, wildcard": lambda svc: svc.publish("a.*", b"x"),
    "publish, empty token": lambda svc: svc.publish("a..b", b"x"),
    "publish, whitespace": lambda svc: svc.publish("a b", b"x"),
    "publish, too long": lambda svc: svc.publish("x" * 20000, b"x"),
    "publish, priority on a subject": lambda svc: svc.publish("a", b"x", priority=1),
    "publish, reliable on no group name": lambda svc: svc.publish(LONG, b"x", reliable=True),
    "subscribe, '>' not last": lambda svc: svc.subscribe("a.>.b"),
    "subscribe, one bad of several": lambda svc: svc.subscribe(["fine", ""]),
    "subscribe, queue with a blank": lambda svc: svc.subscribe("a", queue="q q"),
    "unsubscribe, empty": lambda svc: svc.unsubscribe(""),
    "subscribe_other, bad subject": lambda svc: svc.subscribe_other("a..b", svc.address),
}


async def test_a_bad_subject_is_refused_before_anything_is_sent() -> None:
    """Each of BAD in turn, on one connector: refused by the client, nothing subscribed,
    nothing sent that waits for an answer, and the link still works."""
    broker = await start_broker()
    conn = await meshbus.connect(broker.address, failover=False)
    try:
        for case, call in BAD.items():
            svc = await conn.register()
            try:
                await call(svc)
            except InvalidArgument:
                pass
            else:
                pytest.fail(f"{case}: not refused")
            assert svc.subjects == frozenset(), case
            assert conn.unacked == 0, case
            await conn.ping()
    finally:
        await conn.close()
        await stop_all([broker])


async def test_the_subscriptions_of_a_connector_are_bounded() -> None:
    broker = await start_broker("--max-subjects", "2")
    conn = await meshbus.connect(broker.address, failover=False)
    try:
        a, b = await conn.register(), await conn.register()
        await a.subscribe(["x.*", "y.>"])
        await a.subscribe("x.*")  # subscribed already: nothing more held
        with pytest.raises(JoinFailed, match="--max-subjects"):
            await b.subscribe("z")
        await a.unsubscribe("x.*")
        await b.subscribe("z")  # room again
        await a.publish("z", b"fits")
        assert (await b.recv(timeout=IO_TIMEOUT)).subject == "z"
    finally:
        await conn.close()
        await stop_all([broker])


async def test_subscriptions_survive_a_failover() -> None:
    """A connector whose broker is killed subscribes again on the broker it fails over to;
    what is published there reaches it."""
    a, b = await start_mesh(2)
    moving = await meshbus.connect(a.address, server="moving")
    staying = await meshbus.connect(b.address, server="staying", failover=False)
    try:
        svc = await moving.register()
        await svc.subscribe("alerts.>")
        pub = await staying.register()
        await pub.publish("alerts.fire", b"before")
        assert (await svc.recv(timeout=IO_TIMEOUT)).payload == b"before"
        a.process.kill()  # kill -9

        async def failed_over() -> bool:
            return moving.failovers == 1

        await wait_until(failed_over, "the connector to fail over", IO_TIMEOUT)
        await pub.publish("alerts.flood", b"after")
        msg = await svc.recv(timeout=IO_TIMEOUT)
        assert (msg.subject, msg.payload) == ("alerts.flood", b"after")
        assert svc.subjects == {"alerts.>"}
    finally:
        await asyncio.gather(moving.close(), staying.close())
        await stop_all([a, b])
