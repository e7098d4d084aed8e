"""Frames from the broker, handed to the connector's services and waiters.

A data frame is a response (to its waiting request), an ACK (to the reliable
outbox), or a message: fanned out to the connector's members of a group (one
copy per link comes from the broker), checked for duplicates and acknowledged
when reliable, put in order when it belongs to a message group. A control frame
answers a waiting request or brings news: the broker list, a MOVE, LEFT, an
ERROR before the broker closes the link.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshbus.address import describe_address
from meshbus.client.service import BROADCAST, Message, Service
from meshbus.errors import NoRoute, ProtocolError, Timeout
from meshbus.protocol.codec import ControlFrame, DataFrame
from meshbus.protocol.control import (
    Brokers,
    Bye,
    DeliveryFailure,
    Error,
    Left,
    Move,
    TraceReport,
)
from meshbus.protocol.ext import Ext, split
from meshbus.protocol.layout import ControlType, DataFlags

if TYPE_CHECKING:
    from meshbus.client.connector import Connector
    from meshbus.client.link import BrokerLink

log = logging.getLogger("meshbus.client")

_RESPONSE = int(DataFlags.RESPONSE)
_ECHO = int(DataFlags.ECHO)
_ACK = int(DataFlags.ACK)
_EXT = int(DataFlags.EXT)
_RELIABLE = int(DataFlags.RELIABLE)
_TRACE = int(DataFlags.TRACE)
_CAST_MULTICAST = 2
_CAST_ANYCAST = 3


@dataclass(frozen=True)
class Undeliverable:
    """A ``send(..., notify=True)`` the broker could not deliver (see ``on_undeliverable``)."""

    src: str
    dst: str
    msg_id: int
    reason: str


def on_data(conn: Connector, frame: DataFrame) -> None:
    """A data frame from the broker: a response, an ACK, or a message for services."""
    flags = frame.flags
    if flags & _RESPONSE:
        waiting = conn._requests.get((frame.dst, frame.response_for))
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(
                Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, None)
            )
        else:
            conn.dropped += 1
        return
    reliable = conn._reliable
    if flags & _ACK:
        reliable.on_ack(frame)
        return
    reliable.suspicion.heard(frame.src)
    ext: Ext | None = None
    if flags & _EXT:
        try:
            ext, frame.payload = split(frame.payload)
        except ProtocolError as exc:
            # Another service's bytes, not the broker's: drop the message, keep the link.
            log.warning("dropped a message with a bad extension", extra={"error": str(exc)})
            conn.dropped += 1
            return
        if flags & _TRACE:
            report = TraceReport(frame.src, frame.msg_id, frame.dst, ext.sent_at, time.time())
            conn._send_control(ControlType.TRACE, report)
    cast = frame.dst[0]
    members: list[Service] | tuple[Service, ...]
    if cast in (_CAST_MULTICAST, _CAST_ANYCAST):
        members = conn._members.get(frame.dst, ())
        if frame.dst == BROADCAST:  # sent with ECHO: other services here get it too
            members = [s for s in conn._services.values() if s._raw != frame.src]
        elif not flags & _ECHO:
            members = [m for m in members if m._raw != frame.src]
        if not members:
            conn.dropped += 1
            return
        if cast == _CAST_ANYCAST:
            members = [conn._rng.choice(members)]
    else:
        service = conn._services.get(frame.dst)
        if service is None:
            conn.dropped += 1
            return
        members = (service,)
    for member in members:
        if ext is not None and ext.group and not member._member_of(ext.origin):
            # It left the anycast group: unacknowledged, so the sender asks the group's
            # home again, which moves the group to a member.
            conn.dropped += 1
            continue
        if flags & _RELIABLE and not reliable.accept(member, frame):
            continue
        if ext is None:
            member._deliver(
                Message(frame.src, frame.dst, frame.payload, frame.msg_id, flags, member)
            )
        elif ext.group:
            # A group's sequence must see every frame, a repeated publish id too (a retry
            # from a new connector numbers the group afresh): the check is on release.
            for (to, done, done_ext), reassigned in reliable.in_order(member, frame, ext):
                if not done_ext.publish_id or reliable.first_publish(to, done_ext.publish_id):
                    to._deliver(Message.of(done, to, done_ext, reassigned))
        elif ext.publish_id and not reliable.first_publish(member, ext.publish_id):
            continue
        elif ext.command:
            conn._spawn(member._obey(ext.command, frame.payload), "subscribe-other")
        else:
            member._deliver(Message.of(frame, member, ext, False))


def on_control(conn: Connector, link: BrokerLink, frame: ControlFrame) -> None:
    """A control frame from the broker: an answer, a SYNCED, or news (BROKERS, MOVE, ...)."""
    ctype = frame.type
    body = frame.body
    if ctype in (ControlType.TIMEOUT, ControlType.NO_ROUTE):
        assert isinstance(body, DeliveryFailure)
        _delivery_failure(conn, ctype, body)
        return
    if ctype == ControlType.SYNCED:
        synced = conn._synced_waiters.get(frame.correlation)
        if synced is not None and not synced[0].done():
            synced[0].set_result(frame)
        return
    waiting = conn._control_waiters.get(frame.correlation) if frame.correlation else None
    if waiting is not None:
        if not waiting[0].done():
            waiting[0].set_result(frame)
        return
    if ctype == ControlType.BROKERS:
        assert isinstance(body, Brokers)
        if link is conn._keeper.link:
            conn._keeper.set_brokers(body.brokers)
    elif ctype == ControlType.MOVE:
        assert isinstance(body, Move)
        # Also from a broker this connector is still restoring onto (a failover or a
        # move): the move waits for that to finish, and happens if the link took over.
        if link not in conn._keeper.old:
            conn._keeper.move(body.address, body.reason, link)
    elif ctype == ControlType.ERROR:
        assert isinstance(body, Error)
        link.error = body.message
        log.warning("broker error", extra={"code": body.code, "error": body.message})
    elif ctype == ControlType.BYE:
        assert isinstance(body, Bye)
        link.error = f"the broker said goodbye: {body.reason}"
    elif ctype == ControlType.LEFT:
        assert isinstance(body, Left)
        left = [describe_address(address) for address in body.addresses]
        for handler in conn._left_handlers:
            handler(left)


def _delivery_failure(conn: Connector, ctype: int, body: DeliveryFailure) -> None:
    dst = describe_address(body.dst)
    reason = body.reason or f"no service is registered at or member of {dst}"
    waiting = conn._requests.get((body.src, body.msg_id))
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
    if conn._reliable.no_route(body.msg_id):
        return  # tried again by the resend timer
    report = Undeliverable(describe_address(body.src), dst, body.msg_id, reason)
    if not conn._undeliverable_handlers:
        log.warning(
            "undeliverable message",
            extra={"src": report.src, "dst": report.dst, "reason": reason},
        )
    for handler in conn._undeliverable_handlers:
        handler(report)
