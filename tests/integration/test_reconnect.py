"""A connector whose brokers die: it reconnects to one that comes back, and a program that
ends meanwhile, or cancels what waits on the connector, ends cleanly.

The broker restarts on the port it had, as a supervisor (systemd, a container) would
restart it: the connector comes back to it within ``failover_timeout`` and brings its
services, and its unacknowledged reliable sends, along.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import textwrap
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import meshbus
from meshbus.address import Unicast
from meshbus.broker.process import child_env, spawn_broker
from meshbus.protocol import ControlType, encode_control
from meshbus.protocol.control import AddressBody, Register, Welcome
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.helpers import IO_TIMEOUT, RawLink, stat, wait_until

# How long the broker stays down: well inside the connectors' failover_timeout.
DOWNTIME = 3.0
FAILOVER_TIMEOUT = 20.0
# What must never reach a program's stderr when it ends.
UNCLEAN = (
    "Traceback",
    "Task was destroyed",
    "never retrieved",
    "never awaited",
    "Exception ignored",
)


async def kill(broker: BrokerProcess) -> None:
    """kill -9, and wait until it is gone (its port is free again)."""
    broker.process.kill()
    await broker.process.wait()


async def restart(broker: BrokerProcess) -> BrokerProcess:
    """The same broker started again on the port it had."""
    process, name, address, _ = await spawn_broker(listen=broker.address)
    assert address == broker.address
    return BrokerProcess(process, name, address)


async def reconnected(conn: meshbus.Connector, address: str) -> None:
    async def linked() -> bool:
        return conn.broker_address == address

    await wait_until(linked, f"{conn.name} linked to {address} again", FAILOVER_TIMEOUT)


async def failing_over(conn: meshbus.Connector) -> None:
    async def lost() -> bool:
        return conn.broker_address == ""

    await wait_until(lost, f"{conn.name} noticing its broker is gone", IO_TIMEOUT)


# -- a broker that restarts -------------------------------------------------------------------


async def test_a_connector_comes_back_to_its_restarted_broker() -> None:
    broker = await start_broker()
    server_conn = await meshbus.connect(
        broker.address, server="svc", failover_timeout=FAILOVER_TIMEOUT
    )
    client_conn = await meshbus.connect(
        broker.address, server="cli", failover_timeout=FAILOVER_TIMEOUT
    )
    restarted: BrokerProcess | None = None
    try:
        svc = await server_conn.register()
        fixed = await server_conn.register(7)
        client = await client_conn.register()
        received: list[bytes] = []

        async def serve() -> None:
            async for message in svc:
                if message.is_request:
                    await message.reply(b"re:" + message.payload)
                else:
                    received.append(message.payload)

        serving = asyncio.create_task(serve())
        assert (await client.request(svc.address, b"before", timeout=5)).payload == b"re:before"

        # Unacknowledged when the broker dies: no ack can have come back yet.
        await client.send(svc.address, b"across", reliable=True)
        assert client_conn.unacked == 1
        await kill(broker)
        await asyncio.gather(failing_over(server_conn), failing_over(client_conn))
        # Sent while there is no broker at all: it waits for one.
        during = asyncio.create_task(client.send(svc.address, b"during", reliable=True))
        await asyncio.sleep(DOWNTIME)  # the outage itself, not a wait for something
        assert not during.done()

        restarted = await restart(broker)
        await asyncio.gather(
            reconnected(server_conn, broker.address), reconnected(client_conn, broker.address)
        )
        await asyncio.wait_for(during, IO_TIMEOUT)
        assert server_conn.failovers == client_conn.failovers == 1
        # The restarted broker knows the services again, dynamic and fixed, same addresses.
        addresses = (await stat(restarted))["service_addresses"]
        assert {str(svc.address), str(fixed.address), str(client.address)} <= set(addresses)
        assert (await client.request(svc.address, b"after", timeout=5)).payload == b"re:after"
        await client_conn.wait_acked(timeout=IO_TIMEOUT)
        # Exactly once, however the resend and the first copy crossed the restart.
        await client.send(svc.address, b"last", reliable=True)
        await client_conn.wait_acked(timeout=IO_TIMEOUT)

        async def got_last() -> bool:
            return b"last" in received

        await wait_until(got_last, "the last message")
        assert received.count(b"across") == 1, received
        assert received.count(b"during") == 1, received
        serving.cancel()
    finally:
        await client_conn.close()
        await server_conn.close()
        if restarted is not None:
            assert await restarted.stop() == 0


async def test_a_broker_that_stays_down_past_failover_timeout_loses_the_mesh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = await start_broker()
    conn = await meshbus.connect(broker.address, server="alone", failover_timeout=1.0)
    try:
        svc = await conn.register()
        loop = asyncio.get_running_loop()
        await kill(broker)
        lost_at = loop.time()
        with pytest.raises(meshbus.ConnectionLost, match=r"within failover_timeout 1\.0 s"):
            await asyncio.wait_for(svc.send(svc.address, b"waits, then fails"), IO_TIMEOUT)
        # It kept trying until the timeout: the send waited rather than failing at once.
        assert loop.time() - lost_at >= 0.9
        with pytest.raises(meshbus.ConnectionLost):
            await asyncio.wait_for(svc.recv(), IO_TIMEOUT)
        assert conn.failovers == 0
        # What a default logging.basicConfig() prints says which broker, why and how long
        # (the fields stay in the record's extra for JSON logging).
        said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "meshbus.client"]
        lost = [text for level, text in said if level == logging.WARNING and "lost broker" in text]
        assert lost, said
        assert lost[0].startswith(f"lost broker {broker.name} (")
        assert lost[0].endswith("failing over for up to 1 s")
        given_up = [text for level, text in said if level == logging.ERROR]
        assert any(text.startswith("lost the mesh: ") for text in given_up), said
        assert any("within failover_timeout 1.0 s" in text for text in given_up), said
    finally:
        await conn.close()


# -- ending while failing over ----------------------------------------------------------------

PROGRAM = """
import asyncio, os, signal, sys
import meshbus

