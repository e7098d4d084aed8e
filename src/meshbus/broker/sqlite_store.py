"""The durable stream store: SQLite in WAL mode, one transaction per append batch.

Durability is the ``fsync`` policy. "normal" (synchronous=NORMAL) does not fsync on
commit: the commit is in the WAL file in the OS page cache, so it survives the
broker being killed (kill -9, OOM killer, a crash) but the last commits can be lost
in an OS crash or power cut; fsync happens only at checkpoints. "always"
(synchronous=FULL) fsyncs the WAL on every commit, so an acknowledged publish
survives power loss too, at the price of one fsync per batch. Batching is what
makes "always" affordable: the broker's group commit pays one fsync for every
publish of an event-loop turn.

On disk is everything needed to carry on after a crash: stream configs and
counters, messages, publish ids with their seq and time, consumers with their
position and drop count, and every pending delivery with its count and deadline.
In memory is the mirror from ``store.MirroredStore`` (counters, live publish ids,
pending deliveries), loaded from the database at open, so the hot paths ask
SQLite nothing: an append is one INSERT of a block plus an UPDATE of the stream's
counters. Message bodies are read from disk only. If a transaction fails, it is
rolled back and the mirror is reloaded, so the database stays the truth.

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

Not safe for two stores writing one file at a time (each trusts its own mirror):
the broker must hold a lock on its data directory.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
import time
import zlib
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from operator import itemgetter
from typing import NamedTuple

import msgspec

from meshbus.broker.store import (
    ADDRESS_LEN,
    Appended,
    ConsumerConfig,
    ConsumerInfo,
    ConsumerState,
    Delivery,
    MirroredStore,
    NewMessage,
    StoreDamaged,
    StoredMessage,
    StoreError,
    StreamConfig,
    StreamNotFound,
    StreamState,
    StreamStatus,
    fit_bytes,
)
from meshbus.protocol.blocks import Block, BlockSlice, decode_block, encode_block

log = logging.getLogger("meshbus.broker")

SCHEMA_VERSION = 4
SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1
_SYNCHRONOUS = {"normal": "NORMAL", "always": "FULL"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS streams (
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE, captures BLOB NOT NULL,
    max_msgs INTEGER NOT NULL, max_bytes INTEGER NOT NULL, max_age REAL NOT NULL,
    dedupe_window REAL NOT NULL,
    first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    key INTEGER PRIMARY KEY, last_seq INTEGER NOT NULL, stored_at REAL NOT NULL,
    crc INTEGER NOT NULL, messages BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS consumers (
    id INTEGER PRIMARY KEY, stream_id INTEGER NOT NULL, name TEXT NOT NULL,
    ack_wait REAL NOT NULL, max_deliver INTEGER NOT NULL, start_seq INTEGER NOT NULL,
    next_seq INTEGER NOT NULL, dropped INTEGER NOT NULL, UNIQUE (stream_id, name));
CREATE TABLE IF NOT EXISTS pending (
    consumer_id INTEGER NOT NULL, seq INTEGER NOT NULL, delivery INTEGER NOT NULL,
    deadline REAL NOT NULL, PRIMARY KEY (consumer_id, seq)) WITHOUT ROWID;
"""

# A block holds at most this many messages or payload bytes (but always one message):
# reading one message decodes its whole block, and a columnar fetch sends whole blocks,
# which must fit in a frame (1 MiB by default).
BLOCK_MESSAGES = 4096
BLOCK_BYTES = 256 * 1024
_INSERT_BLOCK = "INSERT INTO blocks VALUES (?, ?, ?, ?, ?)"
# The blocks holding seqs from ?2 to ?3 of a stream whose keys start at ?1: the last
# block starting at or before ?2, and the ones after it.
_BLOCKS_FROM = (
    " FROM blocks WHERE key >= coalesce("
    "(SELECT max(key) FROM blocks WHERE key >= ?1 AND key <= ?2), ?1) AND key <= ?3 ORDER BY key"
)
_SELECT_BLOCKS = "SELECT key, stored_at, last_seq" + _BLOCKS_FROM
_SELECT_BLOCKS_DATA = "SELECT key, stored_at, last_seq, crc, messages" + _BLOCKS_FROM
# Blocks decoded lately, by key (a block never changes; it is only deleted): a reader
# going through a stream page by page decodes each block once, not once per page.
_DECODED_BLOCKS = 16
_UPDATE_COUNTERS = "UPDATE streams SET first_seq = ?, last_seq = ?, bytes = ? WHERE id = ?"
_PUT_PENDING = "INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?)"
_DELETE_PENDING = "DELETE FROM pending WHERE consumer_id = ? AND seq = ?"
# At open, the CRC32 of the newest blocks of every stream is checked, this many bytes of
# them in all (at least the newest block of each stream): the blocks a crash can have
# left half-written, and what consumers read next. Older blocks are checked when read.
VERIFY_BYTES = 64 * 1024 * 1024
# A deleted stream's blocks go in slices of one transaction each, StreamHost running one
# per turn of the event loop; a slice's row count adapts to take about PURGE_SECONDS
# (a 256 KiB block takes 0.1 ms, a small one far less).
PURGE_ROWS = 64
PURGE_SECONDS = 0.01
# The WAL is cut back to this size after a checkpoint (it would stay at its peak).
_WAL_LIMIT = 64 * 1024 * 1024


