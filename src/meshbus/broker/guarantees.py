"""The broker's part of the delivery guarantees: members, message groups, relays, watchers.

* MEMBERS -- the members of a group, mesh-wide (every broker holds the whole
  table): a reliable multicast waits for one ack from each; with ``pick``, the
  member a reliable anycast send goes to (a local one first, one that holds no
  message group when there is one -- the seed's rule).
* GROUP_BIND / GROUP_END -- answered by the group's home broker
  (meshbus.broker.groups); a connector's broker relays them there and relays
  the answer back (RELAYED). Bindings are replicated to every broker (GROUPS).
* WATCH / LEFT -- connectors that asked are told which services left the mesh.

A request relayed from a peer is answered in a RELAYED frame, so the peer can
hand the answer to its connector as it is, with the connector's correlation.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from meshbus.address import describe_address
from meshbus.broker.groups import GroupTable, home_of
from meshbus.broker.link import LinkState
from meshbus.protocol.codec import encode_control, encode_control_raw
from meshbus.protocol.control import (
    ENCODER,
    Body,
    Empty,
    Error,
    GroupBind,
    GroupBound,
    GroupEnd,
    GroupOp,
    Groups,
    Left,
    MemberList,
    MembersRequest,
    Relayed,
)
from meshbus.protocol.layout import ControlType, ErrorCode

if TYPE_CHECKING:
    from meshbus.broker.link import Link
    from meshbus.broker.server import Broker

log = logging.getLogger("meshbus.broker")

# Requests a peer relays for its connectors, and the guarantees' own broker-to-broker frames.
PEER_FRAMES = frozenset(
    int(t)
    for t in (
        ControlType.GROUP_BIND,
        ControlType.GROUP_END,
        ControlType.GROUPS,
        ControlType.RELAYED,
        ControlType.STREAM,
    )
)


class Guarantees:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.groups = GroupTable(broker.config.group_expiry, broker.config.group_grace)
        self.watchers: set[Link] = set()
        self._left: list[bytes] = []
        self._relayed: dict[int, tuple[Link, int, Link]] = {}  # ours -> (origin, its corr, peer)
        self._next_relay = 1

    # -- answering, here or through a peer -------------------------------------------------

    def answer(self, link: Link, type_: ControlType, body: Body, correlation: int) -> None:
        """To a connector as it is; to a peer that relayed the request, wrapped."""
        if link.is_peer:
            body = Relayed(type=int(type_), body=ENCODER.encode(body))
            type_ = ControlType.RELAYED
        self.broker.reply(link, type_, body, correlation)

    def refuse(self, link: Link, code: ErrorCode, message: str, correlation: int) -> None:
        self.answer(link, ControlType.ERROR, Error(code=code, message=message), correlation)

    def relay(self, peer: Link, type_: ControlType, body: Body, origin: Link, corr: int) -> None:
        ours = self._next_relay
        self._next_relay += 1
        self._relayed[ours] = (origin, corr, peer)
        peer.send(encode_control(type_, body, ours))

    def on_relayed(self, peer: Link, correlation: int, body: Body) -> None:
        assert isinstance(body, Relayed)
        waiting = self._relayed.pop(correlation, None)
        if waiting is None:
            return
        origin, corr, _ = waiting
        if origin.state is LinkState.OPEN:
            origin.send(encode_control_raw(body.type, body.body, corr))

    def peer_lost(self, peer: Link) -> None:
        """Requests relayed to a broker that is gone get an answer now: try again."""
        lost = [ours for ours, (_, _, via) in self._relayed.items() if via is peer]
        for ours in lost:
            origin, corr, _ = self._relayed.pop(ours)
            self.refuse(
                origin,
                ErrorCode.UNAVAILABLE,
                f"broker {peer.name} left the mesh before it answered; try again",
                corr,
            )
        if lost:
            self.broker.flush_outbox()

    # -- members ------------------------------------------------------------------------

    def on_members(self, link: Link, correlation: int, body: Body) -> None:
        assert isinstance(body, MembersRequest)
        routing = self.broker.routing
        members = routing.members(body.group)
        if body.pick and members:
            local = [m for m in members if not routing.is_remote_member(m)] or members
            fewest = min(self.groups.holds(m) for m in local)
            members = [
                routing.pick([m for m in local if self.groups.holds(m) == fewest]),
            ]
        self.answer(link, ControlType.MEMBER_LIST, MemberList(members=members), correlation)

    # -- message groups -----------------------------------------------------------------------

    def _home(self, key: bytes) -> Link | None:
        """The peer that is the group's home; None when it is this broker."""
        mesh = self.broker.mesh
        home = home_of(key, [mesh.name, *mesh.peers])
        return mesh.peers.get(home)

    def on_bind(self, link: Link, correlation: int, body: Body) -> None:
        assert isinstance(body, GroupBind)
        home = None if link.is_peer else self._home(body.group + body.key)
        if home is not None:
            self.relay(home, ControlType.GROUP_BIND, body, link, correlation)
            return
        routing = self.broker.routing
        members = routing.members(body.group)
        key = (body.group, body.key)
        binding = self.groups.bind(key, members, body.failed, body.expiry, self.broker.clock())
        if binding is not None and body.sender:
            binding.senders.add(body.sender)
        if binding is None:
            self.refuse(
                link,
                ErrorCode.UNAVAILABLE,
                f"no member of {describe_address(body.group)} to hold message group "
                f"{body.key.decode(errors='replace')!r}",
                correlation,
            )
            return
        self._replicate([(body.group, body.key, binding.member, binding.expiry)])
        bound = GroupBound(member=binding.member, reassigned=binding.moved)
        self.answer(link, ControlType.GROUP_BOUND, bound, correlation)

    def on_end(self, link: Link, correlation: int, body: Body) -> None:
        assert isinstance(body, GroupEnd)
        home = None if link.is_peer else self._home(body.group + body.key)
        if home is not None:
            home.send(encode_control(ControlType.GROUP_END, body))
        else:
            self.groups.end((body.group, body.key), body.sender, self.broker.clock())
        if correlation:
            self.answer(link, ControlType.OK, Empty(), correlation)

    def _replicate(self, ops: list[GroupOp]) -> None:
        mesh = self.broker.mesh
        if mesh.peers:
            frame = encode_control(ControlType.GROUPS, Groups(ops=ops))
            for peer in mesh.peers.values():
                peer.send(frame)

    def on_groups(self, link: Link, correlation: int, body: Body) -> None:
        assert isinstance(body, Groups)
        now = self.broker.clock()
        for anycast, group, member, expiry in body.ops:
            if member:
                self.groups.put((anycast, group), member, expiry, now)
            else:
                self.groups.drop((anycast, group))

    def expire(self) -> None:
        """The seed's deletion process, on every broker; what it drops, it drops everywhere
        (a binding its home let linger after the group's end is still held by the peers)."""
        dropped = self.groups.expire(self.broker.clock())
        if dropped:
            self._replicate([(anycast, group, b"", 0.0) for anycast, group in dropped])

    def send_groups(self, peer: Link) -> None:
        """Every binding, to a peer that just linked up."""
        ops = list(self.groups.ops())
        if ops:
            peer.send(encode_control(ControlType.GROUPS, Groups(ops=ops)))

    # -- services leaving --------------------------------------------------------------------

    def on_watch(self, link: Link, correlation: int, body: Body) -> None:
        self.watchers.add(link)
        self.answer(link, ControlType.OK, Empty(), correlation)

    def services_left(self, addresses: list[bytes]) -> None:
        """Tell the watchers, once per loop turn, which services left the mesh."""
        if not self.watchers or not addresses:
            return
        if not self._left:
            asyncio.get_running_loop().call_soon(self._tell_watchers)
        self._left.extend(addresses)

    def _tell_watchers(self) -> None:
        left, self._left = self._left, []
        body = Left(addresses=left)
        for link in list(self.watchers):
            if link.state is LinkState.OPEN:
                self.broker.reply(link, ControlType.LEFT, body)
            else:
                self.watchers.discard(link)
        self.broker.flush_outbox()
