"""A game-server shard: every player is a service with its own address.

    python examples/game_shard.py [--players 200]

Two shard processes (here: two connectors) each hold their players as services. A
player sends position updates to other players by address (unicast: the mesh finds
the shard that holds them), chats in its zone (multicast), and a login pool answers
requests (anycast). ``send_nowait`` is the game loop's send: it never suspends, and
raises ``WouldBlock`` only while the link's buffer is full (then ``await flush()``).
"""

from __future__ import annotations

import argparse
import asyncio
import random

import meshbus

ZONES = ("forest", "castle", "harbour")


class Shard:
    def __init__(self, conn: meshbus.Connector) -> None:
        self.conn = conn
        self.players: list[meshbus.Service] = []
        self.positions = 0
        self.chat = 0

    async def spawn(self, count: int) -> None:
        for i in range(count):
            player = await self.conn.register()
            await player.subscribe(f"zone.{ZONES[i % len(ZONES)]}")
            player.add_listener(self._heard)
            self.players.append(player)

    def _heard(self, msg: meshbus.Message) -> None:
        if msg.subject is not None:
            self.chat += 1
        else:
            self.positions += 1

    async def tick(self, everyone: list[meshbus.Unicast], rng: random.Random) -> int:
        sent = 0
        for player in self.players:
            for other in rng.sample(everyone, 3):
                try:
                    player.send_nowait(other, rng.randbytes(16))
                except meshbus.WouldBlock:
                    await player.flush()
                    player.send_nowait(other, rng.randbytes(16))
                sent += 1
        speaker = rng.choice(self.players)
        await speaker.publish(f"zone.{rng.choice(ZONES)}", b"gg")
        return sent


async def login_pool(conn: meshbus.Connector) -> None:
    desk = await conn.register()
    await desk.join(meshbus.Anycast("login"))
    desk.add_listener(lambda msg: msg.reply_nowait(json={"ok": True, "token": msg.json()["user"]}))


async def main(players: int, ticks: int) -> None:
    rng = random.Random(7)
    async with meshbus.connect(server="shard1") as one, meshbus.connect(server="shard2") as two:
        shards = [Shard(one), Shard(two)]
        await login_pool(one)
        for shard in shards:
            await shard.spawn(players // 2)
        login = await two.request(meshbus.Anycast("login"), json={"user": "ann"})
        print(f"login: {login.json()}")
        everyone = [p.address for shard in shards for p in shard.players]
        sent = 0
        for _ in range(ticks):
            for shard in shards:
                sent += await shard.tick(everyone, rng)
        # A PONG comes after everything the broker read before the PING: the first round
        # means every send was routed, the second that each shard has read what it got.
        for _ in range(2):
            for shard in shards:
                await shard.conn.ping()
        received = sum(shard.positions for shard in shards)
        print(f"players: {len(everyone)}, position updates sent: {sent}, received: {received}")
        print(f"zone chat lines heard: {sum(shard.chat for shard in shards)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--players", type=int, default=200)
    parser.add_argument("--ticks", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.players, args.ticks))
