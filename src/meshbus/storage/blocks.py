"""The stream store's on-disk layout: its schema, its message blocks and their checksums.

Shared by the store and its reader (``sqlite_store``) and by salvage
(``store_salvage``), which must agree byte for byte on what a row means; kept apart
from the store so that salvage reads and writes blocks without reaching into it.

Messages are stored in blocks, as Kafka's segments and JetStream's message blocks
are: one row per append batch (split at ``BLOCK_MESSAGES`` messages or
``BLOCK_BYTES`` payload bytes). A row per message cost more than everything else
an append does (SQLite's per-row work, plus a second table for publish ids); a block
makes the store's cost per batch. A block is columnar (``meshbus.protocol.blocks``):
bulk reads -- a columnar fetch, the Spark source reading this file -- take the
stored bytes as they are, and build Arrow arrays as views of them.
Publish ids need no table of their own: each message keeps its id in the block,
and opening the store reads back the blocks younger than the dedupe window. (So
after a restart it knows the ids of the messages it still holds: those retention
removed are forgotten with them, as in JetStream.) A block's key packs (stream id,
its first seq) into one integer, ``stream_id << 40 | seq``: appends go to the end
of a stream's key range, and reads and retention are range scans. That allows
2**23 streams of 2**40 (10**12) messages each. Retention removes whole blocks; a
block cut in the middle stays until its last message goes, its head hidden by the
stream's ``first_seq``.
"""

from __future__ import annotations

import os
import sqlite3
import zlib
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate
from operator import itemgetter

from meshbus.protocol.blocks import BlockSlice, decode_block, encode_block
from meshbus.storage.errors import StoreError
from meshbus.storage.store import NewMessage