def _key(stream_id: int, seq: int) -> int:
    return stream_id << SEQ_BITS | seq


class SqliteStreamStore(MirroredStore):
    def __init__(self, path: str | os.PathLike[str], fsync: str = "normal") -> None:
        if fsync not in _SYNCHRONOUS:
            raise ValueError(f"fsync must be 'normal' or 'always', not {fsync!r}")
        super().__init__()
        self.path = os.fspath(path)
        self._purge: list[int] = []  # ids of deleted streams whose blocks are still there
        self._purge_rows = PURGE_ROWS
        # Before SQLite opens the file: once it has, a damaged WAL is cut short for good.
        problem = check_files(self.path)
        if problem:
            raise _damaged(self.path, problem)
        # Autocommit mode (isolation_level=None): transactions are the explicit ones in _tx.
        # check_same_thread=False lets the broker move the store to a worker thread (for
        # fsync="always"), as long as one thread at a time uses it.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._open(_SYNCHRONOUS[fsync])
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise _damaged(self.path, f"SQLite cannot read it ({exc})") from None
        except BlockDamaged as exc:
            self._db.close()
            raise _damaged(self.path, exc.problem) from None
        except BaseException:
            self._db.close()
            raise

    def _open(self, synchronous: str) -> None:
        db = self._db
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(
                f"{self.path}: SQLite could not switch to WAL mode (got {mode!r}); "
                "put the stream store on a local file system"
            )
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute(f"PRAGMA journal_size_limit={_WAL_LIMIT}")
        # Debian's and others' SQLite zero every freed page, which writes a deleted
        # stream's whole size to the WAL: FAST zeroes only what costs no extra writes.
        db.execute("PRAGMA secure_delete=FAST")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise StoreError(
                f"{self.path}: stream store schema version {version} is not {SCHEMA_VERSION}; "
                "it was written by another meshbus version (version 4 added a checksum to "
                "every block); `meshbus stream salvage --data-dir "
                f"{os.path.dirname(os.path.abspath(self.path))} --out NEW_DIR` copies a "
                "version 3 store into a new one, or move it aside to start with an empty store"
            )
        if version:
            # integrity_check, not quick_check: the same pass over the b-trees (its cost
            # grows with the file: 50 ms for 200 MB in the page cache) plus the check that
            # the two small UNIQUE indexes match their tables.
            problems = [row[0] for row in db.execute("PRAGMA integrity_check(5)")]
            if problems != ["ok"]:
                raise _damaged(self.path, "SQLite's integrity check failed: " + "; ".join(problems))
        with self._tx():
            for statement in filter(None, (part.strip() for part in _SCHEMA.split(";"))):
                db.execute(statement)  # not executescript: that commits first
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._load()
        self._verify_newest()
        self._find_orphans()

    def _verify_newest(self) -> None:
        """Check the CRC32 of each stream's newest blocks, ``VERIFY_BYTES`` in all."""
        streams = list(self._streams.values())
        share = VERIFY_BYTES // max(1, len(streams))
        for st in streams:
            left = share
            for key, last, crc, data in self._db.execute(
                "SELECT key, last_seq, crc, messages FROM blocks WHERE key >= ? AND key <= ?"
                " ORDER BY key DESC",
                (_key(st.key, 0), _key(st.key, SEQ_MASK)),
            ):
                if last < st.first_seq:
                    break
                _check_block(self.path, st.config.name, key, last, crc, data)
                left -= len(data)
                if left <= 0:
                    break

    def _find_orphans(self) -> None:
        """Blocks of streams deleted before a restart finished purging them."""
        live = {st.key for st in self._streams.values()}
        key = -1
        while row := self._db.execute(
            "SELECT key FROM blocks WHERE key > ? ORDER BY key LIMIT 1", (key,)
        ).fetchone():
            sid = row[0] >> SEQ_BITS
            if sid not in live:
                self._purge.append(sid)
            key = _key(sid, SEQ_MASK)

    def _load(self) -> None:
        """(Re)build the mirror from the database, the truth."""
        db = self._db
        self._streams = {}
        self._decoded: dict[int, Block] = {}
        by_id: dict[int, StreamState] = {}
        for row in db.execute(
            "SELECT id, name, captures, max_msgs, max_bytes, max_age, dedupe_window,"
            " first_seq, last_seq, bytes FROM streams"
        ):
            sid, name, caps, max_msgs, max_bytes, max_age, window, first, last, size = row
            captures = tuple(caps[i : i + ADDRESS_LEN] for i in range(0, len(caps), ADDRESS_LEN))
            config = StreamConfig(name, captures, max_msgs, max_bytes, max_age, window)
            st = StreamState(config, first, last, size, key=sid)
            if st.count:
                st.first_at = _block_keys(db, sid, first, first)[0][1]  # no decoding
            self._load_publish_ids(st)
            self._streams[name] = by_id[sid] = st
        by_cid: dict[int, ConsumerState] = {}
        for cid, sid, name, ack_wait, max_deliver, start, next_seq, dropped in db.execute(
            "SELECT id, stream_id, name, ack_wait, max_deliver, start_seq, next_seq, dropped"
            " FROM consumers"
        ):
            cs = ConsumerState(
                ConsumerConfig(name, ack_wait, max_deliver, start), next_seq, dropped
            )
            cs.key = cid
            by_id[sid].consumers[name] = by_cid[cid] = cs
        for cid, seq, count, deadline in db.execute(
            "SELECT consumer_id, seq, delivery, deadline FROM pending ORDER BY consumer_id, seq"
        ):
            cs = by_cid[cid]
            cs.pending[seq] = (count, deadline)
            cs.earliest = min(cs.earliest, deadline)

    def _load_publish_ids(self, st: StreamState) -> None:
        """The publish ids of the blocks within the dedupe window of the newest one (the
        store has no clock: the caller's ``now`` decides which of these are still alive)."""
        window = st.config.dedupe_window
        if window <= 0:
            return
        young: list[tuple[int, float, bytes]] = []
        for key, at, last, crc, block in self._db.execute(
            "SELECT key, stored_at, last_seq, crc, messages FROM blocks"
            " WHERE key >= ? AND key <= ? ORDER BY key DESC",
            (_key(st.key, 0), _key(st.key, SEQ_MASK)),
        ):
            if young and at < young[0][1] - window:
                break
            _check_block(self.path, st.config.name, key, last, crc, block)
            young.append((key, at, block))
        for key, at, block in reversed(young):
            first = key & SEQ_MASK
            ids = decode_block(block).publish_id_list()  # no payload is copied at open
            fresh = {
                publish_id: seq
                for seq, publish_id in enumerate(ids, first)
                if publish_id and seq >= st.first_seq
            }
            if fresh:
                st.ids.remember(fresh, at)

    def _blocks(self, st: StreamState, first: int, last: int) -> Iterator[tuple[int, float, Block]]:
        """(first seq, stored_at, block) of the blocks that hold ``first..last``, each
        decoded once while it stays among the last ``_DECODED_BLOCKS``."""
        for key, at, block_last in _block_keys(self._db, st.key, first, last):
            yield key & SEQ_MASK, at, self._block(st, key, block_last)

    def _block(self, st: StreamState, key: int, last: int) -> Block:
        decoded = self._decoded
        block = decoded.get(key)
        if block is None:
            crc, data = _block_data(self._db, key)
            _check_block(self.path, st.config.name, key, last, crc, data)
            block = decoded[key] = decode_block(data)
            if len(decoded) > _DECODED_BLOCKS:
                del decoded[next(iter(decoded))]
        return block

    def _sizes(self, st: StreamState, first: int) -> Iterator[tuple[int, float, int]]:
        """(seq, stored_at, payload size) from ``first`` on, for retention. A damaged
        block's sizes are unknown: each of its messages counts as an even share of its
        bytes, so retention removes it (its messages are lost anyway) instead of failing
        every append to the stream from then on."""
        for key, at, block_last in _block_keys(self._db, st.key, first, st.last_seq):
            block_first = key & SEQ_MASK
            try:
                sizes = self._block(st, key, block_last).payload_sizes()
            except BlockDamaged as exc:
                log.error("retention meets a damaged block", extra={"error": str(exc)})
                count = block_last - block_first + 1
                sizes = [len(_block_data(self._db, key)[1]) // count] * count
            for seq, size in enumerate(sizes, block_first):
                if seq >= first:
                    yield seq, at, size

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction; on any failure roll back and reload the mirror, which the
        caller may already have changed."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            self._load()
            if isinstance(exc, sqlite3.Error):
                # A full disk, a broken file: the caller's StoreError, with what SQLite said.
                raise StoreError(f"stream storage failed: {exc}") from exc
            raise

    # -- streams ------------------------------------------------------------------

    def add_stream(self, config: StreamConfig) -> StreamStatus:
        existing = self._existing_stream(config)
        if existing is not None:
            return existing
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO streams VALUES (NULL, ?, ?, ?, ?, ?, ?, 1, 0, 0)",
                (config.name, b"".join(config.captures), config.max_msgs, config.max_bytes,
                 config.max_age, config.dedupe_window),
            )  # fmt: skip
            sid = cur.lastrowid
            if sid is None or sid >= 1 << (63 - SEQ_BITS):  # cannot pack into a message key
                raise StoreError(f"{self.path}: no stream id left for {config.name!r}")
            self._streams[config.name] = StreamState(config, key=sid)
        return self.info(config.name)

    def delete_stream(self, name: str) -> None:
        """The stream goes at once; its blocks in slices, by ``purge`` (ids are never
        reused, so a new stream of the same name does not see them)."""
        st = self._stream(name)
        sid = st.key
        self._decoded.clear()
        with self._tx() as db:
            db.execute(
                "DELETE FROM pending WHERE consumer_id IN"
                " (SELECT id FROM consumers WHERE stream_id = ?)",
                (sid,),
            )
            db.execute("DELETE FROM consumers WHERE stream_id = ?", (sid,))
            db.execute("DELETE FROM streams WHERE id = ?", (sid,))
            del self._streams[name]
        self._purge.append(sid)

    @property
    def purging(self) -> bool:
        """Blocks of deleted streams are left for ``purge``."""
        return bool(self._purge)

    def purge(self, max_rows: int = 0) -> bool:
        """Delete up to ``max_rows`` blocks of deleted streams, in one transaction; True
        while some are left. The pages they free are reused by later appends (the file
        does not shrink), and the WAL is cut back to ``_WAL_LIMIT`` after checkpoints,
        so a delete never grows the data dir."""
        if not self._purge:
            return False
        sid = self._purge[0]
        rows = max_rows or self._purge_rows
        started = time.perf_counter()
        with self._tx() as db:
            gone = db.execute(
                "DELETE FROM blocks WHERE key IN (SELECT key FROM blocks"
                " WHERE key >= ? AND key <= ? ORDER BY key LIMIT ?)",
                (_key(sid, 0), _key(sid, SEQ_MASK), rows),
            ).rowcount
        took = time.perf_counter() - started
        if took < PURGE_SECONDS / 2:
            self._purge_rows = min(self._purge_rows * 2, 16384)
        elif took > PURGE_SECONDS:
            self._purge_rows = max(self._purge_rows // 2, 1)
        if gone < rows:
            self._purge.pop(0)
        return bool(self._purge)

    def append_batch(self, name: str, messages: Sequence[NewMessage], now: float) -> list[Appended]:
        st = self._stream(name)
        sid = st.key
        with self._tx() as db:
            first = st.last_seq + 1
            results, stored = self._append(st, messages, now)
            if stored:
                rows = []
                for seq, block in _split(first, stored):
                    data = _encode(block)
                    rows.append((_key(sid, seq), seq + len(block) - 1, now, _crc(data), data))
                db.executemany(_INSERT_BLOCK, rows)
                self._trim(db, st, now)
                db.execute(_UPDATE_COUNTERS, (st.first_seq, st.last_seq, st.bytes, sid))
        return results

    def _trim(self, db: sqlite3.Connection, st: StreamState, now: float) -> int:
        """Apply retention inside the caller's transaction; returns messages removed."""
        if not self._needs_cut(st, now):
            return 0
        sid, old_first = st.key, st.first_seq
        self._cut(st, now, self._sizes(st, old_first))
        db.execute(
            "DELETE FROM blocks WHERE key >= ? AND key < ? AND last_seq < ?",
            (_key(sid, 0), _key(sid, st.first_seq), st.first_seq),
        )
        db.executemany(
            "DELETE FROM pending WHERE consumer_id = ? AND seq < ?",
            [(cs.key, st.first_seq) for cs in st.consumers.values()],
        )
        return st.first_seq - old_first

    def read(
        self, name: str, from_seq: int, max_count: int, max_bytes: int = 0
    ) -> list[StoredMessage]:
        st = self._stream(name)
        start = max(from_seq, st.first_seq)
        if max_count <= 0 or start > st.last_seq:
            return []
        return fit_bytes(self._select(st, start, st.last_seq, max_count), max_bytes)

    def read_blocks(
        self, name: str, from_seq: int, max_count: int, max_bytes: int = 0
    ) -> list[BlockSlice]:
        st = self._stream(name)
        return _slices(
            self._db, st.key, st.first_seq, st.last_seq, from_seq, max_count, max_bytes,
            (self.path, name),
        )  # fmt: skip

    def _select(
        self, st: StreamState, first: int, last: int, limit: int
    ) -> Iterator[StoredMessage]:
        name = st.config.name
        last = min(last, first + limit - 1)
        for block_first, at, block in self._blocks(st, first, last):
            start = max(first - block_first, 0)
            end = min(last - block_first + 1, len(block))
            src, dst, payload, group, priority, _ = block.columns(start, end)
            fields = zip(src, dst, group, priority, payload, strict=True)
            for seq, message in enumerate(fields, block_first + start):
                yield StoredMessage(name, seq, at, *message)

    def expire(self, now: float) -> int:
        removed = 0
        with self._tx() as db:
            for st in self._streams.values():
                st.ids.expire(now)
                trimmed = self._trim(db, st, now)
                if trimmed:
                    db.execute(_UPDATE_COUNTERS, (st.first_seq, st.last_seq, st.bytes, st.key))
                removed += trimmed
        return removed

    # -- consumers ----------------------------------------------------------------

    def add_consumer(self, stream: str, config: ConsumerConfig) -> ConsumerInfo:
        existing = self._existing_consumer(stream, config)
        if existing is not None:
            return existing
        st = self._stream(stream)
        cs = self._new_consumer(st, config)
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO consumers VALUES (NULL, ?, ?, ?, ?, ?, ?, 0)",
                (st.key, config.name, config.ack_wait, config.max_deliver, config.start_seq,
                 cs.next_seq),
            )  # fmt: skip
            assert cur.lastrowid is not None
            cs.key = cur.lastrowid
            st.consumers[config.name] = cs
        return self.consumer_info(stream, config.name)

    def delete_consumer(self, stream: str, name: str) -> None:
        st, cs = self._consumer(stream, name)
        with self._tx() as db:
            db.execute("DELETE FROM pending WHERE consumer_id = ?", (cs.key,))
            db.execute("DELETE FROM consumers WHERE id = ?", (cs.key,))
            del st.consumers[name]

    def consumer_next(self, stream: str, name: str, max_count: int, now: float) -> list[Delivery]:
        st, cs = self._consumer(stream, name)
        with self._tx() as db:
            plan = self._plan_next(st, cs, max_count, now)
            if plan.given_up:
                db.executemany(_DELETE_PENDING, [(cs.key, seq) for seq in plan.given_up])
            deadline = plan.deadline
            db.executemany(
                _PUT_PENDING,
                [(cs.key, seq, count, deadline) for seq, count in plan.redeliver]
                + [(cs.key, seq, 1, deadline) for seq in plan.new],
            )
            if plan.given_up or plan.new:
                db.execute(
                    "UPDATE consumers SET next_seq = ?, dropped = ? WHERE id = ?",
                    (cs.next_seq, cs.dropped, cs.key),
                )
        out = [
            Delivery(msg, count)
            for (_, count), msg in zip(
                plan.redeliver, self._bodies(st, plan.redeliver), strict=True
            )
        ]
        if plan.new:
            out += [
                Delivery(msg, 1)
                for msg in self._select(st, plan.new[0], plan.new[-1], len(plan.new))
            ]
        return out

    def _bodies(self, st: StreamState, seqs: list[tuple[int, int]]) -> list[StoredMessage]:
        """Redelivered messages: usually a run of neighbours, so fetch the span at once."""
        if not seqs:
            return []
        first, last = seqs[0][0], seqs[-1][0]
        if last - first < 4 * len(seqs):
            by_seq = {m.seq: m for m in self._select(st, first, last, last - first + 1)}
            return [by_seq[seq] for seq, _ in seqs]
        return [next(self._select(st, seq, seq, 1)) for seq, _ in seqs]

    def consumer_ack(self, stream: str, name: str, seqs: Sequence[int]) -> int:
        _, cs = self._consumer(stream, name)
        with self._tx() as db:
            acked = self._ack(cs, seqs)
            if acked:
                db.executemany(_DELETE_PENDING, [(cs.key, seq) for seq in acked])
        return len(acked)

    def close(self) -> None:
        self._db.close()


