"""``python -m meshbus.demo``: a mesh of brokers, every routing pattern, a crash, a join, a drain.

The demo starts a mesh of three real broker processes (``meshbus broker
--seed ...`` on free ports), runs a short scenario through the public API and
checks every step, then stops the brokers with SIGTERM. It exits 0 when every
step behaved as described and 1 otherwise, so ``make demo`` doubles as a smoke
test of the installed package.

    connector game01 (on mesh-1)   game01:1 (room, answers requests), alice, bob
    connector lobby01 (on mesh-2)  lobby01:1..3 (login pool), lobby01:9 (never
                                   answers), carol
    connectors player1..6          one service each, spread over the brokers

Every message of steps 1-6 crosses from one broker to another. Then mesh-2 is
killed with kill -9 (its connectors fail over with the same addresses), mesh-4
joins (the others hand it connectors), and mesh-3 is drained with SIGTERM (its
connectors move); after each, every service is reached again.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rich.console import Console

import meshbus
from meshbus import Anycast, Multicast, Service, Unicast
from meshbus.broker.process import BrokerStartError, spawn_broker
from meshbus.cli_admin import stat_renderables

STARTUP_TIMEOUT = 20.0
RECV_TIMEOUT = 2.0
SLOW_TIMEOUT = 0.5
LOGIN_REQUESTS = 6
PLAYERS = 6
REACH_TIMEOUT = 10.0

console = Console(highlight=False)


class StepFailed(Exception):
    """A demo step did not behave as described."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise StepFailed(what)


@dataclass
class DemoBroker:
    process: asyncio.subprocess.Process
    name: str
    address: str


async def start_broker(name: str, *seed: str) -> DemoBroker:
    """Start ``meshbus broker --name NAME [--seed ...]`` on a free port; the ready line
    comes once it has joined the mesh."""
    args = ["--name", name, *(a for address in seed for a in ("--seed", address))]
    try:
        process, _, address = await spawn_broker(*args, timeout=STARTUP_TIMEOUT)
    except BrokerStartError as exc:
        raise StepFailed(str(exc)) from exc
    console.print(f"broker {name} listening on [bold]{address}[/] (pid {process.pid})")
    return DemoBroker(process, name, address)


async def stop_broker(process: asyncio.subprocess.Process) -> int:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(process.wait(), 10)
    except TimeoutError:
        process.kill()
        await process.wait()
        return -1


async def answer_all(service: Service, make_answer: Callable[[bytes], bytes]) -> None:
    """Answer every request to ``service`` until its connector closes."""
    async for msg in service:
        if msg.is_request:
            await msg.reply(make_answer(msg.payload))


def welcome_from(login: Service) -> Callable[[bytes], bytes]:
    return lambda payload: f"welcome from {login.address}".encode()


@dataclass
class Cast:
    """Everyone in the demo: the brokers, the connectors and their services."""

    mesh: list[DemoBroker]
    game: meshbus.Connector
    lobby: meshbus.Connector
    players: list[meshbus.Connector]
    room: Service
    alice: Service
    bob: Service
    carol: Service
    logins: list[Service]
    slow: Service
    avatars: list[Service]  # one per player connector, answering requests


