"""Frames from the broker, handed to the services, the reliable sender and the waiters.

``Inbound`` owns what waits for the broker: the answers to control requests (by
correlation), the SYNCED that follows a change's answer, and the responses to
requests (by requester and message id) -- each tied to the link it can only come
over, so losing that link fails exactly those.

A data frame is a response (to its waiting request), an ACK (to the reliable
outbox), or a message: fanned out to the connector's members of a group (one copy
per link comes from the broker), checked for duplicates and acknowledged when
reliable, put in order when it belongs to a message group. A control frame answers
a waiting request or brings news: TIMEOUT and NO_ROUTE for a request or a notified
send, LEFT for the ``on_service_left`` handlers. The rest -- what the broker says
to one link, the broker list, MOVE -- is the link's and the keeper's
(meshbus.client.link).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from meshbus.address import CAST_ANYCAST, CAST_MULTICAST, Multicast, describe_address
from meshbus.client.callbacks import Callbacks
from meshbus.client.mailboxes import BROADCAST, Mailbox, Services
from meshbus.client.outbound import Outbound
from meshbus.client.service import Message
from meshbus.errors import MeshbusError, NoRoute, PermissionDenied, ProtocolError, Timeout
from meshbus.protocol.codec import ControlFrame, DataFrame
from meshbus.protocol.control import DeliveryFailure, Left, TraceReport
from meshbus.protocol.ext import Ext, split
from meshbus.protocol.layout import (
    FLAG_ACK,
    FLAG_ECHO,
    FLAG_EXT,
    FLAG_RELIABLE,
    FLAG_RESPONSE,
    FLAG_TRACE,
    ControlType,
    ErrorCode,
)
from meshbus.util import BackgroundTasks

if TYPE_CHECKING:
    from meshbus.client.link import BrokerLink
    from meshbus.client.receiving import Receiving
    from meshbus.client.reliable import Unacked

log = logging.getLogger("meshbus.client")

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


@dataclass(frozen=True)
class Undeliverable:
    """A ``send(..., notify=True)`` the broker could not deliver (see ``on_undeliverable``)."""

    src: str
    dst: str
    msg_id: int
    reason: str


class Inbound:
    """The connector's dispatch of what its links read, and the waiters for it.

    ``undeliverable`` and ``left`` are the handlers of ``Connector.on_undeliverable``
    and ``on_service_left``; ``dropped`` counts messages nobody here could take."""

    def __init__(
        self,
        services: Services,
        receiving: Receiving,
        unacked: Unacked,
        outbound: Outbound,
        tasks: BackgroundTasks,
    ) -> None:
        self._services = services
        self._receiving = receiving
        self._unacked = unacked
        self._outbound = outbound
        self._tasks = tasks
        self._answers: dict[int, _Answer] = {}
        # SYNCED after the answer to a change: the change is known mesh-wide.
        self._synced: dict[int, tuple[asyncio.Future[ControlFrame], BrokerLink]] = {}
        self._responses: dict[tuple[bytes, int], tuple[asyncio.Future[Message], BrokerLink]] = {}
        self.undeliverable: Callbacks[Callable[[Undeliverable], object]] = Callbacks()
        self.left: Callbacks[Callable[[list[str]], object]] = Callbacks()
        self.dropped = 0
        self._rng = random.Random()

    # -- waiters -------------------------------------------------------------------------

    @contextlib.contextmanager
    def answer(
        self, correlation: int, link: BrokerLink, settle: Callable[[ControlFrame], T]
    ) -> Iterator[asyncio.Future[T]]:
        """The future of the answer with ``correlation`` over ``link``, while in the block:
        what ``settle`` makes of the answer, or what it raised.

        ``settle`` runs as the answer is read, before the frames read with it: a service
        an answer makes is there for the message right behind it."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._answers[correlation] = _Answer(future, link, settle)
        try:
            yield future
        finally:
            self._answers.pop(correlation, None)

    def expect_synced(
        self, correlation: int, link: BrokerLink, future: asyncio.Future[ControlFrame]
    ) -> None:
        """``future`` gets the SYNCED with ``correlation`` over ``link``; it stops waiting
        for it once it is done (or cancelled)."""
        self._synced[correlation] = (future, link)
        future.add_done_callback(lambda _: self._synced.pop(correlation, None))

    def response(
        self, key: tuple[bytes, int], link: BrokerLink
    ) -> contextlib.AbstractContextManager[asyncio.Future[Message]]:
        """The future of the response to request ``key`` (requester, message id) over
        ``link``, while in the block."""
        return _waiting(self._responses, key, link)

    def fail(self, error: MeshbusError, link: BrokerLink | None = None) -> None:
        """Fail what waits for an answer (a control answer, a SYNCED, a response) that can
        only come over ``link``; over any link when it is None."""
        waiting: list[tuple[asyncio.Future[Any], BrokerLink]] = [
            *((answer.future, answer.link) for answer in self._answers.values()),
            *self._synced.values(),
            *self._responses.values(),
        ]
        for future, via in waiting:
            if (link is None or via is link) and not future.done():
                future.set_exception(error)

    # -- data frames -----------------------------------------------------------------

    def on_data(self, frame: DataFrame) -> None:
        """A response, an ACK, or a message for services."""
        flags = frame.flags
        if flags & FLAG_RESPONSE:
            waiting = self._responses.get((frame.dst, frame.response_for))
            if waiting is not None and not waiting[0].done():
                waiting[0].set_result(
                    Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, None)
                )
            else:
                self.dropped += 1
            return
        if flags & FLAG_ACK:
            self._unacked.on_ack(frame)
            return
        self._unacked.heard(frame.src)
        ext: Ext | None = None
        if flags & FLAG_EXT:
            try:
                ext, frame.payload = split(frame.payload)
            except ProtocolError as exc:
                # Another service's bytes, not the broker's: drop the message, keep the link.
                log.warning("dropped a message with a bad extension", extra={"error": str(exc)})
                self.dropped += 1
                return
            if flags & FLAG_TRACE:
                report = TraceReport(frame.src, frame.msg_id, frame.dst, ext.sent_at, time.time())
                self._outbound.send_control(ControlType.TRACE, report)
        dst = frame.dst
        if dst[0] in (CAST_MULTICAST, CAST_ANYCAST):
            members = self._members(frame)
        else:
            mailbox = self._services.get(dst)
            members = () if mailbox is None else (mailbox,)
        if not members:
            self.dropped += 1
            return
        receiving = self._receiving
        for member in members:
            if ext is not None and ext.group and not member.member_of(ext.origin):
                # It left the anycast group: unacknowledged, so the sender asks the group's
                # home again, which moves the group to a member.
                self.dropped += 1
                continue
            if ext is not None and ext.group:
                # A group's sequence must see every frame, a repeated publish id too (a retry
                # from a new connector numbers the group afresh): the check is on release.
                released = receiving.in_order(member, frame, ext, bool(flags & FLAG_RELIABLE))
                for (to, done, done_ext), reassigned in released:
                    if not done_ext.publish_id or receiving.first_publish(to, done_ext.publish_id):
                        to.deliver(Message.of(done, to, done_ext, reassigned))
                continue
            if flags & FLAG_RELIABLE and not receiving.accept(member, frame):
                continue
            if ext is None:
                member.deliver(
                    Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, member)
                )
            elif ext.publish_id and not receiving.first_publish(member, ext.publish_id):
                continue
            elif ext.command:
                self._tasks.spawn(_obey(member, ext.command, frame.payload), "subscribe-other")
            else:
                member.deliver(Message.of(frame, member, ext, False))

    def _members(self, frame: DataFrame) -> Sequence[Mailbox]:
        """The services here that get a group's frame: its members (one random one of an
        anycast group), not the sender unless it asked for ECHO."""
        dst = frame.dst
        members: Sequence[Mailbox]
        if dst == BROADCAST:  # sent with ECHO: other services here get it too
            members = [s for s in self._services.all() if s.raw != frame.src]
        elif frame.flags & FLAG_ECHO:
            members = self._services.members(dst)
        else:
            members = [m for m in self._services.members(dst) if m.raw != frame.src]
        if dst[0] == CAST_ANYCAST and members:
            return [self._rng.choice(members)]
        return members

    # -- control frames --------------------------------------------------------------

    def on_control(self, link: BrokerLink, frame: ControlFrame) -> bool:
        """An answer, a SYNCED, a failed request or send, or LEFT; False for any other
        frame (the link's to handle)."""
        ctype = frame.type
        body = frame.body
        if isinstance(body, DeliveryFailure):  # TIMEOUT, NO_ROUTE
            self._delivery_failure(ctype, body)
            return True
        if ctype == ControlType.SYNCED:
            synced = self._synced.get(frame.correlation)
            if synced is not None and not synced[0].done():
                synced[0].set_result(frame)
            return True
        waiting = self._answers.get(frame.correlation) if frame.correlation else None
        if waiting is not None:
            future = waiting.future
            if not future.done():
                try:
                    future.set_result(waiting.settle(frame))
                except Exception as exc:  # the asker's to raise, not the link's
                    future.set_exception(exc)
            return True
        if isinstance(body, Left):
            left = [describe_address(address) for address in body.addresses]
            for handler in self.left.handlers:
                handler(left)
            return True
        return False

    def _delivery_failure(self, ctype: int, body: DeliveryFailure) -> None:
        dst = describe_address(body.dst)
        reason = body.reason or f"no service is registered at or member of {dst}"
        denied = reason if body.code == ErrorCode.PERMISSION_DENIED else ""
        waiting = self._responses.get((body.src, body.msg_id))
        if waiting is not None:
            future = waiting[0]
            if not future.done():
                if denied:
                    future.set_exception(PermissionDenied(denied))
                elif ctype == ControlType.TIMEOUT:
                    future.set_exception(Timeout(f"no response from {dst} before the deadline"))
                else:
                    future.set_exception(NoRoute(f"no route to {dst}: {reason}", dst))
            return
        if ctype != ControlType.NO_ROUTE:
            return  # a TIMEOUT for a request this side already gave up on
        if self._unacked.no_route(body.msg_id, denied):
            return  # tried again by the resend timer, or given up when denied
        report = Undeliverable(describe_address(body.src), dst, body.msg_id, reason)
        if not self.undeliverable.handlers:
            log.warning(
                "undeliverable message",
                extra={"src": report.src, "dst": report.dst, "reason": reason},
            )
        for handler in self.undeliverable.handlers:
            handler(report)


@dataclass(frozen=True, slots=True)
class _Answer:
    """A control request waiting for its answer."""

    future: asyncio.Future[Any]
    link: BrokerLink
    settle: Callable[[ControlFrame], Any]


@contextlib.contextmanager
def _waiting(
    table: dict[K, tuple[asyncio.Future[V], BrokerLink]], key: K, link: BrokerLink
) -> Iterator[asyncio.Future[V]]:
    future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
    table[key] = (future, link)
    try:
        yield future
    finally:
        table.pop(key, None)


async def _obey(member: Mailbox, command: str, topic: bytes) -> None:
    """A ``subscribe_other`` / ``unsubscribe_other`` for ``member``."""
    try:
        group = Multicast(topic.decode())
        if command == "subscribe":
            await member.service.join(group)
        elif command == "unsubscribe":
            await member.service.leave(group)
    except (MeshbusError, UnicodeDecodeError) as exc:
        log.warning("could not obey", extra={"command": command, "error": str(exc)})
