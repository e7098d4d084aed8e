"""Who a replicated stream's node ids are (its roster), and the one next step that
replaces a lost member (``next_step``): plain values and a pure function, no I/O.

A member is (node id, broker, incarnation). The incarnation is the broker's Raft state
(meshbus.storage.raftlog): a broker whose data dir was wiped comes back as another
incarnation, never as its old self -- it lost its log and its votes, so its old node
id must not speak again. Node ids are never reused: a new member takes the roster's
``next_node``, so a message from an old id can never be taken for a new member's.

The roster rides in the data of each membership-change entry (the core carries the
membership, this the names behind its ids), so every log says who its members are at
each index, committed or not, as it says which membership applies. The founding roster
is the founding list of brokers (node id = place + 1) with incarnations unknown (0):
each founding member's is learned from its first message.

The replacement, decided by the group's leader -- not by the meta group, which is told
the members after each change: the decision is ``next_step``'s, on what the leader knows
first hand (docs/raft.md, "Replacing a replica", says why) --, one membership change at
a time:

1. add the replacement as a **learner** (it counts toward nothing), marked with the
   node id it ``replaces``; it receives the log by ordinary appends, or, past the
   leader's compaction, a snapshot and a copy of the stream (copies.py);
2. once it is **caught up** (its match within ``gap`` entries of the leader's last):
   if the member it replaces is still heard from, **promote** it first, then remove
   the old one -- the old one still counts until then, so the group never has fewer
   voters that answer; if the old one is not heard from, **remove it first**, then
   promote -- a quorum that counts a voter that cannot answer is one more node that
   must be up (four voters with one gone need all three others, three voters with
   one gone need two of them);
3. the other step of 2.

A voter is replaced when its broker says it holds no such group with an incarnation
other than the member's (it was wiped: the new incarnation takes its place), or when it
has not been heard from for ``replace_after`` ticks (the next broker in the stream's
placement order that is not a member takes its place; its incarnation is asked first,
by a probe it answers as a stranger).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from meshbus.raft import ChangeKind, Membership, MembershipChange


class Member(msgspec.Struct, array_like=True, frozen=True):
    node: int
    broker: str
    incarnation: int = 0  # 0: a founding member's, learned from its first message
    replaces: int = 0  # the node id of the member this one is replacing (0: none)


class Roster(msgspec.Struct, array_like=True, frozen=True):
    """The members of one membership (voters and learners) and the next node id."""

    members: list[Member]
    next_node: int

    @classmethod
    def founding(cls, replicas: Sequence[str]) -> Roster:
        members = [Member(place + 1, broker) for place, broker in enumerate(replicas)]
        return cls(members, len(replicas) + 1)

    def get(self, node: int) -> Member | None:
        for member in self.members:
            if member.node == node:
                return member
        return None

    def of_broker(self, broker: str) -> list[Member]:
        return [m for m in self.members if m.broker == broker]

    def added(self, broker: str, incarnation: int, replaces: int) -> tuple[Roster, Member]:
        member = Member(self.next_node, broker, incarnation, replaces)
        return Roster([*self.members, member], self.next_node + 1), member

    def without(self, node: int) -> Roster:
        return Roster([m for m in self.members if m.node != node], self.next_node)

    def settled(self, node: int) -> Roster:
        """The roster with ``node`` no longer marked as replacing another."""
        members = [
            Member(m.node, m.broker, m.incarnation) if m.node == node else m for m in self.members
        ]
        return Roster(members, self.next_node)

    def known(self, incarnations: Mapping[int, int]) -> Roster:
        """The roster with the founding members' incarnations learned since filled in."""
        members = [
            Member(m.node, m.broker, incarnations.get(m.node, 0), m.replaces)
            if m.incarnation == 0
            else m
            for m in self.members
        ]
        return Roster(members, self.next_node)


encode_roster = msgspec.msgpack.Encoder().encode
decode_roster = msgspec.msgpack.Decoder(Roster).decode


@dataclass(frozen=True, slots=True)
class Seen:
    """What the leader knows of one member now."""

    silent: int  # ticks since it was last heard from
    match: int  # the last entry it is known to hold
    lost: bool = False  # its broker holds no such group, as another incarnation


@dataclass(frozen=True, slots=True)
class Step:
    """One thing to do: a membership ``change`` with the ``roster`` it brings (and a
    join to send to ``joining``, for an added learner), or a ``probe`` of a broker whose
    incarnation is not known yet."""

    change: MembershipChange | None = None
    roster: Roster | None = None
    joining: Member | None = None
    probe: str = ""


def next_step(
    membership: Membership,
    roster: Roster,
    seen: Mapping[int, Seen],
    last_index: int,
    *,
    leader: int,
    active_within: int,
    replace_after: int,
    gap: int,
    candidates: Callable[[], Sequence[str]],
    strangers: Mapping[str, int],
) -> Step | None:
    """The next step of a replacement (the module docstring), or None: nothing to do
    now. ``seen`` has every member but ``leader``; ``active_within``: a member silent
    for fewer ticks is heard from; ``replace_after``: ticks of silence after which a
    voter is replaced (0: never); ``candidates()``: the brokers in the stream's
    placement order, ready and linked (asked only when a silent voter is replaced);
    ``strangers``: the incarnations of brokers that said they hold no such group."""
    voters, learners = membership.voters, membership.learners
    for member in roster.members:
        if member.node not in membership.members or not member.replaces:
            continue
        old = member.replaces if member.replaces in membership.members else 0
        if member.node in learners:
            them = seen[member.node]
            if them.lost or (replace_after and them.silent >= replace_after):
                return _remove(roster, member.node)  # gone before it caught up: again
            if last_index - them.match > gap:
                return None  # catching up
            if old in voters and seen[old].silent >= active_within:
                return _remove(roster, old)
            promoted = roster if old else roster.settled(member.node)
            return Step(MembershipChange(ChangeKind.ADD_VOTER, member.node), promoted)
        if old:
            return _remove(roster.settled(member.node), old)
    for node in sorted(voters - {leader}):
        them = seen[node]
        voter = roster.get(node)
        if voter is None:
            continue
        if them.lost and voter.broker in strangers:
            return _add(roster, voter.broker, strangers[voter.broker], node)
        if replace_after and them.silent >= replace_after:
            taken = {m.broker for m in roster.members}
            for broker in candidates():
                if broker in taken:
                    continue
                if broker in strangers:
                    return _add(roster, broker, strangers[broker], node)
                return Step(probe=broker)
    return None


def _add(roster: Roster, broker: str, incarnation: int, replaces: int) -> Step:
    new, member = roster.added(broker, incarnation, replaces)
    change = MembershipChange(ChangeKind.ADD_LEARNER, member.node)
    return Step(change, new, joining=member)


def _remove(roster: Roster, node: int) -> Step:
    return Step(MembershipChange(ChangeKind.REMOVE, node), roster.without(node))
