"""`members`: one channel -- a multicast group -- with MEMBERS members over a mesh of 3
real broker processes: how long they take to join, how long one message takes to reach
all of them, how long any broker's loop stalled, and what a route and a membership cost
each broker in memory.

Memory is each broker's resident set (VmRSS) before and after, divided by the entries
added: every broker holds every route and every membership of the mesh, so each of the 3
gives a figure; the median is reported. An RSS delta counts everything the entries cost
the process (table entries, the addresses themselves, allocator overhead), not only the
tables' own objects.

Per-step tables go to stderr, the machine-readable last line to stdout.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import click

import meshbus
from bench.brokers import MeshbusProcesses
from bench.harness import (
    SETTLE_LIMIT,
    CheckFailed,
    bytes_per_entry,
    fresh_mesh,
    ms,
    now,
    pollers_on,
    register_many,
    rss_of,
    run_on_brokers,
)
from bench.report import key_values, new_table, print_tables

CHANNEL = meshbus.Multicast("channel")


@dataclass
class MembersResult:
    members: int
    register_s: float
    join_s: float
    deliver_ms: list[float]  # per message: from the send until every member had it
    lag_max_ms: list[float]  # per broker, since it started
    lag_own_ms: list[float]  # the part of it the broker's own work explains
    rss_mib: list[list[float]]  # per step (start, registered, joined): per broker

    def bytes_per_entry(self, step: int) -> float:
        """Median over the brokers of the RSS grown from step ``step - 1`` to ``step``,
        per member."""
        return bytes_per_entry(self.rss_mib[step - 1], self.rss_mib[step], self.members)


async def _join_all(services: Sequence[meshbus.Service], batch: int) -> float:
    """Every service joins CHANNEL, ``batch`` joins at a time; the seconds it took. Each
    join returns once every broker has it (SYNCED)."""
    began = now()
    for start in range(0, len(services), batch):
        await asyncio.gather(*(s.join(CHANNEL) for s in services[start : start + batch]))
        gc.freeze()  # as register_many: the bench process stands in for many clients
    return now() - began


async def _deliver(sender: meshbus.Service, services: Sequence[meshbus.Service]) -> float:
    """One message to CHANNEL: the seconds until every member's listener had it."""
    loop = asyncio.get_running_loop()
    everyone: asyncio.Future[float] = loop.create_future()
    received = 0

    def got(_: meshbus.Message) -> None:
        nonlocal received
        received += 1
        if received == len(services):
            everyone.set_result(now())

    removers = [service.add_listener(got) for service in services]
    try:
        began = now()
        await sender.send(CHANNEL, b"to all")
        try:
            done = await asyncio.wait_for(everyone, SETTLE_LIMIT)
        except TimeoutError:
            raise CheckFailed(
                f"{received:,} of {len(services):,} members got the message "
                f"within {SETTLE_LIMIT:.0f} s"
            ) from None
    finally:
        for remove in removers:
            remove()
    if received != len(services):
        raise CheckFailed(f"{received:,} deliveries for {len(services):,} members")
    return done - began


async def _members_run(
    brokers: MeshbusProcesses, members: int, per_broker: int, batch: int, messages: int
) -> MembersResult:
    async with fresh_mesh(brokers, 3) as mesh_run:
        mesh, fleet, pollers = mesh_run.mesh, mesh_run.fleet, mesh_run.pollers
        try:
            pollers.extend(await pollers_on(mesh, "poll"))
            conns = [
                await fleet.connect(broker, f"mb{b}x{i}")
                for i in range(per_broker)
                for b, broker in enumerate(mesh)
            ]
            rss = [rss_of(mesh)]
            services, register_s = await register_many(conns, members, batch)
            rss.append(rss_of(mesh))
            join_s = await _join_all(services, batch)
            rss.append(rss_of(mesh))
            stats = await asyncio.gather(*(p.stat(detail=False) for p in pollers))
            for broker, stat in zip(mesh, stats, strict=True):
                memberships = stat["routes"] - stat["route_services"]
                if memberships < members:
                    raise CheckFailed(f"{broker.name} holds {memberships:,} memberships")
            sender = await pollers[0].register()
            deliver = [await _deliver(sender, services) for _ in range(messages)]
            stats = await asyncio.gather(*(p.stat(detail=False) for p in pollers))
            return MembersResult(
                members=members,
                register_s=register_s,
                join_s=join_s,
                deliver_ms=[ms(seconds) for seconds in deliver],
                lag_max_ms=[s["loop_lag_ms"]["max"] for s in stats],
                lag_own_ms=[s["loop_lag_ms"]["max_own"] for s in stats],
                rss_mib=rss,
            )
        finally:
            gc.unfreeze()


