"""Unit tests of the Raft core's rules that the interaction scripts and the simulation
reach only by chance: each builds the exact situation by hand."""

from __future__ import annotations

import dataclasses

import pytest

from meshbus.errors import InvalidArgument
from meshbus.raft import (
    ChangeKind,
    DriverError,
    Entry,
    HardState,
    Membership,
    MembershipChange,
    Message,
    MessageType,
    NotLeader,
    ProposalRefused,
    RaftNode,
    RaftSettings,
    Role,
    Snapshot,
    Stored,
)
from tests.unit.raft.harness import Cluster
from tests.unit.raft.test_interaction import Fixed

T = MessageType
MEMBERS = Membership.of([1, 2, 3])


def node(entries: list[tuple[int, int]], term: int, commit: int = 0) -> RaftNode:
    """Node 1 with the log of (term, index) entries, at ``term``."""
    log = tuple(Entry(t, i, membership=MEMBERS if i == 1 else None) for t, i in entries)
    stored = Stored(HardState(term, None, commit), Snapshot(0, 0, Membership()), log)
    return RaftNode(1, RaftSettings(), stored, Fixed(0))


def elect(core: RaftNode) -> None:
    """Make node 1 leader by votes from 2 and 3, its Ready handled (no messages kept)."""
    core.campaign()
    for voter in (2, 3):
        core.step(Message(T.PRE_VOTE_RESPONSE, voter, 1, core.term + 1))
    for voter in (2, 3):
        core.step(Message(T.VOTE_RESPONSE, voter, 1, core.term))
    assert core.role is Role.LEADER
    core.ready()
    core.advance()


def test_an_entry_of_an_older_term_is_not_committed_by_counting() -> None:
    # Figure 8 of the Raft paper: the new leader of term 4 holds 2/2 on a majority,
    # yet commits it only with an entry of its own term.
    core = node([(1, 1), (2, 2)], term=3, commit=1)
    elect(core)
    core.step(Message(T.APPEND_RESPONSE, 2, 1, 4, index=2))
    assert core.log.committed == 1
    core.step(Message(T.APPEND_RESPONSE, 2, 1, 4, index=3))
    assert core.log.committed == 3


def test_answers_from_before_a_damaged_restart_are_void() -> None:
    core = node([(1, 1)], term=1, commit=1)
    elect(core)
    core.propose(b"a")
    core.ready()
    core.advance()
    # Node 2 restarted from a damaged log (epoch 1) and says so ...
    core.step(Message(T.HEARTBEAT_RESPONSE, 2, 1, 2, epoch=1, repairing=True))
    assert core.progress[2].match == 0
    # ... then its answer from before the damage arrives: it must not count.
    core.step(Message(T.APPEND_RESPONSE, 2, 1, 2, index=3))
    assert core.progress[2].match == 0
    assert core.log.committed == 1


def test_a_repairing_node_counts_toward_no_commit_and_is_repaired_by_one_without_it() -> None:
    core = node([(1, 1)], term=1, commit=1)
    elect(core)  # the leader's entry of term 2 at 2
    core.step(Message(T.HEARTBEAT_RESPONSE, 2, 1, 2, epoch=1, repairing=True))
    # The leader appended an entry of its own on learning of the damage ...
    assert core.progress[2].repair_index == 3
    assert core.log.term(3) == 2
    core.ready()
    core.advance()
    # ... which node 2, repairing, holds: not counted, nothing is committed ...
    core.step(Message(T.APPEND_RESPONSE, 2, 1, 2, index=3, epoch=1, repairing=True))
    assert core.progress[2].match == 3
    assert core.log.committed == 1
    sent = core.ready().early_messages  # a leader's appends: sent before its write
    assert all(m.epoch == 0 for m in sent if m.kind is T.APPEND)  # nothing repairs it yet
    core.advance()
    # ... until node 3 holds it: committed without node 2, which that append repairs.
    core.step(Message(T.APPEND_RESPONSE, 3, 1, 2, index=3))
    assert core.log.committed == 3
    (append,) = [m for m in core.ready().early_messages if m.to == 2]
    assert (append.kind, append.commit, append.epoch) == (T.APPEND, 3, 1)
    core.advance()
    # Once it says it is repaired, its answers count again.
    core.step(Message(T.APPEND_RESPONSE, 2, 1, 2, index=3, epoch=1))
    assert not core.progress[2].repairing


def test_a_repairing_node_takes_no_commit_index_from_a_heartbeat() -> None:
    # The leader caps a heartbeat's commit at what it heard the node holds -- maybe
    # before the node's log went back to an older one, different there.
    core = repairing_follower()
    core.step(Message(T.HEARTBEAT, 1, 3, 2, commit=1))
    core.step(Message(T.APPEND, 1, 3, 2, index=1, log_term=1, entries=(Entry(1, 2),)))
    core.step(Message(T.HEARTBEAT, 1, 3, 2, commit=2))
    assert core.log.committed == 1


