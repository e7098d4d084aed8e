"""`bench nats-clients`: one NATS client on both sides, through a meshbus broker's NATS
listener (``--nats-listen``) and through nats-server, in the same run.

What a NATS client gets from the broker's listener against the server it stands in for:
two worker processes (a receiver or responder, a sender or requester), the same code on
both systems -- only the server differs. ``--client nats.py`` (the default): the nats.py
workers of ``bench client``; ``--client nats.js``: Node.js processes running the same
scenarios with nats.js (``bench.nats_js``, tests/nats_js/bench.mjs):

* one way: ``publish`` -> a subscription callback, messages per second at the receiver
  from the end of a warm-up (a tenth of the messages) to the last;
* request/response: ``request`` against a callback that ``respond``s, with
  ``--concurrency`` requests in flight (requests per second), and at concurrency 1 (p50).

With ``--brokers 3`` both systems are three servers linked as one -- a meshbus mesh of
three brokers, each with its NATS listener, and a nats-server cluster of three nodes
routed to each other -- and the two sides of each scenario connect to different ones:
the publisher (requester) to the first, the subscriber (responder) to the second, so
every message crosses one broker-to-broker link (docs/nats.md, "Across the mesh").

The systems alternate run by run (``runs.alternate``); the ratios are meshbus / nats
between the medians.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import click

from bench.client import Job, ratio_figures, workers
from bench.cluster import meshbus_mesh, nats_cluster
from bench.nats_js import node_workers
from bench.report import key_values
from bench.runs import alternate, request_options, runs_options
from bench.servers import BenchSetupError, Server, free_port, meshbus_broker, nats_server

_MESH_ATTEMPTS = 3


class Pool(Protocol):
    """The two worker processes of a scenario, in one client's language."""

    def run(self, serve: Job, drive: Job, *, stop_serving: bool) -> dict[str, float]: ...


# --client: the workers of each NATS client measured.
_POOLS: dict[str, Callable[[], contextlib.AbstractContextManager[Pool]]] = {
    "nats.py": workers,
    "nats.js": node_workers,
}


@dataclass
class Ends:
    """Where a scenario's two sides connect: the publisher or requester to ``entry``, the
    subscriber or responder to ``exit`` -- one server, or two nodes of a cluster."""

    kind: str
    entry: Server
    exit: Server


@contextlib.contextmanager
def meshbus_nats_listener() -> Iterator[Ends]:
    """A broker with --nats-listen on a free loopback port: the Server is its NATS side."""
    port = free_port()
    with meshbus_broker("--nats-listen", f"127.0.0.1:{port}") as broker:
        server = Server("meshbus", "127.0.0.1", port, broker.pid)
        yield Ends("meshbus", server, server)


@contextlib.contextmanager
def single_nats_server() -> Iterator[Ends]:
    with nats_server() as server:
        yield Ends("nats", server, server)


@contextlib.contextmanager
def meshbus_nats_mesh(size: int) -> Iterator[Ends]:
    """``size`` brokers in one mesh, each with --nats-listen on a free loopback port. A
    port free a moment ago may be taken by then (by a broker's --listen 127.0.0.1:0): the
    broker that cannot bind it exits, and the mesh is started again on other ports."""
    with contextlib.ExitStack() as stack:
        for attempt in range(_MESH_ATTEMPTS):
            ports = [free_port() for _ in range(size)]
            listen = [("--nats-listen", f"127.0.0.1:{port}") for port in ports]
            try:
                mesh = stack.enter_context(meshbus_mesh(size, each=listen.__getitem__))
                break
            except BenchSetupError:
                if attempt == _MESH_ATTEMPTS - 1:
                    raise
        entry, exit_ = (Server("meshbus", "127.0.0.1", ports[i], mesh.nodes[i].pid) for i in (0, 1))
        yield Ends("meshbus", entry, exit_)


@contextlib.contextmanager
def nats_server_cluster(size: int) -> Iterator[Ends]:
    with nats_cluster(size) as cluster:
        yield Ends("nats", cluster.nodes[0], cluster.nodes[1])


