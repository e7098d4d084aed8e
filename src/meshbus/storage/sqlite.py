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

Messages are stored in blocks of one append batch, each with its CRC32; their
layout, and the SQL shared with salvage, are in ``store_blocks``. The checks at open
that need no SQLite are in ``store_checks``; copying a damaged store is
``store_salvage``.

Not safe for two stores writing one file at a time (each trusts its own mirror):
the broker must hold a lock on its data directory.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from meshbus.protocol.blocks import Block, BlockSlice, decode_block
from meshbus.storage import images
from meshbus.storage.blocks import (
    ADD_OWNERS,
    INSERT_BLOCK,
    OWNERLESS_VERSION,
    PUT_PENDING,
    SCHEMA_VERSION,
    SEQ_BITS,
    SEQ_MASK,
    UPDATE_COUNTERS,
    BlockDamaged,
    BlockRow,
    block_crc,
    block_data,
    block_key,
    block_keys,
    check_block,
    encode_messages,
    read_slices,
    schema_statements,
    split_batch,
)
from meshbus.storage.checks import check_files, store_damaged
from meshbus.storage.errors import StoreError, StreamNotFound
from meshbus.storage.store import (
    ADDRESS_LEN,
    Appended,
    ConsumerConfig,
    ConsumerInfo,
    ConsumerState,
    Delivery,
    MirroredStore,
    NewMessage,
    PublishIds,
    StoredMessage,
    StreamConfig,
    StreamState,
    StreamStatus,
    fit_bytes,
)

log = logging.getLogger("meshbus.broker")

_SYNCHRONOUS = {"normal": "NORMAL", "always": "FULL"}

# Blocks decoded lately, by key (a block never changes; it is only deleted): a reader
# going through a stream page by page decodes each block once, not once per page.
_DECODED_BLOCKS = 16
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


