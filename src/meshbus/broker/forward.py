"""How the broker routes one data frame: the decisions behind the hot path.

``Link._process`` (meshbus.broker.link) walks a read buffer and keeps runs of
frames with the same decision; the first frame of each routing key comes here:

* ``route_connector_frame`` -- a frame from a connector: checked in full (flags,
  hops 0, the source is the link's own) and routed to local links and peers;
* ``route_peer_frame`` -- a frame from a peer broker: hop count and link tag
  checked, and routed to *local* links only, never to another broker;
* ``forward`` -- requests and responses, one at a time (the pending table);
* ``flush_run`` -- a run of frames queued for its targets, stamped per peer.

A decision is cached per routing key by the caller when it can be reused.
"""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING

from meshbus.address import describe_address
from meshbus.protocol.codec import FrameError, check_data_flags
from meshbus.protocol.control import DeliveryFailure
from meshbus.protocol.layout import (
    DATA_HEADER,
    OFF_HOPS,
    OFF_LINK_TAG,
    OFF_MSG_ID,
    OFF_RESPONSE_FOR,
    PEER_HOPS,
    ControlType,
    DataFlags,
    ErrorCode,
)

if TYPE_CHECKING:
    from meshbus.broker.link import Link

log = logging.getLogger("meshbus.broker")

_REQUEST = int(DataFlags.REQUEST)
_RESPONSE = int(DataFlags.RESPONSE)
_ECHO = int(DataFlags.ECHO)
_NOTIFY = int(DataFlags.NOTIFY_DROP)
_TRACE = int(DataFlags.TRACE)
# Frames that take the general path one at a time: never a cached decision or a run.
_PER_FRAME = _REQUEST | _RESPONSE | _NOTIFY | _TRACE
_TELL_SENDER = _REQUEST | _NOTIFY
_PEER_PER_FRAME = _TELL_SENDER | _TRACE
_REQUEST_RESPONSE = _REQUEST | _RESPONSE
_unpack_header = DATA_HEADER.unpack_from
_unpack_response_for = struct.Struct(">Q").unpack_from
_unpack_request_ids = struct.Struct(">Q8xI").unpack_from  # msg_id, (response_for), timeout_ms

# How a cached decision is carried out: plain frames join runs; requests and responses
# each touch the pending table. The modes are compared by identity.
PLAIN = "plain"
_REQUEST_MODE = "request"
_RESPONSE_MODE = "response"
# (frame size, target links, mode, source, destination): valid for every frame with the
# routing key it was made for, until the routing table changes.
Decision = tuple[int, tuple["Link", ...], str, bytes, bytes]
_CAST_UNICAST = 1
_CAST_MULTICAST = 2
_CAST_ANYCAST = 3
# Anycast picks a member per message, so its decisions are never reused.
_CACHEABLE_CASTS = (_CAST_UNICAST, _CAST_MULTICAST)


def flush_run(
    link: Link, targets: tuple[Link, ...], frames: memoryview, count: int, size: int
) -> None:
    """Queue a run of ``count`` frames for each target; ``size`` is the size of each
    frame when they are all the same size, else 0."""
    link.msgs_in += count
    if not targets:
        link.broker.stats.dropped_no_route += count
        return
    queue = link.broker.queue
    for target in targets:
        if target.is_peer:
            queue(target, stamp_run(frames, count, size, target.tag_out), count)
        else:
            queue(target, frames, count)


