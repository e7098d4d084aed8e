"""One Raft group as the driver holds it (``Group``): its node, what it is (``GroupMeta``,
kept with its log), who its node ids are (its roster: meshbus.broker.replication.members)
and what its leader knows of its members for a replacement; and the conversions between
the core's values and the log's records (meshbus.storage.raftlog knows nothing of the
core)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from meshbus.broker.replication.members import (
    Member,
    Roster,
    Seen,
    decode_roster,
    encode_roster,
)
from meshbus.raft import Entry, HardState, Membership, Message, RaftNode, Snapshot, Stored
from meshbus.storage.raftlog import GroupLog, WalEntry, WalRecord, WalSnapshot
from meshbus.storage.raftstate import WalHardState


class SnapshotData(msgspec.Struct, array_like=True, frozen=True):
    """A group's snapshot data: the roster in force at its index (the membership-change
    entries that carried it are compacted away with the rest) and the state machine's
    own (``StateMachine.snapshot``)."""

    roster: bytes
    app: bytes


_encode = msgspec.msgpack.Encoder().encode
_decode_snapshot = msgspec.msgpack.Decoder(SnapshotData).decode


def encode_snapshot(roster: Roster, app: bytes) -> bytes:
    return _encode(SnapshotData(encode_roster(roster), app))


def snapshot_app(data: bytes) -> bytes:
    """The state machine's part of a snapshot's data (b"": none)."""
    return _decode_snapshot(data).app if data else b""


def snapshot_roster(data: bytes) -> bytes:
    """The roster in a snapshot's data (b"": none there, or data this broker does not
    read -- a snapshot from before rosters were kept in it)."""
    try:
        return _decode_snapshot(data).roster if data else b""
    except msgspec.DecodeError:
        return b""


class GroupMeta(msgspec.Struct, array_like=True, frozen=True):
    """What a group is, stored with its log: its founding replicas (node id = place +
    1) and the application's description of it (a stream's configuration); on a member
    added later, its ``node`` id and the ``members`` it was added to."""

    replicas: list[str]
    app: bytes = b""
    node: int = 0
    members: list[Member] = msgspec.field(default_factory=list)


@dataclass
class Group:
    name: str
    meta: GroupMeta
    node: RaftNode
    leader: str | None = None
    term: int = 0
    # index -> (term, its future): proposals waiting for their entry to be applied here
    proposals: dict[int, tuple[int, asyncio.Future[int]]] = field(default_factory=dict)
    leader_changes: int = 0  # a leader known, other than the one before (none between)
    # node id -> the incarnation learned from its first message (a founding member's)
    learned: dict[int, int] = field(default_factory=dict)
    heard: dict[int, int] = field(default_factory=dict)  # node id -> the tick last heard
    lost: set[int] = field(default_factory=set)  # members whose broker is another self
    strangers: dict[str, int] = field(default_factory=dict)  # broker -> its incarnation
    _roster: tuple[int, int, Roster] | None = None  # (index, term, roster) of the log's
    # Data of the entries applied since the last snapshot (the compaction policy's)
    applied_bytes: int = 0
    # A snapshot that waits for the state machine to hold its state (StateMachine.install)
    held_snapshot: Message | None = None

    def roster(self) -> Roster:
        """Who the node ids are: the latest roster in the log (committed or not), over
        the one the group was founded or joined with (a member added later holds the
        log's older rosters first, which may name neither it nor its leader)."""
        return self.roster_at(self.node.log.last_change)

    def roster_at(self, change: int) -> Roster:
        """The roster of the membership change at index ``change`` -- in the log, or
        the snapshot's (kept in its data) --, over the founding or joining one."""
        log = self.node.log
        if change >= log.first_index:
            entry = log.entries(change, 1)[0]
            data, term = entry.data, entry.term
        else:
            snapshot = log.snapshot
            data, term = snapshot_roster(snapshot.data), snapshot.term
        if not data:
            return self.base()
        cached = self._roster
        if cached is None or cached[:2] != (change, term):
            newer = decode_roster(data)
            known = {m.node for m in newer.members}
            older = [m for m in self.base().members if m.node not in known]
            roster = Roster(older + newer.members, newer.next_node)
            cached = self._roster = (change, term, roster)
        return cached[2]

    def base(self) -> Roster:
        meta = self.meta
        if meta.members:
            next_node = max(m.node for m in meta.members) + 1
            return Roster(list(meta.members), next_node)
        return Roster.founding(meta.replicas)

    def member(self, node: int) -> Member | None:
        return self.roster().get(node)

    def broker_of(self, node: int) -> str | None:
        member = self.member(node)
        return member.broker if member is not None else None

    def incarnation_of(self, member: Member) -> int:
        return member.incarnation or self.learned.get(member.node, 0)

    def brokers(self) -> tuple[list[str], list[str]]:
        """The brokers of the voters and of the learners of the latest membership."""
        membership = self.node.membership
        voters = [self.broker_of(n) or "" for n in sorted(membership.voters)]
        learners = [self.broker_of(n) or "" for n in sorted(membership.learners)]
        return voters, learners

    def may_need_replacing(self, now: int, replace_after: int) -> bool:
        """Whether a replacement may have a step to take (members.next_step): a member
        lost, a learner, a replacement marked in the roster, or (``replace_after`` > 0)
        a member not heard from for that long or never since this node leads."""
        if self.lost or self.node.membership.learners:
            return True
        if replace_after:
            members = self.node.membership.members - {self.node.id}
            heard = self.heard
            if any(now - heard.get(peer, now - replace_after) >= replace_after for peer in members):
                return True
        return any(m.replaces for m in self.roster().members)

    def seen(self, now: int) -> dict[int, Seen]:
        """What this node, leading, knows of every other member at tick ``now``."""
        node = self.node
        members = node.membership.members - {node.id}
        self.lost &= members
        return {
            peer: Seen(
                now - self.heard.setdefault(peer, now),
                node.progress[peer].match if peer in node.progress else 0,
                peer in self.lost,
            )
            for peer in members
        }

    def replica_states(self) -> list[dict[str, Any]]:
        """What this node, leading, knows of each member: its broker, its state --
        ``leader``, ``follower``, ``repairing`` (its log was damaged: it counts for
        nothing until repaired) or ``silent`` (not heard from since the last
        check-quorum, at most an election timeout ago) --, its ``lag``, the entries of
        the leader's log it is not known to hold, and whether it is a ``voter`` (or a
        learner)."""
        node = self.node
        last = node.log.last_index
        learners = node.membership.learners
        states = []
        for peer, progress in sorted(node.progress.items()):
            if peer == node.id:
                kind = "leader"
            elif progress.repairing:
                kind = "repairing"
            elif not progress.recent_active:
                kind = "silent"
            else:
                kind = "follower"
            lag = 0 if peer == node.id else max(last - progress.match, 0)
            broker = self.broker_of(peer) or ""
            states.append(
                {"broker": broker, "state": kind, "lag": lag, "voter": peer not in learners}
            )
        return states

    def current(self) -> Roster:
        """The members of the latest membership, as the roster names them."""
        roster = self.roster()
        members = self.node.membership.members
        return Roster([m for m in roster.members if m.node in members], roster.next_node)


# -- between the core's values and the log's records ------------------------------------------


def wal_snapshot(snapshot: Snapshot) -> WalSnapshot:
    return WalSnapshot(
        snapshot.index,
        snapshot.term,
        sorted(snapshot.membership.voters),
        sorted(snapshot.membership.learners),
        snapshot.data,
    )


def record_of(
    group: str, hard: HardState | None, snapshot: Snapshot | None, entries: Sequence[Entry]
) -> WalRecord:
    return WalRecord(
        group,
        hard=None
        if hard is None
        else WalHardState(hard.term, hard.vote or 0, hard.commit, hard.epoch, hard.repairing),
        snapshot=None if snapshot is None else wal_snapshot(snapshot),
        entries=[wal_entry(e) for e in entries],
    )


def wal_entry(entry: Entry) -> WalEntry:
    membership = entry.membership
    if membership is None:
        return WalEntry(entry.term, entry.index, entry.data)
    return WalEntry(
        entry.term, entry.index, entry.data, sorted(membership.voters), sorted(membership.learners)
    )


def stored_of(state: GroupLog) -> Stored:
    hard, snap = state.hard, state.snapshot
    return Stored(
        HardState(hard.term, hard.vote or None, hard.commit, hard.epoch, hard.repairing),
        Snapshot(snap.index, snap.term, Membership.of(snap.voters, snap.learners), snap.data),
        tuple(
            Entry(
                e.term,
                e.index,
                e.data,
                None if e.voters is None else Membership.of(e.voters, e.learners),
            )
            for e in state.entries
        ),
    )