def _systems(brokers: int) -> list[contextlib.AbstractContextManager[Ends]]:
    if brokers == 1:
        return [meshbus_nats_listener(), single_nats_server()]
    return [meshbus_nats_mesh(brokers), nats_server_cluster(brokers)]


def _job(role: str, server: Server, count: int, size: int, concurrency: int = 1) -> Job:
    # "nats": a NATS client on both systems (the nats.js workers know no other); the
    # server is what differs.
    return Job(role, "nats", server.host, server.port, count, size, concurrency)


@click.command(name="nats-clients")
@click.option(
    "--count",
    type=click.IntRange(100),
    default=100_000,
    show_default=True,
    help="Messages per run of the one-way scenario.",
)
@request_options(10_000)
@click.option(
    "--brokers",
    type=click.Choice(["1", "3"]),
    default="1",
    show_default=True,
    help="1: one broker against one nats-server; 3: a mesh of three against a cluster of "
    "three, the two sides on different ones.",
)
@click.option(
    "--client",
    type=click.Choice(sorted(_POOLS)),
    default="nats.py",
    show_default=True,
    help="The NATS client of both sides: nats.py, or nats.js on Node.js (make nats-js).",
)
@runs_options
def nats_clients(
    count: int,
    requests: int,
    size: int,
    concurrency: int,
    brokers: str,
    client: str,
    runs: int,
    vs_nats: bool,
) -> None:
    """A NATS client (nats.py or nats.js) through meshbus's NATS listener vs through
    nats-server (always both: --vs-nats is implied), on one server each or (--brokers 3)
    across three.

    Last line: `meshbus_msgs=<msgs/s> nats_msgs=<msgs/s> ratio_msgs=<r> meshbus_rps=<req/s>
    nats_rps=<req/s> ratio_rps=<r> meshbus_p50_us=<us> nats_p50_us=<us> ratio_p50=<r>`:
    the ratios are meshbus/nats (for p50 lower is better).
    """
    figures: dict[str, str] = {}
    size_of = int(brokers)
    across = " across 3 servers" if size_of > 1 else ""
    with contextlib.ExitStack() as stack:
        try:
            pool = stack.enter_context(_POOLS[client]())
        except BenchSetupError as exc:
            raise click.ClickException(str(exc)) from exc
        one_way = alternate(
            _systems(size_of),
            runs,
            f"{client} one way{across}: {count:,} x {size} B, publish -> callback",
            ("msgs/s",),
            _one_way(pool, count, size),
        )
        ratio_figures(figures, "msgs", one_way, 0)
        for name, at in (("rps", concurrency), ("p50_us", 1)):
            medians = alternate(
                _systems(size_of),
                runs,
                f"{client} request/response{across}: {requests:,} x {size} B, concurrency {at}",
                ("req/s", "p50 µs"),
                _requests(pool, requests, size, at),
            )
            ratio_figures(figures, name, medians, 0 if at > 1 else 1)
    click.echo(key_values(**figures))


def _one_way(pool: Pool, count: int, size: int) -> Callable[[Ends], tuple[float, tuple[str]]]:
    def measure(ends: Ends) -> tuple[float, tuple[str]]:
        done = pool.run(
            _job("receive", ends.exit, count, size),
            _job("send", ends.entry, count, size),
            stop_serving=False,
        )
        return done["msgs_per_s"], (f"{done['msgs_per_s']:,.0f}",)

    return measure


def _requests(
    pool: Pool, requests: int, size: int, concurrency: int
) -> Callable[[Ends], tuple[float, tuple[str, str]]]:
    def measure(ends: Ends) -> tuple[float, tuple[str, str]]:
        done = pool.run(
            _job("respond", ends.exit, requests, size),
            _job("request", ends.entry, requests, size, concurrency),
            stop_serving=True,
        )
        rps, p50 = done["requests_per_s"], done["p50_us"]
        return (rps if concurrency > 1 else p50), (f"{rps:,.0f}", f"{p50:.0f}")

    return measure
