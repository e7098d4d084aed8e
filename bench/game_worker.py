"""One process of `python -m bench game`: a game server, the login pool, the match-results
producer or its consumer, on meshbus (the public client API) or on NATS (nats.py).

Run as ``python -m bench.game_worker CONFIG`` (``CONFIG`` is the JSON of ``WorkerConfig``)
by ``bench.game``, which talks to it over its stdin and stdout, one line each way:

1. the worker connects, registers or subscribes everything it needs, and prints ``ready``;
2. it reads ``go START WINDOW_START WINDOW_END`` (``time.monotonic()`` values, one clock
   for every process of the machine): it sends from START to WINDOW_END and counts what
   it sends and receives between WINDOW_START and WINDOW_END only;
3. it prints its counts as one JSON line (``WorkerResult``), reads ``stop`` and closes.

Both systems run the same code around the same calls: the same payloads (``POSITION``,
``LOGIN_REQUEST``...), the same pacing (``paced``), the same work per received message
(``Counts.delivered``); only the client calls differ (``MeshbusSide``, ``NatsSide``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

import meshbus
from bench.nats_py import flushed

if TYPE_CHECKING:  # nats.py is imported by the NATS side only, when it runs
    import nats.aio.client
    import nats.aio.msg

# A position update: kind tag, zone, sending player, position x y z, velocity x y z and the
# game time it was taken at -- 40 bytes, the same on both systems.
POSITION = struct.Struct("<cxHI6fd")
UNICAST_TAG = b"U"
ZONE_TAG = b"Z"
_SENDER = slice(4, 8)  # the sending player's number inside POSITION
LOGIN_REQUEST = b"login:player-000000:token-0123456"[:32].ljust(32, b".")  # 32 bytes
LOGIN_REPLY = b"ok:session-0123456789abcdef:ttl=3600".ljust(48, b".")  # 48 bytes
RESULT = b"match-000000:winner=player-000000:score=21-17:".ljust(64, b".")  # 64 bytes
ACK = b"ack"

# Pacing: every tick sends what fell due since the last one; a sender more than this
# many seconds behind its schedule skips the rest (counted), so load stays bounded.
_TICK = 0.005
_MAX_BEHIND = 0.5
_REQUEST_TIMEOUT = 5.0
_ACK_TIMEOUT = 2.0  # NATS results: a request not acked in this time is sent again


@dataclass
class WorkerConfig:
    system: str  # "meshbus" or "nats"
    role: str  # "game", "login", "producer" or "consumer"
    address: str  # HOST:PORT of the server this process connects to
    index: int = 0  # the game server's number
    game_servers: int = 4
    players: int = 500  # per game server
    zones: int = 20
    unicast_rate: float = 2.0  # per player per second
    zone_rate: float = 0.2  # per player per second
    login_rate: float = 100.0  # per game server per second
    responders: int = 8
    results_rate: float = 200.0
    max_in_flight: int = 1000  # requests of one process at once; more are skipped


@dataclass
class WorkerResult:
    """What one process counted inside the measured window."""

    role: str
    unicast_sent: int = 0
    zone_sent: int = 0
    unicast: int = 0  # unicast position updates received
    zone: int = 0  # zone updates received (not counting a player's own)
    requests: int = 0  # login requests answered
    request_errors: int = 0
    latencies_us: list[float] = field(default_factory=list)
    answered: int = 0  # the login pool: requests it replied to
    results_sent: int = 0
    reliable: int = 0  # the consumer: match results received
    skipped: int = 0  # sends skipped by a sender behind its schedule
    failed: int = 0  # reliable sends given up


class Counts:
    """The counting of one process: on only inside the window."""

    def __init__(self, role: str) -> None:
        self.on = False
        self.result = WorkerResult(role)

    def delivered(self, own: int, payload: bytes) -> None:
        """A position update reached player ``own`` (what every player does with one)."""
        if not self.on:
            return
        if payload[:1] == UNICAST_TAG:
            self.result.unicast += 1
        elif int.from_bytes(payload[_SENDER], "little") != own:
            # A NATS subscriber also gets what its own connection published to its zone;
            # meshbus does not hand a service its own group send. Neither is counted.
            self.result.zone += 1


def position(tag: bytes, zone: int, player: int) -> bytes:
    return POSITION.pack(tag, zone, player, 1.0, 2.0, 3.0, 0.1, 0.2, 0.3, time.time())


# -- the two systems -------------------------------------------------------------------------


class Side(Protocol):
    """One system's client calls, everything the roles need."""

    async def open(self, name: str) -> None: ...

    async def add_player(self, player: int, zone: int, counts: Counts) -> None: ...

    async def ready(self) -> None:
        """Everything added so far is in place at the server."""
        ...

    async def send_unicast(self, src: int, dst: int, payload: bytes) -> None: ...

    async def send_zone(self, src: int, zone: int, payload: bytes) -> None: ...

    async def login(self, src: int, payload: bytes) -> bytes: ...

    async def serve_login(self, responders: int, counts: Counts) -> None: ...

    async def consume_results(self, counts: Counts) -> None: ...

    async def prepare_results(self, counts: Counts) -> None:
        """Set up the sending of match results; a send given up is counted in ``counts``."""
        ...

    async def send_result(self, payload: bytes, counts: Counts) -> None:
        """Send one match result reliably."""
        ...

    async def settle(self) -> None:
        """Wait for what was sent reliably to be acknowledged (bounded)."""
        ...

    async def close(self) -> None: ...


