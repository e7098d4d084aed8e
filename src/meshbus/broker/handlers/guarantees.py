"""The broker's part of the delivery guarantees: members and message groups.

* MEMBERS -- the members of a group, mesh-wide (every broker holds the whole
  table): a reliable multicast waits for one ack from each; with ``pick``, the
  member a reliable anycast send goes to (a local one first, one that holds no
  message group when there is one -- the seed's rule). TRY_AGAIN for a group whose
  stream was lost with its broker (meshbus.broker.core.captures).
* GROUP_BIND / GROUP_END -- answered by the group's home broker
  (meshbus.broker.mesh.groups); a connector's broker relays them there and relays
  the answer back (meshbus.broker.mesh.relay). Bindings are replicated to every
  broker (GROUPS).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from meshbus.address import describe_address
from meshbus.broker.core.captures import LostCaptures
from meshbus.broker.core.dispatch import Refused
from meshbus.broker.core.endpoint import Endpoint
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import Peers
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.mesh.groups import GroupTable, home_of
from meshbus.broker.mesh.relay import Relay
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import (
    Empty,
    GroupBind,
    GroupBound,
    GroupEnd,
    GroupOp,
    Groups,
    MemberList,
    MembersRequest,
)
from meshbus.protocol.layout import ControlType, ErrorCode

log = logging.getLogger("meshbus.broker")

# Bindings per GROUPS frame: about 60 bytes each, so a frame stays far below the frame
# limit and a peer applies it in a millisecond or two (as ROUTES_CHUNK).
GROUPS_CHUNK = 500


class Guarantees:
    def __init__(
        self,
        *,
        name: Callable[[], str],
        groups: GroupTable,
        routing: RoutingTable[Endpoint],
        peers: Peers,
        relay: Relay,
        outbox: Outbox,
        clock: Callable[[], float],
        fenced: Callable[[], bool],
        out_of_reach: Callable[[], list[str]],
        lost_captures: LostCaptures,
    ) -> None:
        """``name`` gives this broker's name (known once it listens); ``fenced`` is true
        while it re-links after a stall (meshbus.broker.mesh.fence), when it binds nothing;
        ``out_of_reach`` names the brokers a peer is linked to and this one is not
        (``OutOfReach``): alive behind a cut link; ``lost_captures``: the groups whose
        stream went with a lost peer, where "no member" is not the answer."""
        self._lost_captures = lost_captures
        self._name = name
        self.groups = groups
        self._routing = routing
        self._peers = peers
        self._relay = relay
        self._outbox = outbox
        self._clock = clock
        self._fenced = fenced
        self._out_of_reach = out_of_reach

    # -- members ------------------------------------------------------------------------

    def on_members(self, link: Link, correlation: int, body: MembersRequest) -> None:
        routing = self._routing
        members = routing.members(body.group)
        holder = self._lost_captures.holder(body.group, bool(members))
        if holder is not None:
            self._relay.refuse(
                link,
                ErrorCode.TRY_AGAIN,
                f"{describe_address(body.group)} has no member now: the stream that captures "
                f"it was on broker {holder}, which is down or out of reach from broker "
                f"{self._name()}; a send now would be stored nowhere. Ask again in a moment "
                "(another replica may lead it)",
                correlation,
            )
            return
        if body.pick and members:
            local = [m for m in members if not routing.is_remote_member(m)] or members
            fewest = min(self.groups.holds(m) for m in local)
            members = [
                routing.pick([m for m in local if self.groups.holds(m) == fewest]),
            ]
        self._relay.answer(link, ControlType.MEMBER_LIST, MemberList(members=members), correlation)

    # -- message groups -----------------------------------------------------------------------

    def _mesh(self) -> list[str]:
        """The brokers a group's home is chosen from. Those out of reach are counted: they
        are alive and decide for their groups, so this side of a cut link must not pick a
        home of its own for those groups and bind them a second time."""
        return [self._name(), *self._peers, *self._out_of_reach()]

    def _home(self, key: bytes) -> tuple[str, Link | None]:
        """The group's home, and the link to it (None: the home is this broker, or out of
        reach)."""
        home = home_of(key, self._mesh())
        return home, self._peers.get(home)

    def _check_sender(self, link: Link, sender: bytes) -> None:
        """A connector binds and ends a message group only as a service of its own: a
        GROUP_END in another's name would let the group expire under that sender, and the
        group be bound again elsewhere, out of order. A peer relays what it checked."""
        if sender and not link.is_peer and not self._routing.speaks_for(link, link.session, sender):
            raise Refused(
                ErrorCode.NOT_REGISTERED,
                f"cannot send message-group control frames as {describe_address(sender)}: "
                "this connector has not registered it",
            )

    def on_bind(self, link: Link, correlation: int, body: GroupBind) -> None:
        self._check_sender(link, body.sender)
        name, home = (self._name(), None) if link.is_peer else self._home(body.group + body.key)
        if home is not None:
            self._relay.relay(home, ControlType.GROUP_BIND, body, link, correlation)
            return
        if name != self._name():
            self._relay.refuse(
                link,
                ErrorCode.TRY_AGAIN,
                f"broker {name}, the home of message group {body.key.decode(errors='replace')!r}, "
                f"is out of reach from broker {self._name()} (a link between them is down); "
                "ask again in a moment",
                correlation,
            )
            return
        if self._fenced():
            # Its peers took this broker for dead while it stalled; the group's home among
            # them may have moved the group. Binding from what it held could split it.
            self._relay.refuse(
                link,
                ErrorCode.TRY_AGAIN,
                f"broker {self._name()} is re-linking after a stall; ask again in a moment",
                correlation,
            )
            return
        members = self._routing.members(body.group)
        key = (body.group, body.key)
        # A member this broker cannot see may be on a broker out of reach, alive: keep it.
        hold = bool(self._out_of_reach())
        binding = self.groups.bind(key, members, body.failed, body.expiry, self._clock(), hold)
        if binding is None:
            self._relay.refuse(
                link,
                ErrorCode.UNAVAILABLE,
                f"no member of {describe_address(body.group)} to hold message group "
                f"{body.key.decode(errors='replace')!r}",
                correlation,
            )
            return
        if body.sender:
            binding.senders.add(body.sender)
        self._replicate([(body.group, body.key, binding.member, binding.expiry)])
        bound = GroupBound(member=binding.member, reassigned=binding.moved)
        self._relay.answer(link, ControlType.GROUP_BOUND, bound, correlation)

    def on_end(self, link: Link, correlation: int, body: GroupEnd) -> None:
        self._check_sender(link, body.sender)
        name, home = (self._name(), None) if link.is_peer else self._home(body.group + body.key)
        if home is not None:
            home.send(encode_control(ControlType.GROUP_END, body))
        elif name == self._name():
            self.groups.end((body.group, body.key), body.sender, self._clock())
        # else the home is out of reach: its binding goes at its idle expiry instead.
        if correlation:
            self._relay.answer(link, ControlType.OK, Empty(), correlation)

    def _replicate(self, ops: list[GroupOp]) -> None:
        if self._peers:
            for frame in _groups_frames(ops):
                self._peers.send_all(frame)

    def on_groups(self, link: Link, correlation: int, body: Groups) -> None:
        """Bindings from a peer. The group's home decides: a binding this broker holds is
        replaced only by its home's. Two sides of a split may each have bound a group
        (each side had its own home for it); when they link again each sends all it
        holds, and without this rule each would take the other's -- swapped, not one."""
        now = self._clock()
        brokers = self._mesh()
        for anycast, group, member, expiry in body.ops:
            key = (anycast, group)
            if self.groups.get(key) is not None and home_of(anycast + group, brokers) != link.name:
                continue
            if member:
                self.groups.put(key, member, expiry, now)
            else:
                self.groups.drop(key)

    def expire(self) -> None:
        """The seed's deletion process, on every broker; what it drops, it drops everywhere
        (a binding its home let linger after the group's end is still held by the peers)."""
        dropped = self.groups.expire(self._clock())
        if dropped:
            self._replicate([(anycast, group, b"", 0.0) for anycast, group in dropped])

    def send_groups(self, peer: Link) -> None:
        """Every binding, to a peer that just linked up."""
        for frame in _groups_frames(list(self.groups.ops())):
            peer.send(frame)


def _groups_frames(ops: list[GroupOp]) -> list[bytes]:
    return [
        encode_control(ControlType.GROUPS, Groups(ops=ops[start : start + GROUPS_CHUNK]))
        for start in range(0, len(ops), GROUPS_CHUNK)
    ]
