"""SIGHUP reloads a broker's users and permissions (docs/security.md, "Reloading"),
against a real broker process: live links get their user's new rights without
reconnecting, a removed user's links are closed with the reason, and a broken file
changes nothing."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import Credentials
from tests.conftest import BrokerProcess, start_broker
from tests.integration.helpers import IO_TIMEOUT, launch_broker, user_with, wait_until

GAME, LOGIN, OPS = (Credentials.generate(name) for name in ("game", "login", "ops"))


def config_text(game_send: str, *, game: bool = True, login: Credentials = LOGIN) -> str:
    """ops may stat, login may register login and send anywhere, game may register game*
    and send to ``game_send``."""
    return (
        user_with(OPS, 'operator = ["*"]')
        + user_with(login, 'register = ["login"]\nsend = ["*"]')
        + (user_with(GAME, f'register = ["game*"]\nsend = {game_send}') if game else "")
    )


async def ops_stat(broker: BrokerProcess) -> dict[str, object]:
    async with await meshbus.connect(broker.address, server="stat", credentials=OPS) as conn:
        return await conn.stat(detail=False)


async def reload(broker: BrokerProcess, config: Path, text: str, field: str) -> None:
    """Write ``text`` to the config file, send SIGHUP, and wait for ``field`` of the
    broker's counters to count it."""
    before = (await ops_stat(broker))["counters"]
    assert isinstance(before, dict)
    await asyncio.to_thread(config.write_text, text)
    broker.process.send_signal(signal.SIGHUP)

    async def counted() -> bool:
        counters = (await ops_stat(broker))["counters"]
        assert isinstance(counters, dict)
        return bool(counters[field] == before[field] + 1)

    await wait_until(counted, f"the reload counted in {field}")


async def game_links(broker: BrokerProcess) -> list[object]:
    links = (await ops_stat(broker))["links"]
    assert isinstance(links, list)
    return [link["id"] for link in links if link["user"] == "game"]


async def test_a_reload_narrows_and_widens_a_live_links_sends(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(config_text('["*"]'))
    broker = await start_broker("--config", str(config))
    try:
        async with (
            await meshbus.connect(broker.address, server="login", credentials=LOGIN) as login,
            await meshbus.connect(broker.address, server="game01", credentials=GAME) as game,
        ):
            server = await login.register(1)
            player = await game.register()
            link_ids = await game_links(broker)
            # A plain send: its permitted decision is now in the link's decision cache.
            await player.send(server.address, b"1111")
            assert (await server.recv(timeout=IO_TIMEOUT)).payload == b"1111"

            await reload(broker, config, config_text('["multicast:*"]'), "config_reloads")
            # The same routing key as the cached decision: denied now, not delivered.
            await player.send(server.address, b"2222")

            async def denied() -> bool:
                counters = (await ops_stat(broker))["counters"]
                assert isinstance(counters, dict)
                return bool(counters["dropped_denied"] == 1)

            await wait_until(denied, "the narrowed send denied")
            with pytest.raises(meshbus.PermissionDenied, match=r"login:1 \(permissions\.send\)"):
                await player.send_reliable(server.address, b"3333")

            # The denial is cached too; a reload that widens the right drops it.
            await reload(broker, config, config_text('["login:*"]'), "config_reloads")
            await player.send_reliable(server.address, b"4444")
            assert (await server.recv(timeout=IO_TIMEOUT)).payload == b"4444"
            assert await game_links(broker) == link_ids, "the same link, not a new one"
            assert game.failovers == 0
    finally:
        assert await broker.stop() == 0


async def lost_reason(conn: meshbus.Connector) -> str:
    """What the connector says once the broker closed its link (it has no other)."""
    async with asyncio.timeout(IO_TIMEOUT):
        while True:
            try:
                await conn.ping()
            except meshbus.ConnectionLost as exc:
                return str(exc)
            await asyncio.sleep(0.05)


async def test_a_removed_users_links_are_closed_with_the_reason(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(config_text('["*"]'))
    broker = await start_broker("--config", str(config))
    try:
        game = await meshbus.connect(broker.address, server="game01", credentials=GAME)
        login = await meshbus.connect(broker.address, server="login", credentials=LOGIN)
        new_login = Credentials.generate("login")
        await reload(
            broker, config, config_text("[]", game=False, login=new_login), "config_reloads"
        )
        assert "user 'game' was removed from this broker's config" in await lost_reason(game)
        assert "the credential of user 'login' changed" in await lost_reason(login)
        await game.close()
        await login.close()
        counters = (await ops_stat(broker))["counters"]
        assert isinstance(counters, dict)
        assert counters["links_closed"].get("revoked") == 2
        with pytest.raises(meshbus.AuthenticationFailed):
            await meshbus.connect(broker.address, server="game01", credentials=GAME)
        # The new credential signs in.
        async with await meshbus.connect(broker.address, server="login", credentials=new_login):
            pass
    finally:
        assert await broker.stop() == 0


async def test_a_broken_file_on_reload_changes_nothing_and_is_logged(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(config_text('["*"]'))
    broker = await launch_broker("--config", str(config))
    try:
        async with (
            await meshbus.connect(broker.address, server="login", credentials=LOGIN) as login,
            await meshbus.connect(broker.address, server="game01", credentials=GAME) as game,
        ):
            server = await login.register(1)
            player = await game.register()
            # game is gone from the new file, and the file has an error: nothing applies.
            broken = "max-conectors = 7\n" + config_text("[]", game=False)
            await reload(broker, config, broken, "config_reloads_failed")
            await player.send_reliable(server.address, b"still")
            assert (await server.recv(timeout=IO_TIMEOUT)).payload == b"still"
            data = await ops_stat(broker)
            assert data["config_reloaded_at"] is None
            assert isinstance(data["counters"], dict)
            assert data["counters"]["config_reloads"] == 0
    finally:
        broker.process.send_signal(signal.SIGTERM)
        code, _, err = await broker.finish()
    assert code == 0
    assert "config not reloaded; the users and permissions stay as they were" in err
    assert f"{config}:1: unknown key 'max-conectors'" in err


async def test_a_config_file_others_may_change_is_not_reloaded(tmp_path: Path) -> None:
    """Its mode is checked again on SIGHUP, as at start (docs/security.md, "Files that hold
    secrets"): a file made writable by others since the start is refused, and the users
    stay as they were."""
    config = tmp_path / "broker.toml"
    config.write_text(config_text('["*"]'))
    config.chmod(0o644)
    broker = await launch_broker("--config", str(config))
    try:
        async with await meshbus.connect(broker.address, server="game01", credentials=GAME) as game:
            config.chmod(0o666)
            await reload(broker, config, config_text("[]", game=False), "config_reloads_failed")
            await game.register()  # game is still a user: nothing was applied
    finally:
        broker.process.send_signal(signal.SIGTERM)
        code, _, err = await broker.finish()
    assert code == 0
    assert f"the config file {config} may be changed by users other than its owner" in err
    assert f"chmod 600 {config}" in err