def _split(first: int, messages: list[NewMessage]) -> Iterator[tuple[int, list[NewMessage]]]:
    """(first seq, messages) of the blocks a batch is stored in."""
    if len(messages) <= BLOCK_MESSAGES and sum(len(m.payload) for m in messages) <= BLOCK_BYTES:
        yield first, messages  # the usual batch: one block
        return
    start = size = 0
    for i, m in enumerate(messages):
        if i > start and (i - start == BLOCK_MESSAGES or size + len(m.payload) > BLOCK_BYTES):
            yield first + start, messages[start:i]
            start, size = i, 0
        size += len(m.payload)
    yield first + start, messages[start:]


class SqliteStreamReader:
    """Read-only access to a broker's stream store, from another process on the same
    host: the Spark source's local reads (docs/spark.md). In WAL mode it reads while
    the broker writes, one consistent snapshot per call, committed data only; the
    broker's counters in the ``streams`` table say what exists."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        uri = f"file:{self._path}?mode=ro"
        self._db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)

    def read_blocks(self, name: str, from_seq: int, max_count: int) -> list[BlockSlice]:
        db = self._db
        db.execute("BEGIN")  # one snapshot: the counters and the blocks they describe
        try:
            row = db.execute(
                "SELECT id, first_seq, last_seq FROM streams WHERE name = ?", (name,)
            ).fetchone()
            if row is None:
                raise StreamNotFound(name)
            sid, first_seq, last_seq = row
            where = (self._path, name)
            return _slices(db, sid, first_seq, last_seq, from_seq, max_count, 0, where)
        except sqlite3.Error as exc:
            raise StoreError(f"reading stream {name!r} from the store failed: {exc}") from exc
        finally:
            db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()


def _encode(messages: Sequence[NewMessage]) -> bytes:
    # A column at a time, not zip(*messages): that makes an iterator per message, and
    # in the broker the garbage collector then cost 12% of append throughput.
    return encode_block(*[list(map(get, messages)) for get in _FIELDS])


_FIELDS = [itemgetter(i) for i in range(len(NewMessage._fields))]


def _block_keys(
    db: sqlite3.Connection, sid: int, first: int, last: int
) -> list[tuple[int, float, int]]:
    """(key, stored_at, last seq) of the blocks of stream ``sid`` holding ``first..last``."""
    return db.execute(_SELECT_BLOCKS, (_key(sid, 0), _key(sid, first), _key(sid, last))).fetchall()


def _block_data(db: sqlite3.Connection, key: int) -> tuple[int, bytes]:
    crc, data = db.execute("SELECT crc, messages FROM blocks WHERE key = ?", (key,)).fetchone()
    return crc, data


def _slices(
    db: sqlite3.Connection,
    sid: int,
    first_seq: int,
    last_seq: int,
    from_seq: int,
    max_count: int,
    max_bytes: int,
    where: tuple[str, str],
) -> list[BlockSlice]:
    """``read_blocks``: the stored blocks as they are, no decoding, but for a first block
    bigger than ``max_bytes``, cut down to the messages that fit (at least one). A
    block's encoded size bounds its payload bytes, so it stands in for them here."""
    start = max(from_seq, first_seq)
    if max_count <= 0 or start > last_seq:
        return []
    last = min(last_seq, start + max_count - 1)
    out: list[BlockSlice] = []
    room = max_bytes or None
    cursor = db.execute(_SELECT_BLOCKS_DATA, (_key(sid, 0), _key(sid, start), _key(sid, last)))
    try:
        for key, at, block_last, crc, data in cursor:
            _check_block(*where, key, block_last, crc, data)
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


