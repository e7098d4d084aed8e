"""Raft messages through RAFT frames: every kind and field there and back."""

from __future__ import annotations

import pytest

from meshbus.broker.replication.wire import KINDS, from_body, to_bodies
from meshbus.errors import ProtocolError
from meshbus.protocol.codec import decode_body, encode_control
from meshbus.protocol.control import RaftFrame, RaftMessageBody
from meshbus.protocol.layout import CONTROL_HEADER_SIZE, ControlType
from meshbus.raft import Entry, Membership, Message, MessageType, Snapshot

FULL = Message(
    MessageType.APPEND,
    sender=1,
    to=3,
    term=2**62,
    index=41,
    log_term=7,
    entries=(Entry(7, 42, b"rows"), Entry(8, 43, membership=Membership.of([1, 2, 3], [4]))),
    commit=40,
    reject=True,
    hint_index=12,
    hint_term=5,
    snapshot=Snapshot(10, 4, Membership.of([1, 2, 3]), b"state"),
    context=99,
    transfer=True,
    epoch=2**32 - 1,
    repairing=True,
)


def through_the_wire(messages: list[Message]) -> list[Message]:
    frame = encode_control(
        ControlType.RAFT, RaftFrame(group="orders", messages=to_bodies(messages))
    )
    body = decode_body(ControlType.RAFT, frame[CONTROL_HEADER_SIZE:])
    assert isinstance(body, RaftFrame)
    assert body.group == "orders"
    return [from_body(m) for m in body.messages]


def test_every_kind_and_field_comes_back() -> None:
    assert set(KINDS) == set(MessageType)
    messages = [Message(kind, 2, 1, 3) for kind in MessageType] + [FULL]
    assert through_the_wire(messages) == messages


def test_a_kind_past_the_known_ones_is_refused() -> None:
    with pytest.raises(ProtocolError, match="unknown kind 10"):
        from_body(RaftMessageBody(kind=len(KINDS), sender=1, to=2, term=1))
