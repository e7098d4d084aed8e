"""`python -m bench bursts`: how long a burst of work keeps a broker's event loop.

A mesh of 2 broker processes; one connector on the first pipelines COUNT
registrations, then a join of every new service to one multicast group, as fast
as it can (every request in flight at once). Each broker measures its own loop's
lag (a probe that wakes every 20 ms, meshbus.broker.lag); the command reads it
from ``stat`` before and after and reports the largest lag of the burst on the
entry broker and on its peer, which applies the same changes from the ROUTES it
is sent. The goal is a maximum under 50 ms: while a callback runs, no heartbeat
is sent or read.
"""

from __future__ import annotations

import asyncio
import time

import click

import meshbus
from bench.brokers import MeshbusProcesses
from bench.harness import close_all, run_on_brokers
from bench.report import new_table, print_tables

_GROUP = meshbus.Multicast("burst")


async def _lag(address: str) -> dict[str, float]:
    async with await meshbus.connect(address, server="bursts", operator=True) as op:
        lag: dict[str, float] = (await op.stat(detail=False))["loop_lag_ms"]
        return lag


async def _run(brokers: MeshbusProcesses, count: int) -> dict[str, dict[str, float]]:
    entry, peer = await brokers.mesh(2, "--max-services", str(count))
    conn = await meshbus.connect(entry.address, server="bursts", keepalive=0)
    try:
        began = time.perf_counter()
        services = await asyncio.gather(*(conn.register() for _ in range(count)))
        registered = time.perf_counter()
        await asyncio.gather(*(service.join(_GROUP) for service in services))
        joined = time.perf_counter()
        return {
            "entry": await _lag(entry.address),
            "peer": await _lag(peer.address),
            "seconds": {"register": registered - began, "join": joined - registered},
        }
    finally:
        await close_all([conn])


@click.command()
@click.option(
    "--count",
    type=click.IntRange(1, 100_000),
    default=10_000,
    show_default=True,
    help="Services one connector registers (then joins to one group), all in flight at once.",
)
def bursts(count: int) -> None:
    """The longest stall of a broker's event loop while one connector registers COUNT
    services and joins each to a group, pipelined, in a 2-broker mesh.

    Last line: `entry_max_lag_ms=<ms> peer_max_lag_ms=<ms> entry_p99_ms=<ms>`.
    """
    result = run_on_brokers(lambda brokers: _run(brokers, count))
    entry, peer, seconds = result["entry"], result["peer"], result["seconds"]
    table = new_table(
        f"bursts: {count:,} registrations, then {count:,} joins", ("", "entry broker", "peer")
    )
    table.add_row("max loop lag", f"{entry['max']:.1f} ms", f"{peer['max']:.1f} ms")
    table.add_row("p99 loop lag", f"{entry['p99']:.0f} ms", f"{peer['p99']:.0f} ms")
    table.add_row("register / join", f"{seconds['register']:.2f} s / {seconds['join']:.2f} s", "")
    print_tables(table)
    click.echo(
        f"entry_max_lag_ms={entry['max']:.1f} peer_max_lag_ms={peer['max']:.1f} "
        f"entry_p99_ms={entry['p99']:.0f}"
    )