# -- damage ------------------------------------------------------------------------------

# zlib's CRC32 finds every burst of flipped bits up to 32 long and all but one in 2**32 of
# the others: damage from a disk, a file system or a stray write, not an attacker's edit
# (who can recompute it). It is in the standard library and runs at GB/s.
_crc = zlib.crc32


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


def _check_block(path: str, stream: str, key: int, last: int, crc: int, data: bytes) -> None:
    if _crc(data) != crc:
        raise BlockDamaged(path, stream, key & SEQ_MASK, last)


def _damaged(path: str, problem: str) -> StoreDamaged:
    return StoreDamaged(damaged(path, problem), problem)


def damaged(path: str, problem: str) -> str:
    """The message of ``StoreDamaged``: the file, what is wrong, how to recover."""
    data_dir = os.path.dirname(os.path.abspath(path))
    return (
        f"the stream store {path} is damaged: {problem}. The broker does not start on it "
        f"and has changed nothing. To recover, stop every broker using {data_dir}, then run "
        f"`meshbus stream salvage --data-dir {data_dir} --out NEW_DIR` (it copies every "
        "intact block to a new store and reports what is lost) and start the broker with "
        "--data-dir NEW_DIR; or restore the directory from a backup"
    )


_MAGIC = b"SQLite format 3\x00"
_WAL_MAGIC = (0x377F0682, 0x377F0683)  # checksums of little-, big-endian words


