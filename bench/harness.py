"""What the mesh-operation benchmarks (``membership``, ``routes``) share: the event loop
they run on, the connectors they put on the mesh, and the probes that time it.

Every broker is a child process (``brokers``); every connector lives in the bench
process, on one uvloop event loop. Times come from ``time.perf_counter`` (uvloop's
``loop.time()`` only moves once per loop iteration, in whole milliseconds). Every
broker a command starts is stopped when it ends, on errors and on Ctrl-C too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click

import meshbus
from bench.brokers import MeshbusProcess, MeshbusProcesses
from meshbus.broker.process import BrokerStartError

T = TypeVar("T")

# Failures a probe request may meet while a service is on its way back; anything else is a bug.
_RETRYABLE = (meshbus.NoRoute, meshbus.Timeout, meshbus.ConnectionLost)
# A request's own deadline while probing: only hit by a request lost on the way.
PROBE_TIMEOUT = 1.0
# Requests one probe keeps in flight: all of them at once for the default fleet (300), and
# a bound for big ones, whose answers would otherwise come later than their deadline.
_IN_FLIGHT = 500
# Give-up bound for services to answer once the mesh is steady: far above anything
# healthy, it only turns a hang into a clear error.
SETTLE_LIMIT = 120.0


class CheckFailed(click.ClickException):
    """The mesh did not do what the benchmark verifies (an address changed, a route is
    missing, a count is off): the figures would be meaningless, so the command fails."""


def now() -> float:
    return time.perf_counter()


def ms(seconds: float) -> float:
    return seconds * 1000.0


def run_on_brokers(main: Callable[[MeshbusProcesses], Coroutine[Any, Any, T]]) -> T:
    """Run a benchmark on a fresh uvloop loop with the brokers it starts, and stop every
    one of them however it ends; setup and mesh errors become click errors."""
    import uvloop

    brokers = MeshbusProcesses()

    async def guarded() -> T:
        try:
            return await main(brokers)
        finally:
            await brokers.close()

    try:
        result: T = uvloop.run(guarded())
    except BrokerStartError as exc:
        raise click.ClickException(f"a broker did not start: {exc}") from exc
    except meshbus.MeshbusError as exc:
        raise click.ClickException(f"the mesh failed during the benchmark: {exc}") from exc
    finally:
        brokers.kill()
    return result


# -- connectors and services ------------------------------------------------------------------


async def _echo(service: meshbus.Service) -> None:
    """Answer every request with its payload while the service lives."""
    try:
        async for msg in service:
            if msg.is_request:
                await msg.reply(msg.payload)
    except meshbus.MeshbusError:
        pass  # the connector lost its link for good: the service is gone


class Fleet:
    """Connectors in the bench process, each with services that answer requests."""

    def __init__(self) -> None:
        self.conns: list[meshbus.Connector] = []
        self.services: list[meshbus.Service] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self, broker: MeshbusProcess, server: str) -> meshbus.Connector:
        conn = await meshbus.connect(broker.address, server=server)
        self.conns.append(conn)
        return conn

    async def add(self, broker: MeshbusProcess, server: str, services: int) -> meshbus.Connector:
        """A connector with ``services`` answering services: the first half (rounded down)
        with fixed instance ids 1, 2, ..., the rest dynamic."""
        conn = await self.connect(broker, server)
        fixed = services // 2
        registered = await asyncio.gather(
            *(conn.register(instance=i + 1) for i in range(fixed)),
            *(conn.register() for _ in range(services - fixed)),
        )
        for service in registered:
            self.answer(service)
        return conn

    def answer(self, service: meshbus.Service) -> None:
        self.services.append(service)
        self._tasks.append(asyncio.create_task(_echo(service)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await close_all(self.conns)


@dataclass
class MeshRun:
    """One run of a benchmark on a fresh mesh: its brokers, the fleet, and the pollers
    (``pollers_on``) the run adds as it goes."""

    mesh: list[MeshbusProcess]
    fleet: Fleet
    pollers: list[meshbus.Connector]


@contextlib.asynccontextmanager
async def fresh_mesh(brokers: MeshbusProcesses, size: int) -> AsyncIterator[MeshRun]:
    """A new mesh of ``size`` brokers (``MeshbusProcesses.mesh``) with an empty fleet; on exit the
    fleet, the pollers and every broker are closed, in that order."""
    run = MeshRun(await brokers.mesh(size), Fleet(), [])
    try:
        yield run
    finally:
        await run.fleet.close()
        await close_all(run.pollers)
        await brokers.close()


async def pollers_on(mesh: Iterable[MeshbusProcess], server: str) -> list[meshbus.Connector]:
    """One connector named ``server`` on each broker, in order, that never fails over:
    it asks its own broker (``stat``) or probes from there."""
    conns: list[meshbus.Connector] = []
    try:
        for broker in mesh:
            conns.append(await meshbus.connect(broker.address, server=server, failover=False))
    except BaseException:
        await close_all(conns)
        raise
    return conns


async def close_all(conns: Iterable[meshbus.Connector]) -> None:
    for conn in conns:
        await conn.close()


async def register_many(
    conns: Sequence[meshbus.Connector], count: int, batch: int
) -> tuple[list[meshbus.Service], float]:
    """Register ``count`` dynamic services round-robin over ``conns``, ``batch`` at a time
    (asyncio.gather): the services, and the seconds it took.

    The services registered so far are frozen out of the cyclic GC after each batch
    (``gc.freeze``): this one process stands in for the 30 that would hold them, and
    full collections over all of them would otherwise halve the rate by 100k (the
    caller unfreezes)."""
    began = now()
    services: list[meshbus.Service] = []
    while len(services) < count:
        done, size = len(services), min(batch, count - len(services))
        services += await asyncio.gather(
            *(conns[(done + i) % len(conns)].register() for i in range(size))
        )
        gc.freeze()
    return services, now() - began


def rss_of(mesh: Sequence[MeshbusProcess]) -> list[float]:
    """Each broker's resident memory in MiB; a CheckFailed where it cannot be read."""
    sizes = [broker.rss_mib() for broker in mesh]
    if any(size is None for size in sizes):
        raise CheckFailed("the brokers' resident memory cannot be read here (Linux /proc)")
    return [size for size in sizes if size is not None]


