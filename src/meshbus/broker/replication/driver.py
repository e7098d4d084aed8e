"""The Raft driver: many Raft groups (one per replicated stream) on the broker's loop,
with one write-ahead log (meshbus.storage.raftlog) and the peer links.

One *turn* (``turn``), the contract of docs/raft.md for every group at once:

1. step what arrived since the last turn -- ticks, messages, proposals -- into the
   nodes (never between a node's ``ready()`` and ``advance()``: they wait here);
2. take every group's Ready; send the leaders' early messages (their appends and
   heartbeats) and apply the entries a leader has committed -- durable on a majority
   --, resolving the proposals they settle (acks to the senders);
3. meanwhile append all their records to the log and fsync it **once**, in a worker
   thread (``run_blocking``) so the loop is never held by the disk (and, in a turn
   where a term, vote, epoch or repairing flag changed, the state file the log keeps
   them in apart: meshbus.storage.raftlog); a turn that only moved commit indexes
   writes them and syncs nothing;
4. only then send each Ready's other messages (``transport``), apply a follower's
   committed entries (after its answers: they acknowledge nothing), and ``advance()``.

So a thousand groups with an append each cost one fsync per turn, not a thousand; a
leader's fsync runs while its followers' do; and nothing leaves this broker before what
it depends on is durable: a follower has its entries on disk before it answers, a
voter its vote before it grants it, and a leader counts its own entries toward a
commit only once its fsync is done (docs/raft.md, "The driver's contract").

Members are (node id, broker, incarnation) (meshbus.broker.replication.members): a
message is taken from a node id only if it came from that member's broker as that
member's incarnation. A broker holding no such group answers a group's messages as a
*stranger*, with its incarnation; the leader replaces a voter whose broker answers so
as another incarnation (its data dir was wiped), or that it has not heard from for
``replace_after`` ticks, one membership change a tick at most (``members.next_step``).

A log that fails (a full disk) stops the driver: no more sends, no more applies, every
proposal refused with the log's error. The other replicas elect a leader without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from meshbus.broker.replication.compaction import CompactionPolicy
from meshbus.broker.replication.group import (
    Group,
    GroupMeta,
    encode_snapshot,
    record_of,
    stored_of,
    wal_snapshot,
)
from meshbus.broker.replication.members import Member, encode_roster, next_step
from meshbus.errors import MeshbusError
from meshbus.raft import (
    Entry,
    Membership,
    Message,
    MessageType,
    NotLeader,
    ProposalRefused,
    RaftError,
    RaftNode,
    RaftSettings,
    Randomness,
    Ready,
    Role,
    Stored,
    bootstrap,
    empty,
)
from meshbus.raft.progress import Mode
from meshbus.storage.errors import RaftLogFailed
from meshbus.storage.raftlog import REWRITE_SLACK, RaftWal, WalRecord

log = logging.getLogger("meshbus.broker")

# The brokers a group remembers as strangers (their incarnations), at most.
_MAX_STRANGERS = 64

T = TypeVar("T")
RunBlocking = Callable[[Callable[[], T]], Awaitable[T]]


class ReplicationError(MeshbusError):
    """An append to a replicated stream was not committed; the message says why and
    what to do (a reliable sender's resend usually does it)."""


class Transport(Protocol):
    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        """Send ``messages`` of ``group`` to ``broker`` (dropped if it is not linked);
        with none, a probe: a broker that holds no such group answers as a stranger."""

    def stranger(self, broker: str, group: str) -> None:
        """Tell ``broker`` this broker holds no group ``group``."""

    def join(self, broker: str, group: str, meta: GroupMeta, member: Member) -> None:
        """Tell ``broker`` it is added to ``group`` as ``member`` (``meta.members``:
        the group's members with it)."""


class StateMachine(Protocol):
    def apply(self, group: str, entries: Sequence[Entry]) -> None:
        """``entries`` are committed, in order (after a restart, again from the first one
        not in a snapshot: the machine skips what it applied already). An entry with a
        ``membership`` is the driver's: its data is the roster (members.py)."""

    def leader_changed(self, group: str, leader: str | None, term: int) -> None:
        """The leader this broker knows of ``group`` changed (None: none known)."""

    def applied(self, group: str) -> int:
        """The last entry of ``group`` the machine applied (0: none)."""

    def snapshot(self, group: str) -> bytes | None:
        """The machine's data for a snapshot of ``group`` now (its state is at
        ``applied(group)``, at or past the snapshot's index); None: no snapshot now, so
        the log is not compacted."""

    def install(self, group: str, source: str, index: int, now: int) -> None:
        """A snapshot of ``group`` at ``index`` came from broker ``source`` and the
        machine is behind it: get the state from there (``RaftDriver.installed`` once it
        holds it; told again at every snapshot that comes meanwhile, ``now`` the tick)."""

    def flush(self) -> None:
        """Make what the machine applied durable (called in the worker thread, before
        the log drops the entries of a compaction)."""


@dataclass
class DriverStats:
    turns: int = 0
    syncs: int = 0
    sync_seconds: float = 0.0  # appending the turns' records and fsyncing them
    records: int = 0
    sent: int = 0
    received: int = 0
    dropped: int = 0  # messages for a group this broker does not hold, or misaddressed
    compactions: int = 0
    snapshots_installed: int = 0


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
        replace_after: int = 0,
        candidates: Callable[[str], list[str]] = lambda group: [],
        compaction: CompactionPolicy | None = None,
        rewrite_slack: int = REWRITE_SLACK,
    ) -> None:
        """``name()``: this broker's (known once it listens); ``run_blocking(fn)`` runs
        ``fn`` (the disk's work) off the loop, what it returns awaited for it -- best
        started at once (``loop.run_in_executor``), so the turn's applies on the loop
        overlap it.
        ``replace_after``: ticks of silence after which a leader replaces a voter (0:
        never); ``candidates(group)``: the brokers that may take a replica of it, in
        its placement order (ready, linked; members are skipped). ``compaction``: when
        a group's log is compacted (None: never); ``rewrite_slack``: the bytes the log
        file may hold past twice its live records before it is rewritten."""
        self._name = name
        self._wal = wal
        self._transport = transport
        self._machine = machine
        self._settings = settings
        self._randomness = randomness
        self._run_blocking = run_blocking
        self.groups: dict[str, Group] = {}
        self.stats = DriverStats()
        self.failed = ""
        self._ticks = 0
        self._inbox: list[tuple[str, Message]] = []
        self._lost: list[str] = []  # brokers whose links closed since the last turn
        self._proposals: list[tuple[str, bytes, asyncio.Future[int]]] = []
        self._records: list[WalRecord] = []  # written with the next turn's Readys
        self._wake = asyncio.Event()
        self._handing_over = False  # hand_over asked: transfers at the next turn
        self._replace_after = replace_after
        self._candidates = candidates
        self.incarnation = wal.incarnation
        self.now = 0  # ticks stepped in so far: the clock of silences
        # (broker, group) told "stranger" since the last election timeout: once each
        self._told: set[tuple[str, str]] = set()
        self._suspended: set[str] = set()  # groups this broker stopped in until it restarts
        # Only once its groups are read back does this broker know which it holds: a
        # stranger's answer before would make a member that restarts look wiped.
        self._recovered = False
        # members added, told so after the turn's sync (the change is durable here)
        self._joins: list[tuple[Group, Member]] = []
        self._compaction = compaction
        self._rewrite_slack = rewrite_slack
        self._compacted = False  # a compaction's record waits: the machine flushes first
        self._holding: set[str] = set()  # groups with a held snapshot (Group.held_snapshot)

    # -- groups ---------------------------------------------------------------------------

    def recover(self) -> list[tuple[str, GroupMeta]]:
        """The groups the log holds, rebuilt as nodes; each with its meta."""
        found = []
        me = self._name()
        self._recovered = True
        for group in self._wal.lost:
            log.error(
                "damage to the Raft log took every record of a replicated stream; this "
                "broker takes no part in it (its term and vote are kept, so it is never "
                "founded here again)",
                extra={"stream": group},
            )
        for group, state in self._wal.groups.items():
            meta = msgspec.msgpack.decode(state.meta, type=GroupMeta)
            if not meta.node and me not in meta.replicas:
                log.error(
                    "the Raft log names this broker's replicated stream under another broker "
                    "name; restart it with --name set to its name among the replicas",
                    extra={"stream": group, "replicas": meta.replicas, "name": me},
                )
                continue
            self._add(group, meta, stored_of(state))
            found.append((group, meta))
        return found

    def create(self, group: str, replicas: Sequence[str], app: bytes) -> None:
        """Found ``group`` on this broker, one of ``replicas`` (the same list, in the same
        order, on every founding member: it is the group's first membership)."""
        if group in self.groups or group in self._wal.kept:
            return  # founded already (its log is read back at start: ``recover``)
        meta = GroupMeta(list(replicas), app)
        stored = bootstrap(Membership.of(range(1, len(replicas) + 1)))
        record = record_of(group, stored.hard_state, None, stored.entries)
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

    def suspend(self, group: str, why: str) -> None:
        """Stop taking part in ``group`` until the broker restarts, keeping its log: the
        state machine cannot apply what was committed (its store failed: a full disk; an
        entry it does not read). Its messages are dropped unanswered, so its leader sees
        a silent member (replaced after --replace-after), not one that lost the group; a
        restart recovers it from the log, and the machine applies again from where it
        stopped."""
        state = self.groups.pop(group, None)
        if state is None:
            return
        self._suspended.add(group)
        self._fail_proposals(state, ReplicationError(f"stream {group!r} stopped here: {why}"))
        self._wake.set()

    def join(self, group: str, meta: GroupMeta) -> bool:
        """Take part in ``group`` as the new member ``meta.node`` (its leader added
        it): from an empty log, which the leader's appends fill. Whether it was taken:
        not if this broker holds the group already as a member of it -- a join it took
        before, or one from a leader that has not heard of its membership; the local
        copy of a node that is no member now (its addition was never committed) gives
        way, under its own node id, which is never used again."""
        held = self.groups.get(group)
        if held is not None:
            me = held.current().get(held.node.id)
            if held.node.id == meta.node or (me is not None and me.broker == self._name()):
                return False
            self.drop(group)
        record = WalRecord(group, meta=msgspec.msgpack.encode(meta))
        self._records.append(record)
        self._add(group, meta, empty())
        self._wake.set()
        return True

    def _add(self, group: str, meta: GroupMeta, stored: Stored) -> None:
        node_id = meta.node or meta.replicas.index(self._name()) + 1
        node = RaftNode(node_id, self._settings, stored, self._randomness)
        self.groups[group] = Group(group, meta, node)

    def leader_of(self, group: str) -> str | None:
        state = self.groups.get(group)
        return state.leader if state is not None else None

    def is_leader(self, group: str) -> bool:
        state = self.groups.get(group)
        return state is not None and state.node.role is Role.LEADER

    def replica_states(self, group: str) -> list[dict[str, Any]]:
        """What the leader knows of each replica of ``group`` (``Group.replica_states``);
        empty where this broker does not lead it: only the leader knows."""
        state = self.groups.get(group)
        if state is None or state.node.role is not Role.LEADER:
            return []
        return state.replica_states()

    def members_of(self, group: str) -> tuple[list[str], list[str]]:
        """The brokers of ``group``'s voters and of its learners, as this broker's log
        says (the latest membership in it, committed or not)."""
        state = self.groups.get(group)
        return state.brokers() if state is not None else ([], [])

    def hand_over(self) -> list[str]:
        """Ask each group this broker leads to move its leadership to a follower that
        answered its last heartbeat, of those the one that holds most of its log (the
        Raft core's leadership transfer: that follower is brought up to date, then
        campaigns at once) -- before a drain, so that no group waits an election timeout
        for a leader once this broker is gone. The groups it leads now; the transfers
        start at the next turn (a node takes nothing between its Ready and its advance).
        One that cannot move then (no other voter is up to it, a membership change under
        way) is logged and keeps its leader until the broker stops."""
        self._handing_over = True
        self._wake.set()
        return [name for name, state in self.groups.items() if state.node.role is Role.LEADER]

    def _transfer_leaderships(self) -> None:
        # Those that answered the last heartbeat first: the core's recent_active is
        # cleared only at a check-quorum, so a follower lost a few ticks ago still has it,
        # and a transfer to it would hold every append for an election timeout, then fail.
        answers_within = self._settings.heartbeat_ticks
        for state in self.groups.values():
            node = state.node
            if node.role is not Role.LEADER:
                continue
            others = [
                (
                    progress.recent_active,
                    self.now - state.heard.get(peer, -answers_within - 1) <= answers_within,
                    progress.match,
                    peer,
                )
                for peer, progress in node.progress.items()
                if peer != node.id and peer in node.membership.voters and not progress.repairing
            ]
            if not others:
                log.warning("stream %s: no other voter to lead it", state.name)
                continue
            try:
                node.transfer_leadership(max(others)[3])
            except ProposalRefused as exc:
                log.warning("stream %s: its leadership stays here: %s", state.name, exc)

    # -- what comes in ------------------------------------------------------------------------

    def tick(self) -> None:
        self._ticks += 1
        self._wake.set()

    def receive(
        self, sender: str, group: str, messages: Sequence[Message], incarnation: int = 0
    ) -> None:
        """Messages of ``group`` from broker ``sender`` as its ``incarnation``, checked
        against the group's members: a message that does not come from the member it
        names -- its broker, as its incarnation -- is dropped. A group this broker does
        not hold is answered as a stranger (once an election timeout), so its leader
        learns that this broker is not, or no longer, its member."""
        state = self.groups.get(group)
        if state is None:
            self.stats.dropped += len(messages)
            if group in self._suspended:
                return
            if self._recovered and (sender, group) not in self._told:
                self._told.add((sender, group))
                self._transport.stranger(sender, group)
            return
        for message in messages:
            member = state.member(message.sender)
            if member is None or member.broker != sender or message.to != state.node.id:
                self.stats.dropped += 1
                continue
            known = state.incarnation_of(member)
            if known and incarnation != known:
                self.stats.dropped += 1  # from another self of the member's broker
                continue
            if not known and incarnation:
                state.learned[member.node] = incarnation
            state.heard[member.node] = self.now
            self.stats.received += 1
            self._inbox.append((group, message))
        self._wake.set()

    def broker_lost(self, broker: str) -> None:
        """This broker's last link to ``broker`` closed (a killed process's socket is
        reset at once): each group it leads here is told at the next turn
        (``RaftNode.leader_lost``), so its followers elect a leader without waiting out
        an election timeout of silence."""
        self._lost.append(broker)
        self._wake.set()

    def stranger(self, sender: str, group: str, incarnation: int) -> None:
        """Broker ``sender``, as ``incarnation``, holds no group ``group``: a member of
        it there that is another incarnation is lost (replaced by the leader); a
        learner that is this one has not had its join (sent again)."""
        state = self.groups.get(group)
        if state is None:
            return
        if len(state.strangers) >= _MAX_STRANGERS:
            state.strangers.clear()
        state.strangers[sender] = incarnation
        learners = state.node.membership.learners
        for member in state.current().of_broker(sender):
            known = state.incarnation_of(member)
            if known == incarnation and member.node in learners:
                if state.node.role is Role.LEADER:
                    self._joins.append((state, member))
            elif known != incarnation or not known:
                state.lost.add(member.node)
            else:
                log.warning(
                    "a replica of a replicated stream lost its group and is replaced once "
                    "silent for --replace-after",
                    extra={"stream": group, "broker": sender},
                )
        self._wake.set()

    def installed(self, group: str) -> None:
        """The state machine holds the state of the snapshot ``group`` waits with: it is
        stepped into the node at the next turn."""
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
        readies: list[tuple[Group, Ready]] = []
        records, self._records = self._records, []
        must_sync = bool(records)  # a group founded, joined, compacted or dropped
        flush, self._compacted = self._compacted, False
        for state in self.groups.values():
            node = state.node
            self._note_leader(state)  # a leader that stepped down at a tick has no Ready
            if node.has_ready():
                ready = node.ready()
                readies.append((state, ready))
                if ready.hard_state is not None or ready.snapshot is not None or ready.entries:
                    write = record_of(state.name, ready.hard_state, ready.snapshot, ready.entries)
                    records.append(write)
                    must_sync |= ready.must_sync
        # The leaders' appends go out while their own write is synced, and what is
        # committed already -- on a majority's disks -- is applied and acknowledged
        # while it runs, not after (meshbus.raft.Ready, steps 1 and 4): the write is
        # started first, so the state machine's own writes overlap its fsync.
        for state, ready in readies:
            self._send(state, ready.early_messages)
        persisted = (
            self._run_blocking(lambda: self._persist(records, must_sync, flush))
            if records
            else None
        )
        # A leader's applies acknowledge appends: at once, while the fsync runs. A
        # follower's acknowledge nothing: after its answers, which would else wait for
        # its store's writes as well as for its fsync.
        applied_early = [
            ready.snapshot is None and state.node.role is Role.LEADER for state, ready in readies
        ]
        for (state, ready), early in zip(readies, applied_early, strict=True):
            if early:
                self._apply(state, ready)
        if persisted is not None:
            try:
                await persisted
            except RaftLogFailed as exc:
                self._stop(str(exc))
                return
            self.stats.records += len(records)
        joins, self._joins = self._joins, []
        for state, member in joins:
            if self.groups.get(state.name) is state and state.node.role is Role.LEADER:
                self._transport.join(member.broker, state.name, self._meta_for(state), member)
        for state, ready in readies:
            self._send(state, ready.messages)
        for (state, ready), early in zip(readies, applied_early, strict=True):
            if self.groups.get(state.name) is not state:
                continue  # dropped while its write was in flight
            if not early:
                self._apply(state, ready)
            state.node.advance()
            self._note_leader(state)
            if ready.committed and self._compaction is not None:
                self._compact(state, self._compaction)
            if state.node.has_ready():
                self._wake.set()

    def _persist(self, records: list[WalRecord], must_sync: bool, flush: bool) -> None:
        """In the worker thread: the turn's records, one fsync if one needs it (a turn
        that only moved commit indexes needs none), a rewrite when due. With a
        compaction among them (``flush``), the state machine's own writes are made
        durable first: the log must not drop entries whose state may yet be lost."""
        wal = self._wal
        if flush:
            self._machine.flush()
        started = time.perf_counter()
        wal.append(records)
        if must_sync:
            wal.sync()
            self.stats.syncs += 1
            self.stats.sync_seconds += time.perf_counter() - started
        if wal.should_rewrite(self._rewrite_slack):
            wal.rewrite()

    def _step_inputs(self) -> None:
        ticks, self._ticks = self._ticks, 0
        inbox, self._inbox = self._inbox, []
        proposals, self._proposals = self._proposals, []
        lost, self._lost = self._lost, []
        groups = self.groups
        if self._handing_over:
            self._handing_over = False
            self._transfer_leaderships()
        for _ in range(ticks):
            for state in groups.values():
                state.node.tick()
        if ticks:
            self.now += ticks
            if (
                self.now // self._settings.election_ticks
                != (self.now - ticks) // self._settings.election_ticks
            ):
                self._told.clear()
            for state in groups.values():
                if state.node.role is Role.LEADER:
                    self._replace(state)
        for name in list(self._holding):
            holding = groups.get(name)
            held = holding.held_snapshot if holding is not None else None
            if holding is None or held is None:
                self._holding.discard(name)
            elif self._installable(holding, held):
                self._holding.discard(name)
                holding.held_snapshot = None
                self.stats.snapshots_installed += 1
                self._step(holding, held)
        if lost:
            for state in groups.values():
                if state.leader in lost:
                    state.node.leader_lost()
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

    def _replace(self, state: Group) -> None:
        """The leader's next step of a replacement, if one is due (members.next_step)."""
        if not state.may_need_replacing(self.now, self._replace_after):
            return  # the common case, each tick for every group it leads: kept cheap
        node = state.node
        step = next_step(
            node.membership,
            state.current(),
            state.seen(self.now),
            node.log.last_index,
            leader=node.id,
            active_within=2 * self._settings.election_ticks,
            replace_after=self._replace_after,
            gap=2 * self._settings.max_append_entries,
            candidates=lambda: [b for b in self._candidates(state.name) if b != self._name()],
            strangers=state.strangers,
        )
        if step is None:
            return
        if step.probe:
            self._transport.send(step.probe, state.name, ())
            return
        assert step.change is not None
        assert step.roster is not None
        try:
            node.propose_change(step.change, encode_roster(step.roster.known(state.learned)))
        except ProposalRefused as exc:
            log.debug("stream %s: membership change waits: %s", state.name, exc)
            return
        log.warning(
            "replicated stream: membership change",
            extra={
                "stream": state.name,
                "change": step.change.kind.value,
                "node": step.change.node,
                "broker": state.broker_of(step.change.node),
            },
        )
        if step.joining is not None:
            state.heard[step.joining.node] = self.now
            state.strangers.pop(step.joining.broker, None)
            self._joins.append((state, step.joining))

    def _meta_for(self, state: Group) -> GroupMeta:
        """The meta a new member is sent: the group's founding list and description,
        and its members as of now (the latest roster in this leader's log)."""
        return GroupMeta(state.meta.replicas, state.meta.app, 0, state.current().members)

    def _installable(self, state: Group, message: Message) -> bool:
        """Whether snapshot ``message`` may be stepped into the node: the node would not
        install it (stale, or its log holds it already), or the machine holds its state."""
        node, snapshot = state.node, message.snapshot
        assert snapshot is not None
        return (
            message.term < node.term
            or snapshot.index <= node.log.committed
            or node.log.term(snapshot.index) == snapshot.term
            or self._machine.applied(state.name) >= snapshot.index
        )

    def _step(self, state: Group, message: Message) -> None:
        if message.kind is MessageType.SNAPSHOT and not self._installable(state, message):
            # The node would install the snapshot and then apply only what follows it:
            # the machine must first hold the state there (docs/raft.md, "Snapshots of
            # a stream"). The node hears nothing of it meanwhile: its leader sends it
            # again at each heartbeat, and it acknowledges nothing.
            assert message.snapshot is not None
            state.held_snapshot = message
            self._holding.add(state.name)
            source = state.broker_of(message.sender)
            if source is not None:
                self._machine.install(state.name, source, message.snapshot.index, self.now)
            return
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

    def _send(self, state: Group, messages: Sequence[Message]) -> None:
        by_broker: dict[str, list[Message]] = defaultdict(list)
        for message in messages:
            broker = state.broker_of(message.to)
            if broker is not None:
                by_broker[broker].append(message)
        for broker, batch in by_broker.items():
            self.stats.sent += len(batch)
            self._transport.send(broker, state.name, batch)

    def _apply(self, state: Group, ready: Ready) -> None:
        if ready.snapshot is not None:
            state.applied_bytes = 0
        if ready.committed:
            self._machine.apply(state.name, ready.committed)
            state.applied_bytes += sum(len(e.data) for e in ready.committed)
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

    def _compact(self, state: Group, policy: CompactionPolicy) -> None:
        """Compact the group's log if the policy says so: the snapshot (the roster at
        its index, the machine's data) kept in memory at once, written to the log with
        the next turn's records once the machine's writes are durable (``_persist``)."""
        node = state.node
        log_ = node.log
        followers: list[int] = []
        if node.role is Role.LEADER:
            lately = self.now - self._settings.election_ticks
            followers = [
                progress.match
                for peer, progress in node.progress.items()
                if peer != node.id
                and progress.mode is not Mode.SNAPSHOT
                and state.heard.get(peer, lately - 1) >= lately
            ]
        index = policy.compact_to(log_.snapshot.index, log_.applied, state.applied_bytes, followers)
        if index is None:
            return
        data = self._machine.snapshot(state.name)
        if data is None:
            return
        dropped = log_.entries(log_.first_index, index - log_.snapshot.index)
        roster = state.roster_at(log_.change_at(index))
        snapshot = node.compact(index, encode_snapshot(roster, data))
        state.applied_bytes = max(0, state.applied_bytes - sum(len(e.data) for e in dropped))
        self._records.append(WalRecord(state.name, snapshot=wal_snapshot(snapshot), compacted=True))
        self._compacted = True
        self.stats.compactions += 1
        self._wake.set()

    def _note_leader(self, state: Group) -> None:
        node = state.node
        leader = state.broker_of(node.leader) if node.leader is not None else None
        if leader == state.leader and node.term == state.term:
            return
        me = self._name()
        was_leading = state.leader == me
        if leader is not None and leader != state.leader:
            state.leader_changes += 1
        if leader == me and not was_leading:
            # Silences are counted from now: as a follower it heard from the leader only.
            state.heard = dict.fromkeys(node.membership.members, self.now)
            state.lost.clear()
        state.leader, state.term = leader, node.term
        if was_leading and leader != me:
            # Proposals of the old term may yet be committed by the next leader (a
            # resend is then stored once: publish ids); this broker cannot tell.
            for _, future in state.proposals.values():
                if not future.done():
                    future.set_exception(_moved(state))
            state.proposals.clear()
        self._machine.leader_changed(state.name, leader, node.term)

    def _fail_proposals(self, state: Group, error: Exception) -> None:
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


def _moved(state: Group) -> ReplicationError:
    leader = state.leader or "not elected yet"
    return ReplicationError(
        f"stream {state.name!r}: leadership moved (now {leader}) before the append was "
        "committed; it may still be, so a reliable sender resends it and it is stored once"
    )
