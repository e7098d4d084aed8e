"""`handshake`: how long a connector takes to open its link -- connect, HELLO, and the
sign-in when the broker has users -- against brokers without and with users, alternating.

Each run opens ``count`` connectors one after the other with ``meshbus.connect`` (the
real client: TCP, TLS with --tls, HELLO, CHALLENGE/AUTH signed with an Ed25519 key,
WELCOME) and closes each before the next; only ``connect`` is timed. The bench runs on
one uvloop event loop in its own process; each broker is a child process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import click

import meshbus
from bench.runs import alternate, count_option, last_line
from bench.security import Security, security, tls_option
from bench.servers import Server, servers_of


@dataclass
class HandshakeResult:
    seconds: float  # the whole run, closes included
    connect_us: list[float]

    @property
    def p50_us(self) -> float:
        return statistics.median(self.connect_us)

    @property
    def p99_us(self) -> float:
        ordered = sorted(self.connect_us)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def measure_handshakes(server: Server, count: int, made: Security) -> HandshakeResult:
    """Open and close ``count`` connectors on ``server``, one at a time."""
    address = f"{server.host}:{server.port}"
    credentials = made.credentials_for(server.kind)
    tls = made.client_context()
    times: list[float] = []
    began = time.perf_counter()
    for _ in range(count):
        start = time.perf_counter()
        conn = await meshbus.connect(
            address, server="bench", failover=False, credentials=credentials, tls=tls
        )
        times.append((time.perf_counter() - start) * 1e6)
        await conn.close()
    return HandshakeResult(time.perf_counter() - began, times)


@click.command()
@count_option(200, "Connectors opened (and closed) per run.")
@click.option(
    "--runs",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Runs per system, the systems alternating; medians are reported.",
)
@tls_option
def handshake(count: int, runs: int, tls: bool) -> None:
    """Connect time of a connector to a broker without users and to one with users
    (key-pair sign-in), the two alternating: p50 and p99 of `meshbus.connect`.

    Last line: `meshbus_p50_us=<us> meshbus_auth_p50_us=<us> auth_ratio=<with/without>
    meshbus_p99_us=<us> meshbus_auth_p99_us=<us>` (each p99 the median of the runs').
    """
    import uvloop

    with security("both", tls) as made:
        p99s: dict[str, list[float]] = {}

        def measure(server: Server) -> tuple[float, tuple[str, ...]]:
            result = uvloop.run(measure_handshakes(server, count, made))
            p99s.setdefault(server.kind, []).append(result.p99_us)
            return result.p50_us, (
                f"{result.p50_us:.0f}",
                f"{result.p99_us:.0f}",
                f"{count / result.seconds:,.0f}",
            )

        medians = alternate(
            servers_of(made, vs_nats=False),
            runs,
            f"handshake: {count:,} connectors, one at a time{made.label()}",
            ("connect p50 µs", "connect p99 µs", "open+close/s"),
            measure,
        )
    p99 = {kind: statistics.median(values) for kind, values in p99s.items()}
    click.echo(
        f"{last_line(medians, '_p50_us', 0)} meshbus_p99_us={p99['meshbus']:.0f} "
        f"meshbus_auth_p99_us={p99['meshbus_auth']:.0f}"
    )