def _split(player: int, per_server: int) -> tuple[int, int]:
    return divmod(player, per_server)


class MeshbusSide:
    """meshbus: one connector per process, a service per player at a fixed address
    (``g<server>:<1 + player>``), a multicast group per zone, an anycast pool of login
    services, and the consumer's fixed address ``results:1`` for reliable sends."""

    def __init__(self, config: WorkerConfig) -> None:
        self._config = config
        self._conn: meshbus.Connector | None = None
        self._services: dict[int, meshbus.Service] = {}
        self._players = [
            meshbus.Unicast(f"g{g}", 1 + p)
            for g in range(config.game_servers)
            for p in range(config.players)
        ]
        self._zones = [meshbus.Multicast(f"game.zone.{z}") for z in range(config.zones)]
        self._login = meshbus.Anycast("game.login")
        self._results = meshbus.Unicast("results", 1)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def conn(self) -> meshbus.Connector:
        assert self._conn is not None
        return self._conn

    async def open(self, name: str) -> None:
        self._conn = await meshbus.connect(self._config.address, server=name, failover=False)

    async def add_player(self, player: int, zone: int, counts: Counts) -> None:
        _, local = _split(player, self._config.players)
        svc = await self.conn.register(instance=1 + local)
        self._services[player] = svc
        await svc.join(self._zones[zone])
        delivered = counts.delivered
        svc.add_listener(lambda msg: delivered(player, msg.payload))

    async def ready(self) -> None:
        await self.conn.ping()

    async def send_unicast(self, src: int, dst: int, payload: bytes) -> None:
        await self._services[src].send(self._players[dst], payload)

    async def send_zone(self, src: int, zone: int, payload: bytes) -> None:
        await self._services[src].send(self._zones[zone], payload)

    async def login(self, src: int, payload: bytes) -> bytes:
        msg = await self._services[src].request(self._login, payload, timeout=_REQUEST_TIMEOUT)
        return msg.payload

    async def serve_login(self, responders: int, counts: Counts) -> None:
        for _ in range(responders):
            svc = await self.conn.register()
            await svc.join(self._login)
            self._tasks.append(asyncio.create_task(self._answer(svc, counts)))

    @staticmethod
    async def _answer(svc: meshbus.Service, counts: Counts) -> None:
        async for msg in svc:
            await msg.reply(LOGIN_REPLY)
            if counts.on:
                counts.result.answered += 1

    async def consume_results(self, counts: Counts) -> None:
        svc = await self.conn.register(instance=1)

        def received(_msg: meshbus.Message) -> None:
            if counts.on:
                counts.result.reliable += 1

        svc.add_listener(received)

    async def prepare_results(self, counts: Counts) -> None:
        self._services[0] = await self.conn.register(instance=1)

        def failed(_failure: meshbus.DeliveryFailed) -> None:
            counts.result.failed += 1

        self.conn.on_delivery_failed(failed)

    async def send_result(self, payload: bytes, counts: Counts) -> None:
        await self._services[0].send(self._results, payload, reliable=True)

    async def settle(self) -> None:
        with contextlib.suppress(TimeoutError):
            await self.conn.wait_acked(timeout=_ACK_TIMEOUT)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._conn is not None:
            await self._conn.close()


