"""A signed-in user with few rights, against real brokers with users signing in with key
pairs (docs/security.md, "Permissions"): it can do all that its rights name -- ordered
and reliable sends to a group it may send to -- and nothing beyond them: not read
another's traffic through a stream, not take another user's durable consumer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import Credentials
from meshbus.protocol.ext import Ext, wrap
from meshbus.protocol.layout import FLAG_EXT, FLAG_NOTIFY_DROP, FLAG_RELIABLE
from tests.conftest import BrokerProcess, start_broker
from tests.integration.helpers import ACK_TIMEOUT, Collector, broker_key, user_with, wait_until

SHOP, WORKER, OPS = (Credentials.generate(name) for name in ("shop", "worker", "ops"))
ORDERS = meshbus.Anycast("orders")


@asynccontextmanager
async def users_mesh(
    tmp_path: Path, count: int, users: Callable[[], str]
) -> AsyncIterator[list[BrokerProcess]]:
    """``count`` brokers sharing one config file with ``users()`` and the brokers' keys."""
    keys = [broker_key(tmp_path, f"b{index}") for index in range(1, count + 1)]
    config = tmp_path / "broker.toml"
    config.write_text(users() + "".join(key.entry for key in keys))
    brokers = [await start_broker("--config", str(config), *keys[0].args)]
    try:
        for key in keys[1:]:
            seed = ("--seed", brokers[0].address)
            brokers.append(await start_broker("--config", str(config), *key.args, *seed))
        yield brokers
    finally:
        codes = await asyncio.gather(*(b.stop() for b in brokers))
        assert all(code in (0, -9) for code in codes), codes


async def counters(broker: BrokerProcess) -> dict[str, int]:
    async with await meshbus.connect(broker.address, server="stat", credentials=OPS) as conn:
        found = (await conn.stat(detail=False))["counters"]
    assert isinstance(found, dict)
    return found


# -- item 12: sending to a group reaches the member the mesh chose --------------------------


def shop_and_workers() -> str:
    """The rights docs/security.md names for a sender to a group: ``send`` on the group and
    on its own address; the workers may join the group."""
    return (
        user_with(OPS, 'operator = ["*"]')
        + user_with(SHOP, 'register = ["shop"]\nsend = ["anycast:orders", "shop:*"]')
        + user_with(WORKER, 'register = ["worker"]\njoin = ["anycast:orders"]')
    )


async def test_group_and_reliable_anycast_sends_need_only_the_groups_right(
    tmp_path: Path,
) -> None:
    async with (
        users_mesh(tmp_path, 3, shop_and_workers) as brokers,
        await meshbus.connect(brokers[0].address, server="shop", credentials=SHOP) as shop,
        await meshbus.connect(brokers[1].address, server="worker", credentials=WORKER) as w2,
        await meshbus.connect(brokers[2].address, server="worker", credentials=WORKER) as w3,
    ):
        sender = await shop.register(1)
        members = [await w2.register(2), await w3.register(3)]
        outsider = await w2.register(9)  # a worker's address, in no group
        for member in members:
            await member.join(ORDERS)
        collectors = [Collector(member) for member in members]
        sends = 60
        for index in range(sends):
            await sender.send_reliable(ORDERS, b"g%d" % index, group=f"order-{index % 6}")
            await sender.send_reliable(ORDERS, b"r%d" % index)

        async def all_delivered() -> bool:
            return sum(len(c.messages) for c in collectors) == 2 * sends

        await wait_until(all_delivered, "every group and reliable anycast send", ACK_TIMEOUT)
        for collector in collectors:
            collector.stop()
        # The group's right covers the member the mesh chose, for that group only.
        with pytest.raises(meshbus.PermissionDenied, match="may not send to worker:2"):
            await sender.send_reliable(members[0].address, b"direct")
        # A frame that says it is for the group, sent to an address not in it: no route.
        forged = wrap(Ext(origin=ORDERS.to_bytes()), b"forged")
        before = (await counters(brokers[0]))["dropped_no_route"]
        await shop._parts.outbound.write_data(  # a hand-made frame
            outsider.address.to_bytes(),
            sender.address.to_bytes(),
            forged,
            FLAG_RELIABLE | FLAG_NOTIFY_DROP | FLAG_EXT,
            1 << 40,
        )

        async def dropped() -> bool:
            return (await counters(brokers[0]))["dropped_no_route"] > before

        await wait_until(dropped, "the forged group copy dropped")
        with pytest.raises(meshbus.Timeout):
            await outsider.recv(timeout=0.3)
