"""Reliable sends across real broker processes: exactly once, through crashes, drains and
rebalances; giving up; and the notices of services that left the mesh.

Every broker here is a real process; crashes are kill -9, drains are SIGTERM. A test
checks exact payload lists: a lost message, a duplicate delivered to the application or
one delivered out of order (where order is promised) fails it.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable

import pytest

import meshbus
from meshbus.client.delivery import RetryPolicy
from meshbus.client.reliable import ReliableConfig
from meshbus.errors import DeliveryFailed
from meshbus.protocol.codec import DataFrame
from meshbus.protocol.ext import Ext, unpack_acks, wrap
from meshbus.protocol.layout import FLAG_ACK, FLAG_EXT, FLAG_RELIABLE
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import (
    ACK_TIMEOUT,
    IO_TIMEOUT,
    Collector,
    RawLink,
    data_frame,
    recv_n,
    stat,
    wait_members,
    wait_routes,
    wait_until,
)


def numbered(count: int, prefix: bytes = b"") -> list[bytes]:
    return [prefix + b"%d" % i for i in range(count)]


async def stream(
    sender: meshbus.Service,
    dst: meshbus.Address,
    payloads: list[bytes],
    at: int = -1,
    event: Callable[[], object] | None = None,
) -> None:
    """Send ``payloads`` reliably (without waiting for acks); call ``event`` just before
    payload number ``at``. Yields to the loop every 50 sends so that the connector reads
    its link (acks, a MOVE, the loss of its broker) while the stream goes on."""
    for i, payload in enumerate(payloads):
        if i == at and event is not None:
            event()
        await sender.send(dst, payload, reliable=True)
        if i % 50 == 49:
            await asyncio.sleep(0)


def assert_exactly_once(got: list[bytes], expected: list[bytes]) -> None:
    duplicates = len(got) - len(set(got))
    assert duplicates == 0, f"{duplicates} duplicates delivered"
    missing = set(expected) - set(got)
    assert not missing, f"{len(missing)} lost, e.g. {sorted(missing)[:5]}"
    assert sorted(got) == sorted(expected)


# -- unicast ----------------------------------------------------------------------------------


async def test_reliable_unicast_across_two_brokers_exactly_once_in_order(
    mesh2: list[BrokerProcess],
) -> None:
    """2000 reliable messages A -> B arrive once each, in send order, and are all acked."""
    a, b = mesh2
    sender_conn = await meshbus.connect(a.address, server="rsend", failover=False)
    receiver_conn = await meshbus.connect(b.address, server="rrecv", failover=False)
    try:
        sender = await sender_conn.register()
        receiver = await receiver_conn.register()
        collector = Collector(receiver)
        expected = numbered(2000)
        await stream(sender, receiver.address, expected)
        await sender_conn.wait_acked(ACK_TIMEOUT)
        assert sender_conn.unacked == 0
        assert await collector.settle(sender) == expected
        assert sender_conn._parts.unacked.given_up == 0
        collector.stop()
    finally:
        await sender_conn.close()
        await receiver_conn.close()


async def _stream_through_a_crash(mesh: list[BrokerProcess], kill_sender_side: bool) -> None:
    """3000 reliable messages from a connector on one broker to a connector on another;
    the one named by ``kill_sender_side`` is on a broker that is killed (-9) a third of
    the way through, and fails over to the third broker."""
    a, b, c = mesh
    # The side whose broker dies is given the doomed broker first and the spare second.
    doomed = await meshbus.connect(
        f"{a.address},{b.address}", server="doomed", randomize_brokers=False
    )
    steady = await meshbus.connect(c.address, server="steady", failover=False)
    sender_conn, receiver_conn = (doomed, steady) if kill_sender_side else (steady, doomed)
    try:
        assert doomed.broker_name == a.name
        sender = await sender_conn.register()
        receiver = await receiver_conn.register()
        await wait_routes(mesh, receiver.address)
        await wait_routes(mesh, sender.address)
        collector = Collector(receiver)
        expected = numbered(3000)
        await stream(sender, receiver.address, expected, at=1000, event=a.process.kill)
        await sender_conn.wait_acked(ACK_TIMEOUT)
        assert sender_conn.unacked == 0
        assert await a.process.wait() == -9
        assert doomed.failovers == 1
        assert doomed.broker_name in (b.name, c.name)
        assert_exactly_once(await collector.settle(sender), expected)
        assert sender_conn._parts.unacked.given_up == 0
        collector.stop()
    finally:
        await doomed.close()
        await steady.close()


async def test_reliable_survives_kill_9_of_the_senders_broker(mesh3: list[BrokerProcess]) -> None:
    """The sender fails over mid-stream; unacked messages are resent; none is lost or
    delivered twice."""
    await _stream_through_a_crash(mesh3, kill_sender_side=True)


async def test_reliable_survives_kill_9_of_the_receivers_broker(mesh3: list[BrokerProcess]) -> None:
    """The receiver fails over mid-stream (same address on another broker); what went to
    the dead broker is resent; none is lost or delivered twice."""
    await _stream_through_a_crash(mesh3, kill_sender_side=False)


# -- drain and rebalance ----------------------------------------------------------------------


async def stream_until(
    sender: meshbus.Service,
    dst: meshbus.Address,
    done: Callable[[], bool],
    prefix: bytes,
    after: int = 200,
    at: int = -1,
    event: Callable[[], object] | None = None,
) -> list[bytes]:
    """Send numbered messages reliably until ``done()``, then ``after`` more; every 25th
    waits for its ack (a bounded pace, not a sleep). Returns what was sent."""
    sent: list[bytes] = []
    remaining = -1
    i = 0
    while remaining != 0:
        if i == at and event is not None:
            event()
        payload = prefix + b"%d" % i
        if i % 25 == 24:
            await sender.send_reliable(dst, payload)
        else:
            await sender.send(dst, payload, reliable=True)
        sent.append(payload)
        i += 1
        if remaining < 0 and done():
            remaining = after
        elif remaining > 0:
            remaining -= 1
    return sent


async def test_reliable_survives_a_drain_of_the_senders_broker(mesh3: list[BrokerProcess]) -> None:
    """SIGTERM of the sender's broker while it streams: the sender is moved (not failed
    over) and every message arrives exactly once; the drained broker exits 0."""
    a, b, c = mesh3
    sender_conn = await meshbus.connect(a.address, server="dsend")
    receiver_conn = await meshbus.connect(b.address, server="drecv", failover=False)
    try:
        sender = await sender_conn.register()
        receiver = await receiver_conn.register()
        await wait_routes(mesh3, receiver.address)
        collector = Collector(receiver)
        sent = await asyncio.wait_for(
            stream_until(
                sender,
                receiver.address,
                lambda: sender_conn.moves >= 1,
                b"d",
                at=100,
                event=lambda: a.process.send_signal(signal.SIGTERM),
            ),
            ACK_TIMEOUT,
        )
        await sender_conn.wait_acked(ACK_TIMEOUT)
        assert sender_conn.moves == 1
        assert sender_conn.failovers == 0, "a drain moves connectors; nothing fails"
        assert sender_conn.broker_name in (b.name, c.name)
        assert await asyncio.wait_for(a.process.wait(), 20) == 0
        assert_exactly_once(await collector.settle(sender), sent)
        collector.stop()
    finally:
        await sender_conn.close()
        await receiver_conn.close()


async def test_reliable_survives_a_rebalance_onto_a_joining_broker(
    mesh3: list[BrokerProcess],
) -> None:
    """A fourth broker joins while six pairs stream to each other across brokers; it takes
    three of the twelve connectors (moved mid-stream); every pair gets its messages
    exactly once."""
    conns: list[meshbus.Connector] = []
    collectors: list[Collector] = []
    newcomer: BrokerProcess | None = None
    try:
        pairs: list[tuple[meshbus.Service, Collector]] = []
        for i, broker in enumerate(mesh3):
            target = mesh3[(i + 1) % 3]
            for j in range(2):
                send_conn = await meshbus.connect(broker.address, server=f"rs{i}{j}")
                recv_conn = await meshbus.connect(target.address, server=f"rr{i}{j}")
                conns += [send_conn, recv_conn]
                receiver = await recv_conn.register()
                collector = Collector(receiver)
                collectors.append(collector)
                pairs.append((await send_conn.register(), collector))
        await wait_routes(mesh3, pairs[-1][1].service.address)

        def moved() -> bool:
            return sum(conn.moves for conn in conns) >= 3

        streams = [
            asyncio.create_task(
                stream_until(sender, c.service.address, moved, b"p%d-" % n, after=100)
            )
            for n, (sender, c) in enumerate(pairs)
        ]
        newcomer = await start_broker("--seed", mesh3[0].address)
        sent = await asyncio.wait_for(asyncio.gather(*streams), ACK_TIMEOUT)
        for conn in conns:
            await conn.wait_acked(ACK_TIMEOUT)
        assert sum(conn.moves for conn in conns) == 3
        assert sum(conn.failovers for conn in conns) == 0
        assert sum(conn.broker_name == newcomer.name for conn in conns) == 3
        for (sender, collector), expected in zip(pairs, sent, strict=True):
            assert_exactly_once(await collector.settle(sender), expected)
    finally:
        for collector in collectors:
            collector.stop()
        for conn in conns:
            await conn.close()
        if newcomer is not None:
            await stop_all([newcomer])


# -- groups of receivers ----------------------------------------------------------------------


async def test_reliable_multicast_and_anycast_across_three_brokers(
    mesh3: list[BrokerProcess],
) -> None:
    """Reliable multicast: each of 3 members (one per broker) gets each of 500 messages
    exactly once. Reliable anycast: 300 messages to 3 members; together they got each
    exactly once (no message to two members)."""
    sender_conn = await meshbus.connect(mesh3[0].address, server="msend", failover=False)
    member_conns = [
        await meshbus.connect(x.address, server=f"mm{i}", failover=False)
        for i, x in enumerate(mesh3)
    ]
    collectors: list[Collector] = []
    try:
        sender = await sender_conn.register()
        topic = meshbus.Multicast("reliable.topic")
        members = [await conn.register() for conn in member_conns]
        for member in members:
            await member.join(topic)
        # The anycast members are all away from the sender's broker (a local member would
        # take every message): one on B, two on C.
        pool = meshbus.Anycast("reliable.pool")
        pool_members = [
            await member_conns[1].register(),
            await member_conns[2].register(),
            await member_conns[2].register(),
        ]
        for member in pool_members:
            await member.join(pool)
        await wait_members(mesh3, topic, 3)
        await wait_members(mesh3, pool, 3)
        collectors = [Collector(m) for m in members + pool_members]

        expected = numbered(500, b"m")
        await stream(sender, topic, expected)
        await sender_conn.wait_acked(ACK_TIMEOUT)
        for collector in collectors[:3]:
            assert_exactly_once(await collector.settle(sender), expected)

        expected_any = numbered(300, b"a")
        await stream(sender, pool, expected_any)
        await sender_conn.wait_acked(ACK_TIMEOUT)
        union = []
        for collector in collectors[3:]:
            union += await collector.settle(sender)
        assert_exactly_once(union, expected_any)
        assert sender_conn._parts.unacked.given_up == 0
    finally:
        for collector in collectors:
            collector.stop()
        for conn in (sender_conn, *member_conns):
            await conn.close()


async def test_a_publish_id_is_delivered_once_across_senders(mesh2: list[BrokerProcess]) -> None:
    """A retried job resends from a new connector with new message ids: the receiving
    services (each member of a multicast) drop the repeats by publish id, reliable or not."""
    a, b = mesh2
    first = await meshbus.connect(a.address, server="job-try1", failover=False)
    retry = await meshbus.connect(a.address, server="job-try2", failover=False)
    receiver_conn = await meshbus.connect(b.address, server="board", failover=False)
    try:
        members = [await receiver_conn.register() for _ in range(2)]
        for member in members:
            await member.join(meshbus.Multicast("board"))
        await wait_members(mesh2, meshbus.Multicast("board"), 2)
        collectors = [Collector(member) for member in members]
        try1, try2 = await first.register(), await retry.register()
        rows = numbered(50, b"row")
        for i, row in enumerate(rows[:30]):  # the first attempt dies after 30 rows
            await try1.send("multicast:board", row, reliable=True, publish_id=b"job1/%d" % i)
        for i, row in enumerate(rows):  # the retry sends them all again, half of them plain
            await try2.send("multicast:board", row, reliable=i % 2 == 0, publish_id=b"job1/%d" % i)
        await first.wait_acked(ACK_TIMEOUT)
        await retry.wait_acked(ACK_TIMEOUT)
        for collector in collectors:
            got = await collector.settle(try2)
            assert_exactly_once(got, rows)
        assert receiver_conn._parts.receiving.duplicates == 2 * 30
    finally:
        for conn in (first, retry, receiver_conn):
            await conn.close()


async def test_a_retried_group_with_publish_ids_is_delivered_whole(
    mesh2: list[BrokerProcess],
) -> None:
    """The first attempt sends rows 0-2 of a group, the retry (a new connector) rows 0-5
    with the same publish ids: the member gets rows 0-5 once each, in order -- the
    repeats still count in the group's sequence, or rows 3-5 would wait forever."""
    a, b = mesh2
    first = await meshbus.connect(a.address, server="grp-try1", failover=False)
    retry = await meshbus.connect(a.address, server="grp-try2", failover=False)
    member_conn = await meshbus.connect(b.address, server="grp-member", failover=False)
    try:
        member = await member_conn.register()
        await member.join(meshbus.Anycast("rows"))
        await wait_members(mesh2, meshbus.Anycast("rows"), 1)
        collector = Collector(member)
        try1, try2 = await first.register(), await retry.register()
        rows = numbered(6, b"row")
        for i, row in enumerate(rows[:3]):
            await try1.send("anycast:rows", row, group="g", publish_id=b"job/%d" % i)
        await first.wait_acked(ACK_TIMEOUT)
        for i, row in enumerate(rows):
            await try2.send("anycast:rows", row, group="g", final=i == 5, publish_id=b"job/%d" % i)
        await retry.wait_acked(ACK_TIMEOUT)
        await collector.wait_for(6)
        assert collector.payloads == rows
    finally:
        for conn in (first, retry, member_conn):
            await conn.close()


