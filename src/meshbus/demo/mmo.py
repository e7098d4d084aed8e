"""A small MMO back end on the bus: what ``make demo`` runs while brokers fail and join.

    login01, login02   the login pool: anycast ``login``, request/response
    game01, game02     game servers: one service per player (p01..p12)
    chat               players talk in two rooms (multicast ``chat.room0/1``)
    master             interest management: puts players into zone topics with
                       ``subscribe_other`` and publishes zone updates there
    matches            match results, sent reliably to ``multicast:game.results``
                       (captured by the durable stream ``results``), and a reward
                       sent reliably to the winner's service
    lobby              two lobby services that receive ``multicast:leaderboard``

Every connector is given all brokers, so it fails over when its broker dies. The
world counts what it sends per cast type and what arrives, so the demo can say
exactly how much reliable traffic was lost or duplicated.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import meshbus
from meshbus import Anycast, Multicast, Service
from meshbus.cli.common import Access

PLAYERS = 12
ROOMS = 2
ZONES = 3
RESULTS_STREAM = "results"
RESULTS = Multicast("game.results")
LEADERBOARD = Multicast("leaderboard")


def player_name(i: int) -> str:
    return f"p{i + 1:02d}"


@dataclass
class Leaderboard:
    """What a lobby service knows: wins per player from the Spark job's updates, and how
    long each update took from the newest match result it counts."""

    wins: dict[str, int] = field(default_factory=dict)
    updates: int = 0
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (received, took)

    def apply(self, payload: bytes, now: float) -> None:
        row = json.loads(payload)
        player, wins = row["player"], int(row["wins"])
        if wins > self.wins.get(player, 0):
            self.wins[player] = wins
        self.updates += 1
        self.latencies.append((now, now - float(row["last_sent_at"])))

    def top(self, n: int = 5) -> list[tuple[str, int]]:
        return sorted(self.wins.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


@dataclass
class World:
    connectors: dict[str, meshbus.Connector]
    players: dict[str, Service]
    logins: list[Service]
    master: Service
    matches: Service
    lobbies: list[Service]
    sent: Counter[str] = field(default_factory=Counter)  # by cast type
    received: Counter[str] = field(default_factory=Counter)
    results_sent: dict[int, tuple[str, str]] = field(default_factory=dict)  # match -> (w, l)
    rewards: Counter[int] = field(default_factory=Counter)  # match id -> times delivered
    boards: list[Leaderboard] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    @property
    def true_wins(self) -> Counter[str]:
        return Counter(w for w, _ in self.results_sent.values())

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.connectors.values()))


async def build(addresses: str, homes: dict[str, str], access: Access) -> World:
    """Connect every process of the back end (``homes``: connector -> its first broker,
    the rest of ``addresses`` for failover; signed in and over TLS with ``access``) and
    set up its services."""

    async def connect(name: str) -> meshbus.Connector:
        first = homes[name]
        rest = [a for a in addresses.split(",") if a != first]
        return await access.connect(",".join([first, *rest]), server=name, randomize_brokers=False)

    names = ["login01", "login02", "game01", "game02", "master", "matches", "lobby"]
    conns = dict(zip(names, await asyncio.gather(*(connect(n) for n in names)), strict=True))
    logins = [await conns[n].register() for n in ("login01", "login02")]
    for login in logins:
        await login.join(Anycast("login"))
    players: dict[str, Service] = {}
    for i in range(PLAYERS):
        players[player_name(i)] = await conns["game01" if i % 2 == 0 else "game02"].register()
    for i, player in enumerate(players.values()):
        await player.subscribe(f"chat.room{i % ROOMS}")
    lobbies = [await conns["lobby"].register() for _ in range(2)]
    for lobby in lobbies:
        await lobby.join(LEADERBOARD)
    world = World(
        conns, players, logins, await conns["master"].register(),
        await conns["matches"].register(), lobbies,
    )  # fmt: skip
    world.boards = [Leaderboard() for _ in lobbies]
    world.tasks += [asyncio.create_task(_answer_logins(login)) for login in logins]
    world.tasks += [asyncio.create_task(_play(world, name, p)) for name, p in players.items()]
    world.tasks += [
        asyncio.create_task(_watch_board(lobby, board))
        for lobby, board in zip(lobbies, world.boards, strict=True)
    ]
    return world


async def _answer_logins(login: Service) -> None:
    async for msg in login:
        if msg.is_request:
            await msg.reply(b"welcome " + msg.payload + b" from " + str(login.address).encode())


async def _play(world: World, name: str, player: Service) -> None:
    """A player's inbox: chat, zone updates, whispers and rewards, each counted."""
    async for msg in player:
        if msg.subject is not None:
            world.received["chat" if msg.subject.startswith("chat.") else "zone"] += 1
        elif msg.payload.startswith(b"reward "):
            world.rewards[int(msg.payload.split()[1])] += 1
        else:
            world.received["whisper"] += 1


async def _watch_board(lobby: Service, board: Leaderboard) -> None:
    async for msg in lobby:
        board.apply(msg.payload, time.time())


async def log_in_everyone(world: World) -> None:
    """Every player asks the login pool (anycast request/response)."""
    for name in world.players:
        answer = await world.players[name].request(Anycast("login"), name.encode(), timeout=10)
        world.sent["anycast request"] += 1
        if not answer.payload.startswith(b"welcome " + name.encode()):
            raise AssertionError(f"login answered {answer.payload!r}")


async def place_in_zones(world: World) -> None:
    """The master moves players into zones (``subscribe_other``): interest management."""
    for i, player in enumerate(world.players.values()):
        await world.master.subscribe_other(f"zone.{i % ZONES}", player.address)


async def traffic(world: World, seconds: float, on_tick: Callable[[float], object]) -> None:
    """Play for ``seconds``: chat, whispers, zone updates and a match every tick."""
    rng = world.rng
    names = list(world.players)
    start = time.monotonic()
    match = len(world.results_sent)
    while (elapsed := time.monotonic() - start) < seconds:
        on_tick(elapsed)
        speaker = world.players[rng.choice(names)]
        await speaker.publish(f"chat.room{rng.randrange(ROOMS)}", b"gg")
        world.sent["multicast"] += 1
        a, b = rng.sample(names, 2)
        await world.players[a].send(world.players[b].address, b"whisper")
        world.sent["unicast"] += 1
        await world.master.publish(f"zone.{rng.randrange(ZONES)}", b"a dragon appears")
        world.sent["multicast"] += 1
        match += 1
        winner, loser = rng.sample(names, 2)
        if rng.random() < 0.35:  # some players win more often: a ranking worth showing
            winner = names[rng.randrange(3)]
            loser = rng.choice([n for n in names if n != winner])
        result = {"match": match, "winner": winner, "loser": loser, "sent_at": time.time()}
        await world.matches.send(RESULTS, json.dumps(result).encode(), reliable=True)
        world.sent["multicast reliable"] += 1
        world.results_sent[match] = (winner, loser)
        await world.matches.send(world.players[winner].address, b"reward %d" % match, reliable=True)
        world.sent["unicast reliable"] += 1
        await asyncio.sleep(0.05)
