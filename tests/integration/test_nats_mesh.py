"""NATS clients on a mesh of three real brokers, each with its own ``--nats-listen``:
nats.py clients on different brokers reach each other as on one nats-server cluster
(wildcards, queue groups exactly once, request/reply, no responders, interest that goes
with its client or its broker), learn the other brokers from INFO connect_urls as they
join and leave, and go on at another broker when theirs is killed or drains; and they
meet meshbus's own services through the bridge (subject NAME is multicast:NAME both
ways; anycast.NAME requests an anycast pool)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

import meshbus
from bench.nats_py import flushed
from meshbus import Anycast, Multicast
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import IO_TIMEOUT, wait_members, wait_until
from tests.integration.test_nats_listener import QUIET, RawNats


class NatsBroker:
    def __init__(self, process: BrokerProcess, nats_port: int) -> None:
        self.process = process
        self.port = nats_port
        self.netloc = f"127.0.0.1:{nats_port}"  # as connect_urls name it
        self.url = f"nats://{self.netloc}"


async def _start(*args: str) -> NatsBroker:
    """A broker with a NATS listener on a port of its own choosing (its ready line's)."""
    broker = await start_broker("--nats-listen", "127.0.0.1:0", *args)
    return NatsBroker(broker, int(broker.nats_address.rsplit(":", 1)[1]))


@pytest.fixture
async def mesh() -> AsyncIterator[list[NatsBroker]]:
    """Three brokers in one mesh, each taking NATS clients; a drain gives them 1 s to go."""
    first = await _start("--drain-grace", "1")
    brokers = [first]
    try:
        joining = [_start("--seed", first.process.address, "--drain-grace", "1") for _ in range(2)]
        started = await asyncio.gather(*joining, return_exceptions=True)
        brokers += [b for b in started if isinstance(b, NatsBroker)]
        for result in started:
            if isinstance(result, BaseException):
                raise result
        yield brokers
    finally:
        codes = await stop_all([b.process for b in brokers])
        assert all(code in (0, -9) for code in codes), f"broker exit codes {codes}"


@contextlib.asynccontextmanager
async def client(broker: NatsBroker, **options: Any) -> AsyncIterator[Client]:
    """A nats.py client given ``broker`` alone; it does not reconnect unless ``options``
    say so."""
    nc = await nats.connect(
        broker.url, **{"allow_reconnect": False, "connect_timeout": IO_TIMEOUT, **options}
    )
    try:
        yield nc
    finally:
        await nc.close()


class Inbox:
    """What one subscription got."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []

    async def take(self, msg: Msg) -> None:
        self.messages.append(msg)

    @property
    def data(self) -> list[bytes]:
        return [m.data for m in self.messages]

    async def wait_for(self, count: int) -> None:
        async def enough() -> bool:
            return len(self.messages) >= count

        await wait_until(enough, f"{count} messages (got {len(self.messages)})", IO_TIMEOUT)


async def test_wildcards_across_brokers(mesh: list[NatsBroker]) -> None:
    a, b, c = mesh
    async with client(a) as pub, client(b) as sub_b, client(c) as sub_c:
        one, rest, exact = Inbox(), Inbox(), Inbox()
        await sub_b.subscribe("orders.*", cb=one.take)
        await sub_c.subscribe("orders.>", cb=rest.take)
        await sub_c.subscribe("orders.new", cb=exact.take)
        await flushed(sub_b, sub_c)
        await pub.publish("orders.new", b"1")
        await pub.publish("orders.new.eu", b"2")
        await pub.publish("other", b"3")
        await pub.flush()
        await rest.wait_for(2)
        await one.wait_for(1)
        await exact.wait_for(1)
        await asyncio.sleep(0.2)  # anything more would have come by now
        assert one.data == [b"1"]
        assert rest.data == [b"1", b"2"]
        assert exact.data == [b"1"]
        assert [m.subject for m in rest.messages] == ["orders.new", "orders.new.eu"]


async def test_a_subscription_is_known_mesh_wide_when_flush_returns(
    mesh: list[NatsBroker],
) -> None:
    """The promise of a PING after a SUB: a message published through any broker right
    after its PONG finds the subscription -- every time, not just eventually."""
    a, b, _ = mesh
    async with client(a) as pub, client(b) as sub:
        for i in range(20):
            inbox = Inbox()
            subscription = await sub.subscribe(f"flush.{i}", cb=inbox.take)
            await flushed(sub)
            await pub.publish(f"flush.{i}", b"x")
            await pub.flush()
            await inbox.wait_for(1)
            await subscription.unsubscribe()


async def test_a_queue_group_gets_each_message_once_mesh_wide(mesh: list[NatsBroker]) -> None:
    a, b, c = mesh
    count = 300
    async with (
        client(a) as pub,
        client(a) as member_a,
        client(b) as member_b1,
        client(b) as member_b2,
        client(c) as member_c,
        client(c) as plain,
    ):
        members = {"a": Inbox(), "b1": Inbox(), "b2": Inbox(), "c": Inbox()}
        await member_a.subscribe("jobs", queue="workers", cb=members["a"].take)
        await member_b1.subscribe("jobs", queue="workers", cb=members["b1"].take)
        await member_b2.subscribe("jobs", queue="workers", cb=members["b2"].take)
        await member_c.subscribe("jobs", queue="workers", cb=members["c"].take)
        everything = Inbox()
        await plain.subscribe("jobs", cb=everything.take)
        await flushed(member_a, member_b1, member_b2, member_c, plain)
        for i in range(count):
            await pub.publish("jobs", b"%d" % i)
        await pub.flush()
        await everything.wait_for(count)

        async def all_in() -> bool:
            return sum(len(m.messages) for m in members.values()) >= count

        await wait_until(all_in, f"{count} jobs taken", IO_TIMEOUT)
        await asyncio.sleep(0.2)
        taken = Counter(d for m in members.values() for d in m.data)
        assert len(taken) == count, "every job taken"
        assert set(taken.values()) == {1}, "each job once"
        # Picked weighted by members: every member, on every broker, takes some.
        assert all(m.messages for m in members.values()), {
            k: len(m.messages) for k, m in members.items()
        }


async def test_request_reply_across_brokers(mesh: list[NatsBroker]) -> None:
    a, _, c = mesh
    async with client(a) as requester, client(c) as responder:

        async def answer(msg: Msg) -> None:
            await responder.publish(msg.reply, b"re:" + msg.data)

        await responder.subscribe("svc.echo", cb=answer)
        await flushed(responder)
        # nats.py subscribes its _INBOX.<id>.* with the first request, unflushed: the
        # interest must reach c before the request does.
        for i in range(10):
            reply = await requester.request("svc.echo", b"%d" % i, timeout=IO_TIMEOUT)
            assert reply.data == b"re:%d" % i


async def test_no_responders_when_nobody_anywhere_subscribes(mesh: list[NatsBroker]) -> None:
    a, b, _ = mesh
    async with client(a) as requester:
        with pytest.raises(NoRespondersError):
            await requester.request("nobody.home", b"?", timeout=IO_TIMEOUT)
        async with client(b) as responder:

            async def answer(msg: Msg) -> None:
                await responder.publish(msg.reply, b"here")

            await responder.subscribe("somebody.home", cb=answer)
            await flushed(responder)
            reply = await requester.request("somebody.home", b"?", timeout=IO_TIMEOUT)
            assert reply.data == b"here"
        # The responder's client is gone: its interest goes from every broker.

        async def nobody() -> bool:
            try:
                await requester.request("somebody.home", b"?", timeout=0.5)
            except NoRespondersError:
                return True
            except nats.errors.TimeoutError:
                return False  # sent to b before a heard the interest went
            return False

        await wait_until(nobody, "the closed client's interest gone from broker a")


async def test_a_killed_brokers_interest_goes(mesh: list[NatsBroker]) -> None:
    a, _, c = mesh
    async with client(a) as requester:
        responder = await nats.connect(c.url, allow_reconnect=False, connect_timeout=IO_TIMEOUT)

        async def answer(msg: Msg) -> None:
            await responder.publish(msg.reply, b"c")

        await responder.subscribe("on.c", cb=answer)
        await flushed(responder)
        assert (await requester.request("on.c", b"", timeout=IO_TIMEOUT)).data == b"c"
        c.process.process.send_signal(signal.SIGKILL)
        await c.process.process.wait()

        async def nobody() -> bool:
            try:
                await requester.request("on.c", b"?", timeout=0.5)
            except NoRespondersError:
                return True
            except nats.errors.TimeoutError:
                return False  # sent to c's link before a saw it die
            return False

        await wait_until(nobody, "the killed broker's interest gone from broker a")
        with contextlib.suppress(Exception):
            await responder.close()


# -- connect_urls: the other brokers, as they join and leave ---------------------------


async def exited(broker: NatsBroker) -> int:
    """The exit code of a broker told to stop (a second SIGTERM would cut its drain)."""
    return await asyncio.wait_for(broker.process.process.wait(), IO_TIMEOUT)


async def next_info(raw: RawNats) -> dict[str, Any]:
    """The next async INFO the broker sends ``raw`` (its pings answered meanwhile)."""
    while True:
        line = await raw.line()
        if line == b"PING":
            await raw.send(b"PONG\r\n")
        elif line.startswith(b"INFO "):
            info: dict[str, Any] = json.loads(line[5:])
            return info


async def test_connect_urls_follow_the_brokers_that_join_and_leave(
    mesh: list[NatsBroker],
) -> None:
    a, b, c = mesh
    # protocol 1: a client that takes async INFOs (nats.py, nats.js, nats.go all do).
    raw = await RawNats.open(a.port, {**QUIET, "protocol": 1})
    assert raw.info["connect_urls"][0] == a.netloc  # itself first, then its peers
    assert set(raw.info["connect_urls"]) == {a.netloc, b.netloc, c.netloc}
    d = await _start("--seed", a.process.address)
    try:
        info = await next_info(raw)  # once d is ready: not before it takes clients
        assert set(info["connect_urls"]) == {a.netloc, b.netloc, c.netloc, d.netloc}
        d.process.process.send_signal(signal.SIGTERM)  # a drain: its clients must go
        assert set((await next_info(raw))["connect_urls"]) == {a.netloc, b.netloc, c.netloc}
        assert await exited(d) == 0
        c.process.process.send_signal(signal.SIGKILL)
        assert set((await next_info(raw))["connect_urls"]) == {a.netloc, b.netloc}
        await raw.pong()  # nothing else came: one INFO a change
    finally:
        await raw.close()
        await d.process.stop()


@pytest.mark.parametrize("how", ["kill -9", "drain"])
async def test_a_client_given_one_broker_goes_on_at_another_when_it_goes(
    mesh: list[NatsBroker], how: str
) -> None:
    """Given only a's URL, a client learns b and c from a's INFO; when a is killed, or
    drains (lame duck mode, then closed after the grace), it reconnects to one of them
    and its subscription works again there, for messages published anywhere."""
    a, b, c = mesh
    lame_duck, reconnected = asyncio.Event(), asyncio.Event()

    async def on_lame_duck() -> None:
        lame_duck.set()

    async def on_reconnect() -> None:
        reconnected.set()

    async with (
        client(a, allow_reconnect=True, reconnect_time_wait=0.1,
               lame_duck_mode_cb=on_lame_duck, reconnected_cb=on_reconnect) as nc,
        client(c) as publisher,
    ):  # fmt: skip
        assert {s.netloc for s in nc.discovered_servers} == {b.netloc, c.netloc}
        inbox = Inbox()
        await nc.subscribe("goes.on", cb=inbox.take)
        await flushed(nc)
        a.process.process.send_signal(signal.SIGKILL if how == "kill -9" else signal.SIGTERM)
        async with asyncio.timeout(IO_TIMEOUT):
            await reconnected.wait()
        assert lame_duck.is_set() == (how == "drain")
        assert nc.connected_url is not None
        assert nc.connected_url.netloc in {b.netloc, c.netloc}
        await flushed(nc)  # nats.py subscribed again on reconnecting
        await publisher.publish("goes.on", b"after")
        await publisher.flush()
        await inbox.wait_for(1)
        assert inbox.data == [b"after"]
    if how == "drain":
        assert await exited(a) == 0


# -- the bridge: NATS subjects and meshbus addresses ------------------------------------


async def test_a_nats_publish_reaches_a_meshbus_multicast_member(mesh: list[NatsBroker]) -> None:
    a, b, _ = mesh
    async with (
        await meshbus.connect(b.process.address, server="member", failover=False) as conn,
        client(a) as pub,
    ):
        member = await conn.register()
        # Before the group has a member a's bridge learns the subject reaches no one in
        # meshbus; the member's join must undo that.
        await pub.publish("prices.eur", b"before the member")
        await flushed(pub)
        await member.join(Multicast("prices.eur"))
        await wait_members([x.process for x in mesh], Multicast("prices.eur"), 1)
        await pub.publish("prices.eur", b"1.08", headers={"Source": "ecb"})
        await pub.flush()
        msg = await member.recv(timeout=IO_TIMEOUT)
        assert msg.payload == b"1.08"
        assert msg.headers == {"Source": "ecb"}
        assert str(msg.dst) == "multicast:prices.eur"
        for price in (b"1.09", b"1.10", b"1.11"):
            await pub.publish("prices.eur", price)
        await pub.flush()
        assert [(await member.recv(timeout=IO_TIMEOUT)).payload for _ in range(3)] == [
            b"1.09", b"1.10", b"1.11"
        ]  # fmt: skip
        # A subject longer than a group name stays NATS's: nothing more comes.
        await pub.publish("prices.eur.too-long-for-a-group", b"x")
        await pub.flush()
        with pytest.raises(asyncio.TimeoutError):
            await member.recv(timeout=0.3)


async def test_a_meshbus_multicast_reaches_nats_subscribers(mesh: list[NatsBroker]) -> None:
    a, b, c = mesh
    async with (
        await meshbus.connect(a.process.address, server="sender", failover=False) as conn,
        client(b) as sub_b,
        client(c) as sub_c,
        client(c) as worker_c1,
        client(c) as worker_c2,
    ):
        sender = await conn.register()
        # Nobody wants it yet: dropped. The decision a's link caches for this routing key
        # (the same size and flags as those below) must not outlive the NATS interest that
        # comes next.
        await sender.send(Multicast("news.sport"), b"-", headers={"N": "-"})
        await conn.ping()
        exact, wild = Inbox(), Inbox()
        workers = [Inbox(), Inbox()]
        await sub_b.subscribe("news.sport", cb=exact.take)
        await sub_c.subscribe("news.>", cb=wild.take)
        await worker_c1.subscribe("news.sport", queue="q", cb=workers[0].take)
        await worker_c2.subscribe("news.sport", queue="q", cb=workers[1].take)
        await flushed(sub_b, sub_c, worker_c1, worker_c2)
        for i in range(10):
            await sender.send(Multicast("news.sport"), b"%d" % i, headers={"N": str(i)})
        await exact.wait_for(10)
        await wild.wait_for(10)

        async def taken() -> bool:
            return sum(len(w.messages) for w in workers) >= 10

        await wait_until(taken, "the queue group's 10 messages", IO_TIMEOUT)
        await asyncio.sleep(0.2)
        assert exact.data == [b"%d" % i for i in range(10)]
        assert wild.data == exact.data
        assert exact.messages[3].headers == {"N": "3"}
        assert sorted(d for w in workers for d in w.data) == sorted(exact.data)


async def test_a_meshbus_service_answers_a_nats_request(mesh: list[NatsBroker]) -> None:
    a, _, c = mesh
    async with (
        await meshbus.connect(c.process.address, server="pricing", failover=False) as conn,
        client(a) as requester,
    ):
        service = await conn.register()
        with pytest.raises(NoRespondersError):  # no member yet; the join must undo it
            await requester.request("anycast.pricing", b"?", timeout=IO_TIMEOUT)
        await service.join(Anycast("pricing"))
        await wait_members([x.process for x in mesh], Anycast("pricing"), 1)

        async def serve() -> None:
            async for msg in service:
                await msg.reply(b"quote for " + msg.payload)

        serving = asyncio.create_task(serve())
        try:
            for item in (b"apples", b"pears"):
                reply = await requester.request("anycast.pricing", item, timeout=IO_TIMEOUT)
                assert reply.data == b"quote for " + item
        finally:
            serving.cancel()
        # A pool with no member is no responders, as a subject with no subscriber.
        with pytest.raises(NoRespondersError):
            await requester.request("anycast.nobody", b"?", timeout=IO_TIMEOUT)
