"""`routes`: routing-table convergence at scale, timed with real broker processes.

A 3-broker mesh gets SERVICES dynamic services from connectors in the bench process;
then a 4th broker copies the table on joining, and single changes on one broker are
timed until every other broker routes to them. Per-step tables go to stderr, the
machine-readable last line to stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import statistics
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import click

import meshbus
from bench.brokers import MeshbusProcesses
from bench.harness import (
    PROBE_TIMEOUT,
    SETTLE_LIMIT,
    CheckFailed,
    Fleet,
    bytes_per_entry,
    connector_counts,
    fresh_mesh,
    ms,
    now,
    poll_until,
    pollers_on,
    register_many,
    rss_of,
    run_on_brokers,
    wait_balanced,
)
from bench.report import key_values, new_table, print_tables
from meshbus.address import Unicast, dynamic_instance

# Dynamic ids a broker has for one server name (meshbus.address.dynamic_instance).
_DYNAMIC_IDS = 65536
# Give-up bound for the connectors to spread over 4 brokers, each bringing all of its
# services: far above anything healthy, it only turns a hang into a clear error.
_REBALANCE_LIMIT = 600.0


@dataclass
class ChangeRun:
    kind: str  # "dynamic" (no claim) or "fixed" (a claim round first)
    registered_ms: float  # the register call's round trip on broker A
    reach_ms: list[float]  # per other broker: until a request from there was answered

    @property
    def slowest_ms(self) -> float:
        return max(self.reach_ms)


@dataclass
class RoutesResult:
    services: int
    register_s: float
    settle_ms: float  # last register answered -> every broker holds every route
    founder_ms: float
    join_table_ms: float
    newcomer_routes: int
    rebalance_ms: float | None  # None: not measured (--no-rebalance)
    counts: list[int]
    rss_mib: list[float | None]
    bytes_per_route: float  # the RSS the routes grew A, B and C by, per route: the median
    lag_max_ms: list[float]  # per broker A, B, C, D: its loop's largest lag since it started
    lag_own_ms: list[float]
    no_route_rtt_us: float
    stat_rtt_us: float
    changes: list[ChangeRun] = field(default_factory=list)


async def _route_services(pollers: Iterable[meshbus.Connector]) -> list[int]:
    stats = await asyncio.gather(*(p.stat(detail=False) for p in pollers))
    return [int(s["route_services"]) for s in stats]


async def _rtt_us(call: Callable[[], Awaitable[object]], times: int = 20) -> float:
    """Median round trip of ``call`` in microseconds."""
    samples = []
    for _ in range(times):
        began = now()
        await call()
        samples.append(now() - began)
    return statistics.median(samples) * 1e6


async def _no_route(probe: meshbus.Service, target: meshbus.Address) -> None:
    with contextlib.suppress(meshbus.NoRoute):
        await probe.request(target, b"?", timeout=PROBE_TIMEOUT)


async def _first_answer(probe: meshbus.Service, target: meshbus.Address, began: float) -> float:
    """Ask ``target`` back to back until it answers: when (after ``began``) the first
    answered request was sent. Each NO_ROUTE comes back in one round trip to the local
    broker, so that round trip is the resolution."""
    while True:
        sent = now()
        try:
            answer = await probe.request(target, b"?", timeout=PROBE_TIMEOUT)
        except meshbus.NoRoute:
            if sent - began > SETTLE_LIMIT:
                raise CheckFailed(f"{target} never became reachable from {probe.address}") from None
            continue
        if answer.src != target:
            raise CheckFailed(f"a request to {target} was answered by {answer.src}")
        return sent


async def _change(
    fleet: Fleet,
    conn: meshbus.Connector,
    probes: Sequence[meshbus.Service],
    target: meshbus.Address,
    instance: int | None,
) -> ChangeRun:
    """Probes ask ``target`` back to back while ``conn`` registers it; the time from the
    register call until a request of each probe was answered."""
    probing = [asyncio.create_task(_first_answer(p, target, now())) for p in probes]
    await asyncio.sleep(0.02)  # the probes are spinning on NO_ROUTE
    try:
        began = now()
        service = await conn.register(instance=instance)
        registered = now()
        fleet.answer(service)
        if service.address != target:
            raise CheckFailed(f"registered {service.address}, expected {target}")
        reached = await asyncio.gather(*probing)
    finally:
        for task in probing:
            task.cancel()
        await asyncio.gather(*probing, return_exceptions=True)
    return ChangeRun(
        kind="dynamic" if instance is None else "fixed",
        registered_ms=ms(registered - began),
        reach_ms=[ms(max(0.0, t - began)) for t in reached],
    )


async def _routes_run(
    brokers: MeshbusProcesses,
    services: int,
    per_broker: int,
    batch: int,
    changes: int,
    rebalance: bool,
) -> RoutesResult:
    async with fresh_mesh(brokers, 3) as mesh_run:
        mesh, fleet, pollers = mesh_run.mesh, mesh_run.fleet, mesh_run.pollers
        try:
            pollers.extend(await pollers_on(mesh, "poll"))
            conns = [
                await fleet.connect(broker, f"rt{b}x{i}")
                for i in range(per_broker)
                for b, broker in enumerate(mesh)
            ]
            empty = rss_of(mesh)
            _, register_s = await register_many(conns, services, batch)
            registered = now()

            async def full(expected: int, among: Sequence[meshbus.Connector]) -> bool:
                return all(n == expected for n in await _route_services(among))

            settled = await poll_until(
                lambda: full(services, pollers),
                f"{services} routes on every broker",
                SETTLE_LIMIT,
                0.01,
            )
            rss: list[float | None] = [*rss_of(mesh)]
            per_route = bytes_per_entry(empty, rss_of(mesh), services)

            # (a) A 4th broker copies the table: its ready line comes after the copy.
            newcomer = await brokers.start("--seed", mesh[0].address)
            ready = now()
            pollers.extend(await pollers_on([newcomer], "poll"))
            newcomer_routes = (await pollers[-1].stat(detail=False))["route_services"]
            if newcomer_routes != services:
                raise CheckFailed(f"the new broker holds {newcomer_routes} routes, not {services}")
            rebalance_ms = None
            counts = await connector_counts(pollers)
            if rebalance:
                # It takes its share of the connectors, each with all of its services.
                _, counts = await wait_balanced(pollers, len(conns), _REBALANCE_LIMIT, 0.05)
                rebalanced = await poll_until(
                    lambda: full(services, pollers),
                    f"{services} routes on every broker after the rebalance",
                    _REBALANCE_LIMIT,
                    0.05,
                )
                rebalance_ms = ms(rebalanced - ready)
            rss.append(newcomer.rss_mib())

            # (b) One change on A, seen from B, C and D.
            changer = await fleet.connect(mesh[0], "chg")
            probe_conns = pollers[1:]
            probes = [await conn.register() for conn in probe_conns]
            slot = int((await pollers[0].stat(detail=False))["slot"])
            nowhere = Unicast("chg", 65535)
            no_route_us = await _rtt_us(lambda: _no_route(probes[-1], nowhere))
            stat_us = await _rtt_us(lambda: probe_conns[-1].stat(detail=False))
            runs: list[ChangeRun] = []
            for i in range(changes):
                # The next dynamic id of a new server name on A is predictable: A's slot,
                # sequence 0, 1, ... (meshbus.address.dynamic_instance).
                dynamic = Unicast("chg", dynamic_instance(slot, i))
                runs.append(await _change(fleet, changer, probes, dynamic, None))
                runs.append(await _change(fleet, changer, probes, Unicast("chg", i + 1), i + 1))
            lags = [
                s["loop_lag_ms"]
                for s in await asyncio.gather(*(p.stat(detail=False) for p in pollers))
            ]
            return RoutesResult(
                services=services,
                register_s=register_s,
                settle_ms=ms(settled - registered),
                founder_ms=mesh[0].start_ms,
                join_table_ms=newcomer.start_ms,
                newcomer_routes=newcomer_routes,
                rebalance_ms=rebalance_ms,
                counts=counts,
                rss_mib=rss,
                bytes_per_route=per_route,
                lag_max_ms=[lag["max"] for lag in lags],
                lag_own_ms=[lag["max_own"] for lag in lags],
                no_route_rtt_us=no_route_us,
                stat_rtt_us=stat_us,
                changes=runs,
            )
        finally:
            gc.unfreeze()  # register_many froze the registered services


@click.command()
@click.option(
    "--services",
    type=click.IntRange(1, 1_000_000),
    default=100_000,
    show_default=True,
    help="Dynamic services registered across the 3 brokers.",
)
@click.option(
    "--connectors-per-broker",
    type=click.IntRange(1, 40),
    default=10,
    show_default=True,
    help="Connectors registering them, on each broker.",
)
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=3000,
    show_default=True,
    help="Registrations started together (asyncio.gather), round-robin over the connectors.",
)
@click.option(
    "--changes",
    type=click.IntRange(1, 1000),
    default=10,
    show_default=True,
    help="Single changes timed, of each kind (dynamic id, fixed id).",
)
@click.option(
    "--rebalance/--no-rebalance",
    default=True,
    show_default=True,
    help="Time the connectors spreading over the 4 brokers after the join (its 600 s "
    "bound is past at 500,000 services on a busy host).",
)
def routes(
    services: int, connectors_per_broker: int, batch: int, changes: int, rebalance: bool
) -> None:
    """Route convergence at SERVICES routes: registration rate, a 4th broker copying the
    table, and how fast one change reaches every broker.

    SERVICES dynamic services are registered through CONNECTORS-PER-BROKER connectors
    on each of 3 brokers (registrations/s, and until every broker holds every route;
    the registered services are kept out of this process's cyclic GC, which would
    otherwise be what is measured at 100k).
    (a) A 4th broker starts with --seed; its ready line comes once it has copied its
    peers' tables: timed from process start, then checked with its `stat`. It then
    takes its share of the connectors, each bringing all its services (timed until the
    spread is within one and every broker holds every route). (b) One service is
    registered on broker A while probes on B, C and D send it requests back to back:
    timed from the register call until a request from each was answered (the send
    time of the first answered request; NO_ROUTE answers come back in one local round
    trip, far finer than a `stat`, which is also timed and shown). Both kinds of
    change: a dynamic id (no mesh round trip before the route is announced) and a
    fixed id (a claim to every peer first).

    The brokers' RSS before and after the registrations gives the memory per route
    (the median of A, B and C); each broker's largest loop lag since it started (`stat`)
    covers all of it.

    Last line: `join_table_ms=<ms> change_ms=<median, dynamic, slowest broker>
    register_per_s=<n> bytes_per_route=<B> max_lag_ms=<ms, the worst broker>`.
    """

    per_connector = -(-services // (3 * connectors_per_broker))
    if per_connector > _DYNAMIC_IDS:
        raise click.BadParameter(
            f"{per_connector:,} services per connector; a server name has {_DYNAMIC_IDS:,} "
            "dynamic ids per broker: use more connectors",
            param_hint="'--connectors-per-broker'",
        )

    async def main(brokers: MeshbusProcesses) -> RoutesResult:
        return await _routes_run(
            brokers, services, connectors_per_broker, batch, changes, rebalance
        )

    r = run_on_brokers(main)
    per_s = r.services / r.register_s
    mesh_table = new_table(
        f"routes: {services:,} services, {3 * connectors_per_broker} connectors on 3 brokers",
        ("step", "figure"),
    )
    rss = "/".join("?" if m is None else f"{m:.0f}" for m in r.rss_mib)
    counts = "/".join(map(str, r.counts))
    for step, figure in (
        ("registration (bench GC frozen)", f"{r.register_s:.2f} s, {per_s:,.0f}/s"),
        ("all routes on every broker", f"{r.settle_ms:.1f} ms after the last"),
        ("founder start (baseline)", f"{r.founder_ms:.1f} ms"),
        ("4th broker start to ready", f"{r.join_table_ms:.1f} ms"),
        ("4th broker route_services", f"{r.newcomer_routes:,}"),
        (
            "rebalance after the join",
            "not measured" if r.rebalance_ms is None else f"{r.rebalance_ms:.1f} ms",
        ),
        ("connectors A/B/C/D after", counts),
        ("RSS MiB A/B/C/D", rss),
        ("bytes per route (RSS of A/B/C)", f"{r.bytes_per_route:.0f}"),
        ("max loop lag A/B/C/D", "/".join(f"{x:.1f}" for x in r.lag_max_ms) + " ms"),
        ("  of it own work", "/".join(f"{x:.1f}" for x in r.lag_own_ms) + " ms"),
        ("NO_ROUTE rtt (resolution)", f"{r.no_route_rtt_us:.0f} µs"),
        ("stat(detail=False) rtt", f"{r.stat_rtt_us:.0f} µs"),
    ):
        mesh_table.add_row(step, figure)
    change_table = new_table(
        "one change on A: ms from the register call to an answer from B / C / D",
        ("kind", "n", "register", "B", "C", "D", "slowest", "slowest max"),
    )
    medians: dict[str, float] = {}
    for kind in ("dynamic", "fixed"):
        runs = [c for c in r.changes if c.kind == kind]
        slowest = [c.slowest_ms for c in runs]
        medians[kind] = statistics.median(slowest)
        per_broker = [statistics.median(c.reach_ms[i] for c in runs) for i in range(3)]
        change_table.add_row(
            kind,
            str(len(runs)),
            f"{statistics.median(c.registered_ms for c in runs):.2f}",
            *(f"{median:.2f}" for median in per_broker),
            f"{medians[kind]:.2f}",
            f"{max(slowest):.2f}",
        )
    print_tables(mesh_table, change_table)
    click.echo(
        key_values(
            join_table_ms=f"{r.join_table_ms:.1f}",
            change_ms=f"{medians['dynamic']:.2f}",
            register_per_s=f"{per_s:.0f}",
            bytes_per_route=f"{r.bytes_per_route:.0f}",
            max_lag_ms=f"{max(r.lag_max_ms):.1f}",
        )
    )
