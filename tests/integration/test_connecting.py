"""``meshbus.connect`` as a user reaches for it: awaited, entered, or run as a task; and a
service that unregisters itself at the end of its block."""

from __future__ import annotations

import asyncio

import pytest

import meshbus
from tests.conftest import BrokerProcess


async def test_connect_is_an_async_context_manager_that_closes(broker: BrokerProcess) -> None:
    async with meshbus.connect(broker.address, server="ctx") as conn:
        assert isinstance(conn, meshbus.Connector)
        svc = await conn.register()
        await svc.send(svc.address, b"to myself")
        assert (await svc.recv(timeout=5)).payload == b"to myself"
    with pytest.raises(meshbus.NotConnected):
        await svc.send(svc.address, b"after the block")


async def test_connect_is_awaited_entered_after_await_or_run_as_a_task(
    broker: BrokerProcess,
) -> None:
    async with await meshbus.connect(broker.address, server="ctx") as conn:
        assert isinstance(conn, meshbus.Connector)
    in_a_task = await asyncio.create_task(meshbus.connect(broker.address, server="ctx"))
    await in_a_task.ping()
    await in_a_task.close()


async def test_a_refused_connect_in_a_block_raises_and_closes_nothing(
    broker: BrokerProcess,
) -> None:
    with pytest.raises(meshbus.InvalidArgument, match="server name"):
        async with meshbus.connect(broker.address, server="a name far too long"):
            pytest.fail("the block ran without a connector")


async def test_a_service_block_unregisters_it(broker: BrokerProcess) -> None:
    async with meshbus.connect(broker.address, server="ctx") as conn:
        async with await conn.register(5) as svc:
            assert svc.address == meshbus.Unicast("ctx", 5)
        # Its fixed address is free again: a second registration takes it.
        async with await conn.register(5) as again:
            assert again.address == svc.address
            await again.unregister()  # unregistered inside the block: the exit lets it be


async def test_connectors_given_one_list_spread_over_its_brokers(
    mesh3: list[BrokerProcess],
) -> None:
    """As NATS clients do: twelve processes started with one list do not all land on its
    first broker (all twelve there by chance: (1/3)^11, about 6 in a million); with
    ``randomize_brokers=False`` they do, in the order given."""
    addresses = [b.address for b in mesh3]
    spread = [await meshbus.connect(addresses, server=f"s{i}") for i in range(12)]
    in_order = [
        await meshbus.connect(addresses, server=f"o{i}", randomize_brokers=False) for i in range(4)
    ]
    try:
        assert len({conn.broker_name for conn in spread}) > 1
        assert {conn.broker_name for conn in in_order} == {mesh3[0].name}
    finally:
        for conn in [*spread, *in_order]:
            await conn.close()
