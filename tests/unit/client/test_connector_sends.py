"""The connector sends, publishes and requests without a service of the caller's: from
one dynamic address of its own, registered by the first of them, real connectors through
a real broker on the fake network."""

from __future__ import annotations

import asyncio

import pytest

from meshbus import Message, NotConnected, Unicast
from meshbus.testing import FakeNetwork, address_of, start_broker
from tests.unit.client.conftest import Connect

BROKER = address_of("a")


async def test_send_publish_and_request_go_out_from_one_own_address(
    network: FakeNetwork, connect: Connect
) -> None:
    await start_broker(network, "a")
    server = await (await connect(BROKER, "server")).register()
    await server.subscribe("news")
    server.add_listener(lambda m: m.reply_nowait(json=m.json()) if m.is_request else None)
    seen: list[Message] = []
    server.add_listener(seen.append)
    conn = await connect(BROKER, "game")
    assert conn.services == []

    sent = await asyncio.gather(*(conn.send(server.address, b"%d" % i) for i in range(5)))
    assert len(set(sent)) == 5
    await conn.publish("news", json={"headline": "patch 1.2"}, headers={"Lang": "en"})
    response = await conn.request(server.address, json=[1, 2])
    await network.settle()

    assert [m.payload for m in seen[:5]] == [b"0", b"1", b"2", b"3", b"4"]
    published = seen[5]
    assert (published.subject, published.json(), published.headers) == (
        "news",
        {"headline": "patch 1.2"},
        {"Lang": "en"},
    )
    assert published.src.server == "nats"  # a subject's message: from the broker's bridge
    assert response.json() == [1, 2]
    (own,) = conn.services  # concurrent first sends registered one address
    assert isinstance(own.address, Unicast)
    assert own.address.server == "game"
    assert {m.src for m in seen if m is not published} == {own.address}


async def test_what_comes_to_the_own_address_is_dropped_without_pausing_the_link(
    network: FakeNetwork, connect: Connect
) -> None:
    await start_broker(network, "a")
    echo = await (await connect(BROKER, "echo")).register()
    echo.add_listener(lambda m: m.reply_nowait(m.payload) if m.is_request else None)
    conn = await connect(BROKER, "game", max_inbox=4)
    await conn.send(echo.address, b"hello")
    await network.settle()
    (own,) = conn.services
    for _ in range(3 * 4):  # three inboxes' worth: a queue would have paused the link
        await echo.send(own.address, b"to nobody")
    await network.settle()
    assert conn.dropped == 12
    assert (await conn.request(echo.address, b"still here")).payload == b"still here"


async def test_a_closed_connector_refuses_to_send(network: FakeNetwork, connect: Connect) -> None:
    await start_broker(network, "a")
    conn = await connect(BROKER, "game")
    await conn.close()
    with pytest.raises(NotConnected):
        await conn.send("multicast:news", b"late")
