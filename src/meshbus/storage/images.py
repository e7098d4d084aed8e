"""A replicated stream's store as one replica copies it from another
(meshbus.broker.replication.copies): first its blocks as they are, then its *image* --
its counters, its consumers and the Raft index its state is at -- installed in one
transaction.

Why blocks can be copied as they are: every replica applies the same entries, and each
entry's messages are stored as the same blocks (``split_batch`` of the same batch, at
the leader's clock), so the blocks of two replicas start at the same seqs. A copy
asks for the blocks past the last one it holds and gets them whole.

Why the copied blocks may wait past the stream's ``last_seq``: until the image is
installed the stream is what it was -- reads, retention and the publish ids see
``first_seq..last_seq`` only -- so a copy is *staged* beside it and resumable (from
another replica, if the one it copied from stops leading). A copy that is given up
(the replica catches up by ordinary entries after all) is discarded before the next
entry is applied, and one a restart cut short is discarded at open.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

import msgspec

from meshbus.protocol.blocks import decode_block
from meshbus.storage.blocks import (
    PUT_PENDING,
    SEQ_MASK,
    UPDATE_COUNTERS,
    BlockRow,
    block_crc,
    block_key,
    block_keys,
    check_block,
)
from meshbus.storage.errors import StoreError
from meshbus.storage.store import ConsumerConfig, StreamState

_LAST_BLOCK = "SELECT last_seq FROM blocks WHERE key >= ? AND key <= ? ORDER BY key DESC LIMIT 1"
_BLOCKS_AFTER = (
    "SELECT key, stored_at, last_seq, crc, messages FROM blocks"
    " WHERE key >= ? AND key <= ? AND last_seq >= ? ORDER BY key"
)


class CopyMismatch(StoreError):
    """What a replica was sent does not fit what it holds: the copy starts again."""


@dataclass(frozen=True)
class ConsumerImage:
    config: ConsumerConfig
    next_seq: int
    dropped: int
    pending: list[tuple[int, int, float]]  # (seq, deliveries so far, redelivery deadline)


@dataclass(frozen=True)
class StreamImage:
    """A stream's state but its messages, as of Raft entry ``applied``."""

    applied: int
    first_seq: int
    last_seq: int
    payload_bytes: int
    consumers: list[ConsumerImage]
    # (time, publish id, seq) of the ids still inside the dedupe window whose messages
    # retention removed: the blocks no longer tell them, and a resend of one must be a
    # duplicate on every replica alike.
    publish_ids: list[tuple[float, bytes, int]]


def image_of(st: StreamState) -> StreamImage:
    consumers = [
        ConsumerImage(
            cs.config,
            cs.next_seq,
            cs.dropped,
            [(seq, count, deadline) for seq, (count, deadline) in cs.pending.items()],
        )
        for cs in st.consumers.values()
    ]
    return StreamImage(
        st.applied,
        st.first_seq,
        st.last_seq,
        st.bytes,
        consumers,
        st.ids.older_than(st.first_seq),
    )


def held_last(db: sqlite3.Connection, st: StreamState) -> int:
    """The last seq of the stream's blocks, those of a copy staged past ``last_seq``
    included (``last_seq`` if it has none)."""
    row = db.execute(_LAST_BLOCK, (block_key(st.key, 0), block_key(st.key, SEQ_MASK))).fetchone()
    return max(st.last_seq, row[0] if row else 0)


def blocks_after(
    db: sqlite3.Connection, path: str, st: StreamState, from_seq: int, max_bytes: int
) -> list[BlockRow]:
    """The blocks that hold the stream's messages from ``from_seq`` on (the first one
    may start before it: retention keeps a block whole), as many as ``max_bytes`` of
    their encoded size allow -- at least one."""
    start = max(from_seq, st.first_seq)
    if start > st.last_seq:
        return []
    rows: list[BlockRow] = []
    room = max_bytes
    cursor = db.execute(
        _BLOCKS_AFTER, (block_key(st.key, 0), block_key(st.key, st.last_seq), start)
    )
    try:
        for key, at, last, crc, data in cursor:
            if rows and len(data) > room:
                break
            check_block(path, st.config.name, key, last, crc, data)
            rows.append((key & SEQ_MASK, last, at, crc, data))
            room -= len(data)
    finally:
        cursor.close()
    return rows


