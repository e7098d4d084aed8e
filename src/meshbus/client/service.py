"""Services and the messages they receive.

A ``Service`` is the public face of one registered address. It sends through the
connector's parts it is given (``ServiceParts``) and receives through its
``Mailbox`` (meshbus.client.mailboxes), which the inbound dispatcher fills.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshbus.address import BROADCAST_GROUP, Address, Multicast, Unicast
from meshbus.client.mailboxes import BROADCAST, Mailbox, Services
from meshbus.errors import (
    InvalidArgument,
    JoinFailed,
    MeshbusError,
    NotConnected,
    RegistrationError,
)
from meshbus.protocol.codec import DataFrame
from meshbus.protocol.control import AddressBody, Empty, Membership
from meshbus.protocol.ext import Ext, wrap
from meshbus.protocol.layout import (
    FLAG_ECHO,
    FLAG_EXT,
    FLAG_NOTIFY_DROP,
    FLAG_REQUEST,
    FLAG_TRACE,
    ControlType,
)

if TYPE_CHECKING:
    from meshbus.client.keeper import Changes
    from meshbus.client.link import Links
    from meshbus.client.outbound import Outbound, TraceSampler
    from meshbus.client.reliable import Reliable
    from meshbus.client.requester import Requester
    from meshbus.client.streams import StreamClient
    from meshbus.util import BackgroundTasks

AddressLike = Address | str


def as_address(value: AddressLike) -> Address:
    """Accept an Address or its text form (``game01:1``, ``multicast:chat``, ``anycast:login``)."""
    if isinstance(value, Address):
        return value
    if isinstance(value, str):
        return _parse(value)
    raise TypeError(f"expected an Address or its text form, not {type(value).__name__}")


# Most senders name a few addresses over and over: parse each text form once.
_parse = functools.lru_cache(maxsize=4096)(Address.parse)


def _group_address(value: AddressLike) -> Address:
    address = as_address(value)
    if not address.is_group:
        raise InvalidArgument(
            f"{address} is a unicast address; services join multicast:NAME or anycast:NAME"
        )
    return address


# A priority reaches stream readers as a 32-bit signed integer (Spark's IntegerType).
_PRIORITY_MIN = -(1 << 31)
_PRIORITY_MAX = (1 << 31) - 1
# Group and publish ids travel in the frame's extension block, whose size is a u16.
_ID_MAX = 1024
# A request's deadline travels in milliseconds as a u32: about 49.7 days at most.
_MAX_TIMEOUT = 0xFFFFFFFF / 1000


def _checked_priority(priority: int) -> int:
    if not _PRIORITY_MIN <= priority <= _PRIORITY_MAX:
        raise InvalidArgument(
            f"priority {priority} is out of range {_PRIORITY_MIN}..{_PRIORITY_MAX}"
        )
    return priority


def _checked_publish_id(publish_id: bytes) -> bytes:
    if len(publish_id) > _ID_MAX:
        raise InvalidArgument(f"a publish id is at most {_ID_MAX} bytes, got {len(publish_id)}")
    return publish_id


def _checked_send_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not 0 < timeout <= _MAX_TIMEOUT:
        raise InvalidArgument(
            f"timeout must be a positive number of seconds up to {_MAX_TIMEOUT:g}, got {timeout}"
        )
    return timeout


def _group_key(group: str | bytes | None, final: bool) -> bytes:
    """A message group's id as it travels (b"" for none)."""
    key = group.encode() if isinstance(group, str) else (group or b"")
    if final and not key:
        raise InvalidArgument("final=True ends a message group; give the group too")
    if len(key) > _ID_MAX:
        raise InvalidArgument(f"a message group id is at most {_ID_MAX} bytes, got {len(key)}")
    return key


_NO_EXT = Ext()


