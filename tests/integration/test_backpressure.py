"""Slow receivers: the broker cuts a slow consumer loose, a connector pushes back."""

from __future__ import annotations

import asyncio
import socket

import meshbus
from tests.conftest import start_broker
from tests.integration.helpers import IO_TIMEOUT, RawLink, data_frame


async def test_slow_consumer_is_closed_and_the_broker_carries_on() -> None:
    broker = await start_broker("--max-pending-bytes", "1048576")
    try:
        consumer = await RawLink.open(broker.address)
        sock = consumer.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await consumer.hello("stuck")
        stuck = await consumer.register("stuck", 1)
        producer = await RawLink.open(broker.address)
        await producer.hello("fast")
        src = await producer.register("fast", 1)
        chunk = data_frame(stuck, src, b"x" * 60_000) * 16  # ~1 MiB per write
        async with await meshbus.connect(broker.address, server="watch") as watcher:
            for _ in range(64):  # far beyond the limit plus what the kernel buffers hold
                await producer.send(chunk)
                stats = await watcher.stat()
                if stats["counters"]["links_closed"].get("slow-consumer"):
                    break
            stats = await watcher.stat()
            assert stats["counters"]["links_closed"] == {"slow-consumer": 1}
            assert "stuck:1" not in stats["service_addresses"]
            # The producer's link and the broker are fine; the stuck address is free again.
            await producer.ping()
            replacement = await watcher.register()
            assert replacement.address.server == "watch"
        consumer.abort()
        await producer.close()
    finally:
        assert await broker.stop() == 0


async def test_full_inbox_pauses_the_link_and_loses_nothing(broker) -> None:  # type: ignore[no-untyped-def]
    async with (
        await meshbus.connect(broker.address, server="sender") as sending,
        await meshbus.connect(broker.address, server="reader", max_inbox=50) as reading,
    ):
        sender = await sending.register()
        reader = await reading.register()
        total = 2_000
        for i in range(total):
            await sender.send(reader.address, i.to_bytes(4, "big"))
        await sending.ping()
        # The reader has not called recv yet: its inbox fills to max_inbox and stops there;
        # the rest waits in the decoder, TCP and broker buffers until it drains.
        async with asyncio.timeout(IO_TIMEOUT):
            while reader.queued < 50:  # noqa: ASYNC110 - no event exists for "inbox full"
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # not synchronisation: time for an overflow to show
        assert reader.queued == 50
        got = [
            int.from_bytes((await reader.recv(timeout=IO_TIMEOUT)).payload, "big")
            for _ in range(total)
        ]
        assert got == list(range(total))
        stats = await reading.stat()
        assert not stats["counters"]["links_closed"]
