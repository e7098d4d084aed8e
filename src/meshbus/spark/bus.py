"""The async client, driven from Spark's synchronous callbacks.

Every Spark callback (``schema``, ``latestOffset``, ``read``, ``write``, ...) is a
plain function, often in a fresh Python process, so each opens its own connector
and closes it before it returns: a connection never outlives the callback that
opened it and never crosses a pickle. A connect to a local broker costs about
3 ms, less than Spark spends on any callback.

Connectors opened here have **no keepalive** (``keepalive=0``): a reader hands a
page of rows to Spark between two requests, and its event loop does not run while
Spark has it, so there is nothing for a keepalive to do. Instead every request has
a deadline of its own (``requestTimeout``), which is what stops a read from
hanging on a broker that stopped answering.

Errors keep their meshbus type (``StreamError``, ``ConnectionLost``, ``Timeout``),
with the data source and the brokers named in front, so a Spark trace ends with a
line that says what to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import NoReturn, TypeVar

import meshbus
from meshbus.client.streams import StreamInfo
from meshbus.errors import (
    AuthenticationFailed,
    ConnectionLost,
    MeshbusError,
    StreamError,
    Timeout,
    TLSError,
)
from meshbus.spark.options import PREFIX, BusOptions
from meshbus.tls import cli_context

T = TypeVar("T")


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop, as the broker and the CLI use, when it is there."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of meshbus
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopRunner:
    """An event loop to drive step by step (``run(coro)``) across yields.

    Not ``asyncio.Runner``: in a main thread (a Spark worker's) its ``run`` swaps the
    SIGINT handler in and out on every call, and restoring it makes the signal module
    format the finished task's repr -- with its result, a whole page of rows. That
    was half of a read task's time."""

    def __init__(self) -> None:
        self._loop = new_loop()

    def run(self, coro: Awaitable[T]) -> T:
        return self._loop.run_until_complete(coro)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def close(self) -> None:
        loop = self._loop
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:  # gather() of nothing would make its future on another loop
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


@contextlib.contextmanager
def runner() -> Iterator[LoopRunner]:
    run = LoopRunner()
    try:
        yield run
    finally:
        run.close()


def explain(exc: MeshbusError, bus: BusOptions, doing: str) -> MeshbusError:
    """The same kind of error, saying which data source call met it and where (the
    errors a user can act on; any other comes back as it is)."""
    where = f"{PREFIX} (brokers {bus.brokers}), {doing}"
    if isinstance(exc, StreamError):
        return StreamError(f"{where}: {exc}", exc.code)
    if isinstance(exc, ConnectionLost):
        return ConnectionLost(f"{where}: {exc}")
    if isinstance(exc, Timeout):
        return Timeout(f"{where}: {exc}", exc.timeout)
    if isinstance(exc, AuthenticationFailed):
        return AuthenticationFailed(f"{where}: {exc} (the data source's option 'creds')")
    if isinstance(exc, TLSError):
        return TLSError(f"{where}: {exc} (the data source's options 'tlsCa', 'tlsCert', 'tlsKey')")
    return exc


def reraise(exc: MeshbusError, bus: BusOptions, doing: str) -> NoReturn:
    explained = explain(exc, bus, doing)
    if explained is exc:
        raise exc
    raise explained from exc


async def connect(bus: BusOptions, *, keepalive: float = 0.0) -> meshbus.Connector:
    """A connector to the mesh, signed in with option 'creds' and over TLS when a
    'tls*' option is given; on the driver and on the executors alike."""
    try:
        return await meshbus.connect(
            bus.brokers,
            server=bus.server,
            timeout=bus.connect_timeout,
            keepalive=keepalive,
            tls=cli_context(bus.tls_ca, bus.tls_cert, bus.tls_key),
            credentials=bus.creds,
        )
    except MeshbusError as exc:
        reraise(exc, bus, "connecting")


async def ask(bus: BusOptions, request: Awaitable[T], doing: str) -> T:
    """One request with the ``requestTimeout`` deadline."""
    try:
        async with asyncio.timeout(bus.request_timeout):
            return await request
    except MeshbusError as exc:  # before TimeoutError: meshbus.Timeout is one too
        reraise(exc, bus, doing)
    except TimeoutError:
        raise Timeout(
            f"{PREFIX} (brokers {bus.brokers}), {doing}: no answer within "
            f"{bus.request_timeout} s (option 'requestTimeout')",
            bus.request_timeout,
        ) from None


def call(bus: BusOptions, use: Callable[[meshbus.Connector], Awaitable[T]]) -> T:
    """Connect, ``use`` the connector, close: for the driver's one-off requests."""

    async def main() -> T:
        conn = await connect(bus)
        try:
            return await use(conn)
        finally:
            await conn.close()

    with runner() as run:
        return run.run(main())


def stream_info(bus: BusOptions, stream: str) -> StreamInfo:
    """The stream's counters from its host broker (any broker relays the request);
    ``StreamError`` if no broker of the mesh hosts it."""
    return call(
        bus, lambda conn: ask(bus, conn.streams.info(stream), f"looking up stream {stream!r}")
    )


def check_reachable(bus: BusOptions) -> None:
    """Fails with ``ConnectionLost`` naming every broker tried when none answers."""
    call(bus, lambda conn: ask(bus, conn.ping(), "checking the broker answers"))
