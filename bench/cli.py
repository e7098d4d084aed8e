"""The `python -m bench` group: the single-server commands (unicast, request, tables) here,
the others in the modules named by ``_ELSEWHERE``.

Each run starts fresh connections on servers that live for the whole command;
with --vs-nats the meshbus and nats-server runs alternate, so both see the same
machine noise, and the ratio is taken between the medians of the runs.
"""

from __future__ import annotations

import click

from bench.monitor import MONITOR_KIND, monitor_option, monitor_servers
from bench.report import new_table, print_tables
from bench.runs import alternate, count_option, last_line, runs_options, size_option
from bench.security import Security, auth_option, security, tls_option
from bench.servers import Server, nats_server, servers_of
from meshbus.cli.lazy import LazyGroup

# The commands defined elsewhere, by name: the module and attribute of each. They are imported
# when looked up, so that a command starts without the others' imports (`unicast` does not
# import pyspark).
_ELSEWHERE = {
    "cross": "bench.traffic:cross",
    "fanout": "bench.traffic:fanout",
    "failover": "bench.membership:failover",
    "join": "bench.membership:join",
    "routes": "bench.routes:routes",
    "members": "bench.members:members",
    "reliable": "bench.reliable:reliable",
    "chaos": "bench.chaos:chaos",
    "bursts": "bench.bursts:bursts",
    "handshake": "bench.handshake:handshake",
    "stream": "bench.streams:stream",
    "consumer": "bench.consumers:consumer",
    "spark": "bench.spark:spark",
    "game": "bench.game:game",
    "client": "bench.client:client",
    "nats-clients": "bench.nats_clients:nats_clients",
}


@click.group(cls=LazyGroup, elsewhere=_ELSEWHERE)
def bench() -> None:
    """Measure meshbus, optionally against nats-server in the same run (--vs-nats).

    The last line of every benchmark is machine-readable key=value pairs.
    """


@bench.command()
@size_option()
@count_option(1_000_000)
@runs_options
@auth_option
@tls_option
@monitor_option
@click.option(
    "--destinations",
    type=click.IntRange(1, 9999),
    default=1,
    show_default=True,
    help="Spread messages round-robin over this many addresses on the consumer "
    "link (1 = a burst to one address; more defeats per-destination batching).",
)
def unicast(
    size: int,
    count: int,
    runs: int,
    destinations: int,
    vs_nats: bool,
    auth: str,
    tls: bool,
    monitor: str,
    scrape_interval: float,
) -> None:
    """One producer -> one consumer through one server: messages per second.

    Last line: `meshbus=<msgs/s> [meshbus_auth=<msgs/s> auth_ratio=<r>]
    [meshbus_monitor=<msgs/s> monitor_ratio=<r>] [nats=<msgs/s> ratio=<meshbus/nats>]`.
    """
    if monitor != "off" and auth == "both":
        raise click.UsageError("--monitor and --auth both alternate systems: use one of them")
    with security(auth, tls) as made:
        _unicast(size, count, runs, destinations, vs_nats, made, monitor, scrape_interval)


def _unicast(
    size: int,
    count: int,
    runs: int,
    destinations: int,
    vs_nats: bool,
    made: Security,
    monitor: str = "off",
    scrape_interval: float = 1.0,
) -> None:
    from bench.throughput import measure_throughput
    from bench.wire import MeshbusWire, NatsWire, Wire

    tls = made.client_context()
    wires: dict[str, Wire] = {
        kind: MeshbusWire(made.credentials_for(kind), tls) for kind in made.kinds()
    }
    wires[MONITOR_KIND] = wires["meshbus"]
    wires["nats"] = NatsWire(tls)
    systems = servers_of(made, vs_nats)
    if monitor != "off":
        systems = monitor_servers(monitor, made.broker_args(), scrape_interval)
        if vs_nats:
            systems.append(nats_server(*made.nats_args()))
    label = made.label() + (f", monitor {monitor}" if monitor != "off" else "")

    def measure(server: Server) -> tuple[float, tuple[str, ...]]:
        result = measure_throughput(
            wires[server.kind], server.host, server.port, count, size, destinations
        )
        return result.msgs_per_s, (
            f"{result.msgs_per_s:,.0f}",
            f"{result.mib_per_s:,.1f}",
            f"{result.seconds:.3f}",
        )

    medians = alternate(
        systems,
        runs,
        f"unicast: {count:,} x {size} B, {destinations} destination(s){label}",
        ("msgs/s", "MiB/s", "seconds"),
        measure,
    )
    click.echo(last_line(medians, "", 0))


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
@size_option("Payload bytes per request and response.")
@runs_options
@auth_option
@tls_option
def request(
    concurrency: int, count: int, size: int, runs: int, vs_nats: bool, auth: str, tls: bool
) -> None:
    """Request/response through one server: p50/p99 latency and requests per second.

    Last line: `meshbus_p50_us=<us> [meshbus_auth_p50_us=<us> auth_ratio=<r>]
    [nats_p50_us=<us> ratio=<meshbus/nats>]`.
    """
    with security(auth, tls) as made:
        _request(concurrency, count, size, runs, vs_nats, made)


def _request(
    concurrency: int, count: int, size: int, runs: int, vs_nats: bool, made: Security
) -> None:
    import uvloop

    from bench.latency import MeshbusRequests, NatsRequests, RequestCodec, measure_latency

    tls = made.client_context()
    codecs: dict[str, RequestCodec] = {
        kind: MeshbusRequests(made.credentials_for(kind), tls) for kind in made.kinds()
    }
    codecs["nats"] = NatsRequests(tls)

    def measure(server: Server) -> tuple[float, tuple[str, ...]]:
        result = uvloop.run(
            measure_latency(codecs[server.kind], server.host, server.port, count, concurrency, size)
        )
        return result.p50_us, (
            f"{result.p50_us:.0f}",
            f"{result.p99_us:.0f}",
            f"{result.requests_per_s:,.0f}",
        )

    medians = alternate(
        servers_of(made, vs_nats),
        runs,
        f"request/response: {count:,} x {size} B, concurrency {concurrency}{made.label()}",
        ("p50 µs", "p99 µs", "req/s"),
        measure,
    )
    click.echo(last_line(medians, "_p50_us", 1))


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
    from bench.tables import measure_tables

    results = measure_tables(services, links, ops)
    table = new_table(
        f"tables: {services:,} services on {links} links, {ops:,} ops",
        ("operation", "ns/op", "ops/s"),
    )
    for r in results:
        table.add_row(r.name, f"{r.ns_per_op:.0f}", f"{r.ops / r.seconds:,.0f}")
    print_tables(table)
    unicast, multicast, pending = (r.ns_per_op for r in results)
    click.echo(
        f"route_unicast_ns={unicast:.0f} route_multicast_ns={multicast:.0f} "
        f"pending_ns={pending:.0f}"
    )
