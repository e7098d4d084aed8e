"""Services: the public face of each registered address.

A ``Service`` sends through the connector's parts it is given (``ServiceParts``),
joins and leaves groups through ``Memberships`` (meshbus.client.memberships), and
receives through its ``Mailbox`` (meshbus.client.mailboxes), which the inbound
dispatcher fills with ``Message`` values (meshbus.client.message).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

from meshbus.address import BROADCAST_GROUP, SUBJECTS, Address, Anycast, Multicast, Unicast
from meshbus.client.addressing import AddressLike, as_address
from meshbus.client.changes import Changes
from meshbus.client.link import Links
from meshbus.client.mailboxes import BROADCAST, Mailbox, Services
from meshbus.client.memberships import Memberships
from meshbus.client.message import Message
from meshbus.client.outbound import Outbound, TraceSampler
from meshbus.client.payloads import NO_JSON, body
from meshbus.client.reliable import Reliable
from meshbus.client.requester import Requester
from meshbus.client.streams import StreamClient, StreamMessage
from meshbus.errors import (
    InvalidArgument,
    JoinFailed,
    NotConnected,
    RegistrationError,
)
from meshbus.protocol.batch import BATCH_ROWS, FRAME_OVERHEAD, RowTuple, pack_rows
from meshbus.protocol.codec import BytesLike, payload_bytes
from meshbus.protocol.control import AddressBody, Empty
from meshbus.protocol.ext import Ext, prefix, wrap
from meshbus.protocol.headers import encode_headers
from meshbus.protocol.layout import (
    FLAG_ECHO,
    FLAG_EXT,
    FLAG_NOTIFY_DROP,
    FLAG_TRACE,
    ControlType,
)
from meshbus.protocol.subjects import MAX_SUBJECT, is_literal, is_valid_queue, is_valid_subject
from meshbus.util import BackgroundTasks

G = TypeVar("G", bound=Multicast | Anycast)


def _group_address(value: AddressLike) -> Address:
    address = as_address(value)
    if not isinstance(address, Multicast | Anycast):
        raise InvalidArgument(
            f"{address} is a unicast address; services join multicast:NAME or anycast:NAME"
        )
    return _exact(address)


def _exact(group: G) -> G:
    """A group to join, never one named like a wildcard subject: it would be matched by
    its literal name and silently reach nobody."""
    if "*" in group.name or ">" in group.name:
        raise InvalidArgument(
            f"{group}: group names are matched exactly, '*' and '>' are not wildcards; "
            "subscribe to a subject pattern instead (Service.subscribe)"
        )
    return group


# A publisher uses few subjects many times: each is checked once (bounded).
@functools.lru_cache(maxsize=1024)
def _subject(subject: str, *, pattern: bool) -> bytes:
    """``subject`` as it travels, checked as the broker checks it: a subscription's
    pattern, or (not ``pattern``) a literal subject to publish on."""
    if not isinstance(subject, str):
        raise InvalidArgument(f"a subject is text, not {type(subject).__name__}")
    try:
        raw = subject.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"subject {subject!r} is no UTF-8 text: {exc}") from None
    if len(raw) > MAX_SUBJECT:
        raise InvalidArgument(f"a subject is at most {MAX_SUBJECT} bytes, got {len(raw)}")
    if not is_valid_subject(raw):
        raise InvalidArgument(
            f"{subject!r} is no valid subject: tokens separated by '.', none empty, no "
            "whitespace, '>' only as the last token"
        )
    if not pattern and not is_literal(raw):
        raise InvalidArgument(
            f"{subject!r}: a message is published on a subject without wildcards; "
            "'*' and '>' are for subscribe"
        )
    return raw


@functools.lru_cache(maxsize=1024)
def _subject_block(subject: bytes) -> bytes:
    """The extension block of a message on ``subject`` without headers, made once."""
    return prefix(Ext(subject=subject))


def _queue(queue: str | None) -> bytes:
    """A queue group's name as it travels (b"" for none)."""
    if queue is None:
        return b""
    raw = queue.encode()
    if not is_valid_queue(raw) or len(raw) > MAX_SUBJECT:
        raise InvalidArgument(
            f"queue group {queue!r}: a name of 1 to {MAX_SUBJECT} bytes without whitespace"
        )
    return raw


