"""What a connector sees of a refusal by permissions (docs/security.md, "Permissions"):
``meshbus.PermissionDenied`` from the call, at once, and a link that stays usable.

The broker runs in this process on a real socket, so the test can give a link its
permissions itself (``Link.permissions``) right after the connector connects, as the
sign-in does when a link opens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import Credentials
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core import outbox
from meshbus.broker.security.permissions import Permissions
from meshbus.broker.server import Broker
from tests.conftest import start_broker
from tests.integration.helpers import broker_key

# Every denied call must fail well before the client's own timeouts (5 s) would.
QUICK = 2.0


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    broker = Broker(BrokerConfig(port=0))
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


async def connect_as(broker: Broker, table: Mapping[str, object]) -> meshbus.Connector:
    """A connector whose link has the permissions of user ``game`` from ``table``."""
    conn = await meshbus.connect(broker.address, server="game01", name="game")
    (link,) = [link for link in broker.links.connectors if link.name == "game"]
    link.permissions = Permissions.from_table(table, "game")
    return conn


async def test_refused_control_calls_raise_permission_denied(broker: Broker) -> None:
    table = {"register": ["game*"], "streams": {"read": ["scores"]}}
    async with await connect_as(broker, table) as conn:
        service = await conn.register()
        with pytest.raises(meshbus.PermissionDenied) as caught:
            await service.join(meshbus.Multicast("admin"))
        assert str(caught.value) == (
            "permission denied: user 'game' may not join multicast:admin (permissions.join)"
        )
        assert isinstance(caught.value, PermissionError)
        with pytest.raises(meshbus.PermissionDenied, match=r"permissions\.streams\.read"):
            await conn.streams.fetch("orders")
        with pytest.raises(meshbus.PermissionDenied, match="'stat-detail'"):
            await conn.stat()
        with pytest.raises(meshbus.PermissionDenied, match="'drain'"):
            await conn.drain_broker()
        await conn.ping()
        await conn.register(7)  # still usable, and allowed its own server name


async def test_a_denied_register_of_another_server_name(broker: Broker) -> None:
    conn = await meshbus.connect(broker.address, server="login", name="game")
    (link,) = list(broker.links.connectors)
    link.permissions = Permissions.from_table({"register": ["game*"]}, "game")
    try:
        with pytest.raises(meshbus.PermissionDenied, match="may not register login:1"):
            await conn.register(1)
    finally:
        await conn.close()


async def test_denied_requests_and_reliable_sends_fail_at_once(broker: Broker) -> None:
    async with await meshbus.connect(broker.address, server="login") as login:
        server = await login.register(1)
        await server.join(meshbus.Multicast("admin"))
        table = {"register": ["game*"], "send": ["multicast:chat"]}
        async with await connect_as(broker, table) as conn:
            service = await conn.register()
            async with asyncio.timeout(QUICK):
                with pytest.raises(meshbus.PermissionDenied, match=r"permissions\.request"):
                    await service.request(server.address, b"?")
                with pytest.raises(meshbus.PermissionDenied, match="may not send to login:1"):
                    await service.send_reliable(server.address, b"!")
                # A reliable multicast asks for the members first, which takes send too.
                with pytest.raises(meshbus.PermissionDenied, match="multicast:admin"):
                    await service.send_reliable(meshbus.Multicast("admin"), b"!")
            loop = asyncio.get_running_loop()
            failed: asyncio.Future[meshbus.DeliveryFailed] = loop.create_future()
            undeliverable: asyncio.Future[meshbus.Undeliverable] = loop.create_future()
            conn.on_delivery_failed(failed.set_result)
            conn.on_undeliverable(undeliverable.set_result)
            await service.send(server.address, b"bulk", reliable=True)
            await service.send(server.address, b"told", notify=True)
            async with asyncio.timeout(QUICK):
                assert "may not send to login:1 (permissions.send)" in str(await failed)
                assert (await undeliverable).reason == (
                    "permission denied: user 'game' may not send to login:1 (permissions.send)"
                )
        assert broker.stats.dropped_denied == 4, "request, two reliable sends, notified send"


async def test_each_request_of_a_denied_burst_fails_at_once(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests pipelined to where the user may not send are refused in one read; the
    client asks for NO_ROUTE in batches (``HELLO.batched_no_route``) and fails each
    request of a batch, not only the first."""
    batches: list[int] = []
    frame = outbox._Batch.frame

    def counted(batch: outbox._Batch) -> bytes:
        batches.append(len(batch.msg_ids))
        return frame(batch)

    monkeypatch.setattr(outbox._Batch, "frame", counted)
    async with await meshbus.connect(broker.address, server="login") as login:
        server = await login.register(1)
        async with await connect_as(broker, {"register": ["game*"]}) as conn:
            service = await conn.register()
            async with asyncio.timeout(QUICK):
                failures = await asyncio.gather(
                    *(service.request(server.address, b"?") for _ in range(100)),
                    return_exceptions=True,
                )
    assert all(isinstance(failure, meshbus.PermissionDenied) for failure in failures)
    assert sum(batches) == 100
    assert max(batches) > 1, batches


