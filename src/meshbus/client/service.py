"""Services and the messages they receive."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from meshbus.address import Address
from meshbus.errors import MeshbusError, NotConnected, Timeout
from meshbus.protocol.control import AddressBody, Membership
from meshbus.protocol.layout import ControlType, DataFlags

if TYPE_CHECKING:
    from meshbus.client.connector import Connector

AddressLike = Address | str

_FLAG_REQUEST = int(DataFlags.REQUEST)


def as_address(value: AddressLike) -> Address:
    """Accept an Address or its text form (``game01:1``, ``multicast:chat``, ``anycast:login``)."""
    if isinstance(value, Address):
        return value
    if isinstance(value, str):
        return Address.parse(value)
    raise TypeError(f"expected an Address or its text form, not {type(value).__name__}")


class Message:
    """A message as a service receives it."""

    __slots__ = ("_dst", "_service", "_src", "flags", "msg_id", "payload")

    def __init__(
        self,
        src: bytes,
        dst: bytes,
        payload: bytes,
        msg_id: int,
        flags: int,
        service: Service | None,
    ) -> None:
        self._src = src
        self._dst = dst
        self.payload = payload
        self.msg_id = msg_id
        self.flags = flags
        self._service = service

    @property
    def src(self) -> Address:
        """The sending service's unicast address."""
        return Address.from_bytes(self._src)

    @property
    def dst(self) -> Address:
        """The address the message was sent to (a group address for group sends)."""
        return Address.from_bytes(self._dst)

    @property
    def is_request(self) -> bool:
        """True when the sender waits for ``reply``."""
        return bool(self.flags & _FLAG_REQUEST)

    async def reply(self, payload: bytes) -> None:
        """Answer a request. The response comes from the service that received the request."""
        if not self.is_request:
            raise MeshbusError("reply() needs a request; this message was a plain send")
        if self._service is None:
            raise MeshbusError("this message was not received by a service and cannot be answered")
        await self._service._respond(self._src, self.msg_id, payload)

    def __repr__(self) -> str:
        kind = "request" if self.is_request else "message"
        return f"<{kind} {self.src} -> {self.dst} {len(self.payload)} bytes>"


class Service:
    """An addressable endpoint registered through a connector.

    Receive with ``await svc.recv()`` or ``async for msg in svc``; the iteration
    ends when the service is unregistered or its connector closed, and raises
    ``ConnectionLost`` if the link to the broker broke.
    """

    def __init__(self, connector: Connector, address: Address, max_inbox: int) -> None:
        self._conn = connector
        self.address = address
        self._raw = address.to_bytes()
        self._inbox: deque[Message] = deque()
        self._max_inbox = max_inbox
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._groups: set[Address] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Service {self.address}>"

    @property
    def groups(self) -> frozenset[Address]:
        """The multicast and anycast groups this service is a member of."""
        return frozenset(self._groups)

    # -- sending --------------------------------------------------------------

    async def send(
        self, dst: AddressLike, payload: bytes, *, echo: bool = False, notify: bool = False
    ) -> int:
        """Send ``payload`` to ``dst`` (at most once); returns the message id.

        ``echo``: a group send also reaches this service if it is a member.
        ``notify``: if the broker cannot deliver it, it says so, and the connector calls
        its ``on_undeliverable`` handlers; by default such a send is dropped and counted."""
        flags = (DataFlags.ECHO if echo else 0) | (DataFlags.NOTIFY_DROP if notify else 0)
        return await self._conn._send_data(
            self._raw, as_address(dst).to_bytes(), payload, int(flags)
        )

    async def request(self, dst: AddressLike, payload: bytes, *, timeout: float = 5.0) -> Message:
        """Send a request and wait for its response.

        Raises ``meshbus.Timeout`` when no response comes within ``timeout`` seconds
        (the broker enforces the deadline), ``meshbus.NoRoute`` when nobody serves ``dst``.
        """
        if not timeout > 0:
            raise ValueError("timeout must be a positive number of seconds")
        timeout_ms = min(math.ceil(timeout * 1000), 0xFFFFFFFF)
        return await self._conn._request(self._raw, as_address(dst), payload, timeout_ms)

    async def _respond(self, requester: bytes, msg_id: int, payload: bytes) -> None:
        await self._conn._send_data(
            self._raw, requester, payload, int(DataFlags.RESPONSE), response_for=msg_id
        )

    # -- receiving --------------------------------------------------------------

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message; ``meshbus.Timeout`` if none arrives within ``timeout`` seconds.

        Several tasks may wait on one service; each message goes to one of them."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._inbox:
            self._check_open()
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                if deadline is None:
                    await waiter
                else:
                    await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except TimeoutError:
                self._remove_waiter(waiter)
                if self._inbox:
                    break  # a message arrived just as the time ran out: take it
                raise Timeout(
                    f"no message for {self.address} within {timeout} s", timeout
                ) from None
            except BaseException:
                # Cancelled, perhaps after being woken: hand the wake-up on so the
                # message that woke this task is not stranded in the inbox.
                self._remove_waiter(waiter)
                if self._inbox:
                    self._wake_one()
                raise
        message = self._inbox.popleft()
        if len(self._inbox) == self._max_inbox // 2:
            self._conn._inbox_drained(self)
        return message

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.recv()
            except NotConnected:
                return

    def _check_open(self) -> None:
        if self._closed:
            self._conn._check_usable()
            raise NotConnected(f"service {self.address} is unregistered")
        self._conn._check_usable()

    def _deliver(self, message: Message) -> None:
        self._inbox.append(message)
        self._wake_one()
        if len(self._inbox) == self._max_inbox:
            self._conn._inbox_full(self)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _remove_waiter(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # -- membership ---------------------------------------------------------------

    async def join(self, group: AddressLike) -> None:
        """Join a multicast (topic) or anycast (pool) group."""
        address = as_address(group)

        def joined(_: object) -> None:
            self._groups.add(address)
            self._conn._joined(self, address)

        await self._conn._change(
            ControlType.JOIN, Membership(member=self._raw, group=address.to_bytes()), joined
        )

    async def leave(self, group: AddressLike) -> None:
        """Leave a group; leaving a group the service is not in does nothing."""
        address = as_address(group)

        def left(_: object) -> None:
            self._groups.discard(address)
            self._conn._left(self, address)

        await self._conn._change(
            ControlType.LEAVE, Membership(member=self._raw, group=address.to_bytes()), left
        )

    async def unregister(self) -> None:
        """Remove the service from the bus; its address becomes free."""
        await self._conn._change(
            ControlType.UNREGISTER,
            AddressBody(address=self._raw),
            lambda _: self._conn._forget(self),
        )

    def _close(self) -> None:
        self._closed = True
        self._wake()