class NatsSide:
    """NATS (nats.py): one connection per process, a subject per player
    (``game.player.<n>``) and per zone (``game.zone.<z>``) with one subscription each
    per player, the login pool a queue group, and match results requests that the
    consumer acknowledges with a reply (at least once: resent when not acked)."""

    def __init__(self, config: WorkerConfig) -> None:

        self._config = config
        self._nc: nats.aio.client.Client | None = None
        self._in_flight: set[asyncio.Task[None]] = set()

    @property
    def nc(self) -> nats.aio.client.Client:
        assert self._nc is not None
        return self._nc

    async def open(self, name: str) -> None:
        import nats

        self._nc = await nats.connect(
            f"nats://{self._config.address}", name=name, allow_reconnect=False
        )

    async def add_player(self, player: int, zone: int, counts: Counts) -> None:
        delivered = counts.delivered

        async def callback(msg: nats.aio.msg.Msg) -> None:
            delivered(player, msg.data)

        await self.nc.subscribe(f"game.player.{player}", cb=callback)
        await self.nc.subscribe(f"game.zone.{zone}", cb=callback)

    async def ready(self) -> None:
        await flushed(self.nc)

    async def send_unicast(self, src: int, dst: int, payload: bytes) -> None:
        await self.nc.publish(f"game.player.{dst}", payload)

    async def send_zone(self, src: int, zone: int, payload: bytes) -> None:
        await self.nc.publish(f"game.zone.{zone}", payload)

    async def login(self, src: int, payload: bytes) -> bytes:
        msg = await self.nc.request("game.login", payload, timeout=_REQUEST_TIMEOUT)
        return msg.data

    async def serve_login(self, responders: int, counts: Counts) -> None:
        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(LOGIN_REPLY)
            if counts.on:
                counts.result.answered += 1

        for _ in range(responders):
            await self.nc.subscribe("game.login", queue="login", cb=answer)

    async def consume_results(self, counts: Counts) -> None:
        async def received(msg: nats.aio.msg.Msg) -> None:
            if counts.on:
                counts.result.reliable += 1
            await msg.respond(ACK)

        await self.nc.subscribe("game.results", cb=received)

    async def prepare_results(self, counts: Counts) -> None:
        pass

    async def send_result(self, payload: bytes, counts: Counts) -> None:
        task = asyncio.create_task(self._send_until_acked(payload, counts))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send_until_acked(self, payload: bytes, counts: Counts) -> None:
        import nats.errors

        for _ in range(5):  # meshbus's retry policy gives up after a few attempts too
            try:
                await self.nc.request("game.results", payload, timeout=_ACK_TIMEOUT)
                return
            except nats.errors.TimeoutError:
                continue
        counts.result.failed += 1

    async def settle(self) -> None:
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=_ACK_TIMEOUT)

    async def close(self) -> None:
        for task in self._in_flight:
            task.cancel()
        if self._nc is not None:
            await self._nc.close()


# -- pacing ----------------------------------------------------------------------------------


async def paced(
    rate: float, start: float, end: float, send: Callable[[int], Awaitable[None]]
) -> int:
    """Call ``send(0)``, ``send(1)``, ... at ``rate`` per second from ``start`` until ``end``
    (monotonic), a tick's worth at a time; returns how many fell due but were skipped
    because the sender was more than ``_MAX_BEHIND`` seconds behind."""
    if rate <= 0:
        return 0
    sent = skipped = 0
    most_behind = max(1, int(rate * _MAX_BEHIND))
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    while (now := time.monotonic()) < end:
        due = int((now - start) * rate) - skipped
        if due - sent > most_behind:
            skipped += due - sent - most_behind
            due = sent + most_behind
        while sent < due:
            await send(sent)
            sent += 1
        await asyncio.sleep(_TICK)
    return skipped


# -- the roles -------------------------------------------------------------------------------


