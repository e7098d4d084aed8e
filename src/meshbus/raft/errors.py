"""The errors of the Raft core (meshbus.raft.core): each says whose move it is."""

from __future__ import annotations

from meshbus.errors import MeshbusError


class RaftError(MeshbusError):
    """Base of the Raft core's errors."""


class NotLeader(RaftError):
    """A proposal, a read or a transfer went to a node that is not the leader; send it
    to ``.leader`` (None: no leader is known yet, ask again after an election)."""

    def __init__(self, node: int, leader: int | None) -> None:
        where = f"node {leader} is" if leader is not None else "no leader is known yet; an election"
        super().__init__(f"node {node} is not the leader: {where} the one to ask")
        self.leader = leader


class ProposalRefused(RaftError):
    """The leader cannot take this proposal now; the message says why and when to ask
    again."""


class DriverError(RaftError, RuntimeError):
    """The driver broke the core's contract (docs/raft.md, "The driver's contract"): a
    bug in the driver, never a condition to handle at run time."""


class LogConflict(RaftError):
    """An append would overwrite a committed entry: the sender's log or this node's was
    damaged without being detected. The node must stop and be repaired."""
