"""A listener that raises -- a plain function or a coroutine function -- is logged once,
naming the service and the message, with the traceback; it goes on with the next
message, and asyncio never reports an unretrieved task exception."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from meshbus import Message
from meshbus.testing import FakeNetwork, address_of, start_broker
from tests.unit.client.conftest import Connect

BROKER = address_of("a")


@pytest.mark.parametrize("kind", ["plain", "coroutine"])
async def test_a_failing_listener_is_logged_with_its_service_and_message_and_goes_on(
    network: FakeNetwork, connect: Connect, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    await start_broker(network, "a")
    sender = await (await connect(BROKER, "sender")).register()
    receiver = await (await connect(BROKER, "receiver")).register()
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unretrieved.append(context))
    seen: list[bytes] = []

    def plain(msg: Message) -> None:
        seen.append(msg.payload)
        if msg.payload == b"bad":
            raise ValueError("the listener's own bug")

    async def coroutine(msg: Message) -> None:
        plain(msg)

    receiver.add_listener(plain if kind == "plain" else coroutine)
    with caplog.at_level(logging.ERROR, logger="meshbus.client"):
        for payload in (b"bad", b"good"):
            await sender.send(receiver.address, payload)
        await network.settle()
    assert seen == [b"bad", b"good"]
    failures = [r for r in caplog.records if "listener" in r.getMessage()]
    assert len(failures) == 1, caplog.text
    text = failures[0].getMessage()
    assert f"a message listener of {receiver.address} failed on" in text
    assert f"{sender.address} -> {receiver.address} 3 bytes" in text
    assert failures[0].exc_info is not None
    assert "the listener's own bug" in caplog.text
    assert unretrieved == []