class Message:
    """A message as a service receives it.

    ``priority`` is the sender's; ``group`` and ``final`` are set on the messages of a
    message group, and ``group_reassigned`` on the first one a member receives of a group
    that was held by another member before (that member died or left): the receiver
    should recover the group's state before it handles the message."""

    __slots__ = (
        "_dst",
        "_ext",
        "_mailbox",
        "_src",
        "flags",
        "group_reassigned",
        "msg_id",
        "payload",
    )

    def __init__(
        self,
        src: bytes,
        dst: bytes,
        payload: bytes,
        msg_id: int,
        flags: int,
        mailbox: Mailbox | None,
        ext: Ext = _NO_EXT,
        group_reassigned: bool = False,
    ) -> None:
        self._src = src
        self._dst = ext.origin or dst
        self.payload = payload
        self.msg_id = msg_id
        self.flags = flags
        self._mailbox = mailbox
        self._ext = ext
        self.group_reassigned = group_reassigned

    @classmethod
    def of(cls, frame: DataFrame, mailbox: Mailbox, ext: Ext, reassigned: bool) -> Message:
        return cls(
            frame.src,
            frame.dst,
            frame.payload,
            frame.msg_id,
            frame.flags,
            mailbox,
            ext,
            reassigned,
        )

    @property
    def priority(self) -> int:
        return self._ext.priority

    @property
    def group(self) -> str | None:
        """The message group's id, or None for a message outside any group."""
        return self._ext.group.decode() if self._ext.group else None

    @property
    def final(self) -> bool:
        """The last message of its group."""
        return self._ext.final

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
        return bool(self.flags & FLAG_REQUEST)

    async def reply(self, payload: bytes) -> None:
        """Answer a request. The response comes from the service that received the request."""
        if not self.is_request:
            raise MeshbusError("reply() needs a request; this message was a plain send")
        if self._mailbox is None:
            raise MeshbusError("this message was not received by a service and cannot be answered")
        await self._mailbox.respond(self._src, self.msg_id, payload)

    def __repr__(self) -> str:
        kind = "request" if self.is_request else "message"
        return f"<{kind} {self.src} -> {self.dst} {len(self.payload)} bytes>"


@dataclass(frozen=True)
class ServiceParts:
    """What a service uses of its connector: one set, shared by all of them."""

    links: Links  # whether the connector may still be used
    services: Services  # the registry its mailbox is in
    outbound: Outbound  # plain sends and responses
    sampler: TraceSampler  # which plain sends to trace
    requester: Requester  # requests
    reliable: Reliable  # reliable sends, message groups, subscribe_other
    changes: Changes  # join, leave, unregister
    forget: Callable[[Mailbox], None]  # once it is unregistered
    streams: StreamClient  # fetch
    tasks: BackgroundTasks  # coroutine listeners