# -- giving up --------------------------------------------------------------------------------


async def test_give_up_raises_calls_back_and_suspects_the_dead(broker: BrokerProcess) -> None:
    """A service whose connector died without a goodbye: send_reliable raises
    DeliveryFailed after the policy's attempts; a plain reliable send reports to
    on_delivery_failed instead; the second failure in a row (suspicion=2) reports the
    address to on_suspected_dead, once."""
    victim_conn = await meshbus.connect(broker.address, server="victim", failover=False)
    config = ReliableConfig(retry=RetryPolicy(ack_timeout=0.05, max_attempts=3), suspicion=2)
    conn = await meshbus.connect(broker.address, server="giver", reliable=config)
    try:
        victim = await victim_conn.register()
        sender = await conn.register()
        await wait_routes([broker], victim.address)
        victim_conn._parts.abort()  # the transport is reset: no BYE, no UNREGISTER

        async def gone() -> bool:
            return str(victim.address) not in (await stat(broker))["service_addresses"]

        await wait_until(gone, "the broker to drop the dead connector's service")
        failed: list[DeliveryFailed] = []
        dead: list[str] = []
        conn.on_delivery_failed(failed.append)
        conn.on_suspected_dead(dead.append)

        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(DeliveryFailed) as raised:
            await asyncio.wait_for(sender.send_reliable(victim.address, b"one"), IO_TIMEOUT)
        elapsed = loop.time() - start
        assert raised.value.address == str(victim.address)
        # 0.05 + 0.1 + 0.2 s of waiting for acks, three attempts.
        assert elapsed >= config.retry.give_up_after() * 0.9
        assert failed == [], "send_reliable raises; the handlers are for send(reliable=True)"
        assert dead == [], "one failure is not enough with suspicion=2"

        msg_id = await sender.send(victim.address, b"two", reliable=True)

        async def reported() -> bool:
            return len(failed) >= 1

        await wait_until(reported, "on_delivery_failed", timeout=IO_TIMEOUT)
        await conn.wait_acked(IO_TIMEOUT)
        assert [(f.msg_id, f.address) for f in failed] == [(msg_id, str(victim.address))]
        assert dead == [str(victim.address)]
        assert conn.unacked == 0

        # A third failure does not report the address again.
        with pytest.raises(DeliveryFailed):
            await asyncio.wait_for(sender.send_reliable(victim.address, b"three"), IO_TIMEOUT)
        assert dead == [str(victim.address)]
    finally:
        await conn.close()
        await victim_conn.close()