def check_files(path: str) -> str:
    """What is wrong with the database file and its WAL, found without SQLite ("": nothing
    found). SQLite opening a truncated file fails late and vaguely, and one opening a
    damaged WAL drops it and every commit after it without a word."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return ""
    wal = check_wal(path + "-wal")
    if wal:
        return wal
    if size == 0:
        return ""
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(_MAGIC):
        return "its first bytes are not an SQLite header (overwritten?)"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    valid = header[24:28] == header[92:96]  # else the page count is from an older SQLite
    has_wal = os.path.exists(path + "-wal") and os.path.getsize(path + "-wal") > 32
    if valid and not has_wal and size < pages * page_size:
        return (
            f"it is {size} bytes, but its header says {pages} pages of {page_size} bytes "
            f"({pages * page_size} bytes): it was cut short"
        )
    return ""


def check_wal(wal: str) -> str:
    """Where SQLite would stop reading the WAL ``wal`` before its last commit ("" if it
    would not): what a crash leaves (a torn last transaction) is not damage; a commit
    after a frame that fails its checksum is."""
    try:
        with open(wal, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return ""
    if len(data) <= 32:
        return ""
    magic, _, page_size, _, salt1, salt2, c1, c2 = struct.unpack_from(">8I", data)
    big = magic == _WAL_MAGIC[1]
    if magic not in _WAL_MAGIC or _wal_sum(data[:24], 0, 0, big) != (c1, c2):
        return (
            f"its write-ahead log {wal} has a damaged header, so SQLite would drop all of it "
            f"({len(data)} bytes: every commit since the last checkpoint)"
        )
    frame = 24 + page_size
    frames = (len(data) - 32) // frame
    sums = (c1, c2)
    for i in range(frames):
        at = 32 + i * frame
        _, _, s1, s2, f1, f2 = struct.unpack_from(">6I", data, at)
        if (s1, s2) != (salt1, salt2):
            return ""  # the end of this generation of the log: older frames follow
        sums = _wal_sum(data[at : at + 8], *sums, big)
        sums = _wal_sum(data[at + 24 : at + frame], *sums, big)
        if sums != (f1, f2):
            heads = [struct.unpack_from(">4I", data, 32 + j * frame) for j in range(i, frames)]
            lost = [h for h in heads if h[1] and h[2:] == (salt1, salt2)]  # commit frames
            if not lost:
                return ""  # only an uncommitted tail: what a crash in a commit leaves
            return (
                f"its write-ahead log {wal} is damaged at frame {i + 1} of {frames} (its "
                f"checksum does not match): SQLite would drop that frame and the "
                f"{frames - i - 1} after it, {len(lost)} committed transactions since the "
                f"last checkpoint ({(frames - i) * page_size} bytes of pages); moving the WAL "
                "aside (keep a copy) starts the store as it was at that checkpoint"
            )
    return ""


def _wal_sum(data: bytes, s0: int, s1: int, big: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (8-byte aligned), carried on from (s0, s1)."""
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    mask = 0xFFFFFFFF
    for a, b in zip(words[::2], words[1::2], strict=True):
        s0 = (s0 + a + s1) & mask
        s1 = (s1 + b + s0) & mask
    return s0, s1


