"""The fast paths against a real broker process: ``send_nowait`` with ``flush`` as its
backpressure, ``send_many``, ``batches``, an inline listener answering with
``reply_nowait`` -- exactly the messages sent, in order, each once."""

from __future__ import annotations

import asyncio

import meshbus
from tests.conftest import BrokerProcess

IO_TIMEOUT = 10.0


async def test_send_nowait_with_flush_delivers_every_message_in_order_to_batches(
    broker: BrokerProcess,
) -> None:
    async with (
        await meshbus.connect(broker.address, server="sender") as sending,
        await meshbus.connect(broker.address, server="reader", max_inbox=500) as reading,
    ):
        sender = await sending.register()
        reader = await reading.register()
        total = 50_000
        for n in range(total):
            payload = n.to_bytes(4, "big")
            while True:
                try:
                    sender.send_nowait(reader.address, payload)
                    break
                except meshbus.WouldBlock:
                    await sender.flush()
            if n % 1000 == 0:
                await asyncio.sleep(0)  # a game loop's tick: let the loop write and read
        await sending.ping()
        got: list[int] = []
        async with asyncio.timeout(IO_TIMEOUT):
            async for batch in reader.batches(max_size=256):
                assert len(batch) <= 256
                got.extend(int.from_bytes(m.payload, "big") for m in batch)
                if len(got) >= total:
                    break
        assert got == list(range(total))
        assert reader.inbox_fills >= 1, "the reader fell behind: its inbox filled and held"
        stats = await reading.stat()
        assert not stats["counters"]["links_closed"]


async def test_send_many_and_an_inline_responder(broker: BrokerProcess) -> None:
    async with (
        await meshbus.connect(broker.address, server="client") as client_conn,
        await meshbus.connect(broker.address, server="server") as server_conn,
    ):
        client = await client_conn.register()
        first = await server_conn.register()
        second = await server_conn.register()
        got: dict[str, list[bytes]] = {"first": [], "second": []}
        first.add_listener(lambda m: got["first"].append(m.payload))

        def answer(message: meshbus.Message) -> None:
            if message.is_request:
                message.reply_nowait(b"re:" + message.payload)
            else:
                got["second"].append(message.payload)

        second.add_listener(answer)
        pairs = [(first.address if n % 2 else second.address, b"%d" % n) for n in range(1000)]
        ids = await client.send_many(pairs)
        assert len(ids) == 1000
        responses = await asyncio.gather(
            *(client.request(second.address, b"%d" % n, timeout=IO_TIMEOUT) for n in range(100))
        )
        assert [r.payload for r in responses] == [b"re:%d" % n for n in range(100)]
        await client_conn.ping()
        await server_conn.ping()
        assert got["first"] == [b"%d" % n for n in range(1, 1000, 2)]
        assert got["second"] == [b"%d" % n for n in range(0, 1000, 2)]
