"""NATS messages on their way to peer brokers: one frame per peer per loop turn.

A message published here that a peer's NATS clients want goes to that peer once,
whatever number of its clients want it, as a row of a NATS_MSGS frame; the peer matches
it again and delivers it to its own clients only (meshbus.broker.nats.router). The rows
of a loop turn are sent at its end, as few frames as ``max_frame`` allows: in one frame,
encoded at C speed with no work per row here, unless they do not fit one; only then are
they sized row by row and split.

Order: route operations announced before a message (a SUB of the same client, say)
leave before it (``flush_routes`` first), so a peer that gets the message knows the
interest that came before it -- a reply to a request finds its inbox.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from meshbus.broker.core.link import Link
from meshbus.errors import FrameTooLarge
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import NatsMessages, NatsRow
from meshbus.protocol.layout import CONTROL_HEADER_SIZE, ControlType

__all__ = ["PeerMessageStats", "PeerMessages"]

log = logging.getLogger("meshbus.broker.nats")

# What msgpack adds to a frame and to each row of it, at most (array and string heads,
# the counts and flags).
_FRAME_OVERHEAD = CONTROL_HEADER_SIZE + 16
_ROW_OVERHEAD = 32
_QUEUE_OVERHEAD = 5


@dataclass
class PeerMessageStats:
    msgs_out: int = 0
    frames_out: int = 0
    too_large: int = 0  # a message larger than the peer's max_frame: not sent


def row_size(row: NatsRow) -> int:
    """The most bytes ``row`` takes in a frame."""
    subject, reply, _, data, _, queues = row
    return (
        len(subject)
        + len(reply)
        + len(data)
        + _ROW_OVERHEAD
        + sum(len(q) + _QUEUE_OVERHEAD for q in queues)
    )


class PeerMessages:
    """The rows queued for each peer in this loop turn."""

    def __init__(self, flush_routes: Callable[[], None]) -> None:
        """``flush_routes`` sends the route operations announced so far."""
        self._flush_routes = flush_routes
        self._queued: dict[Link, list[NatsRow]] = {}
        self.stats = PeerMessageStats()

    def send(self, peer: Link, rows: list[NatsRow]) -> None:
        """Queue ``rows`` for ``peer``; they leave at the end of this loop turn."""
        queued = self._queued
        if not queued:
            asyncio.get_running_loop().call_soon(self.flush)
        waiting = queued.get(peer)
        if waiting is None:
            queued[peer] = rows.copy()  # the caller's list may go to other peers too
        else:
            waiting.extend(rows)

    def flush(self) -> None:
        """Write each peer's rows, in frames of at most its ``max_frame``."""
        queued, self._queued = self._queued, {}
        if not queued:
            return
        self._flush_routes()
        for peer, rows in queued.items():
            try:
                self._write(peer, rows)
            except FrameTooLarge:
                self._split(peer, rows)

    def _split(self, peer: Link, rows: list[NatsRow]) -> None:
        """Rows too many for one frame to ``peer``: in frames of at most its ``max_frame``;
        a row that fits in none is not sent."""
        stats = self.stats
        room = peer.max_frame - _FRAME_OVERHEAD
        frame: list[NatsRow] = []
        size = 0
        for row in rows:
            needs = row_size(row)
            if needs > room:
                stats.too_large += 1
                if stats.too_large == 1:
                    log.warning(
                        "a NATS message too large for a peer's frame was not sent to it",
                        extra={"peer": peer.name, "bytes": needs, "max_frame": peer.max_frame},
                    )
                continue
            if size + needs > room:
                self._write(peer, frame)
                frame, size = [], 0
            frame.append(row)
            size += needs
        if frame:
            self._write(peer, frame)

    def _write(self, peer: Link, rows: list[NatsRow]) -> None:
        """``rows`` to ``peer`` in one frame; FrameTooLarge, nothing sent, past its
        ``max_frame``."""
        frame = encode_control(
            ControlType.NATS_MSGS, NatsMessages(msgs=rows), max_frame=peer.max_frame
        )
        self.stats.msgs_out += len(rows)
        self.stats.frames_out += 1
        peer.send(frame)
