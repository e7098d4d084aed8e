"""The connector: one process's single link to the mesh, shared by all its services.

The connector fans group messages out to its local members (the broker sends
one copy per link): every member of a multicast group gets one copy, one random
member of an anycast group gets it, and the sender is skipped unless it asked
for ``echo``.

Failover (ARCHITECTURE.md section 5). The connector knows every broker that
takes connectors: the addresses it was given, then the list the brokers push
(in WELCOME and BROKERS frames). When its broker dies, it drops that broker
from the list, picks another at random, reconnects, and registers every service
again *with the same address* and the same group memberships -- the broker sees
the connector's session id and lets it take its own addresses back. Meanwhile
sends wait (up to ``failover_timeout``); requests that were in flight through
the dead broker fail with ``ConnectionLost``, since their pending entries died
with it. A broker that refuses a connector (full, joining, draining) names one
that has room, and the connector goes there.

Moves (rebalancing after a join, or a drain): the broker sends MOVE; the
connector opens a link to the new broker, registers everything there, switches
its sends over, and only then says BYE on the old link, reading it until the old
broker closes it -- make before break.

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
import socket
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from meshbus.address import Address, Unicast, describe_address
from meshbus.client.link import BrokerLink
from meshbus.client.service import Message, Service
from meshbus.errors import (
    AddressInUse,
    ConnectionLost,
    MeshbusError,
    NoRoute,
    NotConnected,
    ProtocolError,
    RegistrationError,
    RemoteProtocolError,
    Timeout,
)
from meshbus.protocol.codec import ControlFrame, DataFrame, encode_control, encode_data
from meshbus.protocol.control import (
    AddressBody,
    Body,
    Brokers,
    Bye,
    DeliveryFailure,
    Drain,
    Empty,
    Error,
    Hello,
    Membership,
    Move,
    Register,
    StatRequest,
    Stats,
    Welcome,
)
from meshbus.protocol.layout import (
    DEFAULT_MAX_FRAME,
    FATAL_ERRORS,
    ControlType,
    DataFlags,
    ErrorCode,
)
from meshbus.util import parse_hostport

log = logging.getLogger("meshbus.client")

T = TypeVar("T")

_RESPONSE = int(DataFlags.RESPONSE)
_ECHO = int(DataFlags.ECHO)
_CAST_MULTICAST = 2
_CAST_ANYCAST = 3
# How long after a request's deadline the client gives up on the broker's TIMEOUT frame.
_LOCAL_TIMEOUT_GRACE = 1.0
# Brokers that refuse us in a row while naming another one before we give up on that chain.
_MAX_REDIRECTS = 8
# Pause between rounds over the broker list while failing over.
_RETRY_PAUSE = 0.05


def broker_list(brokers: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list of ``HOST:PORT``; ValueError names a bad entry."""
    items = brokers.split(",") if isinstance(brokers, str) else list(brokers)
    addresses = [item.strip() for item in items if item.strip()]
    if not addresses:
        raise ValueError("no broker address given; expected HOST:PORT[,HOST:PORT...]")
    for address in addresses:
        parse_hostport(address)
    return addresses


async def connect(
    broker: str | Sequence[str] = "127.0.0.1:7400",
    *,
    server: str | None = None,
    name: str = "",
    max_frame: int = DEFAULT_MAX_FRAME,
    max_inbox: int = 65536,
    timeout: float = 5.0,
    failover: bool = True,
    failover_timeout: float = 10.0,
    keepalive: float = 1.0,
) -> Connector:
    """Connect to the mesh through one of ``broker`` (``HOST:PORT``, several separated
    by commas, or a list) and complete the handshake.

    ``server`` is the server name of this process's unicast addresses (at most
    11 bytes); it defaults to the host name when that fits. ``timeout`` bounds
    connecting (over every address given). With ``failover`` the connector moves
    to another broker when its broker dies, for up to ``failover_timeout``
    seconds; ``keepalive`` is how long a silent link may stay silent before the
    connector pings it (three intervals without an answer count as a dead broker).
    """
    if server is None:
        server = socket.gethostname().split(".")[0]
    Unicast(server, 1)  # a bad server name fails here, before any I/O
    addresses = broker_list(broker)
    connector = Connector(
        server,
        name or server,
        max_frame,
        max_inbox,
        addresses,
        failover_timeout if failover else 0.0,
        keepalive,
    )
    try:
        async with asyncio.timeout(timeout):
            link = await connector._open_any(addresses, random_order=False)
    except TimeoutError:
        connector._abort()
        raise ConnectionLost(
            f"could not connect to broker {', '.join(addresses)} within {timeout} s"
        ) from None
    except ConnectionLost:
        connector._abort()
        raise
    connector._activate(link)
    return connector


