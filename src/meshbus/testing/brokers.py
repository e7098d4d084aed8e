"""In-process brokers on the fake network, and a forwarder without a broker."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.dispatch import ControlDispatch
from meshbus.broker.core.endpoint import CloseReason, Endpoint, PeerInfo, is_peer
from meshbus.broker.core.forward import Forwarder
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox, TrafficStats
from meshbus.broker.core.pending import PendingTable
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.security.users import UserTable
from meshbus.broker.server import Broker
from meshbus.protocol.codec import (
    ControlFrame,
    Frame,
)
from meshbus.protocol.layout import DEFAULT_MAX_FRAME
from meshbus.testing.network import FakeNetwork, FakeTransport, attach, feed
from meshbus.testing.raw import FakeClient, decode_all, describe_frame
from meshbus.testing.sim import FakeClock


def address_of(name: str) -> str:
    """The address the fake network gives the broker named ``name``."""
    return f"{name}:1"


async def start_broker(
    network: FakeNetwork,
    name: str,
    *,
    seeds: Sequence[str] = (),
    reread_users: Callable[[], UserTable] | None = None,
    **settings: Any,
) -> Broker:
    """A broker named ``name`` at ``address_of(name)``: it founds a mesh, or joins through
    ``seeds``; ``settings`` are BrokerConfig fields; ``reread_users`` is what a reload
    (``broker.sign_in.reload()``) reads. Its timers are off: call ``housekeeping`` and
    ``expire_requests`` after moving the clock."""
    address = address_of(name)
    config = BrokerConfig(seeds=list(seeds), **settings)
    # Seeded per name, so anycast picks, group bindings and redial jitter are the same
    # each run.
    broker = Broker(
        config,
        clock=network.clock,
        dialer=network.dialer_from(address),
        rng=random.Random(sum(name.encode())),
        reread_users=reread_users,
    )
    network.listen(address, broker.new_link)
    broker.named(name, address)
    await broker.run_mesh(timers=False)
    await network.settle()
    return broker


async def tick(network: FakeNetwork, brokers: Iterable[Broker], interval: float = 0.5) -> None:
    """One heartbeat interval of fake time: each broker in ``brokers`` does its
    housekeeping (its LOAD is its heartbeat), as its own timer would; the others, whose
    timers stay off, say nothing -- a paused process, or a hung one."""
    network.clock.advance(interval)
    for broker in brokers:
        broker.housekeeping()
    await network.settle()


async def build_mesh(network: FakeNetwork, count: int, **settings: Any) -> list[Broker]:
    """``count`` brokers named a, b, c, ...: the first founds the mesh, the others join
    through it one after the other. Every broker is linked to every other on return."""
    names = [chr(ord("a") + i) for i in range(count)]
    first = await start_broker(network, names[0], **settings)
    brokers = [first]
    for name in names[1:]:
        brokers.append(await start_broker(network, name, seeds=[address_of("a")], **settings))
    for broker in brokers:
        assert broker.mesh.ready
        assert sorted(broker.peers.names()) == sorted(set(names) - {broker.config.name})
    return brokers


def connect_client(network: FakeNetwork, broker: Broker | str, name: str = "raw") -> FakeClient:
    """A FakeClient linked to ``broker`` (a Broker, or the address of one)."""
    address = broker if isinstance(broker, str) else broker.config.advertise
    return FakeClient.connect(network, address, name)


async def connector(
    network: FakeNetwork, broker: Broker, name: str = "conn", **hello: Any
) -> FakeClient:
    """A FakeClient that said HELLO as a connector to ``broker``."""
    client = connect_client(network, broker, name)
    await client.hello(**hello)
    return client


def broker_side(client: FakeClient) -> Link:
    """The broker's link of ``client``'s wire."""
    assert client.wire is not None
    link = client.wire.protocols[1]
    assert isinstance(link, Link)
    return link


def routes_everywhere(brokers: Iterable[Broker], address: bytes) -> dict[str, str | None]:
    """Where each broker routes ``address``: "local", a peer's name, or None."""
    result: dict[str, str | None] = {}
    for broker in brokers:
        owner = broker.routing.owner(address)
        if owner is None:
            result[broker.config.name] = None
        else:
            result[broker.config.name] = owner.name if owner.is_peer else "local"
    return result


# -- a forwarder without a broker -----------------------------------------------------------------


class Hub:
    """A ``Forwarder`` with a real RoutingTable, PendingTable and Outbox, and links on
    capturing transports: the forwarding decisions without a Broker or a network.

    ``connector``/``peer`` make open links; ``feed`` hands a link one read; what each link
    was sent is in ``received``. Deadlines are on ``clock``."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.routing: RoutingTable[Endpoint] = RoutingTable(slot=1, is_remote=is_peer)
        self.pending: PendingTable[Endpoint] = PendingTable()
        self.stats = TrafficStats()
        self.outbox = Outbox(self.stats)
        self.traced: list[tuple[str, bytes, int, bytes]] = []
        self.forwarder = Forwarder(
            self.routing,
            self.pending,
            self.outbox,
            self.stats,
            self._deadline,
            lambda hop, src, msg_id, dst: self.traced.append((hop, src, msg_id, dst)),
            UsageTable(UserTable, self.routing),
        )
        self.dispatch = ControlDispatch(self.outbox)
        self.dispatch.handshake_to(self._no_handshake)
        self.closed: list[tuple[Link, CloseReason]] = []
        self._ids = itertools.count(1)

    def _deadline(self, timeout_ms: int) -> float:
        return self.clock() + (timeout_ms / 1000 if timeout_ms else 30.0)

    def _no_handshake(self, link: Link, frame: ControlFrame) -> None:
        raise AssertionError(f"{link!r} got {describe_frame(frame)} while handshaking")

    def link(self, max_frame: int = DEFAULT_MAX_FRAME) -> Link:
        """A new accepted link on a capturing transport, still handshaking."""
        link = Link(
            next(self._ids),
            routing=self.routing,
            forwarder=self.forwarder,
            dispatch=self.dispatch,
            outbox=self.outbox,
            on_open=lambda link: None,
            on_close=lambda link, reason: self.closed.append((link, reason)),
            max_frame=max_frame,
            max_pending_bytes=1 << 30,
        )
        attach(link)
        return link

    def connector(
        self,
        name: str = "conn",
        max_frame: int = DEFAULT_MAX_FRAME,
        session: bytes = b"",
        batched_no_route: bool = False,
    ) -> Link:
        link = self.link(max_frame)
        link.open_as_connector(
            name,
            session or name.encode().ljust(16, b"."),
            max_frame,
            False,
            batched_no_route=batched_no_route,
        )
        return link

    def peer(self, name: str, tag_out: int = 0x0A0B0C0D) -> Link:
        """A link to peer broker ``name``; its frames must carry our link id as their tag."""
        link = self.link()
        info = PeerInfo(
            listen=address_of(name),
            slot=2,
            tag_in=link.link_id,
            tag_out=tag_out.to_bytes(4, "big"),
            clock=self.clock,
            budget=1.5,
        )
        link.open_as_peer(name, info, DEFAULT_MAX_FRAME)
        return link

    def feed(self, link: Link, *frames: bytes) -> None:
        """``frames`` arrive at ``link`` in one read."""
        feed(link, b"".join(frames))

    def received(self, link: Link) -> list[Frame]:
        """What ``link`` was sent since the last call."""
        transport = link.transport
        assert isinstance(transport, FakeTransport)
        data = bytes(transport.captured)
        transport.captured.clear()
        return decode_all(data)
