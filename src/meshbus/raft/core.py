"""The Raft state machine of one node: messages and ticks in; a Ready out (what to
make durable, then what to send, then what to apply).

It does no I/O, reads no clock and draws no random number of its own: time is
``tick()``, the randomized election timeout comes from the ``Randomness`` the driver
passes in, and everything the node must persist is handed out in a Ready before any
message that depends on it may leave (docs/raft.md). Shaped like etcd's raft:

- pre-vote: a node that lost touch asks first whether it could win, so it does not
  force a term change on a healthy group when it comes back;
- check-quorum: a leader that has not heard from a majority within an election
  timeout steps down, and a follower that heard from a leader within one ignores
  votes (its lease), so a partitioned or removed node cannot disturb the group;
- ReadIndex: a read is confirmed by a round of heartbeats to a majority;
- learners, and membership changes one node at a time (meshbus.raft.config);
- leadership transfer: the leader brings the target up to date, then tells it to
  campaign at once (TIMEOUT_NOW);
- snapshots: the driver compacts the log; a follower behind the leader's first entry
  is sent the snapshot;
- repair: a node that restarted from a damaged log neither votes nor campaigns until
  it holds all that may have been committed (docs/raft.md, "Corruption").

One Ready at a time: after ``ready()``, the driver calls ``advance()`` before it steps,
ticks or proposes again (messages that arrive meanwhile wait in its queue). A leader's
appends and heartbeats may leave before its own write is durable (``early_messages``):
it counts itself toward a commit only at ``advance()``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from meshbus.errors import InvalidArgument
from meshbus.raft.config import (
    Membership,
    MembershipChange,
    VoteResult,
    quorum_index,
    vote_result,
)
from meshbus.raft.errors import DriverError, NotLeader, ProposalRefused
from meshbus.raft.log import RaftLog
from meshbus.raft.messages import (
    Entry,
    HardState,
    Message,
    MessageType,
    ReadState,
    Ready,
    Snapshot,
    Stored,
)
from meshbus.raft.progress import Mode, Progress

T = MessageType

# What only a leader sends (docs/raft.md, "The driver's contract": early messages).
_LEADING = frozenset((T.APPEND, T.HEARTBEAT, T.SNAPSHOT, T.TIMEOUT_NOW))

# After the leader is lost (``leader_lost``), the ticks between one voter's campaign and
# the next one's: long enough for a pre-vote and a vote round (two fsyncs), so the first
# usually wins before the second asks and they do not split the vote.
_LOST_LEADER_STAGGER = 2


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


class Randomness(Protocol):
    """Where the election timeouts come from (``random.Random`` is one, seeded)."""

    def randrange(self, start: int, stop: int, /) -> int: ...


@dataclass(frozen=True, slots=True)
class RaftSettings:
    election_ticks: int = 10  # a follower campaigns after [this, 2x this) silent ticks
    heartbeat_ticks: int = 1
    pre_vote: bool = True
    check_quorum: bool = True
    max_append_entries: int = 64  # entries per APPEND message

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_ticks < self.election_ticks:
            raise InvalidArgument(
                f"heartbeat_ticks ({self.heartbeat_ticks}) must be at least 1 and below "
                f"election_ticks ({self.election_ticks}): followers would time out between "
                "two heartbeats"
            )
        if self.max_append_entries < 1:
            raise InvalidArgument("max_append_entries must be at least 1")


@dataclass(slots=True)
class _PendingRead:
    request: int
    index: int
    acks: set[int]


class RaftNode:
    def __init__(
        self, node_id: int, settings: RaftSettings, stored: Stored, randomness: Randomness
    ) -> None:
        if node_id <= 0:
            raise InvalidArgument(f"a node id is a positive int, not {node_id}")
        self.id = node_id
        self.settings = settings
        self._randomness = randomness
        hard = stored.hard_state
        self.log = RaftLog(stored.snapshot, stored.entries, hard.commit)
        self.term = hard.term
        self.vote = hard.vote
        self.epoch = hard.epoch
        self.repairing = hard.repairing
        self.role = Role.FOLLOWER
        self.leader: int | None = None
        self.progress: dict[int, Progress] = {}
        self.transferee: int | None = None
        self._votes: dict[int, bool] = {}
        self._reads: list[_PendingRead] = []
        self._read_states: list[ReadState] = []
        self._outbox: list[Message] = []
        self._early: list[Message] = []  # may leave before the Ready's write is durable
        self._term_start = 0  # as leader: the index of the first entry of its term
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._timeout = self._random_timeout()
        self._durable = self._hard_state()
        self._snapshot_to_persist: Snapshot | None = None
        self._handed_out: Ready | None = None

    # -- what the driver sees --------------------------------------------------------

    @property
    def membership(self) -> Membership:
        return self.log.membership

    @property
    def promotable(self) -> bool:
        """Whether this node may campaign: a voter, whole, not installing a snapshot."""
        return (
            self.id in self.membership.voters
            and not self.repairing
            and self._snapshot_to_persist is None
        )

    def has_ready(self) -> bool:
        return bool(
            self._outbox
            or self._early
            or self._read_states
            or self._snapshot_to_persist is not None
            or self.log.persisted < self.log.last_index
            or self.log.applied < self.log.committed
            or self._hard_state() != self._durable
        )

    def ready(self) -> Ready:
        """The work to do now, in the order the Ready's docstring says."""
        self._idle()
        hard = self._hard_state()
        durable = self._durable
        entries = self.log.unpersisted()
        ready = Ready(
            hard_state=hard if hard != durable else None,
            snapshot=self._snapshot_to_persist,
            entries=entries,
            messages=tuple(self._outbox),
            committed=self.log.unapplied(),
            read_states=tuple(self._read_states),
            early_messages=tuple(self._early),
            must_sync=bool(
                entries
                or self._snapshot_to_persist is not None
                or hard.term != durable.term
                or hard.vote != durable.vote
                or hard.epoch != durable.epoch
                or hard.repairing != durable.repairing
            ),
        )
        self._outbox.clear()
        self._early.clear()
        self._read_states.clear()
        self._handed_out = ready
        return ready

    def advance(self) -> None:
        """The last Ready is durable, its messages sent and its entries applied."""
        ready = self._handed_out
        if ready is None:
            raise DriverError("advance() without a ready() before it")
        self._handed_out = None
        if ready.hard_state is not None:
            self._durable = ready.hard_state
        if ready.snapshot is not None:
            self._snapshot_to_persist = None
        if ready.entries:
            self.log.persisted = ready.entries[-1].index
        if ready.committed:
            self.log.applied = ready.committed[-1].index
        own = self.progress.get(self.id)
        if self.role is Role.LEADER and own is not None and own.acked(self.log.persisted):
            # The leader's own entry counts toward a majority only once it is durable.
            self._commit_and_broadcast()

    # -- what the driver asks ---------------------------------------------------------

    def tick(self) -> None:
        self._idle()
        self._election_elapsed += 1
        if self.role is not Role.LEADER:
            if self.promotable and self._election_elapsed >= self._timeout:
                self._hup(transfer=False)
            return
        self._heartbeat_elapsed += 1
        if self._election_elapsed >= self.settings.election_ticks:
            self._election_elapsed = 0
            self.transferee = None  # a transfer not done in an election timeout failed
            if self.settings.check_quorum and not self._quorum_active():
                self._become_follower(self.term, None)
                return
            for node, progress in self.progress.items():
                progress.recent_active = node == self.id
        if self._heartbeat_elapsed >= self.settings.heartbeat_ticks:
            self._heartbeat_elapsed = 0
            self._broadcast_heartbeat(0)

    def campaign(self) -> None:
        """Start an election now, as if the election timeout had passed."""
        self._idle()
        if self.role is not Role.LEADER and self.promotable:
            self._hup(transfer=False)

    def leader_lost(self) -> None:
        """The driver learned that the leader is gone -- its broker's link closed --
        sooner than an election timeout of silence would tell. A follower stops counting
        on it: its lease ends (it grants the pre-votes of the others who lost it too),
        and it campaigns without waiting out its timeout -- the first other voter by id
        at once, each next one ``_LOST_LEADER_STAGGER`` ticks later, so that they do not
        split the vote. Timing only, never safety: a pre-vote still needs a majority
        out of their lease, and a word that is wrong (the leader is alive, a link only
        flapped) costs what a late heartbeat does."""
        self._idle()
        leader = self.leader
        if self.role is not Role.FOLLOWER or leader is None:
            return
        self.leader = None
        if not self.promotable:
            return
        rank = sorted(self.membership.voters - {leader}).index(self.id)
        if rank == 0:
            self._hup(transfer=False)
        else:
            # The timeout is kept: a leader heard again sets the count back to 0.
            due = self._timeout - rank * _LOST_LEADER_STAGGER
            self._election_elapsed = max(self._election_elapsed, due)

    def propose(self, data: bytes) -> int:
        """Append ``data`` to the log as the leader; its index."""
        self._check_proposal()
        return self._append(data, None)

    def propose_change(self, change: MembershipChange, data: bytes = b"") -> int:
        """Append a membership change as the leader; its index. One at a time: the
        last must be committed, and so must an entry of this leader's term. ``data``
        rides in the same entry, opaque (the driver's: who the node ids are)."""
        self._check_proposal()
        if self.log.last_change > self.log.committed:
            raise ProposalRefused(
                f"membership change at {self.log.last_change} is not committed yet; "
                "propose the next once it is"
            )
        if self.log.committed < self._term_start:
            raise ProposalRefused("the new leader has not committed in its term yet; retry")
        return self._append(data, self.membership.changed(change))

    def transfer_leadership(self, to: int) -> None:
        self._idle()
        self._check_leader()
        if to == self.id or to not in self.membership.voters:
            raise ProposalRefused(f"node {to} is not another voter; leadership stays here")
        self.transferee = to
        self._election_elapsed = 0  # the transfer has one election timeout to finish
        if self.progress[to].match == self.log.last_index:
            self._send(Message(T.TIMEOUT_NOW, self.id, to, self.term))
        else:
            self._send_append(to)

    def read_index(self, request: int) -> None:
        """Confirm leadership for a read; ``request`` (> 0, the driver's id) comes back
        in a later Ready's read_states with the index the read must wait for."""
        self._idle()
        self._check_leader()
        if request <= 0:
            raise InvalidArgument(f"a read's id is a positive int, not {request}")
        if self.log.committed < self._term_start:
            raise ProposalRefused("the new leader has not committed in its term yet; retry")
        read = _PendingRead(request, self.log.committed, {self.id})
        self._reads.append(read)
        self._release_reads()
        if self._reads:
            self._broadcast_heartbeat(request)

    def compact(self, index: int, data: bytes) -> Snapshot:
        """The state machine up to ``index`` is ``data``: drop the entries up to there.
        The driver makes the returned snapshot durable, then may drop them too."""
        self._idle()
        if not self.log.snapshot.index < index <= self.log.applied:
            raise DriverError(
                f"compact at {index}: only applied entries after the snapshot "
                f"({self.log.snapshot.index}, applied {self.log.applied}) can be compacted"
            )
        return self.log.compact(index, data)

    # -- messages ----------------------------------------------------------------------

    def step(self, message: Message) -> None:
        self._idle()
        m = message
        if m.to != self.id:
            raise DriverError(f"message for node {m.to} stepped into node {self.id}")
        if m.term > self.term:
            if m.kind in (T.PRE_VOTE, T.VOTE) and not m.transfer and self._in_lease():
                return  # a leader was heard within the election timeout
            if m.kind is T.PRE_VOTE or (m.kind is T.PRE_VOTE_RESPONSE and not m.reject):
                pass  # pre-votes are asked and granted for a term not yet entered
            elif m.kind in (T.APPEND, T.HEARTBEAT, T.SNAPSHOT):
                self._become_follower(m.term, m.sender)
            else:
                self._become_follower(m.term, None)
        elif m.term < self.term:
            if m.kind in (T.APPEND, T.HEARTBEAT):
                # A deposed leader (or one cut off while this node's term moved on):
                # tell it the term, since with pre-vote and check-quorum nothing else will.
                self._send(Message(T.APPEND_RESPONSE, self.id, m.sender, self.term))
            elif m.kind is T.PRE_VOTE:
                self._send(Message(T.PRE_VOTE_RESPONSE, self.id, m.sender, self.term, reject=True))
            return
        if m.kind in (T.PRE_VOTE, T.VOTE):
            self._answer_vote(m)
        elif self.role is Role.LEADER:
            self._step_leader(m)
        elif self.role is Role.FOLLOWER:
            self._step_follower(m)
        else:
            self._step_candidate(m)

    def _answer_vote(self, m: Message) -> None:
        can_vote = (
            self.vote == m.sender
            or (self.vote is None and self.leader is None)
            or (m.kind is T.PRE_VOTE and m.term > self.term)
        )
        answer = T.PRE_VOTE_RESPONSE if m.kind is T.PRE_VOTE else T.VOTE_RESPONSE
        if can_vote and not self.repairing and self.log.is_up_to_date(m.index, m.log_term):
            self._send(Message(answer, self.id, m.sender, m.term))
            if m.kind is T.VOTE:
                self.vote = m.sender
                self._election_elapsed = 0
        else:
            self._send(Message(answer, self.id, m.sender, self.term, reject=True))

    def _step_follower(self, m: Message) -> None:
        if m.kind in (T.APPEND, T.HEARTBEAT, T.SNAPSHOT):
            self.leader = m.sender
            self._election_elapsed = 0
            if m.kind is T.APPEND:
                self._receive_append(m)
            elif m.kind is T.HEARTBEAT:
                if not self.repairing:
                    # A heartbeat's commit is the leader's, capped at what it last heard
                    # this node holds: a repairing node may have heard that before its
                    # log went back to an older one, which may differ there.
                    self.log.commit_to(min(m.commit, self.log.last_index))
                self._send(self._reply(m, T.HEARTBEAT_RESPONSE, context=m.context))
            else:
                self._receive_snapshot(m)
        elif m.kind is T.TIMEOUT_NOW and self.promotable:
            self._hup(transfer=True)

    def _step_candidate(self, m: Message) -> None:
        if m.kind in (T.APPEND, T.HEARTBEAT, T.SNAPSHOT):
            self._become_follower(m.term, m.sender)  # a leader won this term
            self._step_follower(m)
            return
        wanted = T.PRE_VOTE_RESPONSE if self.role is Role.PRE_CANDIDATE else T.VOTE_RESPONSE
        if m.kind is not wanted:
            return
        self._votes[m.sender] = not m.reject
        result = vote_result(self.membership, self._votes)
        if result is VoteResult.LOST:
            self._become_follower(self.term, None)
        elif result is VoteResult.WON:
            if self.role is Role.PRE_CANDIDATE:
                self._campaign(transfer=False)
            else:
                self._become_leader()

    def _step_leader(self, m: Message) -> None:
        progress = self.progress.get(m.sender)
        if progress is None or m.kind not in (T.APPEND_RESPONSE, T.HEARTBEAT_RESPONSE):
            return
        if m.epoch < progress.epoch:
            return  # from before the follower lost part of its log: void
        if m.epoch > progress.epoch:
            progress.restart_epoch(m.epoch, m.repairing, self.log.last_index)
            if m.repairing:
                # It is repaired by a commit made after this leader learned of the
                # damage, without it: an entry of its own, appended now (docs/raft.md,
                # "Corruption"). Set first: the append goes out with the entry.
                progress.repair_index = self.log.last_index + 1
                self._append(b"", None)
        else:
            progress.answered(m.repairing)
        progress.recent_active = True
        if m.kind is T.HEARTBEAT_RESPONSE:
            self._heartbeat_answered(m, progress)
        elif m.reject:
            hint = m.hint_index
            if m.hint_term > 0:
                hint, _ = self.log.find_conflict_by_term(m.hint_index, m.hint_term)
            if progress.rejected(m.index, hint):
                self._send_append(m.sender)
        else:
            self._append_answered(m, progress)

    def _append_answered(self, m: Message, progress: Progress) -> None:
        news = progress.acked(m.index)
        if progress.mode is Mode.SNAPSHOT and progress.match >= progress.pending_snapshot:
            progress.become_probe()
        if news and progress.mode is Mode.PROBE:
            progress.become_replicate()
        if not self._commit_and_broadcast():
            sent = False
            while progress.next <= self.log.last_index and not progress.paused:
                if not self._send_append(m.sender, send_empty=False):
                    break
                sent = True
            if not sent and progress.repair_epoch(self.log.committed):
                self._send_append(m.sender)  # it holds all: the commit that repairs it
        if m.sender == self.transferee and progress.match == self.log.last_index:
            self._send(Message(T.TIMEOUT_NOW, self.id, m.sender, self.term))

    def _heartbeat_answered(self, m: Message, progress: Progress) -> None:
        progress.probe_sent = False
        if progress.mode is Mode.SNAPSHOT and progress.match < progress.pending_snapshot:
            progress.become_probe()  # the snapshot may be lost: send it again
        if progress.match < self.log.last_index or progress.repair_epoch(self.log.committed):
            self._send_append(m.sender)  # entries it lacks, or the commit that repairs it
        if m.context and m.sender in self.membership.voters and not progress.repairing:
            for read in self._reads:
                if read.request == m.context:
                    read.acks.add(m.sender)
            self._release_reads()

    def _receive_append(self, m: Message) -> None:
        if m.index < self.log.committed:
            self._send(self._reply(m, T.APPEND_RESPONSE, index=self.log.committed))
            return
        last = self.log.try_append(m.index, m.log_term, m.entries)
        if last is None:
            hint = self.log.find_conflict_by_term(m.index, m.log_term)
            self._send(self._reply(m, T.APPEND_RESPONSE, index=m.index, rejected_at=hint))
            return
        self.log.commit_to(min(m.commit, last))
        if (
            self.repairing
            and m.epoch == self.epoch
            and m.commit <= last
            and self.log.term(m.commit) == m.term
        ):
            # The leader says its commit index is past an entry it appended once it knew
            # of this node's damage, committed without this node; and this node now holds
            # the leader's log up to there: everything that may have been committed, with
            # or without this node's lost copies (docs/raft.md, "Corruption").
            self.repairing = False
        self._send(self._reply(m, T.APPEND_RESPONSE, index=last))

    def _receive_snapshot(self, m: Message) -> None:
        snapshot = m.snapshot
        assert snapshot is not None
        if snapshot.index <= self.log.committed:
            index = self.log.committed
        elif self.log.term(snapshot.index) == snapshot.term:
            self.log.commit_to(snapshot.index)  # the log has it all already
            index = snapshot.index
        else:
            self.log.restore(snapshot)
            self._snapshot_to_persist = snapshot
            index = snapshot.index
        self._send(self._reply(m, T.APPEND_RESPONSE, index=index))

    def _reply(
        self,
        m: Message,
        kind: MessageType,
        index: int = 0,
        context: int = 0,
        rejected_at: tuple[int, int] | None = None,
    ) -> Message:
        """An answer to the leader; ``rejected_at`` the (index, term) hint of a refusal."""
        hint_index, hint_term = rejected_at or (0, 0)
        return Message(
            kind,
            self.id,
            m.sender,
            self.term,
            index=index,
            context=context,
            reject=rejected_at is not None,
            hint_index=hint_index,
            hint_term=hint_term,
            epoch=self.epoch,
            repairing=self.repairing,
        )

    # -- the roles -----------------------------------------------------------------------

    def _become_follower(self, term: int, leader: int | None) -> None:
        self._reset(term)
        self.role = Role.FOLLOWER
        self.leader = leader

    def _hup(self, transfer: bool) -> None:
        if self.settings.pre_vote and not transfer:
            self._reset(self.term)
            self.role = Role.PRE_CANDIDATE
            self._ask_votes(T.PRE_VOTE, self.term + 1, transfer=False)
        else:
            self._campaign(transfer)

    def _campaign(self, transfer: bool) -> None:
        self._reset(self.term + 1)
        self.role = Role.CANDIDATE
        self.vote = self.id
        self._ask_votes(T.VOTE, self.term, transfer)

    def _ask_votes(self, kind: MessageType, term: int, transfer: bool) -> None:
        for voter in sorted(self.membership.voters - {self.id}):
            self._send(
                Message(
                    kind,
                    self.id,
                    voter,
                    term,
                    index=self.log.last_index,
                    log_term=self.log.last_term,
                    transfer=transfer,
                )
            )
        # Its own vote is counted now but seen by nobody before the Ready that asks
        # for the others' is durable (the term and vote first).
        self._step_candidate(
            Message(
                T.PRE_VOTE_RESPONSE if kind is T.PRE_VOTE else T.VOTE_RESPONSE,
                self.id,
                self.id,
                term,
            )
        )

    def _become_leader(self) -> None:
        self._reset(self.term)
        self.role = Role.LEADER
        self.leader = self.id
        self._sync_progress()
        self._term_start = self.log.last_index + 1
        self._append(b"", None)

    def _reset(self, term: int) -> None:
        if term != self.term:
            self.term = term
            self.vote = None
        self.leader = None
        self._votes = {}
        self.progress = {}
        self.transferee = None
        self._reads.clear()
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._timeout = self._random_timeout()

    # -- leading -------------------------------------------------------------------------

    def _append(self, data: bytes, membership: Membership | None) -> int:
        index = self.log.last_index + 1
        self.log.append([Entry(self.term, index, data, membership)])
        if membership is not None:
            self._sync_progress()
        self._commit_and_broadcast(force=True)
        return index

    def _sync_progress(self) -> None:
        """One Progress per member of the latest membership, no more."""
        members = self.membership.members
        for node in list(self.progress):
            if node not in members:
                del self.progress[node]
        for node in members - self.progress.keys():
            progress = self.progress[node] = Progress(self.log.last_index + 1)
            if node == self.id:
                progress.acked(self.log.persisted)
                progress.become_replicate()
                progress.recent_active = True

    def _commit_and_broadcast(self, force: bool = False) -> bool:
        """Commit what a majority holds, if it is of this term; send appends to all
        if that moved the commit index (or if ``force``). True if it did."""
        # A repairing node's answers count toward no commit: it may have lost entries
        # it acknowledged, and may yet lose what it holds now.
        match = {
            node: progress.match
            for node, progress in self.progress.items()
            if not progress.repairing
        }
        index = quorum_index(self.membership, match)
        committed = self.log.term(index) == self.term and self.log.commit_to(index)
        if committed or force:
            for node in sorted(self.progress):
                if node != self.id:
                    self._send_append(node)
        if committed and self.id not in self.membership.voters and self.log.last_change <= index:
            self._become_follower(self.term, None)  # its own removal is committed
        return committed

    def _send_append(self, to: int, send_empty: bool = True) -> bool:
        """An append (or, behind the first entry, the snapshot) to ``to``; whether one
        was sent."""
        progress = self.progress[to]
        if progress.paused:
            return False
        prev = progress.next - 1
        prev_term = self.log.term(prev)
        if prev_term is None:
            snapshot = self.log.snapshot
            progress.become_snapshot(snapshot.index)
            self._send(Message(T.SNAPSHOT, self.id, to, self.term, snapshot=snapshot))
            return True
        entries = self.log.entries(progress.next, self.settings.max_append_entries)
        if not entries and not send_empty:
            return False
        message = Message(
            T.APPEND,
            self.id,
            to,
            self.term,
            index=prev,
            log_term=prev_term,
            entries=entries,
            commit=self.log.committed,
            epoch=progress.repair_epoch(self.log.committed),
        )
        self._send(message)
        progress.sent(entries[-1].index if entries else None)
        return True

    def _broadcast_heartbeat(self, context: int) -> None:
        for node, progress in sorted(self.progress.items()):
            if node != self.id:
                commit = min(progress.match, self.log.committed)
                self._send(
                    Message(T.HEARTBEAT, self.id, node, self.term, commit=commit, context=context)
                )

    def _release_reads(self) -> None:
        """Hand out every read up to the last one a majority of voters confirmed."""
        confirmed = 0
        for position, read in enumerate(self._reads):
            if len(read.acks & self.membership.voters) >= self.membership.quorum:
                confirmed = position + 1
        for read in self._reads[:confirmed]:
            self._read_states.append(ReadState(read.request, read.index))
        del self._reads[:confirmed]

    def _quorum_active(self) -> bool:
        active = {node for node, progress in self.progress.items() if progress.recent_active}
        return len(active & self.membership.voters) >= self.membership.quorum

    def _check_proposal(self) -> None:
        self._idle()
        self._check_leader()
        if self.transferee is not None:
            raise ProposalRefused(
                f"leadership is moving to node {self.transferee}; propose there once it leads"
            )
        if self.id not in self.membership.voters:
            raise ProposalRefused("this leader is being removed from the group")

    def _check_leader(self) -> None:
        if self.role is not Role.LEADER:
            raise NotLeader(self.id, self.leader)

    # -- helpers ---------------------------------------------------------------------

    def _in_lease(self) -> bool:
        return (
            self.settings.check_quorum
            and self.leader is not None
            and self._election_elapsed < self.settings.election_ticks
        )

    def _send(self, message: Message) -> None:
        if (
            message.kind in _LEADING
            and self.role is Role.LEADER
            and self._durable.term == self.term
        ):
            # What a leader sends in a term it made durable (its vote for itself with
            # it) depends on no write of this Ready: its own new entries count toward
            # a commit only once durable (advance), and a crash that loses them loses
            # nothing acknowledged -- they are committed only if a majority fsynced
            # them without it (the Raft thesis, 10.2.1). A single voter that wins at
            # once has its term still to make durable: its appends wait.
            self._early.append(message)
        else:
            self._outbox.append(message)

    def _hard_state(self) -> HardState:
        return HardState(self.term, self.vote, self.log.committed, self.epoch, self.repairing)

    def _random_timeout(self) -> int:
        ticks = self.settings.election_ticks
        return self._randomness.randrange(ticks, 2 * ticks)

    def _idle(self) -> None:
        if self._handed_out is not None:
            raise DriverError("the last Ready is not advanced yet: call advance() first")