def route_connector_frame(
    link: Link, buf: bytearray, mv: memoryview, pos: int, total: int
) -> Decision | None:
    """Validate and route the data frame at ``pos``, the first with its routing key.

    Returns the decision when frames with the same key can reuse it (the caller
    executes it for this frame too); None when this frame was handled on its own."""
    broker = link.broker
    routing = broker.routing
    (_, _, _, flags, hops, dst, src, _, msg_id, _, timeout_ms) = _unpack_header(buf, pos)
    if flags & _REQUEST_RESPONSE == _REQUEST_RESPONSE:
        check_data_flags(flags)
    if hops:
        raise FrameError(
            ErrorCode.PROTOCOL_ERROR, f"a connector's data frame must have hops 0, not {hops}"
        )
    # A connector moving to another broker (same session) keeps sending here until
    # it switches over, also after its new broker has taken its addresses.
    if routing.owner(src) is not link and (
        not link.session or routing.session_of(src) != link.session
    ):
        raise FrameError(
            ErrorCode.ADDRESS_NOT_OWNED,
            f"data frame from source {describe_address(src)}, which this link has not registered",
        )
    cast_type = dst[0]
    if not flags & _PER_FRAME and cast_type in _CACHEABLE_CASTS:
        if cast_type == _CAST_UNICAST:
            owner = routing.route_unicast(dst)
            cacheable: tuple[Link, ...] = (owner,) if owner is not None else ()
        else:
            cacheable = routing.route_multicast(dst, src, link, bool(flags & _ECHO))
        # A link's frame limit is fixed at HELLO, before it owns any address, so a
        # decision that passes this check stays valid for every frame of this key.
        if all(total <= target.max_frame for target in cacheable):
            return (total, cacheable, PLAIN, src, dst)
    if flags & _RESPONSE:
        return (total, (), _RESPONSE_MODE, src, dst)

    link.msgs_in += 1
    frame = mv[pos : pos + total]
    if cast_type == _CAST_UNICAST:
        owner = routing.route_unicast(dst)
        found: tuple[Link, ...] = (owner,) if owner is not None else ()
    elif cast_type == _CAST_MULTICAST:
        found = routing.route_multicast(dst, src, link, bool(flags & _ECHO))
    elif cast_type == _CAST_ANYCAST:
        one = routing.route_anycast(dst, src, bool(flags & _ECHO))
        found = (one,) if one is not None else ()
    else:
        raise FrameError(ErrorCode.PROTOCOL_ERROR, f"destination has unknown cast type {cast_type}")
    if not found:
        broker.stats.dropped_no_route += 1
        if flags & _TELL_SENDER:
            broker.no_route(link, msg_id, src, dst)
        return None
    if (
        flags & _REQUEST
        and cast_type != _CAST_ANYCAST
        and all(total <= target.max_frame for target in found)
    ):
        link.msgs_in -= 1  # counted again when the decision is carried out
        return (total, found, _REQUEST_MODE, src, dst)
    delivered = 0
    for target in found:
        delivered += broker.deliver(target, frame)
    if not delivered:
        if flags & _TELL_SENDER:
            broker.no_route(
                link,
                msg_id,
                src,
                dst,
                f"the frame of {total} bytes exceeds the receiver's maximum frame size",
            )
        return None
    if flags & _REQUEST:
        broker.stats.requests += 1
        broker.pending.add(src, msg_id, link, broker.deadline(timeout_ms), dst, _via(found))
    if flags & _TRACE:
        broker.telemetry.hop("entry", src, msg_id, dst)
        _trace_exit(link, found, src, msg_id, dst)
    return None


def route_peer_frame(
    link: Link, buf: bytearray, mv: memoryview, pos: int, total: int
) -> Decision | None:
    """Route the data frame at ``pos`` that came from a peer broker: to local links only.

    Requests need no pending entry here (the broker where they entered keeps it);
    responses are resolved against this broker's pending table. Frames whose hop
    count or link tag are wrong are dropped and counted, never forwarded."""
    broker = link.broker
    routing = broker.routing
    (_, _, _, flags, hops, dst, src, tag, msg_id, _, _) = _unpack_header(buf, pos)
    if flags & _REQUEST_RESPONSE == _REQUEST_RESPONSE:
        check_data_flags(flags)
    if hops != PEER_HOPS or tag != link.tag_in:
        link.msgs_in += 1
        broker.stats.dropped_bad_hop += 1
        log.warning(
            "dropped a frame from a peer with a wrong hop count or link tag",
            extra={"peer": link.name, "hops": hops, "tag": tag, "expected": link.tag_in},
        )
        return None
    if flags & _RESPONSE:
        return (total, (), _RESPONSE_MODE, src, dst)
    cast_type = dst[0]
    found: tuple[Link, ...]
    if cast_type == _CAST_UNICAST:
        owner = routing.route_unicast(dst)
        found = (owner,) if owner is not None and not owner.is_peer else ()
    elif cast_type == _CAST_MULTICAST:
        found = routing.route_multicast_local(dst)
    elif cast_type == _CAST_ANYCAST:
        link.msgs_in += 1
        one = routing.route_anycast_local(dst, src, bool(flags & _ECHO))
        if one is None or not broker.deliver(one, mv[pos : pos + total]):
            undeliverable(link, flags, msg_id, src, dst)
        elif flags & _TRACE:
            _trace_exit(link, (one,), src, msg_id, dst)
        return None
    else:
        raise FrameError(ErrorCode.PROTOCOL_ERROR, f"destination has unknown cast type {cast_type}")
    if not found or not all(total <= target.max_frame for target in found):
        link.msgs_in += 1
        undeliverable(link, flags, msg_id, src, dst)
        return None
    if flags & _PEER_PER_FRAME:
        # Delivered now; not cached, so a later stale route still reports the drop and
        # a later traced frame is recorded.
        flush_run(link, found, mv[pos : pos + total], 1, total)
        if flags & _TRACE:
            _trace_exit(link, found, src, msg_id, dst)
        return None
    return (total, found, PLAIN, src, dst)