def check_rows(rows: list[BlockRow]) -> None:
    """Blocks from another replica: each whole (its CRC32), of as many messages as its
    seqs say, in order. CopyMismatch if not."""
    after = 0
    for first, last, _, crc, data in rows:
        if not after < first <= last or block_crc(data) != crc:
            raise CopyMismatch(f"a copied block of seqs {first}..{last} is damaged or out of order")
        try:
            count = len(decode_block(data))
        except (msgspec.DecodeError, ValueError) as exc:
            raise CopyMismatch(f"a copied block of seqs {first}..{last} does not decode") from exc
        if count != last - first + 1:
            raise CopyMismatch(f"a copied block of seqs {first}..{last} holds {count} messages")
        after = last


def stage(db: sqlite3.Connection, st: StreamState, rows: list[BlockRow]) -> int:
    """Write the copied blocks past what the stream holds (staged and not); the last seq
    held now. A block that starts inside one held -- they would not line up -- is a
    CopyMismatch."""
    held = held_last(db, st)
    fresh = [row for row in rows if row[1] > held]
    if fresh and fresh[0][0] <= held:
        raise CopyMismatch(
            f"a copied block of seqs {fresh[0][0]}..{fresh[0][1]} overlaps the blocks held "
            f"(to {held})"
        )
    db.executemany(
        "INSERT INTO blocks VALUES (?, ?, ?, ?, ?)",
        [(block_key(st.key, first), last, at, crc, data) for first, last, at, crc, data in fresh],
    )
    return fresh[-1][1] if fresh else held


def install(db: sqlite3.Connection, st: StreamState, image: StreamImage) -> None:
    """Make the stream ``image``: its blocks past ``image.last_seq`` and before
    ``image.first_seq`` gone, its counters, consumers and Raft index replaced. The caller
    reloads its mirror of the stream. CopyMismatch if the blocks held do not run
    unbroken over ``image.first_seq..image.last_seq``."""
    sid = st.key
    if image.last_seq >= image.first_seq:
        blocks = block_keys(db, sid, image.first_seq, image.last_seq)
        expected = (blocks[0][0] & SEQ_MASK) if blocks else 0
        for key, _, last in blocks:
            if key & SEQ_MASK != expected:
                break
            expected = last + 1
        if not blocks or blocks[0][0] & SEQ_MASK > image.first_seq or expected <= image.last_seq:
            raise CopyMismatch(
                f"the blocks held do not cover seqs {image.first_seq}..{image.last_seq}"
            )
    db.execute(
        "DELETE FROM blocks WHERE key > ? AND key <= ?",
        (block_key(sid, image.last_seq), block_key(sid, SEQ_MASK)),
    )
    db.execute(
        "DELETE FROM blocks WHERE key >= ? AND key < ? AND last_seq < ?",
        (block_key(sid, 0), block_key(sid, image.first_seq), image.first_seq),
    )
    db.execute(UPDATE_COUNTERS, (image.first_seq, image.last_seq, image.payload_bytes, sid))
    db.execute(
        "DELETE FROM pending WHERE consumer_id IN (SELECT id FROM consumers WHERE stream_id = ?)",
        (sid,),
    )
    db.execute("DELETE FROM consumers WHERE stream_id = ?", (sid,))
    for consumer in image.consumers:
        c = consumer.config
        cid = db.execute(
            "INSERT INTO consumers VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?)",
            (sid, c.name, c.ack_wait, c.max_deliver, c.start_seq, consumer.next_seq,
             consumer.dropped, c.owner),
        ).lastrowid  # fmt: skip
        db.executemany(
            PUT_PENDING, [(cid, seq, count, due) for seq, count, due in consumer.pending]
        )
    db.execute(
        "INSERT OR REPLACE INTO raft_applied (stream_id, raft_index) VALUES (?, ?)",
        (sid, image.applied),
    )


def discard_staged(db: sqlite3.Connection, st: StreamState) -> None:
    """Drop the blocks of a copy staged past the stream's ``last_seq``."""
    db.execute(
        "DELETE FROM blocks WHERE key > ? AND key <= ?",
        (block_key(st.key, st.last_seq), block_key(st.key, SEQ_MASK)),
    )