# -- salvage -----------------------------------------------------------------------------


class Lost(NamedTuple):
    first: int
    last: int
    why: str


@dataclass
class StreamSalvage:
    name: str
    first_seq: int
    last_seq: int
    saved: list[tuple[str, int, int]] = field(default_factory=list)  # (stream, first, last)
    lost: list[Lost] = field(default_factory=list)
    blocks_saved: int = 0
    blocks_lost: int = 0

    @property
    def messages_lost(self) -> int:
        return sum(lost.last - lost.first + 1 for lost in self.lost)


@dataclass
class Salvage:
    """What ``salvage`` copied and what it could not."""

    source: str
    out: str
    problem: str  # what the checks at open find in the source ("": nothing)
    streams: list[StreamSalvage] = field(default_factory=list)


def salvage(source: str, out: str) -> Salvage:
    """Copy every intact block of every stream of the store ``source`` into a new store
    ``out`` (which must not exist), with the streams' configs and consumers. The source
    is not changed: SQLite reads a copy of it. A stream whose lost blocks leave a hole
    keeps its name for the newest run of seqs it kept; each older run becomes a stream of
    its own, ``NAME.FIRST-LAST``, capturing nothing (a stream has no holes)."""
    if os.path.exists(out):
        raise StoreError(f"{out} exists: salvage writes a new store")
    report = Salvage(source, out, check_files(source))
    work = out + ".source"
    os.makedirs(work, exist_ok=True)
    copy = os.path.join(work, "streams.db")
    try:
        for suffix in ("", "-wal"):
            if os.path.exists(source + suffix):
                with open(source + suffix, "rb") as src, open(copy + suffix, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        if report.problem.startswith("its first bytes are not an SQLite header"):
            report.problem += "; salvage wrote a new header on its copy"
            _new_header(copy)
        elif "it was cut short" in report.problem:
            _fit_header(copy)  # else SQLite refuses to read any page of it
        legacy = _version(copy) == 3
        if legacy:
            report.problem = (
                "it is of schema version 3, whose blocks have no checksums: each is copied "
                "if it decodes, and gets its CRC32 in the new store"
            )
        if not report.problem:
            try:
                SqliteStreamStore(copy).close()  # the checks at open, on the copy
            except StoreDamaged as exc:
                report.problem = exc.problem
        db = sqlite3.connect(copy, isolation_level=None)
        try:
            _salvage(db, out, report, legacy)
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"{source}: SQLite cannot read even its list of streams ({exc}), so nothing "
                "can be salvaged from it; restore it from a backup"
            ) from None
        finally:
            db.close()
    finally:
        for name in os.listdir(work):
            os.remove(os.path.join(work, name))
        os.rmdir(work)
    return report