# -- services leaving -------------------------------------------------------------------------

VICTIM_SCRIPT = """
import asyncio, sys
import meshbus

async def main() -> None:
    conn = await meshbus.connect(sys.argv[1], server="dying", failover=False)
    svc = await conn.register()
    print(svc.address, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_watchers_are_told_of_dead_and_unregistered_services(
    mesh2: list[BrokerProcess],
) -> None:
    """A watcher on A hears of a service on B whose process was killed (-9, no goodbye)
    and of one that unregistered; exactly those, in that order."""
    a, b = mesh2
    watcher = await meshbus.connect(a.address, server="watcher", failover=False)
    leaver_conn = await meshbus.connect(b.address, server="leaver", failover=False)
    victim = await asyncio.create_subprocess_exec(
        sys.executable, "-c", VICTIM_SCRIPT, b.address, stdout=asyncio.subprocess.PIPE
    )
    try:
        told: list[list[str]] = []
        await watcher.on_service_left(told.append)
        leaver = await leaver_conn.register()
        assert victim.stdout is not None
        line = await asyncio.wait_for(victim.stdout.readline(), 20)
        victim_address = meshbus.Address.parse(line.decode().strip())
        await wait_routes([a], victim_address)

        def left() -> list[str]:
            return [address for batch in told for address in batch]

        def heard(address: meshbus.Address) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return str(address) in left()

            return check

        victim.kill()
        await victim.wait()
        await wait_until(heard(victim_address), "the dead service's notice", IO_TIMEOUT)
        await leaver.unregister()
        await wait_until(heard(leaver.address), "the unregistered service's notice", IO_TIMEOUT)
        assert left() == [str(victim_address), str(leaver.address)]
        assert all(isinstance(batch, list) for batch in told)
    finally:
        if victim.returncode is None:
            victim.kill()
            await victim.wait()
        await watcher.close()
        await leaver_conn.close()


async def test_a_reliable_send_on_a_lost_connector_leaves_nothing_pending() -> None:
    """The link is lost for good (no failover): a reliable send raises ConnectionLost and
    is not counted as unacknowledged, and what was unacknowledged when the link broke is
    not either -- no acknowledgement can come, so ``wait_acked`` returns at once."""
    broker = await start_broker()
    conn = await meshbus.connect(broker.address, server="lost", failover=False, keepalive=0)
    try:
        sender = await conn.register()
        # Sent to a service that never acks (nobody registered it): pending until the loss.
        await sender.send(meshbus.Unicast("lost", 9), b"never acked", reliable=True)
        assert conn.unacked == 1
        broker.process.kill()
        await broker.process.wait()
        with pytest.raises(meshbus.ConnectionLost):
            await sender.recv(timeout=5)
        assert conn.unacked == 0
        with pytest.raises(meshbus.ConnectionLost):
            await sender.send(meshbus.Unicast("lost", 9), b"after the loss", reliable=True)
        assert conn.unacked == 0
        await conn.wait_acked(timeout=1)
    finally:
        await conn.close()


async def test_a_group_message_held_back_for_an_earlier_one_is_acked_only_when_delivered(
    broker: BrokerProcess,
) -> None:
    """Message 2 of a group overtakes message 1 (a resend after a failover can): the member
    holds it back, and does not acknowledge it until it is delivered, after message 1.
    An ack on arrival would let the sender count it as delivered -- and were the group to
    move before message 1 came, the new member would never get message 2."""
    member_conn = await meshbus.connect(broker.address, server="worker", failover=False)
    sender = await RawLink.open(broker.address)
    try:
        member = await member_conn.register()
        await member.join(meshbus.Anycast("pool"))
        await sender.hello("raw-sender")
        src = await sender.register("raw-sender")
        pool = meshbus.Anycast("pool").to_bytes()

        def message(seq: int) -> bytes:
            ext = Ext(origin=pool, group=b"g", seq=seq, floor=1)
            flags = FLAG_RELIABLE | FLAG_EXT
            return data_frame(member.address, src, wrap(ext, b"m%d" % seq), msg_id=seq, flags=flags)

        await sender.send(message(2))
        with pytest.raises(TimeoutError):  # nothing comes: no ack for a message held back
            await sender.read_frame(timeout=0.5)
        await sender.send(message(1))
        acked: list[int] = []
        while sorted(acked) != [1, 2]:
            frame = await sender.read_frame()
            assert isinstance(frame, DataFrame), frame
            assert frame.flags & FLAG_ACK, frame
            acked += unpack_acks(frame.payload)
        assert [m.payload for m in await recv_n(member, 2)] == [b"m1", b"m2"]
    finally:
        await sender.close()
        await member_conn.close()
