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
    check_block,
)
from meshbus.storage.errors import StoreError
from meshbus.storage.store import ConsumerConfig, PublishIds, StreamState

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


def check_rows(rows: list[BlockRow]) -> list[tuple[int, float, dict[bytes, int]]]:
    """Blocks from another replica: each whole (its CRC32), of as many messages as its
    seqs say, in order. CopyMismatch if not. Each block's first seq, time and publish
    ids (id -> seq)."""
    after = 0
    ids: list[tuple[int, float, dict[bytes, int]]] = []
    for first, last, at, crc, data in rows:
        if not after < first <= last or block_crc(data) != crc:
            raise CopyMismatch(f"a copied block of seqs {first}..{last} is damaged or out of order")
        try:
            block = decode_block(data)
        except (msgspec.DecodeError, ValueError) as exc:
            raise CopyMismatch(f"a copied block of seqs {first}..{last} does not decode") from exc
        if len(block) != last - first + 1:
            raise CopyMismatch(
                f"a copied block of seqs {first}..{last} holds {len(block)} messages"
            )
        batch = {i: seq for seq, i in enumerate(block.publish_id_list(), first) if i}
        ids.append((first, at, batch))
        after = last
    return ids


@dataclass
class Staged:
    """A copy staged past a stream, as the store keeps it in memory (a restart drops its
    blocks too): the seqs of its blocks -- unbroken from ``first`` to ``last`` (0: none
    yet) -- and their publish ids, remembered as they come."""

    ids: PublishIds
    first: int = 0
    last: int = 0

    def held_last(self, st: StreamState) -> int:
        """The last seq the stream holds, the staged blocks included."""
        return max(st.last_seq, self.last)


def stage(db: sqlite3.Connection, st: StreamState, staged: Staged, rows: list[BlockRow]) -> int:
    """Write the copied blocks past what the stream holds (staged and not); the last seq
    held now. Blocks must follow on from those held, unbroken -- but for the first
    staged, which may start past the stream's end (what lies between is gone from the
    replica copied: retention) --; one that does not is a CopyMismatch."""
    held = staged.held_last(st)
    fresh = [row for row in rows if row[1] > held]
    expected = held + 1 if staged.first else 0
    for first, last, *_ in fresh:
        if first <= held or (expected and first != expected):
            raise CopyMismatch(
                f"a copied block of seqs {first}..{last} does not follow on from the "
                f"blocks held (to {held})"
            )
        expected = last + 1
    if not fresh:
        return held
    db.executemany(
        "INSERT INTO blocks VALUES (?, ?, ?, ?, ?)",
        [(block_key(st.key, first), last, at, crc, data) for first, last, at, crc, data in fresh],
    )
    staged.first = staged.first or fresh[0][0]
    staged.last = fresh[-1][1]
    return staged.last


def install(db: sqlite3.Connection, st: StreamState, staged: Staged, image: StreamImage) -> None:
    """Make the stream ``image``: its blocks past ``image.last_seq`` and before
    ``image.first_seq`` gone, its counters, consumers and Raft index replaced. The caller
    reloads its mirror of the stream. CopyMismatch if the blocks held do not run
    unbroken over ``image.first_seq..image.last_seq``: the stream's own (unbroken) and
    the staged ones after them, or the staged ones alone."""
    sid = st.key
    if image.last_seq >= image.first_seq:
        follows_on = staged.first in (0, st.last_seq + 1)
        start = st.first_seq if follows_on else staged.first
        if staged.held_last(st) < image.last_seq or start > image.first_seq:
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
