"""Headers and JSON payloads, between real connectors through a real broker on the fake
network: every verb that sends carries them, the receiver reads them back, and what
cannot be carried is refused before anything is sent."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from meshbus import FrameTooLarge, InvalidArgument, InvalidPayload, Message, ProtocolError
from meshbus.client.service import Service
from meshbus.protocol.headers import decode_headers, encode_headers
from meshbus.testing import FakeNetwork, address_of, start_broker
from tests.unit.client.conftest import Connect

BROKER = address_of("a")
HEADERS = {"Trace-Id": "4bf92f35", "Player": "Zoë 7", "Empty": ""}


async def services(network: FakeNetwork, connect: Connect) -> tuple[Service, Service]:
    await start_broker(network, "a")
    sender = await (await connect(BROKER, "sender")).register()
    receiver = await (await connect(BROKER, "receiver")).register()
    return sender, receiver


SENDS: dict[str, Callable[[Service, Service, dict[str, Any]], Awaitable[object]]] = {
    "send": lambda s, r, kw: s.send(r.address, **kw),
    "send with a priority": lambda s, r, kw: s.send(r.address, priority=2, **kw),
    "send reliable": lambda s, r, kw: s.send(r.address, reliable=True, **kw),
    "send_reliable": lambda s, r, kw: s.send_reliable(r.address, timeout=5, **kw),
    "publish": lambda s, r, kw: s.publish("scores", **kw),
}


async def _receiver_of(verb: str, receiver: Service) -> None:
    if verb == "publish":
        await receiver.subscribe("scores")


async def _sent(verb: str, network: FakeNetwork, s: Service, r: Service, **kw: Any) -> Message:
    await _receiver_of(verb, r)
    await SENDS[verb](s, r, kw)
    await network.settle()
    assert r.queued == 1
    return await r.recv()


@pytest.mark.parametrize("verb", SENDS)
async def test_headers_arrive_with_the_payload(
    network: FakeNetwork, connect: Connect, verb: str
) -> None:
    sender, receiver = await services(network, connect)
    msg = await _sent(verb, network, sender, receiver, payload=b"hit", headers=HEADERS)
    assert (msg.payload, msg.headers) == (b"hit", HEADERS)


@pytest.mark.parametrize("verb", SENDS)
async def test_json_arrives_as_its_value(network: FakeNetwork, connect: Connect, verb: str) -> None:
    sender, receiver = await services(network, connect)
    value = {"player": 7, "pos": [1.5, -2.0], "name": "zoë", "alive": True, "team": None}
    msg = await _sent(verb, network, sender, receiver, json=value)
    assert msg.json() == value
    assert msg.payload == msgspec.json.encode(value)
    assert msg.headers == {}


async def test_send_nowait_carries_headers_and_json(network: FakeNetwork, connect: Connect) -> None:
    sender, receiver = await services(network, connect)
    sender.send_nowait(receiver.address, json=[1, 2], headers={"K": "v"})
    await network.settle()
    msg = await receiver.recv()
    assert (msg.json(), msg.headers) == ([1, 2], {"K": "v"})


async def test_a_request_and_its_response_carry_headers_and_json(
    network: FakeNetwork, connect: Connect
) -> None:
    client, server = await services(network, connect)
    seen: list[dict[str, str]] = []

    def answer(msg: Message) -> None:
        seen.append(msg.headers)
        msg.reply_nowait(json={"sum": sum(msg.json())}, headers={"Status": "ok"})

    server.add_listener(answer)
    response = await client.request(server.address, json=[1, 2, 3], headers={"Auth": "t"})
    assert seen == [{"Auth": "t"}]
    assert (response.json(), response.headers) == ({"sum": 6}, {"Status": "ok"})
    plain = await client.request(server.address, json=[4])
    assert (plain.json(), plain.headers) == ({"sum": 4}, {"Status": "ok"})
    assert seen[-1] == {}


async def test_an_awaited_reply_carries_headers(network: FakeNetwork, connect: Connect) -> None:
    client, server = await services(network, connect)
    pending = asyncio.create_task(client.request(server.address, b"q"))
    await network.settle()
    await (await server.recv()).reply(b"a", headers={"Served-By": "s1"})
    response = await pending
    assert (response.payload, response.headers) == (b"a", {"Served-By": "s1"})


class Move(msgspec.Struct):
    player: int
    x: float
    y: float


@dataclasses.dataclass
class Chat:
    player: int
    text: str


async def test_decode_validates_into_a_type(network: FakeNetwork, connect: Connect) -> None:
    sender, receiver = await services(network, connect)
    await sender.send(receiver.address, json=Move(7, 1.0, 2.5))
    await sender.send(receiver.address, json=Chat(8, "gg"))
    await sender.send(receiver.address, json={"player": "seven", "x": 0, "y": 0})
    await sender.send(receiver.address, b"\xff not json")
    await network.settle()
    assert (await receiver.recv()).decode(Move) == Move(7, 1.0, 2.5)
    assert (await receiver.recv()).decode(Chat) == Chat(8, "gg")
    wrong = await receiver.recv()
    with pytest.raises(InvalidPayload, match=r"does not fit Move: Expected `int`, got `str`"):
        wrong.decode(Move)
    garbage = await receiver.recv()
    with pytest.raises(InvalidPayload, match="not JSON"):
        garbage.json()
    with pytest.raises(ValueError, match="not JSON"):  # InvalidPayload is a ValueError too
        garbage.decode(Move)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({}, "nothing to send: give a payload"),
        ({"payload": b"x", "json": 1}, "a payload or json=, not both"),
        ({"json": object()}, "json= cannot be encoded as JSON"),
        ({"payload": b"x", "headers": {"bad name": "v"}}, "header name 'bad name' is not a token"),
        ({"payload": b"x", "headers": {"a:b": "v"}}, "is not a token"),
        ({"payload": b"x", "headers": {"": "v"}}, "is not a token"),
        ({"payload": b"x", "headers": {"K": "a\r\nInjected: 1"}}, "may not contain CR or LF"),
        ({"payload": b"x", "headers": {"K": b"v"}}, "a value is text, not bytes; decode it"),
        ({"payload": b"x", "headers": [("K", "v")]}, "headers= is a mapping"),
    ],
)
@pytest.mark.parametrize("verb", SENDS)
async def test_what_cannot_be_carried_is_refused_before_sending(
    network: FakeNetwork, connect: Connect, verb: str, kwargs: dict[str, Any], error: str
) -> None:
    sender, receiver = await services(network, connect)
    await _receiver_of(verb, receiver)
    with pytest.raises(InvalidArgument, match=error):
        await SENDS[verb](sender, receiver, kwargs)
    await network.settle()
    assert receiver.queued == 0


async def test_headers_count_toward_the_frame_limit(network: FakeNetwork, connect: Connect) -> None:
    sender, receiver = await services(network, connect)
    with pytest.raises(InvalidArgument, match=r"headers of 40,\d+ bytes: at most 32,768"):
        await sender.send(receiver.address, b"x", headers={"Big": "v" * 40_000})
    with pytest.raises(FrameTooLarge):
        await sender.send(receiver.address, b"x" * (1 << 20), headers={"Big": "v" * 30_000})
    await network.settle()
    assert receiver.queued == 0


def test_a_header_block_is_the_nats_format() -> None:
    block = encode_headers({"A": "1", "B-c": "x y"})
    assert block == b"NATS/1.0\r\nA: 1\r\nB-c: x y\r\n\r\n"
    assert decode_headers(block) == {"A": "1", "B-c": "x y"}
    # A NATS status line, and a name given twice (joined, as HTTP does).
    assert decode_headers(b"NATS/1.0 503\r\nA: 1\r\nA: 2\r\n\r\n") == {"A": "1, 2"}
    assert encode_headers({}) == encode_headers(None) == b""


@pytest.mark.parametrize(
    "block",
    [
        b"HTTP/1.1\r\n\r\n",
        b"NATS/1.0\r\nA: 1\r\n",
        b"NATS/1.0\r\nno colon\r\n\r\n",
        b"NATS/1.0\r\n\xff: 1\r\n\r\n",
    ],
)
def test_a_malformed_header_block_is_a_protocol_error(block: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed header"):
        decode_headers(block)
