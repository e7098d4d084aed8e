"""The broker forwards data frames as the very bytes it read (hot-path discipline)."""

from __future__ import annotations

import asyncio

from meshbus.protocol import DataFlags
from tests.integration.helpers import IO_TIMEOUT, RawLink, data_frame


async def read_exactly(link: RawLink, size: int) -> bytes:
    async with asyncio.timeout(IO_TIMEOUT):
        return await link.reader.readexactly(size)


async def test_frames_arrive_byte_for_byte(broker) -> None:  # type: ignore[no-untyped-def]
    receiver = await RawLink.open(broker.address)
    await receiver.hello("rx")
    rx = await receiver.register("rx", 1)
    sender = await RawLink.open(broker.address)
    await sender.hello("tx")
    tx = await sender.register("tx", 1)
    # Odd header fields the broker has no business touching, payloads of several sizes,
    # a burst with one routing key and frames that interleave keys.
    frames = [
        data_frame(rx, tx, bytes([i % 251]) * size, msg_id=7 + i, hops=0, link_tag=0xDEADBEEF)
        for i, size in enumerate([0, 1, 16, 16, 16, 1000, 16, 65536, 3])
    ]
    frames += [data_frame(rx, tx, b"e", msg_id=99, flags=int(DataFlags.NOTIFY_DROP))]
    await sender.send(b"".join(frames))
    got = await read_exactly(receiver, sum(len(f) for f in frames))
    assert got == b"".join(frames)
    await sender.close()
    await receiver.close()
