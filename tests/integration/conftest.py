"""Fixtures of the integration suites, built on ``helpers.py`` (which test modules import
as ``tests.integration.helpers``); the ``broker`` fixture itself lives in
``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import meshbus
from tests.conftest import BrokerProcess
from tests.integration.helpers import Pair, RawLink


@pytest.fixture
async def conns(broker: BrokerProcess) -> AsyncIterator[list[meshbus.Connector]]:
    """Three connectors to one broker."""
    opened = [await meshbus.connect(broker.address, server=f"srv{i}") for i in range(3)]
    try:
        yield opened
    finally:
        for conn in opened:
            await conn.close()


@pytest.fixture
async def raw_link(broker: BrokerProcess) -> AsyncIterator[RawLink]:
    link = await RawLink.open(broker.address)
    try:
        yield link
    finally:
        await link.close()


@pytest.fixture
async def healthy_pair(broker: BrokerProcess) -> AsyncIterator[Pair]:
    conn_a = await meshbus.connect(broker.address, server="healthya")
    conn_b = await meshbus.connect(broker.address, server="healthyb")
    try:
        pair = Pair(conn_a, conn_b, await conn_a.register(), await conn_b.register())
        await pair.roundtrip()
        yield pair
    finally:
        await conn_a.close()
        await conn_b.close()
