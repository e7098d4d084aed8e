"""Group and reliable sends right after a broker crashes or pauses (issue 23, A.1).

Three brokers; a sender on broker 1; three members of an anycast group on brokers 1
and 3; the receiver of a reliable unicast on broker 2. Broker 2 is killed (kill -9) or
paused (SIGSTOP) and, at once, 12 groups x 10 messages are sent concurrently, half of
the groups homed at broker 2. Its groups' home answers TRY_AGAIN for a moment
(docs/guarantees.md, "When the broker cannot answer now"): the client asks again, so no
send fails, and every message arrives exactly once, in order per group.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import struct
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import Credentials
from meshbus.broker.mesh.groups import home_of
from meshbus.errors import TryAgain
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.helpers import (
    ACK_TIMEOUT,
    Collector,
    broker_key,
    wait_members,
    wait_routes,
)

pytestmark = pytest.mark.slow

HEARTBEAT = "0.5"
ORDERS = meshbus.Anycast("orders")
GROUPS, PER_GROUP, UNICASTS = 12, 10, 10
PAYLOAD = struct.Struct(">HH")  # group (UNICAST for the unicast), seq
UNICAST = 0xFFFF


def group_names(
    brokers: list[BrokerProcess], lost: BrokerProcess, prefix: str = "grp"
) -> list[str]:
    """GROUPS group ids, the first half of them homed at ``lost``."""
    names = [b.name for b in brokers]
    at_lost: list[str] = []
    elsewhere: list[str] = []
    for i in range(1000):
        key = f"{prefix}{i}"
        homed_at_lost = home_of(ORDERS.to_bytes() + key.encode(), names) == lost.name
        pile = at_lost if homed_at_lost else elsewhere
        if len(pile) < GROUPS // 2:
            pile.append(key)
    return at_lost + elsewhere


class Scene:
    def __init__(self, brokers: list[BrokerProcess]) -> None:
        self.brokers = brokers
        self.conns: list[meshbus.Connector] = []
        self.members: list[Collector] = []

    async def start(self) -> None:
        """Each connector on its broker, the others its failover."""
        one, two, three = self.brokers
        for broker in (one, one, three):
            conn = await self.connect(broker, "member")
            member = await conn.register()
            await member.join(ORDERS)
            self.members.append(Collector(member))
        self.receiver = Collector(await (await self.connect(two, "receiver")).register())
        self.sender_conn = await self.connect(one, "sender")
        self.sender = await self.sender_conn.register()
        await wait_members(self.brokers, ORDERS, 3)
        await wait_routes(self.brokers, self.receiver.service.address)

    async def connect(self, broker: BrokerProcess, server: str) -> meshbus.Connector:
        others = [b.address for b in self.brokers if b is not broker]
        conn = await meshbus.connect(
            [broker.address, *others], server=server, randomize_brokers=False
        )
        self.conns.append(conn)
        return conn

    async def send_all(self, groups: list[str]) -> None:
        """Every group's messages in order, the groups and the unicasts concurrently; a
        send that raises fails the test."""

        async def one_group(index: int, group: str) -> None:
            for seq in range(PER_GROUP):
                await self.sender.send(
                    ORDERS,
                    PAYLOAD.pack(index, seq),
                    group=group,
                    final=seq == PER_GROUP - 1,
                    reliable=True,
                )

        async def unicasts() -> None:
            for seq in range(UNICASTS):
                address = self.receiver.service.address
                await self.sender.send(address, PAYLOAD.pack(UNICAST, seq), reliable=True)

        await asyncio.gather(unicasts(), *(one_group(i, g) for i, g in enumerate(groups)))

    async def check_delivered(self) -> None:
        """Each message once, each group at one member and in order."""
        await self.sender_conn.wait_acked(ACK_TIMEOUT)
        assert self.sender_conn._parts.unacked.given_up == 0
        for collector in self.members:
            await collector.settle(self.sender)
        await self.receiver.settle(self.sender)
        received = [PAYLOAD.unpack(p) for c in self.members for p in c.payloads]
        counts = Counter(received)
        assert set(counts) == {(g, s) for g in range(GROUPS) for s in range(PER_GROUP)}
        assert max(counts.values()) == 1, "a group message was delivered twice"
        for collector in self.members:
            seqs: dict[int, list[int]] = defaultdict(list)
            for payload in collector.payloads:
                group, seq = PAYLOAD.unpack(payload)
                seqs[group].append(seq)
            for group, got in seqs.items():
                assert got == list(range(PER_GROUP)), f"group {group} at one member: {got}"
        unicast = [PAYLOAD.unpack(p) for p in self.receiver.payloads]
        assert sorted(unicast) == [(UNICAST, s) for s in range(UNICASTS)]

    async def close(self) -> None:
        for collector in (*self.members, self.receiver):
            collector.stop()
        for conn in self.conns:
            await conn.close()


@pytest.fixture
async def scene() -> AsyncIterator[Scene]:
    brokers = await start_mesh(3, "--heartbeat-interval", HEARTBEAT)
    shaken = Scene(brokers)
    try:
        await shaken.start()
        yield shaken
    finally:
        await shaken.close()
        with contextlib.suppress(ProcessLookupError):
            brokers[1].process.send_signal(signal.SIGCONT)
        await stop_all(brokers)


@pytest.mark.parametrize(
    "killed", [1, 0], ids=["the-receivers-broker", "the-senders-and-two-members-broker"]
)
async def test_group_and_reliable_sends_right_after_a_kill_9_all_arrive(
    scene: Scene, killed: int
) -> None:
    lost = scene.brokers[killed]
    groups = group_names(scene.brokers, lost)
    lost.process.kill()
    assert await lost.process.wait() == -9
    sends = [scene.send_all(groups)]
    if killed != 0:  # the sender's own broker lost, its answer would be its failover
        late = group_names(scene.brokers, lost, prefix="late")[0]
        sends.append(a_short_deadline_passes(scene.sender, late))
    await asyncio.gather(*sends)
    await scene.check_delivered()


async def a_short_deadline_passes(sender: meshbus.Service, group: str) -> None:
    """A send whose deadline is shorter than the moment its group's home is out of reach
    raises ``Timeout`` saying why, and sends nothing."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(meshbus.Timeout) as caught:
        await sender.send(ORDERS, b"late", group=group, timeout=0.3)
    assert loop.time() - start < 2.0, "raised near its deadline, not the default 15 s"
    assert caught.value.timeout == 0.3
    message = str(caught.value)
    assert f"message group '{group}' to anycast:orders: no member bound within 0.3 s" in message
    assert "ask again in a moment" in message
    assert isinstance(caught.value.__cause__, TryAgain)