SCHEMA_VERSION = 5
# Version 4 had no owners; it is upgraded in place at open (every stream and consumer of
# it is nobody's).
OWNERLESS_VERSION = 4
ADD_OWNERS = (
    "ALTER TABLE streams ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE consumers ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
)
SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS streams (
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE, captures BLOB NOT NULL,
    max_msgs INTEGER NOT NULL, max_bytes INTEGER NOT NULL, max_age REAL NOT NULL,
    dedupe_window REAL NOT NULL,
    first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, bytes INTEGER NOT NULL,
    owner TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS blocks (
    key INTEGER PRIMARY KEY, last_seq INTEGER NOT NULL, stored_at REAL NOT NULL,
    crc INTEGER NOT NULL, messages BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS consumers (
    id INTEGER PRIMARY KEY, stream_id INTEGER NOT NULL, name TEXT NOT NULL,
    ack_wait REAL NOT NULL, max_deliver INTEGER NOT NULL, start_seq INTEGER NOT NULL,
    next_seq INTEGER NOT NULL, dropped INTEGER NOT NULL, owner TEXT NOT NULL DEFAULT '',
    UNIQUE (stream_id, name));
CREATE TABLE IF NOT EXISTS pending (
    consumer_id INTEGER NOT NULL, seq INTEGER NOT NULL, delivery INTEGER NOT NULL,
    deadline REAL NOT NULL, PRIMARY KEY (consumer_id, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS raft_applied (
    stream_id INTEGER PRIMARY KEY, raft_index INTEGER NOT NULL);
"""
# raft_applied: a replicated stream's last Raft entry applied, written in the transaction
# that applies it, so a restart applies each entry once (meshbus.broker.replication).
# Created where missing at every open: a store without it has no replicated stream.


def schema_statements() -> Iterator[str]:
    """``SCHEMA`` a statement at a time, for a caller inside a transaction (the store
    at open) or one making a fresh file (salvage): ``executescript`` would commit first."""
    return filter(None, (part.strip() for part in SCHEMA.split(";")))


# A block holds at most this many messages or payload bytes (but always one message):
# reading one message decodes its whole block, and a columnar fetch sends whole blocks,
# which must fit in a frame (1 MiB by default).
BLOCK_MESSAGES = 4096
BLOCK_BYTES = 256 * 1024

# The statements that both the store and salvage write blocks and counters with.
INSERT_BLOCK = "INSERT INTO blocks VALUES (?, ?, ?, ?, ?)"
UPDATE_COUNTERS = "UPDATE streams SET first_seq = ?, last_seq = ?, bytes = ? WHERE id = ?"
PUT_PENDING = "INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?)"
# The blocks holding seqs from ?2 to ?3 of a stream whose keys start at ?1: the last
# block starting at or before ?2, and the ones after it.
_BLOCKS_FROM = (
    " FROM blocks WHERE key >= coalesce("
    "(SELECT max(key) FROM blocks WHERE key >= ?1 AND key <= ?2), ?1) AND key <= ?3 ORDER BY key"
)
SELECT_BLOCKS = "SELECT key, stored_at, last_seq" + _BLOCKS_FROM
_SELECT_BLOCKS_DATA = "SELECT key, stored_at, last_seq, crc, messages" + _BLOCKS_FROM

# (first seq, last seq, stored_at, CRC32, encoded bytes): a row of ``blocks`` with its
# stream's seqs for its key, as salvage carries blocks from one store to another.
BlockRow = tuple[int, int, float, int, bytes]


def block_key(stream_id: int, seq: int) -> int:
    """The key of the block of stream ``stream_id`` whose first message is ``seq``."""
    return stream_id << SEQ_BITS | seq


_payload_of = itemgetter(2)  # NewMessage.payload


def split_batch(first: int, messages: list[NewMessage]) -> Iterator[tuple[int, list[NewMessage]]]:
    """(first seq, messages) of the blocks a batch is stored in: as many messages as fit
    in ``BLOCK_BYTES`` of payload (at least one), at most ``BLOCK_MESSAGES``."""
    # Running sums and bisection, in C: a loop per message here was a third of the
    # append time of a Spark write's 4096-row batches (BENCHMARKS.md, "Spark writes").
    ends = list(accumulate(map(len, map(_payload_of, messages))))
    if len(messages) <= BLOCK_MESSAGES and (not ends or ends[-1] <= BLOCK_BYTES):
        yield first, messages  # the usual batch: one block
        return
    start = held = 0  # held: payload bytes of the messages before ``start``
    while start < len(messages):
        stop = max(start + 1, bisect_right(ends, held + BLOCK_BYTES, lo=start))
        stop = min(stop, start + BLOCK_MESSAGES)
        yield first + start, messages[start:stop]
        start, held = stop, ends[stop - 1]


def encode_messages(messages: Sequence[NewMessage]) -> bytes:
    """One block of ``messages``, as stored."""
    # A column at a time, not zip(*messages): that makes an iterator per message, and
    # in the broker the garbage collector then cost 12% of append throughput.
    return encode_block(*[list(map(get, messages)) for get in _FIELDS])


_FIELDS = [itemgetter(i) for i in range(len(NewMessage._fields))]


def block_keys(
    db: sqlite3.Connection, sid: int, first: int, last: int
) -> list[tuple[int, float, int]]:
    """(key, stored_at, last seq) of the blocks of stream ``sid`` holding ``first..last``."""
    return db.execute(
        SELECT_BLOCKS, (block_key(sid, 0), block_key(sid, first), block_key(sid, last))
    ).fetchall()


def block_data(db: sqlite3.Connection, key: int) -> tuple[int, bytes]:
    """(CRC32, encoded bytes) of the block ``key``, unchecked."""
    crc, data = db.execute("SELECT crc, messages FROM blocks WHERE key = ?", (key,)).fetchone()
    return crc, data


def read_slices(
    db: sqlite3.Connection,
    sid: int,
    first_seq: int,
    last_seq: int,
    from_seq: int,
    max_count: int,
    max_bytes: int,
    where: tuple[str, str],
) -> list[BlockSlice]:
    """``read_blocks`` of the store and of its reader: the stored blocks as they are, no
    decoding, but for a first block bigger than ``max_bytes``, cut down to the messages
    that fit (at least one). A block's encoded size bounds its payload bytes, so it
    stands in for them here. ``where`` is (file, stream) for ``BlockDamaged``."""
    start = max(from_seq, first_seq)
    if max_count <= 0 or start > last_seq:
        return []
    last = min(last_seq, start + max_count - 1)
    out: list[BlockSlice] = []
    room = max_bytes or None
    cursor = db.execute(
        _SELECT_BLOCKS_DATA, (block_key(sid, 0), block_key(sid, start), block_key(sid, last))
    )
    try:
        for key, at, block_last, crc, data in cursor:
            check_block(*where, key, block_last, crc, data)
            block_first = key & SEQ_MASK
            begin, end = max(start - block_first, 0), min(last, block_last) - block_first + 1
            if room is not None and len(data) > room:
                if not out:
                    out.append(_cut_to_fit(block_first, at, data, begin, end, room))
                break
            out.append(BlockSlice(block_first, at, begin, end, data))
            if room is not None:
                room -= len(data)
    finally:
        cursor.close()  # a loop that stops early must not leave the statement open
    return out


def _cut_to_fit(first: int, at: float, data: bytes, begin: int, end: int, room: int) -> BlockSlice:
    """Messages ``begin..`` of a block, as many as ``room`` payload bytes allow (at
    least one), encoded as a block of their own."""
    block = decode_block(data)
    sizes = accumulate(block.payload_sizes()[begin:end])
    take = max(1, bisect_right(list(sizes), room))
    return BlockSlice(first + begin, at, 0, take, encode_block(*block.columns(begin, begin + take)))


# zlib's CRC32 finds every burst of flipped bits up to 32 long and all but one in 2**32 of
# the others: damage from a disk, a file system or a stray write, not an attacker's edit
# (who can recompute it). It is in the standard library and runs at GB/s.
block_crc = zlib.crc32


class BlockDamaged(StoreError):
    """A block's bytes do not match their CRC32: none of its messages is served."""

    def __init__(self, path: str, stream: str, first: int, last: int) -> None:
        self.problem = (
            f"the block of messages {first}..{last} of stream {stream!r} is damaged "
            "(its CRC32 does not match its bytes)"
        )
        data_dir = os.path.dirname(os.path.abspath(path))
        super().__init__(
            f"{path}: {self.problem}, so none of them is served; stop the broker and run "
            f"`meshbus stream salvage --data-dir {data_dir} --out NEW_DIR` to copy every "
            "intact block to a new store"
        )


def check_block(path: str, stream: str, key: int, last: int, crc: int, data: bytes) -> None:
    """Raise ``BlockDamaged`` if the block ``key`` of ``stream`` in the file ``path``
    (seqs up to ``last``) does not match its stored CRC32."""
    if block_crc(data) != crc:
        raise BlockDamaged(path, stream, key & SEQ_MASK, last)
