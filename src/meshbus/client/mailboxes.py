"""The connector's side of its services: where their messages arrive.

``Mailbox`` is the receiving side of one registered service: its address, the
groups it joined, and the inbox its messages wait in -- or the listeners they go
to instead. The public ``Service`` (meshbus.client.service) sends and receives
through its mailbox; the inbound dispatcher delivers to mailboxes.

``Services`` is the registry of the connector's mailboxes (who is in which group is
meshbus.client.memberships). It also holds backpressure: each inbox holds at most ``max_inbox``
messages, and while any is full the links hand out no frame and read nothing,
until it drains to half -- so a slow service slows its sender through TCP rather
than growing memory without bound (the broker closes a link that falls more than
its ``max_pending_bytes`` behind: a slow consumer, as in NATS).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Final

from meshbus.address import BROADCAST_GROUP, Address, Unicast
from meshbus.client.callbacks import Callbacks
from meshbus.client.link import Links
from meshbus.client.message import Message
from meshbus.client.outbound import Outbound
from meshbus.errors import MeshbusError, NoQueue, NotConnected, Timeout
from meshbus.protocol.codec import BytesLike
from meshbus.protocol.ext import Ext, wrap
from meshbus.protocol.layout import FLAG_EXT, FLAG_RESPONSE
from meshbus.util import BackgroundTasks

log = logging.getLogger("meshbus.client")

BROADCAST: Final = BROADCAST_GROUP.to_bytes()

Listener = Callable[[Message], object]


class Mailbox:
    """The receiving side of one service. ``service`` is the public object it belongs to
    (a meshbus.client.service.Service, which sits above this module), for
    ``Connector.services``."""

    def __init__(
        self,
        service: object,
        address: Unicast,
        max_inbox: int,
        *,
        services: Services,
        links: Links,
        outbound: Outbound,
        tasks: BackgroundTasks,
    ) -> None:
        self.service = service
        self.address = address
        self.raw = address.to_bytes()
        self.groups: set[Address] = set()  # changed by Memberships alone
        self.closed = False
        self._ended_by: MeshbusError | None = None  # why it ended, if not unregistered
        self.listeners: Callbacks[Listener] = Callbacks()
        self.fills = 0  # times the inbox filled up, pausing the links (Service.inbox_fills)
        self._inbox: deque[Message] = deque()
        self._max_inbox = max_inbox
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._services = services
        self._links = links
        self._outbound = outbound
        self._tasks = tasks

    def member_of(self, group: bytes) -> bool:
        return any(g.to_bytes() == group for g in self.groups)

    @property
    def queued(self) -> int:
        return len(self._inbox)

    # -- arriving ------------------------------------------------------------------

    def deliver(self, message: Message) -> None:
        if self.listeners.handlers:
            self._hand_to_listeners(message)
            return
        inbox = self._inbox
        inbox.append(message)
        if self._waiters:
            self._wake_one()
        if len(inbox) == self._max_inbox:
            self.fills += 1
            self._services.inbox_full(self)

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """From now on messages go to the listeners (what waits in the inbox too); the
        returned function removes this one, and with the last one gone they queue again."""
        remove = self.listeners.add(listener)
        while self._inbox:
            self._hand_to_listeners(self._inbox.popleft())
        self._services.inbox_drained(self)
        return remove

    def _hand_to_listeners(self, message: Message) -> None:
        """Each listener in turn, inline: the link reads no further frame until they return."""
        for listener in self.listeners.handlers:
            try:
                result = listener(message)
                # A plain listener returns None: asyncio.iscoroutine's type checks cost
                # more than the rest of the hand-off, so they are asked of a result only.
                if result is not None and asyncio.iscoroutine(result):
                    self._tasks.spawn(self._listening(result, message), "listener")
            except Exception:
                self._listener_failed(message)

    async def _listening(self, listening: Coroutine[Any, Any, object], message: Message) -> None:
        """A coroutine listener's run: what it raises is logged as a plain one's is, not
        left to asyncio's "Task exception was never retrieved"."""
        try:
            await listening
        except Exception:
            self._listener_failed(message)

    def _listener_failed(self, message: Message) -> None:
        """Logged once, with the service and the message; the listeners go on."""
        log.exception(
            "a message listener of %s failed on %r",
            self.address,
            message,
            extra={"service": str(self.address), "src": str(message.src)},
        )

    # -- taking ----------------------------------------------------------------------

    def take_ready(self) -> Message | None:
        """The next message if one is waiting (and the queue is on), else None: the part of
        ``take`` that never suspends, for ``async for``."""
        inbox = self._inbox
        if not inbox or self.listeners.handlers:
            return None
        message = inbox.popleft()
        if len(inbox) == self._max_inbox // 2:
            self._services.inbox_drained(self)
        return message

    async def take(self, timeout: float | None) -> Message:
        """The next message of the inbox (``Service.recv``)."""
        await self._wait(timeout)
        message = self._inbox.popleft()
        if len(self._inbox) == self._max_inbox // 2:
            self._services.inbox_drained(self)
        return message

    async def take_batch(self, max_size: int) -> list[Message]:
        """Every message waiting, up to ``max_size``, once there is one
        (``Service.batches``)."""
        await self._wait(None)
        inbox = self._inbox
        before = len(inbox)
        if before <= max_size:
            batch = list(inbox)
            inbox.clear()
        else:
            batch = [inbox.popleft() for _ in range(max_size)]
        if before > self._max_inbox // 2 >= len(inbox):
            self._services.inbox_drained(self)
        return batch

    async def _wait(self, timeout: float | None) -> None:
        """Return once the inbox holds a message; Timeout past ``timeout`` seconds."""
        if self.listeners.handlers:
            raise NoQueue(
                f"{self.address} hands its messages to listeners (add_listener), "
                "so it has no queue to take them from"
            )
        if self._inbox:
            return
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
                    async with asyncio.timeout_at(deadline):  # not wait_for: see Requester
                        await waiter
            except TimeoutError:
                self._remove_waiter(waiter)
                if self._inbox:
                    return  # a message arrived just as the time ran out: take it
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

    def _check_open(self) -> None:
        self._links.check_usable()
        if self.closed:
            raise self._ended_by or NotConnected(f"service {self.address} is unregistered")

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

    # -- answering ---------------------------------------------------------------------

    async def respond(
        self, requester: bytes, msg_id: int, payload: BytesLike, headers: bytes
    ) -> None:
        payload, flags = _response(payload, headers)
        outbound = self._outbound
        if not outbound.try_send(self.raw, requester, payload, flags, msg_id):
            await outbound.send_data(self.raw, requester, payload, flags, response_for=msg_id)

    def respond_nowait(
        self, requester: bytes, msg_id: int, payload: BytesLike, headers: bytes
    ) -> None:
        payload, flags = _response(payload, headers)
        outbound = self._outbound
        if not outbound.try_send(self.raw, requester, payload, flags, msg_id):
            raise outbound.would_block()

    def close(self, error: MeshbusError | None = None) -> None:
        """Unregistered, or the connector ended, or (``error``) the service lost its
        address: waiting receivers wake and find out, and ``recv`` raises ``error``."""
        self.closed = True
        self._ended_by = error
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