async def test_group_and_reliable_sends_during_a_3_s_pause_all_arrive(scene: Scene) -> None:
    two = scene.brokers[1]
    groups = group_names(scene.brokers, two)
    two.process.send_signal(signal.SIGSTOP)
    resumed = asyncio.Event()

    def resume() -> None:
        two.process.send_signal(signal.SIGCONT)
        resumed.set()

    asyncio.get_running_loop().call_later(3.0, resume)
    await scene.send_all(groups)
    await resumed.wait()
    await scene.check_delivered()


async def test_a_permanent_answer_raises_at_once_however_long_the_deadline(
    tmp_path: Path,
) -> None:
    """No member, or a user that may not send there: asking again changes nothing, so
    the send raises at once, not after its 30 s deadline."""
    game = Credentials.generate("game")
    config = tmp_path / "broker.toml"
    config.write_text(
        broker_key(tmp_path, "b1").settings
        + f'[[users]]\nname = "game"\npublic_key = "{game.public_key}"\n'
        '[users.permissions]\nregister = ["game*"]\nsend = ["game*:*", "anycast:free"]\n'
        'join = ["anycast:*"]\n'
    )
    broker = await start_broker("--config", str(config))
    loop = asyncio.get_running_loop()
    try:
        async with await meshbus.connect(broker.address, server="game01", credentials=game) as conn:
            service = await conn.register()
            start = loop.time()
            free = meshbus.Anycast("free")
            with pytest.raises(meshbus.NoRoute, match="no member of anycast:free"):
                await service.send(free, b"x", group="g", timeout=30)
            with pytest.raises(meshbus.NoRoute, match="no member of anycast:free"):
                await service.send(free, b"x", reliable=True, timeout=30)
            await service.join(ORDERS)
            with pytest.raises(
                meshbus.PermissionDenied, match=r"anycast:orders \(permissions\.send\)"
            ):
                await service.send(ORDERS, b"x", group="g", timeout=30)
            assert loop.time() - start < 5.0, "at once, not after the 30 s deadline"
            assert conn.unacked == 0, "nothing was sent"
    finally:
        await stop_all([broker])


async def test_a_send_timeout_is_checked(broker: BrokerProcess) -> None:
    async with await meshbus.connect(broker.address, server="game01") as conn:
        service = await conn.register()
        for bad in (0, -1.0, math.nan, math.inf):
            with pytest.raises(meshbus.InvalidArgument, match="timeout must be a positive"):
                await service.send(ORDERS, b"x", group="g", timeout=bad)
        with pytest.raises(meshbus.InvalidArgument, match="a plain one waits for nothing"):
            await service.send(ORDERS, b"x", timeout=1.0)
