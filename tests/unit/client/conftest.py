"""Real connectors on the fake network (meshbus.testing.connect_over), closed after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from meshbus.broker.server import Broker
from meshbus.client.connector import Connector
from meshbus.client.service import Service
from meshbus.testing import FakeNetwork, connect_over

Connect = Callable[..., Awaitable[Connector]]


@pytest.fixture
async def connect(network: FakeNetwork) -> AsyncIterator[Connect]:
    """``await connect(brokers, name, **options)``: ``connect_over`` on the test's
    network; every connector it made is closed when the test ends."""
    made: list[Connector] = []

    async def connect(brokers: str | Sequence[str], name: str, **options: Any) -> Connector:
        conn = await connect_over(network, brokers, name, **options)
        made.append(conn)
        return conn

    yield connect
    for conn in made:
        await conn.close()
    await network.settle()


async def received(service: Service) -> list[bytes]:
    """The payloads waiting in ``service``'s inbox, taken."""
    got = []
    while service.queued:
        got.append((await service.recv()).payload)
    return got


def served_by(brokers: Sequence[Broker], name: str) -> dict[str, str | None]:
    """What ``meshbus.testing.routes_everywhere`` says of an address that broker ``name``
    serves: "local" there, ``name`` on every other broker."""
    return {b.config.name: "local" if b.config.name == name else name for b in brokers}
