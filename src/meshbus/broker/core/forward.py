"""How the broker routes one data frame: the decisions behind the hot path.

``Link._process`` (meshbus.broker.core.link) walks a read buffer and keeps runs of
frames with the same decision; the first frame of each routing key comes to the
``Forwarder``:

* ``route_connector_frame`` -- a frame from a connector: checked in full (flags,
  hops 0, the source is the link's own) and routed to local links and peers;
* ``route_peer_frame`` -- a frame from a peer broker: hop count and link tag
  checked, and routed to *local* links only, never to another broker;
* ``forward`` -- requests and responses (the pending table), and refusals: the frame
  at hand and those right after it with the same routing key, each frame's table work
  done one by one and their deliveries queued as one slice per target;
* ``flush_run`` -- a run of frames queued for its targets, stamped per peer.

Permissions (docs/security.md): a connector's frame is checked against its link's
``permissions`` where its decision is made, and a refusal is a decision too
(``Carry.DENIED``), cached like the others: a user's frames to one destination are
checked once per routing-table version, and an allowed destination's cached
decision costs what it did. With no permissions the check is one attribute test
per decision. A frame to a unicast address its user may not send to still goes
when its extension block names a group (``origin``) the user may send to and that
address is a member of it now: the copy of a reliable or message-group send pinned
to the member the mesh chose. Such frames are decided one by one, never cached; the
block is read only for a frame that would otherwise be refused. Responses are not
checked (who may answer is the pending table's business), nor acks to a unicast
address (a receiver acknowledges whoever sent it a reliable message; an ack is
never delivered as a message).

A decision is cached per routing key by the caller when it can be reused, until
the routing table's version moves (docs/architecture.md, "the routing caches").

A connector's plain multicast also goes to the ``multicast_tap`` of its group, when it
names one: the NATS bridge, for the NATS clients of the whole mesh that want the group's
name as a subject (meshbus.broker.nats.bridge). Only at the entry broker, so they get it
once; the bridge touches the routing table whenever that answer may change.
"""

from __future__ import annotations

import enum
import functools
import logging
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from meshbus.address import (
    ADDRESS_SIZE,
    CAST_ANYCAST,
    CAST_MULTICAST,
    CAST_UNICAST,
    describe_address,
)
from meshbus.broker.core.endpoint import Endpoint, LinkRole
from meshbus.broker.core.outbox import Outbox, TrafficStats
from meshbus.broker.core.pending import WRONG_RESPONDER, PendingTable
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.stamp import stamp_run
from meshbus.broker.security.quotas import REQUESTS
from meshbus.errors import ProtocolError
from meshbus.protocol.codec import FrameError, check_data_flags
from meshbus.protocol.control import DeliveryFailure
from meshbus.protocol.ext import block_of
from meshbus.protocol.layout import (
    DATA_HEADER,
    FLAG_ACK,
    FLAG_ECHO,
    FLAG_EXT,
    FLAG_NOTIFY_DROP,
    FLAG_REQUEST,
    FLAG_RESPONSE,
    FLAG_TRACE,
    OFF_MSG_ID,
    OFF_RESPONSE_FOR,
    OFF_TIMEOUT_MS,
    PEER_HOPS,
    ControlType,
    ErrorCode,
)

if TYPE_CHECKING:
    from meshbus.broker.core.link import Link
    from meshbus.broker.core.usage import UsageTable
    from meshbus.broker.security.permissions import Permissions

log = logging.getLogger("meshbus.broker")

# Frames that take the general path one at a time: never a cached decision or a run.
_PER_FRAME = FLAG_REQUEST | FLAG_RESPONSE | FLAG_NOTIFY_DROP | FLAG_TRACE
_TELL_SENDER = FLAG_REQUEST | FLAG_NOTIFY_DROP
_PEER_PER_FRAME = _TELL_SENDER | FLAG_TRACE
_REQUEST_RESPONSE = FLAG_REQUEST | FLAG_RESPONSE
# A request's decision is cached unless it is traced: a traced one records its hops here.
_REQUEST_OR_TRACE = FLAG_REQUEST | FLAG_TRACE
_unpack_header = DATA_HEADER.unpack_from
_unpack_u64 = struct.Struct(">Q").unpack_from
_REQUEST_OR_EXT = FLAG_REQUEST | FLAG_EXT
_HEADER_SIZE = DATA_HEADER.size
_GROUP_CASTS = (CAST_MULTICAST, CAST_ANYCAST)
# Anycast picks a member per message, so its decisions are never reused.
_CACHEABLE_CASTS = (CAST_UNICAST, CAST_MULTICAST)
_CASTS = (CAST_UNICAST, CAST_MULTICAST, CAST_ANYCAST)