def repairing_follower() -> RaftNode:
    stored = Stored(
        HardState(2, 1, 1, epoch=1, repairing=True),
        Snapshot(0, 0, Membership()),
        (Entry(1, 1, membership=MEMBERS),),
    )
    return RaftNode(3, RaftSettings(), stored, Fixed(0))


@pytest.mark.parametrize(
    ("epoch", "commit", "repaired"),
    [
        (0, 3, False),  # sent before the leader knew of the damage
        (1, 2, False),  # the leader's commit is not yet of its own term
        (1, 3, True),
    ],
)
def test_a_repairing_node_is_whole_only_with_the_leaders_commit_of_its_term(
    epoch: int, commit: int, repaired: bool
) -> None:
    core = repairing_follower()
    entries = (Entry(1, 2), Entry(2, 3))
    core.step(
        Message(T.APPEND, 1, 3, 2, index=1, log_term=1, entries=entries, commit=commit, epoch=epoch)
    )
    assert core.repairing is not repaired


def test_a_repairing_node_neither_votes_nor_campaigns() -> None:
    core = repairing_follower()
    core.step(Message(T.VOTE, 2, 3, 3, index=5, log_term=2))
    (answer,) = core.ready().messages
    assert answer.reject
    core.advance()
    for _ in range(100):
        core.tick()
    assert core.role is Role.FOLLOWER
    assert not core.ready().messages


def test_the_driver_advances_each_ready_before_anything_else() -> None:
    core = node([(1, 1)], term=1, commit=1)
    core.campaign()
    core.ready()
    with pytest.raises(DriverError):
        core.tick()
    with pytest.raises(DriverError):
        core.step(Message(T.VOTE_RESPONSE, 2, 1, 2))
    core.advance()
    with pytest.raises(DriverError):
        core.advance()
    with pytest.raises(DriverError):
        core.compact(5, b"")  # not applied yet


def test_only_the_leader_takes_proposals() -> None:
    core = node([(1, 1)], term=1, commit=1)
    with pytest.raises(NotLeader, match="no leader is known yet"):
        core.propose(b"a")
    core.step(Message(T.HEARTBEAT, 2, 1, 2))
    with pytest.raises(NotLeader, match="node 2 is the one to ask") as caught:
        core.propose(b"a")
    assert caught.value.leader == 2


def test_the_leader_counts_its_own_entry_once_it_is_durable() -> None:
    cluster = Cluster([1], RaftSettings(), lambda n: Fixed(0))
    core = cluster.nodes[1].up
    core.campaign()
    assert core.role is Role.LEADER
    ready = core.ready()
    assert ready.entries
    assert [e.index for e in ready.committed] == [1]
    assert core.log.committed == 1  # the leader's empty entry is not durable yet
    cluster.nodes[1].disk.write(ready)
    core.advance()
    assert core.log.committed == 2


def test_a_leaders_appends_leave_before_its_write_and_its_followers_answers_after() -> None:
    core = node([(1, 1)], term=1, commit=1)
    elect(core)
    for voter in (2, 3):  # they hold the term's entry: appends go back to back now
        core.step(Message(T.APPEND_RESPONSE, voter, 1, 2, index=2))
    core.ready()
    core.advance()
    core.propose(b"a")
    ready = core.ready()
    assert ready.must_sync
    assert {(m.kind, m.to) for m in ready.early_messages} == {(T.APPEND, 2), (T.APPEND, 3)}
    assert not ready.messages
    core.advance()
    # A follower answers only once the entries it acknowledges are durable.
    stored = Stored(HardState(2, 1, 1), Snapshot(0, 0, Membership()), (Entry(1, 1, b"", MEMBERS),))
    follower = RaftNode(2, RaftSettings(), stored, Fixed(0))
    follower.step(Message(T.APPEND, 1, 2, 2, index=1, log_term=1, entries=(Entry(2, 2),)))
    ready = follower.ready()
    assert ready.must_sync
    assert not ready.early_messages
    assert [m.kind for m in ready.messages] == [T.APPEND_RESPONSE]


def test_a_commit_index_alone_is_written_without_an_fsync() -> None:
    core = node([(1, 1)], term=1, commit=1)
    elect(core)
    core.step(Message(T.APPEND_RESPONSE, 2, 1, 2, index=2))
    ready = core.ready()
    assert ready.hard_state is not None
    assert ready.hard_state.commit == 2
    assert not ready.must_sync
    assert [e.index for e in ready.committed] == [2]
    assert all(m.commit == 2 for m in ready.early_messages)


def test_a_leader_whose_term_is_not_durable_yet_sends_after_its_write() -> None:
    # A single voter wins at once: its term and vote are in this very Ready, and an
    # append of that term must not reach the learner before they are durable.
    cluster = Cluster([1], RaftSettings(), lambda n: Fixed(0), learners=[2])
    core = cluster.nodes[1].up
    core.campaign()
    assert core.role is Role.LEADER
    ready = core.ready()
    assert ready.must_sync
    assert not ready.early_messages
    assert [(m.kind, m.to) for m in ready.messages] == [(T.APPEND, 2)]
    core.advance()
    core.step(Message(T.APPEND_RESPONSE, 2, 1, core.term, index=2))
    core.ready()
    core.advance()
    core.propose(b"a")
    assert [m.to for m in core.ready().early_messages] == [2]  # the term is durable now


