"""Everything a broker writes to its links during one read: deliveries, replies, failures.

Frames routed while a read is handled are not written one by one: they are queued
per destination link and written with one call per link when the read is done
(``flush``), in the order they were routed. That batching is what makes a burst
of small frames cost one system call per link rather than one per frame.

Frames written outside a read (timers, another link's control change) go through
``reply`` and then ``flush``, or straight to ``Endpoint.send``.

The outbox also keeps the counters of what could not be delivered: every drop is
counted by reason and shown by ``meshbus stat`` and the telemetry records.

NO_ROUTE answers to a connector that takes them in batches (``Hello.batched_no_route``)
are batched here: answers queued one right after the other for one link, about frames
from one source to one destination refused alike, go out as one frame, its
``DeliveryFailure.also`` naming the rest -- a flood of refused frames costs a list append
each, and its answer a few bytes each, not a frame.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from meshbus.broker.core.endpoint import Endpoint
from meshbus.broker.core.pending import PendingEntry
from meshbus.broker.core.stamp import stamp_run
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import MAX_ALSO, DeliveryFailure
from meshbus.protocol.layout import ControlType

Frames = memoryview | bytes | bytearray
# A NO_ROUTE's bytes besides its reason and msg_ids (header, keys, addresses, code), and
# the most one msg_id takes: a batch stays within its link's frame limit.
_NO_ROUTE_OVERHEAD = 128
_MSG_ID_BYTES = 9


@dataclass
class TrafficStats:
    """Cumulative counters of requests and of frames the broker could not deliver."""

    requests: int = 0
    timeouts: int = 0
    late_responses: int = 0
    dropped_no_route: int = 0
    dropped_too_large: int = 0
    dropped_bad_hop: int = 0  # frames from a peer with a wrong hop count or link tag
    dropped_revoked: int = 0  # frames from an address its connector lost (REVOKED)
    # Responses from other than who may answer their request (docs/protocol.md §7).
    dropped_wrong_responder: int = 0
    # Frames their sender's user may not send there (docs/security.md, "Permissions").
    dropped_denied: int = 0


class _Batch:
    """NO_ROUTE answers queued one after the other for one link: written as one frame
    into ``parts[slot]`` when the outbox is flushed."""

    __slots__ = ("code", "dst", "msg_ids", "parts", "reason", "room", "slot", "src")

    def __init__(
        self,
        parts: list[Frames],
        msg_id: int,
        src: bytes,
        dst: bytes,
        reason: str,
        code: int,
        room: int,
    ) -> None:
        self.parts = parts
        self.slot = len(parts)
        parts.append(b"")
        self.msg_ids = [msg_id]
        self.src = src
        self.dst = dst
        self.reason = reason
        self.code = code
        self.room = room  # how many msg_ids it may name

    def frame(self) -> bytes:
        msg_ids = self.msg_ids
        body = DeliveryFailure(
            msg_id=msg_ids[0],
            src=self.src,
            dst=self.dst,
            reason=self.reason,
            code=self.code,
            also=msg_ids[1:],
        )
        return encode_control(ControlType.NO_ROUTE, body)


class Outbox:
    def __init__(self, stats: TrafficStats) -> None:
        self.stats = stats
        self._queued: dict[Endpoint, list[Frames]] = {}
        self._batches: list[_Batch] = []  # NO_ROUTE batches queued, written by ``flush``
        self._flush_scheduled = False

    def deliver(self, link: Endpoint, frame: Frames) -> bool:
        """Queue one frame for ``link``, stamped for it when it is a peer.

        False (and counted) when the frame is larger than the link accepts: forwarding
        it would break the receiver's framing and cost it its link."""
        if len(frame) > link.max_frame:
            self.stats.dropped_too_large += 1
            return False
        if link.peer is not None:
            frame = stamp_run(frame, 1, len(frame), link.peer.tag_out)
        self.queue(link, frame, 1)
        return True

    def deliver_run(self, link: Endpoint, frames: Frames, count: int, size: int) -> None:
        """Queue ``count`` frames of ``size`` bytes each for ``link``, as ``deliver``
        would one by one."""
        if size > link.max_frame:
            self.stats.dropped_too_large += count
            return
        if link.peer is not None:
            frames = stamp_run(frames, count, size, link.peer.tag_out)
        self.queue(link, frames, count)

    def queue(self, link: Endpoint, frames: Frames, count: int) -> None:
        """Queue ``count`` frames (one contiguous slice) for ``link`` without checks."""
        link.msgs_out += count
        parts = self._queued.get(link)
        if parts is None:
            self._queued[link] = [frames]
        else:
            parts.append(frames)

    def reply(self, link: Endpoint, type_: ControlType, body: Any, correlation: int = 0) -> None:
        """Queue a control frame for ``link``, after what is already queued for it."""
        parts = self._queued.setdefault(link, [])
        parts.append(encode_control(type_, body, correlation))

    def no_route(
        self, link: Endpoint, msg_id: int, src: bytes, dst: bytes, reason: str = "", code: int = 0
    ) -> None:
        """NO_ROUTE for a request or notified send; ``code`` PERMISSION_DENIED when its
        user may not send there. Batched for a link that takes batches."""
        if not link.batched_no_route:
            self.reply(
                link,
                ControlType.NO_ROUTE,
                DeliveryFailure(msg_id=msg_id, src=src, dst=dst, reason=reason, code=code),
            )
            return
        parts = self._queued.get(link)
        if parts is None:
            parts = self._queued[link] = []
        elif self._batches:
            last = self._batches[-1]
            if (
                last.parts is parts
                and last.slot == len(parts) - 1
                and len(last.msg_ids) < last.room
                and last.src == src
                and last.dst == dst
                and last.reason == reason
                and last.code == code
            ):
                last.msg_ids.append(msg_id)
                return
        room = (link.max_frame - _NO_ROUTE_OVERHEAD - len(reason.encode())) // _MSG_ID_BYTES
        self._batches.append(
            _Batch(parts, msg_id, src, dst, reason, code, max(1, min(room, 1 + MAX_ALSO)))
        )

    def tell_requester(
        self, entry: PendingEntry[Endpoint], outcome: ControlType, reason: str = ""
    ) -> None:
        """TIMEOUT or NO_ROUTE for a pending request, to the link it came in on, now."""
        entry.link.send(
            encode_control(
                outcome,
                DeliveryFailure(
                    msg_id=entry.msg_id, src=entry.requester, dst=entry.dst, reason=reason
                ),
            )
        )

    def flush(self) -> None:
        """Write each link's queued frames in one call, in the order they were queued."""
        if self._batches:
            for batch in self._batches:
                batch.parts[batch.slot] = batch.frame()
            self._batches.clear()
        if not self._queued:
            return
        batches = list(self._queued.items())
        self._queued.clear()
        for link, parts in batches:
            link.send(b"".join(parts))

    def flush_soon(self) -> None:
        """``flush`` at the end of this loop turn: for a part whose input has no flush of
        its own (a NATS client's read, a peer's frame), so what it queues in one turn
        still leaves in one write per link."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_scheduled_now)

    def _flush_scheduled_now(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def forget(self, link: Endpoint) -> None:
        """Drop what is queued for a link that closed."""
        self._queued.pop(link, None)