# Records a traced frame's hop: (hop, source, message id, destination).
TraceHop = Callable[[str, bytes, int, bytes], None]


class Carry(enum.Enum):
    """How a cached decision is carried out: plain frames join runs; requests and
    responses each touch the pending table."""

    PLAIN = "plain"
    REQUEST = "request"
    RESPONSE = "response"
    DENIED = "denied"  # the link's user may not send there: dropped, the sender told


PLAIN = Carry.PLAIN


class Decision:
    """A routing decision, valid for every frame with the routing key it was made for
    until the routing table changes: the frame size, the target links, how to carry
    it out, and the frame's source and destination."""

    __slots__ = ("carry", "dst", "refusal", "responders", "size", "src", "targets", "via")

    def __init__(
        self,
        size: int,
        targets: tuple[Endpoint, ...],
        carry: Carry,
        src: bytes,
        dst: bytes,
        refusal: str = "",
    ) -> None:
        self.size = size
        self.targets = targets
        self.carry = carry
        self.src = src
        self.dst = dst
        self.via = _via(targets)  # for a request: the pending entry's ``via``
        self.responders = _responders(dst, targets)  # and its ``responders``
        # DENIED, for a frame that tells its sender: the NO_ROUTE's reason. The routing
        # key holds the flags, so every frame of the decision gets the same text.
        self.refusal = refusal


