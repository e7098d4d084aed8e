"""A durable stream and a consumer that acknowledges what it has done.

    python examples/durable_consumer.py

A stream captures everything published to ``orders``; it lives on the broker's disk
(with ``--data-dir``) and outlives every connector. A durable consumer reads it in
batches and acknowledges each message once handled; one not acknowledged within
``ack_wait`` seconds comes again (``delivery`` counts the tries), so a worker that dies
mid-batch loses nothing.
"""

from __future__ import annotations

import asyncio

import meshbus


async def main() -> None:
    async with meshbus.connect(server="shop") as conn:
        info = await conn.streams.add("orders", "multicast:orders", max_msgs=10_000)
        print(f"stream {info.name} on broker {info.broker}, {info.messages} messages so far")
        start = info.last_seq + 1
        for n in range(5):
            order = {"order": n}
            await conn.publish("orders", json=order, headers={"Shop": "north"}, reliable=True)
        await conn.wait_acked(10)  # a stream acknowledges a reliable message once stored
        consumer = await conn.streams.consumer("orders", "billing", ack_wait=1.0)
        handled = 0
        while batch := await consumer.next(2):
            for msg in batch:
                if msg.seq >= start:
                    print(f"#{msg.seq} {msg.json()} from {msg.headers['Shop']}, try {msg.delivery}")
                    handled += 1
            await consumer.ack(batch)
        print(f"handled {handled}; pending now: {(await consumer.info())['pending']}")


if __name__ == "__main__":
    asyncio.run(main())
