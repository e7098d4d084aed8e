"""The batch frame's rows (meshbus.protocol.batch): packed in order, split where a frame
would overflow and never cut, and every field of a received batch range-checked."""

from __future__ import annotations

import msgspec
import pytest

from meshbus.errors import FrameTooLarge, InvalidArgument, ProtocolError
from meshbus.protocol.batch import (
    FRAME_OVERHEAD,
    MAX_ROWS,
    PRIORITY_MAX,
    PUBLISH_ID_MAX,
    BatchRow,
    RowTuple,
    decode_rows,
    pack_rows,
    received_rows,
)
from meshbus.protocol.ext import Ext, split, wrap


def rows_of(count: int, size: int = 100) -> list[RowTuple]:
    return [(b"%08d" % i * (size // 8), b"job/%d" % i, i % 7) for i in range(count)]


def test_rows_come_back_as_they_went_in_order() -> None:
    rows: list[RowTuple] = [(b"a", b"id-1"), (b"", b"id-2", -5), (b"c" * 300, b"x" * 1024, 0)]
    [(payload, count)] = list(pack_rows(rows, 1 << 20))
    assert count == 3
    assert decode_rows(payload) == [
        BatchRow(b"a", b"id-1"),
        BatchRow(b"", b"id-2", -5),
        BatchRow(b"c" * 300, b"x" * 1024),
    ]


def test_a_batch_over_the_limit_is_split_never_cut() -> None:
    rows = rows_of(1000)
    limit = 10_000
    packed = list(pack_rows(rows, limit))
    assert len(packed) > 10
    assert all(len(payload) <= limit for payload, _ in packed)
    assert [count for _, count in packed] == [len(decode_rows(p)) for p, _ in packed]
    back = [(r.payload, r.publish_id, r.priority) for p, _ in packed for r in decode_rows(p)]
    assert back == rows


def test_a_row_that_cannot_fit_a_frame_of_its_own_is_refused() -> None:
    with pytest.raises(FrameTooLarge) as caught:
        list(pack_rows([(b"ok", b"1"), (b"x" * 2000, b"2")], 1000))
    assert caught.value.limit == 1000 + FRAME_OVERHEAD
    assert "maximum frame size" in str(caught.value)


@pytest.mark.parametrize(
    "row",
    [
        (b"p", b""),  # a row needs its publish id: it is what dedupes it
        (b"p", b"x" * (PUBLISH_ID_MAX + 1)),
        (b"p", b"id", PRIORITY_MAX + 1),
        ("text", b"id"),
    ],
)
def test_a_bad_row_is_refused_before_sending(row: RowTuple) -> None:
    with pytest.raises(InvalidArgument, match="a batch row is not"):
        list(pack_rows([(b"fine", b"id"), row], 1 << 20))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode({"not": "a list"}),
        msgspec.msgpack.encode([[b"p"]]),  # no publish id
        msgspec.msgpack.encode([[b"p", b""]]),
        msgspec.msgpack.encode([[b"p", b"id", 2**31]]),
        msgspec.msgpack.encode([[b"p", b"id", -(2**31) - 1]]),
        msgspec.msgpack.encode([[b"p", b"id", 2**64 - 1]]),
        msgspec.msgpack.encode([[b"p", b"i" * (PUBLISH_ID_MAX + 1)]]),
        msgspec.msgpack.encode([[b"p", b"id"]])[:-1],  # cut short
        msgspec.msgpack.encode([[b"", b"i"]] * (MAX_ROWS + 1)),  # more rows than a frame may carry
    ],
)
def test_a_bad_batch_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed batch of rows"):
        decode_rows(payload)


def test_the_extension_block_says_batch_and_checks_its_range() -> None:
    ext, rest = split(wrap(Ext(batch=1), b"rows"))
    assert (ext.batch, rest) == (1, b"rows")
    assert split(wrap(Ext(), b""))[0].batch == 0
    block = msgspec.msgpack.encode(["", "", 0, 0, False, 0, "", "", 0.0, 256])
    with pytest.raises(ProtocolError, match="malformed extension block"):
        split(len(block).to_bytes(2, "big") + block)


def test_a_sender_splits_at_the_most_rows_a_frame_may_carry() -> None:
    rows = [(b"", b"%d" % i) for i in range(MAX_ROWS * 2 + 1)]
    packed = list(pack_rows(rows, 1 << 20))
    assert [count for _, count in packed] == [MAX_ROWS, MAX_ROWS, 1]
    assert [row.publish_id for payload, _ in packed for row in decode_rows(payload)] == [
        publish_id for _, publish_id in rows
    ]


@pytest.mark.parametrize(
    ("ext", "refusal"),
    [
        (Ext(batch=2), "batch format 2 is unknown here"),
        (Ext(batch=1, group=b"g"), "cannot be a message group's or a command"),
        (Ext(batch=1, command="subscribe"), "cannot be a message group's or a command"),
    ],
)
def test_every_receiver_refuses_a_batch_it_cannot_read(ext: Ext, refusal: str) -> None:
    rows = msgspec.msgpack.encode([[b"p", b"id"]])
    assert [row.payload for row in received_rows(Ext(batch=1), rows)] == [b"p"]
    with pytest.raises(ProtocolError, match=refusal):
        received_rows(ext, rows)
