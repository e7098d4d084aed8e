"""The connector: one process's single link to the mesh, shared by all its services.

``Connector`` is the public face. ``ConnectorParts`` builds its parts and wires
them -- the only place that knows them all -- handing each, in its constructor,
exactly what it uses, and keeps what belongs to the whole connector: starting it,
closing it, and the ordered end of everything when the mesh is lost. The parts:

* ``Links`` (meshbus.client.link): which link it sends on, and whether it may;
* ``Outbound`` (meshbus.client.outbound): frames that wait for no answer;
* ``Services`` / ``Mailbox`` (meshbus.client.mailboxes): the registered services,
  the inboxes, backpressure;
* ``Waiters`` (meshbus.client.waiters): what waits for the broker;
* ``Requester`` (meshbus.client.requester): requests that wait for an answer;
* ``Gate`` and ``Changes`` (meshbus.client.changes): register, join, ..., never
  while the services are copied to a new broker;
* ``Memberships`` (meshbus.client.memberships): who is in which group, the
  broadcast member;
* ``Inbound`` (meshbus.client.inbound): what the links read;
* ``Receiving``, ``Unacked``, ``Reliable`` (meshbus.client.receiving, .reliable):
  reliable sends and message groups, both sides;
* ``LinkKeeper`` (meshbus.client.failover): failover, redirects, moves and
  keepalive, every link opened by the ``Dialer`` (meshbus.client.dial);
* ``StreamClient`` (meshbus.client.streams): ``conn.streams``.

The dialer and the random source are injected, as the broker's are: tests run the
real connector against in-process brokers (meshbus.testing.connect_over).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from typing import Any, Unpack

import msgspec

from meshbus.address import Address, Unicast
from meshbus.auth import Credentials
from meshbus.client.addressing import AddressLike
from meshbus.client.changes import Changes, Gate
from meshbus.client.dial import Dialer
from meshbus.client.failover import Identity, LinkKeeper
from meshbus.client.inbound import Inbound, Undeliverable
from meshbus.client.link import Links
from meshbus.client.mailboxes import Mailbox, Services
from meshbus.client.memberships import Memberships
from meshbus.client.message import Message
from meshbus.client.options import PublishOptions, RequestOptions, SendOptions
from meshbus.client.outbound import Outbound, TraceSampler
from meshbus.client.receiving import Receiving
from meshbus.client.reliable import Reliable, ReliableConfig, Unacked
from meshbus.client.requester import Requester
from meshbus.client.service import Service, ServiceParts
from meshbus.client.streams import StreamClient
from meshbus.client.waiters import Waiters
from meshbus.errors import (
    AlreadyConnected,
    ConnectionLost,
    DeliveryFailed,
    InvalidArgument,
    MeshbusError,
    NotConnected,
    ProtocolError,
    Timeout,
)
from meshbus.protocol.codec import BytesLike, encode_control
from meshbus.protocol.control import (
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    AddressBody,
    Bye,
    Drain,
    Empty,
    Register,
    StatRequest,
    Stats,
)
from meshbus.protocol.layout import ControlType
from meshbus.util import BackgroundTasks

# How long close() waits for a TLS link's goodbye before it drops the socket.
_CLOSE_GRACE = 1.0


class ConnectorParts:
    """Every part of one connector, built and wired here; and what belongs to the whole.

    ``dialer`` opens every link (meshbus.client.dial); ``rng`` makes every random choice
    of the connector (the brokers it tries, the pauses between tries, the member of an
    anycast group here that gets a message)."""

    def __init__(
        self,
        *,
        server: str,
        name: str,
        brokers: list[str],
        max_frame: int,
        max_inbox: int,
        failover_timeout: float,
        keepalive: float,
        operator: bool,
        reliable: ReliableConfig,
        request_timeout: float,
        credentials: Credentials | None,
        dialer: Dialer,
        rng: random.Random,
    ) -> None:
        self.server = server
        self.name = name
        self.operator = operator
        self.max_inbox = max_inbox
        self.session = os.urandom(16)  # the same across failover and moves
        self.tasks = tasks = BackgroundTasks()
        self.links = links = Links(max_frame)
        gate = Gate()
        self.sampler = sampler = TraceSampler()
        self.outbound = outbound = Outbound(links)
        self.services = services = Services(links)
        self.waiters = waiters = Waiters()
        self.requester = requester = Requester(links, outbound, waiters, request_timeout, rng)
        self.changes = changes = Changes(links, gate, requester)
        self.memberships = memberships = Memberships(services, changes, links, tasks)
        self.receiving = Receiving(reliable, outbound)
        self.unacked = unacked = Unacked(reliable, outbound)
        self.inbound = inbound = Inbound(
            services, memberships, waiters, self.receiving, unacked, outbound, tasks, rng
        )
        self.reliable = Reliable(
            reliable, unacked=unacked, requester=requester, outbound=outbound, tasks=tasks
        )
        self.streams = StreamClient(requester)
        self.service_parts = ServiceParts(
            links=links,
            services=services,
            outbound=outbound,
            sampler=sampler,
            requester=requester,
            reliable=self.reliable,
            changes=changes,
            memberships=memberships,
            streams=self.streams,
            tasks=tasks,
        )
        self.keeper = LinkKeeper(
            identity=Identity(
                name=name,
                role=ROLE_OPERATOR if operator else ROLE_CONNECTOR,
                session=self.session,
                credential=credentials,
            ),
            brokers=brokers,
            dialer=dialer,
            rng=rng,
            failover_timeout=failover_timeout,
            keepalive=keepalive,
            request_timeout=request_timeout,
            links=links,
            gate=gate,
            inbound=inbound,
            waiters=waiters,
            requester=requester,
            services=services,
            memberships=memberships,
            outbound=outbound,
            sampler=sampler,
            tasks=tasks,
            resend_all=self.reliable.resend_all,
            shutdown=self.shutdown,
        )

    async def start(self, timeout: float) -> None:
        """Link to the first broker that takes the connector; ConnectionLost if none does
        within ``timeout`` seconds."""
        brokers = list(self.keeper.brokers)
        try:
            async with asyncio.timeout(timeout):
                await self.keeper.start()
        except TimeoutError:
            self.abort()
            raise ConnectionLost(
                f"could not connect to broker {', '.join(brokers)} within {timeout} s"
            ) from None
        except BaseException:
            self.abort()
            raise
        self.tasks.spawn(self._close_when_cancelled(), "close when cancelled")

    async def _close_when_cancelled(self) -> None:
        """Wait, as long as the connector lives, to be cancelled by anyone but the end.

        A program whose main coroutine returns without ``close()`` has ``asyncio.run``
        cancel every task once and wait for them. A link lost during that pass would
        start a failover after it -- a task nothing cancels, destroyed pending when the
        loop closes. This task is one of those cancelled: it closes the connector (so
        nothing starts anew) and waits for the connector's tasks, all within the pass."""
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if not self.links.closed:
                await self.close_and_wait()
                await self.tasks.cancel()
            raise

    def shutdown(self, error: MeshbusError) -> None:
        """The end: closed (by the user) or lost (the mesh). Everything that waits gets
        ``error``, in order: the link state first, so nothing starts anew meanwhile."""
        self.links.end(error if isinstance(error, ConnectionLost) else None)
        self.waiters.fail(error)
        self.outbound.fail(error)
        self.reliable.stop()
        self.unacked.shutdown(error)
        self.tasks.cancel_now()
        self.services.close_all()

    def close(self) -> None:
        """Say goodbye on every link, end, and close the links."""
        if self.links.closed:
            return
        links = self.links.all()
        for link in links:
            if link.writable:
                link.write(encode_control(ControlType.BYE, Bye(reason="connector closed")))
        self.shutdown(NotConnected("the connector was closed"))
        for link in links:
            link.close()

    async def close_and_wait(self) -> None:
        """``close``, and return once every link's socket is closed (a TLS link's within
        ``_CLOSE_GRACE``)."""
        links = self.links.all()
        self.close()
        await asyncio.gather(*(link.gone(_CLOSE_GRACE) for link in links))

    def abort(self) -> None:
        """Drop every link at once, no goodbye (a connect that failed)."""
        self.links.end(None)
        for link in self.links.all():
            link.abort()
        self.tasks.cancel_now()


