"""Who is in the group: voters and learners, changed one node at a time.

A membership is carried whole in the log entry that changes it, so every log (and
every snapshot) says which membership applies at each index. A node uses the latest
membership in its log, committed or not (the Raft thesis, section 4.1): with one node
changed at a time, any majority of the old voters and any majority of the new ones
share a node, so two leaders cannot be elected in one term by the two memberships.
The leader proposes a change only once the previous one is committed and it has
committed an entry of its own term (the fix Ongaro posted to raft-dev in 2015 for
single-server changes across leader changes).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshbus.raft.errors import ProposalRefused


class ChangeKind(enum.Enum):
    ADD_VOTER = "add-voter"  # also promotes a learner
    ADD_LEARNER = "add-learner"  # also demotes a voter
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class MembershipChange:
    kind: ChangeKind
    node: int


@dataclass(frozen=True, slots=True)
class Membership:
    voters: frozenset[int] = frozenset()
    learners: frozenset[int] = frozenset()

    @classmethod
    def of(cls, voters: Iterable[int], learners: Iterable[int] = ()) -> Membership:
        return cls(frozenset(voters), frozenset(learners))

    @property
    def members(self) -> frozenset[int]:
        return self.voters | self.learners

    @property
    def quorum(self) -> int:
        """How many voters make a majority."""
        return len(self.voters) // 2 + 1

    def changed(self, change: MembershipChange) -> Membership:
        """This membership with one node added, moved or removed."""
        node = change.node
        if change.kind is ChangeKind.ADD_VOTER:
            if node in self.voters:
                raise ProposalRefused(f"node {node} is a voter already")
            return Membership(self.voters | {node}, self.learners - {node})
        if change.kind is ChangeKind.ADD_LEARNER:
            if node in self.learners:
                raise ProposalRefused(f"node {node} is a learner already")
            if self.voters == {node}:
                raise ProposalRefused(f"node {node} is the last voter; add another first")
            return Membership(self.voters - {node}, self.learners | {node})
        if node not in self.members:
            raise ProposalRefused(f"node {node} is not a member")
        if self.voters == {node}:
            raise ProposalRefused(f"node {node} is the last voter; add another first")
        return Membership(self.voters - {node}, self.learners - {node})

    def __str__(self) -> str:
        voters = ",".join(map(str, sorted(self.voters)))
        learners = ",".join(map(str, sorted(self.learners)))
        return f"voters=({voters})" + (f" learners=({learners})" if learners else "")


def quorum_index(membership: Membership, match: Mapping[int, int]) -> int:
    """The highest index that a majority of the voters hold (0 if none)."""
    held = sorted((match.get(voter, 0) for voter in membership.voters), reverse=True)
    return held[membership.quorum - 1] if held else 0


class VoteResult(enum.Enum):
    WON = "won"
    LOST = "lost"
    PENDING = "pending"


def vote_result(membership: Membership, votes: Mapping[int, bool]) -> VoteResult:
    """Whether the votes so far (voter -> granted) win, lose or wait for more."""
    granted = sum(1 for voter in membership.voters if votes.get(voter) is True)
    missing = sum(1 for voter in membership.voters if voter not in votes)
    if granted >= membership.quorum:
        return VoteResult.WON
    if granted + missing >= membership.quorum:
        return VoteResult.PENDING
    return VoteResult.LOST
