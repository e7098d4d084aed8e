"""One link of the broker -- to a connector or to a peer broker -- and the hot path.

Link states and the only transitions allowed between them:

    AWAIT_HELLO   --HELLO ok (connector)-----------> OPEN      (a connector link)
    AWAIT_HELLO   --HELLO ok (role broker)---------> OPEN      (a peer link, accepted)
    AWAIT_WELCOME --WELCOME------------------------> OPEN      (a peer link, dialled)
    AWAIT_HELLO   --anything else------------------> CLOSED    (NOT_HANDSHAKEN)
    AWAIT_*       --refused (full, duplicate, ...)-> CLOSED    (REDIRECT, DUPLICATE_LINK, ...)
    OPEN          --BYE / EOF / fatal error--------> CLOSED
    OPEN (peer)   --no frame for N heartbeats------> CLOSED    (heartbeat-timeout)
    any           --broker stops-------------------> CLOSED    (SHUTTING_DOWN)

The hot path (``Link._process``) forwards data frames as the bytes it read.
It never decodes a payload: it reads the 40-byte routing key at the start of
each frame (length, kind, version, flags, hops, destination, source). Frames
with equal keys get the same routing decision, so:

1. a frame whose key equals the previous frame's costs one
   ``bytearray.startswith`` and extends the current run;
2. a frame whose key was seen before takes its decision from a per-link cache
   (cleared whenever the routing table changes); a run goes on while the target
   links stay the same, whatever the destination address;
3. any other frame is validated in full (prefix, flags, hops, source ownership,
   cast type) and routed by the table; its decision is cached when it can be reused.

A run is written out as one slice. Requests and responses reuse cached
decisions too but are carried out one by one, since each touches the pending
table; anycast picks a member per frame and is never cached. Everything routed
during one read is batched per destination link and written once per link at
the end of the read, in arrival order.

Between brokers (neighbour identifiers): each broker gives each peer a link id
(its ``tag_in``, our link id) and tells it at the handshake; frames sent to a peer
carry the id that peer gave us (``tag_out``) at offset 40, and hops = 1. Both are
written into a copy of the run, per peer, with strided slice assignment -- a
constant number of C-level writes per run, not per frame; the payload and the
rest of the header are the bytes that arrived. A frame that came from a peer is
delivered to local connectors only and never forwarded to another broker: that
rule alone makes loops impossible, and the hop count (must be exactly 1) and the
tag (must be the one we gave that peer) guard it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import struct
from typing import TYPE_CHECKING, cast

from meshbus.address import describe_address
from meshbus.errors import ProtocolError
from meshbus.protocol.codec import (
    FrameError,
    check_data_flags,
    decode_body,
    encode_control,
    frame_extent,
)
from meshbus.protocol.control import DeliveryFailure, Error
from meshbus.protocol.layout import (
    DATA_HEADER,
    KIND_CONTROL,
    KNOWN_DATA_FLAGS,
    OFF_HOPS,
    OFF_LINK_TAG,
    OFF_MSG_ID,
    OFF_RESPONSE_FOR,
    PEER_HOPS,
    ROUTING_KEY_SIZE,
    ControlType,
    DataFlags,
    ErrorCode,
)

if TYPE_CHECKING:
    from meshbus.broker.server import Broker

log = logging.getLogger("meshbus.broker")

_READ_BUFFER = 256 * 1024
_MIN_READ = 64 * 1024
_REQUEST = int(DataFlags.REQUEST)
_RESPONSE = int(DataFlags.RESPONSE)
_ECHO = int(DataFlags.ECHO)
_NOTIFY = int(DataFlags.NOTIFY_DROP)
_PER_FRAME = _REQUEST | _RESPONSE | _NOTIFY
_TELL_SENDER = _REQUEST | _NOTIFY
_REQUEST_RESPONSE = _REQUEST | _RESPONSE
_BAD_FLAGS = ~KNOWN_DATA_FLAGS
_unpack_header = DATA_HEADER.unpack_from
_NO_KEY = b""  # empty, so falsy: no cached routing decision
_unpack_response_for = struct.Struct(">Q").unpack_from
_unpack_request_ids = struct.Struct(">Q8xI").unpack_from  # msg_id, (response_for), timeout_ms

# How a cached decision is carried out: plain frames join runs; requests and responses
# each touch the pending table. The modes are compared by identity.
_PLAIN = "plain"
_REQUEST_MODE = "request"
_RESPONSE_MODE = "response"
# (frame size, target links, mode, source, destination): valid for every frame with the
# routing key it was made for, until the routing table changes.
Decision = tuple[int, tuple["Link", ...], str, bytes, bytes]
_unpack_key = struct.Struct(f"{ROUTING_KEY_SIZE}s").unpack_from
# A link sending to more distinct (destination, source, size) keys than this starts over;
# the bound keeps a hostile or unusual sender from growing the cache without limit.
_MAX_DECISIONS = 4096
_CAST_UNICAST = 1
_CAST_MULTICAST = 2
_CAST_ANYCAST = 3
# Anycast picks a member per message, so its decisions are never reused.
_CACHEABLE_CASTS = (_CAST_UNICAST, _CAST_MULTICAST)


class LinkState(enum.Enum):
    AWAIT_HELLO = "await-hello"
    AWAIT_WELCOME = "await-welcome"
    OPEN = "open"
    CLOSED = "closed"


class CloseReason(enum.Enum):
    """Why a link closed; logged, counted in ``stat``, and sent to the peer when it is an error."""

    CLIENT_BYE = "client-bye"
    CLIENT_EOF = "client-eof"
    CONNECTION_LOST = "connection-lost"
    PROTOCOL_ERROR = "protocol-error"
    SLOW_CONSUMER = "slow-consumer"
    BROKER_SHUTDOWN = "broker-shutdown"
    REFUSED = "refused"  # redirected (full, joining, draining) or a broker name in use
    DUPLICATE_LINK = "duplicate-link"
    HEARTBEAT_TIMEOUT = "heartbeat-timeout"
    PEER_BYE = "peer-bye"


class Link(asyncio.BufferedProtocol):
    """The broker's side of one link: to a connector, or (``is_peer``) to a peer broker."""

    def __init__(self, broker: Broker, link_id: int, *, dialled: bool = False) -> None:
        self.broker = broker
        self.link_id = link_id
        self.state = LinkState.AWAIT_WELCOME if dialled else LinkState.AWAIT_HELLO
        self.dialled = dialled
        self.peer = "?"
        self.name = ""  # the connector's name, or the peer broker's
        self.session = b""  # a connector's session (see meshbus.broker.routing)
        # Peer links only: the peer's advertised address and slot; the id we gave it
        # (expected at offset 40 of its frames) and the id it gave us (stamped on ours).
        self.is_peer = False
        self.listen = ""
        self.slot = 0
        self.tag_in = link_id
        self.tag_out = bytes(4)
        self.heard = False  # any bytes since the last heartbeat check
        self.misses = 0  # heartbeat intervals in a row without a frame
        self.moving = False  # a connector told to MOVE, not yet gone
        self._blocked = False  # reading stopped until a pending REGISTER is decided
        self.transport: asyncio.Transport | None = None
        self.max_frame = broker.config.max_frame
        self._buf = bytearray(_READ_BUFFER)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        # Routing decisions by routing key, valid for one routing-table version; and the
        # key, frame size and targets of the last data frame read on this link.
        self._decisions: dict[bytes, Decision] = {}
        self._decisions_version = -1
        self._key = _NO_KEY
        self._key_total = 0
        self._targets: tuple[Link, ...] = ()
        self.msgs_in = 0
        self.msgs_out = 0
        self.bytes_in = 0
        self.bytes_out = 0

    def __repr__(self) -> str:
        return f"<Link {self.link_id} {self.peer} {self.state.value}>"

    # -- asyncio callbacks ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        # Unsent output past this is a slow consumer (see pause_writing); the transport
        # checks it on every write at no cost to the hot path.
        high = self.broker.config.max_pending_bytes
        self.transport.set_write_buffer_limits(high=high, low=high // 2)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.broker.link_opened(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buf) - self._end < _MIN_READ:
            self._make_room()
        return self._mv[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        self.bytes_in += nbytes
        self.heard = True
        if not self._blocked:
            self._process()

    def block(self) -> None:
        """Stop handling this link's frames (and reading) until ``unblock``: a REGISTER
        waiting for the mesh's answer must be answered before anything after it."""
        self._blocked = True
        if self.transport is not None:
            self.transport.pause_reading()

    def unblock(self) -> None:
        """Carry on with the frames read while blocked; call from its own loop callback."""
        if not self._blocked or self.state is LinkState.CLOSED:
            return
        self._blocked = False
        if self.transport is not None:
            self.transport.resume_reading()
        self._process()

    def eof_received(self) -> bool:
        if self._end > self._start:
            self.fail(
                ErrorCode.PROTOCOL_ERROR,
                f"connection closed inside a frame ({self._end - self._start} bytes unread)",
                reason=CloseReason.PROTOCOL_ERROR,
            )
        else:
            self.close(CloseReason.CLIENT_EOF)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is not LinkState.CLOSED:
            self._closed(CloseReason.CONNECTION_LOST if exc else CloseReason.CLIENT_EOF)

    # -- output -------------------------------------------------------------

    def send(self, data: bytes | bytearray) -> None:
        """Write now (outside a read: timers, other links' control changes)."""
        if self.transport is not None and self.state is not LinkState.CLOSED:
            self.transport.write(data)
            self.bytes_out += len(data)

    def pause_writing(self) -> None:
        """The transport's unsent output passed ``max_pending_bytes`` (its high-water
        mark): a slow consumer. Closed on the next loop turn, not inside ``write``."""
        asyncio.get_running_loop().call_soon(
            self.fail,
            ErrorCode.SLOW_CONSUMER,
            f"slow consumer: more than {self.broker.config.max_pending_bytes} bytes "
            "waiting to be written to this link",
            CloseReason.SLOW_CONSUMER,
        )

    def resume_writing(self) -> None:
        pass  # a link that paused is already being closed

    # -- the hot path -------------------------------------------------------

    def _process(self) -> None:
        buf = self._buf
        mv = self._mv
        end = self._end
        pos = self._start
        broker = self.broker
        decisions = self._decisions
        if self._decisions_version != broker.routing.version:
            decisions.clear()
            self._key = _NO_KEY
            self._decisions_version = broker.routing.version
        key = self._key
        key_total = self._key_total
        targets = self._targets
        run_start = pos
        run_frames = 0
        run_size = key_total  # the size of every frame of the run; 0 once sizes differ
        try:
            while True:
                # 1. The same routing key as the frame before: extend the run.
                if key and buf.startswith(key, pos) and pos + key_total <= end:
                    pos += key_total
                    run_frames += 1
                    continue
                # 2. A key seen before: its decision is cached; a run continues as long
                #    as the targets stay the same, whatever the destination address.
                if end - pos >= ROUTING_KEY_SIZE:
                    (seen,) = _unpack_key(buf, pos)
                    hit = decisions.get(seen)
                    if hit is not None and pos + hit[0] <= end:
                        if hit[2] is not _PLAIN:
                            # A request or response: its own pending-table work, no run.
                            if run_frames:
                                self._flush_run(targets, mv[run_start:pos], run_frames, run_size)
                                run_frames = 0
                            key = _NO_KEY
                            self._forward(hit, pos)
                            pos += hit[0]
                            run_start = pos
                            continue
                        key = seen
                        key_total = hit[0]
                        if hit[1] != targets or not run_frames:
                            if run_frames:
                                self._flush_run(targets, mv[run_start:pos], run_frames, run_size)
                            targets = hit[1]
                            run_start = pos
                            run_frames = 0
                            run_size = key_total
                        elif key_total != run_size:
                            run_size = 0
                        pos += key_total
                        run_frames += 1
                        continue
                # 3. Anything else takes the general path, one frame at a time.
                if run_frames:
                    self._flush_run(targets, mv[run_start:pos], run_frames, run_size)
                    run_frames = 0
                key = _NO_KEY
                total = frame_extent(buf, pos, end, self.max_frame)
                if not total:
                    break
                if buf[pos + 4] == KIND_CONTROL:
                    self._on_control(bytes(buf[pos : pos + total]))
                    if self._decisions_version != broker.routing.version:
                        decisions.clear()
                        self._decisions_version = broker.routing.version
                elif self.state is not LinkState.OPEN:
                    raise FrameError(
                        ErrorCode.NOT_HANDSHAKEN, "data frame before the HELLO handshake"
                    )
                else:
                    decided = (
                        self._route_from_peer(buf, mv, pos, total)
                        if self.is_peer
                        else self._route_one(buf, mv, pos, total)
                    )
                    if decided is not None:
                        (seen,) = _unpack_key(buf, pos)
                        if len(decisions) >= _MAX_DECISIONS:
                            decisions.clear()
                        decisions[seen] = decided
                        if decided[2] is _PLAIN:
                            # This frame opens a run, flushed with the frames that follow it.
                            key = seen
                            key_total = run_size = total
                            targets = decided[1]
                            run_start = pos
                            pos += total
                            run_frames = 1
                            continue
                        self._forward(decided, pos)
                pos += total
                run_start = pos
                if self.state is LinkState.CLOSED or self._blocked:
                    break
        except ProtocolError as exc:
            self._start = pos
            code = getattr(exc, "code", ErrorCode.PROTOCOL_ERROR)
            self.fail(code, str(exc), reason=CloseReason.PROTOCOL_ERROR)
            return
        self._key = key
        self._key_total = key_total
        self._targets = targets
        self._start = pos
        if pos == end:
            self._start = self._end = 0
        broker.flush_outbox()

    def _flush_run(
        self, targets: tuple[Link, ...], frames: memoryview, count: int, size: int
    ) -> None:
        """Queue a run of ``count`` frames for each target; ``size`` is the size of each
        frame when they are all the same size, else 0."""
        self.msgs_in += count
        if not targets:
            self.broker.stats.dropped_no_route += count
            return
        queue = self.broker.queue
        for link in targets:
            if link.is_peer:
                queue(link, stamp_run(frames, count, size, link.tag_out), count)
            else:
                queue(link, frames, count)

    def _route_one(self, buf: bytearray, mv: memoryview, pos: int, total: int) -> Decision | None:
        """Validate and route the data frame at ``pos``, the first with its routing key.

        Returns the decision when frames with the same key can reuse it (the caller
        executes it for this frame too); None when this frame was handled on its own."""
        broker = self.broker
        routing = broker.routing
        (_, _, _, flags, hops, dst, src, _, msg_id, _, timeout_ms) = _unpack_header(buf, pos)
        if flags & _BAD_FLAGS or flags & _REQUEST_RESPONSE == _REQUEST_RESPONSE:
            check_data_flags(flags)
        if hops:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR, f"a connector's data frame must have hops 0, not {hops}"
            )
        # A connector moving to another broker (same session) keeps sending here until
        # it switches over, also after its new broker has taken its addresses.
        if routing.owner(src) is not self and (
            not self.session or routing.session_of(src) != self.session
        ):
            raise FrameError(
                ErrorCode.ADDRESS_NOT_OWNED,
                f"data frame from source {describe_address(src)}, "
                "which this link has not registered",
            )
        cast_type = dst[0]
        if not flags & _PER_FRAME and cast_type in _CACHEABLE_CASTS:
            if cast_type == _CAST_UNICAST:
                owner = routing.route_unicast(dst)
                cacheable: tuple[Link, ...] = (owner,) if owner is not None else ()
            else:
                cacheable = routing.route_multicast(dst, src, self, bool(flags & _ECHO))
            # A link's frame limit is fixed at HELLO, before it owns any address, so a
            # decision that passes this check stays valid for every frame of this key.
            if all(total <= link.max_frame for link in cacheable):
                return (total, cacheable, _PLAIN, src, dst)
        if flags & _RESPONSE:
            return (total, (), _RESPONSE_MODE, src, dst)

        self.msgs_in += 1
        frame = mv[pos : pos + total]
        if cast_type == _CAST_UNICAST:
            owner = routing.route_unicast(dst)
            found: tuple[Link, ...] = (owner,) if owner is not None else ()
        elif cast_type == _CAST_MULTICAST:
            found = routing.route_multicast(dst, src, self, bool(flags & _ECHO))
        elif cast_type == _CAST_ANYCAST:
            one = routing.route_anycast(dst, src, bool(flags & _ECHO))
            found = (one,) if one is not None else ()
        else:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR, f"destination has unknown cast type {cast_type}"
            )
        if not found:
            broker.stats.dropped_no_route += 1
            if flags & _TELL_SENDER:
                broker.no_route(self, msg_id, src, dst)
            return None
        if (
            flags & _REQUEST
            and cast_type != _CAST_ANYCAST
            and all(total <= link.max_frame for link in found)
        ):
            self.msgs_in -= 1  # counted again when the decision is carried out
            return (total, found, _REQUEST_MODE, src, dst)
        delivered = 0
        for link in found:
            delivered += broker.deliver(link, frame)
        if not delivered:
            if flags & _TELL_SENDER:
                broker.no_route(
                    self,
                    msg_id,
                    src,
                    dst,
                    f"the frame of {total} bytes exceeds the receiver's maximum frame size",
                )
            return None
        if flags & _REQUEST:
            broker.stats.requests += 1
            broker.pending.add(src, msg_id, self, broker.deadline(timeout_ms), dst)
        return None

    def _route_from_peer(
        self, buf: bytearray, mv: memoryview, pos: int, total: int
    ) -> Decision | None:
        """Route the data frame at ``pos`` that came from a peer broker: to local links only.

        Requests need no pending entry here (the broker where they entered keeps it);
        responses are resolved against this broker's pending table. Frames whose hop
        count or link tag are wrong are dropped and counted, never forwarded."""
        broker = self.broker
        routing = broker.routing
        (_, _, _, flags, hops, dst, src, tag, msg_id, _, _) = _unpack_header(buf, pos)
        if flags & _BAD_FLAGS or flags & _REQUEST_RESPONSE == _REQUEST_RESPONSE:
            check_data_flags(flags)
        if hops != PEER_HOPS or tag != self.tag_in:
            self.msgs_in += 1
            broker.stats.dropped_bad_hop += 1
            log.warning(
                "dropped a frame from a peer with a wrong hop count or link tag",
                extra={"peer": self.name, "hops": hops, "tag": tag, "expected": self.tag_in},
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
            self.msgs_in += 1
            one = routing.route_anycast_local(dst, src, bool(flags & _ECHO))
            if one is None or not broker.deliver(one, mv[pos : pos + total]):
                self._undeliverable(flags, msg_id, src, dst)
            return None
        else:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR, f"destination has unknown cast type {cast_type}"
            )
        if not found or not all(total <= link.max_frame for link in found):
            self.msgs_in += 1
            self._undeliverable(flags, msg_id, src, dst)
            return None
        if flags & _TELL_SENDER:
            # Delivered now; not cached, so a later stale route still reports the drop.
            self._flush_run(found, mv[pos : pos + total], 1, total)
            return None
        return (total, found, _PLAIN, src, dst)

    def _undeliverable(self, flags: int, msg_id: int, src: bytes, dst: bytes) -> None:
        """A frame from a peer found no local receiver (its route went stale on the way):
        counted, and the sender's broker told when the sender waits or asked."""
        self.broker.stats.dropped_no_route += 1
        if flags & _TELL_SENDER:
            self.broker.reply(
                self,
                ControlType.NO_ROUTE,
                DeliveryFailure(msg_id=msg_id, src=src, dst=dst, reason="the route went stale"),
            )

    def _forward(self, decision: Decision, pos: int) -> None:
        """Carry out a request or response decision for the frame at ``pos``."""
        total, targets, mode, src, dst = decision
        broker = self.broker
        self.msgs_in += 1
        frame = self._mv[pos : pos + total]
        if mode is _RESPONSE_MODE:
            (response_for,) = _unpack_response_for(self._buf, pos + OFF_RESPONSE_FOR)
            requester_link = broker.pending.resolve(dst, response_for)
            if requester_link is None and not self.is_peer:
                # The request entered the mesh at another broker, which keeps its pending
                # entry: the response goes there, one hop, and is resolved there.
                owner = broker.routing.route_unicast(dst)
                if owner is not None and owner.is_peer:
                    broker.deliver(owner, frame)
                    return
            if requester_link is None or requester_link.state is LinkState.CLOSED:
                broker.stats.late_responses += 1
            else:
                broker.deliver(requester_link, frame)
            return
        msg_id, timeout_ms = _unpack_request_ids(self._buf, pos + OFF_MSG_ID)
        for link in targets:
            broker.deliver(link, frame)
        broker.stats.requests += 1
        broker.pending.add(src, msg_id, self, broker.deadline(timeout_ms), dst)

    # -- control frames -------------------------------------------------------

    def _on_control(self, frame: bytes) -> None:
        ctype = int.from_bytes(frame[6:8], "big")
        correlation = int.from_bytes(frame[8:12], "big")
        body = decode_body(ctype, frame[12:])
        if self.state is LinkState.AWAIT_HELLO and ctype != ControlType.HELLO:
            raise FrameError(ErrorCode.NOT_HANDSHAKEN, "the first frame on a link must be HELLO")
        if self.is_peer or self.state is LinkState.AWAIT_WELCOME:
            self.broker.mesh.on_peer_control(self, ctype, correlation, body)
        else:
            self.broker.control.handle(self, ctype, correlation, body)

    # -- closing ---------------------------------------------------------------

    def fail(
        self, code: ErrorCode, message: str, reason: CloseReason, *, redirect: str = ""
    ) -> None:
        """Tell the peer what went wrong in an ERROR frame, then close the link.

        A slow consumer is aborted instead: its output is what is stuck, so a
        graceful close would wait on exactly the bytes it does not read."""
        if self.state is LinkState.CLOSED:
            return
        log.info(
            "closing link",
            extra={
                "link": self.link_id,
                "peer": self.peer,
                "reason": reason.value,
                "error": message,
            },
        )
        self.broker.flush_outbox()
        transport = self.transport
        self._closed(reason)
        if transport is None:
            return
        if reason is CloseReason.SLOW_CONSUMER:
            transport.abort()
            return
        transport.write(
            encode_control(
                ControlType.ERROR, Error(code=int(code), message=message, redirect=redirect)
            )
        )
        transport.close()

    def close(self, reason: CloseReason) -> None:
        if self.state is LinkState.CLOSED:
            return
        self._closed(reason)
        if self.transport is not None:
            self.transport.close()

    def _closed(self, reason: CloseReason) -> None:
        self.state = LinkState.CLOSED
        self.broker.link_closed(self, reason)

    def _make_room(self) -> None:
        """Called when under _MIN_READ bytes are free: move the unread tail to the front,
        and grow the buffer if that is not enough (a frame larger than the buffer)."""
        pending = self._end - self._start
        size = len(self._buf)
        if size - pending < _MIN_READ:
            size = min(2 * size, self.max_frame + _READ_BUFFER)
        # A fresh buffer rather than an in-place move or resize: the loop may still hold
        # views of the old one, and a bytearray with live views cannot be resized.
        buf = bytearray(size)
        buf[:pending] = self._mv[self._start : self._end]
        self._buf = buf
        self._mv = memoryview(buf)
        self._start, self._end = 0, pending


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
