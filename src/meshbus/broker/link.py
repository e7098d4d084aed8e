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

from meshbus.broker.forward import (
    PLAIN,
    Decision,
    flush_run,
    forward,
    route_connector_frame,
    route_peer_frame,
)
from meshbus.errors import ProtocolError
from meshbus.protocol.codec import FrameError, decode_body, encode_control, frame_extent
from meshbus.protocol.control import Error
from meshbus.protocol.layout import KIND_CONTROL, ROUTING_KEY_SIZE, ControlType, ErrorCode

if TYPE_CHECKING:
    from meshbus.broker.server import Broker

log = logging.getLogger("meshbus.broker")

_READ_BUFFER = 256 * 1024
_MIN_READ = 64 * 1024
_NO_KEY = b""  # empty, so falsy: no cached routing decision
_unpack_key = struct.Struct(f"{ROUTING_KEY_SIZE}s").unpack_from
# A link sending to more distinct (destination, source, size) keys than this starts over;
# the bound keeps a hostile or unusual sender from growing the cache without limit.
_MAX_DECISIONS = 4096


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
        self.operator = False  # an operator's link (stat, drain): not a connector
        self.wants_synced = False  # a connector that asked for SYNCED after each change
        # Peer links only: the peer's advertised address and slot; the id we gave it
        # (expected at offset 40 of its frames) and the id it gave us (stamped on ours).
        self.is_peer = False
        self.listen = ""
        self.slot = 0
        self.tag_in = link_id
        self.tag_out = bytes(4)
        self.heard = False  # any bytes since the last heartbeat check
        self.misses = 0  # heartbeat intervals in a row without a frame
        self.move_sent = 0.0  # when a connector was told to MOVE (0: never)
        self._blocked = False  # reading stopped until a pending REGISTER is decided
        self._eof = False  # our direction ended (half_close): nothing more may be written
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

    @property
    def closed(self) -> bool:
        return self.state is LinkState.CLOSED

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

    def queued_bytes(self) -> int:
        """Output written to this link that the socket has not taken yet."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

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

    @property
    def writable(self) -> bool:
        """Open for output: not closed, and not half-closed after a goodbye."""
        return self.transport is not None and self.state is not LinkState.CLOSED and not self._eof

    def send(self, data: bytes | bytearray) -> None:
        """Write now (outside a read: timers, other links' control changes)."""
        if self.writable:
            assert self.transport is not None
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
                        if hit[2] is not PLAIN:
                            # A request or response: its own pending-table work, no run.
                            if run_frames:
                                flush_run(self, targets, mv[run_start:pos], run_frames, run_size)
                                run_frames = 0
                            key = _NO_KEY
                            forward(self, hit, pos)
                            pos += hit[0]
                            run_start = pos
                            continue
                        key = seen
                        key_total = hit[0]
                        if hit[1] != targets or not run_frames:
                            if run_frames:
                                flush_run(self, targets, mv[run_start:pos], run_frames, run_size)
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
                    flush_run(self, targets, mv[run_start:pos], run_frames, run_size)
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
                        route_peer_frame(self, buf, mv, pos, total)
                        if self.is_peer
                        else route_connector_frame(self, buf, mv, pos, total)
                    )
                    if decided is not None:
                        (seen,) = _unpack_key(buf, pos)
                        if len(decisions) >= _MAX_DECISIONS:
                            decisions.clear()
                        decisions[seen] = decided
                        if decided[2] is PLAIN:
                            # This frame opens a run, flushed with the frames that follow it.
                            key = seen
                            key_total = run_size = total
                            targets = decided[1]
                            run_start = pos
                            pos += total
                            run_frames = 1
                            continue
                        forward(self, decided, pos)
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
        if self._eof:
            transport.close()  # we already said goodbye; nothing more may be written
            return
        transport.write(
            encode_control(
                ControlType.ERROR, Error(code=int(code), message=message, redirect=redirect)
            )
        )
        transport.close()

    def half_close(self) -> None:
        """Send everything written so far, then end our direction; keep reading until the
        peer closes (closing with unread input would reset the connection instead)."""
        if self.writable:
            assert self.transport is not None
            self.transport.write_eof()
            self._eof = True

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