async def scenario(mesh: list[DemoBroker]) -> None:
    addresses = ",".join(b.address for b in mesh)
    async with (
        await meshbus.connect(mesh[0].address, server="game01") as game,
        await meshbus.connect(mesh[1].address, server="lobby01") as lobby,
    ):
        players = [
            await meshbus.connect(mesh[i % len(mesh)].address, server=f"player{i + 1}")
            for i in range(PLAYERS)
        ]
        room = await game.register(instance=1)
        alice = await game.register()
        bob = await game.register()
        logins = [await lobby.register(instance=n) for n in (1, 2, 3)]
        slow = await lobby.register(instance=9)
        carol = await lobby.register()
        avatars = [await p.register(instance=1) for p in players]
        console.print(
            f"mesh: {addresses}\n"
            f"connector [bold]game01[/] on {game.broker_name}: room {room.address}, "
            f"alice {alice.address}, bob {bob.address}\n"
            f"connector [bold]lobby01[/] on {lobby.broker_name}: login pool "
            f"{', '.join(str(s.address) for s in logins)}, slow {slow.address}, "
            f"carol {carol.address}\n"
            f"{PLAYERS} player connectors: "
            + ", ".join(
                f"{a.address} on {p.broker_name}" for a, p in zip(avatars, players, strict=True)
            )
        )
        cast = Cast(mesh, game, lobby, players, room, alice, bob, carol, logins, slow, avatars)

        async with asyncio.TaskGroup() as tasks:
            # The responders end when their connector closes at the end of the block.
            tasks.create_task(answer_all(room, lambda p: b"room 1 says: " + p))
            for login in logins:
                tasks.create_task(answer_all(login, welcome_from(login)))
            for avatar in avatars:
                tasks.create_task(answer_all(avatar, lambda p: b"here"))
            # `slow` is registered but nobody reads it: requests to it time out.

            try:
                failures = await run_steps(cast)
            finally:
                for conn in (game, lobby, *players):
                    await conn.close()
    if failures:
        raise StepFailed("; ".join(failures))


