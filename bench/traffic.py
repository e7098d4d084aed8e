"""`cross` and `fanout`: traffic that crosses brokers, against a nats-server cluster.

The load driver is the one of ``throughput``: a blocking-socket producer sends
pre-encoded messages in batches, one thread per receiving link counts bytes, and
time runs from the first send to the last expected byte on every receiving link.
What is new here is where the links sit: on different servers of a meshbus mesh
(``cluster.meshbus_mesh``) or of a nats-server cluster (``cluster.nats_cluster``).

Before any timing, interest must have crossed the cluster (a meshbus broker
announces its services and memberships to its peers; nats-server sends route
subscriptions), so ``wait_for_route`` publishes probes until one reaches every
receiving link, for both systems alike, then drains the links clean.
"""

from __future__ import annotations

import contextlib
import functools
import select
import socket
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import click

from bench.cluster import Cluster, broker_stat, meshbus_mesh, nats_cluster, nats_monitor
from bench.runs import alternate, count_option, last_line, runs_options, size_option
from bench.security import AUTH_KIND, Security, auth_option, security
from bench.servers import BenchSetupError
from bench.throughput import ThroughputResult, split_batches, time_delivery
from bench.wire import CONSUMER, PRODUCER, MeshbusWire, NatsWire, Wire
from meshbus.address import Multicast, Unicast
from meshbus.protocol import ControlType, encode_control, encode_data
from meshbus.protocol.control import Membership

_SETTLE_TIMEOUT = 15.0
_PROBE_INTERVAL = 0.05
_PROBE_PREFIX = b"<probe-"
_SYNC = b"<sync>"
_FANOUT_BROKERS = 3
# meshbus subscribers are bench:<this + n>, clear of the producer (1) and consumers (2...).
_FIRST_SUBSCRIBER = 100
_MAX_SUBSCRIBERS = 0xFFFF - _FIRST_SUBSCRIBER


# -- probes: has interest crossed the cluster? ------------------------------------------


class Probe(Protocol):
    def probe(self, token: bytes) -> tuple[bytes, bytes]:
        """(what the producer sends to publish ``token``, the bytes each delivered copy
        of it ends with)."""
        ...


@dataclass
class MeshbusProbe:
    dst: bytes
    src: bytes

    def probe(self, token: bytes) -> tuple[bytes, bytes]:
        # The payload is the end of a data frame.
        return encode_data(self.dst, self.src, token), token


@dataclass
class NatsProbe:
    subject: bytes

    def probe(self, token: bytes) -> tuple[bytes, bytes]:
        # MSG <subject> <sid> <size>\r\n<payload>\r\n
        return b"PUB %s %d\r\n%s\r\n" % (self.subject, len(token), token), token + b"\r\n"


def wait_for_route(
    name: str,
    producer: socket.socket,
    probe: Probe,
    links: Sequence[tuple[socket.socket, int]],
    timeout: float = _SETTLE_TIMEOUT,
) -> None:
    """Publish probes on ``producer`` until one has reached every link of ``links``
    (socket, copies of one message it receives), then one last probe, and read each
    link until all copies of that one are in. Each path through the servers keeps
    its order, so by then every earlier probe that will ever arrive has arrived:
    the links are empty when this returns, and every route is in place."""
    bufs = {sock: bytearray() for sock, _ in links}
    deadline = time.monotonic() + timeout

    def read(wait: float) -> None:
        if time.monotonic() > deadline:
            raise BenchSetupError(
                f"{name}: probes published did not reach every receiving link in {timeout:.0f} s"
            )
        readable, _, _ = select.select(list(bufs), [], [], wait)
        for sock in readable:
            chunk = sock.recv(65536)
            if not chunk:
                raise BenchSetupError(f"{name} closed a receiving link while it was probed")
            bufs[sock] += chunk

    sent = 0
    while not all(_PROBE_PREFIX in buf for buf in bufs.values()):
        sent += 1
        producer.sendall(probe.probe(_PROBE_PREFIX + b"%d>" % sent)[0])
        until = time.monotonic() + _PROBE_INTERVAL
        while (left := until - time.monotonic()) > 0 and not all(
            _PROBE_PREFIX in buf for buf in bufs.values()
        ):
            read(left)
    frame, marker = probe.probe(_SYNC)
    producer.sendall(frame)
    for sock, copies in links:
        while bufs[sock].count(marker) < copies:
            read(0.1)
        if not bufs[sock].endswith(marker):
            raise BenchSetupError(f"{name}: unexpected bytes after the last probe on a link")


# -- the servers -------------------------------------------------------------------------