@click.command()
@click.option(
    "--members",
    type=click.IntRange(1, 1_000_000),
    default=100_000,
    show_default=True,
    help="Services registered over the 3 brokers, every one of them joined to the channel.",
)
@click.option(
    "--connectors-per-broker",
    type=click.IntRange(1, 100),
    default=10,
    show_default=True,
    help="Connectors holding them, on each broker (a connector takes 10,000 services).",
)
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=3000,
    show_default=True,
    help="Registrations, then joins, started together (asyncio.gather).",
)
@click.option(
    "--messages",
    type=click.IntRange(1, 100),
    default=5,
    show_default=True,
    help="Messages to the channel timed, one after the other.",
)
def members(members: int, connectors_per_broker: int, batch: int, messages: int) -> None:
    """One channel with MEMBERS members over 3 brokers: join time, delivery to all, loop
    stalls, and memory per route and per membership.

    MEMBERS dynamic services are registered through CONNECTORS-PER-BROKER connectors on
    each of 3 brokers, then every one joins the multicast group `channel` (timed from
    the first join until the last returned; a join returns once every broker has it).
    Then a service on the first broker sends MESSAGES messages to the channel, one at a
    time: each timed from the send until every member's listener had it. The brokers'
    largest loop lag since they started (`stat`) covers all of it. Memory: each broker's
    RSS grown by the registrations, then by the joins, per member (median of the 3).

    Last line: `join_s=<s> deliver_ms=<median ms> max_lag_ms=<ms, the worst broker>
    bytes_per_route=<B> bytes_per_membership=<B>`.
    """

    if -(-members // (3 * connectors_per_broker)) > 10_000:
        raise click.BadParameter(
            "more than 10,000 services per connector (a broker's --max-services): "
            "use more connectors",
            param_hint="'--connectors-per-broker'",
        )

    async def main(brokers: MeshbusProcesses) -> MembersResult:
        return await _members_run(brokers, members, connectors_per_broker, batch, messages)

    r = run_on_brokers(main)
    table = new_table(
        f"members: one channel, {members:,} members, {3 * connectors_per_broker} connectors "
        "on 3 brokers",
        ("step", "figure"),
    )
    rss = [" / ".join(f"{m:.0f}" for m in step) for step in r.rss_mib]
    for step, figure in (
        ("registration", f"{r.register_s:.2f} s, {members / r.register_s:,.0f}/s"),
        ("joins (until the last returned)", f"{r.join_s:.2f} s, {members / r.join_s:,.0f}/s"),
        ("one message to all: each", ", ".join(f"{d:.1f}" for d in r.deliver_ms) + " ms"),
        ("max loop lag A / B / C", " / ".join(f"{x:.1f}" for x in r.lag_max_ms) + " ms"),
        ("  of it own work", " / ".join(f"{x:.1f}" for x in r.lag_own_ms) + " ms"),
        ("RSS MiB at start", rss[0]),
        ("RSS MiB registered", rss[1]),
        ("RSS MiB joined", rss[2]),
        ("bytes per route (RSS)", f"{r.bytes_per_entry(1):.0f}"),
        ("bytes per membership (RSS)", f"{r.bytes_per_entry(2):.0f}"),
    ):
        table.add_row(step, figure)
    print_tables(table)
    click.echo(
        key_values(
            join_s=f"{r.join_s:.2f}",
            deliver_ms=f"{statistics.median(r.deliver_ms):.1f}",
            max_lag_ms=f"{max(r.lag_max_ms):.1f}",
            bytes_per_route=f"{r.bytes_per_entry(1):.0f}",
            bytes_per_membership=f"{r.bytes_per_entry(2):.0f}",
        )
    )
