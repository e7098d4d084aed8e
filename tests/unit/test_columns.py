"""The packed page of a columnar fetch: what goes in comes out, and the layout is the
one Arrow reads (little-endian u32 indices and offsets)."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from meshbus.protocol.columns import FIELDS, pack, unpack_index, unpack_payloads

ADDRESSES = st.sampled_from([bytes([1]) + bytes(15), bytes([2]) * 16, bytes([3]) * 16])


@given(
    st.lists(
        st.tuples(ADDRESSES, ADDRESSES, st.sampled_from([b"", b"g1", b"g2"]), st.binary()),
        max_size=50,
    )
)
def test_pack_round_trips(messages: list[tuple[bytes, bytes, bytes, bytes]]) -> None:
    src = [m[0] for m in messages]
    dst = [m[1] for m in messages]
    group = [m[2] for m in messages]
    payload = [m[3] for m in messages]
    seq = list(range(7, 7 + len(messages)))
    page = dict(
        zip(
            FIELDS,
            pack(seq, [1.5] * len(seq), src, dst, group, [0] * len(seq), payload),
            strict=True,
        )
    )
    assert page["seq"] == seq
    assert unpack_index(page["src_values"], page["src_index"]) == src
    assert unpack_index(page["dst_values"], page["dst_index"]) == dst
    assert unpack_index(page["group_values"], page["group_index"]) == group
    assert len(page["src_values"]) == len(set(src))  # each distinct value once
    assert unpack_payloads(page["offsets"], page["payloads"]) == payload


def test_offsets_and_indices_are_little_endian_u32() -> None:
    page = dict(
        zip(
            FIELDS,
            pack([1, 2], [0.0, 0.0], [b"a", b"b"], [b"d", b"d"], [b"", b""], [0, 0], [b"xy", b"z"]),
            strict=True,
        )
    )
    assert page["offsets"] == struct.pack("<3I", 0, 2, 3)
    assert page["src_index"] == struct.pack("<2I", 0, 1)
    assert page["payloads"] == b"xyz"
