"""The `meshbus bench` commands.

Each run starts fresh connections on servers that live for the whole command;
with --vs-nats the meshbus and nats-server runs alternate, so both see the same
machine noise, and the ratio is taken between the medians of the runs.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from typing import Any, TypeVar

import click

from meshbus.bench.servers import BenchSetupError, Server, meshbus_broker, nats_server

F = TypeVar("F", bound=Callable[..., Any])


def _alternate(
    vs_nats: bool,
    runs: int,
    title: str,
    columns: tuple[str, ...],
    measure: Callable[[Server], tuple[float, tuple[str, ...]]],
) -> dict[str, float]:
    """Run ``measure`` ``runs`` times per system, meshbus and nats-server alternating,
    print the per-run table on stderr and return the median figure per system.

    ``measure`` returns the figure to take the median of and the table cells of the run.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("run", "system", *columns):
        table.add_column(column, justify="right")
    figures: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        try:
            servers = [stack.enter_context(meshbus_broker())]
            if vs_nats:
                servers.append(stack.enter_context(nats_server()))
        except BenchSetupError as exc:
            raise click.ClickException(str(exc)) from exc
        for run in range(1, runs + 1):
            for server in servers:
                figure, cells = measure(server)
                figures.setdefault(server.kind, []).append(figure)
                table.add_row(str(run), server.kind, *cells)
    Console(stderr=True).print(table)
    return {kind: statistics.median(values) for kind, values in figures.items()}


def _last_line(medians: dict[str, float], suffix: str, digits: int) -> str:
    """`meshbus<suffix>=<v> [nats<suffix>=<v> ratio=<meshbus/nats>]`, machine-readable."""
    line = f"meshbus{suffix}={medians['meshbus']:.{digits}f}"
    if "nats" in medians:
        ratio = medians["meshbus"] / medians["nats"]
        line += f" nats{suffix}={medians['nats']:.{digits}f} ratio={ratio:.3f}"
    return line


def _runs_options(command: F) -> F:
    """--runs and --vs-nats, the same for every benchmark."""
    command = click.option(
        "--vs-nats", is_flag=True, help="Also measure nats-server (Debian package)."
    )(command)
    return click.option(
        "--runs",
        type=click.IntRange(1),
        default=3,
        show_default=True,
        help="Runs per system, meshbus and nats-server alternating; medians are reported.",
    )(command)


@click.group()
def bench() -> None:
    """Measure meshbus, optionally against nats-server in the same run (--vs-nats).

    The last line of every benchmark is machine-readable key=value pairs.
    """


@bench.command()
@click.option(
    "--size",
    type=click.IntRange(0, 1_000_000),
    default=16,
    show_default=True,
    help="Payload bytes per message.",
)
@click.option(
    "--count",
    type=click.IntRange(1),
    default=1_000_000,
    show_default=True,
    help="Messages per run.",
)
@_runs_options
@click.option(
    "--destinations",
    type=click.IntRange(1, 9999),
    default=1,
    show_default=True,
    help="Spread messages round-robin over this many addresses on the consumer "
    "link (1 = a burst to one address; more defeats per-destination batching).",
)
def unicast(size: int, count: int, runs: int, destinations: int, vs_nats: bool) -> None:
    """One producer -> one consumer through one server: messages per second.

    Last line: `meshbus=<msgs/s> [nats=<msgs/s> ratio=<meshbus/nats>]`.
    """
    from meshbus.bench.throughput import measure_throughput
    from meshbus.bench.wire import MeshbusWire, NatsWire, Wire

    wires: dict[str, Wire] = {"meshbus": MeshbusWire(), "nats": NatsWire()}

    def measure(server: Server) -> tuple[float, tuple[str, ...]]:
        result = measure_throughput(
            wires[server.kind], server.host, server.port, count, size, destinations
        )
        return result.msgs_per_s, (
            f"{result.msgs_per_s:,.0f}",
            f"{result.mib_per_s:,.1f}",
            f"{result.seconds:.3f}",
        )

    medians = _alternate(
        vs_nats,
        runs,
        f"unicast: {count:,} x {size} B, {destinations} destination(s)",
        ("msgs/s", "MiB/s", "seconds"),
        measure,
    )
    click.echo(_last_line(medians, "", 0))


@bench.command()
@click.option(
    "--concurrency",
    type=click.IntRange(1, 10_000),
    default=1,
    show_default=True,
    help="Requests in flight at once.",
)
@click.option(
    "--count",
    type=click.IntRange(10),
    default=20_000,
    show_default=True,
    help="Timed requests per run (a warm-up of 10% more is not timed).",
)
@click.option(
    "--size",
    type=click.IntRange(0, 1_000_000),
    default=16,
    show_default=True,
    help="Payload bytes per request and response.",
)
@_runs_options
def request(concurrency: int, count: int, size: int, runs: int, vs_nats: bool) -> None:
    """Request/response through one server: p50/p99 latency and requests per second.

    Last line: `meshbus_p50_us=<us> [nats_p50_us=<us> ratio=<meshbus/nats>]`.
    """
    import uvloop

    from meshbus.bench.latency import MeshbusRequests, NatsRequests, RequestCodec, measure_latency

    codecs: dict[str, RequestCodec] = {"meshbus": MeshbusRequests(), "nats": NatsRequests()}

    def measure(server: Server) -> tuple[float, tuple[str, ...]]:
        result = uvloop.run(
            measure_latency(codecs[server.kind], server.host, server.port, count, concurrency, size)
        )
        return result.p50_us, (
            f"{result.p50_us:.0f}",
            f"{result.p99_us:.0f}",
            f"{result.requests_per_s:,.0f}",
        )

    medians = _alternate(
        vs_nats,
        runs,
        f"request/response: {count:,} x {size} B, concurrency {concurrency}",
        ("p50 µs", "p99 µs", "req/s"),
        measure,
    )
    click.echo(_last_line(medians, "_p50_us", 1))


@bench.command()
@click.option(
    "--services",
    type=click.IntRange(1, 65535),
    default=10_000,
    show_default=True,
    help="Services in the routing table (all in one topic).",
)
@click.option(
    "--links",
    type=click.IntRange(1),
    default=50,
    show_default=True,
    help="Links the services are spread over.",
)
@click.option(
    "--ops",
    type=click.IntRange(1),
    default=200_000,
    show_default=True,
    help="Operations timed per figure.",
)
def tables(services: int, links: int, ops: int) -> None:
    """The broker's routing and pending tables in process: nanoseconds per operation.

    Last line: `route_unicast_ns=<ns> route_multicast_ns=<ns> pending_ns=<ns>`.
    """
    from rich.console import Console
    from rich.table import Table

    from meshbus.bench.tables import measure_tables

    results = measure_tables(services, links, ops)
    table = Table(title=f"tables: {services:,} services on {links} links, {ops:,} ops")
    for column in ("operation", "ns/op", "ops/s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r.name, f"{r.ns_per_op:.0f}", f"{r.ops / r.seconds:,.0f}")
    Console(stderr=True).print(table)
    unicast, multicast, pending = (r.ns_per_op for r in results)
    click.echo(
        f"route_unicast_ns={unicast:.0f} route_multicast_ns={multicast:.0f} "
        f"pending_ns={pending:.0f}"
    )