class Role:
    def __init__(self, config: WorkerConfig, side: Side) -> None:
        self.config = config
        self.side = side
        self.counts = Counts(config.role)

    async def setup(self) -> None:
        raise NotImplementedError

    async def run(self, start: float, end: float) -> None:
        """Send from ``start`` until ``end``."""
        await asyncio.sleep(max(0.0, end - time.monotonic()))


class GameServer(Role):
    """P players: each sends position updates to random other players and to its zone at
    the configured rates, round robin over the players; login requests at their rate."""

    async def setup(self) -> None:
        c = self.config
        await self.side.open(f"g{c.index}")
        first = c.index * c.players
        for player in range(first, first + c.players):
            await self.side.add_player(player, player % c.zones, self.counts)
        await self.side.ready()
        self._first = first
        self._all = c.game_servers * c.players
        self._rng = random.Random(c.index)
        self._in_flight: set[asyncio.Task[None]] = set()

    async def run(self, start: float, end: float) -> None:
        c, side, result = self.config, self.side, self.counts.result

        async def unicast(n: int) -> None:
            src = self._first + n % c.players
            dst = self._rng.randrange(self._all - 1)
            dst += dst >= src  # anyone but the sender
            await side.send_unicast(src, dst, position(UNICAST_TAG, src % c.zones, src))
            if self.counts.on:
                result.unicast_sent += 1

        async def zone(n: int) -> None:
            src = self._first + n % c.players
            z = src % c.zones
            await side.send_zone(src, z, position(ZONE_TAG, z, src))
            if self.counts.on:
                result.zone_sent += 1

        async def login(n: int) -> None:
            if len(self._in_flight) >= c.max_in_flight:
                result.skipped += 1
                return
            task = asyncio.create_task(self._login(self._first + n % c.players))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

        skipped = await asyncio.gather(
            paced(c.unicast_rate * c.players, start, end, unicast),
            paced(c.zone_rate * c.players, start, end, zone),
            paced(c.login_rate, start, end, login),
        )
        result.skipped += sum(skipped)
        for task in self._in_flight:
            task.cancel()

    async def _login(self, player: int) -> None:
        began = time.perf_counter()
        try:
            await self.side.login(player, LOGIN_REQUEST)
        except Exception:
            if self.counts.on:
                self.counts.result.request_errors += 1
            return
        if self.counts.on:
            self.counts.result.requests += 1
            self.counts.result.latencies_us.append((time.perf_counter() - began) * 1e6)


class LoginPool(Role):
    async def setup(self) -> None:
        await self.side.open("login")
        await self.side.serve_login(self.config.responders, self.counts)
        await self.side.ready()


class ResultsConsumer(Role):
    async def setup(self) -> None:
        await self.side.open("results")
        await self.side.consume_results(self.counts)
        await self.side.ready()


class ResultsProducer(Role):
    async def setup(self) -> None:
        await self.side.open("producer")
        await self.side.prepare_results(self.counts)
        await self.side.ready()

    async def run(self, start: float, end: float) -> None:
        result = self.counts.result

        async def send(_n: int) -> None:
            await self.side.send_result(RESULT, self.counts)
            if self.counts.on:
                result.results_sent += 1

        result.skipped += await paced(self.config.results_rate, start, end, send)
        await self.side.settle()


_ROLES: dict[str, type[Role]] = {
    "game": GameServer,
    "login": LoginPool,
    "consumer": ResultsConsumer,
    "producer": ResultsProducer,
}


async def _read_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _count_between(counts: Counts, start: float, end: float) -> None:
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    counts.on = True
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    counts.on = False


async def work(config: WorkerConfig) -> None:
    side: Side = MeshbusSide(config) if config.system == "meshbus" else NatsSide(config)
    role = _ROLES[config.role](config, side)
    try:
        await role.setup()
        print("ready", flush=True)
        go = (await _read_line()).split()
        if not go or go[0] != "go":
            return
        start, window_start, window_end = (float(x) for x in go[1:4])
        counting = asyncio.create_task(_count_between(role.counts, window_start, window_end))
        await role.run(start, window_end)
        await counting
        print(json.dumps(asdict(role.counts.result)), flush=True)
        await _read_line()  # stop: every process has reported
    finally:
        await side.close()


def main() -> None:
    import uvloop

    config = WorkerConfig(**json.loads(sys.argv[1]))
    uvloop.run(work(config))


if __name__ == "__main__":
    main()
