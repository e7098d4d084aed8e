"""Frames from the broker, handed to the services, the reliable sender and the waiters.

``Inbound`` is the dispatch of what the links read. What waits for the broker --
control answers, SYNCED, responses -- waits in ``Waiters`` (meshbus.client.waiters),
which it settles.

A data frame is a response (to its waiting request), an ACK (to the reliable
outbox), or a message: fanned out to the connector's members of a group (one copy
per link comes from the broker), checked for duplicates and acknowledged when
reliable, put in order when it belongs to a message group. A control frame answers
a waiting request or brings news: TIMEOUT and NO_ROUTE for a request or a notified
send, LEFT for the ``on_service_left`` handlers. The rest -- what the broker says
to one link, the broker list, MOVE -- is the link's and the keeper's
(meshbus.client.link, meshbus.client.failover). A ``subscribe_other`` from another
service subscribes through ``Memberships`` (meshbus.client.memberships).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from meshbus.address import (
    CAST_ANYCAST,
    CAST_MULTICAST,
    CAST_UNICAST,
    describe_address,
)
from meshbus.client.callbacks import Callbacks
from meshbus.client.link import BrokerLink
from meshbus.client.mailboxes import BROADCAST, Mailbox, Services
from meshbus.client.memberships import Memberships
from meshbus.client.message import Message
from meshbus.client.outbound import Outbound
from meshbus.client.receiving import Receiving
from meshbus.client.reliable import Unacked
from meshbus.client.waiters import Waiters
from meshbus.errors import MeshbusError, NoRoute, PermissionDenied, ProtocolError, Timeout
from meshbus.protocol.batch import BatchRow, received_rows
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

log = logging.getLogger("meshbus.client")

# A data frame with none of these flags is a plain send or a request: no response to
# settle, no ack to take, no extension to read, no duplicate to check.
_NO_EXT: Final = Ext()
_NOT_PLAIN: Final = FLAG_RESPONSE | FLAG_ACK | FLAG_EXT | FLAG_RELIABLE


@dataclass(frozen=True)
class Undeliverable:
    """A ``send(..., notify=True)`` the broker could not deliver (see ``on_undeliverable``):
    ``src`` the sending service and ``dst`` the destination (as text), ``msg_id`` the id
    ``send`` returned, ``reason`` the broker's words."""

    src: str
    dst: str
    msg_id: int
    reason: str


