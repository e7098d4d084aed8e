"""Columnar blocks: what goes in comes out, whole or a slice, and the layout is the one
Arrow reads (little-endian u32 indices and offsets, each distinct value once)."""

from __future__ import annotations

import struct
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshbus.protocol.blocks import (
    BlockSlice,
    MessageColumns,
    decode_block,
    encode_block,
    slices_of,
    u32_values,
)

ADDRESSES = st.sampled_from([bytes([1]) + bytes(15), bytes([2]) * 16, bytes([3]) * 16])
MESSAGE = st.tuples(
    ADDRESSES,
    ADDRESSES,
    st.binary(max_size=40),
    st.sampled_from([b"", b"g1", b"g2"]),
    st.sampled_from([0, 3, -1, 2**40]),
    st.sampled_from([b"", b"id1", b"id2"]),
    st.sampled_from([b"", b"NATS/1.0\r\nTrace: 1\r\n\r\n"]),
)


@given(st.lists(MESSAGE, min_size=1, max_size=50), st.data())
def test_a_block_gives_back_its_messages_whole_or_sliced(
    messages: list[tuple[bytes, bytes, bytes, bytes, int, bytes, bytes]], data: st.DataObject
) -> None:
    columns = MessageColumns(*map(list, zip(*messages, strict=True)))
    block = decode_block(encode_block(*columns))
    assert len(block) == len(messages)
    assert block.columns() == columns
    assert block.payload_sizes() == [len(m[2]) for m in messages]
    assert len(block.src_values) == len({m[0] for m in messages})  # each distinct value once
    start = data.draw(st.integers(0, len(messages)))
    stop = data.draw(st.integers(start, len(messages)))
    expected = [[m[field] for m in messages[start:stop]] for field in range(7)]
    assert block.columns(start, stop) == MessageColumns(*expected)
    piece = BlockSlice(10, 1.5, start, stop, encode_block(*columns))
    assert piece.seqs == range(10 + start, 10 + stop)
    assert piece.columns() == block.columns(start, stop)


def test_offsets_and_indices_are_little_endian_u32() -> None:
    columns = MessageColumns(
        [b"a", b"b"], [b"d", b"d"], [b"xy", b"z"], [b"", b""], [0, 0], [b"", b"k"], [b"h", b""]
    )
    block = decode_block(encode_block(*columns))
    assert bytes(block.offsets) == struct.pack("<3I", 0, 2, 3)
    assert bytes(block.payloads) == b"xyz"
    assert bytes(block.src_index) == struct.pack("<2I", 0, 1)
    assert (block.dst_values, bytes(block.dst_index)) == ([b"d"], b"")  # one value: no index
    assert bytes(block.id_offsets) == struct.pack("<3I", 0, 0, 1)
    assert block.header_offsets is not None
    assert bytes(block.header_offsets) == struct.pack("<3I", 0, 1, 1)


def test_a_block_without_headers_ends_before_their_columns() -> None:
    """The blocks of a store from before headers decode as blocks without any."""
    data = encode_block([b"a"] * 2, [b"d"] * 2, [b"x", b"y"], [b""] * 2, [0] * 2, [b""] * 2)
    assert data == encode_block(
        [b"a"] * 2, [b"d"] * 2, [b"x", b"y"], [b""] * 2, [0] * 2, [b""] * 2, [b""] * 2
    )
    block = decode_block(data)
    assert (block.header_offsets, block.headers) == (None, None)
    assert block.columns().headers == [b"", b""]


def test_a_decoded_block_shares_the_encoded_bytes() -> None:
    data = encode_block([b"a"], [b"d"], [b"x" * 1000], [b""], [0], [b""])
    assert decode_block(data).payloads.obj is data  # a view, not a copy


def test_rows_become_one_block_per_run_stored_at_the_same_time() -> None:
    rows = [
        (5, 1.0, b"s", b"d", b"", 0, b"a", b""),
        (6, 1.0, b"s", b"d", b"g", 2, b"b", b"h"),
        (7, 2.0, b"t", b"d", b"", 0, b"c", b""),
    ]
    first, second = slices_of(rows)
    assert (first.first_seq, first.stored_at, first.seqs) == (5, 1.0, range(5, 7))
    assert first.columns() == MessageColumns(
        [b"s", b"s"], [b"d", b"d"], [b"a", b"b"], [b"", b"g"], [0, 2], [b"", b""], [b"", b"h"]
    )
    assert (second.seqs, second.columns().payload) == (range(7, 8), [b"c"])
    assert slices_of([]) == []


def test_publish_ids_alone_match_the_column() -> None:
    ids = [b"", b"k1", b"k2"]
    columns = MessageColumns(
        [b"a"] * 3, [b"d"] * 3, [b"x", b"y", b"z"], [b""] * 3, [0] * 3, ids, [b""] * 3
    )
    block = decode_block(encode_block(*columns))
    assert block.publish_id_list() == ids == block.columns().publish_id


def test_the_big_endian_reader_takes_four_bytes_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a big-endian machine u32s are read natively, then byte-swapped. Forced on this
    machine, that swap gives the swapped values -- but one per 4 bytes, not per byte."""
    data = memoryview(struct.pack("<3I", 1, 2, 0x01020304))
    monkeypatch.setattr(sys, "byteorder", "big")
    assert list(u32_values(data)) == [0x01000000, 0x02000000, 0x04030201]