def _trace_exit(link: Link, targets: tuple[Link, ...], src: bytes, msg_id: int, dst: bytes) -> None:
    """A traced frame leaves the mesh here when it goes to a connector's link."""
    sink = link.broker.streams.sink
    if any(not t.is_peer and t is not sink for t in targets):
        link.broker.telemetry.hop("exit", src, msg_id, dst)


def undeliverable(link: Link, flags: int, msg_id: int, src: bytes, dst: bytes) -> None:
    """A frame from a peer found no local receiver (its route went stale on the way):
    counted, and the sender's broker told when the sender waits or asked."""
    link.broker.stats.dropped_no_route += 1
    if flags & _TELL_SENDER:
        link.broker.reply(
            link,
            ControlType.NO_ROUTE,
            DeliveryFailure(msg_id=msg_id, src=src, dst=dst, reason="the route went stale"),
        )


def forward(link: Link, decision: Decision, pos: int) -> None:
    """Carry out a request or response decision for the frame at ``pos``."""
    total, targets, mode, src, dst = decision
    broker = link.broker
    link.msgs_in += 1
    frame = link._mv[pos : pos + total]
    if mode is _RESPONSE_MODE:
        (response_for,) = _unpack_response_for(link._buf, pos + OFF_RESPONSE_FOR)
        requester_link = broker.pending.resolve(dst, response_for)
        if requester_link is None and not link.is_peer:
            # The request entered the mesh at another broker, which keeps its pending
            # entry: the response goes there, one hop, and is resolved there.
            owner = broker.routing.route_unicast(dst)
            if owner is not None and owner.is_peer:
                broker.deliver(owner, frame)
                return
        if requester_link is None or requester_link.closed:
            broker.stats.late_responses += 1
        else:
            broker.deliver(requester_link, frame)
        return
    msg_id, timeout_ms = _unpack_request_ids(link._buf, pos + OFF_MSG_ID)
    for target in targets:
        broker.deliver(target, frame)
    broker.stats.requests += 1
    broker.pending.add(src, msg_id, link, broker.deadline(timeout_ms), dst, _via(targets))


def _via(targets: tuple[Link, ...]) -> Link | None:
    """The peer a request went to, when it is the only one that can answer it."""
    return targets[0] if len(targets) == 1 and targets[0].is_peer else None


# -- control frames -------------------------------------------------------


_ONE = b"\x01"


def stamp_run(
    frames: memoryview | bytes | bytearray, count: int, size: int, tag: bytes
) -> bytearray:
    """A copy of ``count`` frames (``size`` bytes each, or 0 when sizes differ) with
    hops = 1 and link tag ``tag`` (4 bytes) written in, for one peer.

    Equal sizes: five strided slice assignments, whatever the count. Otherwise a
    walk over the frames' length fields."""
    out = bytearray(frames)
    if size:
        view = memoryview(out)
        view[OFF_HOPS::size] = _ONE * count
        for i in range(4):
            view[OFF_LINK_TAG + i :: size] = tag[i : i + 1] * count
        return out
    pos = 0
    end = len(out)
    while pos < end:
        out[pos + OFF_HOPS] = PEER_HOPS
        out[pos + OFF_LINK_TAG : pos + OFF_LINK_TAG + 4] = tag
        pos += int.from_bytes(out[pos : pos + 4], "big") + 4
    return out
