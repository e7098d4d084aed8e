"""`python -m bench bursts`: how long bursts of work keep a broker's event loop.

A mesh of 2 broker processes (0.5 s heartbeats). One connector on the first
pipelines COUNT registrations, then a join of every new service to one multicast
group, as fast as it can (every request in flight at once). Then, one after the
other: an operator asks the entry broker for its detailed ``stat`` (every
service); a third broker joins the mesh (both send it their whole table); the
connector closes (its COUNT services leave every table).

Each broker measures its own loop's lag (a probe that wakes every 20 ms,
meshbus.broker.observe.lag); the command reads it from ``stat`` at the end and reports the
largest lag on the entry broker, and on the others (which apply the same changes
from the ROUTES they are sent). It also reports ``suspicions``: peer links any
broker closed on its own (a peer taken for dead) -- a stall past the heartbeat
budget shows as one. The goals: a maximum under 50 ms, no suspicion.

Three brokers and the load generator share the machine's cores, and on two cores a
broker's loop also waits for a core while the others work: its wall-clock lag is
then more than its own work. ``--own-core ROLE`` gives one broker (entry, peer, or
the joining one) a core of its own -- the last one this process may use -- and every
other process the rest: that broker's lag is then what it would be on a host of its
own, and the last line adds ``alone_max_lag_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import click

import meshbus
from bench.brokers import MeshbusProcesses
from bench.harness import CheckFailed, close_all, run_on_brokers
from bench.report import new_table, print_tables

_GROUP = meshbus.Multicast("burst")


async def _facts(address: str) -> dict[str, Any]:
    async with await meshbus.connect(address, server="bursts", operator=True) as op:
        return await op.stat(detail=False)


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """This process's cyclic GC off while it drives the burst. The load generator holds
    COUNT services and their requests in flight: its full collections took 0.2-1.2 s of
    CPU each at 50,000, taken from the brokers under measurement on a 2-core machine.
    The brokers' own collector stays on: it is part of what is measured."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_ROLES = ("entry", "peer", "joining")


class _Cores:
    """Which core each process runs on: with ``alone`` (a role), that broker gets the last
    core this process may use and everything else the others; without, no pinning."""

    def __init__(self, alone: str | None) -> None:
        self.alone = alone
        cores = sorted(os.sched_getaffinity(0))
        if alone is not None and len(cores) < 2:
            raise CheckFailed("--own-core needs at least 2 cores")
        self._own, self._rest = {cores[-1]}, set(cores[:-1])
        if alone is not None:
            os.sched_setaffinity(0, self._rest)  # the load generator

    def place(self, role: str, pid: int) -> None:
        if self.alone is not None:
            os.sched_setaffinity(pid, self._own if role == self.alone else self._rest)


async def _run(brokers: MeshbusProcesses, count: int, alone: str | None) -> dict[str, Any]:
    before = os.sched_getaffinity(0)
    try:
        with _collector_off():
            return await _burst(brokers, count, _Cores(alone))
    finally:
        os.sched_setaffinity(0, before)


async def _burst(brokers: MeshbusProcesses, count: int, cores: _Cores) -> dict[str, Any]:
    heartbeat = ("--heartbeat-interval", "0.5")
    entry, peer = await brokers.mesh(2, "--max-services", str(count), *heartbeat)
    cores.place("entry", entry.process.pid)
    cores.place("peer", peer.process.pid)
    conn = await meshbus.connect(entry.address, server="bursts", keepalive=0)
    seconds: dict[str, float] = {}
    try:
        began = time.perf_counter()
        services = await asyncio.gather(*(conn.register() for _ in range(count)))
        seconds["register"] = time.perf_counter() - began
        began = time.perf_counter()
        await asyncio.gather(*(service.join(_GROUP) for service in services))
        seconds["join"] = time.perf_counter() - began
        began = time.perf_counter()
        async with await meshbus.connect(entry.address, server="bursts", operator=True) as op:
            listed = len((await op.stat())["service_addresses"])
        seconds["stat"] = time.perf_counter() - began
        if listed < count:
            raise CheckFailed(f"stat listed {listed} services, not {count}")
        began = time.perf_counter()
        third = await brokers.start("--seed", entry.address, *heartbeat)
        cores.place("joining", third.process.pid)
        seconds["join_broker"] = time.perf_counter() - began
    finally:
        await close_all([conn])
    await asyncio.sleep(1.0)  # the connector's services leave every table
    facts = [await _facts(b.address) for b in (entry, peer, third)]
    return {
        "roles": {role: f["loop_lag_ms"] for role, f in zip(_ROLES, facts, strict=True)},
        "entry": facts[0]["loop_lag_ms"],
        "others": {
            key: max(f["loop_lag_ms"][key] for f in facts[1:]) for key in ("max", "max_own", "p99")
        },
        "suspicions": sum(f["mesh_counters"]["peers_lost"] for f in facts),
        "seconds": seconds,
    }


@click.command()
@click.option(
    "--count",
    type=click.IntRange(1, 65_000),
    default=10_000,
    show_default=True,
    help="Services one connector registers (then joins to one group), all in flight at "
    "once; its services share its server name, which has 65,536 dynamic ids per broker.",
)
@click.option(
    "--own-core",
    type=click.Choice(_ROLES),
    default=None,
    help="Give this broker a core of its own (every other process shares the rest): "
    "its lag without waiting for a core, as on a host of its own.",
)
def bursts(count: int, own_core: str | None) -> None:
    """The longest stall of a broker's event loop while one connector registers COUNT
    services and joins each to a group, pipelined, in a 2-broker mesh; then a detailed
    stat, a third broker joining, and the connector leaving.

    Last line: `entry_max_lag_ms=<ms> peer_max_lag_ms=<ms> entry_p99_ms=<ms>
    suspicions=<n> entry_own_ms=<ms> peer_own_ms=<ms>` (own: the part of the lag the
    broker's own work explains, the rest being time it waited for a core), and with
    --own-core, ` alone_max_lag_ms=<ms>`: the lag of the broker with its own core.
    """
    result = run_on_brokers(lambda brokers: _run(brokers, count, own_core))
    entry, others, seconds = result["entry"], result["others"], result["seconds"]
    table = new_table(
        f"bursts: {count:,} registrations, {count:,} joins, a detailed stat, a broker "
        "joining, the connector leaving",
        ("", "entry broker", "the others (worst)"),
    )
    table.add_row("max loop lag", f"{entry['max']:.1f} ms", f"{others['max']:.1f} ms")
    table.add_row(
        "  of it its own work", f"{entry['max_own']:.1f} ms", f"{others['max_own']:.1f} ms"
    )
    table.add_row("p99 loop lag", f"{entry['p99']:.0f} ms", f"{others['p99']:.0f} ms")
    for role, lag in result["roles"].items():
        alone = " (a core of its own)" if role == own_core else ""
        table.add_row(f"max lag: {role}{alone}", f"{lag['max']:.1f} ms", "")
    table.add_row("peers taken for dead", str(result["suspicions"]), "")
    for phase, took in seconds.items():
        table.add_row(f"{phase.replace('_', ' ')} took", f"{took:.2f} s", "")
    print_tables(table)
    click.echo(
        f"entry_max_lag_ms={entry['max']:.1f} peer_max_lag_ms={others['max']:.1f} "
        f"entry_p99_ms={entry['p99']:.0f} suspicions={result['suspicions']} "
        f"entry_own_ms={entry['max_own']:.1f} peer_own_ms={others['max_own']:.1f}"
        + (f" alone_max_lag_ms={result['roles'][own_core]['max']:.1f}" if own_core else "")
    )
