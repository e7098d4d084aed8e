"""The Raft driver: many Raft groups (one per replicated stream) on the broker's loop,
with one write-ahead log (meshbus.storage.raftlog) and the peer links.

One *turn* (``turn``), the contract of docs/raft.md for every group at once:

1. step what arrived since the last turn -- ticks, messages, proposals -- into the
   nodes (never between a node's ``ready()`` and ``advance()``: they wait here);
2. take every group's Ready; append all their records to the log and fsync it **once**,
   in a worker thread (``run_blocking``) so the loop is never held by the disk (and, in
   a turn where a term, vote, epoch or repairing flag changed, the state file the log
   keeps them in apart: meshbus.storage.raftlog);
3. only then send each Ready's messages (``transport``), apply its committed entries
   (``machine``), resolve the proposals they settle, and ``advance()``.

So a thousand groups with an append each cost one fsync per turn, not a thousand, and
nothing leaves this broker before what it depends on is durable: a follower has its
entries on disk before it answers, a voter its vote before it grants it.

A log that fails (a full disk) stops the driver: no more sends, no more applies, every
proposal refused with the log's error. The other replicas elect a leader without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from meshbus.errors import MeshbusError
from meshbus.raft import (
    Entry,
    HardState,
    Membership,
    Message,
    NotLeader,
    ProposalRefused,
    RaftError,
    RaftNode,
    RaftSettings,
    Randomness,
    Ready,
    Role,
    Snapshot,
    Stored,
    bootstrap,
)
from meshbus.storage.raftlog import (
    GroupLog,
    RaftLogFailed,
    RaftWal,
    WalEntry,
    WalHardState,
    WalRecord,
    WalSnapshot,
)

log = logging.getLogger("meshbus.broker")

T = TypeVar("T")
RunBlocking = Callable[[Callable[[], T]], Awaitable[T]]


class ReplicationError(MeshbusError):
    """An append to a replicated stream was not committed; the message says why and
    what to do (a reliable sender's resend usually does it)."""


class Transport(Protocol):
    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        """Send ``messages`` of ``group`` to ``broker`` (dropped if it is not linked)."""


class StateMachine(Protocol):
    def apply(self, group: str, entries: Sequence[Entry]) -> None:
        """``entries`` are committed, in order (after a restart, again from the first one
        not in a snapshot: the machine skips what it applied already)."""

    def leader_changed(self, group: str, leader: str | None, term: int) -> None:
        """The leader this broker knows of ``group`` changed (None: none known)."""


class GroupMeta(msgspec.Struct, array_like=True, frozen=True):
    """What a group is, stored with its log: its replicas (node id = place + 1) and the
    application's description of it (a stream's configuration)."""

    replicas: list[str]
    app: bytes = b""


@dataclass
class _Group:
    name: str
    meta: GroupMeta
    node: RaftNode
    leader: str | None = None
    term: int = 0
    # index -> (term, its future): proposals waiting for their entry to be applied here
    proposals: dict[int, tuple[int, asyncio.Future[int]]] = field(default_factory=dict)
    leader_changes: int = 0  # a leader known, other than the one before (none between)

    def broker_of(self, node: int) -> str | None:
        replicas = self.meta.replicas
        return replicas[node - 1] if 0 < node <= len(replicas) else None


@dataclass
class DriverStats:
    turns: int = 0
    syncs: int = 0
    sync_seconds: float = 0.0  # appending the turns' records and fsyncing them
    records: int = 0
    sent: int = 0
    received: int = 0
    dropped: int = 0  # messages for a group this broker does not hold, or misaddressed


class RaftDriver:
    def __init__(
        self,
        *,
        name: Callable[[], str],
        wal: RaftWal,
        transport: Transport,
        machine: StateMachine,
        settings: RaftSettings,
        randomness: Randomness,
        run_blocking: RunBlocking[None],
    ) -> None:
        """``name()``: this broker's (known once it listens); ``run_blocking(fn)`` runs
        ``fn`` (the disk's work) off the loop and awaits it (``loop.run_in_executor``)."""
        self._name = name
        self._wal = wal
        self._transport = transport
        self._machine = machine
        self._settings = settings
        self._randomness = randomness
        self._run_blocking = run_blocking
        self.groups: dict[str, _Group] = {}
        self.stats = DriverStats()
        self.failed = ""
        self._ticks = 0
        self._inbox: list[tuple[str, Message]] = []
        self._proposals: list[tuple[str, bytes, asyncio.Future[int]]] = []
        self._records: list[WalRecord] = []  # written with the next turn's Readys
        self._wake = asyncio.Event()
        self._handing_over = False  # hand_over asked: transfers at the next turn

    # -- groups ---------------------------------------------------------------------------

    def recover(self) -> list[tuple[str, GroupMeta]]:
        """The groups the log holds, rebuilt as nodes; each with its meta."""
        found = []
        me = self._name()
        for group in self._wal.lost:
            log.error(
                "damage to the Raft log took every record of a replicated stream; this "
                "broker takes no part in it (its term and vote are kept, so it is never "
                "founded here again)",
                extra={"stream": group},
            )
        for group, state in self._wal.groups.items():
            meta = msgspec.msgpack.decode(state.meta, type=GroupMeta)
            if me not in meta.replicas:
                log.error(
                    "the Raft log names this broker's replicated stream under another broker "
                    "name; restart it with --name set to its name among the replicas",
                    extra={"stream": group, "replicas": meta.replicas, "name": me},
                )
                continue
            self._add(group, meta, _stored(state))
            found.append((group, meta))
        return found

    def create(self, group: str, replicas: Sequence[str], app: bytes) -> None:
        """Found ``group`` on this broker, one of ``replicas`` (the same list, in the same
        order, on every founding member: it is the group's first membership)."""
        if group in self.groups or group in self._wal.kept:
            return  # founded already (its log is read back at start: ``recover``)
        meta = GroupMeta(list(replicas), app)
        stored = bootstrap(Membership.of(range(1, len(replicas) + 1)))
        record = _record(group, stored.hard_state, None, stored.entries)
        self._records.append(msgspec.structs.replace(record, meta=msgspec.msgpack.encode(meta)))
        self._add(group, meta, stored)
        self._wake.set()

    def drop(self, group: str) -> None:
        """Forget ``group`` here (its stream was deleted)."""
        state = self.groups.pop(group, None)
        if state is None:
            return
        self._records.append(WalRecord(group, dropped=True))
        self._fail_proposals(state, ReplicationError(f"stream {group!r} was deleted"))
        self._wake.set()

    def _add(self, group: str, meta: GroupMeta, stored: Stored) -> None:
        node_id = meta.replicas.index(self._name()) + 1
        node = RaftNode(node_id, self._settings, stored, self._randomness)
        self.groups[group] = _Group(group, meta, node)

    def leader_of(self, group: str) -> str | None:
        state = self.groups.get(group)
        return state.leader if state is not None else None

    def is_leader(self, group: str) -> bool:
        state = self.groups.get(group)
        return state is not None and state.node.role is Role.LEADER

    def replica_states(self, group: str) -> list[dict[str, Any]]:
        """What the leader knows of each replica of ``group``: its broker, its state --
        ``leader``, ``follower``, ``repairing`` (its log was damaged: it counts for
        nothing until repaired) or ``silent`` (not heard from since the last
        check-quorum, at most an election timeout ago) -- and its ``lag``, the entries
        of the leader's log it is not known to hold. Empty where this broker does not
        lead the group: only the leader knows."""
        state = self.groups.get(group)
        if state is None or state.node.role is not Role.LEADER:
            return []
        node = state.node
        last = node.log.last_index
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
            states.append({"broker": state.broker_of(peer) or "", "state": kind, "lag": lag})
        return states

    def hand_over(self) -> list[str]:
        """Ask each group this broker leads to move its leadership to the follower that
        holds most of its log (the Raft core's leadership transfer: that follower is
        brought up to date, then campaigns at once) -- before a drain, so that no group
        waits an election timeout for a leader once this broker is gone. The groups it
        leads now; the transfers start at the next turn (a node takes nothing between
        its Ready and its advance). One that cannot move then (no other voter is up to
        it, a membership change under way) is logged and keeps its leader until the
        broker stops."""
        self._handing_over = True
        self._wake.set()
        return [name for name, state in self.groups.items() if state.node.role is Role.LEADER]

    def _transfer_leaderships(self) -> None:
        for state in self.groups.values():
            node = state.node
            if node.role is not Role.LEADER:
                continue
            others = [
                (progress.recent_active, progress.match, peer)
                for peer, progress in node.progress.items()
                if peer != node.id and peer in node.membership.voters and not progress.repairing
            ]
            if not others:
                log.warning("stream %s: no other voter to lead it", state.name)
                continue
            try:
                node.transfer_leadership(max(others)[2])
            except ProposalRefused as exc:
                log.warning("stream %s: its leadership stays here: %s", state.name, exc)

    # -- what comes in ------------------------------------------------------------------------

    def tick(self) -> None:
        self._ticks += 1
        self._wake.set()

    def receive(self, sender: str, group: str, messages: Sequence[Message]) -> None:
        """Messages of ``group`` from broker ``sender`` (checked against the group's
        replicas: a message that does not come from the broker it names is dropped)."""
        state = self.groups.get(group)
        for message in messages:
            if (
                state is None
                or state.broker_of(message.sender) != sender
                or message.to != state.node.id
            ):
                self.stats.dropped += 1
                continue
            self.stats.received += 1
            self._inbox.append((group, message))
        self._wake.set()

    def propose(self, group: str, data: bytes) -> asyncio.Future[int]:
        """Append ``data`` to ``group``'s log; the future is its index once it is
        committed and applied here. It fails with ``NotLeader`` (this broker does not
        lead the group), ``ReplicationError`` (leadership moved before it committed:
        it may still be committed by the next leader) or ``RaftLogFailed``."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        state = self.groups.get(group)
        if self.failed:
            future.set_exception(RaftLogFailed(self.failed))
        elif state is None:
            future.set_exception(ReplicationError(f"no replicated stream {group!r} here"))
        elif state.node.role is not Role.LEADER:
            future.set_exception(NotLeader(state.node.id, state.node.leader))
        else:
            self._proposals.append((group, data, future))
            self._wake.set()
        return future

    # -- turns ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Turn whenever there is work, until the log fails (or the task is cancelled)."""
        while not self.failed:
            await self._wake.wait()
            self._wake.clear()
            await self.turn()
            await asyncio.sleep(0)  # a turn with nothing to write awaited nothing

    async def turn(self) -> None:
        if self.failed:
            return
        self.stats.turns += 1
        self._step_inputs()
        readies: list[tuple[_Group, Ready]] = []
        records, self._records = self._records, []
        for state in self.groups.values():
            node = state.node
            self._note_leader(state)  # a leader that stepped down at a tick has no Ready
            if node.has_ready():
                ready = node.ready()
                readies.append((state, ready))
                if ready.must_sync:
                    write = _record(state.name, ready.hard_state, ready.snapshot, ready.entries)
                    records.append(write)
        if records:
            try:
                await self._run_blocking(lambda: self._persist(records))
            except RaftLogFailed as exc:
                self._stop(str(exc))
                return
            self.stats.syncs += 1
            self.stats.records += len(records)
        for state, ready in readies:
            self._send(state, ready.messages)
        for state, ready in readies:
            if self.groups.get(state.name) is not state:
                continue  # dropped while its write was in flight
            self._apply(state, ready)
            state.node.advance()
            self._note_leader(state)
            if state.node.has_ready():
                self._wake.set()

    def _persist(self, records: list[WalRecord]) -> None:
        """In the worker thread: the turn's records, one fsync, a rewrite when due."""
        wal = self._wal
        started = time.perf_counter()
        wal.append(records)
        wal.sync()
        self.stats.sync_seconds += time.perf_counter() - started
        if wal.should_rewrite():
            wal.rewrite()

    def _step_inputs(self) -> None:
        ticks, self._ticks = self._ticks, 0
        inbox, self._inbox = self._inbox, []
        proposals, self._proposals = self._proposals, []
        groups = self.groups
        if self._handing_over:
            self._handing_over = False
            self._transfer_leaderships()
        for _ in range(ticks):
            for state in groups.values():
                state.node.tick()
        for group, message in inbox:
            target = groups.get(group)
            if target is not None:
                self._step(target, message)
        for group, data, future in proposals:
            leading = groups.get(group)
            if future.done():
                continue
            if leading is None:
                future.set_exception(ReplicationError(f"replicated stream {group!r} is gone"))
                continue
            try:
                index = leading.node.propose(data)
            except RaftError as exc:
                future.set_exception(exc)
                continue
            leading.proposals[index] = (leading.node.term, future)

    def _step(self, state: _Group, message: Message) -> None:
        try:
            state.node.step(message)
        except RaftError as exc:
            # LogConflict: this replica's log and the leader's disagree on a committed
            # entry -- damage nothing detected. The group stops here; the others go on.
            log.error(
                "a replicated stream's log conflicts with its leader's; it stops on this broker",
                extra={"stream": state.name, "error": str(exc)},
            )
            self.groups.pop(state.name, None)
            self._fail_proposals(state, ReplicationError(f"stream {state.name!r}: {exc}"))

    def _send(self, state: _Group, messages: Sequence[Message]) -> None:
        by_broker: dict[str, list[Message]] = defaultdict(list)
        for message in messages:
            broker = state.broker_of(message.to)
            if broker is not None:
                by_broker[broker].append(message)
        for broker, batch in by_broker.items():
            self.stats.sent += len(batch)
            self._transport.send(broker, state.name, batch)

    def _apply(self, state: _Group, ready: Ready) -> None:
        if ready.committed:
            self._machine.apply(state.name, ready.committed)
        proposals = state.proposals
        if not proposals:
            return
        for entry in ready.committed:
            waiting = proposals.pop(entry.index, None)
            if waiting is None:
                continue
            term, future = waiting
            if future.done():
                continue
            if entry.term == term:
                future.set_result(entry.index)
            else:
                future.set_exception(_moved(state))

    def _note_leader(self, state: _Group) -> None:
        node = state.node
        leader = state.broker_of(node.leader) if node.leader is not None else None
        if leader == state.leader and node.term == state.term:
            return
        me = self._name()
        was_leading = state.leader == me
        if leader is not None and leader != state.leader:
            state.leader_changes += 1
        state.leader, state.term = leader, node.term
        if was_leading and leader != me:
            # Proposals of the old term may yet be committed by the next leader (a
            # resend is then stored once: publish ids); this broker cannot tell.
            for _, future in state.proposals.values():
                if not future.done():
                    future.set_exception(_moved(state))
            state.proposals.clear()
        self._machine.leader_changed(state.name, leader, node.term)

    def _fail_proposals(self, state: _Group, error: Exception) -> None:
        for _, future in state.proposals.values():
            if not future.done():
                future.set_exception(error)
        state.proposals.clear()

    def _stop(self, why: str) -> None:
        self.failed = why
        log.error("the Raft log failed: replicated streams stop here", extra={"error": why})
        for state in self.groups.values():
            self._fail_proposals(state, RaftLogFailed(why))
        for _, _, future in self._proposals:
            if not future.done():
                future.set_exception(RaftLogFailed(why))
        self._proposals.clear()

    def close(self) -> None:
        self._wal.close()


def _moved(state: _Group) -> ReplicationError:
    leader = state.leader or "not elected yet"
    return ReplicationError(
        f"stream {state.name!r}: leadership moved (now {leader}) before the append was "
        "committed; it may still be, so a reliable sender resends it and it is stored once"
    )


# -- between the core's values and the log's records ------------------------------------------


def _record(
    group: str, hard: HardState | None, snapshot: Snapshot | None, entries: Sequence[Entry]
) -> WalRecord:
    return WalRecord(
        group,
        hard=None
        if hard is None
        else WalHardState(hard.term, hard.vote or 0, hard.commit, hard.epoch, hard.repairing),
        snapshot=None
        if snapshot is None
        else WalSnapshot(
            snapshot.index,
            snapshot.term,
            sorted(snapshot.membership.voters),
            sorted(snapshot.membership.learners),
            snapshot.data,
        ),
        entries=[_wal_entry(e) for e in entries],
    )


def _wal_entry(entry: Entry) -> WalEntry:
    membership = entry.membership
    if membership is None:
        return WalEntry(entry.term, entry.index, entry.data)
    return WalEntry(
        entry.term, entry.index, entry.data, sorted(membership.voters), sorted(membership.learners)
    )


def _stored(state: GroupLog) -> Stored:
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