class Service:
    """An addressable mailbox registered through a connector.

    Receive with ``await svc.recv()`` or ``async for msg in svc``; the iteration
    ends when the service is unregistered or its connector closed, and raises
    ``ConnectionLost`` if the link to the broker broke.
    """

    def __init__(self, address: Unicast, max_inbox: int, parts: ServiceParts) -> None:
        """A service the broker just registered; it joins ``parts.services`` at once, so
        no message to it can arrive before it is there."""
        self.address = address
        self._mailbox = mailbox = Mailbox(
            self,
            address,
            max_inbox,
            services=parts.services,
            links=parts.links,
            outbound=parts.outbound,
            tasks=parts.tasks,
        )
        self._raw = mailbox.raw
        self._parts = parts
        self._outbound = parts.outbound
        self._sampler = parts.sampler
        parts.services.add(mailbox)

    def __repr__(self) -> str:
        return f"<Service {self.address}>"

    @property
    def groups(self) -> frozenset[Address]:
        """The multicast and anycast groups this service is a member of."""
        return frozenset(g for g in self._mailbox.groups if g.to_bytes() != BROADCAST)

    @property
    def queued(self) -> int:
        """Messages waiting in this service's inbox for ``recv`` (at most ``max_inbox``:
        a full inbox pauses the link)."""
        return self._mailbox.queued

    # -- sending --------------------------------------------------------------

    async def send(
        self,
        dst: AddressLike,
        payload: bytes,
        *,
        echo: bool = False,
        notify: bool = False,
        reliable: bool = False,
        group: str | bytes | None = None,
        final: bool = False,
        priority: int = 0,
        publish_id: bytes = b"",
        timeout: float | None = None,
    ) -> int:
        """Send ``payload`` to ``dst``; returns the message id.

        A plain send is at most once. ``reliable=True``: exactly once to the application --
        kept until the receiving connector acknowledges it and resent on timeout (see
        ``ReliableConfig``); ``send`` returns once it is sent, and a send that is finally
        given up goes to ``Connector.on_delivery_failed``. Use ``send_reliable`` to wait for
        the acknowledgement instead. To a multicast address each member gets it once; to an
        anycast address exactly one member does.

        ``group`` (to an anycast address): a message group -- every message with this id
        goes to the same member, in the order sent, reliably; ``final=True`` on the last
        one ends the group. ``priority`` (a 32-bit signed integer) is carried to the
        receiver (``Message.priority``). ``publish_id``: a name for the message across
        senders and retries -- a stream stores it, and each receiving service delivers it,
        once per dedupe window. Group and publish ids are at most 1024 bytes.
        ``echo``: a group send also reaches this service if it is a member.
        ``notify``: if the broker cannot deliver a plain send, it says so, and the connector
        calls its ``on_undeliverable`` handlers; by default such a send is dropped and
        counted. A value it cannot use raises ``meshbus.InvalidArgument`` before anything
        is sent.

        ``timeout`` (a reliable or group send): how long ``send`` may wait for what it asks
        the broker first -- the member of a new group, a group's members -- while the
        answer is "not now" (a group's home broker lost a moment ago, a failover), asking
        again meanwhile. By default the retry policy's ``give_up_after()`` (15 s); past
        it, ``meshbus.Timeout`` says what it waited for and why. A permanent answer (no
        member, permission denied) raises at once."""
        raw = as_address(dst).to_bytes()
        if reliable or group is not None:
            return await self._parts.reliable.send(
                self._raw,
                raw,
                payload,
                echo=echo,
                group=_group_key(group, final),
                final=final,
                priority=_checked_priority(priority),
                publish_id=_checked_publish_id(publish_id),
                wait=False,
                timeout=_checked_send_timeout(timeout),
            )
        if final:
            raise InvalidArgument("final=True ends a message group; give the group too")
        if timeout is not None:
            raise InvalidArgument(
                "timeout= bounds a reliable or group send; a plain one waits for nothing"
            )
        if priority or publish_id:
            _checked_priority(priority)
            _checked_publish_id(publish_id)
        flags = (FLAG_ECHO if echo else 0) | (FLAG_NOTIFY_DROP if notify else 0)
        sampler = self._sampler
        if sampler.every and sampler.this_one():
            flags |= FLAG_EXT | FLAG_TRACE
            ext = Ext(priority=priority, publish_id=publish_id, sent_at=time.time())
            payload = wrap(ext, payload)
        elif priority or publish_id:
            flags |= FLAG_EXT
            payload = wrap(Ext(priority=priority, publish_id=publish_id), payload)
        return await self._outbound.send_data(self._raw, raw, payload, flags)

    async def send_reliable(
        self,
        dst: AddressLike,
        payload: bytes,
        *,
        group: str | None = None,
        final: bool = False,
        priority: int = 0,
        publish_id: bytes = b"",
        echo: bool = False,
        timeout: float | None = None,
    ) -> int:
        """A reliable send that returns once it is acknowledged (by every member, for a
        multicast address); raises ``meshbus.DeliveryFailed`` when it is given up, and
        ``meshbus.Timeout`` as ``send`` does (``timeout``)."""
        return await self._parts.reliable.send(
            self._raw,
            as_address(dst).to_bytes(),
            payload,
            echo=echo,
            group=_group_key(group, final),
            final=final,
            priority=_checked_priority(priority),
            publish_id=_checked_publish_id(publish_id),
            wait=True,
            timeout=_checked_send_timeout(timeout),
        )

    # -- the Postina verbs (docs/architecture.md) ------------------------------------------

    async def publish(
        self, topic: str, payload: bytes, *, priority: int = 0, reliable: bool = False
    ) -> int:
        """Send to every subscriber of ``topic`` (the multicast address of that name)."""
        return await self.send(Multicast(topic), payload, priority=priority, reliable=reliable)

    async def subscribe(self, topics: str | Iterable[str]) -> None:
        """Receive what is published to ``topics`` (one name or several; a bad name fails
        before any is subscribed)."""
        await self._membership(self.join, topics)

    async def unsubscribe(self, topics: str | Iterable[str]) -> None:
        await self._membership(self.leave, topics)

    @staticmethod
    async def _membership(
        change: Callable[[Multicast], Awaitable[None]], topics: str | Iterable[str]
    ) -> None:
        groups = [Multicast(topic) for topic in ([topics] if isinstance(topics, str) else topics)]
        for group in groups:
            try:
                await change(group)
            except RegistrationError as exc:
                raise JoinFailed(str(exc), exc.code) from exc

    async def subscribe_other(self, topic: str, address: AddressLike) -> None:
        """Make the service at ``address`` subscribe to ``topic`` (interest management by a
        master service). Returns once its connector has the request; reliable."""
        await self._command("subscribe", topic, address)

    async def unsubscribe_other(self, topic: str, address: AddressLike) -> None:
        await self._command("unsubscribe", topic, address)

    async def _command(self, command: str, topic: str, address: AddressLike) -> None:
        Multicast(topic)  # a bad topic fails here
        await self._parts.reliable.send(
            self._raw,
            as_address(address).to_bytes(),
            topic.encode(),
            echo=False,
            group=b"",
            final=False,
            priority=0,
            publish_id=b"",
            wait=True,
            command=command,
        )

    async def broadcast(self, payload: bytes, *, priority: int = 0) -> int:
        """Send to every service on the bus (at most once, like ``publish``)."""
        return await self.send(BROADCAST_GROUP, payload, priority=priority, echo=True)

    async def fetch(self, stream: str, from_seq: int = 1, max_count: int = 100) -> list[Any]:
        """Read a durable stream (``Connector.streams.fetch``): ``StreamMessage`` objects
        with ``.seq``, ``.stored_at``, ``.src``, ``.dst`` and ``.payload``."""
        return await self._parts.streams.fetch(stream, from_seq, max_count)

    def add_listener(self, listener: Callable[[Message], object]) -> Callable[[], None]:
        """Call ``listener`` with each message (a coroutine function is run as a task).
        From then on the queue is off: ``next_message``/``recv`` raise ``NoQueue``.

        Returns a function that removes the listener again; once the last one is removed,
        messages queue for ``recv`` as before (the shape of every ``on_...`` here:
        meshbus.client.callbacks)."""
        return self._mailbox.add_listener(listener)

    async def next_message(self, timeout: float | None = None) -> Message:
        """The next message from the queue (Postina's name for ``recv``)."""
        return await self.recv(timeout)

    async def request(self, dst: AddressLike, payload: bytes, *, timeout: float = 5.0) -> Message:
        """Send a request and wait for its response.

        Raises ``meshbus.Timeout`` when no response comes within ``timeout`` seconds
        (the broker enforces the deadline), ``meshbus.NoRoute`` when nobody serves ``dst``.
        """
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout}")
        timeout_ms = math.ceil(min(timeout, _MAX_TIMEOUT) * 1000)
        return await self._parts.requester.request(self._raw, as_address(dst), payload, timeout_ms)

    # -- receiving --------------------------------------------------------------

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message; ``meshbus.Timeout`` if none arrives within ``timeout`` seconds.

        Several tasks may wait on one service; each message goes to one of them."""
        return await self._mailbox.take(timeout)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.recv()
            except NotConnected:
                return

    # -- membership ---------------------------------------------------------------

    async def join(self, group: AddressLike) -> None:
        """Join a multicast (topic) or anycast (pool) group."""
        await self._change_group(ControlType.JOIN, group, self._parts.services.joined)

    async def leave(self, group: AddressLike) -> None:
        """Leave a group; leaving a group the service is not in does nothing."""
        await self._change_group(ControlType.LEAVE, group, self._parts.services.left)

    async def _change_group(
        self,
        type_: ControlType,
        group: AddressLike,
        apply: Callable[[Mailbox, Address], None],
    ) -> None:
        address = _group_address(group)
        mailbox = self._mailbox
        await self._parts.changes.change(
            type_,
            Membership(member=self._raw, group=address.to_bytes()),
            Empty,
            lambda _: apply(mailbox, address),
        )

    async def unregister(self) -> None:
        """Remove the service from the bus; its address becomes free."""
        mailbox, forget = self._mailbox, self._parts.forget
        await self._parts.changes.change(
            ControlType.UNREGISTER,
            AddressBody(address=self._raw),
            Empty,
            lambda _: forget(mailbox),
        )
