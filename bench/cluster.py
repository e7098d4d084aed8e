"""Start and stop what the multi-server benchmarks measure: an N-broker meshbus mesh and
an N-node nats-server cluster, each formed in full before it is handed out.

The meshbus mesh is started by ``brokers.MeshbusProcesses``, the same code that starts the
mesh-operation benchmarks' brokers (asyncio subprocesses from ``spawn_broker``,
joined with ``--seed``). The traffic benchmarks that use it here are thread-based
and blocking, so ``meshbus_mesh`` runs that code on an event loop of its own, which
runs only while brokers start and stop: nothing of it runs while traffic is timed.

A cluster is "formed" when every broker (node) sees every other one: for meshbus,
each broker's `stat` lists N-1 peer links and every broker of the mesh as ready;
for nats-server, each node's ``/routez`` monitoring page lists a route to every
other node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import meshbus
from bench.brokers import MeshbusProcesses
from bench.servers import BenchSetupError, Server, find_nats_server
from meshbus.auth import Credentials
from meshbus.broker.process import BrokerStartError, stop_process
from meshbus.util import parse_hostport

_FORM_TIMEOUT = 15.0
_START_TIMEOUT = 10.0


@dataclass
class Cluster:
    """N servers of one kind that route to each other; ``nodes[0]`` is the seed."""

    kind: str
    nodes: list[Server]
    # nats-server only: each node's HTTP monitoring port, in the order of ``nodes``.
    monitors: list[int] = field(default_factory=list)
    # meshbus brokers with users: what the bench's own connectors sign in with.
    credentials: Credentials | None = None


def wait_until(what: str, check: Callable[[], bool], timeout: float = _FORM_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise BenchSetupError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


# -- meshbus ------------------------------------------------------------------------------


def broker_stat(server: Server, credentials: Credentials | None = None) -> dict[str, Any]:
    """The `stat` answer of one broker (without the per-service lists)."""

    async def ask() -> dict[str, Any]:
        address = f"{server.host}:{server.port}"
        async with await meshbus.connect(
            address, server="bench", failover=False, credentials=credentials
        ) as conn:
            return await conn.stat(detail=False)

    return asyncio.run(ask())


def _mesh_formed(nodes: list[Server], credentials: Credentials | None) -> bool:
    for node in nodes:
        stat = broker_stat(node, credentials)
        if len(stat["peer_links"]) != len(nodes) - 1:
            return False
        mesh = stat["mesh"]
        if len(mesh) != len(nodes) or not all(b["ready"] and not b["draining"] for b in mesh):
            return False
    return True


@contextlib.contextmanager
def meshbus_mesh(
    size: int,
    *extra: str,
    kind: str = "meshbus",
    each: Callable[[int], Sequence[str]] | None = None,
    credentials: Credentials | None = None,
) -> Iterator[Cluster]:
    """``size`` brokers with ``extra`` arguments (broker i also ``each(i)``) on free
    loopback ports, the others joined through the first one (``--seed``), all linked to
    each other and ready; stopped on exit, however it ends. ``credentials``: what the
    bench signs in with to brokers with users."""
    import uvloop

    brokers = MeshbusProcesses()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            try:
                mesh = runner.run(brokers.mesh(size, *extra, each=each))
            except BrokerStartError as exc:
                raise BenchSetupError(f"a meshbus broker did not start: {exc}") from exc
            nodes = [
                Server(kind, *parse_hostport(broker.address), broker.process.pid) for broker in mesh
            ]
            wait_until(
                f"a full mesh of {size} meshbus brokers",
                lambda: _mesh_formed(nodes, credentials),
            )
            yield Cluster(kind, nodes, credentials=credentials)
        finally:
            try:
                runner.run(brokers.close())
            finally:
                brokers.kill()


# -- nats-server ----------------------------------------------------------------------------


def _read_ports(path: str) -> dict[str, int] | None:
    """The ports in a nats-server ports file ({"nats": ["nats://HOST:PORT"], ...}),
    or None while it is missing or not completely written."""
    try:
        with open(path) as file:
            urls = json.load(file)
        return {kind: _port(urls[kind][0]) for kind in ("nats", "monitoring", "cluster")}
    except (OSError, ValueError, KeyError, IndexError):
        return None


def _port(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    if port is None:
        raise ValueError(f"no port in {url!r}")
    return port


@contextlib.contextmanager
def _nats_node(
    workdir: str, index: int, seed_route: str | None, extra: Sequence[str] = ()
) -> Iterator[tuple[Server, int, int]]:
    """One clustered nats-server on random loopback ports: (server, monitor port, route
    port). Its ports come from the ports file it writes into ``workdir``, its log goes
    to a file there; stopped on exit. ``extra`` arguments come last: they may set what the
    others set (a flag given twice takes the last value)."""
    argv = [
        find_nats_server(),
        *("-a", "127.0.0.1", "-p", "-1", "-m", "-1", "--ports_file_dir", workdir),
        *("--cluster_name", "meshbus-bench", "--cluster", "nats://127.0.0.1:-1"),
    ]
    if seed_route is not None:
        argv += ["--routes", seed_route]
    argv += extra
    log_path = os.path.join(workdir, f"nats-{index}.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    try:
        ports_path = os.path.join(workdir, f"{os.path.basename(argv[0])}_{process.pid}.ports")
        deadline = time.monotonic() + _START_TIMEOUT
        while (ports := _read_ports(ports_path)) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as failed:
                    tail = failed.readlines()[-5:]
                raise BenchSetupError("clustered nats-server did not start: " + "".join(tail))
            time.sleep(0.01)
        yield (
            Server("nats", "127.0.0.1", ports["nats"], process.pid),
            ports["monitoring"],
            ports["cluster"],
        )
    finally:
        stop_process(process)


def nats_monitor(port: int, page: str) -> dict[str, Any]:
    """One page of a nats-server's HTTP monitoring endpoint (``varz``, ``routez``, ...)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{page}", timeout=5) as answer:
        data: dict[str, Any] = json.load(answer)
        return data


def _nats_formed(monitors: list[int]) -> bool:
    ids = [nats_monitor(port, "varz")["server_id"] for port in monitors]
    for own, port in zip(ids, monitors, strict=True):
        routes = {route["remote_id"] for route in nats_monitor(port, "routez")["routes"]}
        if routes != set(ids) - {own}:
            return False
    return True


@contextlib.contextmanager
def nats_cluster(
    size: int, each: Callable[[str, int], Sequence[str]] | None = None
) -> Iterator[Cluster]:
    """``size`` nats-servers on random loopback ports, the others routed to the first one
    (the cluster gossips the rest), every node routed to every other one; stopped on exit.
    Node i also gets ``each(workdir, i)``: arguments that may name files of its own in the
    cluster's temporary ``workdir`` (a JetStream store, a config file)."""
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="meshbus-bench-nats-"))
        nodes: list[Server] = []
        monitors: list[int] = []
        seed_route: str | None = None
        for index in range(size):
            extra = each(workdir, index) if each is not None else ()
            node, monitor, route = stack.enter_context(
                _nats_node(workdir, index, seed_route, extra)
            )
            seed_route = seed_route or f"nats://127.0.0.1:{route}"
            nodes.append(node)
            monitors.append(monitor)
        wait_until(f"a full cluster of {size} nats-servers", lambda: _nats_formed(monitors))
        yield Cluster("nats", nodes, monitors)
