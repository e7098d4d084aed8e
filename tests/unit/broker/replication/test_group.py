"""One group as the driver holds it: who its node ids are, from its log's latest roster
over the one it was founded or joined with; and its log records and back."""

from __future__ import annotations

import random

from meshbus.broker.replication.group import (
    Group,
    GroupMeta,
    encode_snapshot,
    record_of,
    stored_of,
)
from meshbus.broker.replication.members import Member, Roster, encode_roster
from meshbus.raft import Entry, HardState, Membership, RaftNode, RaftSettings, Snapshot, Stored
from meshbus.storage.raftlog import GroupLog

FOUNDING = Entry(1, 1, membership=Membership.of([1, 2, 3]))


def group(entries: tuple[Entry, ...], meta: GroupMeta, node: int = 1) -> Group:
    stored = Stored(HardState(1, None, 0), Snapshot(0, 0, Membership()), entries)
    return Group("orders", meta, RaftNode(node, RaftSettings(), stored, random.Random(0)))


def test_a_founding_member_knows_the_founding_list() -> None:
    founded = group((FOUNDING,), GroupMeta(["b1", "b2", "b3"]))
    assert [founded.broker_of(n) for n in (1, 2, 3, 4)] == ["b1", "b2", "b3", None]
    assert founded.brokers() == (["b1", "b2", "b3"], [])


def test_the_latest_roster_in_the_log_names_the_members() -> None:
    roster, _ = Roster.founding(["b1", "b2", "b3"]).added("b4", 9, replaces=3)
    change = Entry(2, 2, encode_roster(roster), Membership.of([1, 2, 3], [4]))
    held = group((FOUNDING, change), GroupMeta(["b1", "b2", "b3"]))
    assert held.member(4) == Member(4, "b4", 9, replaces=3)
    assert held.brokers() == (["b1", "b2", "b3"], ["b4"])
    removed = Entry(2, 3, encode_roster(roster.without(3)), Membership.of([1, 2], [4]))
    held = group((FOUNDING, change, removed), GroupMeta(["b1", "b2", "b3"]))
    assert held.current().members == [Member(1, "b1"), Member(2, "b2"), Member(4, "b4", 9, 3)]
    assert held.broker_of(3) == "b3"  # still named, for a message of the old one to drop


def test_a_joiner_routes_by_its_join_until_its_log_names_its_leader() -> None:
    """Node 6 joined a group whose leader, node 5, was itself added after the founding:
    the older rosters it copies first name neither."""
    members = [Member(1, "b1"), Member(5, "b5", 7), Member(6, "b6", 8)]
    meta = GroupMeta(["b1", "b2", "b3"], node=6, members=members)
    older, _ = Roster.founding(["b1", "b2", "b3"]).added("b4", 3, replaces=2)
    change = Entry(2, 2, encode_roster(older), Membership.of([1, 2, 3], [4]))
    joiner = group((FOUNDING, change), meta, node=6)
    assert (joiner.broker_of(5), joiner.broker_of(6), joiner.broker_of(4)) == ("b5", "b6", "b4")
    assert joiner.base().next_node == 7


def test_a_record_of_the_core_values_is_read_back_the_same() -> None:
    roster = encode_roster(Roster.founding(["b1", "b2", "b3"]))
    entries = (FOUNDING, Entry(1, 2, b"data"), Entry(1, 3, roster, Membership.of([1, 2], [3])))
    hard = HardState(4, 2, 3, epoch=1)
    state = GroupLog()
    state.apply(record_of("orders", hard, None, entries))
    assert stored_of(state) == Stored(hard, Snapshot(0, 0, Membership()), entries)


def test_a_replacement_is_looked_for_only_when_one_may_be_due() -> None:
    held = group((FOUNDING,), GroupMeta(["b1", "b2", "b3"]))
    held.heard = {2: 100, 3: 100}
    assert not held.may_need_replacing(149, replace_after=50)
    assert not held.may_need_replacing(10_000, replace_after=0)  # never for silence
    assert held.may_need_replacing(150, replace_after=50)  # node 2 and 3 silent for 50
    held.lost.add(3)
    assert held.may_need_replacing(100, replace_after=0)
    held.lost.clear()
    roster, _ = Roster.founding(["b1", "b2", "b3"]).added("b4", 9, replaces=3)
    promoted = Entry(2, 2, encode_roster(roster), Membership.of([1, 2, 3, 4]))
    replacing = group((FOUNDING, promoted), GroupMeta(["b1", "b2", "b3"]))
    replacing.heard = {2: 100, 3: 100, 4: 100}
    assert replacing.may_need_replacing(100, replace_after=0)  # node 3 still to remove


def test_the_roster_of_a_compacted_change_comes_from_the_snapshot() -> None:
    """The entry that replaced node 3 by node 4 (b4) is compacted away: the snapshot's
    data keeps the roster, so node 4 is still b4 -- after a restart from the snapshot,
    and on a node that installed it."""
    roster, _ = Roster.founding(["b1", "b2", "b3"]).added("b4", 9, replaces=3)
    roster = roster.without(3)
    snapshot = Snapshot(5, 2, Membership.of([1, 2, 4]), encode_snapshot(roster, b"mark"))
    stored = Stored(HardState(2, None, 5), snapshot, (Entry(2, 6, b"x"),))
    meta = GroupMeta(["b1", "b2", "b3"])
    restored = Group("orders", meta, RaftNode(1, RaftSettings(), stored, random.Random(0)))
    assert restored.member(4) == Member(4, "b4", 9, replaces=3)
    assert restored.brokers() == (["b1", "b2", "b4"], [])
    assert restored.roster_at(restored.node.log.change_at(6)) == restored.roster()
    # A snapshot whose data holds no roster (or none this broker reads): the founding one.
    unread = Snapshot(5, 2, Membership.of([1, 2, 3]), b"\xc1")
    plain = Stored(HardState(2, None, 5), unread)
    old = Group("orders", meta, RaftNode(1, RaftSettings(), plain, random.Random(0)))
    assert old.broker_of(3) == "b3"