def _new_header(path: str) -> None:
    """Give the file ``path`` the 100-byte header of a store of this schema, with its page
    count from its size and an empty free list (pages on the lost one are not read)."""
    size = os.path.getsize(path)
    page_size = 4096  # SQLite's default, and what every store is made with
    fresh = path + ".header"
    db = sqlite3.connect(fresh, isolation_level=None)
    try:
        db.execute(f"PRAGMA page_size={page_size}")
        db.execute("PRAGMA journal_mode=WAL")
        for statement in filter(None, (part.strip() for part in _SCHEMA.split(";"))):
            db.execute(statement)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    finally:
        db.close()
    with open(fresh, "rb") as f:
        header = bytearray(f.read(100))
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(fresh + suffix):
            os.remove(fresh + suffix)
    header[28:32] = (size // page_size).to_bytes(4, "big")
    header[32:40] = bytes(8)  # no free list
    with open(path, "r+b") as f:
        f.write(header)


def _fit_header(path: str) -> None:
    """Make the header's page count that of a file cut short (whole pages only)."""
    with open(path, "r+b") as f:
        header = f.read(100)
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = os.path.getsize(path) // page_size
        f.truncate(pages * page_size)
        f.seek(28)
        f.write(pages.to_bytes(4, "big"))


def _version(path: str) -> int:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            version: int = db.execute("PRAGMA user_version").fetchone()[0]
            return version
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return 0


def _salvage(db: sqlite3.Connection, out: str, report: Salvage, legacy: bool = False) -> None:
    streams = db.execute(
        "SELECT id, name, captures, max_msgs, max_bytes, max_age, dedupe_window,"
        " first_seq, last_seq FROM streams ORDER BY name"
    ).fetchall()
    consumers = db.execute(
        "SELECT id, stream_id, name, ack_wait, max_deliver, start_seq, next_seq, dropped"
        " FROM consumers"
    ).fetchall()
    new = SqliteStreamStore(out)
    try:
        for sid, name, caps, max_msgs, max_bytes, max_age, window, first, last in streams:
            sv = StreamSalvage(name, first, last)
            report.streams.append(sv)
            runs = _salvage_blocks(db, sid, first, last, sv, legacy)
            captures = tuple(caps[i : i + ADDRESS_LEN] for i in range(0, len(caps), ADDRESS_LEN))
            for i, (run_first, run) in enumerate(runs):
                newest = i == len(runs) - 1
                run_last = run[-1][1]
                run_name = name if newest else f"{name}.{run_first}-{run_last}"[:64]
                new.add_stream(
                    StreamConfig(
                        run_name, captures if newest else (), max_msgs, max_bytes, max_age, window
                    )
                )
                sv.saved.append((run_name, run_first, run_last))
                _put_run(new, run_name, run_first, run)
            if not runs:  # nothing kept: the stream, empty, numbering on from where it was
                new.add_stream(StreamConfig(name, captures, max_msgs, max_bytes, max_age, window))
                new._db.execute(
                    "UPDATE streams SET first_seq = ?, last_seq = ? WHERE name = ?",
                    (last + 1, last, name),
                )
            new_sid = new._stream(name).key
            for cid, c_sid, c_name, ack_wait, max_deliver, start, next_seq, dropped in consumers:
                if c_sid != sid:
                    continue
                new._db.execute(
                    "INSERT INTO consumers VALUES (NULL, ?, ?, ?, ?, ?, ?, ?)",
                    (new_sid, c_name, ack_wait, max_deliver, start, next_seq, dropped),
                )
                new_cid = new._db.execute("SELECT last_insert_rowid()").fetchone()[0]
                # Pending deliveries of seqs the stream still holds (those of older runs
                # are read from their streams: NAME.FIRST-LAST).
                pending = db.execute(
                    "SELECT seq, delivery, deadline FROM pending"
                    " WHERE consumer_id = ? AND seq >= ?",
                    (cid, runs[-1][0] if runs else last + 1),
                ).fetchall()
                new._db.executemany(
                    _PUT_PENDING, [(new_cid, seq, count, at) for seq, count, at in pending]
                )
    finally:
        new.close()


# (first seq, last seq, stored_at, crc, data) of one intact block
_Kept = tuple[int, int, float, int, bytes]


def _salvage_blocks(
    db: sqlite3.Connection, sid: int, first: int, last: int, sv: StreamSalvage, legacy: bool
) -> list[tuple[int, list[_Kept]]]:
    """The intact blocks holding ``first..last``, as runs of consecutive seqs: (the run's
    first seq, its blocks)."""
    runs: list[tuple[int, list[_Kept]]] = []
    pos = first
    joined = False  # the next intact block continues the last run

    def lose(begin: int, end: int, why: str) -> None:
        nonlocal joined
        sv.lost.append(Lost(begin, end, why))
        joined = False

    while pos <= last:
        try:
            row = db.execute(_SELECT_BLOCKS + " LIMIT 1", (
                _key(sid, 0), _key(sid, pos), _key(sid, last)
            )).fetchone()  # fmt: skip
        except sqlite3.DatabaseError:
            # The pages that lead to the next block are lost: skip ahead until SQLite
            # finds blocks again.
            step = 1
            while pos + step <= last:
                try:
                    db.execute(_SELECT_BLOCKS + " LIMIT 1", (
                        _key(sid, 0), _key(sid, pos + step), _key(sid, last)
                    )).fetchone()  # fmt: skip
                    break
                except sqlite3.DatabaseError:
                    step *= 2
            end = min(last, pos + step - 1)
            sv.blocks_lost += 1
            lose(pos, end, "SQLite cannot read the pages that hold them")
            pos = end + 1
            continue
        if row is None:
            lose(pos, last, "no block holds them")
            break
        key, _, block_last = row
        block_first = key & SEQ_MASK
        if block_first > pos:
            lose(pos, block_first - 1, "no block holds them")
            pos = block_first
        try:
            if legacy:  # no checksum: a block that decodes is taken as intact
                query = "SELECT messages FROM blocks WHERE key = ?"
                data = db.execute(query, (key,)).fetchone()[0]
                crc = _crc(data)
                decode_block(data)
            else:
                crc, data = _block_data(db, key)
            intact = _crc(data) == crc
            why = "" if intact else "the block's CRC32 does not match its bytes"
        except sqlite3.DatabaseError as exc:
            why = f"SQLite cannot read the block ({exc})"
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            why = f"the block does not decode ({exc})"
        if why:
            sv.blocks_lost += 1
            lose(pos, block_last, why)
        else:
            if not joined:
                runs.append((pos, []))
            runs[-1][1].append((block_first, block_last, row[1], crc, data))
            sv.blocks_saved += 1
            joined = True
        pos = block_last + 1
    return runs


def _put_run(store: SqliteStreamStore, name: str, first: int, run: list[_Kept]) -> None:
    """The blocks of one run into stream ``name`` of a new store, and its counters."""
    sid = store._stream(name).key
    db = store._db
    size = sum(decode_block(run[0][4]).payload_sizes()[first - run[0][0] :])
    size += sum(sum(decode_block(data).payload_sizes()) for *_, data in run[1:])
    with store._tx():
        db.executemany(
            _INSERT_BLOCK,
            [(_key(sid, b_first), b_last, at, crc, data) for b_first, b_last, at, crc, data in run],
        )
        db.execute(_UPDATE_COUNTERS, (first, run[-1][1], size, sid))
