"""The connector: one process's single link to a broker, shared by all its services.

The connector fans group messages out to its local members (the broker sends
one copy per link): every member of a multicast group gets one copy, one random
member of an anycast group gets it, and the sender is skipped unless it asked
for ``echo``.

Backpressure: each service's inbox holds at most ``max_inbox`` messages. When
one fills, the connector stops handing out frames and reading from the socket
until it drains to half, so a slow service slows its sender through TCP rather
than growing memory without bound. While it waits, nothing else on the link
moves either (control answers included): one link, one order. The broker closes
a link that falls more than its ``max_pending_bytes`` behind (a slow consumer,
as in NATS).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from meshbus.address import Address, Unicast, describe_address
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
from meshbus.protocol.codec import (
    ControlFrame,
    DataFrame,
    FrameDecoder,
    encode_control,
    encode_data,
)
from meshbus.protocol.control import (
    AddressBody,
    Body,
    Bye,
    DeliveryFailure,
    Empty,
    Error,
    Hello,
    Register,
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

_RESPONSE = int(DataFlags.RESPONSE)
_ECHO = int(DataFlags.ECHO)
_CAST_MULTICAST = 2
_CAST_ANYCAST = 3
# How long after a request's deadline the client gives up on the broker's TIMEOUT frame.
_LOCAL_TIMEOUT_GRACE = 1.0


async def connect(
    broker: str = "127.0.0.1:7400",
    *,
    server: str | None = None,
    name: str = "",
    max_frame: int = DEFAULT_MAX_FRAME,
    max_inbox: int = 65536,
    timeout: float = 5.0,
) -> Connector:
    """Connect to a broker at ``HOST:PORT`` and complete the handshake.

    ``server`` is the server name of this process's unicast addresses (at most
    11 bytes); it defaults to the host name when that fits. ``timeout`` bounds
    the TCP connect and the handshake.
    """
    if server is None:
        server = socket.gethostname().split(".")[0]
    Unicast(server, 1)  # a bad server name fails here, before any I/O
    host, port = parse_hostport(broker)
    connector = Connector(server, name or server, max_frame, max_inbox)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            await loop.create_connection(lambda: _LinkProtocol(connector), host, port)
            await connector._handshake()
    except TimeoutError:
        connector._abort()
        raise ConnectionLost(f"could not connect to broker {broker} within {timeout} s") from None
    except OSError as exc:
        # asyncio's own message ("Connect call failed ...") hides the reason; errno has it.
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConnectionLost(
            f"could not connect to broker {broker}: {why} (is a broker running there?)"
        ) from exc
    return connector


@dataclass(frozen=True)
class Undeliverable:
    """A ``send(..., notify=True)`` the broker could not deliver (see ``on_undeliverable``)."""

    src: str
    dst: str
    msg_id: int
    reason: str


class _LinkProtocol(asyncio.Protocol):
    def __init__(self, connector: Connector) -> None:
        self.connector = connector

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.connector._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.connector._data_received(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.connector._connection_lost(exc)

    def pause_writing(self) -> None:
        self.connector._write_paused = True

    def resume_writing(self) -> None:
        self.connector._resume_writing()


class Connector:
    """One link to one broker, carrying every service of the process.

    Use as ``async with await meshbus.connect(...) as conn:``; ``close()`` ends it.
    """

    def __init__(self, server: str, name: str, max_frame: int, max_inbox: int) -> None:
        self.server = server
        self.name = name
        self.max_frame = max_frame
        self.max_inbox = max_inbox
        self.broker_name = ""
        self._transport: asyncio.Transport | None = None
        self._decoder = FrameDecoder(max_frame)
        self._next_correlation = 1
        self._next_msg_id = 1
        self._control_waiters: dict[int, asyncio.Future[ControlFrame]] = {}
        self._requests: dict[tuple[bytes, int], asyncio.Future[Message]] = {}
        self._services: dict[bytes, Service] = {}
        self._members: dict[bytes, list[Service]] = {}
        self._full_inboxes: set[Service] = set()
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._lost: MeshbusError | None = None
        self._broker_error = ""
        self._rng = random.Random()
        self._undeliverable_handlers: list[Callable[[Undeliverable], None]] = []
        self.dropped = 0

    async def __aenter__(self) -> Connector:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<Connector {self.server} to {self.broker_name or '?'}>"

    @property
    def services(self) -> list[Service]:
        return list(self._services.values())

    # -- public API ----------------------------------------------------------

    async def register(self, instance: int | None = None) -> Service:
        """Register a service: ``instance`` 1..65535 for a fixed, well-known address
        (``AddressInUse`` if taken), or None for a dynamic address from the broker."""
        if instance is not None and not 1 <= instance <= 65535:
            raise ValueError(
                f"fixed instance ids are 1..65535, got {instance}; omit it for a dynamic id"
            )
        subject = f"{self.server}:{instance}" if instance else ""
        frame = await self._control(
            ControlType.REGISTER, Register(server=self.server, instance=instance or 0), subject
        )
        assert isinstance(frame.body, AddressBody)
        address = Address.from_bytes(frame.body.address)
        service = Service(self, address, self.max_inbox)
        self._services[frame.body.address] = service
        return service

    async def stat(self) -> dict[str, Any]:
        """The broker's view: links, services, groups and counters."""
        frame = await self._control(ControlType.STAT, Empty())
        assert isinstance(frame.body, Stats)
        return frame.body.data

    async def ping(self) -> None:
        """A round trip to the broker. Frames sent before it have been routed when it returns,
        since the broker handles a link's frames in order."""
        await self._control(ControlType.PING, Empty())

    def on_undeliverable(self, handler: Callable[[Undeliverable], None]) -> None:
        """Call ``handler`` for each ``send(..., notify=True)`` the broker could not deliver.

        Without a handler such reports are logged as warnings. ``Undeliverable.msg_id``
        is the value ``send`` returned."""
        self._undeliverable_handlers.append(handler)

    async def close(self) -> None:
        """Say goodbye and close the link. Pending requests fail with ``NotConnected``."""
        if self._closed:
            return
        transport = self._transport
        if transport is not None and not transport.is_closing() and self._lost is None:
            transport.write(encode_control(ControlType.BYE, Bye(reason="connector closed")))
        self._shutdown(NotConnected("the connector was closed"))
        if transport is not None:
            transport.close()

    # -- used by Service -------------------------------------------------------

    def _check_usable(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed or self._transport is None:
            raise NotConnected("the connector is closed")

    async def _send_data(
        self, src: bytes, dst: bytes, payload: bytes, flags: int, *, response_for: int = 0
    ) -> int:
        self._check_usable()
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
        assert self._transport is not None
        self._transport.write(frame)
        if self._write_paused:
            await self._drain()
        return msg_id

    async def _request(self, src: bytes, dst: Address, payload: bytes, timeout_ms: int) -> Message:
        self._check_usable()
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
        self._requests[key] = future
        assert self._transport is not None
        self._transport.write(frame)
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

    async def _control(self, type_: ControlType, body: Body, subject: str = "") -> ControlFrame:
        """Send a control request and wait for its answer; ERROR answers become exceptions."""
        self._check_usable()
        correlation = self._next_correlation
        self._next_correlation = correlation % 0xFFFFFFFF + 1
        future: asyncio.Future[ControlFrame] = asyncio.get_running_loop().create_future()
        self._control_waiters[correlation] = future
        assert self._transport is not None
        self._transport.write(encode_control(type_, body, correlation))
        try:
            answer = await future
        finally:
            self._control_waiters.pop(correlation, None)
        if answer.type == ControlType.ERROR:
            assert isinstance(answer.body, Error)
            raise _error_from(answer.body, type_, subject)
        return answer

    async def _handshake(self) -> None:
        frame = await self._control(
            ControlType.HELLO, Hello(name=self.name, max_frame=self.max_frame)
        )
        assert isinstance(frame.body, Welcome)
        self.broker_name = frame.body.broker
        self.max_frame = min(self.max_frame, frame.body.max_frame)

    async def _drain(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(future)
        await future

    def _resume_writing(self) -> None:
        self._write_paused = False
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

    def _inbox_full(self, service: Service) -> None:
        self._full_inboxes.add(service)
        if self._transport is not None:
            self._transport.pause_reading()

    def _inbox_drained(self, service: Service) -> None:
        if service in self._full_inboxes:
            self._full_inboxes.discard(service)
            if not self._full_inboxes and self._transport is not None:
                self._transport.resume_reading()
                self._dispatch_buffered()

    # -- incoming frames -----------------------------------------------------------

    def _data_received(self, data: bytes) -> None:
        try:
            self._decoder.feed(data)
        except ProtocolError as exc:
            self._protocol_error(exc)
            return
        self._dispatch_buffered()

    def _dispatch_buffered(self) -> None:
        """Hand out the buffered frames, stopping while an inbox is full: the rest stay
        in the decoder, so an inbox never holds more than ``max_inbox`` messages."""
        decoder = self._decoder
        try:
            while not self._full_inboxes and (frame := decoder.next_frame()) is not None:
                if isinstance(frame, DataFrame):
                    self._on_data(frame)
                else:
                    self._on_control(frame)
        except ProtocolError as exc:
            self._protocol_error(exc)

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.warning("broker broke the protocol", extra={"error": str(exc)})
        self._lost = ConnectionLost(f"the broker sent an invalid frame: {exc}")
        if self._transport is not None:
            self._transport.abort()

    def _on_data(self, frame: DataFrame) -> None:
        flags = frame.flags
        if flags & _RESPONSE:
            future = self._requests.get((frame.dst, frame.response_for))
            if future is not None and not future.done():
                future.set_result(
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

    def _on_control(self, frame: ControlFrame) -> None:
        ctype = frame.type
        body = frame.body
        if ctype in (ControlType.TIMEOUT, ControlType.NO_ROUTE):
            assert isinstance(body, DeliveryFailure)
            self._on_delivery_failure(ctype, body)
            return
        waiter = self._control_waiters.get(frame.correlation) if frame.correlation else None
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(frame)
            return
        if ctype == ControlType.ERROR:
            assert isinstance(body, Error)
            self._broker_error = body.message
            log.warning("broker error", extra={"code": body.code, "error": body.message})
        elif ctype == ControlType.BYE:
            assert isinstance(body, Bye)
            self._broker_error = f"the broker said goodbye: {body.reason}"

    def _on_delivery_failure(self, ctype: int, body: DeliveryFailure) -> None:
        dst = describe_address(body.dst)
        reason = body.reason or f"no service is registered at or member of {dst}"
        future = self._requests.get((body.src, body.msg_id))
        if future is not None:
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

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._closed:
            return
        reason = self._broker_error or (str(exc) if exc else "the broker closed the connection")
        self._shutdown(self._lost or ConnectionLost(f"lost the link to the broker: {reason}"))

    def _shutdown(self, error: MeshbusError) -> None:
        self._closed = True
        if isinstance(error, ConnectionLost):
            self._lost = error
        futures: list[asyncio.Future[Any]] = [
            *self._control_waiters.values(),
            *self._requests.values(),
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
        if self._transport is not None:
            self._transport.abort()


def _error_from(body: Error, request: ControlType, subject: str) -> MeshbusError:
    code = body.code
    if code == ErrorCode.ADDRESS_IN_USE:
        return AddressInUse(body.message, subject, code)
    if code in FATAL_ERRORS:
        return RemoteProtocolError(code, body.message)
    return RegistrationError(f"{request.name.lower()} refused: {body.message}", code)
