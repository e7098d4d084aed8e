"""The connector: one process's single link to the mesh, shared by all its services.

The connector fans group messages out to its local members (the broker sends
one copy per link): every member of a multicast group gets one copy, one random
member of an anycast group gets it, and the sender is skipped unless it asked
for ``echo``. That and the rest of what arrives from the broker is handled in
meshbus.client.inbound; reliable sends and message groups in
meshbus.client.reliable.

Failover, redirects, moves and keepalive -- keeping the connector linked to
one broker of the mesh -- are in meshbus.client.keeper.

Backpressure: each service's inbox holds at most ``max_inbox`` messages. When
one fills, the connector stops handing out frames and reading from its links
until it drains to half, so a slow service slows its sender through TCP rather
than growing memory without bound. The broker closes a link that falls more
than its ``max_pending_bytes`` behind (a slow consumer, as in NATS).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from meshbus.address import Address
from meshbus.client.inbound import Undeliverable
from meshbus.client.keeper import LinkKeeper
from meshbus.client.link import BrokerLink
from meshbus.client.reliable import Reliable, ReliableConfig
from meshbus.client.service import BROADCAST, Message, Service
from meshbus.client.streams import Streams
from meshbus.errors import (
    AddressInUse,
    AlreadyConnected,
    ConnectionLost,
    DeliveryFailed,
    InvalidArgument,
    MeshbusError,
    NoRoute,
    NotConnected,
    ProtocolError,
    RegistrationError,
    RemoteProtocolError,
    StreamError,
    Timeout,
)
from meshbus.protocol.codec import ControlFrame, describe, encode_control, encode_data
from meshbus.protocol.control import (
    AddressBody,
    Body,
    Bye,
    Drain,
    Empty,
    Error,
    Register,
    StatRequest,
    Stats,
)
from meshbus.protocol.layout import (
    FATAL_ERRORS,
    ControlType,
    DataFlags,
    ErrorCode,
)

log = logging.getLogger("meshbus.client")

T = TypeVar("T")

# How long after a request's deadline the client gives up on the broker's TIMEOUT frame.
_LOCAL_TIMEOUT_GRACE = 1.0


class Connector:
    """One link to one broker of the mesh, carrying every service of the process.

    Use as ``async with await meshbus.connect(...) as conn:``; ``close()`` ends it.
    """

    def __init__(
        self,
        server: str,
        name: str,
        max_frame: int,
        max_inbox: int,
        brokers: list[str],
        failover_timeout: float,
        keepalive: float,
        operator: bool = False,
        reliable: ReliableConfig | None = None,
        request_timeout: float = 30.0,
    ) -> None:
        self.server = server
        self._request_timeout = request_timeout
        self.operator = operator
        self.name = name
        self.max_frame = max_frame
        self.max_inbox = max_inbox
        self.session = os.urandom(16)  # the same across failover and moves
        self.dropped = 0
        self._keeper = LinkKeeper(self, brokers, failover_timeout, keepalive)
        self._next_correlation = 1
        self._next_msg_id = 1
        # The broker asks for one send in this many to be traced (its telemetry).
        self._trace_every = self._trace_left = 0
        self._control_waiters: dict[int, tuple[asyncio.Future[ControlFrame], BrokerLink]] = {}
        # SYNCED after the answer to a change: the change is known mesh-wide.
        self._synced_waiters: dict[int, tuple[asyncio.Future[ControlFrame], BrokerLink]] = {}
        self._requests: dict[tuple[bytes, int], tuple[asyncio.Future[Message], BrokerLink]] = {}
        self._services: dict[bytes, Service] = {}
        self._members: dict[bytes, list[Service]] = {}
        self._full_inboxes: set[Service] = set()
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._lost: MeshbusError | None = None
        self._rng = random.Random()
        self._undeliverable_handlers: list[Callable[[Undeliverable], None]] = []
        self._left_handlers: list[Callable[[list[str]], None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._broadcast_member: Service | None = None
        self._reliable = Reliable(self, reliable or ReliableConfig())
        self.streams = Streams(self)
        """Durable streams: ``conn.streams.add``, ``.info``, ``.fetch``, ``.consumer``."""

    async def __aenter__(self) -> Connector:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<Connector {self.server} to {self.broker_name or '?'}>"

    @property
    def services(self) -> list[Service]:
        return list(self._services.values())

    @property
    def brokers(self) -> list[str]:
        """The brokers this connector may fail over to (kept current by the mesh)."""
        return list(self._keeper.brokers)

    @property
    def broker_name(self) -> str:
        """The name of the broker the connector is linked to (the last one while failing over)."""
        link = self._keeper.link
        return link.broker_name if link is not None else ""

    @property
    def broker_address(self) -> str:
        """The address of the broker the connector is linked to ("" while failing over)."""
        link = self._keeper.link
        return link.address if link is not None and self._keeper.connected.is_set() else ""

    @property
    def failovers(self) -> int:
        """Times the connector reconnected to another broker after losing its own."""
        return self._keeper.failovers

    @property
    def moves(self) -> int:
        """Times it moved to another broker because its broker asked (rebalance, drain)."""
        return self._keeper.moves

    # -- public API ----------------------------------------------------------

    async def register(self, instance: int | None = None) -> Service:
        """Register a service: ``instance`` 1..65535 for a fixed, well-known address
        (``AddressInUse`` if taken anywhere in the mesh), or None for a dynamic address."""
        if instance is not None and not 1 <= instance <= 65535:
            raise InvalidArgument(
                f"fixed instance ids are 1..65535, got {instance}; omit it for a dynamic id"
            )
        subject = f"{self.server}:{instance}" if instance else ""
        if instance and Address.parse(subject).to_bytes() in self._services:
            raise AlreadyConnected(
                f"address {subject} is already registered by this connector", subject
            )

        def registered(frame: ControlFrame) -> Service:
            assert isinstance(frame.body, AddressBody)
            service = Service(self, Address.from_bytes(frame.body.address), self.max_inbox)
            self._services[frame.body.address] = service
            return service

        service = await self._change(
            ControlType.REGISTER,
            Register(server=self.server, instance=instance or 0),
            registered,
            subject,
        )
        await self._reach_broadcasts()
        return service

    async def _reach_broadcasts(self) -> None:
        """One service of the connector is a member of the broadcast group, so the mesh
        sends the connector one copy of each broadcast, which it hands to every service."""
        if self._broadcast_member is not None or not self._services:
            return
        member = self._broadcast_member = next(iter(self._services.values()))
        try:
            await member.join(Address.from_bytes(BROADCAST))
        except MeshbusError:
            self._broadcast_member = None
            raise

    async def _change(
        self,
        type_: ControlType,
        body: Body,
        apply: Callable[[ControlFrame], T],
        subject: str = "",
    ) -> T:
        """A register, unregister, join or leave, and ``apply`` to its answer: never
        interleaved with copying the services to a new broker (failover, move).

        It returns once the broker says every broker of the mesh knows the change
        (SYNCED), so a message sent through any broker afterwards sees it. One whose
        broker dies before it answers is made again on the new broker: each of them is
        safe to repeat there (a service the old broker registered but never confirmed
        is not in ``services``, so the copy did not bring it along)."""
        keeper = self._keeper
        while True:
            link = await keeper.usable()
            synced: asyncio.Future[ControlFrame] = asyncio.get_running_loop().create_future()
            try:
                async with keeper.gate.change():
                    # A failover may have begun while we waited: wait it out.
                    if keeper.link is link and keeper.connected.is_set():
                        result = apply(
                            await self._control(type_, body, subject, link=link, synced=synced)
                        )
                        try:
                            await synced
                        except ConnectionLost:
                            pass  # done here; the failover copies it to the next broker
                        return result
            except ConnectionLost:
                if self._closed:
                    raise
            finally:
                synced.cancel()

    async def stat(self, *, detail: bool = True) -> dict[str, Any]:
        """The broker's view: itself, its links, the mesh, services, groups and counters.

        ``detail=False`` leaves out the per-service and per-group lists."""
        frame = await self._control(ControlType.STAT, StatRequest(detail=detail))
        assert isinstance(frame.body, Stats)
        return frame.body.data

    async def ping(self) -> None:
        """A round trip to the broker. Frames sent before it have been routed when it returns,
        since the broker handles a link's frames in order."""
        await self._control(ControlType.PING, Empty())

    async def drain_broker(self, grace: float = 0.0) -> None:
        """Ask the broker this connector is linked to to drain: it moves its connectors
        (this one too) to other brokers and exits. ``grace`` 0 uses the broker's own."""
        if not grace >= 0:
            raise InvalidArgument(f"grace must be 0 or more seconds, got {grace}")
        await self._control(ControlType.DRAIN, Drain(grace=grace))

    def on_undeliverable(self, handler: Callable[[Undeliverable], None]) -> None:
        """Call ``handler`` for each ``send(..., notify=True)`` the broker could not deliver.

        Without a handler such reports are logged as warnings. ``Undeliverable.msg_id``
        is the value ``send`` returned."""
        self._undeliverable_handlers.append(handler)

    def on_delivery_failed(self, handler: Callable[[DeliveryFailed], None]) -> None:
        """Call ``handler`` for each reliable send (``send(..., reliable=True)``) given up
        after every attempt; ``send_reliable`` raises the same ``DeliveryFailed`` instead."""
        self._reliable.failed_handlers.append(handler)

    def on_suspected_dead(self, handler: Callable[[str], None]) -> None:
        """Call ``handler`` with an address once reliable sends to it have failed
        ``ReliableConfig.suspicion`` times in a row; any message from it clears that."""
        self._reliable.dead_handlers.append(handler)

    async def on_service_left(self, handler: Callable[[list[str]], None]) -> None:
        """Call ``handler`` with the addresses of services that left the mesh: unregistered,
        or their connector died without a goodbye (a failover leaves and comes back)."""
        if not self._left_handlers:
            await self._control(ControlType.WATCH, Empty())
        self._left_handlers.append(handler)

    @property
    def unacked(self) -> int:
        """Reliable messages sent and not acknowledged yet."""
        return len(self._reliable._pending)

    async def wait_acked(self, timeout: float | None = None) -> None:
        """Wait until every reliable message sent so far is acknowledged or given up;
        ``meshbus.Timeout`` if that takes longer than ``timeout`` seconds."""
        if timeout is not None and not timeout >= 0:
            raise InvalidArgument(f"timeout must be 0 or more seconds, got {timeout}")
        try:
            async with asyncio.timeout(timeout):
                await self._reliable.idle()
        except TimeoutError:
            raise Timeout(
                f"{self.unacked} reliable messages were not acknowledged within {timeout} s",
                timeout,
            ) from None

    async def close(self) -> None:
        """Say goodbye and close the link. Pending requests fail with ``NotConnected``."""
        if self._closed:
            return
        links = self._keeper.links()
        for link in links:
            if link.transport is not None and not link.transport.is_closing():
                link.write(encode_control(ControlType.BYE, Bye(reason="connector closed")))
        self._shutdown(NotConnected("the connector was closed"))
        for link in links:
            link.close()
        self._keeper.cancel()

    # -- links ---------------------------------------------------------------------

    def _link_lost(self, link: BrokerLink, lost: ConnectionLost) -> None:
        self._fail_in_flight(lost, link)
        if not self._closed and not self._keeper.lost(link, lost):
            self._shutdown(self._lost or lost)

    # -- used by Service -------------------------------------------------------

    def _check_usable(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed or self._keeper.link is None:
            raise NotConnected("the connector is closed")

    async def _send_data(
        self, src: bytes, dst: bytes, payload: bytes, flags: int, *, response_for: int = 0
    ) -> int:
        msg_id = self._new_msg_id()
        await self._write_data(dst, src, payload, flags, msg_id, response_for)
        return msg_id

    def _trace_this(self) -> bool:
        """Whether the next plain send is one the broker asked to trace."""
        self._trace_left -= 1
        if self._trace_left > 0:
            return False
        self._trace_left = self._trace_every
        return True

    def _new_msg_id(self) -> int:
        msg_id = self._next_msg_id
        self._next_msg_id += 1
        return msg_id

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send_control(self, type_: ControlType, body: Body) -> None:
        """A control frame whose answer nobody waits for."""
        link = self._keeper.link
        if link is not None and not link.closed and self._keeper.connected.is_set():
            link.write(encode_control(type_, body))

    async def _write_data(
        self,
        dst: bytes,
        src: bytes,
        payload: bytes,
        flags: int,
        msg_id: int,
        response_for: int = 0,
    ) -> None:
        keeper = self._keeper
        link = keeper.link
        if link is None or not keeper.connected.is_set() or self._closed:
            link = await keeper.usable()
        frame = encode_data(
            dst,
            src,
            payload,
            msg_id=msg_id,
            response_for=response_for,
            flags=flags,
            max_frame=self.max_frame,
        )
        link.write(frame)
        if link.write_paused:
            await self._drain()

    async def _request(self, src: bytes, dst: Address, payload: bytes, timeout_ms: int) -> Message:
        link = await self._keeper.usable()
        msg_id = self._new_msg_id()
        frame = encode_data(
            dst.to_bytes(),
            src,
            payload,
            msg_id=msg_id,
            flags=int(DataFlags.REQUEST),
            timeout_ms=timeout_ms,
            max_frame=self.max_frame,
        )
        key = (src, msg_id)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._requests[key] = (future, link)
        link.write(frame)
        timeout = timeout_ms / 1000
        try:
            # The broker sends TIMEOUT at the deadline; the local guard covers a broker
            # that died or stalled, so a request can never hang.
            return await asyncio.wait_for(future, timeout + _LOCAL_TIMEOUT_GRACE)
        except Timeout as exc:  # the broker's TIMEOUT (before the local guard: it is one too)
            exc.timeout = timeout
            raise
        except TimeoutError:
            raise Timeout(f"no response from {dst} within {timeout} s", timeout) from None
        finally:
            self._requests.pop(key, None)

    async def _control(
        self,
        type_: ControlType,
        body: Body,
        subject: str = "",
        *,
        link: BrokerLink | None = None,
        synced: asyncio.Future[ControlFrame] | None = None,
    ) -> ControlFrame:
        """Send a control request and wait for its answer; ERROR answers become exceptions.

        Without ``link`` it goes to the current broker (waiting out a failover). With
        ``synced``, that future gets the SYNCED frame that follows a change's answer."""
        if link is None:
            link = await self._keeper.usable()
        correlation = self._next_correlation
        self._next_correlation = correlation % 0xFFFFFFFF + 1
        future: asyncio.Future[ControlFrame] = asyncio.get_running_loop().create_future()
        self._control_waiters[correlation] = (future, link)
        if synced is not None:
            self._synced_waiters[correlation] = (synced, link)
            synced.add_done_callback(lambda _: self._synced_waiters.pop(correlation, None))
        if link.closed:
            future.set_exception(ConnectionLost(f"the link to {link.address} is closed"))
        else:
            link.write(encode_control(type_, body, correlation))
        limit = self._request_timeout
        try:
            # A dead broker is the keepalive's to find; this is for one that is alive
            # and does not answer (a relay that went wrong, a bug): never wait forever.
            async with asyncio.timeout(limit or None):
                answer = await future
        except TimeoutError:
            raise Timeout(
                f"broker {link.address} did not answer {describe(type_)}"
                + (f" for {subject}" if subject else "")
                + f" within {limit} s (connect(request_timeout=...))",
                limit,
            ) from None
        finally:
            self._control_waiters.pop(correlation, None)
        if answer.type == ControlType.ERROR:
            if synced is not None:
                synced.cancel()  # no change, so no SYNCED
            assert isinstance(answer.body, Error)
            raise _error_from(answer.body, type_, subject)
        return answer

    async def _drain(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(future)
        await future

    def _resume_writing(self) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    def _joined(self, service: Service, group: Address) -> None:
        members = self._members.setdefault(group.to_bytes(), [])
        if service not in members:
            members.append(service)

    def _left(self, service: Service, group: Address) -> None:
        members = self._members.get(group.to_bytes())
        if members and service in members:
            members.remove(service)
            if not members:
                del self._members[group.to_bytes()]

    def _forget(self, service: Service) -> None:
        for group in list(service._groups):
            self._left(service, group)
        self._services.pop(service._raw, None)
        self._inbox_drained(service)
        service._close()
        if service is self._broadcast_member and not self._closed:
            self._broadcast_member = None
            self._spawn(self._rejoin_broadcasts(), "broadcast-member")

    async def _rejoin_broadcasts(self) -> None:
        try:
            await self._reach_broadcasts()
        except MeshbusError as exc:  # that service went too; the next register tries again
            log.debug("no broadcast member", extra={"error": str(exc)})

    def _inbox_full(self, service: Service) -> None:
        self._full_inboxes.add(service)
        for link in self._keeper.links():
            link.pause_reading()

    def _inbox_drained(self, service: Service) -> None:
        if service in self._full_inboxes:
            self._full_inboxes.discard(service)
            if not self._full_inboxes:
                for link in self._keeper.links():
                    link.resume_reading()
                    link.dispatch()

    # -- incoming frames -----------------------------------------------------------

    def _protocol_error(self, link: BrokerLink, exc: ProtocolError) -> None:
        log.warning("broker broke the protocol", extra={"error": str(exc)})
        link.error = f"the broker sent an invalid frame: {exc}"
        link.abort()

    # -- ending ---------------------------------------------------------------------

    def _fail_in_flight(self, error: MeshbusError, link: BrokerLink | None = None) -> None:
        """Fail what waits for an answer (a control answer, a SYNCED, a response) that
        can only come over ``link``; over any link when it is None."""
        waiting: list[tuple[asyncio.Future[Any], BrokerLink]] = [
            *self._control_waiters.values(),
            *self._synced_waiters.values(),
            *self._requests.values(),
        ]
        for future, via in waiting:
            if (link is None or via is link) and not future.done():
                future.set_exception(error)

    def _shutdown(self, error: MeshbusError) -> None:
        self._closed = True
        if isinstance(error, ConnectionLost):
            self._lost = error
        self._keeper.connected.set()  # wake senders waiting out a failover: they raise now
        self._fail_in_flight(error)
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._drain_waiters.clear()
        self._reliable.shutdown(error)
        for task in self._tasks:
            task.cancel()
        for service in self._services.values():
            service._close()

    def _abort(self) -> None:
        self._closed = True
        for link in self._keeper.links():
            link.abort()
        self._keeper.cancel()


def _error_from(body: Error, request: ControlType, subject: str) -> MeshbusError:
    code = body.code
    if code == ErrorCode.ADDRESS_IN_USE:
        return AddressInUse(body.message, subject, code)
    if code in FATAL_ERRORS:
        return RemoteProtocolError(code, body.message)
    if request == ControlType.STREAM:
        return StreamError(body.message, code)
    if request == ControlType.GROUP_BIND and code == ErrorCode.UNAVAILABLE:
        return NoRoute(body.message)
    return RegistrationError(f"{request.name.lower()} refused: {body.message}", code)
