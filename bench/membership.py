"""MeshbusProcesses leaving and joining a running mesh, timed with real broker processes.

``failover``: one of 3 brokers is killed (kill -9) and its connectors move to the
survivors. ``join``: a 4th broker joins and takes its share of the connectors.
Both run CONNECTORS connectors with answering services in the bench process
(``harness.Fleet``) on a fresh mesh per run, and check that every service comes
through with its own address. Per-run tables go to stderr, the machine-readable
last line to stdout.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import click

import meshbus
from bench.brokers import MeshbusProcesses
from bench.harness import (
    SETTLE_LIMIT,
    CheckFailed,
    answered,
    connector_counts,
    fresh_mesh,
    ms,
    now,
    poll_until,
    pollers_on,
    run_on_brokers,
    wait_balanced,
)
from bench.report import key_values, new_table, print_tables, summary_rows

# Give-up bounds: far above anything healthy, they only turn a hang into a clear error.
_FAILOVER_LIMIT = 30.0
_BALANCE_LIMIT = 60.0


def _connector_options(default_services: int) -> Callable[[Callable[..., Any]], Any]:
    def decorate(command: Callable[..., Any]) -> Any:
        command = click.option(
            "--services-per-connector",
            type=click.IntRange(1, 10_000),
            default=default_services,
            show_default=True,
            help="Answering services per connector: half with fixed ids, half dynamic.",
        )(command)
        command = click.option(
            "--connectors",
            type=click.IntRange(3, 100),
            default=30,
            show_default=True,
            help="Connectors in the bench process, spread evenly over the 3 brokers "
            "(a broker takes 50).",
        )(command)
        return click.option(
            "--runs",
            type=click.IntRange(1),
            default=5,
            show_default=True,
            help="Runs, each on a fresh mesh; medians are reported.",
        )(command)

    return decorate


# -- failover -------------------------------------------------------------------------------


@dataclass
class FailoverRun:
    dropped_ms: float  # until both survivors had dropped the dead broker (and its routes)
    reconnected_ms: float  # until every orphaned connector had failed over (its own view)
    failover_ms: float  # until every service answered the probes on both survivors
    orphans: int
    landed: list[int]  # orphans per survivor


async def _peer_gone(poller: meshbus.Connector, name: str) -> float:
    """Poll ``stat`` back to back until broker ``name`` is no longer a peer. The broker
    drops a peer's routes in the same step as the peer (``Broker._link_closed`` in
    meshbus.broker.server)."""
    while name in (await poller.stat(detail=False))["peers"]:
        pass
    return now()


async def _all_failed_over(conns: Sequence[meshbus.Connector]) -> float:
    """When every connector of ``conns`` had failed over once (checked every millisecond)."""

    async def all_back() -> bool:
        return all(conn.failovers for conn in conns)

    return await poll_until(
        all_back, "the orphaned connectors to fail over", _FAILOVER_LIMIT, 0.001
    )


async def _failover_run(
    brokers: MeshbusProcesses, connectors: int, services_per_connector: int
) -> FailoverRun:
    async with fresh_mesh(brokers, 3) as mesh_run:
        mesh, fleet, probe_conns = mesh_run.mesh, mesh_run.fleet, mesh_run.pollers
        await asyncio.gather(
            *(fleet.add(mesh[i % 3], f"fo{i}", services_per_connector) for i in range(connectors))
        )
        probe_conns.extend(await pollers_on(mesh, "probe"))
        probes = [await conn.register() for conn in probe_conns]
        targets = [s.address for s in fleet.services]
        # Every service answers every probe before the crash.
        await asyncio.gather(*(answered(p, targets, SETTLE_LIMIT) for p in probes))
        victim, survivors = mesh[2], mesh[:2]
        orphans = [c for c in fleet.conns if c.broker_name == victim.name]
        addresses = {id(c): [s.address for s in c.services] for c in fleet.conns}

        began = now()
        victim.process.kill()  # kill -9
        reconnected = asyncio.create_task(_all_failed_over(orphans))
        try:
            # Probing starts once both survivors have dropped the dead broker: a request
            # routed to it before that would sit in a pending table until its deadline.
            try:
                dropped = await asyncio.wait_for(
                    asyncio.gather(*(_peer_gone(p, victim.name) for p in probe_conns[:2])),
                    _FAILOVER_LIMIT,
                )
            except TimeoutError:
                raise CheckFailed(
                    f"the survivors still listed {victim.name} as a peer after "
                    f"{_FAILOVER_LIMIT:.0f} s"
                ) from None
            answers = await asyncio.gather(
                *(answered(p, targets, _FAILOVER_LIMIT) for p in probes[:2])
            )
            done = max(max(a.values()) for a in answers)
            reconnected_at = await reconnected
        finally:
            reconnected.cancel()

        for conn in fleet.conns:
            if [s.address for s in conn.services] != addresses[id(conn)]:
                raise CheckFailed(f"{conn} lost or changed services in the failover")
            expected = 1 if conn in orphans else 0
            if conn.failovers != expected:
                raise CheckFailed(f"{conn} failed over {conn.failovers} times, not {expected}")
        landed = [sum(c.broker_name == b.name for c in orphans) for b in survivors]
        if sum(landed) != len(orphans):
            raise CheckFailed(f"orphaned connectors on brokers other than the survivors: {landed}")
        return FailoverRun(
            dropped_ms=ms(max(dropped) - began),
            reconnected_ms=ms(reconnected_at - began),
            failover_ms=ms(done - began),
            orphans=len(orphans),
            landed=landed,
        )


@click.command()
@_connector_options(10)
def failover(runs: int, connectors: int, services_per_connector: int) -> None:
    """Kill -9 one of 3 brokers: time until every service answers again.

    CONNECTORS connectors (a third on each broker, all in this process) with
    SERVICES-PER-CONNECTOR answering services each, and a probe connector on every
    broker. One broker is killed; its connectors fail over to the other two and
    register their services again, with the same addresses (checked: every answer
    must come from the address asked). Timed from the kill until each service has
    answered a request from the probes on both survivors; also until both survivors
    had dropped the dead broker's routes, and until every orphaned connector had
    reconnected.

    Last line: `failover_ms_median=<ms> failover_ms_max=<ms>`.
    """

    async def main(brokers: MeshbusProcesses) -> list[FailoverRun]:
        return [
            await _failover_run(brokers, connectors, services_per_connector) for _ in range(runs)
        ]

    results = run_on_brokers(main)
    columns = ("run", "routes dropped ms", "reconnected ms", "all answer ms", "orphans", "landed")
    table = new_table(
        f"failover: kill -9 of 1 of 3 brokers, {connectors} connectors x "
        f"{services_per_connector} services",
        columns,
    )
    for i, r in enumerate(results, 1):
        table.add_row(
            str(i),
            f"{r.dropped_ms:.1f}",
            f"{r.reconnected_ms:.1f}",
            f"{r.failover_ms:.1f}",
            str(r.orphans),
            "/".join(map(str, r.landed)),
        )
    figures = {
        "dropped": [r.dropped_ms for r in results],
        "reconnected": [r.reconnected_ms for r in results],
        "failover": [r.failover_ms for r in results],
    }
    summary_rows(table, figures, len(columns) - 1)
    print_tables(table)
    click.echo(
        key_values(
            failover_ms_median=f"{statistics.median(figures['failover']):.1f}",
            failover_ms_max=f"{max(figures['failover']):.1f}",
        )
    )


# -- join -----------------------------------------------------------------------------------


@dataclass
class JoinRun:
    ready_ms: float  # process start to ready line
    balance_ms: float  # ready line to a spread within one
    founder_ms: float  # the mesh's first broker, process start to ready line: the baseline
    counts: list[int]
    moves: int

    @property
    def spread(self) -> int:
        return max(self.counts) - min(self.counts)


async def _join_run(
    brokers: MeshbusProcesses, connectors: int, services_per_connector: int
) -> JoinRun:
    async with fresh_mesh(brokers, 3) as mesh_run:
        mesh, fleet, pollers = mesh_run.mesh, mesh_run.fleet, mesh_run.pollers
        # Pollers first: a broker hands its newest connectors to a newcomer, so the
        # pollers, the oldest, stay where they are.
        pollers.extend(await pollers_on(mesh, "poll"))
        await asyncio.gather(
            *(fleet.add(mesh[i % 3], f"jn{i}", services_per_connector) for i in range(connectors))
        )
        counts = await connector_counts(pollers)
        if max(counts) - min(counts) > 1:
            raise CheckFailed(f"connectors not spread evenly before the join: {counts}")
        newcomer = await brokers.start("--seed", mesh[0].address)
        ready = now()
        pollers.extend(await pollers_on([newcomer], "poll"))
        balanced, counts = await wait_balanced(pollers, connectors, _BALANCE_LIMIT, 0.01)
        # Every service is still there, reachable from the newcomer.
        probe = await pollers[-1].register()
        await answered(probe, [s.address for s in fleet.services], SETTLE_LIMIT)
        return JoinRun(
            ready_ms=newcomer.start_ms,
            balance_ms=ms(balanced - ready),
            founder_ms=mesh[0].start_ms,
            counts=counts,
            moves=sum(conn.moves for conn in fleet.conns),
        )


@click.command()
@_connector_options(10)
def join(runs: int, connectors: int, services_per_connector: int) -> None:
    """A 4th broker joins a mesh of 3: time to its ready line, then to an even spread.

    CONNECTORS connectors (a third on each broker, SERVICES-PER-CONNECTOR services
    each) and one poller connector per broker; then `meshbus broker --seed` starts a
    4th. Timed: (a) from starting its process to its ready line (it prints it once it
    has joined and copied the tables; the founding broker's start, with nothing to
    join, is shown as the baseline of process start and imports), (b) from the ready
    line until the connectors are within one of even over the 4 brokers (`stat` on
    each broker every 10 ms, pollers not counted; the pollers of the first 3 are
    connectors too, so the mesh balances CONNECTORS + 3). Every service must then
    answer a probe on the newcomer.

    Last line: `join_ms_median=<ms of (a)+(b)> spread=<largest final spread of any run>`.
    """

    async def main(brokers: MeshbusProcesses) -> list[JoinRun]:
        return [await _join_run(brokers, connectors, services_per_connector) for _ in range(runs)]

    results = run_on_brokers(main)
    columns = (
        "run",
        "ready ms",
        "balance ms",
        "join ms",
        "founder start ms",
        "counts A/B/C/D",
        "spread",
        "moves",
    )
    table = new_table(
        f"join: a 4th broker, {connectors} connectors x {services_per_connector} services",
        columns,
    )
    for i, r in enumerate(results, 1):
        table.add_row(
            str(i),
            f"{r.ready_ms:.1f}",
            f"{r.balance_ms:.1f}",
            f"{r.ready_ms + r.balance_ms:.1f}",
            f"{r.founder_ms:.1f}",
            "/".join(map(str, r.counts)),
            str(r.spread),
            str(r.moves),
        )
    figures = {
        "ready": [r.ready_ms for r in results],
        "balance": [r.balance_ms for r in results],
        "join": [r.ready_ms + r.balance_ms for r in results],
        "founder": [r.founder_ms for r in results],
    }
    summary_rows(table, figures, len(columns) - 1)
    print_tables(table)
    click.echo(
        key_values(
            join_ms_median=f"{statistics.median(figures['join']):.1f}",
            spread=str(max(r.spread for r in results)),
        )
    )
