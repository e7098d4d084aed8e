"""A seeded simulation of the mesh under partitions and pauses, in the direction of
FoundationDB's and TigerBeetle's simulators: brokers, connectors and the network in one
process on fake time, driven by a random schedule that a seed fixes, so a failing seed
replays exactly (``pytest -k 'seed-17'``).

Each step picks one of: cut the link between two brokers, cut every link of one
broker (an island), heal a cut link, pause a broker
(SIGSTOP: it reads, writes and ticks nothing, but connections to it still open),
resume it, a connector registers a fixed address (from a small set, so both sides of
a split take the same one), a sender binds a message group, or time moves one
heartbeat interval. After every step, what must always hold is checked; after the
schedule, the network is made whole and what must hold *eventually* is checked:

- always: at most one link between two brokers; no route leads through a closed link;
  under ``--partition-handling pause-minority``, no broker cut off from most of the
  mesh (and awake) serves a connector;
- eventually (within a few heartbeat intervals): one mesh; every broker routes every
  fixed address to the same broker, so no address has two owners; every connector
  that lost an address was told (REVOKED); every broker holds the same binding for
  every message group.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from meshbus.address import Anycast, Unicast
from meshbus.broker.core.endpoint import LinkState
from meshbus.broker.server import Broker
from meshbus.protocol.codec import ControlFrame
from meshbus.protocol.control import GroupBind, Register, Revoked
from meshbus.protocol.layout import ControlType
from meshbus.testing import FakeClient, FakeClock, FakeNetwork, build_mesh, connector

SEEDS = range(24)
BROKERS = 3
STEPS = 60
INTERVAL = 0.5
POOL = Anycast("pool").to_bytes()
FIXED = [Unicast("game", i).to_bytes() for i in (1, 2, 3)]


@dataclass
class World:
    rng: random.Random
    network: FakeNetwork
    clock: FakeClock
    brokers: list[Broker]
    clients: list[FakeClient] = field(default_factory=list)
    cut: set[frozenset[str]] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)
    # (client, correlation) of every REGISTER of a fixed address sent.
    registers: list[tuple[FakeClient, int]] = field(default_factory=list)

    def address(self, broker: Broker) -> str:
        return broker.config.advertise

    async def step(self) -> str:
        rng, net = self.rng, self.network
        a, b = rng.sample(self.brokers, 2)
        pair = frozenset((self.address(a), self.address(b)))
        action = rng.choice(
            ["cut", "isolate", "heal", "pause", "resume", "register", "bind", "bind"] + ["tick"] * 4
        )
        if action == "cut" and pair not in self.cut:
            self.cut.add(pair)
            net.partition(*pair)
        elif action == "isolate":  # an island of one: every link of ``a`` cut
            for other in self.brokers:
                apart = frozenset((self.address(a), self.address(other)))
                if other is not a and apart not in self.cut:
                    self.cut.add(apart)
                    net.partition(*apart)
        elif action == "heal" and self.cut:
            healed = rng.choice(sorted(self.cut, key=sorted))
            self.cut.discard(healed)
            net.heal(*healed)
        elif action == "pause" and not self.paused:
            self.paused.add(self.address(a))
            net.pause(self.address(a))
        elif action == "resume" and self.paused:
            net.resume(self.paused.pop())
        elif action == "register":
            index = rng.randrange(len(self.clients))
            body = Register(server="game", instance=rng.randrange(1, len(FIXED) + 1))
            client = self.clients[index]
            self.registers.append((client, client.send_control(ControlType.REGISTER, body)))
        elif action == "bind":
            client = rng.choice(self.clients)
            client.send_control(ControlType.GROUP_BIND, GroupBind(group=POOL, key=b"g"))
        else:
            action = "tick"
            await self.tick()
        await net.settle()
        await self.fail_over()
        return action

    async def fail_over(self) -> None:
        """A connector whose link its broker closed (pause-minority) links to a broker
        that takes connectors, as a real one fails over, and registers and joins again."""
        for index, old in enumerate(self.clients):
            welcoming = [
                b
                for b in self.brokers
                if self.address(b) not in self.paused and b.mesh.refusal(0) == ""
            ]
            if not old.closed or not welcoming:
                continue
            client = await connector(
                self.network, self.rng.choice(welcoming), old.name, session=bytes([index + 1]) * 16
            )
            await client.join(await client.register(f"m{index}"), POOL)
            self.clients[index] = client

    async def tick(self) -> None:
        self.clock.advance(INTERVAL)
        for broker in self.brokers:
            if self.address(broker) not in self.paused:
                broker.housekeeping()
        await self.network.settle()

    async def make_whole(self) -> None:
        for pair in self.cut:
            self.network.heal(*pair)
        self.cut.clear()
        for address in self.paused:
            self.network.resume(address)
        self.paused.clear()
        await self.network.settle()


def check_always(world: World) -> None:
    for broker in world.brokers:
        open_peers = Counter(
            link.name
            for link in broker.links.links.values()
            if link.is_peer and link.state is LinkState.OPEN
        )
        assert all(n == 1 for n in open_peers.values()), f"{broker.config.name}: {open_peers}"
        for _, owner in broker.routing.services():
            assert not owner.closed, f"{broker.config.name} routes through a closed link"
        # pause-minority: a broker cut off from most of the mesh serves no connector.
        if broker.mesh.minority.refusal() and broker.config.advertise not in world.paused:
            assert not broker.links.connectors, f"{broker.config.name} serves in a minority"


def owners(world: World) -> dict[bytes, set[str]]:
    """For each fixed address, the brokers where it is local (should be one)."""
    found: dict[bytes, set[str]] = {}
    for broker in world.brokers:
        for address in FIXED:
            owner = broker.routing.owner(address)
            if owner is not None and not owner.is_peer:
                found.setdefault(address, set()).add(broker.config.name)
    return found


def check_eventually(world: World) -> None:
    names = sorted(b.config.name for b in world.brokers)
    for broker in world.brokers:
        assert broker.peers.names() == sorted(set(names) - {broker.config.name})
    for address, where in owners(world).items():
        assert len(where) == 1, f"{Unicast.from_bytes(address)} owned on {where}"
        [home] = where
        for broker in world.brokers:
            owner = broker.routing.owner(address)
            assert owner is not None
            assert (owner.name if owner.is_peer else broker.config.name) == home
    bindings = {b.config.name: b.guarantees.groups.get((POOL, b"g")) for b in world.brokers}
    members = {name: binding.member for name, binding in bindings.items() if binding}
    assert len(set(members.values())) <= 1, f"group bound to two members: {members}"
    # Every connector that was granted an address no broker gives it now was told.
    for client, correlation in world.registers:
        if client.closed:
            continue  # its broker closed its link, with an ERROR saying why: it was told
        answers = [f for f in client.controls() if f.correlation == correlation]
        if not answers or answers[0].type != ControlType.REGISTERED:
            continue
        address = answers[0].body.address  # type: ignore[union-attr]
        local = [
            b
            for b in world.brokers
            if any(
                link is not None and link.name == client.name
                for link in [b.routing.owner(address)]
                if link is not None and not link.is_peer
            )
        ]
        if not local:
            revoked = [
                f
                for f in client.controls()
                if isinstance(f, ControlFrame)
                and isinstance(f.body, Revoked)
                and f.body.address == address
            ]
            assert revoked, f"{client.name} lost {Unicast.from_bytes(address)} silently"


@pytest.mark.parametrize("handling", ["ignore", "pause-minority"])
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed-{s}" for s in SEEDS])
async def test_partitions_and_pauses_never_leave_two_owners_or_two_meshes(
    seed: int, handling: str, network: FakeNetwork, clock: FakeClock
) -> None:
    random.seed(seed)  # the brokers' own choices (claim back-off, picks) follow the seed too
    rng = random.Random(seed)
    brokers = await build_mesh(
        network, BROKERS, heartbeat_interval=INTERVAL, partition_handling=handling
    )
    world = World(rng, network, clock, brokers)
    for i, broker in enumerate(brokers):
        client = await connector(network, broker, f"conn{i}", session=bytes([i + 1]) * 16)
        member = await client.register(f"m{i}")
        await client.join(member, POOL)
        world.clients.append(client)
    for _ in range(STEPS):
        await world.step()
        check_always(world)
    await world.make_whole()
    for _ in range(12):  # 6 s of fake time: the goal is 3 intervals + 1 s
        await world.tick()
        check_always(world)
    check_eventually(world)
