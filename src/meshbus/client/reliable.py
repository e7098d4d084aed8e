"""Reliable sends and message groups: the connector's side of the guarantees.

Sending (ARCHITECTURE.md section 6). A reliable frame carries the RELIABLE flag;
the sender keeps it in its ``Outbox`` until the receiving connector acknowledges
it with an ACK frame (a 64-byte data frame from the receiving service back to
the sender, ``response_for`` = the message id), resends it after an ack timeout
with backoff, and gives up after ``RetryPolicy.max_attempts``:

* unicast -- the first ack completes it;
* multicast -- the broker names the members first (MEMBERS); one frame goes to
  the group and every member acks; resends go to the members that have not
  acked, one unicast copy each, with the group address in the extension block;
* anycast -- the broker picks the member first, and every attempt goes to that
  one member, so exactly one member gets it;
* a message group -- the group's home broker binds the group to one member
  (GROUP_BIND, see meshbus.broker.groups); every message of the group goes to
  that member with the group's sequence number, and the receiver delivers them
  in order (``GroupOrder``). A member that cannot be reached is reported with
  the next GROUP_BIND; the home moves the group once the member is gone for good.

After a failover every unacknowledged message is resent at once, in the order
it was first sent. Giving up raises ``DeliveryFailed`` from ``send_reliable``
and calls the ``on_delivery_failed`` handlers; it also adds a suspicion against
the receiver (``Suspicion``), and one declared dead is reported to the
``on_suspected_dead`` handlers.

Receiving: each reliable frame is acknowledged -- also a duplicate, whose first
ack may have been lost -- and delivered only if its (receiving service, source,
message id) is not in the ``SeenWindow``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from meshbus.address import describe_address
from meshbus.client.delivery import GroupOrder, Outbox, RetryPolicy, SeenWindow, Suspicion
from meshbus.errors import (
    DeliveryFailed,
    InvalidArgument,
    MeshbusError,
    NoRoute,
    ProtocolError,
)
from meshbus.protocol.codec import DataFrame
from meshbus.protocol.control import GroupBind, GroupBound, GroupEnd, MemberList, MembersRequest
from meshbus.protocol.ext import Ext, ack_frames, unpack_acks, wrap
from meshbus.protocol.layout import ControlType, DataFlags

if TYPE_CHECKING:
    from meshbus.client.connector import Connector
    from meshbus.client.service import Service

log = logging.getLogger("meshbus.client")

_RELIABLE = int(DataFlags.RELIABLE | DataFlags.NOTIFY_DROP)
_EXT = int(DataFlags.EXT)
_ECHO = int(DataFlags.ECHO)
_CAST_MULTICAST = 2
_CAST_ANYCAST = 3
# The finest the resend timer ticks; an ack timeout is at least this late.
_TICK = 0.01
# How long a multicast's member list is reused: a member that joined since is not waited
# for (it still gets the message if it joined before the broker routed it).
_MEMBERS_TTL = 1.0


@dataclass(eq=False)
class _GroupSend:
    """The sender's transmission table entry for one message group (the seed's)."""

    member: bytes
    bound_at: float
    next_seq: int = 1
    outstanding: dict[int, int] = field(default_factory=dict)  # seq -> msg id, in seq order
    unreachable: bool = False  # NO_ROUTE from the member since the last bind
    final_sent: bool = False

    def floor(self) -> int:
        return next(iter(self.outstanding), self.next_seq)


@dataclass(eq=False)
class _Pending:
    src: bytes
    origin: bytes  # the address the application sent to
    dst: bytes  # where the frame goes: origin, or the member a group send is pinned to
    payload: bytes
    flags: int
    ext: Ext | None
    group: tuple[bytes, bytes, bytes] | None = None  # (src, anycast, group key)
    seq: int = 0
    future: asyncio.Future[None] | None = None


@dataclass(frozen=True)
class ReliableConfig:
    """How a connector sends reliably (``meshbus.connect(..., reliable=...)``).

    ``retry``: ack timeout, backoff and attempts. ``dedupe_window``: how many
    (service, source, message id) triples the receiver remembers, and as many
    (service, publish id) pairs. ``max_unacked``: a
    reliable send waits while this many are unacknowledged (backpressure instead of
    unbounded memory). ``group_expiry``: idle seconds before a message group's
    binding is dropped (the seed's 5 minutes). ``suspicion``: given-up sends to one
    address before it is declared dead."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    dedupe_window: int = 100_000
    max_unacked: int = 10_000
    group_expiry: float = 300.0
    suspicion: int = 3

    def __post_init__(self) -> None:
        if self.dedupe_window < 1 or self.max_unacked < 1 or self.suspicion < 1:
            raise InvalidArgument("dedupe_window, max_unacked and suspicion must be at least 1")
        if not self.group_expiry > 0:
            raise InvalidArgument("group_expiry must be a positive number of seconds")


class Reliable:
    """One connector's outbox, duplicate window, group tables and suspicion list."""

    def __init__(self, connector: Connector, config: ReliableConfig) -> None:
        self.conn = connector
        self.policy = policy = config.retry
        self.outbox = Outbox(policy)
        self.seen: SeenWindow[tuple[bytes, bytes, int]] = SeenWindow(config.dedupe_window)
        # A publish id names a message across senders: a retried job (a Spark
        # micro-batch) resends from a new connector with new message ids.
        self.published: SeenWindow[tuple[bytes, bytes]] = SeenWindow(config.dedupe_window)
        self.order: GroupOrder[tuple[Service, DataFrame, Ext]] = GroupOrder(
            idle_timeout=config.group_expiry
        )
        self.suspicion = Suspicion(config.suspicion)
        self.max_unacked = config.max_unacked
        self.group_expiry = config.group_expiry
        self.duplicates = 0
        self.given_up = 0
        self.failed_handlers: list[Callable[[DeliveryFailed], None]] = []
        self.dead_handlers: list[Callable[[str], None]] = []
        self._pending: dict[int, _Pending] = {}
        self._groups: dict[tuple[bytes, bytes, bytes], _GroupSend] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._timer: asyncio.TimerHandle | None = None
        self._member_cache: dict[bytes, tuple[float, frozenset[bytes]]] = {}
        self._resend_queue: dict[int, None] = {}  # an ordered set
        self._resending = False
        self._acks: dict[tuple[bytes, bytes], list[int]] = {}  # (acker, sender) -> ids

    # -- sending ---------------------------------------------------------------------

    async def send(
        self,
        src: bytes,
        dst: bytes,
        payload: bytes,
        *,
        echo: bool,
        group: bytes,
        final: bool,
        priority: int,
        publish_id: bytes,
        wait: bool,
        command: str = "",
    ) -> int:
        conn = self.conn
        while len(self._pending) >= self.max_unacked:
            self._room.clear()
            await self._room.wait()
        cast = dst[0]
        targets: frozenset[bytes] | None = None
        target = dst
        state: _GroupSend | None = None
        key = (src, dst, group)
        if group:
            if cast != _CAST_ANYCAST:
                raise InvalidArgument(
                    f"message groups go to an anycast address, not {describe_address(dst)}"
                )
            state = await self._bound(key, b"")
            target = state.member
        elif cast == _CAST_MULTICAST:
            now = conn._now()
            cached = self._member_cache.get(dst)
            if cached is not None and now - cached[0] < _MEMBERS_TTL:
                targets = cached[1]  # the usual case, every message of a stream of them
            else:
                targets = frozenset(await self._members(dst, pick=False))
            if src in targets and not echo:
                targets = targets - {src}
            if not targets:
                return 0  # nobody to deliver to: nothing can be lost
        elif cast == _CAST_ANYCAST:
            members = await self._members(dst, pick=True)
            if not members:
                raise NoRoute(f"no member of {describe_address(dst)}", describe_address(dst))
            target = members[0]
        msg_id = conn._new_msg_id()
        seq = 0
        ext: Ext | None = None
        if state is not None:
            seq = state.next_seq
            state.next_seq += 1
            state.outstanding[seq] = msg_id
            state.final_sent = final
            ext = Ext(
                origin=dst, group=group, seq=seq, floor=state.floor(), final=final,
                priority=priority, publish_id=publish_id,
            )  # fmt: skip
        elif target != dst or priority or publish_id or command:
            ext = Ext(
                origin=dst if target != dst else b"",
                priority=priority,
                publish_id=publish_id,
                command=command,
            )
        flags = _RELIABLE | (_ECHO if echo else 0) | (_EXT if ext is not None else 0)
        future = asyncio.get_running_loop().create_future() if wait else None
        pending = _Pending(src, dst, target, payload, flags, ext, key if group else None, seq)
        pending.future = future
        self._pending[msg_id] = pending
        self._idle.clear()
        self.outbox.add(msg_id, targets, conn._now())
        await conn._write_data(target, src, self._payload(pending), flags, msg_id)
        self._arm()
        if future is not None:
            await future
        return msg_id

    @staticmethod
    def _payload(pending: _Pending, ext: Ext | None = None) -> bytes:
        ext = ext or pending.ext
        return wrap(ext, pending.payload) if ext is not None else pending.payload

    async def _members(self, group: bytes, *, pick: bool) -> list[bytes]:
        """The members of ``group`` -- cached by ``send`` for ``_MEMBERS_TTL``, as a
        reliable multicast needs them for every message -- or the one member an anycast
        send goes to."""
        now = self.conn._now()
        frame = await self.conn._control(
            ControlType.MEMBERS, MembersRequest(group=group, pick=pick)
        )
        assert isinstance(frame.body, MemberList)
        if not pick and frame.body.members:
            # An empty list is asked again: a stream or member may be added any moment.
            self._member_cache[group] = (now, frozenset(frame.body.members))
        return frame.body.members

    async def _bound(self, key: tuple[bytes, bytes, bytes], failed: bytes) -> _GroupSend:
        """The member holding the group: cached, and asked of the group's home broker when
        new, older than half the idle expiry (which keeps the home's entry alive), or
        after the member could not be reached."""
        now = self.conn._now()
        state = self._groups.get(key)
        if (
            state is not None
            and not failed
            and not state.unreachable
            and now - state.bound_at < self.group_expiry / 2
        ):
            return state
        src, anycast, group = key
        frame = await self.conn._control(
            ControlType.GROUP_BIND,
            GroupBind(
                group=anycast, key=group, failed=failed, expiry=self.group_expiry, sender=src
            ),
        )
        assert isinstance(frame.body, GroupBound)
        member = frame.body.member
        state = self._groups.get(key)
        if state is None and failed:
            # The group ended while we asked again: our question re-bound it at the home;
            # end it there too, or a later sender of the group could be split from us.
            end = GroupEnd(group=anycast, key=group, sender=src)
            self.conn._send_control(ControlType.GROUP_END, end)
            return _GroupSend(member, now)
        if state is None:
            state = self._groups[key] = _GroupSend(member, now)
        else:
            state.member, state.bound_at = member, now
            state.unreachable = False
        return state

    def _arm(self) -> None:
        if self._timer is not None:
            return
        deadline = self.outbox.next_deadline()
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(_TICK, deadline - self.conn._now())
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        resend, given_up = self.outbox.due(self.conn._now())
        for msg_id in given_up:
            self._give_up(msg_id)
        if resend:
            self._queue_resend(resend)
        self._arm()

    def _queue_resend(self, msg_ids: list[int]) -> None:
        """One resend pass at a time: ids that fall due meanwhile join the queue, so a slow
        pass is never run twice over the same messages."""
        self._resend_queue.update(dict.fromkeys(msg_ids))
        if not self._resending:
            self._resending = True
            self.conn._spawn(self._resend(), "resend")

    async def _resend(self) -> None:
        """Send the queued ids again, in order: group ones to the member holding the group
        now (asked of the homes first, all groups at once, so no send waits behind another
        group's question), multicast ones as one copy to each member that has not acked."""
        try:
            while self._resend_queue:
                msg_ids = sorted(self._resend_queue)
                self._resend_queue.clear()
                groups = {
                    p.group
                    for i in msg_ids
                    if (p := self._pending.get(i)) is not None and p.group is not None
                }
                # No ack in time: the member may be gone. The home keeps the group where it
                # is unless the member has left the anycast group for good.
                await asyncio.gather(*(self._rebind(key) for key in groups))
                for msg_id in msg_ids:
                    pending = self._pending.get(msg_id)
                    if pending is not None:
                        await self._send_again(msg_id, pending)
        finally:
            self._resending = False

    async def _rebind(self, key: tuple[bytes, bytes, bytes]) -> None:
        state = self._groups.get(key)
        if state is None:
            return
        try:
            await self._bound(key, state.member)
        except MeshbusError as exc:  # the home is failing over: the next pass asks again
            log.debug("group rebind failed", extra={"error": str(exc)})

    async def _send_again(self, msg_id: int, pending: _Pending) -> None:
        conn = self.conn
        if pending.group is not None:
            state = self._groups.get(pending.group)
            if state is None:
                return
            pending.dst = state.member
            assert pending.ext is not None
            ext = msgspec.structs.replace(pending.ext, floor=state.floor())
            payload = self._payload(pending, ext)
            await conn._write_data(pending.dst, pending.src, payload, pending.flags, msg_id)
            return
        targets = self.outbox.pending(msg_id)
        if not targets:
            await conn._write_data(
                pending.dst, pending.src, self._payload(pending), pending.flags, msg_id
            )
            return
        ext = msgspec.structs.replace(pending.ext or Ext(), origin=pending.origin)
        payload = self._payload(pending, ext)
        for member in sorted(targets):
            await conn._write_data(member, pending.src, payload, pending.flags | _EXT, msg_id)

    async def idle(self) -> None:
        await self._idle.wait()

    def resend_all(self) -> None:
        """After a failover: everything unacknowledged goes out again now, in send order."""
        ids = self.outbox.ids()
        if ids:
            self._queue_resend(ids)

    def _give_up(self, msg_id: int) -> None:
        pending = self._pending.pop(msg_id, None)
        if pending is None:
            return
        self.given_up += 1
        self._settled(msg_id, pending)
        error = DeliveryFailed(
            f"no acknowledgement for message {msg_id} to {describe_address(pending.origin)} "
            f"after {self.policy.max_attempts} attempts",
            describe_address(pending.origin),
            msg_id,
        )
        if pending.future is not None and not pending.future.done():
            pending.future.set_exception(error)  # send_reliable raises it, instead of handlers
        elif not self.failed_handlers:
            log.warning("reliable send failed", extra={"error": str(error)})
        else:
            for handler in self.failed_handlers:
                handler(error)
        if pending.dst[0] not in (_CAST_MULTICAST, _CAST_ANYCAST) and self.suspicion.failed(
            pending.dst
        ):
            for dead in self.dead_handlers:
                dead(describe_address(pending.dst))

    def _settled(self, msg_id: int, pending: _Pending) -> None:
        """The message is acked or given up: its group entry moves on."""
        if len(self._pending) < self.max_unacked:
            self._room.set()
        if not self._pending:
            self._idle.set()
        if pending.group is None:
            return
        state = self._groups.get(pending.group)
        if state is None:
            return
        state.outstanding.pop(pending.seq, None)
        if state.final_sent and not state.outstanding:
            del self._groups[pending.group]
            _, anycast, group = pending.group
            src = pending.group[0]
            end = GroupEnd(group=anycast, key=group, sender=src)
            self.conn._send_control(ControlType.GROUP_END, end)

    def no_route(self, msg_id: int) -> bool:
        """The broker could not deliver a reliable frame now; the resend timer tries
        again, and a group send asks its home broker first. False: not ours."""
        pending = self._pending.get(msg_id)
        if pending is None:
            return False
        if pending.group is not None and (state := self._groups.get(pending.group)) is not None:
            state.unreachable = True
        return True

    # -- receiving -----------------------------------------------------------------------

    def on_ack(self, frame: DataFrame) -> None:
        self.suspicion.heard(frame.src)
        try:
            msg_ids = unpack_acks(frame.payload)
        except ProtocolError as exc:
            log.warning("dropped a bad ACK", extra={"error": str(exc)})
            return
        acker = frame.src
        for msg_id in msg_ids:
            if self.outbox.ack(msg_id, acker):
                pending = self._pending.pop(msg_id, None)
                if pending is not None:
                    if pending.future is not None and not pending.future.done():
                        pending.future.set_result(None)
                    self._settled(msg_id, pending)

    def accept(self, service: Service, frame: DataFrame) -> bool:
        """Acknowledge a reliable frame for ``service``; True when it is new to it."""
        if not self._acks:
            asyncio.get_running_loop().call_soon(self._flush_acks)
        self._acks.setdefault((service._raw, frame.src), []).append(frame.msg_id)
        if self.seen.add((service._raw, frame.src, frame.msg_id)):
            return True
        self.duplicates += 1
        return False

    def first_publish(self, service: Service, publish_id: bytes) -> bool:
        """True unless ``service`` already got a message with this publish id."""
        if self.published.add((service._raw, publish_id)):
            return True
        self.duplicates += 1
        return False

    def _flush_acks(self) -> None:
        acks, self._acks = self._acks, {}
        link = self.conn._keeper.link
        if link is None or link.closed:
            return  # the senders resend; the duplicates are acked then
        link.write(b"".join(f for (a, s), ids in acks.items() for f in ack_frames(a, s, ids)))

    def in_order(
        self, service: Service, frame: DataFrame, ext: Ext
    ) -> list[tuple[tuple[Service, DataFrame, Ext], bool]]:
        """The group messages deliverable now, in the group's order (with reassigned flags)."""
        key = service._raw + ext.group
        ready = self.order.push(
            frame.src, key, ext.seq, ext.floor, (service, frame, ext), self.conn._now()
        )
        for (_, done, done_ext), _ in ready:
            if done_ext.final:
                self.order.end(done.src, key)
        return ready

    def shutdown(self, error: Exception) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for pending in self._pending.values():
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)
        self._room.set()
        self._idle.set()
