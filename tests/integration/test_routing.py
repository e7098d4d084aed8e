"""Routing through one real broker: unicast, multicast, anycast, membership, order, sizes.

"Exactly one copy" is checked without sleeping: after the messages under test the same
sender sends a unicast *marker* to every receiver. Order is kept per (sender, receiver)
path, so a receiver's next message after the expected ones must be the marker; a
duplicate or a stray copy would show up in its place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import pytest

import meshbus
from meshbus.protocol import DEFAULT_MAX_FRAME, ControlType, DataFlags, encode_control
from meshbus.protocol.control import DeliveryFailure, Register
from tests.integration.helpers import (
    RawLink,
    assert_next_is,
    data_frame,
    recv_payloads,
)

HEADER = 64


async def send_markers(sender: meshbus.Service, *receivers: meshbus.Service) -> None:
    for receiver in receivers:
        await sender.send(receiver.address, b"marker:" + str(receiver.address).encode())


async def expect_markers(*receivers: meshbus.Service) -> None:
    for receiver in receivers:
        await assert_next_is(receiver, b"marker:" + str(receiver.address).encode())


# -- unicast ----------------------------------------------------------------------------


async def test_unicast_to_owner_on_another_connector(conns):
    a, b = await conns[0].register(), await conns[1].register()
    bystander = await conns[1].register()
    await a.send(b.address, b"hello")
    msg = await b.recv(timeout=5)
    assert msg.payload == b"hello"
    assert msg.src == a.address
    assert msg.dst == b.address
    assert not msg.is_request
    await send_markers(a, bystander)
    await expect_markers(bystander)


async def test_unicast_to_service_of_same_connector(conns):
    a, b = await conns[0].register(), await conns[0].register()
    await a.send(b.address, b"local")
    msg = await b.recv(timeout=5)
    assert (msg.payload, msg.src) == (b"local", a.address)
    await send_markers(a, a)
    await expect_markers(a)


async def test_unicast_by_text_address(conns):
    a = await conns[0].register()
    b = await conns[1].register(instance=5)
    await a.send("srv1:5", b"text form")
    await assert_next_is(b, b"text form")


# -- multicast -------------------------------------------------------------------------


@pytest.mark.parametrize("echo", [False, True])
async def test_multicast_one_copy_per_member(conns, echo):
    topic = meshbus.Multicast("chat.lobby")
    sender = await conns[0].register()
    same_conn = [await conns[0].register() for _ in range(2)]
    other_conn = [await conns[1].register() for _ in range(2)] + [await conns[2].register()]
    outsider = await conns[1].register()  # not a member
    for member in [sender, *same_conn, *other_conn]:
        await member.join(topic)

    await sender.send(topic, b"hi all", echo=echo)
    receivers = same_conn + other_conn + ([sender] if echo else [])
    for member in receivers:
        msg = await member.recv(timeout=5)
        assert (msg.payload, msg.src, msg.dst) == (b"hi all", sender.address, topic)
    everyone = [sender, *same_conn, *other_conn, outsider]
    await send_markers(sender, *everyone)
    # The marker comes next for every member (no second copy), for the sender when echo
    # is off (no copy at all), and for the outsider.
    await expect_markers(*everyone)


async def test_multicast_sender_not_member_reaches_all(conns):
    topic = meshbus.Multicast("news")
    sender = await conns[0].register()
    members = [await conns[1].register(), await conns[1].register(), await conns[2].register()]
    for member in members:
        await member.join(topic)
    for i in range(5):
        await sender.send(topic, b"%d" % i)
    for member in members:
        assert await recv_payloads(member, 5) == [b"0", b"1", b"2", b"3", b"4"]
    await send_markers(sender, *members)
    await expect_markers(*members)


async def test_multicast_sender_only_member_without_echo_is_dropped(conns):
    topic = meshbus.Multicast("alone")
    sender = await conns[0].register()
    await sender.join(topic)
    await sender.send(topic, b"nobody else")
    await sender.send(topic, b"echoed", echo=True)
    await assert_next_is(sender, b"echoed")


async def test_leave_stops_multicast_delivery(conns):
    topic = meshbus.Multicast("leavers")
    sender = await conns[0].register()
    stays, leaves = await conns[1].register(), await conns[2].register()
    for member in (stays, leaves):
        await member.join(topic)
    await sender.send(topic, b"before")
    for member in (stays, leaves):
        await assert_next_is(member, b"before")
    await leaves.leave(topic)
    assert topic not in leaves.groups
    await sender.send(topic, b"after")
    await assert_next_is(stays, b"after")
    await send_markers(sender, leaves)
    await expect_markers(leaves)


async def test_leave_one_of_two_members_on_same_connector(conns):
    topic = meshbus.Multicast("pair")
    sender = await conns[0].register()
    stays, leaves = await conns[1].register(), await conns[1].register()
    for member in (stays, leaves):
        await member.join(topic)
    await leaves.leave(topic)
    await sender.send(topic, b"after")
    await assert_next_is(stays, b"after")
    await send_markers(sender, stays, leaves)
    await expect_markers(stays, leaves)


async def test_leave_group_not_joined_is_a_noop(conns):
    a = await conns[0].register()
    await a.leave(meshbus.Multicast("never"))
    await a.leave(meshbus.Anycast("never"))


# -- anycast ----------------------------------------------------------------------------


async def test_anycast_exactly_one_member_each_and_spread(conns):
    pool = meshbus.Anycast("login")
    sender = await conns[0].register()
    members = [await conns[0].register(), await conns[1].register(), await conns[2].register()]
    for member in [sender, *members]:
        await member.join(pool)

    count = 300
    for i in range(count):
        await sender.send(pool, b"%d" % i)

    got: dict[meshbus.Address, list[bytes]] = {m.address: [] for m in members}
    all_in = asyncio.Event()

    async def drain(member: meshbus.Service) -> None:
        while True:
            got[member.address].append((await member.recv()).payload)
            if sum(len(v) for v in got.values()) >= count:
                all_in.set()

    tasks = [asyncio.create_task(drain(m)) for m in members]
    try:
        await asyncio.wait_for(all_in.wait(), 10)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    payloads = Counter(p for v in got.values() for p in v)
    assert sum(payloads.values()) == count
    assert set(payloads) == {b"%d" % i for i in range(count)}, "lost or foreign messages"
    assert max(payloads.values()) == 1, "a message reached more than one member"
    for address, received in got.items():
        # Uniform choice gives ~100 each; 30 is more than 8 standard deviations away.
        assert len(received) >= 30, f"{address} got only {len(received)} of {count}"
        assert received == sorted(received, key=int), "anycast reordered one member's messages"
    # Nothing extra is queued anywhere, and the sender (a member) got none of it.
    await send_markers(sender, sender, *members)
    await expect_markers(sender, *members)


async def test_anycast_sender_only_member_is_dropped(conns):
    pool = meshbus.Anycast("self")
    sender = await conns[0].register()
    await sender.join(pool)
    before = (await conns[0].stat())["counters"]["dropped_no_route"]
    await sender.send(pool, b"x")
    assert (await conns[0].stat())["counters"]["dropped_no_route"] == before + 1
    await send_markers(sender, sender)
    await expect_markers(sender)


async def test_anycast_leave_stops_delivery(conns):
    pool = meshbus.Anycast("workers")
    sender = await conns[0].register()
    stays, leaves = await conns[1].register(), await conns[2].register()
    for member in (stays, leaves):
        await member.join(pool)
    await leaves.leave(pool)
    for i in range(50):
        await sender.send(pool, b"%d" % i)
    assert await recv_payloads(stays, 50) == [b"%d" % i for i in range(50)]
    await send_markers(sender, leaves)
    await expect_markers(leaves)


# -- registration -----------------------------------------------------------------------


async def test_unregister_frees_fixed_address(broker):
    async with (
        await meshbus.connect(broker.address, server="game01") as one,
        await meshbus.connect(broker.address, server="game01") as two,
    ):
        first = await one.register(instance=42)
        with pytest.raises(meshbus.AddressInUse):
            await two.register(instance=42)
        await first.unregister()
        with pytest.raises(meshbus.NotConnected):
            await first.recv(timeout=1)
        second = await two.register(instance=42)
        assert second.address == first.address == meshbus.Unicast("game01", 42)
        # Messages to the address now reach the new owner only.
        sender = await one.register()
        await sender.send(second.address, b"to the new owner")
        await assert_next_is(second, b"to the new owner")


async def test_unregister_of_dynamic_address_stops_delivery(broker):
    async with await meshbus.connect(broker.address, server="game01") as conn:
        sender, gone = await conn.register(), await conn.register()
        address = gone.address
        await gone.join(meshbus.Multicast("t"))
        await gone.unregister()
        before = (await conn.stat())["counters"]["dropped_no_route"]
        await sender.send(address, b"x")
        await sender.send(meshbus.Multicast("t"), b"y")
        stat = await conn.stat()
        assert stat["counters"]["dropped_no_route"] == before + 2
        assert str(address) not in stat["service_addresses"]
        assert "multicast:t" not in stat["groups"]


async def test_dynamic_addresses_are_dynamic_and_unique(conns):
    addresses = []
    for conn in conns:
        for _ in range(5):
            addresses.append((await conn.register()).address)
    assert all(isinstance(a, meshbus.Unicast) for a in addresses)
    assert all(a.instance >= 65536 for a in addresses), addresses
    assert not any(a.is_fixed for a in addresses)
    assert len(set(addresses)) == len(addresses)


async def test_register_taken_fixed_address_raises_address_in_use(conns):
    await conns[0].register(instance=7)
    with pytest.raises(meshbus.AddressInUse) as info:
        await conns[0].register(instance=7)
    assert "srv0:7" in str(info.value)
    assert info.value.address == "srv0:7"
    assert isinstance(info.value, meshbus.RegistrationError)
    # The refusal is not fatal: the connector still works.
    other = await conns[0].register(instance=8)
    assert other.address == meshbus.Unicast("srv0", 8)


# -- order ----------------------------------------------------------------------------------


def seq(i: int) -> bytes:
    return i.to_bytes(4, "big")


async def test_order_kept_for_burst_of_10000(conns):
    a, b = await conns[0].register(), await conns[1].register()
    count = 10_000
    for i in range(count):
        await a.send(b.address, seq(i))
    received = await recv_payloads(b, count, timeout=30)
    assert received == [seq(i) for i in range(count)]
    await send_markers(a, b)
    await expect_markers(b)
    stat = await conns[0].stat()
    assert stat["counters"]["dropped_no_route"] == 0


@pytest.mark.parametrize("same_connector", [True, False], ids=["same-conn", "two-conns"])
async def test_order_kept_for_interleaved_destinations(conns, same_connector):
    a = await conns[0].register()
    b1 = await conns[1].register()
    b2 = await (conns[1] if same_connector else conns[2]).register()
    count = 2_000
    for i in range(count):
        await a.send(b1.address, b"b1:" + seq(i))
        await a.send(b2.address, b"b2:" + seq(i))
    r1, r2 = await asyncio.gather(
        recv_payloads(b1, count, timeout=30), recv_payloads(b2, count, timeout=30)
    )
    assert r1 == [b"b1:" + seq(i) for i in range(count)]
    assert r2 == [b"b2:" + seq(i) for i in range(count)]


async def test_order_kept_across_cast_types_to_one_receiver(conns):
    """Plain unicast runs, multicast runs and per-frame anycast sends, interleaved, arrive
    at their only receiver in the order they were sent."""
    a, b = await conns[0].register(), await conns[1].register()
    topic, pool = meshbus.Multicast("order.t"), meshbus.Anycast("order.a")
    await b.join(topic)
    await b.join(pool)
    destinations = [b.address, b.address, b.address, topic, topic, pool, b.address, pool]
    count = 3_000
    for i in range(count):
        await a.send(destinations[i % len(destinations)], seq(i))
    assert await recv_payloads(b, count, timeout=30) == [seq(i) for i in range(count)]


# -- no route -----------------------------------------------------------------------------


async def test_send_without_route_is_dropped_and_counted(conns):
    a = await conns[0].register()
    before = (await conns[0].stat())["counters"]["dropped_no_route"]
    await a.send(meshbus.Unicast("nobody", 9), b"x")
    await a.send(meshbus.Multicast("empty"), b"x")
    await a.send(meshbus.Anycast("empty"), b"x")
    # notify=True: the broker answers with NO_ROUTE; the connector has nothing to hand it
    # to for a plain send, so what is observable here is the counter and a healthy link.
    await a.send(meshbus.Unicast("nobody", 9), b"x", notify=True)
    assert (await conns[0].stat())["counters"]["dropped_no_route"] == before + 4
    await send_markers(a, a)
    await expect_markers(a)


async def test_burst_without_route_is_counted_per_message(conns):
    a = await conns[0].register()
    before = (await conns[0].stat())["counters"]["dropped_no_route"]
    for i in range(500):
        await a.send(meshbus.Unicast("nobody", 9), seq(i))
    assert (await conns[0].stat())["counters"]["dropped_no_route"] == before + 500


async def test_notify_drop_sends_no_route_frame(broker):
    link = await RawLink.open(broker.address)
    try:
        await link.hello()
        src = await link.register("raw", 3)
        dst = meshbus.Unicast("nobody", 1)
        await link.send(data_frame(dst, src, b"x", msg_id=77, flags=int(DataFlags.NOTIFY_DROP)))
        frame = await link.read_control()
        assert frame.type == ControlType.NO_ROUTE
        assert frame.body == DeliveryFailure(msg_id=77, src=src, dst=dst.to_bytes())
        # Without the flag the broker says nothing: the next answer is the PONG.
        await link.send(data_frame(dst, src, b"x", msg_id=78))
        await link.ping()
    finally:
        await link.close()


async def test_register_then_send_in_one_write_is_routed(broker, conns):
    """A REGISTER and a data frame from the new address in the same read: the routing
    change must be visible to the very next frame (not ADDRESS_NOT_OWNED)."""
    receiver = await conns[0].register()
    link = await RawLink.open(broker.address)
    try:
        await link.hello()
        src = meshbus.Unicast("raw", 9)
        await link.send(
            encode_control(ControlType.REGISTER, Register(server="raw", instance=9), 5)
            + data_frame(receiver.address, src, b"same read")
        )
        frame = await link.read_control()
        assert frame.type == ControlType.REGISTERED, frame
        msg = await receiver.recv(timeout=5)
        assert (msg.payload, msg.src) == (b"same read", src)
        await link.ping()
    finally:
        await link.close()


# -- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size",
    [0, 1, 64 * 1024, DEFAULT_MAX_FRAME - HEADER],
    ids=["empty", "one-byte", "64KiB", "max-frame"],
)
async def test_payload_sizes_arrive_intact(conns, size):
    a, b = await conns[0].register(), await conns[1].register()
    payload = bytes(i % 251 for i in range(size))
    await a.send(b.address, payload)
    await a.send(b.address, payload[::-1])  # back to back: the second starts mid-read
    first, second = await recv_payloads(b, 2, timeout=10)
    assert len(first) == size
    assert first == payload
    assert second == payload[::-1]


async def test_max_size_frames_to_multicast(conns):
    topic = meshbus.Multicast("big")
    a = await conns[0].register()
    members = [await conns[1].register(), await conns[1].register(), await conns[2].register()]
    for member in members:
        await member.join(topic)
    payloads = [bytes([i]) * (DEFAULT_MAX_FRAME - HEADER) for i in range(3)]
    for payload in payloads:
        await a.send(topic, payload)
    for member in members:
        assert await recv_payloads(member, 3, timeout=10) == payloads


async def test_payload_over_frame_limit_raises_frame_too_large(conns):
    a, b = await conns[0].register(), await conns[1].register()
    with pytest.raises(meshbus.FrameTooLarge) as info:
        await a.send(b.address, bytes(DEFAULT_MAX_FRAME - HEADER + 1))
    assert info.value.size == DEFAULT_MAX_FRAME + 1
    assert info.value.limit == DEFAULT_MAX_FRAME
    assert isinstance(info.value, meshbus.ProtocolError)
    with pytest.raises(meshbus.FrameTooLarge):
        await a.request(b.address, bytes(2 * DEFAULT_MAX_FRAME), timeout=1)
    # Nothing was sent and the connector is still open.
    await a.send(b.address, b"still fine")
    await assert_next_is(b, b"still fine")


async def test_smaller_max_frame_is_negotiated_and_enforced(broker, conns):
    small_limit = 4096
    async with await meshbus.connect(
        broker.address, server="small", max_frame=small_limit
    ) as small:
        svc = await small.register()
        peer = await conns[0].register()
        await svc.send(peer.address, bytes(small_limit - HEADER))
        assert len((await peer.recv(timeout=5)).payload) == small_limit - HEADER
        with pytest.raises(meshbus.FrameTooLarge):
            await svc.send(peer.address, bytes(small_limit - HEADER + 1))
        await svc.send(peer.address, b"ok")
        await assert_next_is(peer, b"ok")


async def test_frame_larger_than_receivers_limit_does_not_break_its_link(broker, conns):
    """A connector that asked for a small max frame must not be sent a bigger frame it has
    to refuse: its link to the broker stays up and later messages still arrive."""
    async with await meshbus.connect(broker.address, server="small", max_frame=4096) as small:
        receiver = await small.register()
        sender = await conns[0].register()
        await sender.send(receiver.address, bytes(10_000))
        await sender.send(receiver.address, b"after the big one")
        async with asyncio.timeout(5):
            while True:
                msg = await receiver.recv()
                if msg.payload == b"after the big one":
                    break
        await small.ping()


# -- a message that comes right behind the answer that makes its address ---------------


@contextlib.asynccontextmanager
async def batching_proxy(upstream: str, every: float = 0.05) -> AsyncIterator[str]:
    """A TCP proxy that hands the broker's bytes on in batches every ``every`` seconds, as
    a busy client reads them: an answer and the frames behind it arrive in one read."""
    host, port = upstream.rsplit(":", 1)
    tasks: set[asyncio.Task[None]] = set()

    async def batched(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pending = bytearray()

        async def flush() -> None:
            while True:
                await asyncio.sleep(every)
                if pending:
                    writer.write(bytes(pending))
                    pending.clear()

        flusher = asyncio.create_task(flush())
        try:
            while chunk := await reader.read(65536):
                pending += chunk
        finally:
            flusher.cancel()
            writer.close()

    async def straight(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        for pump in (batched(up_reader, writer), straight(reader, up_writer)):
            task = asyncio.create_task(pump)
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("change", ["register", "join"])
async def test_a_message_read_together_with_the_answer_that_makes_its_address_arrives(
    broker, conns, change
):
    """A sender keeps sending to an address while a connector behind a slow reader makes
    it (registers the fixed address, or joins the group): the first message the broker
    routes can come in the same read as the answer, and must find its service there."""
    sender = await conns[0].register()
    group = meshbus.Multicast("fresh")
    target: meshbus.Address = meshbus.Unicast("fresh", 1) if change == "register" else group
    sending = True

    async def keep_sending() -> None:
        while sending:
            await sender.send(target, b"m")
            await asyncio.sleep(0.001)

    async with (
        batching_proxy(broker.address) as address,
        await meshbus.connect(address, server="fresh") as slow,
    ):
        first = None if change == "register" else await slow.register()
        task = asyncio.create_task(keep_sending())
        try:
            await asyncio.sleep(0.05)
            if first is None:
                receiver = await slow.register(instance=1)
            else:
                await first.join(group)
                receiver = first
            await asyncio.sleep(0.2)
        finally:
            sending = False
            await task
        assert (await receiver.recv(timeout=5)).payload == b"m"
        assert slow.dropped == 0