@dataclass(frozen=True)
class Undeliverable:
    """A ``send(..., notify=True)`` the broker could not deliver (see ``on_undeliverable``)."""

    src: str
    dst: str
    msg_id: int
    reason: str


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
    ) -> None:
        self.server = server
        self.name = name
        self.max_frame = max_frame
        self.max_inbox = max_inbox
        self.failover_timeout = failover_timeout
        self.keepalive = keepalive
        self.session = os.urandom(16)
        self.broker_name = ""
        self.failovers = 0  # times the connector reconnected after losing its broker
        self.moves = 0  # times it moved when a broker asked
        self.dropped = 0
        self._brokers = list(brokers)
        self._link: BrokerLink | None = None
        self._old_links: set[BrokerLink] = set()
        self._connected = asyncio.Event()
        self._next_correlation = 1
        self._next_msg_id = 1
        self._control_waiters: dict[int, tuple[asyncio.Future[ControlFrame], BrokerLink]] = {}
        self._requests: dict[tuple[bytes, int], tuple[asyncio.Future[Message], BrokerLink]] = {}
        self._services: dict[bytes, Service] = {}
        self._members: dict[bytes, list[Service]] = {}
        self._full_inboxes: set[Service] = set()
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._lost: MeshbusError | None = None
        # Held while the set of services is copied to a new broker, so a register or
        # join cannot slip in between and be missing there.
        self._membership_lock = asyncio.Lock()
        self._rng = random.Random()
        self._undeliverable_handlers: list[Callable[[Undeliverable], None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()

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
        return list(self._brokers)

    @property
    def broker_address(self) -> str:
        """The address of the broker the connector is linked to now ("" while failing over)."""
        return self._link.address if self._link is not None and self._connected.is_set() else ""

    # -- public API ----------------------------------------------------------

    async def register(self, instance: int | None = None) -> Service:
        """Register a service: ``instance`` 1..65535 for a fixed, well-known address
        (``AddressInUse`` if taken anywhere in the mesh), or None for a dynamic address."""
        if instance is not None and not 1 <= instance <= 65535:
            raise ValueError(
                f"fixed instance ids are 1..65535, got {instance}; omit it for a dynamic id"
            )
        subject = f"{self.server}:{instance}" if instance else ""

        def registered(frame: ControlFrame) -> Service:
            assert isinstance(frame.body, AddressBody)
            service = Service(self, Address.from_bytes(frame.body.address), self.max_inbox)
            self._services[frame.body.address] = service
            return service

        return await self._change(
            ControlType.REGISTER,
            Register(server=self.server, instance=instance or 0),
            registered,
            subject,
        )

    async def _change(
        self,
        type_: ControlType,
        body: Body,
        apply: Callable[[ControlFrame], T],
        subject: str = "",
    ) -> T:
        """A register, unregister, join or leave, and ``apply`` to its answer: never
        interleaved with copying the services to a new broker (failover, move)."""
        while True:
            await self._usable_link()
            async with self._membership_lock:
                # A failover may have begun while we waited for the lock: wait it out.
                if self._connected.is_set() and self._link is not None and not self._closed:
                    return apply(await self._control(type_, body, subject, link=self._link))

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
        await self._control(ControlType.DRAIN, Drain(grace=grace))

    def on_undeliverable(self, handler: Callable[[Undeliverable], None]) -> None:
        """Call ``handler`` for each ``send(..., notify=True)`` the broker could not deliver.

        Without a handler such reports are logged as warnings. ``Undeliverable.msg_id``
        is the value ``send`` returned."""
        self._undeliverable_handlers.append(handler)

    async def close(self) -> None:
        """Say goodbye and close the link. Pending requests fail with ``NotConnected``."""
        if self._closed:
            return
        links = [link for link in (self._link, *self._old_links) if link is not None]
        for link in links:
            if link.transport is not None and not link.transport.is_closing():
                link.write(encode_control(ControlType.BYE, Bye(reason="connector closed")))
        self._shutdown(NotConnected("the connector was closed"))
        for link in links:
            link.close()
        for task in list(self._tasks):
            task.cancel()

    # -- links: open, activate, lose, fail over, move ------------------------------

    async def _open_any(self, addresses: list[str], *, random_order: bool) -> BrokerLink:
        """A handshaken link to one of ``addresses``, following redirects; ConnectionLost
        (naming every reason) if none takes us."""
        order = list(addresses)
        if random_order:
            self._rng.shuffle(order)
        reasons: list[str] = []
        for address in order:
            for _ in range(_MAX_REDIRECTS):
                try:
                    return await self._open(address)
                except _Redirected as exc:
                    reasons.append(f"{address}: {exc}")
                    if not exc.address or exc.address == address:
                        break
                    address = exc.address
                except ConnectionLost as exc:
                    reasons.append(str(exc))
                    break
        raise ConnectionLost("; ".join(reasons) or "no broker to connect to")

    async def _open(self, address: str) -> BrokerLink:
        host, port = parse_hostport(address)
        loop = asyncio.get_running_loop()
        try:
            _, link = await loop.create_connection(
                lambda: BrokerLink(self, address, self.max_frame), host, port
            )
        except OSError as exc:
            # asyncio's own message ("Connect call failed ...") hides the reason; errno has it.
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConnectionLost(
                f"could not connect to broker {address}: {why} (is a broker running there?)"
            ) from exc
        hello = Hello(name=self.name, max_frame=self.max_frame, session=self.session)
        try:
            frame = await self._control(ControlType.HELLO, hello, link=link)
        except ConnectionLost:
            # A broker that refuses us sends an ERROR (naming one with room) and closes.
            link.abort()
            if link.error_code == ErrorCode.REDIRECT:
                raise _Redirected(link.error, link.redirect) from None
            raise
        except BaseException:
            link.abort()
            raise
        assert isinstance(frame.body, Welcome)
        link.broker_name = frame.body.broker
        self.max_frame = min(self.max_frame, frame.body.max_frame)
        self._set_brokers(frame.body.brokers)
        return link

    def _activate(self, link: BrokerLink) -> None:
        self._link = link
        self.broker_name = link.broker_name
        self._connected.set()
        if self.keepalive and not any(t.get_name() == "keepalive" for t in self._tasks):
            self._spawn(self._keep_alive(), "keepalive")

    def _set_brokers(self, infos: list[Any]) -> None:
        if infos:
            self._brokers = [info.address for info in infos]

    def _link_lost(self, link: BrokerLink, exc: Exception | None) -> None:
        reason = link.error or (str(exc) if exc else "the broker closed the connection")
        lost = ConnectionLost(
            f"lost the link to broker {link.broker_name or link.address}: {reason}"
        )
        self._fail_in_flight(link, lost)
        if link in self._old_links:
            self._old_links.discard(link)  # a move finished
            return
        if self._closed or link is not self._link:
            return
        if link.address in self._brokers:
            self._brokers.remove(link.address)
        if not self.failover_timeout or not self._brokers:
            # No failover, or no other broker to go to (the seed's rule): the link is lost.
            self._shutdown(self._lost or lost)
            return
        self._connected.clear()
        log.info("broker lost, failing over", extra={"broker": link.broker_name, "reason": reason})
        self._spawn(self._fail_over(lost), "failover")

    async def _fail_over(self, lost: ConnectionLost) -> None:
        """Reconnect to another broker and bring every service back, same addresses."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.failover_timeout
        reasons = ""
        async with self._membership_lock:
            while loop.time() < deadline:
                try:
                    async with asyncio.timeout(max(0.05, deadline - loop.time())):
                        link = await self._open_any(self._brokers, random_order=True)
                        await self._restore(link)
                except (ConnectionLost, TimeoutError) as exc:
                    reasons = str(exc)
                    await asyncio.sleep(_RETRY_PAUSE)
                    continue
                self.failovers += 1
                self._activate(link)
                log.info("failed over", extra={"broker": link.broker_name})
                return
        self._shutdown(
            ConnectionLost(
                f"{lost}; no other broker took this connector within "
                f"{self.failover_timeout} s ({reasons})"
            )
        )

    async def _move(self, address: str, reason: str) -> None:
        """MOVE: link to ``address``, bring the services there, switch, then leave."""
        async with self._membership_lock:
            old = self._link
            if old is None or self._closed or not self._connected.is_set():
                return
            try:
                link = await self._open_any([address], random_order=False)
                await self._restore(link)
            except (ConnectionLost, RemoteProtocolError) as exc:
                log.warning("could not move", extra={"to": address, "error": str(exc)})
                return
            if self._closed:
                link.abort()
                return
            self.moves += 1
            self._old_links.add(old)
            self._activate(link)
            old.write(encode_control(ControlType.BYE, Bye(reason=f"moved: {reason}")))
        log.info("moved", extra={"to": link.broker_name, "reason": reason})

    async def _restore(self, link: BrokerLink) -> None:
        """Register every service on ``link`` with its own address, then its groups.

        Requests go out together and are answered in order; a service whose address
        was taken meanwhile by another session is closed (it cannot come back)."""
        services = list(self._services.values())
        answers = await asyncio.gather(
            *(
                self._control(
                    ControlType.REGISTER,
                    Register(server=s.address.server, instance=s.address.instance),
                    str(s.address),
                    link=link,
                )
                for s in services
                if isinstance(s.address, Unicast)
            ),
            return_exceptions=True,
        )
        joins: list[Coroutine[Any, Any, ControlFrame]] = []
        for service, answer in zip(services, answers, strict=True):
            if isinstance(answer, ConnectionLost):
                raise answer
            if isinstance(answer, BaseException):
                log.error(
                    "a service could not be registered again after failover",
                    extra={"address": str(service.address), "error": str(answer)},
                )
                self._forget(service)
                continue
            joins.extend(
                self._control(
                    ControlType.JOIN,
                    Membership(member=service._raw, group=group.to_bytes()),
                    link=link,
                )
                for group in service._groups
            )
        for answer in await asyncio.gather(*joins, return_exceptions=True):
            if isinstance(answer, ConnectionLost):
                raise answer

    async def _keep_alive(self) -> None:
        """Ping a silent link; three silent intervals mean the broker is gone (one that
        hangs, or a host that vanished: a killed process closes its sockets itself)."""
        loop = asyncio.get_running_loop()
        interval = self.keepalive
        while not self._closed:
            await asyncio.sleep(interval)
            link = self._link
            if link is None or link.closed or not self._connected.is_set() or self._full_inboxes:
                continue
            silent = loop.time() - link.heard_at
            if silent > 3 * interval:
                link.error = f"no answer for {silent:.1f} s"
                link.abort()
            elif silent > interval:
                link.write(encode_control(ControlType.PING, Empty()))

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- used by Service -------------------------------------------------------

    def _check_usable(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed or self._link is None:
            raise NotConnected("the connector is closed")

    async def _usable_link(self) -> BrokerLink:
        """The link to send on; waits while the connector fails over."""
        self._check_usable()
        if not self._connected.is_set():
            await self._connected.wait()
            self._check_usable()
        assert self._link is not None
        return self._link

    async def _send_data(
        self, src: bytes, dst: bytes, payload: bytes, flags: int, *, response_for: int = 0
    ) -> int:
        link = self._link
        if link is None or not self._connected.is_set() or self._closed:
            link = await self._usable_link()
        msg_id = self._next_msg_id
        self._next_msg_id += 1
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
        return msg_id

    async def _request(self, src: bytes, dst: Address, payload: bytes, timeout_ms: int) -> Message:
        link = await self._usable_link()
        msg_id = self._next_msg_id
        self._next_msg_id += 1
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
        except TimeoutError:
            raise Timeout(f"no response from {dst} within {timeout} s", timeout) from None
        except Timeout as exc:
            exc.timeout = timeout
            raise
        finally:
            self._requests.pop(key, None)

    async def _control(
        self,
        type_: ControlType,
        body: Body,
        subject: str = "",
        *,
        link: BrokerLink | None = None,
    ) -> ControlFrame:
        """Send a control request and wait for its answer; ERROR answers become exceptions.

        Without ``link`` it goes to the current broker (waiting out a failover)."""
        if link is None:
            link = await self._usable_link()
        correlation = self._next_correlation
        self._next_correlation = correlation % 0xFFFFFFFF + 1
        future: asyncio.Future[ControlFrame] = asyncio.get_running_loop().create_future()
        self._control_waiters[correlation] = (future, link)
        if link.closed:
            future.set_exception(ConnectionLost(f"the link to {link.address} is closed"))
        else:
            link.write(encode_control(type_, body, correlation))
        try:
            answer = await future
        finally:
            self._control_waiters.pop(correlation, None)
        if answer.type == ControlType.ERROR:
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

    def _links(self) -> list[BrokerLink]:
        return [link for link in (self._link, *self._old_links) if link is not None]

    def _inbox_full(self, service: Service) -> None:
        self._full_inboxes.add(service)
        for link in self._links():
            link.pause_reading()

    def _inbox_drained(self, service: Service) -> None:
        if service in self._full_inboxes:
            self._full_inboxes.discard(service)
            if not self._full_inboxes:
                for link in self._links():
                    link.resume_reading()
                    link.dispatch()

    # -- incoming frames -----------------------------------------------------------

    def _protocol_error(self, link: BrokerLink, exc: ProtocolError) -> None:
        log.warning("broker broke the protocol", extra={"error": str(exc)})
        link.error = f"the broker sent an invalid frame: {exc}"
        link.abort()

    def _on_data(self, frame: DataFrame) -> None:
        flags = frame.flags
        if flags & _RESPONSE:
            waiting = self._requests.get((frame.dst, frame.response_for))
            if waiting is not None and not waiting[0].done():
                waiting[0].set_result(
                    Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, None)
                )
            else:
                self.dropped += 1
            return
        cast = frame.dst[0]
        if cast in (_CAST_MULTICAST, _CAST_ANYCAST):
            members = self._members.get(frame.dst, ())
            if not flags & _ECHO:
                members = [m for m in members if m._raw != frame.src]
            if not members:
                self.dropped += 1
                return
            if cast == _CAST_ANYCAST:
                members = [self._rng.choice(members)]
            for member in members:
                member._deliver(
                    Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, member)
                )
            return
        service = self._services.get(frame.dst)
        if service is None:
            self.dropped += 1
            return
        service._deliver(Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, service))

    def _on_control(self, link: BrokerLink, frame: ControlFrame) -> None:
        ctype = frame.type
        body = frame.body
        if ctype in (ControlType.TIMEOUT, ControlType.NO_ROUTE):
            assert isinstance(body, DeliveryFailure)
            self._on_delivery_failure(ctype, body)
            return
        waiting = self._control_waiters.get(frame.correlation) if frame.correlation else None
        if waiting is not None:
            if not waiting[0].done():
                waiting[0].set_result(frame)
            return
        if ctype == ControlType.BROKERS:
            assert isinstance(body, Brokers)
            if link is self._link:
                self._set_brokers(body.brokers)
        elif ctype == ControlType.MOVE:
            assert isinstance(body, Move)
            if link is self._link:
                self._spawn(self._move(body.address, body.reason), "move")
        elif ctype == ControlType.ERROR:
            assert isinstance(body, Error)
            link.error = body.message
            link.error_code = body.code
            link.redirect = body.redirect
            if body.code != ErrorCode.REDIRECT:
                log.warning("broker error", extra={"code": body.code, "error": body.message})
        elif ctype == ControlType.BYE:
            assert isinstance(body, Bye)
            link.error = f"the broker said goodbye: {body.reason}"

    def _on_delivery_failure(self, ctype: int, body: DeliveryFailure) -> None:
        dst = describe_address(body.dst)
        reason = body.reason or f"no service is registered at or member of {dst}"
        waiting = self._requests.get((body.src, body.msg_id))
        if waiting is not None:
            future = waiting[0]
            if not future.done():
                if ctype == ControlType.TIMEOUT:
                    future.set_exception(Timeout(f"no response from {dst} before the deadline"))
                else:
                    future.set_exception(NoRoute(f"no route to {dst}: {reason}", dst))
            return
        if ctype != ControlType.NO_ROUTE:
            return  # a TIMEOUT for a request this side already gave up on
        report = Undeliverable(describe_address(body.src), dst, body.msg_id, reason)
        if not self._undeliverable_handlers:
            log.warning(
                "undeliverable message",
                extra={"src": report.src, "dst": report.dst, "reason": reason},
            )
        for handler in self._undeliverable_handlers:
            handler(report)

    # -- ending ---------------------------------------------------------------------

    def _fail_in_flight(self, link: BrokerLink, error: MeshbusError) -> None:
        """Fail what waits for an answer that can only come over ``link``."""
        waiting: list[tuple[asyncio.Future[Any], BrokerLink]] = [
            *self._control_waiters.values(),
            *self._requests.values(),
        ]
        for future, via in waiting:
            if via is link and not future.done():
                future.set_exception(error)

    def _shutdown(self, error: MeshbusError) -> None:
        self._closed = True
        if isinstance(error, ConnectionLost):
            self._lost = error
        self._connected.set()  # wake senders waiting out a failover: they raise now
        futures: list[asyncio.Future[Any]] = [
            *(f for f, _ in self._control_waiters.values()),
            *(f for f, _ in self._requests.values()),
        ]
        for future in futures:
            if not future.done():
                future.set_exception(error)
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._drain_waiters.clear()
        for service in self._services.values():
            service._close()

    def _abort(self) -> None:
        self._closed = True
        for link in self._links():
            link.abort()
        for task in list(self._tasks):
            task.cancel()


class _Redirected(ConnectionLost):
    """A broker refused the connector and named another (internal to connecting)."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


def _error_from(body: Error, request: ControlType, subject: str) -> MeshbusError:
    code = body.code
    if code == ErrorCode.ADDRESS_IN_USE:
        return AddressInUse(body.message, subject, code)
    if code in FATAL_ERRORS:
        return RemoteProtocolError(code, body.message)
    return RegistrationError(f"{request.name.lower()} refused: {body.message}", code)