class Services:
    """The connector's mailboxes by address, and ``full``: the mailboxes whose inbox is
    full (the links read it before every frame)."""

    def __init__(self, links: Links) -> None:
        self._by_address: dict[bytes, Mailbox] = {}
        self.full: set[Mailbox] = set()
        # Connector.on_slow_consumer: called with each mailbox whose inbox just filled up.
        self.slow: Callbacks[Callable[[Mailbox], object]] = Callbacks()
        self._links = links
        # The mailbox of a 16-byte address, or None: the dict's own lookup, since every
        # unicast message asks it.
        self.get: Callable[[bytes], Mailbox | None] = self._by_address.get

    def __len__(self) -> int:
        return len(self._by_address)

    def __contains__(self, raw: bytes) -> bool:
        return raw in self._by_address

    def all(self) -> list[Mailbox]:
        return list(self._by_address.values())

    def add(self, mailbox: Mailbox) -> None:
        self._by_address[mailbox.raw] = mailbox

    def remove(self, mailbox: Mailbox, error: MeshbusError | None = None) -> None:
        """The service is unregistered, or (``error``) lost its address: it could not come
        back after a failover, or another took it after a split (its groups are left
        first: Memberships.forget)."""
        self._by_address.pop(mailbox.raw, None)
        self.inbox_drained(mailbox)
        mailbox.close(error)

    def close_all(self) -> None:
        for mailbox in self._by_address.values():
            mailbox.close()

    def inbox_full(self, mailbox: Mailbox) -> None:
        self.full.add(mailbox)
        for link in self._links.all():
            link.pause_reading()
        for handler in self.slow.handlers:
            try:
                handler(mailbox)
            except Exception:
                log.exception("a slow-consumer handler failed")

    def inbox_drained(self, mailbox: Mailbox) -> None:
        if mailbox in self.full:
            self.full.discard(mailbox)
            if not self.full:
                for link in self._links.all():
                    link.resume_reading()
                    link.dispatch()


def _response(payload: BytesLike, headers: bytes) -> tuple[BytesLike, int]:
    """A response's payload and flags: with an extension block when it has headers."""
    if headers:
        return wrap(Ext(headers=headers), payload), FLAG_RESPONSE | FLAG_EXT
    return payload, FLAG_RESPONSE
