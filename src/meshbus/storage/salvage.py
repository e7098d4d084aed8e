"""Salvage: copy what is intact of a damaged (or version 3) stream store into a new one.

Separate from the store because it runs offline (``meshbus stream salvage``), on a file
the store refuses to open: it reads the copy with plain SQLite, block by block, and
writes through the new store's ``write_salvaged*`` methods.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from meshbus.protocol.blocks import decode_block
from meshbus.storage.blocks import (
    SCHEMA_VERSION,
    SELECT_BLOCKS,
    SEQ_MASK,
    BlockRow,
    block_crc,
    block_data,
    block_key,
    schema_statements,
)
from meshbus.storage.checks import check_files
from meshbus.storage.errors import StoreDamaged, StoreError
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import ADDRESS_LEN, StreamConfig


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
        for statement in schema_statements():
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
        f" first_seq, last_seq, {_owner(db, 'streams')} FROM streams ORDER BY name"
    ).fetchall()
    consumers = db.execute(
        "SELECT id, stream_id, name, ack_wait, max_deliver, start_seq, next_seq, dropped,"
        f" {_owner(db, 'consumers')} FROM consumers"
    ).fetchall()
    new = SqliteStreamStore(out)
    try:
        for sid, name, caps, max_msgs, max_bytes, max_age, window, first, last, owner in streams:
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
                        run_name,
                        captures if newest else (),
                        max_msgs,
                        max_bytes,
                        max_age,
                        window,
                        owner,
                    )
                )
                sv.saved.append((run_name, run_first, run_last))
                _put_run(new, run_name, run_first, run)
            if not runs:  # nothing kept: the stream, empty, numbering on from where it was
                new.add_stream(
                    StreamConfig(name, captures, max_msgs, max_bytes, max_age, window, owner)
                )
                new.write_salvaged(name, last + 1, last, 0, [])
            for consumer in consumers:
                cid, c_sid, c_name, ack_wait, max_deliver, start, next_seq, dropped, c_owner = (
                    consumer
                )
                if c_sid != sid:
                    continue
                # Pending deliveries of seqs the stream still holds (those of older runs
                # are read from their streams: NAME.FIRST-LAST).
                pending = db.execute(
                    "SELECT seq, delivery, deadline FROM pending"
                    " WHERE consumer_id = ? AND seq >= ?",
                    (cid, runs[-1][0] if runs else last + 1),
                ).fetchall()
                new.write_salvaged_consumer(
                    name, c_name, ack_wait, max_deliver, start, next_seq, dropped, c_owner, pending
                )
    finally:
        new.close()


def _owner(db: sqlite3.Connection, table: str) -> str:
    """What to select for the owner of a row of ``table``: a store older than owners
    (schema version 4 or before) has none."""
    columns = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
    return "owner" if "owner" in columns else "''"


def _salvage_blocks(
    db: sqlite3.Connection, sid: int, first: int, last: int, sv: StreamSalvage, legacy: bool
) -> list[tuple[int, list[BlockRow]]]:
    """The intact blocks holding ``first..last``, as runs of consecutive seqs: (the run's
    first seq, its blocks)."""
    runs: list[tuple[int, list[BlockRow]]] = []
    pos = first
    joined = False  # the next intact block continues the last run

    def lose(begin: int, end: int, why: str) -> None:
        nonlocal joined
        sv.lost.append(Lost(begin, end, why))
        joined = False

    while pos <= last:
        try:
            row = db.execute(SELECT_BLOCKS + " LIMIT 1", (
                block_key(sid, 0), block_key(sid, pos), block_key(sid, last)
            )).fetchone()  # fmt: skip
        except sqlite3.DatabaseError:
            # The pages that lead to the next block are lost: skip ahead until SQLite
            # finds blocks again.
            step = 1
            while pos + step <= last:
                try:
                    db.execute(SELECT_BLOCKS + " LIMIT 1", (
                        block_key(sid, 0), block_key(sid, pos + step), block_key(sid, last)
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
                crc = block_crc(data)
                decode_block(data)
            else:
                crc, data = block_data(db, key)
            intact = block_crc(data) == crc
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


def _put_run(store: SqliteStreamStore, name: str, first: int, run: list[BlockRow]) -> None:
    """The blocks of one run into stream ``name`` of a new store, and its counters."""
    size = sum(decode_block(run[0][4]).payload_sizes()[first - run[0][0] :])
    size += sum(sum(decode_block(data).payload_sizes()) for *_, data in run[1:])
    store.write_salvaged(name, first, run[-1][1], size, run)