def _reliable_group(subject: str) -> Multicast:
    """The group a reliable publish on ``subject`` goes to: the multicast of its name."""
    try:
        return Multicast(subject)
    except InvalidArgument as exc:
        raise InvalidArgument(
            f"publish(reliable=True) on {subject!r}: a reliable publish goes to the members "
            f"of multicast:{subject}, and {exc}; subject subscriptions acknowledge nothing"
        ) from None


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


@dataclass(frozen=True)
class ServiceParts:
    """What a service uses of its connector: one set, shared by all of them."""

    links: Links  # whether the connector may still be used
    services: Services  # the registry its mailbox is in
    outbound: Outbound  # plain sends and responses
    sampler: TraceSampler  # which plain sends to trace
    requester: Requester  # requests
    reliable: Reliable  # reliable sends, message groups, subscribe_other
    changes: Changes  # unregister
    memberships: Memberships  # join, leave; forgets it once it is unregistered
    streams: StreamClient  # fetch
    tasks: BackgroundTasks  # coroutine listeners


class Service:
    """An addressable mailbox registered through a connector.

    Receive with ``await svc.recv()`` or ``async for msg in svc``; the iteration
    ends when the service is unregistered or its connector closed, and raises
    ``ConnectionLost`` if the link to the broker broke. The fast paths: ``send_nowait``,
    ``send_many`` and ``flush`` to send, ``batches`` and ``add_listener`` (inline) to
    receive, ``Message.reply_nowait`` to answer.
    """

    def __init__(self, address: Unicast, max_inbox: int, parts: ServiceParts) -> None:
        """A service the broker just registered; it joins ``parts.services`` at once, so
        no message to it can arrive before it is there."""
        self.address = address
        """Its unicast address: where sends to it go, the ``src`` of what it sends."""
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

    async def __aenter__(self) -> Service:
        """``async with await conn.register() as svc:`` unregisters it when the block ends."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._mailbox.closed:  # not unregistered yet, its connector not ended
            await self.unregister()

    @property
    def closed(self) -> bool:
        """Unregistered, or its connector closed: it sends and receives no more."""
        return self._mailbox.closed

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
        payload: BytesLike | None = None,
        *,
        json: object = NO_JSON,
        headers: Mapping[str, str] | None = None,
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

        The payload is any bytes-like object, or ``json=value`` instead: the value encoded
        as JSON (dicts, lists, dataclasses, msgspec Structs...; ``Message.json()`` and
        ``Message.decode(Type)`` read it back). ``headers``: names and values the receiver
        reads as ``Message.headers`` (a name is an ASCII token, a value text without CR or
        LF); they count toward the frame's size limit with the payload.

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
        if payload is None or json is not NO_JSON:
            payload = body(payload, json)
        if reliable or group is not None:
            return await self._parts.reliable.send(
                self._raw,
                raw,
                payload_bytes(payload),  # kept for resends: a copy the caller cannot change
                headers=encode_headers(headers),
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
        payload, flags = self._plain(payload, echo, notify, priority, publish_id, headers)
        outbound = self._outbound
        # Written at once when nothing stands in the way (no suspension); else it waits.
        return outbound.try_send(self._raw, raw, payload, flags) or await outbound.send_data(
            self._raw, raw, payload, flags
        )

    def send_nowait(
        self,
        dst: AddressLike,
        payload: BytesLike | None = None,
        *,
        json: object = NO_JSON,
        headers: Mapping[str, str] | None = None,
        echo: bool = False,
        notify: bool = False,
        priority: int = 0,
        publish_id: bytes = b"",
    ) -> int:
        """A plain ``send`` that never suspends: the frame is written to the link's buffer
        (handed to the socket with everything else written in this loop turn) and its
        message id returned. For a sender that may not wait -- a callback, a game loop's tick.

        Raises ``meshbus.WouldBlock``, and sends nothing, while the link's write buffer is
        over its high-water mark (the broker reads slower than this connector writes) or
        the connector is failing over: ``await flush()`` waits for both to pass. That is
        nats.py's choice too (a publish past its pending limit raises): a full buffer is
        the sender's to see, not a memory that grows without bound. The options are
        ``send``'s plain ones."""
        if payload is None or json is not NO_JSON:
            payload = body(payload, json)
        payload, flags = self._plain(payload, echo, notify, priority, publish_id, headers)
        outbound = self._outbound
        msg_id = outbound.try_send(self._raw, as_address(dst).to_bytes(), payload, flags)
        if not msg_id:
            raise outbound.would_block()
        return msg_id

    @overload
    async def send_many(
        self,
        dst: AddressLike,
        payloads: Iterable[BytesLike],
        /,
        *,
        echo: bool = False,
        notify: bool = False,
    ) -> range: ...

    @overload
    async def send_many(
        self,
        messages: Iterable[tuple[AddressLike, BytesLike]],
        /,
        *,
        echo: bool = False,
        notify: bool = False,
    ) -> range: ...

    async def send_many(
        self,
        dst_or_messages: AddressLike | Iterable[tuple[AddressLike, BytesLike]],
        payloads: Iterable[BytesLike] | None = None,
        /,
        *,
        echo: bool = False,
        notify: bool = False,
    ) -> range:
        """Plain sends in one write: ``send_many(dst, payloads)`` sends each payload to
        ``dst``, ``send_many([(dst, payload), ...])`` each payload to its own destination.
        Returns their message ids (consecutive, in the order given).

        It waits as ``send`` does -- out a failover before writing, and while the link's
        write buffer is over its high-water mark after -- and is at most once per message
        as ``send`` is. A payload over the frame limit raises ``meshbus.FrameTooLarge``
        and nothing is sent."""
        if payloads is None:
            if isinstance(dst_or_messages, Address | str):
                raise InvalidArgument(
                    "send_many takes a destination and its payloads, "
                    "or (destination, payload) pairs; got a destination alone"
                )
            messages = [
                (as_address(dst).to_bytes(), *self._plain(payload, echo, notify, 0, b""))
                for dst, payload in dst_or_messages
            ]
        else:
            if not isinstance(dst_or_messages, Address | str):
                raise InvalidArgument(
                    "send_many(dst, payloads): dst is an Address or its text form, "
                    f"not {type(dst_or_messages).__name__}"
                )
            raw = as_address(dst_or_messages).to_bytes()
            messages = [(raw, *self._plain(payload, echo, notify, 0, b"")) for payload in payloads]
        return await self._outbound.send_many(self._raw, messages)

    async def flush(self) -> None:
        """Wait until a send would go out without waiting: the link's write buffer is back
        under its low-water mark, and the connector is linked (after a failover). What was
        written is handed to the socket at once.

        The backpressure wait of ``send_nowait`` and ``reply_nowait`` (``await send``
        waits by itself). It is not a round trip: for "the broker has routed everything
        sent so far", ``await conn.ping()``."""
        await self._outbound.writable()

    def _plain(
        self,
        payload: BytesLike,
        echo: bool,
        notify: bool,
        priority: int,
        publish_id: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[BytesLike, int]:
        """A plain send's payload and flags: with an extension block when it carries a
        priority, a publish id or headers, or is one the broker asked to trace."""
        flags = (FLAG_ECHO if echo else 0) | (FLAG_NOTIFY_DROP if notify else 0)
        sampler = self._sampler
        if sampler.every and sampler.this_one():
            flags |= FLAG_EXT | FLAG_TRACE
            ext = Ext(
                priority=_checked_priority(priority),
                publish_id=_checked_publish_id(publish_id),
                sent_at=time.time(),
                headers=encode_headers(headers),
            )
            return wrap(ext, payload), flags
        if priority or publish_id or headers:
            ext = Ext(
                priority=_checked_priority(priority),
                publish_id=_checked_publish_id(publish_id),
                headers=encode_headers(headers),
            )
            return wrap(ext, payload), flags | FLAG_EXT
        return payload, flags

    async def send_reliable(
        self,
        dst: AddressLike,
        payload: BytesLike | None = None,
        *,
        json: object = NO_JSON,
        headers: Mapping[str, str] | None = None,
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
            payload_bytes(body(payload, json)),
            headers=encode_headers(headers),
            echo=echo,
            group=_group_key(group, final),
            final=final,
            priority=_checked_priority(priority),
            publish_id=_checked_publish_id(publish_id),
            wait=True,
            timeout=_checked_send_timeout(timeout),
        )

    async def send_batch(
        self, dst: AddressLike, rows: Sequence[RowTuple], *, timeout: float | None = None
    ) -> list[tuple[int, int]]:
        """Send ``rows`` -- ``(payload, publish_id)`` or ``(payload, publish_id, priority)``
        tuples -- reliably to ``dst`` in as few frames as the link's ``max_frame`` allows
        (docs/protocol.md §4.9). Every receiver gets each row as a message of its own, in
        order, and a stream stores each row as a message of its own; a frame is
        acknowledged, resent and given up (``Connector.on_delivery_failed``) as one
        reliable message. The publish id (1 to 1024 bytes, required) is what keeps each
        row exactly once when a frame is resent, or a whole job sent again.

        Returns ``(msg_id, rows)`` per frame sent, in order; ``msg_id`` is 0 for a frame
        to a multicast address without members. Waits while 16 batch frames of this
        connector are unacknowledged. A row too large for a frame of its own raises
        ``meshbus.FrameTooLarge``, a row with a bad field ``InvalidArgument``, before
        anything is sent. ``timeout`` as for ``send``. Not for message groups, whose
        messages each have their place in the group: send those with ``send``."""
        raw = as_address(dst).to_bytes()
        timeout = _checked_send_timeout(timeout)
        limit = self._parts.links.max_frame - FRAME_OVERHEAD
        packed = list(pack_rows(rows, limit))  # every row checked before the first send
        sent: list[tuple[int, int]] = []
        for payload, count in packed:
            msg_id = await self._parts.reliable.send(
                self._raw,
                raw,
                payload,
                echo=False,
                group=b"",
                final=False,
                priority=0,
                publish_id=b"",
                wait=False,
                timeout=timeout,
                batch=BATCH_ROWS,
            )
            sent.append((msg_id, count))
        return sent

    # -- the Postina verbs on subjects (docs/nats.md, "NATS and meshbus services") ---------

    async def publish(
        self,
        subject: str,
        payload: BytesLike | None = None,
        *,
        json: object = NO_JSON,
        headers: Mapping[str, str] | None = None,
        priority: int = 0,
        reliable: bool = False,
        echo: bool = False,
    ) -> int:
        """Publish on ``subject`` (any length up to 16 KiB, tokens separated by ``.``, no
        wildcard): every subscription matching it anywhere in the mesh gets it -- the
        services' (``subscribe``) and the NATS clients' -- and, when ``subject`` is a group
        name, the members of ``multicast:SUBJECT``. At most once, like ``send``; ``json``
        and ``headers`` as ``send`` takes them; ``echo``: this service gets it too if it
        subscribed. Returns the message id.

        ``reliable=True`` is the reliable multicast to ``multicast:SUBJECT`` (``send``'s):
        only for a subject that is a group name (at most 15 bytes, no ``:``). Its members
        acknowledge it; subject subscriptions get it once, unacknowledged, and only when
        the group has a member. ``priority`` travels with a reliable publish only (a
        subject carries none). A value it cannot use raises ``meshbus.InvalidArgument``
        before anything is sent."""
        raw = _subject(subject, pattern=False)
        if reliable:
            return await self.send(
                _reliable_group(subject),
                payload,
                json=json,
                headers=headers,
                priority=priority,
                reliable=True,
                echo=echo,
            )
        if priority:
            raise InvalidArgument(
                "a subject carries no priority; publish(..., reliable=True) to a group name "
                "does, or send(Multicast(name), priority=...)"
            )
        if payload is None or json is not NO_JSON:
            payload = body(payload, json)
        flags = FLAG_EXT | (FLAG_ECHO if echo else 0)
        if headers:
            framed = wrap(Ext(subject=raw, headers=encode_headers(headers)), payload)
        else:
            framed = _subject_block(raw) + payload_bytes(payload)
        outbound = self._outbound
        return outbound.try_send(self._raw, SUBJECTS, framed, flags) or await outbound.send_data(
            self._raw, SUBJECTS, framed, flags
        )

    async def subscribe(self, subjects: str | Iterable[str], *, queue: str | None = None) -> None:
        """Receive what is published on ``subjects`` (one pattern or several: ``*`` is any
        one token, a last ``>`` one or more, as in NATS) anywhere in the mesh -- by
        services and NATS clients -- and what is sent to ``multicast:NAME`` for a group
        name they match. Each message comes once, however many of the patterns match it;
        ``msg.subject`` is the subject it was published on. ``queue``: in that queue group,
        one member mesh-wide gets each message, as NATS's queue subscribers. Returns once
        every broker knows it; a bad pattern raises ``meshbus.InvalidArgument`` before any
        is subscribed, a refusal of the broker ``meshbus.JoinFailed`` (past its
        ``--max-subjects``, say), and one of the user's permissions
        ``meshbus.PermissionDenied``."""
        await self._subjects(self._parts.memberships.subscribe, subjects, queue)

    async def unsubscribe(self, subjects: str | Iterable[str], *, queue: str | None = None) -> None:
        """Receive no more of what is published on ``subjects`` (the patterns, and queue
        group, as subscribed)."""
        await self._subjects(self._parts.memberships.unsubscribe, subjects, queue)

    @property
    def subjects(self) -> frozenset[str]:
        """The subject patterns this service is subscribed to (in a queue group or not)."""
        return frozenset(
            subject.decode() for subject, _ in self._parts.memberships.subjects(self._mailbox)
        )

    async def _subjects(
        self,
        change: Callable[[Mailbox, bytes, bytes], Awaitable[None]],
        subjects: str | Iterable[str],
        queue: str | None,
    ) -> None:
        subjects = [subjects] if isinstance(subjects, str) else subjects
        patterns = [_subject(subject, pattern=True) for subject in subjects]
        group = _queue(queue)
        for pattern in patterns:
            try:
                await change(self._mailbox, pattern, group)
            except RegistrationError as exc:
                raise JoinFailed(str(exc), exc.code) from exc

    async def subscribe_other(self, subject: str, address: AddressLike) -> None:
        """Make the service at ``address`` subscribe to the subject pattern ``subject``
        (interest management by a master service). Returns once its connector has the
        request; reliable."""
        await self._command("subscribe", subject, address)

    async def unsubscribe_other(self, subject: str, address: AddressLike) -> None:
        """Make the service at ``address`` unsubscribe from ``subject``
        (``subscribe_other``'s undo)."""
        await self._command("unsubscribe", subject, address)

    async def _command(self, command: str, subject: str, address: AddressLike) -> None:
        pattern = _subject(subject, pattern=True)  # a bad subject fails here
        await self._parts.reliable.send(
            self._raw,
            as_address(address).to_bytes(),
            pattern,
            echo=False,
            group=b"",
            final=False,
            priority=0,
            publish_id=b"",
            wait=True,
            command=command,
        )

    async def broadcast(self, payload: BytesLike, *, priority: int = 0) -> int:
        """Send to every service on the bus (at most once, like ``publish``)."""
        return await self.send(BROADCAST_GROUP, payload, priority=priority, echo=True)

    async def fetch(
        self, stream: str, from_seq: int = 1, max_count: int = 100
    ) -> list[StreamMessage]:
        """Read a durable stream (``Connector.streams.fetch``): ``StreamMessage`` objects
        with ``.seq``, ``.stored_at``, ``.src``, ``.dst`` and ``.payload``."""
        return await self._parts.streams.fetch(stream, from_seq, max_count)

    def add_listener(self, listener: Callable[[Message], object]) -> Callable[[], None]:
        """Call ``listener`` with each message. From then on the queue is off:
        ``next_message``/``recv`` raise ``NoQueue``.

        A plain function runs inline, as the link reads the message: no task, no queue --
        the fastest way to receive. The link reads nothing more until it returns, so a
        slow listener slows its senders through TCP (backpressure with no inbox), and it
        may answer with ``msg.reply_nowait``: the responses to one read leave in one
        write. A coroutine function is run as a task per message instead (no
        backpressure: prefer ``batches`` for work that awaits).

        Returns a function that removes the listener again; once the last one is removed,
        messages queue for ``recv`` as before (the shape of every ``on_...`` here:
        meshbus.client.callbacks)."""
        return self._mailbox.add_listener(listener)

    async def next_message(self, timeout: float | None = None) -> Message:
        """The next message from the queue (Postina's name for ``recv``)."""
        return await self.recv(timeout)

    async def request(
        self,
        dst: AddressLike,
        payload: BytesLike | None = None,
        *,
        json: object = NO_JSON,
        headers: Mapping[str, str] | None = None,
        timeout: float = 5.0,
    ) -> Message:
        """Send a request and wait for its response (``json`` and ``headers`` as ``send``
        takes them; the response's are ``Message.json()`` and ``Message.headers``).

        Raises ``meshbus.Timeout`` when no response comes within ``timeout`` seconds
        (the broker enforces the deadline), ``meshbus.NoRoute`` when nobody serves ``dst``.
        """
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout}")
        timeout_ms = math.ceil(min(timeout, _MAX_TIMEOUT) * 1000)
        return await self._parts.requester.request(
            self._raw, as_address(dst), body(payload, json), timeout_ms, encode_headers(headers)
        )

    # -- receiving --------------------------------------------------------------

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message; ``meshbus.Timeout`` if none arrives within ``timeout`` seconds.

        Several tasks may wait on one service; each message goes to one of them."""
        return await self._mailbox.take(timeout)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        mailbox = self._mailbox
        take_ready = mailbox.take_ready
        while True:
            message = take_ready()  # no suspension while messages wait
            if message is None:
                try:
                    message = await mailbox.take(None)
                except NotConnected:
                    return
            yield message

    def batches(self, max_size: int = 1024) -> AsyncIterator[list[Message]]:
        """``async for batch in svc.batches():`` the messages waiting, as lists of at most
        ``max_size`` -- what one read brought, or more if the service fell behind -- in
        the order they arrived. Ends as ``async for msg in svc`` does.

        Taking a list is one step per read instead of one per message; the inbox stays
        bounded (``max_inbox``), and the responses a batch's requests get with
        ``reply_nowait`` (or ``await msg.reply``, which does not suspend while the link
        takes bytes) leave in one write."""
        if max_size < 1:
            raise InvalidArgument(f"max_size must be at least 1, got {max_size}")
        return self._batches(max_size)

    async def _batches(self, max_size: int) -> AsyncIterator[list[Message]]:
        mailbox = self._mailbox
        while True:
            try:
                batch = await mailbox.take_batch(max_size)
            except NotConnected:
                return
            yield batch

    @property
    def inbox_fills(self) -> int:
        """Times this service's inbox filled up (``max_inbox`` messages): the connector
        stopped reading until it drained to half -- it is a slow consumer, and its senders
        were slowed through TCP. ``Connector.on_slow_consumer`` hears each one."""
        return self._mailbox.fills

    # -- membership ---------------------------------------------------------------

    async def join(self, group: AddressLike) -> None:
        """Join a multicast (topic) or anycast (pool) group."""
        await self._parts.memberships.join(self._mailbox, _group_address(group))

    async def leave(self, group: AddressLike) -> None:
        """Leave a group; leaving a group the service is not in does nothing."""
        await self._parts.memberships.leave(self._mailbox, _group_address(group))

    async def unregister(self) -> None:
        """Remove the service from the bus; its address becomes free."""
        mailbox, forget = self._mailbox, self._parts.memberships.forget
        await self._parts.changes.change(
            ControlType.UNREGISTER,
            AddressBody(address=self._raw),
            Empty,
            lambda _: forget(mailbox),
        )