def test_settings_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="below election_ticks"):
        RaftSettings(election_ticks=3, heartbeat_ticks=3)
    with pytest.raises(InvalidArgument):
        RaftSettings(max_append_entries=0)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (MembershipChange(ChangeKind.ADD_VOTER, 1), "a voter already"),
        (MembershipChange(ChangeKind.REMOVE, 9), "not a member"),
    ],
)
def test_a_membership_change_must_change_something(change: MembershipChange, error: str) -> None:
    with pytest.raises(ProposalRefused, match=error):
        MEMBERS.changed(change)
    only = Membership.of([1])
    with pytest.raises(ProposalRefused, match="last voter"):
        only.changed(MembershipChange(ChangeKind.REMOVE, 1))
    assert str(dataclasses.replace(only, learners=frozenset({3}))) == "voters=(1) learners=(3)"


def test_a_membership_change_carries_the_drivers_data_with_it() -> None:
    core = node([(1, 1)], term=1, commit=1)
    elect(core)
    core.step(Message(T.APPEND_RESPONSE, 2, 1, core.term, index=2))  # the term's entry
    index = core.propose_change(MembershipChange(ChangeKind.ADD_LEARNER, 4), b"who 4 is")
    (entry,) = core.ready().entries
    assert (entry.index, entry.data) == (index, b"who 4 is")
    assert entry.membership == Membership.of([1, 2, 3], [4])


def settle(cluster: Cluster) -> None:
    """Every Ready handled and every message delivered, no tick between."""
    while True:
        busy = [n for n, sim in cluster.nodes.items() if sim.core and sim.up.has_ready()]
        for node in busy:
            cluster.process(node)
        if not busy and not cluster.in_flight:
            return
        flying, cluster.in_flight = cluster.in_flight, []
        for message in flying:
            cluster.deliver(message)


def lost_leader(lease: bool = False) -> Cluster:
    """Three voters, node 1 leading, then killed; with ``lease``, 3 has not heard."""
    cluster = Cluster([1, 2, 3], RaftSettings(), lambda n: Fixed(0))
    cluster.nodes[1].up.campaign()
    settle(cluster)
    assert cluster.nodes[1].up.role is Role.LEADER
    cluster.nodes[1].crash()
    return cluster


def test_followers_that_lose_the_leaders_link_elect_another_at_once() -> None:
    cluster = lost_leader()
    for node in (2, 3):
        cluster.nodes[node].up.leader_lost()
    # The first other voter asks at once: no tick, no election timeout waited out.
    assert cluster.nodes[2].up.role is Role.PRE_CANDIDATE
    assert cluster.nodes[3].up.role is Role.FOLLOWER
    settle(cluster)
    assert cluster.nodes[2].up.role is Role.LEADER
    assert cluster.nodes[3].up.leader == 2
    assert cluster.nodes[3].up.term == cluster.nodes[2].up.term == 3  # one election after 1's


def test_a_follower_still_in_its_lease_refuses_until_it_loses_the_leader_too() -> None:
    cluster = lost_leader()
    cluster.nodes[2].up.leader_lost()
    settle(cluster)
    # 3 heard from 1 within an election timeout: 2's pre-vote is ignored, no term moved.
    assert cluster.nodes[2].up.role is Role.PRE_CANDIDATE
    assert (cluster.nodes[3].up.role, cluster.nodes[3].up.term) == (Role.FOLLOWER, 2)
    # Told in turn, 3 waits its stagger -- 2 asked first -- then campaigns and wins.
    third = cluster.nodes[3].up
    third.leader_lost()
    assert third.role is Role.FOLLOWER
    ticks = 0
    while third.role is Role.FOLLOWER:
        third.tick()
        ticks += 1
    assert ticks == 2
    settle(cluster)
    assert third.role is Role.LEADER
    assert cluster.nodes[2].up.leader == 3


def test_a_wrong_word_of_a_lost_leader_disturbs_nothing() -> None:
    cluster = Cluster([1, 2, 3], RaftSettings(), lambda n: Fixed(0))
    cluster.nodes[1].up.campaign()
    settle(cluster)
    # The link of 2 to 1 flapped; 1 is alive and 3 still hears it.
    cluster.nodes[2].up.leader_lost()
    settle(cluster)
    assert cluster.nodes[1].up.role is Role.LEADER
    assert cluster.nodes[1].up.term == 2  # still the term it was elected in
    cluster.nodes[1].up.tick()  # a heartbeat: 2 follows 1 again
    settle(cluster)
    assert cluster.nodes[2].up.leader == 1
    # A leader, or a follower that knows no leader, has nothing to lose.
    cluster.nodes[1].up.leader_lost()
    assert cluster.nodes[1].up.role is Role.LEADER
