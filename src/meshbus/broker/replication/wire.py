"""Raft messages to and from RAFT frame bodies (meshbus.protocol.control.RaftMessageBody).

The body's numbers are range-checked by its decoder (node ids 1..5, counters below
2**63, at most 64 entries a message); here the kinds are numbered -- the numbers are
the wire's and never reused -- and the values converted.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshbus.errors import ProtocolError
from meshbus.protocol.control import RaftEntryBody, RaftMessageBody, RaftSnapshotBody
from meshbus.raft import Entry, Membership, Message, MessageType, Snapshot

KINDS: tuple[MessageType, ...] = (
    MessageType.PRE_VOTE,
    MessageType.PRE_VOTE_RESPONSE,
    MessageType.VOTE,
    MessageType.VOTE_RESPONSE,
    MessageType.APPEND,
    MessageType.APPEND_RESPONSE,
    MessageType.HEARTBEAT,
    MessageType.HEARTBEAT_RESPONSE,
    MessageType.SNAPSHOT,
    MessageType.TIMEOUT_NOW,
)
_NUMBER = {kind: number for number, kind in enumerate(KINDS)}


def to_body(m: Message) -> RaftMessageBody:
    snapshot = m.snapshot
    return RaftMessageBody(
        kind=_NUMBER[m.kind],
        sender=m.sender,
        to=m.to,
        term=m.term,
        index=m.index,
        log_term=m.log_term,
        entries=[_entry_body(e) for e in m.entries],
        commit=m.commit,
        reject=m.reject,
        hint_index=m.hint_index,
        hint_term=m.hint_term,
        snapshot=None
        if snapshot is None
        else RaftSnapshotBody(
            snapshot.index,
            snapshot.term,
            sorted(snapshot.membership.voters),
            sorted(snapshot.membership.learners),
            snapshot.data,
        ),
        context=m.context,
        transfer=m.transfer,
        epoch=m.epoch,
        repairing=m.repairing,
    )


def from_body(b: RaftMessageBody) -> Message:
    """The message; ProtocolError for a kind this broker does not know."""
    if b.kind >= len(KINDS):
        raise ProtocolError(f"RAFT message of unknown kind {b.kind}")
    snap = b.snapshot
    return Message(
        KINDS[b.kind],
        b.sender,
        b.to,
        b.term,
        index=b.index,
        log_term=b.log_term,
        entries=tuple(map(_entry, b.entries)),
        commit=b.commit,
        reject=b.reject,
        hint_index=b.hint_index,
        hint_term=b.hint_term,
        snapshot=None
        if snap is None
        else Snapshot(snap.index, snap.term, Membership.of(snap.voters, snap.learners), snap.data),
        context=b.context,
        transfer=b.transfer,
        epoch=b.epoch,
        repairing=b.repairing,
    )


def to_bodies(messages: Sequence[Message]) -> list[RaftMessageBody]:
    return [to_body(m) for m in messages]


def _entry_body(entry: Entry) -> RaftEntryBody:
    membership = entry.membership
    if membership is None:
        return RaftEntryBody(entry.term, entry.index, entry.data)
    return RaftEntryBody(
        entry.term, entry.index, entry.data, sorted(membership.voters), sorted(membership.learners)
    )


def _entry(body: RaftEntryBody) -> Entry:
    membership = None if body.voters is None else Membership.of(body.voters, body.learners)
    return Entry(body.term, body.index, body.data, membership)
