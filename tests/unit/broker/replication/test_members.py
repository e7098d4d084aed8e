"""The roster and the replacement's steps (members.next_step), on plain values: what
the leader does next for each state of a replacement."""

from __future__ import annotations

from collections.abc import Mapping

from meshbus.broker.replication.members import (
    Member,
    Roster,
    Seen,
    Step,
    decode_roster,
    encode_roster,
    next_step,
)
from meshbus.raft import ChangeKind, Membership, MembershipChange

FOUNDED = Roster.founding(["b1", "b2", "b3"])
ACTIVE = 20  # ticks: heard from within this, a member answers
REPLACE_AFTER = 100
GAP = 8
HEARD = Seen(silent=0, match=50)


def step(
    membership: Membership,
    roster: Roster,
    seen: Mapping[int, Seen],
    *,
    replace_after: int = REPLACE_AFTER,
    candidates: tuple[str, ...] = ("b1", "b2", "b3", "b4", "b5"),
    strangers: Mapping[str, int] | None = None,
) -> Step | None:
    return next_step(
        membership,
        roster,
        seen,
        50,
        leader=1,
        active_within=ACTIVE,
        replace_after=replace_after,
        gap=GAP,
        candidates=lambda: candidates,
        strangers=strangers or {},
    )


def test_the_founding_roster_numbers_the_replicas_and_round_trips() -> None:
    assert FOUNDED.members == [Member(1, "b1"), Member(2, "b2"), Member(3, "b3")]
    assert FOUNDED.next_node == 4
    assert decode_roster(encode_roster(FOUNDED)) == FOUNDED
    learned = FOUNDED.known({2: 77})
    assert learned.get(2) == Member(2, "b2", 77)
    assert learned.get(3) == Member(3, "b3", 0)


def test_a_healthy_group_needs_nothing() -> None:
    voters = Membership.of([1, 2, 3])
    assert step(voters, FOUNDED, {2: HEARD, 3: HEARD}) is None
    # silent, but not for long enough; or replacement by silence is off
    silent = Seen(silent=REPLACE_AFTER - 1, match=0)
    assert step(voters, FOUNDED, {2: silent, 3: HEARD}) is None
    long_silent = Seen(silent=10 * REPLACE_AFTER, match=0)
    assert step(voters, FOUNDED, {2: long_silent, 3: HEARD}, replace_after=0) is None


def test_a_voter_whose_broker_is_another_incarnation_is_replaced_by_it() -> None:
    lost = Seen(silent=0, match=0, lost=True)
    found = step(Membership.of([1, 2, 3]), FOUNDED, {2: HEARD, 3: lost}, strangers={"b3": 9})
    assert found is not None
    assert found.change == MembershipChange(ChangeKind.ADD_LEARNER, 4)
    assert found.joining == Member(4, "b3", 9, replaces=3)
    assert found.roster is not None
    assert found.roster.next_node == 5
    assert found.roster.get(4) == found.joining


def test_a_silent_voter_is_replaced_by_the_next_broker_not_a_member() -> None:
    silent = Seen(silent=REPLACE_AFTER, match=0)
    voters = Membership.of([1, 2, 3])
    # b4's incarnation is not known yet: it is asked first
    assert step(voters, FOUNDED, {2: silent, 3: HEARD}) == Step(probe="b4")
    found = step(voters, FOUNDED, {2: silent, 3: HEARD}, strangers={"b4": 5})
    assert found is not None
    assert found.joining == Member(4, "b4", 5, replaces=2)
    assert step(voters, FOUNDED, {2: silent, 3: HEARD}, candidates=("b3", "b2")) is None


def replacing(learner: bool) -> tuple[Membership, Roster]:
    """b3 (node 3) being replaced by b4 (node 4): as a learner, or promoted."""
    roster, _ = FOUNDED.added("b4", 5, replaces=3)
    if learner:
        return Membership.of([1, 2, 3], [4]), roster
    return Membership.of([1, 2, 3, 4]), roster


def test_a_learner_is_promoted_only_once_caught_up() -> None:
    membership, roster = replacing(learner=True)
    behind = Seen(silent=0, match=50 - GAP - 1)
    assert step(membership, roster, {2: HEARD, 3: HEARD, 4: behind}) is None
    close = Seen(silent=0, match=50 - GAP)
    found = step(membership, roster, {2: HEARD, 3: HEARD, 4: close})
    assert found is not None
    # The old voter answers: it counts until the new one does (promoted first).
    assert found.change == MembershipChange(ChangeKind.ADD_VOTER, 4)


def test_a_replaced_voter_not_heard_from_is_removed_before_the_promotion() -> None:
    membership, roster = replacing(learner=True)
    gone = Seen(silent=ACTIVE, match=0)
    found = step(membership, roster, {2: HEARD, 3: gone, 4: HEARD})
    assert found is not None
    assert found.change == MembershipChange(ChangeKind.REMOVE, 3)
    assert found.roster is not None
    assert found.roster.get(3) is None
    # then the promotion, and the marker goes with it
    after = Membership.of([1, 2], [4])
    assert found.roster.get(4) == Member(4, "b4", 5, replaces=3)
    promoted = step(after, found.roster, {2: HEARD, 4: HEARD})
    assert promoted is not None
    assert promoted.change == MembershipChange(ChangeKind.ADD_VOTER, 4)
    assert promoted.roster is not None
    assert promoted.roster.get(4) == Member(4, "b4", 5)


def test_a_promoted_replacement_removes_the_old_voter() -> None:
    membership, roster = replacing(learner=False)
    found = step(membership, roster, {2: HEARD, 3: HEARD, 4: HEARD})
    assert found is not None
    assert found.change == MembershipChange(ChangeKind.REMOVE, 3)
    assert found.roster is not None
    assert found.roster.get(4) == Member(4, "b4", 5)
    assert step(Membership.of([1, 2, 4]), found.roster, {2: HEARD, 4: HEARD}) is None


def test_a_learner_lost_before_it_caught_up_is_removed() -> None:
    membership, roster = replacing(learner=True)
    for learner in (Seen(0, 0, lost=True), Seen(silent=REPLACE_AFTER, match=0)):
        found = step(membership, roster, {2: HEARD, 3: HEARD, 4: learner})
        assert found is not None
        assert found.change == MembershipChange(ChangeKind.REMOVE, 4)
