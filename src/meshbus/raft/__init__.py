"""A Raft core of meshbus's own, pure: no I/O, no clock, no randomness inside.

The shape (etcd's raft, in the small; docs/raft.md is the whole contract)::

    driver                         RaftNode (core.py)
    ------                         ------------------
    tick()          --------->     time, in ticks
    step(message)   --------->     a message from another node
    propose(data)   --------->     a new entry (the leader only)
    ready()         <---------     Ready: hard state, entries, snapshot to make durable;
                                   then messages to send; then entries to apply
    advance()       --------->     "that Ready is durable, sent and applied"

The modules: ``messages`` (the values that cross the boundary), ``config`` (voters,
learners, quorums), ``log`` (the log as the core sees it), ``progress`` (what a leader
knows of each follower), ``core`` (the state machine), ``errors``.

Of meshbus it imports only ``meshbus.errors`` (a contract in pyproject.toml): the
driver that gives it a disk, a network and a clock is another package's.
"""

from meshbus.raft.config import ChangeKind, Membership, MembershipChange
from meshbus.raft.core import RaftNode, RaftSettings, Randomness, Role
from meshbus.raft.errors import DriverError, LogConflict, NotLeader, ProposalRefused, RaftError
from meshbus.raft.messages import (
    Entry,
    HardState,
    Message,
    MessageType,
    ReadState,
    Ready,
    Snapshot,
    Stored,
    bootstrap,
    empty,
)

__all__ = [
    "ChangeKind",
    "DriverError",
    "Entry",
    "HardState",
    "LogConflict",
    "Membership",
    "MembershipChange",
    "Message",
    "MessageType",
    "NotLeader",
    "ProposalRefused",
    "RaftError",
    "RaftNode",
    "RaftSettings",
    "Randomness",
    "ReadState",
    "Ready",
    "Role",
    "Snapshot",
    "Stored",
    "bootstrap",
    "empty",
]