def bytes_per_entry(before: Sequence[float], after: Sequence[float], entries: int) -> float:
    """The median over the brokers of the RSS (MiB) grown from ``before`` to ``after``, in
    bytes per entry added."""
    grown = [(a - b) * 1024 * 1024 / entries for b, a in zip(before, after, strict=True)]
    return statistics.median(grown)


# -- probes ---------------------------------------------------------------------------------


async def _ask(probe: meshbus.Service, target: meshbus.Address) -> float | None:
    """One request to ``target``: when its answer arrived, or None if it failed in a way
    that a service on its way back can cause. An answer from any other address fails
    the benchmark: a service must come back with its own address."""
    try:
        answer = await probe.request(target, b"?", timeout=PROBE_TIMEOUT)
    except _RETRYABLE:
        return None
    if answer.src != target:
        raise CheckFailed(f"a request to {target} was answered by {answer.src}")
    return now()


async def answered(
    probe: meshbus.Service,
    targets: Sequence[meshbus.Address],
    limit: float,
    pause: float = 0.002,
) -> dict[meshbus.Address, float]:
    """Ask every target in rounds (each still unanswered one once per round, at most
    ``_IN_FLIGHT`` requests at a time; ``pause`` between rounds) until each has answered:
    the time each answer arrived."""
    began = now()
    times: dict[meshbus.Address, float] = {}
    pending = list(targets)
    window = asyncio.Semaphore(_IN_FLIGHT)

    async def ask(target: meshbus.Address) -> float | None:
        async with window:
            return await _ask(probe, target)

    while pending:
        results = await asyncio.gather(*(ask(target) for target in pending))
        still = []
        for target, when in zip(pending, results, strict=True):
            if when is None:
                still.append(target)
            else:
                times[target] = when
        pending = still
        if pending:
            if now() - began > limit:
                raise CheckFailed(
                    f"{len(pending)} services did not answer {probe.address} within "
                    f"{limit:.0f} s, e.g. {', '.join(map(str, pending[:3]))}"
                )
            await asyncio.sleep(pause)
    return times


async def poll_until(
    check: Callable[[], Awaitable[bool]], what: str, limit: float, pause: float
) -> float:
    """Poll ``check`` every ``pause`` seconds until it holds; when it first held."""
    began = now()
    while not await check():
        if now() - began > limit:
            raise CheckFailed(f"timed out after {limit:.0f} s waiting for {what}")
        await asyncio.sleep(pause)
    return now()


async def connector_counts(pollers: Iterable[meshbus.Connector]) -> list[int]:
    """Connectors per broker, from one poller connector on each, not counting the poller."""
    stats = await asyncio.gather(*(p.stat(detail=False) for p in pollers))
    return [int(s["connectors"]) - 1 for s in stats]


async def wait_balanced(
    pollers: Sequence[meshbus.Connector], total: int, limit: float, pause: float
) -> tuple[float, list[int]]:
    """Poll the connector counts every ``pause`` s until they are within one of even
    (and add up to ``total``): when, and the counts."""
    counts: list[int] = []

    async def check() -> bool:
        nonlocal counts
        counts = await connector_counts(pollers)
        return sum(counts) == total and max(counts) - min(counts) <= 1

    try:
        when = await poll_until(check, "a connector spread within one", limit, pause)
    except CheckFailed as exc:
        raise CheckFailed(f"{exc.message} (connectors per broker: {counts})") from None
    return when, counts
