"""The client's log lines say what happened in their text -- what a default
``logging.basicConfig()`` prints -- and keep the fields in the record for JSON logging."""

from __future__ import annotations

import logging

import pytest

from meshbus import Unicast
from meshbus.testing import FakeNetwork, address_of, start_broker
from tests.unit.client.conftest import Connect

BROKER = address_of("a")


async def test_an_undeliverable_message_names_source_destination_and_reason(
    network: FakeNetwork, connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    await start_broker(network, "a")
    sender = await (await connect(BROKER, "sender")).register()
    nobody = Unicast("nobody", 7)
    with caplog.at_level(logging.WARNING, logger="meshbus.client"):
        msg_id = await sender.send(nobody, b"x", notify=True)
        await network.settle()
    records = [r for r in caplog.records if "undeliverable" in r.getMessage()]
    assert len(records) == 1, caplog.text
    text = records[0].getMessage()
    assert text.startswith(
        f"undeliverable message {sender.address} -> {nobody} (msg id {msg_id}): "
    )
    assert text.endswith(f"no service is registered at or member of {nobody}"), text
    assert records[0].__dict__["dst"] == str(nobody)
