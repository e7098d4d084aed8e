"""Reliable sends and message groups: the connector's side of the guarantees.

Sending (docs/guarantees.md). A reliable frame carries the RELIABLE flag;
the sender keeps it in its ``AckTable`` until the receiving connector acknowledges
it with an ACK frame (a 64-byte data frame from the receiving service back to
the sender, ``response_for`` = the message id), resends it after an ack timeout
with backoff, and gives up after ``RetryPolicy.max_attempts``. Only an ack from an
address the message was sent to counts; others are ignored and counted
(``refused_acks``), so no third service can complete a send nobody received:

* unicast -- the first ack of its destination completes it;
* multicast -- the broker names the members first (MEMBERS); one frame goes to
  the group and every member acks; resends go to the members that have not
  acked, one unicast copy each, with the group address in the extension block;
* anycast -- the broker picks the member first, and every attempt goes to that
  one member, so exactly one member gets it, and only its ack counts;
* a message group -- the group's home broker binds the group to one member
  (GROUP_BIND, see meshbus.broker.mesh.groups); every message of the group goes to
  that member with the group's sequence number, and the receiver delivers them
  in order (``GroupOrder``). A member that cannot be reached is reported with
  the next GROUP_BIND; the home moves the group once the member is gone for good.
  The ack of every member a message went to counts (the first may still ack it).

After a failover every unacknowledged message is resent at once, in the order
it was first sent. Giving up raises ``DeliveryFailed`` from ``send_reliable``
and calls the ``on_delivery_failed`` handlers; it also adds a suspicion against
the receiver (``Suspicion``), and one declared dead is reported to the
``on_suspected_dead`` handlers.

``Unacked`` is what a connector sent reliably and has not had acknowledged yet,
and what happens when an ACK or a NO_ROUTE comes for it, or it is given up: the
inbound dispatcher reports those to it. ``Reliable`` sends, resends and binds
message groups, asking the broker through meshbus.client.requester. The receiving
side is meshbus.client.receiving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from meshbus.address import CAST_ANYCAST, CAST_MULTICAST, describe_address
from meshbus.client.callbacks import Callbacks
from meshbus.client.delivery import Ack, AckTable, RetryPolicy, Suspicion
from meshbus.client.outbound import Outbound
from meshbus.client.requester import Requester
from meshbus.errors import (
    ConnectionLost,
    DeliveryFailed,
    InvalidArgument,
    MeshbusError,
    NoRoute,
    PermissionDenied,
    ProtocolError,
    Timeout,
    TryAgain,
)
from meshbus.protocol.codec import DataFrame
from meshbus.protocol.control import GroupBind, GroupBound, GroupEnd, MemberList, MembersRequest
from meshbus.protocol.ext import Ext, unpack_acks, wrap
from meshbus.protocol.layout import (
    FLAG_ECHO,
    FLAG_EXT,
    FLAG_NOTIFY_DROP,
    FLAG_RELIABLE,
    ControlType,
)
from meshbus.util import BackgroundTasks, Turns

log = logging.getLogger("meshbus.client")

# A reliable frame that finds no route is reported (NO_ROUTE), so it is resent at once.
_RELIABLE = FLAG_RELIABLE | FLAG_NOTIFY_DROP
# The finest the resend timer ticks; an ack timeout is at least this late.
_TICK = 0.01
# How long a multicast's member list is reused: a member that joined since is not waited
# for (it still gets the message if it joined before the broker routed it).
_MEMBERS_TTL = 1.0
# Batch frames unacknowledged at once, per connector: ``max_unacked`` counts frames, and
# ten thousand batch frames of up to a megabyte each would be gigabytes held for resends.
MAX_UNACKED_BATCHES = 16

GroupKey = tuple[bytes, bytes, bytes]  # (sending service, anycast address, group id)


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
    group: GroupKey | None = None
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


class Unacked:
    """The reliable messages sent and not acknowledged yet, by message id, with the
    message groups they belong to and the suspicion list.

    ``failed`` and ``dead`` are the handlers of ``Connector.on_delivery_failed`` and
    ``on_suspected_dead``; ``given_up`` counts the messages given up, ``refused_acks``
    the acks ignored because their message was not sent to their source."""

    def __init__(self, config: ReliableConfig, outbound: Outbound) -> None:
        self.policy = config.retry
        self.outbox = AckTable(config.retry)
        self.messages: dict[int, _Pending] = {}
        self.groups: dict[GroupKey, _GroupSend] = {}
        self.suspicion = Suspicion(config.suspicion)
        self.given_up = 0
        self.refused_acks = 0
        self.failed: Callbacks[Callable[[DeliveryFailed], object]] = Callbacks()
        self.dead: Callbacks[Callable[[str], object]] = Callbacks()
        self._max = config.max_unacked
        self._outbound = outbound
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._batches = 0  # batch frames among ``messages``
        self._batch_room = asyncio.Event()
        self._batch_room.set()

    def __len__(self) -> int:
        return len(self.messages)

    async def room(self) -> None:
        """Wait while ``max_unacked`` messages are unacknowledged."""
        while len(self.messages) >= self._max:
            self._room.clear()
            await self._room.wait()

    async def idle(self) -> None:
        """Wait until every message sent so far is acknowledged or given up."""
        await self._idle.wait()

    async def batch_room(self) -> None:
        """Wait while ``MAX_UNACKED_BATCHES`` batch frames are unacknowledged."""
        while self._batches >= MAX_UNACKED_BATCHES:
            self._batch_room.clear()
            await self._batch_room.wait()

    def add(
        self, msg_id: int, pending: _Pending, members: frozenset[bytes] | None, now: float
    ) -> None:
        """Track a message sent to ``pending.dst``, or, to a multicast, to ``members``."""
        self.messages[msg_id] = pending
        self._idle.clear()
        if pending.ext is not None and pending.ext.batch:
            self._batches += 1
        if members is None:
            self.outbox.add(msg_id, frozenset((pending.dst,)), now)
        else:
            self.outbox.add(msg_id, members, now, every=True)

    def heard(self, address: bytes) -> None:
        """Any message from ``address`` proves it alive."""
        self.suspicion.heard(address)

    def on_ack(self, frame: DataFrame) -> None:
        self.suspicion.heard(frame.src)
        try:
            msg_ids = unpack_acks(frame.payload)
        except ProtocolError as exc:
            log.warning("dropped a bad ACK", extra={"error": str(exc)})
            return
        acker = frame.src
        for msg_id in msg_ids:
            done = self.outbox.ack(msg_id, acker)
            if done is Ack.STRANGER:
                self.refused_acks += 1
            elif done is Ack.DONE:
                pending = self.messages.pop(msg_id, None)
                if pending is not None:
                    if pending.future is not None and not pending.future.done():
                        pending.future.set_result(None)
                    self._settled(pending)

    def no_route(self, msg_id: int, denied: str = "") -> bool:
        """The broker could not deliver a reliable frame now; the resend timer tries
        again, and a group send asks its home broker first. ``denied`` (the broker's
        reason): its user may not send there, which no resend changes, so it is given
        up now. False: not ours."""
        pending = self.messages.get(msg_id)
        if pending is None:
            return False
        if denied:
            self.outbox.remove(msg_id)
            self.give_up(msg_id, PermissionDenied(denied))
            return True
        if pending.group is not None and (state := self.groups.get(pending.group)) is not None:
            state.unreachable = True
        return True

    def withdraw(self, msg_id: int) -> None:
        """A message that was never sent: it is not pending, nor counted as given up."""
        pending = self.messages.pop(msg_id, None)
        self.outbox.remove(msg_id)
        if pending is not None:
            self._settled(pending)

    def give_up(self, msg_id: int, denied: PermissionDenied | None = None) -> None:
        """After its last attempt; or at once when ``denied``: ``send_reliable`` raises
        that, and the ``on_delivery_failed`` handlers get a DeliveryFailed with its words."""
        pending = self.messages.pop(msg_id, None)
        if pending is None:
            return
        self.given_up += 1
        self._settled(pending)
        error = DeliveryFailed(
            str(denied)
            if denied is not None
            else f"no acknowledgement for message {msg_id} to "
            f"{describe_address(pending.origin)} after {self.policy.max_attempts} attempts",
            describe_address(pending.origin),
            msg_id,
        )
        if pending.future is not None and not pending.future.done():
            # send_reliable raises it, instead of handlers
            pending.future.set_exception(denied or error)
        elif not self.failed.handlers:
            log.warning("reliable send failed: %s", error, extra={"error": str(error)})
        else:
            for handler in self.failed.handlers:
                handler(error)
        if (
            denied is None
            and pending.dst[0] not in (CAST_MULTICAST, CAST_ANYCAST)
            and self.suspicion.failed(pending.dst)
        ):
            for dead in self.dead.handlers:
                dead(describe_address(pending.dst))

    def _settled(self, pending: _Pending) -> None:
        """The message is acked or given up: its group entry moves on."""
        if len(self.messages) < self._max:
            self._room.set()
        if not self.messages:
            self._idle.set()
        if pending.ext is not None and pending.ext.batch:
            self._batches -= 1
            if self._batches < MAX_UNACKED_BATCHES:
                self._batch_room.set()
        if pending.group is None:
            return
        state = self.groups.get(pending.group)
        if state is None:
            return
        state.outstanding.pop(pending.seq, None)
        if state.final_sent and not state.outstanding:
            del self.groups[pending.group]
            src, anycast, group = pending.group
            self._outbound.send_control(
                ControlType.GROUP_END, GroupEnd(group=anycast, key=group, sender=src)
            )

    def shutdown(self, error: Exception) -> None:
        """The connector ended: whoever waits for an acknowledgement gets ``error``, and
        nothing is pending any more (no acknowledgement can come)."""
        for pending in self.messages.values():
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)
        self.messages.clear()
        for msg_id in self.outbox.ids():
            self.outbox.remove(msg_id)
        self._batches = 0
        self._room.set()
        self._idle.set()
        self._batch_room.set()


class Reliable:
    """Sends reliably: asks the broker for the members or the group's holder, sends,
    and resends what ``Unacked`` still holds when its ack timeout passes."""

    def __init__(
        self,
        config: ReliableConfig,
        *,
        unacked: Unacked,
        requester: Requester,
        outbound: Outbound,
        tasks: BackgroundTasks,
    ) -> None:
        self._unacked = unacked
        self._requester = requester
        self._outbound = outbound
        self._tasks = tasks
        self._group_expiry = config.group_expiry
        # How long a send asks again while the broker cannot answer now, unless it says.
        self._default_timeout = config.retry.give_up_after()
        self._timer: asyncio.TimerHandle | None = None
        self._member_cache: dict[bytes, tuple[float, frozenset[bytes]]] = {}
        self._resend_queue: dict[int, None] = {}  # an ordered set
        self._resending = False
        self._turns: Turns[GroupKey] = Turns()

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
        timeout: float | None = None,
        command: str = "",
        batch: int = 0,
        headers: bytes = b"",
    ) -> int:
        """Send reliably; with ``wait``, return once acknowledged. ``batch``: the payload
        is a batch of rows in that format (meshbus.protocol.batch); it waits while
        ``MAX_UNACKED_BATCHES`` batch frames are unacknowledged. What the broker is
        asked first (the group's member, a group's members) is asked again while it
        cannot answer now, until ``timeout`` seconds (None: the retry policy's
        ``give_up_after``) have passed: then ``Timeout``."""
        cast = dst[0]
        if group and cast != CAST_ANYCAST:
            raise InvalidArgument(
                f"message groups go to an anycast address, not {describe_address(dst)}"
            )
        limit = self._default_timeout if timeout is None else timeout
        deadline = _now() + limit
        unacked = self._unacked
        await unacked.room()
        if batch:
            await unacked.batch_room()
        targets: frozenset[bytes] | None = None
        target = dst
        state: _GroupSend | None = None
        key = (src, dst, group)
        patiently = self._requester.patiently
        if group:
            what = f"message group {group.decode(errors='replace')!r} to {describe_address(dst)}"
            # The usual case: the member is cached and no earlier send of the group is
            # still asking, so there is nothing to ask. Otherwise one send of a group at
            # a time asks, in the order they came, so a send that waits for an answer
            # keeps its place: its sequence number is taken as its turn ends, with no
            # await in between.
            state = None if key in self._turns else self._cached(key)
            if state is None:
                async with self._turns.turn(key):
                    state = await patiently(
                        lambda: self._group_state(key), deadline, limit, f"{what}: no member bound"
                    )
            target = state.member
        elif cast == CAST_MULTICAST:
            now = _now()
            cached = self._member_cache.get(dst)
            if cached is not None and now - cached[0] < _MEMBERS_TTL:
                targets = cached[1]  # the usual case, every message of a stream of them
            else:
                members = await patiently(
                    lambda: self._members(dst, pick=False),
                    deadline,
                    limit,
                    f"the members of {describe_address(dst)}: not known",
                )
                targets = frozenset(members)
            if src in targets and not echo:
                targets = targets - {src}
            if not targets:
                return 0  # nobody to deliver to: nothing can be lost
        elif cast == CAST_ANYCAST:
            members = await patiently(
                lambda: self._members(dst, pick=True),
                deadline,
                limit,
                f"a member of {describe_address(dst)}: not picked",
            )
            if not members:
                raise NoRoute(f"no member of {describe_address(dst)}", describe_address(dst))
            target = members[0]
        msg_id = self._outbound.new_msg_id()
        seq = 0
        ext: Ext | None = None
        if state is not None:
            seq = state.next_seq
            state.next_seq += 1
            state.outstanding[seq] = msg_id
            state.final_sent = final
            ext = Ext(
                origin=dst, group=group, seq=seq, floor=state.floor(), final=final,
                priority=priority, publish_id=publish_id, headers=headers,
            )  # fmt: skip
        elif target != dst or priority or publish_id or command or batch or headers:
            ext = Ext(
                origin=dst if target != dst else b"",
                priority=priority,
                publish_id=publish_id,
                command=command,
                batch=batch,
                headers=headers,
            )
        flags = _RELIABLE | (FLAG_ECHO if echo else 0) | (FLAG_EXT if ext is not None else 0)
        future = asyncio.get_running_loop().create_future() if wait else None
        pending = _Pending(src, dst, target, payload, flags, ext, key if group else None, seq)
        pending.future = future
        unacked.add(msg_id, pending, targets, _now())
        try:
            await self._outbound.write_data(target, src, _payload(pending), flags, msg_id)
        except MeshbusError:
            # Never written (the connector is closed or lost): nothing to wait for.
            unacked.withdraw(msg_id)
            raise
        except asyncio.CancelledError:
            # The caller is gone: nobody will take what the future gets (the connector's
            # end would leave it an exception never retrieved).
            if future is not None:
                future.cancel()
            raise
        self._arm()
        if future is not None:
            await future
        return msg_id

    async def _members(self, group: bytes, *, pick: bool) -> list[bytes]:
        """The members of ``group`` -- cached by ``send`` for ``_MEMBERS_TTL``, as a
        reliable multicast needs them for every message -- or the one member an anycast
        send goes to."""
        now = _now()
        answer = await self._requester.ask(
            ControlType.MEMBERS, MembersRequest(group=group, pick=pick), MemberList
        )
        if not pick and answer.members:
            # An empty list is asked again: a stream or member may be added any moment.
            self._member_cache[group] = (now, frozenset(answer.members))
        return answer.members

    async def _group_state(self, key: GroupKey) -> _GroupSend:
        """The member a group's next message goes to. When the home cannot answer now
        (out of reach behind a cut link, lost a moment ago, re-linking after a stall, or
        the connector failing over) and the group has a member already, the message waits
        for that member, and the resend pass asks the home again; a group with none yet
        raises, and ``send`` asks again."""
        try:
            return await self._bound(key, b"")
        except (NoRoute, TryAgain, ConnectionLost, Timeout):
            held = self._unacked.groups.get(key)
            if held is None:
                raise
            return held

    def _cached(self, key: GroupKey) -> _GroupSend | None:
        """The group's member as the sender knows it, if that needs no question: bound
        less than half the idle expiry ago, and reachable since."""
        state = self._unacked.groups.get(key)
        if (
            state is not None
            and not state.unreachable
            and _now() - state.bound_at < self._group_expiry / 2
        ):
            return state
        return None

    async def _bound(self, key: GroupKey, failed: bytes) -> _GroupSend:
        """The member holding the group: cached, and asked of the group's home broker when
        new, older than half the idle expiry (which keeps the home's entry alive), or
        after the member could not be reached."""
        if not failed and (cached := self._cached(key)) is not None:
            return cached
        now = _now()
        groups = self._unacked.groups
        src, anycast, group = key
        bound = await self._requester.ask(
            ControlType.GROUP_BIND,
            GroupBind(
                group=anycast, key=group, failed=failed, expiry=self._group_expiry, sender=src
            ),
            GroupBound,
        )
        state = groups.get(key)
        if state is None and failed:
            # The group ended while we asked again: our question re-bound it at the home;
            # end it there too, or a later sender of the group could be split from us.
            end = GroupEnd(group=anycast, key=group, sender=src)
            self._outbound.send_control(ControlType.GROUP_END, end)
            return _GroupSend(bound.member, now)
        if state is None:
            state = groups[key] = _GroupSend(bound.member, now)
        else:
            state.member, state.bound_at = bound.member, now
            state.unreachable = False
        return state

    # -- resending -------------------------------------------------------------------

    def _arm(self) -> None:
        if self._timer is not None:
            return
        deadline = self._unacked.outbox.next_deadline()
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(_TICK, deadline - loop.time())
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        unacked = self._unacked
        resend, given_up = unacked.outbox.due(_now())
        for msg_id in given_up:
            unacked.give_up(msg_id)
        if resend:
            self._queue_resend(resend)
        self._arm()

    def resend_all(self) -> None:
        """After a failover: everything unacknowledged goes out again now, in send order."""
        ids = self._unacked.outbox.ids()
        if ids:
            self._queue_resend(ids)

    def _queue_resend(self, msg_ids: list[int]) -> None:
        """One resend pass at a time: ids that fall due meanwhile join the queue, so a slow
        pass is never run twice over the same messages."""
        self._resend_queue.update(dict.fromkeys(msg_ids))
        if not self._resending:
            self._resending = True
            self._tasks.spawn(self._resend(), "resend")

    async def _resend(self) -> None:
        """Send the queued ids again, in order: group ones to the member holding the group
        now (asked of the homes first, all groups at once, so no send waits behind another
        group's question), multicast ones as one copy to each member that has not acked."""
        messages = self._unacked.messages
        try:
            while self._resend_queue:
                msg_ids = sorted(self._resend_queue)
                self._resend_queue.clear()
                groups = {
                    p.group
                    for i in msg_ids
                    if (p := messages.get(i)) is not None and p.group is not None
                }
                # No ack in time: the member may be gone. The home keeps the group where it
                # is unless the member has left the anycast group for good.
                await asyncio.gather(*(self._rebind(key) for key in groups))
                for msg_id in msg_ids:
                    pending = messages.get(msg_id)
                    if pending is not None:
                        await self._send_again(msg_id, pending)
        finally:
            self._resending = False

    async def _rebind(self, key: GroupKey) -> None:
        state = self._unacked.groups.get(key)
        if state is None:
            return
        try:
            await self._bound(key, state.member)
        except MeshbusError as exc:  # the home is failing over: the next pass asks again
            log.debug("group rebind failed", extra={"error": str(exc)})

    async def _send_again(self, msg_id: int, pending: _Pending) -> None:
        write = self._outbound.write_data
        if pending.group is not None:
            state = self._unacked.groups.get(pending.group)
            if state is None:
                return
            pending.dst = state.member
            self._unacked.outbox.allow(msg_id, state.member)
            assert pending.ext is not None
            ext = msgspec.structs.replace(pending.ext, floor=state.floor())
            await write(pending.dst, pending.src, _payload(pending, ext), pending.flags, msg_id)
            return
        targets = self._unacked.outbox.pending(msg_id)
        if not targets:
            await write(pending.dst, pending.src, _payload(pending), pending.flags, msg_id)
            return
        ext = msgspec.structs.replace(pending.ext or Ext(), origin=pending.origin)
        payload = _payload(pending, ext)
        for member in sorted(targets):
            await write(member, pending.src, payload, pending.flags | FLAG_EXT, msg_id)

    def stop(self) -> None:
        """The connector ended: no more resends."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _payload(pending: _Pending, ext: Ext | None = None) -> bytes:
    ext = ext or pending.ext
    return wrap(ext, pending.payload) if ext is not None else pending.payload


def _now() -> float:
    return asyncio.get_running_loop().time()
