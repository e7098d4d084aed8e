"""Frames from the connector to its broker that wait for no answer.

``Outbound`` numbers data frames (one message id counter per connector), writes
them to the link the connector sends on -- waiting out a failover, and waiting
while the socket's buffer is full, so a fast sender is slowed by TCP rather than
growing memory -- and sends the control frames nobody waits an answer for. What
waits for an answer is meshbus.client.requester.

A send that need not wait does not suspend: ``try_send`` writes at once when the
link is up and its buffer under the high-water mark, which is what ``await send``
tries first and all that ``send_nowait`` does. The link gathers what is written in
one loop turn into one socket write (meshbus.client.link).

``TraceSampler`` picks the plain sends the broker asked to trace (its telemetry):
one in every ``every``, as the WELCOME said.
"""

from __future__ import annotations

import asyncio

from meshbus.client.link import Links
from meshbus.errors import MeshbusError, WouldBlock
from meshbus.protocol.codec import BytesLike, encode_control, encode_data
from meshbus.protocol.control import Body
from meshbus.protocol.layout import ControlType


class Outbound:
    def __init__(self, links: Links) -> None:
        self._links = links
        self._next_msg_id = 1
        self._drain_waiters: list[asyncio.Future[None]] = []

    def new_msg_id(self) -> int:
        msg_id = self._next_msg_id
        self._next_msg_id += 1
        return msg_id

    def try_send(
        self, src: bytes, dst: bytes, payload: BytesLike, flags: int, response_for: int = 0
    ) -> int:
        """Write one data frame if that needs no waiting: its message id, or 0 while the
        connector fails over or the link's write buffer is over its high-water mark (nothing
        is written then). NotConnected or ConnectionLost once the connector ended."""
        links = self._links
        link = links.current
        if link is None or link.write_paused or links.closed or not links.connected.is_set():
            links.check_usable()
            return 0
        msg_id = self._next_msg_id
        link.write(self._frame(dst, src, payload, flags, msg_id, response_for))
        self._next_msg_id = msg_id + 1
        return msg_id

    def would_block(self) -> WouldBlock:
        """Why ``try_send`` wrote nothing, for the caller that may not wait."""
        link = self._links.current
        if link is not None and link.write_paused:
            return WouldBlock(
                f"the link to broker {link.broker_name or link.address} has more bytes waiting "
                "than its high-water mark: await flush() before sending on, or use "
                "await send(), which waits by itself"
            )
        return WouldBlock(
            "the connector is failing over to another broker: await flush() to wait for it, "
            "or use await send(), which waits by itself"
        )

    async def send_data(
        self, src: bytes, dst: bytes, payload: BytesLike, flags: int, *, response_for: int = 0
    ) -> int:
        """Send one data frame with a new message id; returns the id."""
        msg_id = self.new_msg_id()
        await self.write_data(dst, src, payload, flags, msg_id, response_for)
        return msg_id

    async def send_many(self, src: bytes, messages: list[tuple[bytes, BytesLike, int]]) -> range:
        """Send ``messages`` (destination, payload, flags) in one write, numbered in order;
        returns their message ids. Waits out a failover first and a full write buffer
        after, as ``write_data``; FrameTooLarge (nothing sent) if one is over the limit."""
        links = self._links
        link = links.current
        if link is None or not links.connected.is_set() or links.closed:
            link = await links.usable()
        first = self._next_msg_id
        max_frame = links.max_frame
        frames = [
            encode_data(dst, src, payload, msg_id=msg_id, flags=flags, max_frame=max_frame)
            for msg_id, (dst, payload, flags) in enumerate(messages, first)
        ]
        self._next_msg_id = first + len(frames)
        link.write(b"".join(frames))
        if link.write_paused:
            await self.writable()
        return range(first, first + len(frames))

    async def write_data(
        self,
        dst: bytes,
        src: bytes,
        payload: BytesLike,
        flags: int,
        msg_id: int,
        response_for: int = 0,
    ) -> None:
        """Write one data frame (a reliable resend keeps its id); FrameTooLarge if it is
        over the link's limit."""
        links = self._links
        link = links.current
        if link is None or not links.connected.is_set() or links.closed:
            link = await links.usable()
        link.write(self._frame(dst, src, payload, flags, msg_id, response_for))
        if link.write_paused:
            await self.writable()

    def _frame(
        self,
        dst: bytes,
        src: bytes,
        payload: BytesLike,
        flags: int,
        msg_id: int,
        response_for: int,
    ) -> bytes:
        return encode_data(
            dst,
            src,
            payload,
            msg_id=msg_id,
            response_for=response_for,
            flags=flags,
            max_frame=self._links.max_frame,
        )

    async def writable(self) -> None:
        """Return once a send would go out without waiting: the connector is linked (after
        a failover) and its link's write buffer is back under its low-water mark. What was
        written is handed to the socket at once."""
        links = self._links
        link = await links.usable()
        link.flush()
        while link.write_paused:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(future)
            await future
            link = await links.usable()

    def send_control(self, type_: ControlType, body: Body) -> None:
        """A control frame whose answer nobody waits for; dropped while the connector fails
        over or after it ended."""
        self.write_now(encode_control(type_, body))

    def write_now(self, frames: bytes) -> None:
        """Frames that need not survive a failover (ACKs: the senders resend, and the
        duplicates are acknowledged then); dropped when there is no link to write to."""
        link = self._links.sendable()
        if link is not None:
            link.write(frames)

    def resume_writing(self) -> None:
        """The link's socket takes bytes again: wake the senders waiting for it."""
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    def fail(self, error: MeshbusError) -> None:
        """The connector ended: senders waiting for the socket get ``error``."""
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._drain_waiters.clear()


class TraceSampler:
    """Which plain sends to trace: one in every ``every`` (0: none), as the broker asked."""

    def __init__(self) -> None:
        self.every = 0
        self._left = 0

    def reset(self, every: int) -> None:
        """A new broker's WELCOME: its rate, counted afresh."""
        self.every = self._left = every

    def this_one(self) -> bool:
        """Whether the send about to go out is one to trace."""
        self._left -= 1
        if self._left > 0:
            return False
        self._left = self.every
        return True
