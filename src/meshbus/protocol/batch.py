"""A batch frame's rows: many messages in one reliable data frame (docs/protocol.md §4.9).

A reliable send costs its sender an entry in the ack table, a resend timer and a
frame through the broker, and the stream host a capture and an ack. A bulk writer
(the Spark sink) sending a million rows one frame each spends its time there, not
on the rows. A *batch frame* carries many rows and is acknowledged, resent and
routed as one message; its receivers -- connectors and stream hosts -- unpack it
into one message per row, so whoever reads them sees the same messages as if
each row had been sent alone.

Exactly once stays per row: every row carries its own publish id (required), which
receiving services and streams deduplicate as for any message. A batch resent
after a lost ack, or sent again by a retried Spark task from a new connector, is
therefore delivered and stored once per row.

The payload of a batch frame (EXT block with ``batch = BATCH_ROWS``) is a msgpack
array of rows, each an array ``[payload: bin, publish_id: bin, priority: int]``
(``priority`` left out when 0). Sans-IO: bytes in, rows out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Annotated

import msgspec

from meshbus.errors import FrameTooLarge, InvalidArgument, ProtocolError
from meshbus.protocol.ext import Ext

# The batch format of the EXT block's ``batch`` field; 0 is a plain message.
BATCH_ROWS = 1
# The most rows one batch frame may carry. A receiver decodes them and a stream host
# appends them in one turn of its loop (about 3 us a row): 4,096 keep a frame's share of
# that turn near 12 ms, where a 1 MiB frame of empty rows would be 75,000 of them. A
# batch with more is refused as malformed; senders split at it.
MAX_ROWS = 4096
PUBLISH_ID_MAX = 1024  # as for a single message (Service.send)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
# The most bytes msgpack adds to a row around its payload and publish id: the row's
# array header (1), bin headers (5 + 3) and a priority (5).
_ROW_OVERHEAD = 14
_ARRAY_HEADER = 5  # the list's array32 header, at most
# Room a sender leaves in a frame for the 64-byte header and the EXT block (whose
# origin, on a resend to one member, is 16 more bytes).
FRAME_OVERHEAD = 64 + 64


class BatchRow(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """One row of a batch frame, as it is decoded (every field range-checked). Untracked
    by the garbage collector (bytes and an int make no cycle): a stream host decodes a
    million of these a second, and tracking them took two thirds of the decode."""

    payload: bytes
    publish_id: Annotated[bytes, msgspec.Meta(min_length=1, max_length=PUBLISH_ID_MAX)]
    priority: Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0


# A row as a sender gives it: (payload, publish id) or (payload, publish id, priority).
RowTuple = tuple[bytes, bytes] | tuple[bytes, bytes, int]

_encode = msgspec.msgpack.Encoder().encode
_decode_rows: Callable[[bytes | memoryview], list[BatchRow]] = msgspec.msgpack.Decoder(
    Annotated[list[BatchRow], msgspec.Meta(max_length=MAX_ROWS)]
).decode


def received_rows(ext: Ext, payload: bytes | memoryview) -> list[BatchRow]:
    """The rows of a batch frame with extension block ``ext``, as every receiver reads
    them (a connector delivering, a stream host storing); ``ProtocolError`` if it is not
    a batch in a format this version reads, or claims a message group or a command."""
    if ext.batch != BATCH_ROWS:
        raise ProtocolError(
            f"batch format {ext.batch} is unknown here (this meshbus reads format "
            f"{BATCH_ROWS}): upgrade it to the sender's meshbus version"
        )
    if ext.group or ext.command:
        raise ProtocolError("a batch frame cannot be a message group's or a command")
    return decode_rows(payload)


def decode_rows(payload: bytes | memoryview) -> list[BatchRow]:
    """The rows of a batch frame's payload; ``ProtocolError`` if it is not a list of
    well-formed rows (a publish id missing or too long, a priority out of range)."""
    try:
        return _decode_rows(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed batch of rows: {exc}") from None


def pack_rows(rows: Sequence[RowTuple], limit: int) -> Iterator[tuple[bytes, int]]:
    """``rows`` as batch payloads of at most ``limit`` bytes and ``MAX_ROWS`` rows each, in
    order: (payload, rows in it). A row that cannot fit in a payload of its own raises
    ``FrameTooLarge``; a row with a bad field raises ``InvalidArgument`` -- before
    anything is packed, so a receiver never drops a batch for a row its sender could
    have refused."""
    start = 0
    size = _ARRAY_HEADER
    for i, row in enumerate(rows):
        row_size = len(row[0]) + len(row[1]) + _ROW_OVERHEAD
        if _ARRAY_HEADER + row_size > limit:
            raise FrameTooLarge(_ARRAY_HEADER + row_size + FRAME_OVERHEAD, limit + FRAME_OVERHEAD)
        if size + row_size > limit or i - start == MAX_ROWS:
            yield _packed(rows[start:i]), i - start
            start, size = i, _ARRAY_HEADER
        size += row_size
    if start < len(rows):
        yield _packed(rows[start:]), len(rows) - start


def _packed(rows: Sequence[RowTuple]) -> bytes:
    payload = _encode(rows)
    try:
        _decode_rows(payload)  # the receivers' checks, in C: cheaper than one per row here
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidArgument(
            f"a batch row is not (payload: bytes, publish_id: 1 to {PUBLISH_ID_MAX} bytes"
            f"[, priority: {PRIORITY_MIN}..{PRIORITY_MAX}]): {exc}"
        ) from None
    return payload