def _clusters(
    size: int, vs_nats: bool, *broker_args: str, made: Security | None = None
) -> list[AbstractContextManager[Cluster]]:
    """A meshbus mesh of ``size`` brokers per system of ``made`` (with --auth both, one
    without users and one with) and, with ``vs_nats``, a nats-server cluster of ``size``
    nodes, to be started by ``runs.alternate``."""
    if made is None:
        clusters: list[AbstractContextManager[Cluster]] = [meshbus_mesh(size, *broker_args)]
    else:
        clusters = [
            meshbus_mesh(
                size,
                *broker_args,
                kind=kind,
                each=functools.partial(made.broker_args, kind),
                credentials=made.credentials_for(kind),
            )
            for kind in made.kinds()
        ]
    if vs_nats:
        clusters.append(nats_cluster(size))
    return clusters


def _meshbus_quiet(cluster: Cluster) -> None:
    """Wait until no broker holds a service of a bench link any more: the next run
    registers the same fixed addresses, which must not still be in use."""
    if not cluster.kind.startswith("meshbus"):
        return
    deadline = time.monotonic() + _SETTLE_TIMEOUT
    while any(broker_stat(node, cluster.credentials)["services"] for node in cluster.nodes):
        if time.monotonic() > deadline:
            raise BenchSetupError("meshbus brokers kept the services of closed bench links")
        time.sleep(0.02)


def _peer_msgs_out(cluster: Cluster) -> dict[str, int]:
    """Data messages the first node has sent to each of its peers so far, by peer."""
    if cluster.kind.startswith("meshbus"):
        stat = broker_stat(cluster.nodes[0], cluster.credentials)
        return {p["name"]: p["msgs_out"] for p in stat["peer_links"]}
    routes = nats_monitor(cluster.monitors[0], "routez")["routes"]
    return {r["remote_id"]: r["out_msgs"] for r in routes}


# -- cross ---------------------------------------------------------------------------------

_CROSS_PROBES: dict[str, Probe] = {
    "meshbus": MeshbusProbe(CONSUMER.to_bytes(), PRODUCER.to_bytes()),
    AUTH_KIND: MeshbusProbe(CONSUMER.to_bytes(), PRODUCER.to_bytes()),
    # NatsWire's consumer subscribes to its first subject.
    "nats": NatsProbe(NatsWire()._subjects(1)[0]),
}


def measure_cross(
    wire: Wire, probe: Probe, cluster: Cluster, count: int, size: int, timeout: float = 120.0
) -> ThroughputResult:
    """One producer on the cluster's first server -> one consumer on its second one."""
    a, b = cluster.nodes[:2]
    with (
        wire.open_consumer(b.host, b.port) as consumer,
        wire.open_producer(a.host, a.port) as producer,
    ):
        wait_for_route(wire.name, producer, probe, [(consumer, 1)])
        batches = split_batches(count, lambda n: wire.encode_messages(n, size))
        expected = count * wire.delivered_size(size)
        seconds = time_delivery(wire.name, producer, batches, [(consumer, expected)], timeout)
    _meshbus_quiet(cluster)
    return ThroughputResult(wire.name, count, size, seconds)


@click.command()
@size_option()
@count_option(1_000_000)
@runs_options
@auth_option
def cross(size: int, count: int, runs: int, vs_nats: bool, auth: str) -> None:
    """One producer on broker A -> one consumer on broker B of a 2-broker mesh:
    messages per second across the broker-to-broker link.

    With --vs-nats the same through a 2-node nats-server cluster (producer on one
    node, subscriber on the other). Each run opens fresh links and waits until a
    probe sent on A arrives at B before timing.

    With --auth the brokers have a user and list each other in [[brokers]], each with
    its own key (docs/security.md), and the links sign in.

    Last line: `meshbus=<msgs/s> [meshbus_auth=<msgs/s> auth_ratio=<r>] [nats=<msgs/s>
    ratio=<meshbus/nats>]`.
    """
    with security(auth, brokers=2) as made:
        _cross(size, count, runs, vs_nats, made)


def _cross(size: int, count: int, runs: int, vs_nats: bool, made: Security) -> None:
    wires: dict[str, Wire] = {
        kind: MeshbusWire(made.credentials_for(kind)) for kind in made.kinds()
    }
    wires["nats"] = NatsWire()

    def measure(cluster: Cluster) -> tuple[float, tuple[str, ...]]:
        result = measure_cross(
            wires[cluster.kind], _CROSS_PROBES[cluster.kind], cluster, count, size
        )
        return result.msgs_per_s, (
            f"{result.msgs_per_s:,.0f}",
            f"{result.mib_per_s:,.1f}",
            f"{result.seconds:.3f}",
        )

    medians = alternate(
        _clusters(2, vs_nats, made=made),
        runs,
        f"cross: {count:,} x {size} B, producer on server A, consumer on server B{made.label()}",
        ("msgs/s", "MiB/s", "seconds"),
        measure,
    )
    click.echo(last_line(medians, "", 0))