async def main() -> None:
    addresses, pids = sys.argv[1], [int(p) for p in sys.argv[2].split(",")]
    conns = [
        await meshbus.connect(addresses, server=f"p{i}", failover_timeout=30) for i in range(3)
    ]
    for conn in conns:
        service = await conn.register()
        await service.join(meshbus.Multicast("everyone"))

    async def tidy_up() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.5)  # asyncio.run's cancelling of the tasks lasts this long

    async def send_on(service: meshbus.Service) -> None:
        while True:
            await service.send(service.address, b"x")
            await asyncio.sleep(0.01)

    asyncio.get_running_loop().create_task(tidy_up())
    for conn in conns:
        asyncio.get_running_loop().create_task(send_on(conn.services[0]))
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    # Returns at once: the links are lost while asyncio.run cancels the tasks. No close().

asyncio.run(main())
"""


async def test_a_program_ending_without_close_while_its_brokers_die_prints_nothing(
    tmp_path: Path,
) -> None:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    brokers = await start_mesh(2)
    try:
        program = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            ",".join(b.address for b in brokers),
            ",".join(str(b.process.pid) for b in brokers),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=child_env(),
        )
        _, err = await asyncio.wait_for(program.communicate(), 30)
    finally:
        for b in brokers:
            with contextlib.suppress(ProcessLookupError):
                b.process.kill()
        await stop_all(brokers)
    stderr = err.decode()
    assert program.returncode == 0, stderr
    for unclean in UNCLEAN:
        assert unclean not in stderr, stderr


# -- cancelling what waits on a connector that fails over ----------------------------------------


@contextlib.asynccontextmanager
async def clean_loop() -> AsyncIterator[list[dict[str, Any]]]:
    """What the loop reports (a future's exception nobody retrieved, ...) and the
    warnings (a coroutine never awaited) while in the block, collected after it."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            yield reported
            gc.collect()
            await asyncio.sleep(0)
        reported.extend({"warning": str(w.message)} for w in warned)
    finally:
        loop.set_exception_handler(previous)


async def no_other_tasks() -> None:
    me = asyncio.current_task()

    async def alone() -> bool:
        return not [task for task in asyncio.all_tasks() if task is not me]

    await wait_until(alone, "every task to end", IO_TIMEOUT)


async def listener(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"127.0.0.1:{port}"


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A peer that takes connections and never says a word (a HELLO is never answered)."""
    await reader.read()
    writer.close()


class DiesInTheRestore:
    """A broker that welcomes a connector, answers its first REGISTER, and drops the link
    at the second: it dies while the connector restores its services onto it."""

    def __init__(self) -> None:
        self.dropped = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = RawLink(reader, writer)
        with contextlib.suppress(AssertionError, ConnectionError, TimeoutError):
            hello = await link.read_control()
            await link.send(
                encode_control(ControlType.WELCOME, Welcome(broker="doomed"), hello.correlation)
            )
            first = await link.read_control()
            assert isinstance(first.body, Register)
            address = Unicast(first.body.server, first.body.instance).to_bytes()
            answer = encode_control(
                ControlType.REGISTERED, AddressBody(address=address), first.correlation
            )
            await link.send(answer)
            await link.read_control()
        writer.transport.abort()
        self.dropped.set()


async def test_cancelling_what_waits_on_a_failing_over_connector_leaves_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = await start_broker()
    quiet, quiet_address = await listener(silent)
    doomed = DiesInTheRestore()
    restoring, restoring_address = await listener(doomed)
    conn = await meshbus.connect(
        [broker.address, restoring_address],
        server="cancel",
        failover_timeout=30,
        randomize_brokers=False,
    )
    try:
        async with clean_loop() as reported:
            svc = await conn.register()
            other = await conn.register()
            await kill(broker)
            await failing_over(conn)
            # Round after round it fails over onto a broker that dies in the restore.
            await asyncio.wait_for(doomed.dropped.wait(), IO_TIMEOUT)
            waits: dict[str, Callable[[], Awaitable[object]]] = {
                "send": lambda: svc.send(other.address, b"x"),
                "send reliable": lambda: svc.send(other.address, b"x", reliable=True),
                "send_reliable": lambda: svc.send_reliable(other.address, b"x"),
                "request": lambda: svc.request(other.address, b"x", timeout=30),
                "recv": lambda: svc.recv(),
                "register": lambda: conn.register(),
                "join": lambda: svc.join(meshbus.Multicast("g")),
                "ping": lambda: conn.ping(),
                "stat": lambda: conn.stat(),
                "connect": lambda: meshbus.connect(quiet_address, server="never"),
            }
            tasks = {name: asyncio.create_task(wait()) for name, wait in waits.items()}
            for _ in range(20):
                await asyncio.sleep(0)
            assert not [name for name, task in tasks.items() if task.done()]
            for task in tasks.values():
                task.cancel()
            results = await asyncio.gather(*tasks.values(), return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results), results
            # Still failing over, and still usable once a broker is back.
            assert conn.broker_address == ""
            await conn.close()
            await no_other_tasks()
        assert reported == []
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
    finally:
        await conn.close()
        quiet.close()
        restoring.close()
