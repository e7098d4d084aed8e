"""A signed-in user with few rights, against real brokers with users signing in with key
pairs (docs/security.md, "Permissions"): it can do all that its rights name -- ordered
and reliable sends to a group it may send to -- and nothing beyond them: not read
another's traffic through a stream, not take another user's durable consumer."""

from __future__ import annotations

import asyncio
import signal
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


# -- item 7: a stream captures only what its user may join ----------------------------------

ALICE, MALLORY = (Credentials.generate(name) for name in ("alice", "mallory"))
STREAM_USER = 'register = ["{0}"]\nstreams = {{ add = ["*"], read = ["*"], consume = ["*"] }}'


def capture_rights(alice_joins: str = '["multicast:team"]') -> str:
    """alice may join ``alice_joins``, mallory nothing; both may add and read streams."""
    return (
        user_with(OPS, 'operator = ["*"]\nstreams = { read = ["*"], consume = ["*"] }')
        + user_with(SHOP, 'register = ["shop"]\nsend = ["multicast:*"]')
        + user_with(ALICE, STREAM_USER.format("alice") + f"\njoin = {alice_joins}")
        + user_with(MALLORY, STREAM_USER.format("mallory"))
    )


async def reload(broker: BrokerProcess, config: Path, text: str) -> None:
    """Rewrite the config file, SIGHUP, and wait until the reload is applied."""
    before = (await counters(broker))["config_reloads"]
    await asyncio.to_thread(config.write_text, text)
    broker.process.send_signal(signal.SIGHUP)

    async def applied() -> bool:
        return (await counters(broker))["config_reloads"] > before

    await wait_until(applied, "the reload applied")


async def paused(broker: BrokerProcess) -> dict[str, list[str]]:
    async with await meshbus.connect(broker.address, server="stat", credentials=OPS) as conn:
        found = (await conn.stat())["streams"]["paused"]
    assert isinstance(found, dict)
    return found


async def test_a_stream_captures_only_groups_its_user_may_join(tmp_path: Path) -> None:
    team = meshbus.Multicast("team")
    async with users_mesh(tmp_path, 1, capture_rights) as (broker,):
        config = tmp_path / "broker.toml"
        keys = config.read_text()[len(capture_rights()) :]  # the [[brokers]] entries
        async with (
            await meshbus.connect(broker.address, server="mallory", credentials=MALLORY) as mal,
            await meshbus.connect(broker.address, server="alice", credentials=ALICE) as alice,
            await meshbus.connect(broker.address, server="shop", credentials=SHOP) as shop,
        ):
            with pytest.raises(meshbus.PermissionDenied) as caught:
                await mal.streams.add("spy", team)
            assert str(caught.value) == (
                "permission denied: user 'mallory' may not add stream 'spy' capturing "
                "multicast:team (capturing a group takes the right to join it) "
                "(permissions.join)"
            )
            assert "spy" not in [s["name"] for s in await alice.streams.list()]
            await alice.streams.add("team-log", team)
            assert (await mal.streams.info("team-log")).owner == "alice"
            sender = await shop.register(1)

            async def stored(count: int) -> None:
                async def enough() -> bool:
                    return len(await alice.streams.fetch("team-log")) == count

                await wait_until(enough, f"{count} messages stored")

            await sender.send_reliable(team, b"1")
            await stored(1)
            # alice loses the right: the stream stops capturing the group, and keeps
            # what it stored.
            await reload(broker, config, capture_rights("[]") + keys)
            assert await paused(broker) == {"team-log": ["multicast:team"]}
            await sender.send(team, b"2")
            # The right back: it captures again.
            await reload(broker, config, capture_rights() + keys)
            assert await paused(broker) == {}
            await sender.send_reliable(team, b"3")
            await stored(2)
            assert [m.payload for m in await alice.streams.fetch("team-log")] == [b"1", b"3"]


# -- item 8: a durable consumer is its maker's ----------------------------------------------


def consumer_rights() -> str:
    """alice and mallory may consume every stream; ops has the operator right
    "consumers"."""
    return (
        user_with(OPS, 'operator = ["*"]\nstreams = { read = ["*"], consume = ["*"] }')
        + user_with(SHOP, 'register = ["shop"]\nsend = ["multicast:*"]')
        + user_with(ALICE, STREAM_USER.format("alice") + '\njoin = ["multicast:jobs"]')
        + user_with(MALLORY, STREAM_USER.format("mallory"))
    )


async def test_only_its_maker_or_an_operator_uses_a_durable_consumer(tmp_path: Path) -> None:
    jobs = meshbus.Multicast("jobs")
    async with (
        users_mesh(tmp_path, 2, consumer_rights) as brokers,
        # The stream is hosted by the first broker; mallory and ops ask the second,
        # which relays their requests there.
        await meshbus.connect(brokers[0].address, server="alice", credentials=ALICE) as alice,
        await meshbus.connect(brokers[1].address, server="mallory", credentials=MALLORY) as mal,
        await meshbus.connect(brokers[1].address, server="stat", credentials=OPS) as ops,
        await meshbus.connect(brokers[0].address, server="shop", credentials=SHOP) as shop,
    ):
        await alice.streams.add("jobs", jobs)
        sender = await shop.register(1)
        for payload in (b"a", b"b"):
            await sender.send_reliable(jobs, payload)
        mine = await alice.streams.consumer("jobs", "worker")
        (first,) = await mine.next(max_count=1)
        taken = mal.streams.bind_consumer("jobs", "worker")  # not made: mallory's handle
        denied = "user 'mallory' may not {} consumer 'worker' of stream 'jobs': user 'alice'"
        for op, call in [
            ("consumer_add", lambda: mal.streams.consumer("jobs", "worker")),
            ("next", lambda: taken.next()),
            ("ack", lambda: taken.ack([first.seq])),
            ("consumer_info", lambda: taken.info()),
            ("consumer_delete", lambda: taken.delete()),
        ]:
            with pytest.raises(meshbus.PermissionDenied, match=denied.format(op)):
                await call()
        # Nothing of it moved: alice's pending delivery is still hers to ack.
        assert await mine.ack([first]) == 1
        # mallory makes one of its own on the same stream.
        theirs = await mal.streams.consumer("jobs", "mallory")
        assert [m.payload for m in await theirs.next()] == [b"a", b"b"]
        # The operator right "consumers" may use and delete anyone's.
        as_ops = ops.streams.bind_consumer("jobs", "worker")
        assert [m.payload for m in await as_ops.next()] == [b"b"]
        await as_ops.delete()
        with pytest.raises(meshbus.StreamError, match="consumer"):
            await mine.next()
