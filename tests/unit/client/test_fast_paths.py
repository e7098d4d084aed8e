"""The fast paths of a service (meshbus.client.service): ``send_nowait``, ``send_many``,
``flush``, ``batches``, inline listeners and ``reply_nowait``, on real connectors over the
fake network. Each delivers exactly the messages sent, in order; each keeps backpressure:
a sender that may not wait is refused (``WouldBlock``) rather than buffering without
bound, and a receiver's inbox never holds more than ``max_inbox``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from meshbus import FrameTooLarge, InvalidArgument, MeshbusError, Message, WouldBlock
from meshbus.client.connector import Connector
from meshbus.client.service import Service
from meshbus.testing import FakeNetwork, FakeTransport, address_of, start_broker
from tests.unit.client.conftest import Connect, received

BROKER = address_of("a")


def numbered(count: int, start: int = 0) -> list[bytes]:
    return [n.to_bytes(4, "big") for n in range(start, start + count)]


def to_sender(network: FakeNetwork, name: str) -> FakeTransport:
    """The transport connector ``name`` writes to its broker on."""
    return network.wire_between(name, BROKER).transports[0]


def count_writes(transport: FakeTransport) -> list[int]:
    """The sizes of the writes to ``transport`` from now on."""
    writes: list[int] = []
    write = transport.write

    def counted(data: bytes | bytearray | memoryview) -> None:
        writes.append(len(data))
        write(data)

    transport.write = counted  # type: ignore[method-assign]
    return writes


@dataclass
class Pair:
    sending: Connector
    sender: Service
    receiving: Connector
    receiver: Service


async def pair(network: FakeNetwork, connect: Connect, *, max_inbox: int = 65536) -> Pair:
    await start_broker(network, "a")
    sending = await connect(BROKER, "sender")
    receiving = await connect(BROKER, "receiver", max_inbox=max_inbox)
    return Pair(sending, await sending.register(), receiving, await receiving.register())


async def test_send_nowait_sends_in_order_without_suspending(
    network: FakeNetwork, connect: Connect
) -> None:
    both = await pair(network, connect)
    sender, receiver = both.sender, both.receiver
    ids = [sender.send_nowait(receiver.address, payload) for payload in numbered(300)]
    assert ids == list(range(ids[0], ids[0] + 300))
    await network.settle()
    assert await received(receiver) == numbered(300)


async def test_send_nowait_refuses_past_the_high_water_mark_and_flush_waits_it_out(
    network: FakeNetwork, connect: Connect
) -> None:
    both = await pair(network, connect)
    sender, receiver = both.sender, both.receiver
    network.wire_between("sender", BROKER).hold()  # the broker reads nothing meanwhile
    accepted: list[bytes] = []
    refused: WouldBlock | None = None
    for payload in numbered(100_000):
        try:
            sender.send_nowait(receiver.address, payload)
        except WouldBlock as exc:
            refused = exc
            break
        accepted.append(payload)
    assert refused is not None
    assert "high-water mark" in str(refused)
    buffered = to_sender(network, "sender").get_write_buffer_size()
    assert 64 * 1024 < buffered < 64 * 1024 + 1024, "refused just past the mark, not later"
    with pytest.raises(WouldBlock):
        sender.send_nowait(receiver.address, b"refused too")

    flushed = asyncio.ensure_future(sender.flush())
    await network.settle()
    assert not flushed.done(), "flush waits while the buffer is over the mark"
    network.wire_between("sender", BROKER).release()
    await network.settle()
    assert flushed.done()
    await flushed
    sender.send_nowait(receiver.address, b"after")
    await network.settle()
    assert await received(receiver) == [*accepted, b"after"], "no loss, no duplicate"


async def test_send_many_writes_once_and_numbers_in_order(
    network: FakeNetwork, connect: Connect
) -> None:
    both = await pair(network, connect)
    sender, receiver = both.sender, both.receiver
    writes = count_writes(to_sender(network, "sender"))
    ids = await sender.send_many(receiver.address, numbered(100))
    await network.settle()
    assert len(writes) == 1, "one write for the whole batch"
    assert len(ids) == 100
    assert await received(receiver) == numbered(100)
    more = await sender.send_many([(receiver.address, b"x"), (str(receiver.address), b"y")])
    assert list(more) == [ids[-1] + 1, ids[-1] + 2]
    await network.settle()
    assert await received(receiver) == [b"x", b"y"]


async def test_send_many_to_several_destinations_keeps_each_one_s_order(
    network: FakeNetwork, connect: Connect
) -> None:
    both = await pair(network, connect)
    sender, receiver = both.sender, both.receiver
    second = await (await connect(BROKER, "second")).register()
    messages = [(receiver if n % 3 else second).address for n in range(90)]
    payloads = numbered(90)
    await sender.send_many(list(zip(messages, payloads, strict=True)))
    await network.settle()
    assert await received(receiver) == [p for n, p in enumerate(payloads) if n % 3]
    assert await received(second) == [p for n, p in enumerate(payloads) if not n % 3]


async def test_send_many_sends_nothing_when_one_payload_is_too_large(
    network: FakeNetwork, connect: Connect
) -> None:
    both = await pair(network, connect)
    sender, receiver = both.sender, both.receiver
    too_large = b"x" * both.sending.max_frame
    with pytest.raises(FrameTooLarge):
        await sender.send_many(receiver.address, [b"fine", too_large])
    await network.settle()
    assert receiver.queued == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda svc: svc.send_many("receiver:1"),
        lambda svc: svc.send_many([b"no destination"], [b"payload"]),
    ],
)
async def test_send_many_says_what_it_takes(
    network: FakeNetwork, connect: Connect, call: Callable[[Service], Awaitable[object]]
) -> None:
    sender = (await pair(network, connect)).sender
    with pytest.raises(InvalidArgument, match="send_many"):
        await call(sender)


async def test_batches_take_what_waits_and_the_inbox_stays_bounded(
    network: FakeNetwork, connect: Connect
) -> None:
    both = await pair(network, connect, max_inbox=50)
    sender, receiver = both.sender, both.receiver
    slow: list[Service] = []
    both.receiving.on_slow_consumer(slow.append)
    for start in range(0, 500, 100):
        await sender.send_many(receiver.address, numbered(100, start))
    await network.settle()
    assert receiver.queued == 50, "the full inbox stopped the reading"
    assert receiver.inbox_fills == 1
    assert slow == [receiver]

    got: list[bytes] = []
    batches = receiver.batches(max_size=20)
    while len(got) < 500:
        batch = await anext(batches)
        assert 1 <= len(batch) <= 20
        got.extend(message.payload for message in batch)
        assert receiver.queued <= 50
        await network.settle()
    assert got == numbered(500), "in order, each once"
    assert receiver.inbox_fills > 1, "it filled again after each drain to half"


async def test_an_inline_listener_answers_a_read_s_requests_in_one_write(
    network: FakeNetwork, connect: Connect
) -> None:
    both = await pair(network, connect)
    requester, responder = both.sender, both.receiver
    answered: list[int] = []

    def answer(message: Message) -> None:
        answered.append(len(answered))
        message.reply_nowait(message.payload * 2)

    responder.add_listener(answer)
    await network.settle()
    writes = count_writes(to_sender(network, "receiver"))
    requests = [
        asyncio.ensure_future(requester.request(responder.address, p)) for p in numbered(20)
    ]
    await network.settle()
    responses = [r.result().payload for r in requests]
    assert responses == [p * 2 for p in numbered(20)]
    assert len(answered) == 20
    assert len(writes) == 1, (
        "the twenty requests came in one read; their answers leave in one write"
    )


async def test_reply_nowait_needs_a_request(network: FakeNetwork, connect: Connect) -> None:
    both = await pair(network, connect)
    sender, receiver = both.sender, both.receiver
    sender.send_nowait(receiver.address, b"plain")
    await network.settle()
    message = await receiver.recv()
    with pytest.raises(MeshbusError, match=r"reply_nowait\(\) needs a request"):
        message.reply_nowait(b"no")