class SqliteStreamStore(MirroredStore):
    def __init__(self, path: str | os.PathLike[str], fsync: str = "normal") -> None:
        if fsync not in _SYNCHRONOUS:
            raise ValueError(f"fsync must be 'normal' or 'always', not {fsync!r}")
        super().__init__()
        self.path = os.fspath(path)
        self._purge: list[int] = []  # ids of deleted streams whose blocks are still there
        self._staged: dict[str, images.Staged] = {}  # stream -> a copy staged past it
        self._purge_rows = PURGE_ROWS
        # Before SQLite opens the file: once it has, a damaged WAL is cut short for good.
        problem = check_files(self.path)
        if problem:
            raise store_damaged(self.path, problem)
        # Autocommit mode (isolation_level=None): transactions are the explicit ones in _tx.
        # check_same_thread=False lets the broker move the store to a worker thread (for
        # fsync="always"), as long as one thread at a time uses it.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._synchronous = _SYNCHRONOUS[fsync]
        try:
            self._open(self._synchronous)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise store_damaged(self.path, f"SQLite cannot read it ({exc})") from None
        except BlockDamaged as exc:
            self._db.close()
            raise store_damaged(self.path, exc.problem) from None
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
        if version not in (0, OWNERLESS_VERSION, SCHEMA_VERSION):
            raise StoreError(
                f"{self.path}: stream store schema version {version} is not {SCHEMA_VERSION}; "
                "it was written by another meshbus version (version 4 added a checksum to "
                "every block; a version 4 store is upgraded in place); `meshbus stream "
                "salvage --data-dir "
                f"{os.path.dirname(os.path.abspath(self.path))} --out NEW_DIR` copies a "
                "version 3 store into a new one, or move it aside to start with an empty store"
            )
        if version:
            # integrity_check, not quick_check: the same pass over the b-trees (its cost
            # grows with the file: 50 ms for 200 MB in the page cache) plus the check that
            # the two small UNIQUE indexes match their tables.
            problems = [row[0] for row in db.execute("PRAGMA integrity_check(5)")]
            if problems != ["ok"]:
                raise store_damaged(
                    self.path, "SQLite's integrity check failed: " + "; ".join(problems)
                )
        with self._tx():
            for statement in schema_statements():
                db.execute(statement)
            if version == OWNERLESS_VERSION:
                for statement in ADD_OWNERS:
                    db.execute(statement)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._load()
        with self._tx() as db:
            for st in self._streams.values():
                images.discard_staged(db, st)  # a copy a restart cut short starts again
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
                (block_key(st.key, 0), block_key(st.key, SEQ_MASK)),
            ):
                if last < st.first_seq:
                    break
                check_block(self.path, st.config.name, key, last, crc, data)
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
            key = block_key(sid, SEQ_MASK)

    def _load(self, only: StreamState | None = None) -> None:
        """(Re)build the mirror from the database, the truth: of every stream, or of
        stream ``only`` alone (a copy installed in it: its publish ids are the caller's,
        not read back from its blocks)."""
        db = self._db
        self._decoded: dict[int, Block] = {}
        params: tuple[int, ...] = ()
        if only is None:
            self._streams = {}
            where = ""
        else:
            del self._streams[only.config.name]
            where, params = " WHERE stream_id = ?", (only.key,)
        by_id: dict[int, StreamState] = {}
        for row in db.execute(
            "SELECT id, name, captures, max_msgs, max_bytes, max_age, dedupe_window,"
            " first_seq, last_seq, bytes, owner FROM streams" + where.replace("stream_id", "id"),
            params,
        ):
            sid, name, caps, max_msgs, max_bytes, max_age, window, first, last, size, owner = row
            captures = tuple(caps[i : i + ADDRESS_LEN] for i in range(0, len(caps), ADDRESS_LEN))
            config = StreamConfig(name, captures, max_msgs, max_bytes, max_age, window, owner)
            st = StreamState(config, first, last, size, key=sid)
            if st.count:
                st.first_at = block_keys(db, sid, first, first)[0][1]  # no decoding
            if only is None:
                self._load_publish_ids(st)
            self._streams[name] = by_id[sid] = st
        by_cid: dict[int, ConsumerState] = {}
        for cid, sid, name, ack_wait, max_deliver, start, next_seq, dropped, owner in db.execute(
            "SELECT id, stream_id, name, ack_wait, max_deliver, start_seq, next_seq, dropped,"
            " owner FROM consumers" + where,
            params,
        ):
            cs = ConsumerState(
                ConsumerConfig(name, ack_wait, max_deliver, start, owner), next_seq, dropped
            )
            cs.key = cid
            by_id[sid].consumers[name] = by_cid[cid] = cs
        for cid, seq, count, deadline in db.execute(
            "SELECT consumer_id, seq, delivery, deadline FROM pending"
            + (where and " WHERE consumer_id IN (SELECT id FROM consumers" + where + ")")
            + " ORDER BY consumer_id, seq",
            params,
        ):
            cs = by_cid[cid]
            cs.pending[seq] = (count, deadline)
            cs.earliest = min(cs.earliest, deadline)
        for sid, index in db.execute(
            "SELECT stream_id, raft_index FROM raft_applied" + where, params
        ):
            if sid in by_id:
                by_id[sid].applied = index

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
            (block_key(st.key, 0), block_key(st.key, SEQ_MASK)),
        ):
            if key & SEQ_MASK > st.last_seq:
                continue  # a copy staged past the stream (meshbus.storage.images)
            if young and at < young[0][1] - window:
                break
            check_block(self.path, st.config.name, key, last, crc, block)
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
        for key, at, block_last in block_keys(self._db, st.key, first, last):
            yield key & SEQ_MASK, at, self._block(st, key, block_last)

    def _block(self, st: StreamState, key: int, last: int) -> Block:
        decoded = self._decoded
        block = decoded.get(key)
        if block is None:
            crc, data = block_data(self._db, key)
            check_block(self.path, st.config.name, key, last, crc, data)
            block = decoded[key] = decode_block(data)
            if len(decoded) > _DECODED_BLOCKS:
                del decoded[next(iter(decoded))]
        return block

    def _sizes(self, st: StreamState, first: int) -> Iterator[tuple[int, float, int]]:
        """(seq, stored_at, payload size) from ``first`` on, for retention. A damaged
        block's sizes are unknown: each of its messages counts as an even share of its
        bytes, so retention removes it (its messages are lost anyway) instead of failing
        every append to the stream from then on."""
        for key, at, block_last in block_keys(self._db, st.key, first, st.last_seq):
            block_first = key & SEQ_MASK
            try:
                sizes = self._block(st, key, block_last).payload_sizes()
            except BlockDamaged as exc:
                log.error("retention meets a damaged block", extra={"error": str(exc)})
                count = block_last - block_first + 1
                sizes = [len(block_data(self._db, key)[1]) // count] * count
            for seq, size in enumerate(sizes, block_first):
                if seq >= first:
                    yield seq, at, size

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction; on any failure roll back and reload the mirror, which the
        caller may already have changed. Inside another (``raft_entry``), part of it."""
        if self._db.in_transaction:
            yield self._db
            return
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
                "INSERT INTO streams VALUES (NULL, ?, ?, ?, ?, ?, ?, 1, 0, 0, ?)",
                (config.name, b"".join(config.captures), config.max_msgs, config.max_bytes,
                 config.max_age, config.dedupe_window, config.owner),
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
        self._staged.pop(name, None)
        with self._tx() as db:
            db.execute(
                "DELETE FROM pending WHERE consumer_id IN"
                " (SELECT id FROM consumers WHERE stream_id = ?)",
                (sid,),
            )
            db.execute("DELETE FROM consumers WHERE stream_id = ?", (sid,))
            db.execute("DELETE FROM streams WHERE id = ?", (sid,))
            db.execute("DELETE FROM raft_applied WHERE stream_id = ?", (sid,))
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
                (block_key(sid, 0), block_key(sid, SEQ_MASK), rows),
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
        with self._tx() as db:
            return self._write(db, st, messages, now)

    @contextmanager
    def raft_entry(self, name: str, index: int) -> Iterator[None]:
        """Committed without an fsync whatever ``fsync`` says: a replicated stream's
        durability is its Raft log's, fsynced before any ack; what a power loss takes
        from here is applied again from the log at start (from ``applied``), and the
        log drops no entry before ``flush`` made this file durable."""
        st = self._stream(name)
        relaxed = self._synchronous != "NORMAL" and not self._db.in_transaction
        if relaxed:
            self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            with self._tx() as db:
                yield
                db.execute(
                    "INSERT OR REPLACE INTO raft_applied (stream_id, raft_index) VALUES (?, ?)",
                    (st.key, index),
                )
        finally:
            if relaxed:
                self._db.execute(f"PRAGMA synchronous={self._synchronous}")
        st.applied = index

    def _write(
        self, db: sqlite3.Connection, st: StreamState, messages: Sequence[NewMessage], now: float
    ) -> list[Appended]:
        """Append inside the caller's transaction."""
        sid = st.key
        first = st.last_seq + 1
        results, stored = self._append(st, messages, now)
        if stored:
            rows = []
            for seq, block in split_batch(first, stored):
                data = encode_messages(block)
                rows.append((block_key(sid, seq), seq + len(block) - 1, now, block_crc(data), data))
            db.executemany(INSERT_BLOCK, rows)
            self._trim(db, st, now)
            db.execute(UPDATE_COUNTERS, (st.first_seq, st.last_seq, st.bytes, sid))
        return results

    def _trim(self, db: sqlite3.Connection, st: StreamState, now: float) -> int:
        """Apply retention inside the caller's transaction; returns messages removed."""
        if not self._needs_cut(st, now):
            return 0
        sid, old_first = st.key, st.first_seq
        self._cut(st, now, self._sizes(st, old_first))
        db.execute(
            "DELETE FROM blocks WHERE key >= ? AND key < ? AND last_seq < ?",
            (block_key(sid, 0), block_key(sid, st.first_seq), st.first_seq),
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
        return read_slices(
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
            src, dst, payload, group, priority, _, headers = block.columns(start, end)
            fields = zip(src, dst, group, priority, payload, headers, strict=True)
            for seq, message in enumerate(fields, block_first + start):
                yield StoredMessage(name, seq, at, *message)

    def expire(self, now: float, streams: Iterable[str] | None = None) -> int:
        removed = 0
        selected = self._selected(streams)
        with self._tx() as db:
            for st in selected:
                st.ids.expire(now)
                trimmed = self._trim(db, st, now)
                if trimmed:
                    db.execute(UPDATE_COUNTERS, (st.first_seq, st.last_seq, st.bytes, st.key))
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
                "INSERT INTO consumers VALUES (NULL, ?, ?, ?, ?, ?, ?, 0, ?)",
                (st.key, config.name, config.ack_wait, config.max_deliver, config.start_seq,
                 cs.next_seq, config.owner),
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

    def consumer_next(
        self, stream: str, name: str, max_count: int, now: float, *, read: bool = True
    ) -> list[Delivery]:
        st, cs = self._consumer(stream, name)
        with self._tx() as db:
            plan = self._plan_next(st, cs, max_count, now)
            if plan.given_up:
                db.executemany(_DELETE_PENDING, [(cs.key, seq) for seq in plan.given_up])
            deadline = plan.deadline
            db.executemany(
                PUT_PENDING,
                [(cs.key, seq, count, deadline) for seq, count in plan.redeliver]
                + [(cs.key, seq, 1, deadline) for seq in plan.new],
            )
            if plan.given_up or plan.new:
                db.execute(
                    "UPDATE consumers SET next_seq = ?, dropped = ? WHERE id = ?",
                    (cs.next_seq, cs.dropped, cs.key),
                )
        if not read:
            return []
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

    # -- copies between replicas (meshbus.storage.images) ------------------------

    def image(self, name: str) -> images.StreamImage:
        """Stream ``name`` but its messages, as of the Raft entry it applied last."""
        return images.image_of(self._stream(name))

    def copy_out(self, name: str, from_seq: int, max_bytes: int) -> list[BlockRow]:
        """The blocks holding the stream's messages from ``from_seq`` on, up to
        ``max_bytes`` of them (at least one), as they are stored."""
        return images.blocks_after(self._db, self.path, self._stream(name), from_seq, max_bytes)

    def held_last(self, name: str) -> int:
        """The last seq stream ``name`` holds, a copy staged past it included."""
        st = self._stream(name)
        staged = self._staged.get(name)
        return staged.held_last(st) if staged is not None else st.last_seq

    def stage(self, name: str, rows: list[BlockRow]) -> int:
        """Blocks copied from another replica, staged past the stream until ``install``;
        the last seq held now. CopyMismatch if they do not fit. Their publish ids are
        remembered as they come (within the dedupe window of the newest), so that the
        install neither reads them back from every block nor builds their table at
        once: either would hold the caller as long as a store's open does."""
        blocks = images.check_rows(rows)
        st = self._stream(name)
        staged = self._staged.get(name)
        if staged is None:
            staged = self._staged[name] = images.Staged(PublishIds(st.config.dedupe_window))
        before = staged.held_last(st)
        with self._tx() as db:
            held = images.stage(db, st, staged, rows)
        for first, at, batch in blocks:
            if first > before and batch:
                staged.ids.remember(batch, at)
        if blocks:
            staged.ids.expire(max(at for _, at, _ in blocks))
        return held

    def install(self, name: str, image: images.StreamImage) -> None:
        """Stream ``name`` becomes ``image`` over the blocks staged for it. Its publish
        ids: those of the staged blocks, with those it knew and the image's."""
        st = self._stream(name)
        staged = self._staged.get(name) or images.Staged(PublishIds(st.config.dedupe_window))
        known = st.ids.older_than(SEQ_MASK)
        self._decoded.clear()
        with self._tx() as db:  # a failure reloads the whole mirror, publish ids with it
            images.install(db, st, staged, image)
        self._load(st)
        self._staged.pop(name, None)
        staged.ids.restore([*known, *image.publish_ids])
        self._stream(name).ids = staged.ids

    def discard_staged(self, name: str) -> None:
        self._staged.pop(name, None)
        with self._tx() as db:
            images.discard_staged(db, self._stream(name))

    def wal_bytes(self) -> int:
        """The size of the WAL file now (0: none)."""
        try:
            return os.stat(self.path + "-wal").st_size
        except FileNotFoundError:
            return 0

    def checkpoint(self) -> None:
        """Copy the WAL's committed pages into the database file, with a connection of
        its own: from another thread than the store's, so the copying and its fsyncs do
        not stall the store's writer. PASSIVE: it never waits for the writer, which
        keeps its own checkpoint at SQLite's 1,000 pages -- little is left for it to do
        then, and the WAL starts over (and is cut to ``_WAL_LIMIT``) after it."""
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:
            raise StoreError(f"checkpointing the stream store failed: {exc}") from exc
        finally:
            db.close()

    def flush(self) -> None:
        """Make every commit so far durable, with ``fsync="normal"`` too: the database
        file and its WAL fsynced (from another thread than the store's: it opens its own
        descriptors). A replicated stream's Raft log drops the entries up to an index
        only once the store holds their state durably."""
        for path in (self.path, self.path + "-wal"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # no WAL: every commit is in the database file
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- salvage ------------------------------------------------------------------

    def write_salvaged(
        self, name: str, first_seq: int, last_seq: int, size: int, blocks: Sequence[BlockRow]
    ) -> None:
        """For ``store_salvage``: intact ``blocks`` of another store, copied as they are
        into stream ``name``, whose counters become ``first_seq..last_seq`` and ``size``.
        Writes the database only, not the mirror: salvage closes the store, and a broker
        reads it back at open."""
        sid = self._stream(name).key
        with self._tx() as db:
            db.executemany(
                INSERT_BLOCK,
                [
                    (block_key(sid, first), last, at, crc, data)
                    for first, last, at, crc, data in blocks
                ],
            )
            db.execute(UPDATE_COUNTERS, (first_seq, last_seq, size, sid))

    def write_salvaged_consumer(
        self,
        stream: str,
        name: str,
        ack_wait: float,
        max_deliver: int,
        start_seq: int,
        next_seq: int,
        dropped: int,
        owner: str,
        pending: Sequence[tuple[int, int, float]],
    ) -> None:
        """For ``store_salvage``, as ``write_salvaged``: consumer ``name`` of ``stream``
        as it was, with its ``pending`` (seq, delivery count, deadline). Copied values,
        so not checked as ``ConsumerConfig`` would."""
        sid = self._stream(stream).key
        with self._tx() as db:
            cid = db.execute(
                "INSERT INTO consumers VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?)",
                (sid, name, ack_wait, max_deliver, start_seq, next_seq, dropped, owner),
            ).lastrowid
            db.executemany(PUT_PENDING, [(cid, seq, count, at) for seq, count, at in pending])

    def close(self) -> None:
        self._db.close()


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
            return read_slices(db, sid, first_seq, last_seq, from_seq, max_count, 0, where)
        except sqlite3.Error as exc:
            raise StoreError(f"reading stream {name!r} from the store failed: {exc}") from exc
        finally:
            db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()