class Inbound:
    """The connector's dispatch of what its links read.

    ``undeliverable`` and ``left`` are the handlers of ``Connector.on_undeliverable``
    and ``on_service_left``; ``dropped`` counts messages nobody here could take."""

    def __init__(
        self,
        services: Services,
        memberships: Memberships,
        waiters: Waiters,
        receiving: Receiving,
        unacked: Unacked,
        outbound: Outbound,
        tasks: BackgroundTasks,
        rng: random.Random,
    ) -> None:
        self._services = services
        self._memberships = memberships
        self._waiters = waiters
        self._receiving = receiving
        self._unacked = unacked
        self._heard = unacked.heard  # bound once: every message from another service calls it
        self._outbound = outbound
        self._tasks = tasks
        self._rng = rng  # which member of an anycast group here gets its message
        self.undeliverable: Callbacks[Callable[[Undeliverable], object]] = Callbacks()
        self.left: Callbacks[Callable[[list[str]], object]] = Callbacks()
        self.dropped = 0

    # -- data frames -----------------------------------------------------------------

    def on_data(self, frame: DataFrame) -> None:
        """A response, an ACK, or a message for services."""
        flags = frame.flags
        dst = frame.dst
        if not flags & _NOT_PLAIN and dst[0] == CAST_UNICAST:
            # The common case, in few steps: a plain send or a request to one service here.
            self._heard(frame.src)
            mailbox = self._services.get(dst)
            if mailbox is None:
                self.dropped += 1
            else:
                mailbox.deliver(
                    Message(frame.src, dst, frame.payload, frame.msg_id, flags, mailbox)
                )
            return
        if flags & FLAG_RESPONSE:
            waiting = self._waiters.response_to((frame.dst, frame.response_for))
            if waiting is None or waiting.done():
                self.dropped += 1
                return
            response_ext = _NO_EXT
            if flags & FLAG_EXT:
                try:
                    response_ext, frame.payload = split(frame.payload)
                except ProtocolError as exc:
                    waiting.set_exception(exc)
                    return
            waiting.set_result(
                Message(
                    frame.src, frame.dst, frame.payload, frame.msg_id, flags, None, response_ext
                )
            )
            return
        if flags & FLAG_ACK:
            self._unacked.on_ack(frame)
            return
        self._heard(frame.src)
        ext: Ext | None = None
        rows: list[BatchRow] = []
        if flags & FLAG_EXT:
            try:
                ext, frame.payload = split(frame.payload)
            except ProtocolError as exc:
                # Another service's bytes, not the broker's: drop the message, keep the link.
                log.warning(
                    "dropped a message from %s with a bad extension: %s",
                    describe_address(frame.src),
                    exc,
                    extra={"error": str(exc)},
                )
                self.dropped += 1
                return
            if flags & FLAG_TRACE:
                report = TraceReport(frame.src, frame.msg_id, frame.dst, ext.sent_at, time.time())
                self._outbound.send_control(ControlType.TRACE, report)
            if ext.batch:
                decoded = self._batch_rows(frame, ext)
                if decoded is None:
                    return
                rows = decoded
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
                        to.deliver(_message(done, to, done_ext, reassigned))
                continue
            if flags & FLAG_RELIABLE and not receiving.accept(member, frame):
                continue
            if ext is not None and ext.batch:
                # One message per row, each deduplicated by its publish id: a batch sent
                # again from a new connector (a retried Spark task) has new message ids.
                for row in rows:
                    if receiving.first_publish(member, row.publish_id):
                        row_ext = Ext(
                            origin=ext.origin, priority=row.priority, publish_id=row.publish_id
                        )
                        message = Message(
                            frame.src, frame.dst, row.payload, frame.msg_id, flags, member, row_ext
                        )
                        member.deliver(message)
            elif ext is None:
                member.deliver(
                    Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, member)
                )
            elif ext.publish_id and not receiving.first_publish(member, ext.publish_id):
                continue
            elif ext.command:
                self._tasks.spawn(self._obey(member, ext.command, frame.payload), "subscribe-other")
            else:
                member.deliver(_message(frame, member, ext, False))

    def _batch_rows(self, frame: DataFrame, ext: Ext) -> list[BatchRow] | None:
        """The rows of a batch frame; None (dropped, counted, not acknowledged) when it
        is not one this connector can deliver: the sender's bytes, not the broker's, so
        the link stays up."""
        try:
            return received_rows(ext, frame.payload)
        except ProtocolError as exc:
            log.warning(
                "dropped a bad batch frame from %s: %s",
                describe_address(frame.src),
                exc,
                extra={"src": describe_address(frame.src), "error": str(exc)},
            )
            self.dropped += 1
            return None

    def _members(self, frame: DataFrame) -> Sequence[Mailbox]:
        """The services here that get a group's frame: its members (one random one of an
        anycast group), not the sender unless it asked for ECHO."""
        dst = frame.dst
        members: Sequence[Mailbox]
        if dst == BROADCAST:  # sent with ECHO: other services here get it too
            members = [s for s in self._services.all() if s.raw != frame.src]
        elif frame.flags & FLAG_ECHO:
            members = self._memberships.members(dst)
        else:
            members = self._memberships.members(dst)
            if self._services.get(frame.src) is not None:
                # Sent by a service here: not back to it. (Only then: copying the members
                # for every group frame showed in the profiles of bench game.)
                members = [m for m in members if m.raw != frame.src]
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
            self._waiters.synced(frame)
            return True
        if self._waiters.answered(frame):
            return True
        if isinstance(body, Left):
            left = [describe_address(address) for address in body.addresses]
            for handler in self.left.handlers:
                handler(left)
            return True
        return False

    def _delivery_failure(self, ctype: int, body: DeliveryFailure) -> None:
        """Each frame the failure names: ``msg_id``, and those of a batch (``also``)."""
        dst = describe_address(body.dst)
        reason = body.reason or f"no service is registered at or member of {dst}"
        denied = reason if body.code == ErrorCode.PERMISSION_DENIED else ""
        self._failed(ctype, body, body.msg_id, dst, reason, denied)
        for msg_id in body.also:
            self._failed(ctype, body, msg_id, dst, reason, denied)

    def _failed(
        self, ctype: int, body: DeliveryFailure, msg_id: int, dst: str, reason: str, denied: str
    ) -> None:
        future = self._waiters.response_to((body.src, msg_id))
        if future is not None:
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
        if self._unacked.no_route(msg_id, denied):
            return  # tried again by the resend timer, or given up when denied
        report = Undeliverable(describe_address(body.src), dst, msg_id, reason)
        if not self.undeliverable.handlers:
            log.warning(
                "undeliverable message %s -> %s (msg id %s): %s",
                report.src,
                report.dst,
                msg_id,
                reason,
                extra={"src": report.src, "dst": report.dst, "reason": reason},
            )
        for handler in self.undeliverable.handlers:
            handler(report)

    async def _obey(self, member: Mailbox, command: str, topic: bytes) -> None:
        """A ``subscribe_other`` / ``unsubscribe_other`` for ``member``: the payload is the
        subject (the broker refuses one that is no valid pattern)."""
        try:
            if command == "subscribe":
                await self._memberships.subscribe(member, topic, b"")
            elif command == "unsubscribe":
                await self._memberships.unsubscribe(member, topic, b"")
        except MeshbusError as exc:
            log.warning(
                "could not %s %s for %s: %s",
                command,
                topic.decode(errors="replace"),
                member.address,
                exc,
                extra={"command": command, "error": str(exc)},
            )


def _message(frame: DataFrame, mailbox: Mailbox, ext: Ext, reassigned: bool) -> Message:
    return Message(
        frame.src, frame.dst, frame.payload, frame.msg_id, frame.flags, mailbox, ext, reassigned
    )
