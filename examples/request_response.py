"""Request/response: a pool of responders behind one anycast address, and a client.

    meshbus broker --listen 127.0.0.1:7400 &
    python examples/request_response.py

The broker comes from MESHBUS_BROKER (default 127.0.0.1:7400). Two responders join
``anycast:prices``; each request goes to exactly one of them, and its response comes back
to the requester -- from whichever responder took it. A request nobody can answer is
``NoRoute``; one nobody answers in time is ``Timeout``: neither ever hangs.
"""

from __future__ import annotations

import asyncio

import msgspec

import meshbus

PRICES = {"sword": 120, "shield": 80, "potion": 5}


class Quote(msgspec.Struct):
    item: str
    price: int
    served_by: str


async def responder(conn: meshbus.Connector, instance: int) -> None:
    service = await conn.register(instance=instance)
    await service.join(meshbus.Anycast("prices"))

    def answer(msg: meshbus.Message) -> None:
        item = msg.json()["item"]
        quote = Quote(item, PRICES.get(item, -1), str(service.address))
        msg.reply_nowait(json=quote)  # inline from the read: no task per request

    service.add_listener(answer)


async def main() -> None:
    async with meshbus.connect(server="shop") as shop, meshbus.connect(server="player") as player:
        await responder(shop, 1)
        await responder(shop, 2)
        for item in PRICES:
            response = await player.request(meshbus.Anycast("prices"), json={"item": item})
            quote = response.decode(Quote)
            print(f"{quote.item}: {quote.price} gold (from {quote.served_by})")
        try:
            await player.request(meshbus.Anycast("nobody"), b"?", timeout=1)
        except meshbus.NoRoute as exc:
            print(f"no route: {exc}")


if __name__ == "__main__":
    asyncio.run(main())