# -- a broker process with its config file ----------------------------------------------------


async def test_a_brokers_config_gives_each_signed_in_user_its_permissions(tmp_path: Path) -> None:
    """The attacker's squat and eavesdrop of the issue, against a real broker with users:
    a user not allowed ``login`` cannot take ``login:1`` before the real service starts,
    nor send to it, join an admin topic, or read the broker's stat."""
    game, login = Credentials.generate("game"), Credentials.generate("login")
    config = tmp_path / "broker.toml"
    config.write_text(
        broker_key(tmp_path, "b1").settings
        + f'[[users]]\nname = "game"\npublic_key = "{game.public_key}"\n'
        "[users.permissions]\n"
        'register = ["game*"]\nsend = ["game*:*", "multicast:chat.*"]\n'
        'join = ["multicast:chat.*"]\n'
        f'[[users]]\nname = "login"\npublic_key = "{login.public_key}"\n'
        '[users.permissions]\nregister = ["login"]\nsend = ["*"]\n'
    )
    broker = await start_broker("--config", str(config))
    try:
        async with (
            await meshbus.connect(broker.address, server="login", credentials=game) as squatter,
            await meshbus.connect(broker.address, server="game01", credentials=game) as game01,
            await meshbus.connect(broker.address, server="login", credentials=login) as real,
        ):
            with pytest.raises(
                meshbus.PermissionDenied,
                match=r"may not register login:1 \(permissions\.register\)",
            ):
                await squatter.register(1)
            login_service = await real.register(1)  # the real service gets its address
            player = await game01.register()
            with pytest.raises(meshbus.PermissionDenied, match=r"login:1 \(permissions\.send\)"):
                await player.send_reliable(login_service.address, b"forged")
            with pytest.raises(meshbus.PermissionDenied, match="multicast:admin"):
                await player.join(meshbus.Multicast("admin"))
            await player.join(meshbus.Multicast("chat.eu"))
            with pytest.raises(meshbus.PermissionDenied, match="stat"):
                await game01.stat()
            await login_service.send(player.address, b"welcome")  # login may send anywhere
            assert (await player.recv(timeout=QUICK)).payload == b"welcome"
    finally:
        assert await broker.stop() == 0


async def test_a_watcher_hears_only_of_the_services_its_user_may_see(tmp_path: Path) -> None:
    """WATCH on a broker with users: LEFT names only the addresses the watcher's user may
    send or send requests to; a user with the stat-detail right hears of every one."""
    game, ops, login = (Credentials.generate(name) for name in ("game", "ops", "login"))
    config = tmp_path / "broker.toml"
    config.write_text(
        broker_key(tmp_path, "b1").settings
        + f'[[users]]\nname = "game"\npublic_key = "{game.public_key}"\n'
        '[users.permissions]\nsend = ["game*:*"]\nrequest = ["anycast:scores"]\n'
        f'[[users]]\nname = "ops"\npublic_key = "{ops.public_key}"\n'
        '[users.permissions]\noperator = ["stat-detail"]\n'
        f'[[users]]\nname = "login"\npublic_key = "{login.public_key}"\n'
        '[users.permissions]\nregister = ["*"]\n'
    )
    broker = await start_broker("--config", str(config))
    try:
        async with (
            await meshbus.connect(broker.address, credentials=game) as watcher,
            await meshbus.connect(broker.address, credentials=ops) as operator,
            await meshbus.connect(broker.address, server="login", credentials=login) as owner,
            await meshbus.connect(broker.address, server="game07", credentials=login) as game07,
        ):
            heard: dict[str, list[str]] = {"game": [], "ops": []}
            told = {"game": asyncio.Event(), "ops": asyncio.Event()}

            def hears(user: str, expected: int) -> Callable[[list[str]], None]:
                def left(addresses: list[str]) -> None:
                    heard[user].extend(addresses)
                    if len(heard[user]) >= expected:
                        told[user].set()

                return left

            await watcher.on_service_left(hears("game", 1))
            await operator.on_service_left(hears("ops", 2))
            secret = await owner.register(1)
            visible = await game07.register(3)
            await secret.unregister()
            await visible.unregister()
            async with asyncio.timeout(QUICK):
                await told["ops"].wait()
                await told["game"].wait()
            assert sorted(heard["ops"]) == ["game07:3", "login:1"]
            assert heard["game"] == ["game07:3"], "login:1 is not the watcher's to know"
    finally:
        assert await broker.stop() == 0
