"""What a payload may be: any bytes-like object, sent as its bytes (a memoryview by its
bytes whatever its item size); anything else -- text above all -- is refused with
``InvalidArgument`` before anything is sent, by every verb that takes a payload."""

from __future__ import annotations

import array
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from meshbus import InvalidArgument
from meshbus.client.service import Service
from meshbus.testing import FakeNetwork, address_of, start_broker
from tests.unit.client.conftest import Connect

BROKER = address_of("a")

VERBS: dict[str, Callable[[Service, Service, Any], Awaitable[object]]] = {
    "send": lambda s, r, p: s.send(r.address, p),
    "send with a priority": lambda s, r, p: s.send(r.address, p, priority=3),
    "send reliable": lambda s, r, p: s.send(r.address, p, reliable=True),
    "send_reliable": lambda s, r, p: s.send_reliable(r.address, p, timeout=5),
    "send_many": lambda s, r, p: s.send_many(r.address, [p]),
    "request": lambda s, r, p: s.request(r.address, p, timeout=0.5),
}


async def services(network: FakeNetwork, connect: Connect) -> tuple[Service, Service]:
    await start_broker(network, "a")
    sender = await (await connect(BROKER, "sender")).register()
    receiver = await (await connect(BROKER, "receiver")).register()
    return sender, receiver


@pytest.mark.parametrize("verb", VERBS)
async def test_text_is_refused_with_a_hint(
    network: FakeNetwork, connect: Connect, verb: str
) -> None:
    sender, receiver = await services(network, connect)
    with pytest.raises(InvalidArgument, match=r"not str: encode the text first"):
        await VERBS[verb](sender, receiver, "hello")
    with pytest.raises(InvalidArgument, match=r"not int"):
        await VERBS[verb](sender, receiver, 5)
    with pytest.raises(InvalidArgument, match=r"not str"):
        sender.send_nowait(receiver.address, "hello")  # type: ignore[arg-type]
    await network.settle()
    assert receiver.queued == 0


async def test_bytes_like_payloads_arrive_as_their_bytes(
    network: FakeNetwork, connect: Connect
) -> None:
    sender, receiver = await services(network, connect)
    ints = array.array("i", [1, 2, 3])  # a memoryview of it has 3 items of 4 bytes
    payloads = [bytearray(b"bytearray"), memoryview(b"memoryview"), memoryview(ints)]
    for payload in payloads:
        await sender.send(receiver.address, payload)
    sender.send_nowait(receiver.address, bytearray(b"nowait"))
    await sender.send(receiver.address, memoryview(b"with ext"), priority=1)
    await network.settle()
    got = [(await receiver.recv()).payload for _ in range(5)]
    assert got == [b"bytearray", b"memoryview", ints.tobytes(), b"nowait", b"with ext"]


async def test_a_reply_takes_bytes_like_and_refuses_text(
    network: FakeNetwork, connect: Connect
) -> None:
    sender, receiver = await services(network, connect)

    async def answer() -> None:
        request = await receiver.recv()
        with pytest.raises(InvalidArgument, match="not str"):
            await request.reply("text")  # type: ignore[arg-type]
        await request.reply(bytearray(b"ok"))

    answering = asyncio.create_task(answer())
    response = await sender.request(receiver.address, b"?", timeout=5)
    await answering
    assert response.payload == b"ok"