# -- fanout --------------------------------------------------------------------------------


class FanoutWire(Protocol):
    """One system's side of ``fanout``: a publisher link and subscriber links."""

    name: str

    @property
    def probe(self) -> Probe:
        """Publishes to the subscribers' group or subject."""
        ...

    def open_publisher(self, host: str, port: int) -> socket.socket: ...

    def open_subscribers(self, host: str, port: int, members: Sequence[int]) -> socket.socket:
        """A link carrying the subscribers numbered ``members``, all subscribed."""
        ...

    def encode_messages(self, count: int, size: int) -> bytes: ...

    def delivered(self, size: int, members: int) -> tuple[int, int]:
        """(copies, bytes) of one published message that a link with ``members``
        subscribers receives."""
        ...


class MeshbusFanout:
    """Subscribers are services joined to one multicast group; the broker sends one
    frame per link with members, the connector there hands it to each of them."""

    name = "meshbus"
    group = Multicast("bench.fanout").to_bytes()

    def __init__(self) -> None:
        self._wire = MeshbusWire()
        self.probe = MeshbusProbe(self.group, PRODUCER.to_bytes())

    def open_publisher(self, host: str, port: int) -> socket.socket:
        return self._wire.open_producer(host, port)

    def open_subscribers(self, host: str, port: int, members: Sequence[int]) -> socket.socket:
        addresses = [Unicast("bench", _FIRST_SUBSCRIBER + n) for n in members]
        joins = b"".join(
            encode_control(
                ControlType.JOIN, Membership(member=a.to_bytes(), group=self.group), 2 + i
            )
            for i, a in enumerate(addresses)
        )
        return self._wire._open(host, port, *addresses, extra=joins)

    def encode_messages(self, count: int, size: int) -> bytes:
        src, payload = PRODUCER.to_bytes(), b"x" * size
        return b"".join(encode_data(self.group, src, payload, msg_id=i + 1) for i in range(count))

    def delivered(self, size: int, members: int) -> tuple[int, int]:
        return 1, self._wire.delivered_size(size)


class NatsFanout:
    """Subscribers are subscriptions (SUB) on one subject; nats-server sends one MSG
    per subscription."""

    name = "nats"
    subject = b"bench.fanout"

    def __init__(self) -> None:
        self._wire = NatsWire()
        self.probe = NatsProbe(self.subject)

    def open_publisher(self, host: str, port: int) -> socket.socket:
        return self._wire.open_producer(host, port)

    def open_subscribers(self, host: str, port: int, members: Sequence[int]) -> socket.socket:
        subs = b"".join(
            b"SUB %s %d\r\n" % (self.subject, sid) for sid in range(1, len(members) + 1)
        )
        return self._wire._open(host, port, subs)

    def encode_messages(self, count: int, size: int) -> bytes:
        return b"PUB %s %d\r\n%s\r\n" % (self.subject, size, b"x" * size) * count

    def delivered(self, size: int, members: int) -> tuple[int, int]:
        # MSG <subject> <sid> <size>\r\n<payload>\r\n, once per subscription (sids 1..members).
        return members, sum(
            len(b"MSG %s %d %d\r\n" % (self.subject, sid, size)) + size + 2
            for sid in range(1, members + 1)
        )


def fanout_plan(subscribers: int, brokers: int, links_per_broker: int) -> list[list[list[int]]]:
    """Subscriber numbers per link per broker: subscriber n on link n mod L (L links in
    all), link j on broker j mod ``brokers``, so links and brokers differ by at most one
    subscriber."""
    links = brokers * links_per_broker
    plan: list[list[list[int]]] = [[] for _ in range(brokers)]
    for j in range(links):
        plan[j % brokers].append(list(range(j, subscribers, links)))
    return plan


@dataclass
class FanoutResult:
    system: str
    count: int
    subscribers: int
    wire_msgs: int  # messages written to subscriber links in all
    seconds: float
    peer_copies: dict[str, float]  # copies per published message, per peer of server A

    @property
    def deliveries_per_s(self) -> float:
        return self.count * self.subscribers / self.seconds

    @property
    def wire_msgs_per_s(self) -> float:
        return self.wire_msgs / self.seconds


