"""``python -m meshbus.demo``: one broker, two connectors, every routing pattern once.

The demo starts a real broker process (``meshbus broker --listen 127.0.0.1:0``),
waits for its ready line, runs a short scenario through the public API and
checks every step, then stops the broker with SIGTERM. It exits 0 when every
step behaved as described and 1 otherwise, so ``make demo`` doubles as a smoke
test of the installed package.

    connector game01   game01:1 (room, answers requests), alice, bob (dynamic ids)
    connector lobby01  lobby01:1..3 (login pool), lobby01:9 (never answers), carol
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from rich.console import Console

import meshbus
from meshbus import Anycast, Multicast, Service, Unicast
from meshbus.broker.process import BrokerStartError, spawn_broker
from meshbus.cli_admin import stat_renderables

STARTUP_TIMEOUT = 20.0
RECV_TIMEOUT = 2.0
SLOW_TIMEOUT = 0.5
LOGIN_REQUESTS = 6

console = Console(highlight=False)


class StepFailed(Exception):
    """A demo step did not behave as described."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise StepFailed(what)


async def start_broker() -> tuple[asyncio.subprocess.Process, str]:
    """Start ``meshbus broker`` on a free port; return the process and its HOST:PORT."""
    try:
        process, _, address = await spawn_broker(timeout=STARTUP_TIMEOUT)
    except BrokerStartError as exc:
        raise StepFailed(str(exc)) from exc
    return process, address


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


async def scenario(address: str) -> None:
    async with (
        await meshbus.connect(address, server="game01") as game,
        await meshbus.connect(address, server="lobby01") as lobby,
    ):
        room = await game.register(instance=1)
        alice = await game.register()
        bob = await game.register()
        logins = [await lobby.register(instance=n) for n in (1, 2, 3)]
        slow = await lobby.register(instance=9)
        carol = await lobby.register()
        console.print(
            f"connector [bold]game01[/]:  room {room.address}, alice {alice.address}, "
            f"bob {bob.address}\n"
            f"connector [bold]lobby01[/]: login pool {', '.join(str(s.address) for s in logins)}, "
            f"slow {slow.address}, carol {carol.address}"
        )

        async with asyncio.TaskGroup() as tasks:
            # The responders end when their connector closes at the end of the block.
            tasks.create_task(answer_all(room, lambda p: b"room 1 says: " + p))
            for login in logins:
                tasks.create_task(answer_all(login, welcome_from(login)))
            # `slow` is registered but nobody reads it: requests to it time out.

            try:
                failures = await run_steps(lobby, room, alice, bob, carol, logins, slow)
            finally:
                await game.close()
                await lobby.close()
    if failures:
        raise StepFailed("; ".join(failures))


async def run_steps(
    conn: meshbus.Connector,
    room: Service,
    alice: Service,
    bob: Service,
    carol: Service,
    logins: list[Service],
    slow: Service,
) -> list[str]:
    """Run every step; return the failures, one line each."""
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
        data = await conn.stat()
        for renderable in stat_renderables(data):
            console.print(renderable)
        groups = data.get("groups", {})
        check(len(groups.get(str(chat), [])) == 3, f"{chat} should have 3 members: {groups}")
        check(len(groups.get(str(pool), [])) == 3, f"{pool} should have 3 members: {groups}")

    await step("1. unicast send", unicast)
    await step("2. multicast chat", multicast)
    await step("3. anycast login pool", anycast)
    await step("4. request / response", request_response)
    await step("5. request to nobody -> NoRoute", no_route)
    await step("6. request to a silent service -> Timeout", timeout)
    await step("7. broker stat", stat)
    return failures


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


async def run() -> int:
    started = time.monotonic()
    console.print("[bold]meshbus demo[/]: starting a broker")
    try:
        process, address = await start_broker()
    except StepFailed as exc:
        console.print(f"[bold red]FAILED[/] {exc}")
        return 1
    console.print(f"broker listening on [bold]{address}[/] (pid {process.pid})")
    failed = ""
    try:
        await scenario(address)
    except* (StepFailed, meshbus.MeshbusError) as group:
        # A failing responder task arrives wrapped by the TaskGroup; show the leaves.
        failed = "; ".join(str(exc) for exc in leaves(group))
    finally:
        code = await stop_broker(process)
    console.rule("[bold]done")
    if code != 0:
        failed = failed or f"the broker exited with {code} on SIGTERM"
    else:
        console.print("broker stopped with SIGTERM (exit 0)")
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
