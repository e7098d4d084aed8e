"""Per-user quotas on a real broker process (docs/security.md, "Per-user quotas"): one
user's many links cannot take what the broker has for everyone, `meshbus stat` and
/metrics show what each user holds, and a user with no operator right gets no operator
link."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import Credentials, TokenHash
from tests.conftest import BrokerProcess, start_broker
from tests.integration.helpers import broker_key
from tests.integration.test_auth import run_cli
from tests.integration.test_monitor import free_port, http_get

TOKEN = "quota-metrics-token"
QUOTAS = "[users.quotas]\nconnections = 3\nservices = 2\nmemberships = 4\nrequests = 2\n"
EVERYTHING = (
    '[users.permissions]\nregister = ["*"]\nsend = ["*"]\nrequest = ["*"]\njoin = ["*"]\n'
    'operator = ["*"]\n'
)


class Users:
    """alice (small quotas), bob (the defaults), dave (no permissions)."""

    def __init__(self, directory: Path) -> None:
        self.alice, self.bob, self.dave = (
            Credentials.generate(name) for name in ("alice", "bob", "dave")
        )
        self.dave_file = directory / "dave.creds"
        self.dave.write(self.dave_file)

    def config(self, quotas: bool) -> str:
        """Their entries; without ``quotas``, alice has the default quotas too."""
        return (
            f'[[users]]\nname = "alice"\npublic_key = "{self.alice.public_key}"\n'
            + EVERYTHING
            + (QUOTAS if quotas else "")
            + f'[[users]]\nname = "bob"\npublic_key = "{self.bob.public_key}"\n'
            + EVERYTHING
            + f'[[users]]\nname = "dave"\npublic_key = "{self.dave.public_key}"\n'
        )


@contextlib.asynccontextmanager
async def quota_broker(
    tmp_path: Path, *, quotas: bool = True
) -> AsyncIterator[tuple[BrokerProcess, Users, str]]:
    """A broker with the users of ``Users`` and a monitor (its address the third value)."""
    users = Users(tmp_path)
    monitor = f"127.0.0.1:{free_port()}"
    config = tmp_path / "broker.toml"
    config.write_text(
        broker_key(tmp_path, "b1").settings
        + f'monitor = "{monitor}"\nmonitor-token-hash = "{TokenHash.of(TOKEN)}"\n'
        + users.config(quotas)
    )
    broker = await start_broker("--config", str(config))
    try:
        yield broker, users, monitor
    finally:
        assert await broker.stop() == 0


async def test_one_users_links_stop_at_its_quota_and_stat_and_metrics_show_it(
    tmp_path: Path,
) -> None:
    async with quota_broker(tmp_path) as (broker, users, monitor):
        async with contextlib.AsyncExitStack() as stack:
            links = [
                await stack.enter_async_context(
                    await meshbus.connect(broker.address, server="a", credentials=users.alice)
                )
                for _ in range(3)
            ]
            with pytest.raises(meshbus.ConnectionLost) as caught:
                await meshbus.connect(broker.address, server="a", credentials=users.alice)
            assert (
                "limit exceeded: user 'alice' already has 3 links open to this broker, and its "
                "quota is 3 (quotas.connections of its [[users]] entry in the broker's config)"
            ) in str(caught.value)
            bob = await stack.enter_async_context(
                await meshbus.connect(broker.address, server="b", credentials=users.bob)
            )
            await links[0].register()
            await links[1].register()
            with pytest.raises(meshbus.RegistrationError, match=r"quotas\.services"):
                await links[2].register()
            await bob.register()  # alice's quota, not bob's

            stat = await bob.stat()
            assert stat["users"]["alice"]["connections"] == {"used": 3, "quota": 3}
            assert stat["users"]["alice"]["services"] == {"used": 2, "quota": 2}
            assert stat["users"]["bob"]["services"] == {"used": 1, "quota": 100_000}
            status, body = await asyncio.to_thread(http_get, f"http://{monitor}/metrics", TOKEN)
            assert status == 200
            text = body.decode()
            assert 'meshbus_user_usage{broker="b1",quota="connections",user="alice"} 3.0' in text
            assert 'meshbus_user_quota{broker="b1",quota="services",user="alice"} 2.0' in text
            assert 'meshbus_user_usage{broker="b1",quota="services",user="bob"} 1.0' in text
        # The links closed: alice gets in again.
        async with await meshbus.connect(broker.address, server="a", credentials=users.alice):
            pass


async def test_memberships_and_requests_count_over_all_of_a_users_links(
    tmp_path: Path,
) -> None:
    async with (
        quota_broker(tmp_path) as (broker, users, _),
        await meshbus.connect(broker.address, server="a", credentials=users.alice) as first,
        await meshbus.connect(broker.address, server="a", credentials=users.alice) as second,
        await meshbus.connect(broker.address, server="b", credentials=users.bob) as bob,
    ):
        # Each service joins the broadcast group as it registers: 2 memberships already.
        one, two = await first.register(), await second.register()
        await one.join(meshbus.Multicast("g1"))
        await two.join(meshbus.Multicast("g2"))
        with pytest.raises(meshbus.RegistrationError, match=r"quotas\.memberships"):
            await two.join(meshbus.Multicast("g3"))
        silent = await bob.register()  # never answers
        waiting = [
            asyncio.create_task(service.request(silent.address, b"?", timeout=30))
            for service in (one, two)
        ]

        async def received_both() -> None:
            for _ in waiting:
                await silent.recv(timeout=10)

        await received_both()
        with pytest.raises(meshbus.NoRoute, match=r"quotas\.requests"):
            await one.request(silent.address, b"?", timeout=30)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_user_with_no_operator_right_gets_no_operator_link(tmp_path: Path) -> None:
    async with quota_broker(tmp_path, quotas=False) as (broker, users, _):
        with pytest.raises(meshbus.PermissionDenied, match="may not open an operator link"):
            await meshbus.connect(
                broker.address, server="stat", operator=True, credentials=users.dave
            )
        code, _, err = await run_cli(
            "stat", "--broker", broker.address, "--creds", str(users.dave_file)
        )
        assert code == 1
        assert "permission denied: user 'dave' may not open an operator link" in err, err
        assert "Traceback" not in err
        # A connector's link it may open; and bob's operator link shows only configured users.
        async with (
            await meshbus.connect(broker.address, server="d", credentials=users.dave),
            await meshbus.connect(
                broker.address, server="stat", operator=True, credentials=users.bob
            ) as ops,
        ):
            stat = await ops.stat()
            assert sorted(stat["users"]) == ["alice", "bob", "dave"]
            assert stat["users"]["dave"]["connections"]["used"] == 1
        bob_file = tmp_path / "bob.creds"
        users.bob.write(bob_file)
        code, out, err = await run_cli("stat", "--broker", broker.address, "--creds", str(bob_file))
        assert code == 0, err
        assert "users: used / quota" in out
        assert "alice" in out
