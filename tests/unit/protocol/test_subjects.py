"""What a subject is (meshbus.protocol.subjects), both ends' rules; and the subject on the
wire: SUBSCRIBE/UNSUBSCRIBE bodies and the extension block's ``subject``."""

from __future__ import annotations

import msgspec
import pytest

from meshbus.address import Unicast
from meshbus.protocol.codec import FrameError, decode_body, encode_control
from meshbus.protocol.control import SubjectInterest
from meshbus.protocol.ext import Ext, split, wrap
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.protocol.subjects import MAX_SUBJECT, is_literal, is_valid_queue, is_valid_subject

MEMBER = Unicast("game01", 5).to_bytes()


@pytest.mark.parametrize(
    "subject",
    [b"foo", b"foo.bar", b"*", b">", b"foo.*", b"foo.>", b"*.*.>", b"foo*.bar", b"_INBOX.x.*"],
)
def test_valid_subjects(subject: bytes) -> None:
    assert is_valid_subject(subject)


@pytest.mark.parametrize(
    "subject",
    [
        b"",
        b".",
        b"foo.",
        b".foo",
        b"foo..bar",
        b"foo bar",
        b"foo\tbar",
        b"a.\r",
        b">.foo",
        b"a.>.b",
    ],
)
def test_invalid_subjects(subject: bytes) -> None:
    assert not is_valid_subject(subject)


def test_literal() -> None:
    assert is_literal(b"foo.bar")
    assert is_literal(b"foo*.b>")  # a wildcard is a whole token, or it is a character
    assert not is_literal(b"foo.*")
    assert not is_literal(b"foo.>")


def test_queue_groups() -> None:
    assert is_valid_queue(b"workers")
    assert is_valid_queue(b"a.*")  # a queue group is a name, not a pattern
    assert not is_valid_queue(b"")
    assert not is_valid_queue(b"two words")


@pytest.mark.parametrize("ctype", [ControlType.SUBSCRIBE, ControlType.UNSUBSCRIBE])
def test_a_subject_interest_is_bounded_on_the_wire(ctype: ControlType) -> None:
    longest = SubjectInterest(member=MEMBER, subject=b"s" * MAX_SUBJECT, queue=b"q" * MAX_SUBJECT)
    frame = encode_control(ctype, longest)
    assert decode_body(ctype, frame[12:]) == longest
    for field in ("subject", "queue"):
        body = {"member": MEMBER, "subject": b"a", field: b"s" * (MAX_SUBJECT + 1)}
        with pytest.raises(FrameError) as error:
            decode_body(ctype, msgspec.msgpack.encode(body))
        assert error.value.code == ErrorCode.PROTOCOL_ERROR
    with pytest.raises(FrameError):  # the member and the subject are required
        decode_body(ctype, msgspec.msgpack.encode({"member": MEMBER}))


def test_the_extension_block_carries_a_subject() -> None:
    block = Ext(subject=b"game.eu-west-zone7.chat", headers=b"NATS/1.0\r\nA: b\r\n\r\n")
    got, payload = split(wrap(block, b"gg"))
    assert (got, payload) == (block, b"gg")
    assert split(wrap(Ext(), b""))[0].subject == b""
    # The longest subject beside the most headers still fits the block's u16 length.
    wrap(Ext(subject=b"s" * MAX_SUBJECT, headers=b"h" * 32 * 1024), b"")
