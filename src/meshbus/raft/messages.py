"""What goes into and comes out of the Raft core: entries, snapshots, the durable
state, the messages between nodes and the Ready that hands the driver its work.

All are frozen: the core never changes a value once the driver can see it. Node ids
are positive ints; 0 is "no node" on the wire, None in the core.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshbus.raft.config import Membership


@dataclass(frozen=True, slots=True)
class Entry:
    """One log entry. ``membership`` is set on the entries that change the group (it
    then takes effect as soon as the entry is in a log); ``data`` is opaque."""

    term: int
    index: int
    data: bytes = b""
    membership: Membership | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state machine up to ``index`` (whose entry had ``term``), with the membership
    in force there; ``data`` is the driver's, opaque to the core."""

    index: int
    term: int
    membership: Membership
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class HardState:
    """What a node must find again after a restart, besides its log.

    ``epoch`` counts the times this node restarted from a damaged log, and
    ``repairing`` says it has not yet caught up since the last time (docs/raft.md,
    "Corruption"). All but ``commit`` must survive damage to the log: the driver keeps
    them apart from it (docs/raft.md, "The driver's contract"); the commit index may
    go back with the log.
    """

    term: int = 0
    vote: int | None = None
    commit: int = 0
    epoch: int = 0
    repairing: bool = False


@dataclass(frozen=True, slots=True)
class Stored:
    """What the driver read back from its disk at a restart."""

    hard_state: HardState
    snapshot: Snapshot
    entries: tuple[Entry, ...] = ()


def bootstrap(membership: Membership) -> Stored:
    """The disk of a founding member of a new group: the membership as entry 1, term 1,
    committed (the same on every founding member, so no election is needed to agree on
    it). A node that joins later starts from ``empty()`` and hears from the leader."""
    entry = Entry(term=1, index=1, membership=membership)
    return Stored(HardState(term=1, commit=1), Snapshot(0, 0, Membership()), (entry,))


def empty() -> Stored:
    return Stored(HardState(), Snapshot(0, 0, Membership()))


class MessageType(enum.Enum):
    PRE_VOTE = "PreVote"
    PRE_VOTE_RESPONSE = "PreVoteResp"
    VOTE = "Vote"
    VOTE_RESPONSE = "VoteResp"
    APPEND = "App"
    APPEND_RESPONSE = "AppResp"
    HEARTBEAT = "Heartbeat"
    HEARTBEAT_RESPONSE = "HeartbeatResp"
    SNAPSHOT = "Snap"
    TIMEOUT_NOW = "TimeoutNow"


@dataclass(frozen=True, slots=True)
class Message:
    """One message between two nodes. Which fields mean what, by type:

    - PRE_VOTE, VOTE: ``index``/``log_term`` the candidate's last entry; ``transfer``
      when a leadership transfer asked for it (the voters' lease does not stop it).
    - their responses: ``reject``; ``term`` is the term asked for when granted.
    - APPEND: ``index``/``log_term`` the entry before ``entries``; ``commit``;
      ``epoch`` the recipient's epoch once the leader's commit index repairs it (it is
      past an entry the leader appended after it learned of the recipient's damage, and
      committed without it: docs/raft.md, "Corruption"), else 0.
    - APPEND_RESPONSE: ``index`` the last entry now held (or, with ``reject``, the
      ``index`` refused and ``hint_index``/``hint_term`` where the logs may agree);
      ``epoch`` and ``repairing`` the sender's.
    - HEARTBEAT: ``commit``; ``context`` a read's id (0: none). Its response echoes
      ``context`` and carries ``epoch``.
    - SNAPSHOT: ``snapshot``.
    """

    kind: MessageType
    sender: int
    to: int
    term: int
    index: int = 0
    log_term: int = 0
    entries: tuple[Entry, ...] = ()
    commit: int = 0
    reject: bool = False
    hint_index: int = 0
    hint_term: int = 0
    snapshot: Snapshot | None = None
    context: int = 0
    transfer: bool = False
    epoch: int = 0
    repairing: bool = False

    def __str__(self) -> str:
        text = f"{self.sender}->{self.to} {self.kind.value} term={self.term}"
        kind = self.kind
        if kind in (MessageType.PRE_VOTE, MessageType.VOTE, MessageType.APPEND):
            text += f" log={self.log_term}/{self.index}"
        if kind is MessageType.APPEND_RESPONSE:
            text += f" index={self.index}"
        if kind in (MessageType.APPEND, MessageType.HEARTBEAT):
            text += f" commit={self.commit}"
        if self.entries:
            text += " entries=[" + ", ".join(map(describe_entry, self.entries)) + "]"
        if self.snapshot is not None:
            text += f" snapshot={describe_snapshot(self.snapshot)}"
        if self.reject:
            text += " rejected"
            if kind is MessageType.APPEND_RESPONSE:
                text += f" hint={self.hint_term}/{self.hint_index}"
        if self.context:
            text += f" read={self.context}"
        if self.transfer:
            text += " transfer"
        if self.epoch:
            text += f" epoch={self.epoch}"
        if self.repairing:
            text += " repairing"
        return text


def describe_entry(entry: Entry) -> str:
    if entry.membership is not None:
        return f"{entry.term}/{entry.index} {entry.membership}"
    return f"{entry.term}/{entry.index} {entry.data.decode(errors='replace')!r}"


def describe_snapshot(snapshot: Snapshot) -> str:
    return f"{snapshot.term}/{snapshot.index} {snapshot.membership}"


@dataclass(frozen=True, slots=True)
class ReadState:
    """A read the leader confirmed: once ``index`` is applied, the state machine
    answers read ``request`` linearizably."""

    request: int
    index: int


@dataclass(frozen=True, slots=True)
class Ready:
    """The core's work for the driver, in this order (docs/raft.md, "The driver's
    contract"):

    1. ``early_messages`` may be sent at once, before or while step 2 runs: the
       leader's appends, heartbeats, snapshots and TIMEOUT_NOW, in a term already
       durable -- nothing in them depends on this Ready's write (the leader counts its
       own entries toward a commit only at ``advance()``). Without a ``snapshot``,
       ``committed`` may be applied now too: a committed entry is durable on a
       majority already, and this node's copy adds nothing to that;
    2. write ``snapshot`` (it replaces the whole log), ``entries`` (they replace the
       log from ``entries[0].index`` on) and ``hard_state`` as one atomic record, and
       fsync it if ``must_sync`` (a change of the commit index alone need not be: it is
       learnt again from the quorum);
    3. only then send ``messages``;
    4. apply ``snapshot`` then ``committed`` (unless applied in step 1), answer
       ``read_states`` once their index is applied;
    5. call ``advance()``.
    """

    hard_state: HardState | None = None
    snapshot: Snapshot | None = None
    entries: tuple[Entry, ...] = ()
    messages: tuple[Message, ...] = ()
    committed: tuple[Entry, ...] = ()
    read_states: tuple[ReadState, ...] = ()
    early_messages: tuple[Message, ...] = ()
    # Whether step 2's write must be fsynced before ``messages`` leave: entries, a
    # snapshot, or a term, vote, epoch or repairing flag to make durable.
    must_sync: bool = False