class Forwarder:
    def __init__(
        self,
        routing: RoutingTable[Endpoint],
        pending: PendingTable[Endpoint],
        outbox: Outbox,
        stats: TrafficStats,
        deadline: Callable[[int], float],
        trace: TraceHop,
        usage: UsageTable,
        multicast_tap: Callable[[bytes], Endpoint | None] = lambda group: None,
    ) -> None:
        """``deadline`` turns a request's timeout_ms (0: the default) into a deadline on
        the broker's clock; ``trace`` records a traced frame's hop (telemetry). A request
        past the pending table's ``max_per_link`` (``--max-requests``), or past its user's
        quota (``usage``), is answered NO_ROUTE at once. ``multicast_tap(group)``: where a
        connector's multicast to ``group`` also goes, if anywhere (module docstring)."""
        self.routing = routing
        self._tap = multicast_tap
        self._pending = pending
        self._outbox = outbox
        self._stats = stats
        self._deadline = deadline
        self._trace = trace
        self._usage = usage
        self._past_cap = (
            f"limit exceeded: this connector already has {pending.max_per_link} requests "
            "waiting for a response (the broker's --max-requests)"
        )

    def flush_run(
        self,
        link: Link,
        targets: tuple[Endpoint, ...],
        frames: memoryview,
        count: int,
        size: int,
    ) -> None:
        """Queue a run of ``count`` frames for each target; ``size`` is the size of each
        frame when they are all the same size, else 0."""
        link.msgs_in += count
        if not targets:
            self._stats.dropped_no_route += count
            return
        self._queue_run(targets, frames, count, size)

    def _queue_run(
        self, targets: tuple[Endpoint, ...], frames: memoryview, count: int, size: int
    ) -> None:
        """Queue ``count`` frames for each target, whose limits the decision checked."""
        queue = self._outbox.queue
        for target in targets:
            peer = target.peer
            if peer is not None:
                queue(target, stamp_run(frames, count, size, peer.tag_out), count)
            else:
                queue(target, frames, count)

    def route_connector_frame(
        self, link: Link, buf: bytearray, mv: memoryview, pos: int, total: int
    ) -> Decision | None:
        """Validate and route the data frame at ``pos``, the first with its routing key.

        Returns the decision when frames with the same key can reuse it (the caller
        carries it out for this frame too); None when this frame was handled on its own."""
        routing = self.routing
        (_, _, _, flags, hops, dst, src, _, msg_id, _, timeout_ms) = _unpack_header(buf, pos)
        if flags & _REQUEST_RESPONSE == _REQUEST_RESPONSE:
            check_data_flags(flags)
        if hops:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR, f"a connector's data frame must have hops 0, not {hops}"
            )
        if not routing.speaks_for(link, link.session, src):
            if src in link.revoked:
                link.msgs_in += 1
                self._stats.dropped_revoked += 1
                return None
            raise FrameError(
                ErrorCode.ADDRESS_NOT_OWNED,
                f"data frame from source {describe_address(src)}, "
                "which this link has not registered",
            )
        cast_type = dst[0]
        permissions = link.permissions
        for_group = False
        if (
            permissions is not None
            and cast_type in _CASTS  # another is the protocol error below
            and not (flags & FLAG_RESPONSE or (flags & FLAG_ACK and cast_type == CAST_UNICAST))
            and not (
                permissions.may_request(dst) if flags & FLAG_REQUEST else permissions.may_send(dst)
            )
        ):
            if flags & _REQUEST_OR_EXT != FLAG_EXT or cast_type != CAST_UNICAST:
                return _denied(permissions, flags, total, src, dst)
            # A copy for a group sent to the member the mesh chose: the group's send
            # right covers it. Decided per frame, never cached: the next frame of this
            # routing key may be for another group, or for none.
            group = _group_named(permissions, mv[pos + _HEADER_SIZE : pos + total])
            if not group:
                link.msgs_in += 1
                self._denied(link, _denied(permissions, flags, total, src, dst), buf, pos)
                return None
            if not routing.is_member(dst, group):
                # Allowed, but the member has left the group (or its join has not reached
                # this broker yet): a stale route, which the sender's next try resolves.
                link.msgs_in += 1
                self._undeliverable(link, flags, msg_id, src, dst)
                return None
            for_group = True
        if not flags & _PER_FRAME and cast_type in _CACHEABLE_CASTS and not for_group:
            if cast_type == CAST_UNICAST:
                owner = routing.route_unicast(dst)
                cacheable: tuple[Endpoint, ...] = (owner,) if owner is not None else ()
            else:
                cacheable = routing.route_multicast(dst, src, link, bool(flags & FLAG_ECHO))
                tap = self._tap(dst)
                if tap is not None:
                    cacheable += (tap,)
            # A link's frame limit is fixed at HELLO, before it owns any address, so a
            # decision that passes this check stays valid for every frame of this key.
            if all(total <= target.max_frame for target in cacheable):
                return Decision(total, cacheable, Carry.PLAIN, src, dst)
        if flags & FLAG_RESPONSE:
            return Decision(total, (), Carry.RESPONSE, src, dst)

        link.msgs_in += 1
        frame = mv[pos : pos + total]
        if cast_type == CAST_UNICAST:
            owner = routing.route_unicast(dst)
            found: tuple[Endpoint, ...] = (owner,) if owner is not None else ()
        elif cast_type == CAST_MULTICAST:
            found = routing.route_multicast(dst, src, link, bool(flags & FLAG_ECHO))
            tap = None if flags & FLAG_REQUEST else self._tap(dst)
            if tap is not None:
                found += (tap,)
        elif cast_type == CAST_ANYCAST:
            one = routing.route_anycast(dst, src, bool(flags & FLAG_ECHO))
            found = (one,) if one is not None else ()
        else:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR, f"destination has unknown cast type {cast_type}"
            )
        outbox = self._outbox
        if not found:
            self._stats.dropped_no_route += 1
            if flags & _TELL_SENDER:
                outbox.no_route(link, msg_id, src, dst)
            return None
        if (
            flags & _REQUEST_OR_TRACE == FLAG_REQUEST
            and cast_type != CAST_ANYCAST
            and all(total <= target.max_frame for target in found)
        ):
            link.msgs_in -= 1  # counted again when the decision is carried out
            return Decision(total, found, Carry.REQUEST, src, dst)
        pending = self._pending
        user = link.user
        tally = None
        if flags & FLAG_REQUEST:
            tally = None if user is None else self._usage.tally_for_request(user)
            if pending.count(link) >= pending.max_per_link or (user is not None and tally is None):
                self._too_many_requests(link, msg_id, src, dst)  # anycast or traced
                return None
        delivered = 0
        for target in found:
            delivered += outbox.deliver(target, frame)
        if not delivered:
            if flags & _TELL_SENDER:
                outbox.no_route(
                    link,
                    msg_id,
                    src,
                    dst,
                    f"the frame of {total} bytes exceeds the receiver's maximum frame size",
                )
            return None
        if flags & FLAG_REQUEST:
            self._stats.requests += 1
            self._pending.add(
                src,
                msg_id,
                link,
                self._deadline(timeout_ms),
                dst,
                _via(found),
                responders=_responders(dst, found),
                tally=tally,
            )
        if flags & FLAG_TRACE:
            self._trace("entry", src, msg_id, dst)
            self._trace_exit(found, src, msg_id, dst)
        return None

    def route_peer_frame(
        self, link: Link, buf: bytearray, mv: memoryview, pos: int, total: int
    ) -> Decision | None:
        """Route the data frame at ``pos`` that came from a peer broker: to local links only.

        The broker where a request entered keeps its pending entry; this one keeps an
        entry only for the members it delivered a group request to (``_answerable_here``).
        Responses are resolved against this broker's table. Frames whose hop count or
        link tag are wrong are dropped and counted, never forwarded."""
        routing = self.routing
        (_, _, _, flags, hops, dst, src, tag, msg_id, _, timeout_ms) = _unpack_header(buf, pos)
        if flags & _REQUEST_RESPONSE == _REQUEST_RESPONSE:
            check_data_flags(flags)
        assert link.peer is not None
        if hops != PEER_HOPS or tag != link.peer.tag_in:
            link.msgs_in += 1
            self._stats.dropped_bad_hop += 1
            log.warning(
                "dropped a frame from a peer with a wrong hop count or link tag",
                extra={"peer": link.name, "hops": hops, "tag": tag, "expected": link.peer.tag_in},
            )
            return None
        if flags & FLAG_RESPONSE:
            return Decision(total, (), Carry.RESPONSE, src, dst)
        cast_type = dst[0]
        found: tuple[Endpoint, ...]
        if cast_type == CAST_UNICAST:
            owner = routing.route_unicast(dst)
            found = (owner,) if owner is not None and not owner.is_peer else ()
        elif cast_type == CAST_MULTICAST:
            found = routing.route_multicast_local(dst)
        elif cast_type == CAST_ANYCAST:
            link.msgs_in += 1
            one = routing.route_anycast_local(dst, src, bool(flags & FLAG_ECHO))
            if one is None or not self._outbox.deliver(one, mv[pos : pos + total]):
                self._undeliverable(link, flags, msg_id, src, dst)
                return None
            if flags & FLAG_REQUEST:
                self._answerable_here(link, src, msg_id, timeout_ms, dst, (one,))
            if flags & FLAG_TRACE:
                self._trace_exit((one,), src, msg_id, dst)
            return None
        else:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR, f"destination has unknown cast type {cast_type}"
            )
        if not found or not all(total <= target.max_frame for target in found):
            link.msgs_in += 1
            self._undeliverable(link, flags, msg_id, src, dst)
            return None
        if flags & _PEER_PER_FRAME:
            # Delivered now; not cached, so a later stale route still reports the drop and
            # a later traced frame is recorded.
            self.flush_run(link, found, mv[pos : pos + total], 1, total)
            if flags & FLAG_REQUEST and cast_type == CAST_MULTICAST:
                self._answerable_here(link, src, msg_id, timeout_ms, dst, found)
            if flags & FLAG_TRACE:
                self._trace_exit(found, src, msg_id, dst)
            return None
        return Decision(total, found, Carry.PLAIN, src, dst)

    def _answerable_here(
        self,
        link: Link,
        src: bytes,
        msg_id: int,
        timeout_ms: int,
        dst: bytes,
        members: tuple[Endpoint, ...],
    ) -> None:
        """A peer's group request went to ``members`` here (the anycast member this
        broker picked, or the links of a multicast's members). Only this broker knows
        them, so only it can tell their response from another connector's: it keeps an
        entry that passes a response back to the peer when it comes from one of them.
        The entry broker takes it from that peer's link alone. No TIMEOUT from here
        (Broker.expire_requests): the requester's broker sends it."""
        deadline = self._deadline(timeout_ms)
        self._pending.add(src, msg_id, link, deadline, dst, responders=members, capped=False)

    def _trace_exit(
        self, targets: tuple[Endpoint, ...], src: bytes, msg_id: int, dst: bytes
    ) -> None:
        """A traced frame leaves the mesh here when it goes to a connector's link."""
        if any(t.role is LinkRole.CONNECTOR for t in targets):
            self._trace("exit", src, msg_id, dst)

    def _undeliverable(self, link: Link, flags: int, msg_id: int, src: bytes, dst: bytes) -> None:
        """A frame whose route went stale found no receiver -- from a peer, on the way; a
        copy for a group, its member left the group: counted, and the sender (or its
        broker) told when the sender waits or asked."""
        self._stats.dropped_no_route += 1
        if flags & _TELL_SENDER:
            self._outbox.no_route(link, msg_id, src, dst, "the route went stale")

    def on_peer_no_route(self, link: Link, correlation: int, body: DeliveryFailure) -> None:
        """NO_ROUTE from a peer about a frame that entered the mesh here: to the requester
        (by the pending entry) or to the sender of a notified send (by its address)."""
        target = self._pending.resolve(body.src, body.msg_id)
        if target is None:
            owner = self.routing.owner(body.src)
            target = owner if owner is not None and not owner.is_peer else None
        if target is not None:
            self._outbox.reply(target, ControlType.NO_ROUTE, body)

    def forward(
        self,
        link: Link,
        decision: Decision,
        key: bytes,
        buf: bytearray,
        mv: memoryview,
        pos: int,
        end: int,
        most: int,
    ) -> int:
        """Carry out a request, response or refusal decision for the frame at ``pos``
        (``mv`` is a view of ``buf``) and for the frames right after it that have its
        routing key ``key``, whole before ``end``: at most ``most`` frames in all (the
        caller looks at the clock between bursts). Returns how many it carried out.

        A burst of requests (or responses) from one pipelining connector is the common
        case: each frame's pending-table work is its own, but consecutive frames bound
        for the same link are queued as one slice, as a run is."""
        size = decision.size
        stop = pos + size
        last = min(end, pos + most * size)
        while stop + size <= last and buf.startswith(key, stop):
            stop += size
        link.msgs_in += (stop - pos) // size
        carry = decision.carry
        if carry is Carry.REQUEST:
            self._requests(link, decision, mv, pos, stop)
        elif carry is Carry.RESPONSE:
            self._responses(link, decision, mv, pos, stop)
        else:
            for at in range(pos, stop, size):
                self._denied(link, decision, buf, at)
        return (stop - pos) // size

    def _requests(
        self, link: Link, decision: Decision, mv: memoryview, pos: int, stop: int
    ) -> None:
        """Record and deliver the requests from ``pos`` to ``stop``. A request is recorded
        first: refused, and not forwarded, past the link's cap (--max-requests) or its
        user's quota; the requests before it leave before its refusal does."""
        size = decision.size
        src = decision.src
        dst = decision.dst
        via = decision.via
        responders = decision.responders
        targets = decision.targets
        user = link.user
        usage = self._usage
        add = self._pending.add
        # The requests of a burst were read at one time: one clock reading serves all
        # those with the same timeout.
        timeout = -1
        expires = 0.0
        at = pos
        waiting = pos  # the first recorded request not queued yet
        for msg_id, timeout_ms in _request_ids(size)(mv[pos:stop]):
            if timeout_ms != timeout:
                timeout = timeout_ms
                expires = self._deadline(timeout_ms)
            tally = None if user is None else usage.tally_for_request(user)
            if (tally is None and user is not None) or not add(
                src, msg_id, link, expires, dst, via, responders=responders, tally=tally
            ):
                if at > waiting:
                    self._queue_run(targets, mv[waiting:at], (at - waiting) // size, size)
                    self._stats.requests += (at - waiting) // size
                self._too_many_requests(link, msg_id, src, dst)
                waiting = at + size
            at += size
        if stop > waiting:
            self._queue_run(targets, mv[waiting:stop], (stop - waiting) // size, size)
            self._stats.requests += (stop - waiting) // size

    def _responses(
        self, link: Link, decision: Decision, mv: memoryview, pos: int, stop: int
    ) -> None:
        """Pass the responses from ``pos`` to ``stop`` back along their pending entries;
        consecutive ones for the same link leave as one slice."""
        size = decision.size
        src = decision.src
        dst = decision.dst
        accept = self._pending.accept_response
        stats = self._stats
        deliver_run = self._outbox.deliver_run
        target: Endpoint | None = None  # where the responses from ``start`` on go
        start = at = pos
        for (response_for,) in _responses_for(size)(mv[pos:stop]):
            requester_link = accept(dst, response_for, src, link)
            to: Endpoint | None = None
            if requester_link is WRONG_RESPONDER:
                stats.dropped_wrong_responder += 1
            elif requester_link is not None and not requester_link.closed:
                to = requester_link
            else:
                if requester_link is None and not link.is_peer:
                    # The request entered the mesh at another broker, which keeps its
                    # pending entry: the response goes there, one hop, and is resolved
                    # there.
                    owner = self.routing.route_unicast(dst)
                    if owner is not None and owner.is_peer:
                        to = owner
                if to is None:
                    stats.late_responses += 1
            if to is not target:
                if target is not None:
                    deliver_run(target, mv[start:at], (at - start) // size, size)
                target = to
                start = at
            at += size
        if target is not None:
            deliver_run(target, mv[start:stop], (stop - start) // size, size)

    def _denied(self, link: Link, decision: Decision, buf: bytearray, pos: int) -> None:
        """A frame its user may not send: dropped and counted; a request or notified send
        gets NO_ROUTE with code PERMISSION_DENIED, naming the permission."""
        self._stats.dropped_denied += 1
        if not decision.refusal:
            return  # the frame does not tell its sender
        (msg_id,) = _unpack_u64(buf, pos + OFF_MSG_ID)
        self._outbox.no_route(
            link,
            msg_id,
            decision.src,
            decision.dst,
            decision.refusal,
            ErrorCode.PERMISSION_DENIED,
        )

    def _too_many_requests(self, link: Link, msg_id: int, src: bytes, dst: bytes) -> None:
        """A request past the link's cap or its user's quota: refused, not forwarded, and
        the requester told now (its ``request()`` raises NoRoute with this reason)."""
        self._stats.dropped_no_route += 1
        user = link.user
        self._outbox.no_route(
            link,
            msg_id,
            src,
            dst,
            (user is not None and self._usage.refusal(user, REQUESTS)) or self._past_cap,
        )


@functools.lru_cache(maxsize=64)
def _request_ids(size: int) -> Callable[[memoryview], Iterator[tuple[int, int]]]:
    """The (msg_id, timeout_ms) of consecutive request frames of ``size`` bytes."""
    return struct.Struct(f">{OFF_MSG_ID}xQ8xI{size - OFF_TIMEOUT_MS - 4}x").iter_unpack


@functools.lru_cache(maxsize=64)
def _responses_for(size: int) -> Callable[[memoryview], Iterator[tuple[int]]]:
    """The response_for of consecutive response frames of ``size`` bytes."""
    return struct.Struct(f">{OFF_RESPONSE_FOR}xQ{size - OFF_RESPONSE_FOR - 8}x").iter_unpack


def _denied(permissions: Permissions, flags: int, total: int, src: bytes, dst: bytes) -> Decision:
    """The refusal of a frame with ``flags`` to ``dst``; its reason (the permission it
    lacks) is written only when the sender is to be told."""
    reason = ""
    if flags & _TELL_SENDER:
        where = describe_address(dst)
        reason = (
            permissions.denial(f"send requests to {where}", "request")
            if flags & FLAG_REQUEST
            else permissions.denial(f"send to {where}", "send")
        )
    return Decision(total, (), Carry.DENIED, src, dst, reason)


def _responders(dst: bytes, targets: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
    """The pending entry's ``responders``: none for a unicast request, whose response must
    come from its destination address; otherwise the links the request went out on."""
    return () if dst[0] == CAST_UNICAST else targets


def _via(targets: tuple[Endpoint, ...]) -> Endpoint | None:
    """The peer a request went to, when it is the only one that can answer it."""
    return targets[0] if len(targets) == 1 and targets[0].is_peer else None


def _group_named(permissions: Permissions, payload: memoryview) -> bytes:
    """The group an EXT frame's payload says it is a copy for (``origin``), when its user
    may send to that group; else b""."""
    try:
        group = block_of(payload).origin
    except ProtocolError:
        return b""
    if len(group) == ADDRESS_SIZE and group[0] in _GROUP_CASTS and permissions.may_send(group):
        return group
    return b""
