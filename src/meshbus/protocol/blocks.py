"""Columnar message blocks: how a stream stores its messages, and what a bulk reader
(the Spark source) fetches.

A block is the messages of one append batch (the store splits big batches), a column
per field, in the layout Arrow takes as is -- one msgpack array of

    src_values, src_index               distinct 16-byte addresses; a u32 index per message
                                        (none when there is one value: the usual batch)
    dst_values, dst_index
    group_values, group_index           b"" stands for "no group"
    priority_values, priority_index
    id_offsets, publish_ids             n+1 u32 offsets into one buffer; b"": no id
    offsets, payloads                   the same for payloads
    header_offsets, headers             the same for header blocks; left out (the
                                        array ends before them) when no message has any

Indices and offsets are little-endian u32 (a block is far under 4 GiB).

The SQLite store keeps a block as one row, and a columnar fetch
(``StreamRequest.columns``) answers with the stored bytes as they are: a
``BlockSlice`` says which of the block's messages the answer covers. So a bulk read
costs the broker no work per message, and the reader's Arrow arrays are views of the
block's buffers: nobody makes a Python object per message. Rows, for the paths that
want them, come from ``Block.columns``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import accumulate, groupby, pairwise
from operator import itemgetter
from typing import NamedTuple, TypeVar

import msgspec

T = TypeVar("T")
Key = TypeVar("Key", bytes, int)


class MessageColumns(NamedTuple):
    """Messages a list per field (the order of the broker's ``NewMessage``)."""

    src: Sequence[bytes]
    dst: Sequence[bytes]
    payload: Sequence[bytes]
    group: Sequence[bytes]
    priority: Sequence[int]
    publish_id: Sequence[bytes]
    headers: Sequence[bytes]


class Block(msgspec.Struct, array_like=True, frozen=True):
    """A decoded block. Its buffers are views of the encoded bytes (no copy)."""

    src_values: list[bytes]
    src_index: memoryview
    dst_values: list[bytes]
    dst_index: memoryview
    group_values: list[bytes]
    group_index: memoryview
    priority_values: list[int]
    priority_index: memoryview
    id_offsets: memoryview
    publish_ids: memoryview
    offsets: memoryview
    payloads: memoryview
    header_offsets: memoryview | None = None
    headers: memoryview | None = None

    def __len__(self) -> int:
        return len(self.offsets) // 4 - 1

    def payload_sizes(self) -> list[int]:
        return [b - a for a, b in pairwise(u32_values(self.offsets))]

    def publish_id_list(self) -> list[bytes]:
        """Every message's publish id (b"": none), without the other columns."""
        return _cut(self.id_offsets, self.publish_ids, 0, len(self))

    def columns(self, start: int = 0, stop: int | None = None) -> MessageColumns:
        """Messages ``start``..``stop - 1`` (positions in the block) as lists."""
        stop = len(self) if stop is None else stop
        return MessageColumns(
            _take(self.src_values, self.src_index, start, stop),
            _take(self.dst_values, self.dst_index, start, stop),
            _cut(self.offsets, self.payloads, start, stop),
            _take(self.group_values, self.group_index, start, stop),
            _take(self.priority_values, self.priority_index, start, stop),
            _cut(self.id_offsets, self.publish_ids, start, stop),
            self.header_list(start, stop),
        )

    def header_list(self, start: int = 0, stop: int | None = None) -> list[bytes]:
        """Messages ``start``..``stop - 1``'s header blocks (b"": none)."""
        stop = len(self) if stop is None else stop
        if self.header_offsets is None or self.headers is None:
            return [b""] * (stop - start)
        return _cut(self.header_offsets, self.headers, start, stop)


class BlockSlice(msgspec.Struct, array_like=True, frozen=True):
    """Messages ``start``..``stop - 1`` of an encoded block whose first message has seq
    ``first_seq``; every message of a block was stored at ``stored_at``."""

    first_seq: int
    stored_at: float
    start: int
    stop: int
    data: bytes

    @property
    def seqs(self) -> range:
        return range(self.first_seq + self.start, self.first_seq + self.stop)

    def block(self) -> Block:
        return decode_block(self.data)

    def columns(self) -> MessageColumns:
        return self.block().columns(self.start, self.stop)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Block).decode


def encode_block(
    src: Sequence[bytes],
    dst: Sequence[bytes],
    payload: Sequence[bytes],
    group: Sequence[bytes],
    priority: Sequence[int],
    publish_id: Sequence[bytes],
    headers: Sequence[bytes] = (),
) -> bytes:
    """A block of messages given a sequence per field (``MessageColumns``' order);
    ``headers`` empty or all b"": no message has headers."""
    columns: tuple[object, ...] = (
        *_dictionary(src),
        *_dictionary(dst),
        *_dictionary(group),
        *_dictionary(priority),
        *_concat(publish_id),
        *_concat(payload),
    )
    if any(headers):
        columns = (*columns, *_concat(headers))
    return _encode(columns)


def decode_block(data: bytes | memoryview) -> Block:
    return _decode(data)


# seq, stored_at, src, dst, group, priority, payload, headers
Row = tuple[int, float, bytes, bytes, bytes, int, bytes, bytes]


def slices_of(rows: Iterable[Row]) -> list[BlockSlice]:
    """Consecutive rows as blocks, one per run stored at the same time (as a store's
    blocks are), for those that keep or get messages as rows."""
    out: list[BlockSlice] = []
    for at, run in groupby(rows, key=itemgetter(1)):
        seq, _, src, dst, group, priority, payload, headers = zip(*run, strict=True)
        data = encode_block(src, dst, payload, group, priority, [b""] * len(seq), headers)
        out.append(BlockSlice(seq[0], at, 0, len(seq), data))
    return out


def u32_values(data: memoryview) -> Sequence[int]:
    """Little-endian u32s; a view of ``data`` where the machine is little-endian."""
    if sys.byteorder == "little":
        return data.cast("B").cast("I")
    values = array("I")
    values.frombytes(data)  # array("I", data) would take each byte as one value
    values.byteswap()
    return values


def _u32(values: Iterable[int]) -> bytes:
    packed = array("I", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _dictionary(values: Sequence[Key]) -> tuple[list[Key], bytes]:
    if values and values.count(values[0]) == len(values):
        return [values[0]], b""  # the usual batch: one sender, one topic, no group
    distinct = list(dict.fromkeys(values))
    index = {value: i for i, value in enumerate(distinct)}
    return distinct, _u32(map(index.__getitem__, values))


def _concat(values: Sequence[bytes]) -> tuple[bytes, bytes]:
    return _u32(accumulate(map(len, values), initial=0)), b"".join(values)


def _take(values: list[T], index: memoryview, start: int, stop: int) -> list[T]:
    if not index:
        return values * (stop - start)
    return [values[i] for i in u32_values(index)[start:stop]]


def _cut(offsets: memoryview, data: memoryview, start: int, stop: int) -> list[bytes]:
    ends = u32_values(offsets)
    whole = bytes(data[ends[start] : ends[stop]])
    base = ends[start]
    return [whole[a - base : b - base] for a, b in pairwise(ends[start : stop + 1])]