class Connector:
    """One link to one broker of the mesh, carrying every service of the process.

    Use as ``async with await meshbus.connect(...) as conn:``; ``close()`` ends it.
    """

    def __init__(self, parts: ConnectorParts) -> None:
        """A started connector (``meshbus.connect`` makes them)."""
        self._parts = parts
        # The dynamic service ``send``, ``publish`` and ``request`` go out from, registered
        # by the first of them; and what came to its address (nobody reads it).
        self._own: Service | None = None
        self._own_lock = asyncio.Lock()
        self._dropped_at_own = 0
        self.server = parts.server
        """The server name of its services' addresses (``SERVER:INSTANCE``)."""
        self.name = parts.name
        """Its name as the broker shows it (``meshbus stat``)."""
        self.operator = parts.operator
        """It links as an operator (``meshbus.connect(..., operator=True)``)."""
        self.max_inbox = parts.max_inbox
        """Messages a service's inbox holds before the link pauses."""
        self.session = parts.session
        """Its session id: the same across failovers and moves."""
        self.streams = parts.streams
        """Durable streams: ``conn.streams.add``, ``.info``, ``.fetch``, ``.consumer``."""

    async def __aenter__(self) -> Connector:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<Connector {self.server} to {self.broker_name or '?'}>"

    @property
    def services(self) -> list[Service]:
        """Its registered services (with the one ``send`` goes out from, once used)."""
        # Each mailbox belongs to the Service that made it (meshbus.client.mailboxes).
        return [
            service
            for mailbox in self._parts.services.all()
            if isinstance(service := mailbox.service, Service)
        ]

    @property
    def max_frame(self) -> int:
        """The largest frame it sends: its own limit, or a broker's if that was smaller."""
        return self._parts.links.max_frame

    @property
    def dropped(self) -> int:
        """Messages that arrived for no service here (or a response nobody waited for),
        and those sent to the address ``send``, ``publish`` and ``request`` go out from."""
        return self._parts.inbound.dropped + self._dropped_at_own

    @property
    def refused_acks(self) -> int:
        """Acknowledgements ignored because the message they name was not sent to their
        source (docs/guarantees.md, "Who may acknowledge")."""
        return self._parts.unacked.refused_acks

    @property
    def brokers(self) -> list[str]:
        """The brokers this connector may fail over to (kept current by the mesh)."""
        return list(self._parts.keeper.brokers)

    @property
    def broker_name(self) -> str:
        """The name of the broker the connector is linked to (the last one while failing over)."""
        link = self._parts.links.current
        return link.broker_name if link is not None else ""

    @property
    def broker_address(self) -> str:
        """The address of the broker the connector is linked to ("" while failing over)."""
        links = self._parts.links
        link = links.current
        return link.address if link is not None and links.connected.is_set() else ""

    @property
    def failovers(self) -> int:
        """Times the connector reconnected after losing its broker (to another, or the same)."""
        return self._parts.keeper.failovers

    @property
    def moves(self) -> int:
        """Times it moved to another broker because its broker asked (rebalance, drain)."""
        return self._parts.keeper.moves

    # -- public API ----------------------------------------------------------

    async def register(self, instance: int | None = None) -> Service:
        """Register a service: ``instance`` 1..65535 for a fixed, well-known address
        (``AddressInUse`` if taken anywhere in the mesh), or None for a dynamic address."""
        if instance is not None and not 1 <= instance <= 65535:
            raise InvalidArgument(
                f"fixed instance ids are 1..65535, got {instance}; omit it for a dynamic id"
            )
        parts = self._parts
        subject = f"{self.server}:{instance}" if instance else ""
        if instance and Unicast(self.server, instance).to_bytes() in parts.services:
            raise AlreadyConnected(
                f"address {subject} is already registered by this connector", subject
            )

        def registered(answer: AddressBody) -> Service:
            address = Address.from_bytes(answer.address)
            if not isinstance(address, Unicast):
                raise ProtocolError(f"the broker registered {address}, not a unicast address")
            return Service(address, self.max_inbox, parts.service_parts)

        service = await parts.changes.change(
            ControlType.REGISTER,
            Register(server=self.server, instance=instance or 0),
            AddressBody,
            registered,
            subject,
        )
        await parts.memberships.reach_broadcasts()
        return service

    # -- sending without a service of one's own ------------------------------------------

    async def send(
        self, dst: AddressLike, payload: BytesLike | None = None, **options: Unpack[SendOptions]
    ) -> int:
        """``Service.send``, from this connector's own dynamic address: a process that only
        sends needs no service, as a NATS client publishes without subscribing. The
        address is registered by the first ``send``, ``publish`` or ``request`` and kept
        across failovers; what is sent to it is dropped (counted in ``dropped``) -- to be
        addressed, to receive or to serve requests, ``register`` a service."""
        return await (await self._sender()).send(dst, payload, **options)

    async def publish(
        self, subject: str, payload: BytesLike | None = None, **options: Unpack[PublishOptions]
    ) -> int:
        """``Service.publish`` from this connector's own address (see ``send``)."""
        return await (await self._sender()).publish(subject, payload, **options)

    async def request(
        self, dst: AddressLike, payload: BytesLike | None = None, **options: Unpack[RequestOptions]
    ) -> Message:
        """``Service.request`` from this connector's own address (see ``send``); the
        response comes back to it."""
        return await (await self._sender()).request(dst, payload, **options)

    async def _sender(self) -> Service:
        own = self._own
        if own is not None and not own.closed:
            return own
        async with self._own_lock:  # concurrent first sends register one address
            own = self._own
            if own is None or own.closed:
                own = self._own = await self.register()
                own.add_listener(self._to_own_address)
            return own

    def _to_own_address(self, msg: Message) -> None:
        self._dropped_at_own += 1

    async def stat(self, *, detail: bool = True) -> dict[str, Any]:
        """The broker's view: itself, its links, the mesh, services, groups and counters.

        ``detail=False`` leaves out the per-service and per-group lists. An answer larger
        than a frame comes in pages, asked for one by one; the lists come unsorted (the
        broker does not spend its loop on that) and are sorted here."""
        ask = self._parts.requester.ask
        answer = await ask(ControlType.STAT, StatRequest(detail=detail), Stats)
        data = answer.data
        if answer.pages > 1:
            blobs = [answer.blob]
            for page in range(1, answer.pages):
                more = await ask(ControlType.STAT, StatRequest(detail=detail, page=page), Stats)
                blobs.append(more.blob)
            data = msgspec.msgpack.decode(b"".join(blobs))
        if detail:
            for link in data.get("links", []):
                link["services"] = sorted(link["services"])
            data["service_addresses"] = sorted(data.get("service_addresses", []))
            data["groups"] = {g: sorted(m) for g, m in data.get("groups", {}).items()}
        return data

    async def ping(self) -> None:
        """A round trip to the broker. Frames sent before it have been routed when it returns,
        since the broker handles a link's frames in order."""
        await self._parts.requester.ask(ControlType.PING, Empty(), Empty)

    async def flush(self) -> None:
        """Wait until a send would go out without waiting (``Service.flush``: the link's
        write buffer under its low-water mark, the connector linked). Not a round trip:
        that is ``ping``."""
        await self._parts.outbound.writable()

    async def drain_broker(self, grace: float = 0.0) -> None:
        """Ask the broker this connector is linked to to drain: it moves its connectors
        (this one too) to other brokers and exits. ``grace`` 0 uses the broker's own."""
        if not grace >= 0:
            raise InvalidArgument(f"grace must be 0 or more seconds, got {grace}")
        await self._parts.requester.ask(ControlType.DRAIN, Drain(grace=grace), Empty)

    # Every on_... returns the function that removes the handler (meshbus.client.callbacks).

    def on_undeliverable(self, handler: Callable[[Undeliverable], object]) -> Callable[[], None]:
        """Call ``handler`` for each ``send(..., notify=True)`` the broker could not deliver;
        returns a function that removes it again.

        Without a handler such reports are logged as warnings. ``Undeliverable.msg_id``
        is the value ``send`` returned."""
        return self._parts.inbound.undeliverable.add(handler)

    def on_delivery_failed(self, handler: Callable[[DeliveryFailed], object]) -> Callable[[], None]:
        """Call ``handler`` for each reliable send (``send(..., reliable=True)``) given up
        after every attempt; returns a function that removes it again.
        ``send_reliable`` raises the same ``DeliveryFailed`` instead."""
        return self._parts.unacked.failed.add(handler)

    def on_suspected_dead(self, handler: Callable[[str], object]) -> Callable[[], None]:
        """Call ``handler`` with an address once reliable sends to it have failed
        ``ReliableConfig.suspicion`` times in a row (any message from it clears that);
        returns a function that removes it again."""
        return self._parts.unacked.dead.add(handler)

    async def on_service_left(self, handler: Callable[[list[str]], object]) -> Callable[[], None]:
        """Call ``handler`` with the addresses of services that left the mesh: unregistered,
        or their connector died without a goodbye (a failover leaves and comes back).
        Returns a function that removes it again."""
        inbound = self._parts.inbound
        if not inbound.left.handlers:
            await self._parts.requester.ask(ControlType.WATCH, Empty(), Empty)
        return inbound.left.add(handler)

    def on_slow_consumer(self, handler: Callable[[Service], object]) -> Callable[[], None]:
        """Call ``handler`` with a service whose inbox just filled up (``max_inbox``
        messages): the connector stops reading -- nothing is lost, its senders are slowed
        through TCP -- until that inbox drains to half. Each service counts these
        (``Service.inbox_fills``). Returns a function that removes the handler again."""

        def slow(mailbox: Mailbox) -> None:
            if isinstance(service := mailbox.service, Service):
                handler(service)

        return self._parts.services.slow.add(slow)

    @property
    def unacked(self) -> int:
        """Reliable messages sent and not acknowledged yet."""
        return len(self._parts.unacked)

    async def wait_acked(self, timeout: float | None = None) -> None:
        """Wait until every reliable message sent so far is acknowledged or given up;
        ``meshbus.Timeout`` if that takes longer than ``timeout`` seconds."""
        if timeout is not None and not timeout >= 0:
            raise InvalidArgument(f"timeout must be 0 or more seconds, got {timeout}")
        try:
            async with asyncio.timeout(timeout):
                await self._parts.unacked.idle()
        except TimeoutError:
            raise Timeout(
                f"{self.unacked} reliable messages were not acknowledged within {timeout} s",
                timeout,
            ) from None

    async def close(self) -> None:
        """Say goodbye and close the link. Pending requests fail with ``NotConnected``.
        It returns once the link's socket is closed (a TLS link's within a second)."""
        await self._parts.close_and_wait()
