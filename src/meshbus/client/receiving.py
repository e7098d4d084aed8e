"""The receiving side of the guarantees: acknowledgements, duplicates, group order.

Each reliable frame is acknowledged -- also a duplicate, whose first ack may have
been lost -- and delivered only if its (receiving service, source, message id) is
not in the ``SeenWindow``; a message with a publish id only if its (receiving
service, publish id) is not either. A message of a message group is acknowledged
when it is released in the group's order, not when it arrives: one held back for an
earlier one is not delivered yet, and should the group move to another member
before the gap fills, the sender must send it there too. Acks are gathered and
sent once per loop turn, one ACK frame per (acker, sender) pair: an ack per message
would cost the sender's broker as much routing as the messages themselves. The
messages of a message group are released in the group's order (``GroupOrder``,
meshbus.client.delivery).
The sending side is meshbus.client.reliable.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from meshbus.client.delivery import GroupOrder, SeenWindow
from meshbus.client.outbound import Outbound
from meshbus.protocol.codec import DataFrame
from meshbus.protocol.ext import Ext, ack_frames

if TYPE_CHECKING:
    from meshbus.client.mailboxes import Mailbox
    from meshbus.client.reliable import ReliableConfig

Released = tuple["Mailbox", DataFrame, Ext]


class Receiving:
    """``duplicates`` counts the reliable frames (and repeated publish ids) not delivered
    again."""

    def __init__(self, config: ReliableConfig, outbound: Outbound) -> None:
        self.seen: SeenWindow[tuple[bytes, bytes, int]] = SeenWindow(config.dedupe_window)
        # A publish id names a message across senders: a retried job (a Spark
        # micro-batch) resends from a new connector with new message ids.
        self.published: SeenWindow[tuple[bytes, bytes]] = SeenWindow(config.dedupe_window)
        self.order: GroupOrder[Released] = GroupOrder(idle_timeout=config.group_expiry)
        self.duplicates = 0
        self._outbound = outbound
        self._acks: dict[tuple[bytes, bytes], list[int]] = {}  # (acker, sender) -> ids

    def accept(self, member: Mailbox, frame: DataFrame) -> bool:
        """Acknowledge a reliable frame for ``member``; True when it is new to it."""
        self._ack(member, frame)
        if self.seen.add((member.raw, frame.src, frame.msg_id)):
            return True
        self.duplicates += 1
        return False

    def _ack(self, member: Mailbox, frame: DataFrame) -> None:
        if not self._acks:
            asyncio.get_running_loop().call_soon(self._flush_acks)
        self._acks.setdefault((member.raw, frame.src), []).append(frame.msg_id)

    def first_publish(self, member: Mailbox, publish_id: bytes) -> bool:
        """True unless ``member`` already got a message with this publish id."""
        if self.published.add((member.raw, publish_id)):
            return True
        self.duplicates += 1
        return False

    def in_order(
        self, member: Mailbox, frame: DataFrame, ext: Ext, reliable: bool
    ) -> list[tuple[Released, bool]]:
        """The group messages deliverable now, in the group's order (with reassigned
        flags); each is acknowledged as it is released."""
        key = member.raw + ext.group
        ready: list[tuple[Released, bool]] = []
        if reliable and not self.seen.add((member.raw, frame.src, frame.msg_id)):
            self.duplicates += 1
        else:
            now = asyncio.get_running_loop().time()
            ready = self.order.push(frame.src, key, ext.seq, ext.floor, (member, frame, ext), now)
        released_it = False
        for (to, done, done_ext), _ in ready:
            released_it = released_it or done is frame
            if reliable:
                self._ack(to, done)
            if done_ext.final:
                self.order.end(done.src, key)
        if reliable and not released_it and not self.order.holds(frame.src, key, ext.seq):
            # Delivered before (a duplicate whose first ack may be lost, or a stale copy
            # below where the group is): acknowledged again. One held back is not.
            self._ack(member, frame)
        return ready

    def _flush_acks(self) -> None:
        acks, self._acks = self._acks, {}
        # Lost with the link when there is none: the senders resend, and the duplicates
        # are acknowledged then.
        self._outbound.write_now(
            b"".join(f for (a, s), ids in acks.items() for f in ack_frames(a, s, ids))
        )
