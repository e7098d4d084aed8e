"""One link of the broker -- to a connector or to a peer broker -- and the hot path.

Its roles, states and transitions are written out in meshbus.broker.core.endpoint; every
transition is a method here.

The hot path (``Link._process``) forwards data frames as the bytes it read.
It never decodes a payload: it reads the 40-byte routing key at the start of
each frame (length, kind, version, flags, hops, destination, source). Frames
with equal keys get the same routing decision, so:

1. a frame whose key equals the previous frame's costs one
   ``bytearray.startswith`` and extends the current run (then, as in 2., the rest
   of the run is matched at C speed);
2. a frame whose key was seen before takes its decision from a per-link cache
   (cleared whenever the routing table changes); a run goes on while the target
   links stay the same, whatever the destination address. Once a run is a few
   frames long, the rest of the read is matched at C speed: the keys of the cached
   decisions with the run's targets and frame size are kept as one set, and
   ``runs.frames_in`` counts how many of the frames that follow have keys in it (a
   producer interleaving destinations on the same link costs a set lookup a frame,
   not a turn of the loop);
3. any other frame is validated in full (prefix, flags, hops, source ownership,
   cast type) and routed by the table; its decision is cached when it can be reused.

A run is written out as one slice. Requests and responses reuse cached
decisions too; each touches the pending table on its own, but a burst of them
with one routing key is carried out by one ``Forwarder.forward`` call, and its
frames for one link leave as one slice. Anycast picks a member per frame and is
never cached. Everything routed during one read is batched per destination link
and written once per link at the end of the read, in arrival order.

A link never holds the loop for more than a slice (about 5 ms, ``slices.SLICE``) of
one loop turn, across all the reads the loop hands it in that turn: control frames
and the dear data frames (every 32nd) look at the clock, and so does the end of a big
read; a run's frames never do. Past the slice the link stops reading until the next
turn (docs/architecture.md §4.4).

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
import logging
import struct
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, cast

from meshbus.broker.core import slices
from meshbus.broker.core.endpoint import CloseReason, Endpoint, LinkRole, LinkState, PeerInfo
from meshbus.broker.core.forward import PLAIN, Decision, Forwarder
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.runs import frames_in, same_key_frames
from meshbus.errors import FrameTooLarge, ProtocolError
from meshbus.protocol.codec import FrameError, decode_body, encode_control, frame_extent
from meshbus.protocol.control import Body, Error
from meshbus.protocol.handshake import (
    MAX_HANDSHAKE_FRAME,
    AcceptingHandshake,
    DiallingHandshake,
)
from meshbus.protocol.layout import (
    KIND_CONTROL,
    ROUTING_KEY_SIZE,
    ControlType,
    ErrorCode,
)

if TYPE_CHECKING:
    from meshbus.broker.core.dispatch import ControlDispatch
    from meshbus.broker.security.permissions import Permissions

log = logging.getLogger("meshbus.broker")

_READ_BUFFER = 256 * 1024
_MIN_READ = 64 * 1024
# Before its handshake a link has a small buffer, enough for any HELLO or WELCOME: a
# connection that never says HELLO holds this much, not 256 KiB (_opening grows it).
_HANDSHAKE_BUFFER = 4 * 1024
_HANDSHAKE_MIN_READ = 1024
# How long a TLS link refused before its handshake was done may take to close.
_REFUSED_TLS_LINGER = 0.5
_NO_KEY = b""  # empty, so falsy: no cached routing decision
_unpack_key = struct.Struct(f"{ROUTING_KEY_SIZE}s").unpack_from
# A link sending to more distinct (destination, source, size) keys than this starts over;
# the bound keeps a hostile or unusual sender from growing the cache without limit.
_MAX_DECISIONS = 4096
# A run this many frames long, its frames all of one size, has the rest of the read
# matched in one C-level pass (``runs.frames_in``): a pass costs a few frames' worth to start,
# so short runs never start one.
_SCAN_AFTER = 8
# Frames of a read that cost more than a run's (requests, responses, refusals, a new
# routing key) between two looks at the clock (every 32nd: this mask's bits all 0): a
# look is dearer than a run's frame, cheap beside these; and a read with fewer never
# starts a slice.
_COSTLY_MASK = 31


class Link(Endpoint, asyncio.BufferedProtocol):
    """The broker's side of one TCP link: to a connector, an operator or a peer broker."""

    def __init__(
        self,
        link_id: int,
        *,
        routing: RoutingTable[Endpoint],
        forwarder: Forwarder,
        dispatch: ControlDispatch,
        outbox: Outbox,
        on_open: Callable[[Link], None],
        on_close: Callable[[Link, CloseReason], None],
        max_frame: int,
        max_pending_bytes: int,
        dialled: bool = False,
    ) -> None:
        """``on_open`` and ``on_close`` tell the broker the link is up, or gone (the
        broker then does the ordered cleanup: docs/architecture.md). ``max_frame`` is
        a dialled link's limit until its handshake sets the one agreed with the peer."""
        # Until its handshake is done, an accepted link takes frames only as large as a
        # HELLO or AUTH: its buffer stays at _HANDSHAKE_BUFFER, never grows towards
        # ``max_frame`` (``_opening`` sets the link's own limit). A dialled one waits for
        # the WELCOME of a broker this one chose to dial.
        super().__init__(
            link_id, LinkRole.HANDSHAKING, max_frame if dialled else MAX_HANDSHAKE_FRAME
        )
        self.state = LinkState.AWAIT_WELCOME if dialled else LinkState.AWAIT_HELLO
        self.dialled = dialled
        self.host = "?"  # the other end's IP address
        self.remote = "?"  # the other end's IP:port
        self.session = b""  # a connector's session (see meshbus.broker.core.routing)
        self.epoch = 0  # links its session opened before this one (Hello.epoch)
        self.wants_synced = False  # a connector that asked for SYNCED after each change
        # The user a connector or operator signed in as (docs/security.md); None when the
        # broker has no users, and on a peer's link.
        self.user: str | None = None
        # What that user may do (meshbus.broker.security.permissions); None: everything. Set by the
        # sign-in as the link opens, before any frame of it is routed; changed only by
        # ``reauthorize``, which drops the cached decisions made with the old one.
        self.permissions: Permissions | None = None
        self.move_sent = 0.0  # when a connector was told to MOVE (0: never)
        self.stat_pages: list[bytes] = []  # the pages of a STATS answer not yet asked for
        # Addresses this connector registered and lost to another after a split (REVOKED):
        # its frames from them, sent before it heard, are dropped, not a protocol error.
        self.revoked: set[bytes] = set()
        # The handshake (meshbus.protocol.handshake): an accepted link waits for HELLO;
        # a dialled one gets its DiallingHandshake with the HELLO it sends (``dial``).
        self.accepting = None if dialled else AcceptingHandshake()
        self.dialling: DiallingHandshake | None = None
        self._routing = routing
        self._forwarder = forwarder
        self._dispatch = dispatch
        self._outbox = outbox
        self._on_open = on_open
        self._on_close = on_close
        self._max_pending_bytes = max_pending_bytes
        self._blocked = False  # reading stopped until a pending REGISTER is decided
        # When this loop turn's slice of the link's reads ends (0: none started); the loop
        # may hand it several reads in one turn (libuv reads a socket while it fills the
        # buffer), and the slice spans them (docs/architecture.md §4.4).
        self._slice_end = 0.0
        self._eof = False  # our direction ended (half_close): nothing more may be written
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(_HANDSHAKE_BUFFER)
        self._mv = memoryview(self._buf)
        self._min_read = _HANDSHAKE_MIN_READ
        self._start = 0
        self._end = 0
        # Routing decisions by routing key, valid for one routing-table version; and the
        # key, frame size and targets of the last data frame read on this link.
        self._decisions: dict[bytes, Decision] = {}
        self._decisions_version = -1
        # The keys of the cached plain decisions, as ``_scan_keys`` yields them, by
        # (targets, frame size): the frames of a run whose keys are all in its group.
        # Cleared with the decisions.
        self._run_keys: dict[tuple[tuple[Endpoint, ...], int], set[tuple[bytes]]] = {}
        self._key = _NO_KEY
        self._key_total = 0
        self._targets: tuple[Endpoint, ...] = ()

    def __repr__(self) -> str:
        return f"<Link {self.link_id} {self.role.value} {self.remote} {self.state.value}>"

    # -- transitions (meshbus.broker.core.endpoint has the table) ----------------------

    def dial(self, handshake: DiallingHandshake) -> None:
        """Start the handshake of a link this broker dialled: send its HELLO."""
        self.dialling = handshake
        self.send(handshake.hello())

    def open_as_connector(
        self,
        name: str,
        session: bytes,
        max_frame: int,
        wants_synced: bool,
        epoch: int = 0,
        user: str | None = None,
        permissions: Permissions | None = None,
        batched_no_route: bool = False,
    ) -> None:
        self._opening(LinkRole.CONNECTOR, name, max_frame)
        self.user = user
        self.permissions = permissions
        self.session = session
        self.epoch = epoch
        self.wants_synced = wants_synced
        self.batched_no_route = batched_no_route

    def open_as_operator(
        self,
        name: str,
        max_frame: int,
        user: str | None = None,
        permissions: Permissions | None = None,
    ) -> None:
        self._opening(LinkRole.OPERATOR, name, max_frame)
        self.user = user
        self.permissions = permissions

    def open_as_peer(self, name: str, info: PeerInfo, max_frame: int) -> None:
        self._opening(LinkRole.PEER, name, max_frame)
        self.peer = info
        self.is_peer = True

    def reauthorize(self, permissions: Permissions | None) -> None:
        """A reload of the config file gave the link's user new permissions. Its cached
        routing decisions were made with the old ones -- a refusal or a permit -- so they
        are dropped, as a routing-table change drops them: the next read decides again.
        Called between reads (a signal handler), never inside ``_process``."""
        self.permissions = permissions
        self._decisions_version = -1

    def _opening(self, role: LinkRole, name: str, max_frame: int) -> None:
        if self.role is not LinkRole.HANDSHAKING or self.state is LinkState.CLOSED:
            raise RuntimeError(f"{self!r} cannot open as {role.value}")
        self.role = role
        self.state = LinkState.OPEN
        self.name = name
        self.max_frame = max_frame
        if len(self._buf) < _READ_BUFFER:
            # The full buffer now that the link is open. Same offsets: ``_process`` may be
            # in the middle of this read, and goes on with the old buffer's bytes.
            buf = bytearray(_READ_BUFFER)
            buf[: self._end] = self._mv[: self._end]
            self._buf = buf
            self._mv = memoryview(buf)
        self._min_read = _MIN_READ

    # -- asyncio callbacks ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        # Unsent output past this is a slow consumer (see pause_writing); the transport
        # checks it on every write at no cost to the hot path.
        high = self._max_pending_bytes
        self.transport.set_write_buffer_limits(high=high, low=high // 2)
        remote = transport.get_extra_info("peername")
        if remote:
            self.came_from(remote[0], remote[1])
        self._on_open(self)

    def shows_certificate(self) -> bool:
        """Whether this link's TLS handshake verified a client certificate against the
        broker's CA."""
        return bool(self.transport and self.transport.get_extra_info("peercert"))

    def came_from(self, host: str, port: int) -> None:
        """The other end's address (the socket's peer name)."""
        self.host = host
        self.remote = f"{host}:{port}"

    def certificate_name(self) -> str:
        """The common name of the client certificate this link's TLS handshake verified
        against the broker's CA; "" without TLS or without a certificate."""
        certificate = self.transport.get_extra_info("peercert") if self.transport else None
        for attribute in (certificate or {}).get("subject", ()):
            for key, value in attribute:
                if key == "commonName":
                    return str(value)
        return ""

    def queued_bytes(self) -> int:
        """Output written to this link that the socket has not taken yet."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buf) - self._end < self._min_read:
            self._make_room()
        return self._mv[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        self.bytes_in += nbytes
        peer = self.peer
        if peer is not None and not peer.hear():
            # Frames that waited out the budget (in the kernel while this loop stalled, or
            # in a network that held them) are not delivered: the peer took this broker
            # for dead, and the group or message may have moved on without them.
            self.fail(
                ErrorCode.PROTOCOL_ERROR,
                "frames came after a silence past the heartbeat budget",
                CloseReason.STALLED,
            )
            return
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

    def _slice_started(self, now: float) -> float:
        """Start this loop turn's slice at ``now``; it ends with the turn."""
        end = self._slice_end = now + slices.SLICE
        asyncio.get_running_loop().call_soon(self._slice_over)
        return end

    def _slice_over(self) -> None:
        self._slice_end = 0.0

    def _past_slice(self) -> bool:
        """Whether this loop turn's slice is used up; the first look starts it."""
        now = perf_counter()
        if not self._slice_end:
            self._slice_started(now)
            return False
        return now > self._slice_end

    def _yield_turn(self) -> None:
        """The slice is used up: leave the rest of what was read, and what the socket
        holds, to the next loop turn, so that one link never holds the loop."""
        self._slice_end = 0.0
        if not self._blocked:
            self.block()
            asyncio.get_running_loop().call_soon(self.unblock)

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
        """Write now (outside a read: timers, other links' control changes). Not to a
        transport that is closing: its socket may be gone before ``connection_lost``
        reaches the link, and uvloop's transport raises on a write then."""
        transport = self.transport
        if self.writable and transport is not None and not transport.is_closing():
            transport.write(data)
            self.bytes_out += len(data)

    def pause_writing(self) -> None:
        """The transport's unsent output passed ``max_pending_bytes`` (its high-water
        mark): a slow consumer. Closed on the next loop turn, not inside ``write``."""
        asyncio.get_running_loop().call_soon(
            self.fail,
            ErrorCode.SLOW_CONSUMER,
            f"slow consumer: more than {self._max_pending_bytes} bytes "
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
        pos = began = self._start
        routing = self._routing
        forwarder = self._forwarder
        flush_run = forwarder.flush_run
        decisions = self._decisions
        run_keys = self._run_keys
        if self._decisions_version != routing.version:
            decisions.clear()
            run_keys.clear()
            self._key = _NO_KEY
            self._decisions_version = routing.version
        key = self._key
        key_total = self._key_total
        targets = self._targets
        run_start = pos
        run_frames = 0
        run_size = key_total  # the size of every frame of the run; 0 once sizes differ
        costly = 0  # frames of this read dearer than a run's (_COSTLY_MASK)
        spent = False  # this loop turn's slice is used up: the rest waits for the next
        try:
            while True:
                # 1. The same routing key as the frame before: extend the run; once it is
                #    a few frames long, by all its frames up to the first of another group.
                if key and buf.startswith(key, pos) and pos + key_total <= end:
                    if run_frames < _SCAN_AFTER or key_total != run_size:
                        pos += key_total
                        run_frames += 1
                        continue
                    counted = same_key_frames(
                        key, run_keys[targets, key_total], buf, mv, pos, end, key_total
                    )
                    pos += counted * key_total
                    run_frames += counted
                    continue
                # 2. A key seen before: its decision is cached; a run continues as long
                #    as the targets stay the same, whatever the destination address.
                if end - pos >= ROUTING_KEY_SIZE:
                    (seen,) = _unpack_key(buf, pos)
                    hit = decisions.get(seen)
                    if hit is not None and pos + hit.size <= end:
                        if hit.carry is not PLAIN:
                            # Requests or responses: each its own pending-table work, no
                            # run. A burst of them with this key is carried out at once, up
                            # to the next look at the clock.
                            if run_frames:
                                flush_run(self, targets, mv[run_start:pos], run_frames, run_size)
                                run_frames = 0
                            key = _NO_KEY
                            costly += 1
                            if not costly & _COSTLY_MASK and self._past_slice():
                                spent = True
                                break
                            burst = forwarder.forward(
                                self,
                                hit,
                                seen,
                                buf,
                                mv,
                                pos,
                                end,
                                _COSTLY_MASK + 1 - (costly & _COSTLY_MASK),
                            )
                            costly += burst - 1
                            pos += burst * hit.size
                            run_start = pos
                            continue
                        key = seen
                        key_total = hit.size
                        if hit.targets != targets or not run_frames:
                            if run_frames:
                                flush_run(self, targets, mv[run_start:pos], run_frames, run_size)
                            targets = hit.targets
                            run_start = pos
                            run_frames = 0
                            run_size = key_total
                        elif key_total != run_size:
                            run_size = 0
                        elif run_frames >= _SCAN_AFTER:
                            # A run of several keys (or one key again after others):
                            # count its frames up to the first of another group at once.
                            # The frame at ``pos`` is in the group, so the count is >= 1.
                            counted = frames_in(
                                run_keys[targets, key_total], mv, pos, end, key_total
                            )
                            pos += counted * key_total
                            run_frames += counted
                            continue
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
                    # A pipelined burst of registrations or joins is handled in slices:
                    # past the slice, the rest waits for the next loop turn, so one link
                    # never holds the loop. A control frame starts the slice if none has
                    # (it counts that frame too, a peer's ROUTES being a few ms of work)
                    # and looks at the clock after it.
                    if not self._slice_end:
                        self._slice_started(perf_counter())
                    self._on_control(bytes(buf[pos : pos + total]))
                    if self._decisions_version != routing.version:
                        decisions.clear()
                        run_keys.clear()
                        self._decisions_version = routing.version
                    if perf_counter() > self._slice_end and self.state is not LinkState.CLOSED:
                        pos += total
                        spent = True
                        break
                elif self.state is not LinkState.OPEN:
                    raise FrameError(
                        ErrorCode.NOT_HANDSHAKEN, "data frame before the HELLO handshake"
                    )
                else:
                    # Data frames are timed too, every 32nd of the dear ones: a flood of
                    # refused requests or sends is microseconds a frame.
                    costly += 1
                    if not costly & _COSTLY_MASK and self._past_slice():
                        spent = True
                        break
                    decided = (
                        forwarder.route_peer_frame(self, buf, mv, pos, total)
                        if self.is_peer
                        else forwarder.route_connector_frame(self, buf, mv, pos, total)
                    )
                    if decided is not None:
                        unpacked = _unpack_key(buf, pos)
                        (seen,) = unpacked
                        if len(decisions) >= _MAX_DECISIONS:
                            decisions.clear()
                            run_keys.clear()
                        decisions[seen] = decided
                        if decided.carry is PLAIN:
                            group = run_keys.get((decided.targets, total))
                            if group is None:
                                group = run_keys[decided.targets, total] = set()
                            group.add(unpacked)
                            # This frame opens a run, flushed with the frames that follow it.
                            key = seen
                            key_total = run_size = total
                            targets = decided.targets
                            run_start = pos
                            pos += total
                            run_frames = 1
                            continue
                        forwarder.forward(self, decided, seen, buf, mv, pos, end, 1)
                pos += total
                run_start = pos
                if self.state is LinkState.CLOSED or self._blocked:
                    break
        except ProtocolError as exc:
            self._start = pos
            code = getattr(exc, "code", ErrorCode.PROTOCOL_ERROR)
            self.fail(code, self._why(exc), reason=CloseReason.PROTOCOL_ERROR)
            return
        self._key = key
        self._key_total = key_total
        self._targets = targets
        self._start = pos
        if pos == end:
            self._start = self._end = 0
        if (
            not spent
            and (self._slice_end or pos - began >= _MIN_READ)
            and not self._blocked
            and self.state is not LinkState.CLOSED
        ):
            # A big read (the loop may hand over another at once), or one more read in a
            # turn whose slice started: cheap frames add up across reads.
            spent = self._past_slice()
        if spent:
            self._yield_turn()
        self._outbox.flush()

    def _why(self, exc: ProtocolError) -> str:
        """What the ERROR that closes the link for ``exc`` says."""
        if isinstance(exc, FrameTooLarge) and self.role is LinkRole.HANDSHAKING:
            return (
                f"a frame of {exc.size} bytes before the handshake is done; until WELCOME "
                f"a link sends only HELLO and AUTH, at most {exc.limit} bytes"
            )
        return str(exc)

    def _on_control(self, frame: bytes) -> None:
        ctype = int.from_bytes(frame[6:8], "big")
        correlation = int.from_bytes(frame[8:12], "big")
        body: Body | None = decode_body(ctype, frame[12:])
        self._dispatch.handle(self, ctype, correlation, body)

    # -- closing ---------------------------------------------------------------

    def fail(self, code: ErrorCode, message: str, reason: CloseReason) -> None:
        """Tell the peer what went wrong in an ERROR frame, then close the link.

        A slow consumer is aborted instead: its output is what is stuck, so a
        graceful close would wait on exactly the bytes it does not read."""
        self.close_with(
            encode_control(ControlType.ERROR, Error(code=int(code), message=message)),
            reason,
            message,
        )

    def close_with(self, last: bytes, reason: CloseReason, why: str) -> None:
        """Write what is queued for this link, then ``last`` (an ERROR frame), then close."""
        if self.state is LinkState.CLOSED:
            return
        log.info(
            "closing link",
            extra={
                "link": self.link_id,
                "remote": self.remote,
                "reason": reason.value,
                "error": why,
            },
        )
        self._outbox.flush()
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
        transport.write(last)
        transport.close()
        if self.role is LinkRole.HANDSHAKING and transport.get_extra_info("ssl_object"):
            # A TLS close waits for the client's close_notify, up to 30 s, holding the
            # socket: a flood of refused connections would run the broker out of file
            # descriptors. A link that never finished its handshake is owed no more than
            # the moment its ERROR takes to leave.
            asyncio.get_running_loop().call_later(_REFUSED_TLS_LINGER, transport.abort)

    def half_close(self) -> None:
        """Send everything written so far, then end our direction; keep reading until the
        peer closes (closing with unread input would reset the connection instead)."""
        if self.writable:
            assert self.transport is not None
            # TLS cannot half-close: there we stop writing and go on reading all the same.
            if self.transport.can_write_eof():
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
        self._on_close(self, reason)

    def _make_room(self) -> None:
        """Called when under ``_min_read`` bytes are free: move the unread tail to the front,
        and grow the buffer if that is not enough (a frame larger than the buffer)."""
        pending = self._end - self._start
        size = len(self._buf)
        if size - pending >= self._min_read and pending <= self._start:
            # Room enough once the tail (mostly part of one frame) is moved to the front,
            # and the two do not overlap: moved in place. Nothing holds a view of the
            # buffer between reads -- the outbox was flushed at the end of ``_process``,
            # and the loop takes a view only from here to ``buffer_updated`` -- while a
            # fresh buffer costs an allocation, its zeroing and its page faults per read.
            self._buf[:pending] = self._mv[self._start : self._end]
            self._start, self._end = 0, pending
            return
        if size - pending < self._min_read:
            size = min(2 * size, self.max_frame + _READ_BUFFER)
        # A fresh buffer rather than a resize: a bytearray with live views (``_mv``)
        # cannot be resized.
        buf = bytearray(size)
        buf[:pending] = self._mv[self._start : self._end]
        self._buf = buf
        self._mv = memoryview(buf)
        self._start, self._end = 0, pending