async def run_steps(cast: Cast) -> list[str]:
    """Run every step; return the failures, one line each."""
    alice, bob, carol, room = cast.alice, cast.bob, cast.carol, cast.room
    logins, slow = cast.logins, cast.slow
    # Each step only ends the demo early if the bus is unusable; otherwise it is
    # reported and the next step runs, so one run shows everything that is wrong.
    failures: list[str] = []

    async def step(title: str, body: Callable[[], Awaitable[None]]) -> None:
        console.rule(f"[bold]{title}")
        try:
            await body()
        except (StepFailed, meshbus.MeshbusError) as exc:
            failures.append(f"{title}: {exc}")
            console.print(f"[bold red]FAILED[/] {exc}")
        else:
            console.print("[green]ok[/]")

    # Unicast send across connectors: alice (game01) tells carol (lobby01) something.
    async def unicast() -> None:
        await alice.send(carol.address, b"hi carol, alice here")
        msg = await carol.recv(timeout=RECV_TIMEOUT)
        console.print(f"{msg.dst} got from {msg.src}: {msg.payload.decode()!r}")
        check(msg.src == alice.address and msg.payload == b"hi carol, alice here", "wrong message")

    # Multicast: every member but the sender gets a copy, across both connectors.
    chat = Multicast("chat.lobby")

    # A join is answered once every broker knows it: alice (mesh-1) can send at once.
    async def multicast() -> None:
        for member in (alice, bob, carol):
            await member.join(chat)
        await alice.send(chat, b"hello, lobby!")
        for member in (bob, carol):
            msg = await member.recv(timeout=RECV_TIMEOUT)
            console.print(
                f"{member.address} got {msg.payload.decode()!r} from {msg.src} via {chat}"
            )
            check(msg.payload == b"hello, lobby!", f"{member.address} got {msg.payload!r}")
        # The sender is skipped unless it asks for echo. Alice shares bob's connector, so
        # a copy for her would have arrived with his.
        try:
            extra = await alice.recv(timeout=0.05)
        except meshbus.Timeout:
            console.print(f"the sender {alice.address} got no copy of its own message (no echo)")
        else:
            raise StepFailed(f"the sender received its own message: {extra!r}")

    # Anycast: each request goes to exactly one member of the login pool.
    pool = Anycast("login")

    async def anycast() -> None:
        for login in logins:
            await login.join(pool)
        served: Counter[str] = Counter()
        for n in range(1, LOGIN_REQUESTS + 1):
            user = ("alice", "bob")[n % 2]
            requester = alice if user == "alice" else bob
            response = await requester.request(pool, f"login {user}".encode(), timeout=2.0)
            served[str(response.src)] += 1
            console.print(
                f"request {n} ({user}) -> {pool} taken by [bold]{response.src}[/]: "
                f"{response.payload.decode()!r}"
            )
        check(sum(served.values()) == LOGIN_REQUESTS, "not every login was answered")
        check(set(served) <= {str(s.address) for s in logins}, f"answered by strangers: {served}")
        console.print(
            "answers per pool member: " + ", ".join(f"{a}={n}" for a, n in sorted(served.items()))
        )

    # Request/response across connectors: carol (lobby01) asks the room (game01).
    async def request_response() -> None:
        response = await carol.request(room.address, b"who is here?", timeout=2.0)
        console.print(f"{carol.address} asked {room.address}, got {response.payload.decode()!r}")
        check(response.payload == b"room 1 says: who is here?", f"got {response.payload!r}")

    # A request nobody can take: the broker answers NO_ROUTE at once.
    async def no_route() -> None:
        nobody = Unicast("nobody", 42)
        started = time.monotonic()
        try:
            await alice.request(nobody, b"hello?", timeout=2.0)
        except meshbus.NoRoute as exc:
            elapsed = time.monotonic() - started
            console.print(f"NoRoute after {elapsed * 1000:.1f} ms: {exc}")
            check(elapsed < 1.0, f"NoRoute took {elapsed:.2f} s; it should be immediate")
        else:
            raise StepFailed("a request to an unregistered address got a response")

    # A request to a service that never answers: the broker's deadline fires.
    async def timeout() -> None:
        started = time.monotonic()
        try:
            await alice.request(slow.address, b"are you there?", timeout=SLOW_TIMEOUT)
        except meshbus.Timeout as exc:
            elapsed = time.monotonic() - started
            console.print(f"Timeout after {elapsed:.3f} s (deadline {SLOW_TIMEOUT} s): {exc}")
            check(
                SLOW_TIMEOUT * 0.9 <= elapsed < SLOW_TIMEOUT + 0.5,
                f"Timeout after {elapsed:.3f} s, expected about {SLOW_TIMEOUT} s",
            )
        else:
            raise StepFailed("a service that never answers sent a response")

    async def stat() -> None:
        data = await cast.lobby.stat()
        for renderable in stat_renderables(data):
            console.print(renderable)
        groups = data.get("groups", {})
        check(len(groups.get(str(chat), [])) == 3, f"{chat} should have 3 members: {groups}")
        check(len(groups.get(str(pool), [])) == 3, f"{pool} should have 3 members: {groups}")
        check(len(data["peers"]) == len(cast.mesh) - 1, f"peers: {data['peers']}")

    connectors = [cast.game, cast.lobby, *cast.players]

    async def reach_everyone() -> float:
        """Seconds until alice (on mesh-1) has an answer from every player and the
        login pool."""
        started = time.monotonic()
        pending: list[meshbus.Address] = [a.address for a in cast.avatars] + [pool]
        while pending:
            results = await asyncio.gather(
                *(alice.request(t, b"ping", timeout=0.5) for t in pending),
                return_exceptions=True,
            )
            pending = [t for t, r in zip(pending, results, strict=True) if isinstance(r, Exception)]
            if pending:
                check(time.monotonic() - started < REACH_TIMEOUT, f"unreachable: {pending}")
                await asyncio.sleep(0.01)
        return time.monotonic() - started

    def where() -> str:
        by_broker: dict[str, list[str]] = {}
        for conn in connectors:
            by_broker.setdefault(conn.broker_name, []).append(conn.name)
        return "; ".join(f"{b}: {', '.join(n)}" for b, n in sorted(by_broker.items()))

    # kill -9 a broker: its connectors fail over, with the same addresses.
    async def crash() -> None:
        victim = cast.mesh[1]
        orphans = [c for c in connectors if c.broker_name == victim.name]
        before = sorted(str(s.address) for c in orphans for s in c.services)
        victim.process.kill()
        took = await reach_everyone()
        cast.mesh.remove(victim)
        await victim.process.wait()
        console.print(
            f"kill -9 {victim.name}: {len(orphans)} connectors failed over, and every service "
            f"answered again after {took * 1000:.0f} ms"
        )
        console.print(f"connectors now: {where()}")
        check(all(c.failovers == 1 for c in orphans), "a connector did not fail over")
        after = sorted(str(s.address) for c in orphans for s in c.services)
        check(after == before, f"addresses changed: {before} -> {after}")
        console.print(f"same addresses after failover: {', '.join(after)}")

    async def counts() -> dict[str, int]:
        mesh = (await cast.game.stat(detail=False))["mesh"]
        return {b["name"]: b["connectors"] for b in mesh}

    # A new broker joins: the others hand it connectors until the spread is within one.
    async def join() -> None:
        newcomer = await start_broker("mesh-4", cast.mesh[0].address)
        cast.mesh.append(newcomer)
        started = time.monotonic()
        while True:
            spread = await counts()
            if len(spread) == 3 and max(spread.values()) - min(spread.values()) <= 1:
                break
            check(time.monotonic() - started < REACH_TIMEOUT, f"not balanced: {spread}")
            await asyncio.sleep(0.02)
        console.print(
            f"{newcomer.name} joined; connectors per broker after "
            f"{(time.monotonic() - started) * 1000:.0f} ms: "
            + ", ".join(f"{name}={n}" for name, n in sorted(spread.items()))
        )
        console.print(f"connectors now: {where()}")
        await reach_everyone()

    # Drain a broker with SIGTERM: its connectors move away, then it exits.
    async def drain() -> None:
        leaving = next(b for b in cast.mesh if b.name == "mesh-3")
        movers = [c for c in connectors if c.broker_name == leaving.name]
        code = await stop_broker(leaving.process)
        cast.mesh.remove(leaving)
        check(code == 0, f"{leaving.name} exited with {code}")
        took = await reach_everyone()
        console.print(
            f"SIGTERM {leaving.name}: it drained {len(movers)} connectors and exited 0; "
            f"every service answered {took * 1000:.0f} ms later"
        )
        console.print(f"connectors now: {where()}")
        check(all(c.moves >= 1 for c in movers), "a connector did not move")
        check(all(c.broker_name != leaving.name for c in connectors), "one stayed behind")
        for renderable in stat_renderables(await cast.game.stat(detail=False))[:3]:
            console.print(renderable)

    await step("1. unicast send", unicast)
    await step("2. multicast chat", multicast)
    await step("3. anycast login pool", anycast)
    await step("4. request / response", request_response)
    await step("5. request to nobody -> NoRoute", no_route)
    await step("6. request to a silent service -> Timeout", timeout)
    await step("7. broker stat", stat)
    await step("8. a broker crashes (kill -9) -> failover", crash)
    await step("9. a broker joins -> rebalance", join)
    await step("10. a broker drains (SIGTERM) -> connectors move", drain)
    return failures


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


async def run() -> int:
    started = time.monotonic()
    console.print("[bold]meshbus demo[/]: starting a mesh of three brokers")
    mesh: list[DemoBroker] = []
    failed = ""
    try:
        mesh.append(await start_broker("mesh-1"))
        mesh.extend(
            await asyncio.gather(*(start_broker(f"mesh-{i}", mesh[0].address) for i in (2, 3)))
        )
        await scenario(mesh)
    except* (StepFailed, meshbus.MeshbusError) as group:
        # A failing responder task arrives wrapped by the TaskGroup; show the leaves.
        failed = "; ".join(str(exc) for exc in leaves(group))
    finally:
        codes = {b.name: await stop_broker(b.process) for b in mesh}
    console.rule("[bold]done")
    if any(codes.values()):
        failed = failed or f"brokers exited with {codes} on SIGTERM"
    else:
        console.print(f"brokers {', '.join(codes)} stopped with SIGTERM (exit 0)")
    if failed:
        console.print(f"[bold red]demo FAILED[/]: {failed}")
        return 1
    console.print(f"[bold green]demo passed[/] in {time.monotonic() - started:.1f} s")
    return 0


def main() -> None:
    import uvloop

    sys.exit(uvloop.run(run()))


if __name__ == "__main__":
    main()