def measure_fanout(
    wire: FanoutWire,
    cluster: Cluster,
    plan: list[list[list[int]]],
    count: int,
    size: int,
    timeout: float = 120.0,
) -> FanoutResult:
    """One publisher on the cluster's first server -> the subscribers of ``plan``."""
    with contextlib.ExitStack() as stack:
        links: list[tuple[socket.socket, int, int]] = []  # socket, copies, bytes per message
        for node, node_links in zip(cluster.nodes, plan, strict=True):
            for members in node_links:
                sock = stack.enter_context(wire.open_subscribers(node.host, node.port, members))
                links.append((sock, *wire.delivered(size, len(members))))
        a = cluster.nodes[0]
        publisher = stack.enter_context(wire.open_publisher(a.host, a.port))
        wait_for_route(wire.name, publisher, wire.probe, [(s, copies) for s, copies, _ in links])
        before = _peer_msgs_out(cluster)
        batches = split_batches(count, lambda n: wire.encode_messages(n, size))
        expected = [(sock, count * per_message) for sock, _, per_message in links]
        seconds = time_delivery(wire.name, publisher, batches, expected, timeout)
        after = _peer_msgs_out(cluster)
    _meshbus_quiet(cluster)
    return FanoutResult(
        wire.name,
        count,
        sum(len(members) for node_links in plan for members in node_links),
        count * sum(copies for _, copies, _ in links),
        seconds,
        {peer: (after[peer] - before.get(peer, 0)) / count for peer in after},
    )


def _worst(copies: list[float]) -> float:
    """The figure furthest from exactly one copy."""
    return max(copies, key=lambda x: abs(x - 1.0))


@click.command()
@click.option(
    "--subscribers",
    type=click.IntRange(1, _MAX_SUBSCRIBERS),
    default=1000,
    show_default=True,
    help="Subscribers in all, spread evenly over the subscriber links.",
)
@click.option(
    "--links-per-broker",
    type=click.IntRange(1, 1000),
    default=10,
    show_default=True,
    help=f"Subscriber links on each of the {_FANOUT_BROKERS} brokers (nats-server nodes).",
)
@size_option()
@count_option(100_000, "Messages published per run.")
@runs_options
def fanout(
    subscribers: int, links_per_broker: int, size: int, count: int, runs: int, vs_nats: bool
) -> None:
    """One publisher link on broker A -> SUBSCRIBERS subscribers on 3 brokers:
    deliveries per second.

    A delivery is one published message reaching one subscriber, so deliveries/s is
    messages x subscribers / seconds, time running from the first send until every
    subscriber link has received all its bytes. meshbus subscribers are services
    joined to one multicast group, each link registering its share: the broker
    sends ONE frame per link with members (its connector fans out to its local
    members), and broker A sends one copy per peer broker. nats-server subscribers
    are one SUB each on one subject, and the server writes one MSG per
    subscription. The bench's links only count bytes, so no client work is in the
    figure of either system (for meshbus: not the connector's hand-out to its
    members). The table also shows the messages actually written to subscriber
    links per second ("wire msgs/s"), and the data messages server A sent to each
    peer per published message (meshbus: broker `stat`; nats-server: /routez).

    Last line: `meshbus_deliveries=<per s> [nats_deliveries=<per s> ratio=<r>]
    peer_copies_per_msg=<x>`, x being meshbus's copies per peer per message (the one
    furthest from 1 over all peers and runs; one copy per peer is the design).
    """
    links = _FANOUT_BROKERS * links_per_broker
    if subscribers < links:
        raise click.BadParameter(
            f"{subscribers} subscribers cannot fill {links} links "
            f"({links_per_broker} per broker on {_FANOUT_BROKERS} brokers)",
            param_hint="--subscribers",
        )
    plan = fanout_plan(subscribers, _FANOUT_BROKERS, links_per_broker)
    wires: dict[str, FanoutWire] = {"meshbus": MeshbusFanout(), "nats": NatsFanout()}
    meshbus_copies: list[float] = []

    def measure(cluster: Cluster) -> tuple[float, tuple[str, ...]]:
        result = measure_fanout(wires[cluster.kind], cluster, plan, count, size)
        if cluster.kind == "meshbus":
            meshbus_copies.extend(result.peer_copies.values())
        return result.deliveries_per_s, (
            f"{result.deliveries_per_s:,.0f}",
            f"{result.wire_msgs_per_s:,.0f}",
            f"{result.seconds:.3f}",
            " ".join(f"{c:.3f}" for c in sorted(result.peer_copies.values())),
        )

    # Room for the subscriber links, the publisher and the bench's `stat` links.
    max_connectors = str(max(50, links_per_broker + 10))
    medians = alternate(
        _clusters(_FANOUT_BROKERS, vs_nats, "--max-connectors", max_connectors),
        runs,
        f"fanout: {count:,} x {size} B to {subscribers:,} subscribers on {links} links "
        f"({_FANOUT_BROKERS} servers); delivery = 1 message at 1 subscriber",
        ("deliveries/s", "wire msgs/s", "seconds", "copies/peer/msg"),
        measure,
    )
    line = last_line(medians, "_deliveries", 0)
    click.echo(f"{line} peer_copies_per_msg={_worst(meshbus_copies):.3f}")
