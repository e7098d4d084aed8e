"""The packed page of a columnar stream fetch (``StreamRequest.columns``).

A bulk reader (the Spark source) turns a page into Arrow arrays; the layout is
the one Arrow takes as is, so neither end makes a Python object per message:

    [seq, stored_at,                      lists of int / float
     src_values, src_index,               distinct addresses; a u32 index per message
     dst_values, dst_index,
     group_values, group_index,           b"" stands for "no group"
     priority,                            list of int
     offsets, payloads]                   n+1 u32 offsets into one buffer

Indices and offsets are little-endian u32. A page holds less than 4 GiB (it fits
in one frame), so u32 offsets always suffice.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

FIELDS = (
    "seq", "stored_at", "src_values", "src_index", "dst_values", "dst_index",
    "group_values", "group_index", "priority", "offsets", "payloads",
)  # fmt: skip


def _u32(values: Any) -> bytes:
    packed = array("I", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _from_u32(data: bytes) -> array[int]:
    values = array("I", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _dictionary(values: Sequence[bytes]) -> tuple[list[bytes], bytes]:
    distinct = list(dict.fromkeys(values))
    index = {value: i for i, value in enumerate(distinct)}
    return distinct, _u32(map(index.__getitem__, values))


def pack(
    seq: list[int],
    stored_at: list[float],
    src: Sequence[bytes],
    dst: Sequence[bytes],
    group: Sequence[bytes],
    priority: list[int],
    payload: Sequence[bytes],
) -> list[Any]:
    """A page from a list per field."""
    return [
        seq,
        stored_at,
        *_dictionary(src),
        *_dictionary(dst),
        *_dictionary(group),
        priority,
        _u32(accumulate(map(len, payload), initial=0)),
        b"".join(payload),
    ]


def unpack_index(values: list[bytes], index: bytes) -> list[bytes]:
    """A dictionary-encoded field as a list (for readers that want lists)."""
    return [values[i] for i in _from_u32(index)]


def unpack_payloads(offsets: bytes, payloads: bytes) -> list[bytes]:
    return [payloads[a:b] for a, b in pairwise(_from_u32(offsets))]
