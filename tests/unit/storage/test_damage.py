"""A damaged stream store is found at open (or, for an old block, when it is read), named
and refused -- never served altered, never silently emptied."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from meshbus.errors import MeshbusError
from meshbus.protocol.blocks import encode_block
from meshbus.storage import blocks as store_blocks
from meshbus.storage import sqlite as sqlite_store
from meshbus.storage.errors import StoreDamaged, StoreError
from meshbus.storage.salvage import Lost, salvage
from meshbus.storage.sqlite import SqliteStreamReader, SqliteStreamStore
from meshbus.storage.store import ConsumerConfig, NewMessage, StreamConfig
from tests.damage import flip

SRC = bytes(range(16))
DST = bytes(range(16, 32))


def make(
    path: Path, batches: int = 20, per: int = 50, size: int = 100, window: float = 120.0
) -> SqliteStreamStore:
    store = SqliteStreamStore(path)
    store.add_stream(StreamConfig("orders", (DST,), dedupe_window=window))
    for b in range(batches):
        payloads = [b"%05d:" % (b * per + i) + b"P" * size for i in range(per)]
        store.append_batch("orders", [NewMessage(SRC, DST, p) for p in payloads], float(b))
    return store


def refused(path: Path) -> str:
    with pytest.raises(StoreDamaged) as error:
        SqliteStreamStore(path)
    message = str(error.value)
    assert isinstance(error.value, MeshbusError)
    assert message.startswith(f"the stream store {path} is damaged: ")
    assert f"meshbus stream salvage --data-dir {path.parent}" in message
    return message


@pytest.fixture
def closed(tmp_path: Path) -> Path:
    path = tmp_path / "streams.db"
    make(path).close()
    assert not os.path.exists(f"{path}-wal")  # closing checkpoints: one file
    return path


def test_truncated_by_8_kib(closed: Path) -> None:
    os.truncate(closed, os.path.getsize(closed) - 8192)
    assert "it was cut short" in refused(closed)


def test_cut_in_half(closed: Path) -> None:
    os.truncate(closed, os.path.getsize(closed) // 2)
    assert "it was cut short" in refused(closed)


def test_header_overwritten(closed: Path) -> None:
    flip(closed, 0, 100)
    assert "its first bytes are not an SQLite header" in refused(closed)


def test_64_flipped_bytes_in_a_payload(closed: Path) -> None:
    at = closed.read_bytes().find(b"P" * 100)
    flip(closed, at)
    assert "of stream 'orders' is damaged (its CRC32 does not match its bytes)" in refused(closed)


def test_64_flipped_bytes_in_the_btree(closed: Path) -> None:
    flip(closed, 4096 * 2 + 8)  # a page's header: SQLite's own structure
    message = refused(closed)
    assert "SQLite" in message


def test_an_old_damaged_block_is_found_when_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = tmp_path / "streams.db"
    make(closed, window=0).close()  # no publish ids to read back at open
    monkeypatch.setattr(sqlite_store, "VERIFY_BYTES", 1)  # only the newest block at open
    at = closed.read_bytes().find(b"00003:")
    flip(closed, at + 10)
    store = SqliteStreamStore(closed)
    try:
        assert [m.seq for m in store.read("orders", 900, 100)] == list(range(900, 1000))
        expected = "the block of messages 1..50 of stream 'orders' is damaged"
        with pytest.raises(StoreError, match=expected):
            store.read("orders", 1, 10)
        with pytest.raises(StoreError, match=expected):
            store.read_blocks("orders", 1, 10)
        reader = SqliteStreamReader(closed)
        with pytest.raises(StoreError, match=expected):
            reader.read_blocks("orders", 1, 10)
        reader.close()
    finally:
        store.close()


def crash_image(tmp_path: Path) -> Path:
    """The files a broker killed with kill -9 leaves: the database and its WAL."""
    live = tmp_path / "live" / "streams.db"
    live.parent.mkdir()
    store = make(live, batches=200)
    image = tmp_path / "crashed" / "streams.db"
    image.parent.mkdir()
    shutil.copy(live, image)
    shutil.copy(f"{live}-wal", f"{image}-wal")
    store.close()
    return image


def test_a_crash_image_opens_whole(tmp_path: Path) -> None:
    store = SqliteStreamStore(crash_image(tmp_path))
    assert store.info("orders").messages == 10_000
    store.close()


def test_64_flipped_bytes_in_the_wal(tmp_path: Path) -> None:
    image = crash_image(tmp_path)
    wal = Path(f"{image}-wal")
    flip(wal, 32 + (24 + 4096) * 3 + 24)  # the page of the fourth frame
    message = refused(image)
    assert f"its write-ahead log {wal} is damaged at frame 4 of " in message
    assert "committed transactions since the last checkpoint" in message
    assert wal.stat().st_size > 32  # SQLite never got to cut it short


def test_a_damaged_wal_header(tmp_path: Path) -> None:
    image = crash_image(tmp_path)
    flip(Path(f"{image}-wal"), 0, 8)
    assert "has a damaged header" in refused(image)


def test_an_older_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=3")
    db.close()
    with pytest.raises(StoreError, match=r"schema version 3 is not 5.*checksum"):
        SqliteStreamStore(path)


def test_deleting_a_big_stream_does_not_grow_the_data_dir(tmp_path: Path) -> None:
    path = tmp_path / "streams.db"
    store = make(path, batches=40, per=100, size=4000)  # 16 MB
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def disk() -> int:
        return sum(os.path.getsize(p) for p in tmp_path.iterdir())

    before = disk()
    store.delete_stream("orders")
    slices = 0
    while store.purge(max_rows=4):
        slices += 1
        assert disk() < before * 1.2
    assert slices >= 9
    assert store._db.execute("SELECT count(*) FROM blocks").fetchone() == (0,)
    store.add_stream(StreamConfig("orders", (DST,)))  # a new id: nothing of the old one
    assert store.read("orders", 1, 10) == []
    store.append_batch("orders", [NewMessage(SRC, DST, b"x" * 4000)] * 1000, 99.0)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert disk() <= before  # the freed pages are used again
    store.close()


def test_a_delete_is_sliced_into_short_transactions(tmp_path: Path) -> None:
    """The broker runs one slice per turn of its event loop, so a delete must leave the
    blocks to the slices and each slice take at most the rows it is given (how many it
    is given adapts to the time one took: a figure for the benchmarks, not this test)."""
    path = tmp_path / "streams.db"
    store = make(path, batches=100, per=100, size=4000)  # 40 MB, 200 blocks

    def blocks() -> int:
        (count,) = store._db.execute("SELECT count(*) FROM blocks").fetchone()
        return int(count)

    before = blocks()
    store.delete_stream("orders")
    assert blocks() == before  # the delete itself removes no block
    slices = []
    while True:
        left = blocks()
        more = store.purge(max_rows=16)
        slices.append(left - blocks())
        if not more:
            break
    assert blocks() == 0
    assert max(slices) <= 16, slices
    assert len(slices) >= before // 16, slices
    store.close()


def test_a_purge_cut_short_by_a_restart_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "streams.db"
    store = make(path)
    store.delete_stream("orders")
    store.close()
    store = SqliteStreamStore(path)
    assert store.purging
    while store.purge():
        pass
    assert store._db.execute("SELECT count(*) FROM blocks").fetchone() == (0,)
    store.close()


def test_salvage_keeps_intact_blocks_consumers_and_their_pending(tmp_path: Path) -> None:
    path = tmp_path / "streams.db"
    store = make(path, window=0)
    store.add_consumer("orders", ConsumerConfig("audit", ack_wait=5.0))
    taken = store.consumer_next("orders", "audit", 120, 100.0)
    store.consumer_ack("orders", "audit", [d.message.seq for d in taken[:100]])
    store.close()
    flip(path, path.read_bytes().find(b"00520:") + 10)  # the block of seqs 501..550
    report = salvage(str(path), str(tmp_path / "new.db"))
    assert "501..550 of stream 'orders' is damaged" in report.problem
    (sv,) = report.streams
    assert (sv.blocks_saved, sv.blocks_lost, sv.messages_lost) == (19, 1, 50)
    assert sv.lost == [Lost(501, 550, "the block's CRC32 does not match its bytes")]
    assert sv.saved == [("orders.1-500", 1, 500), ("orders", 551, 1000)]
    new = SqliteStreamStore(tmp_path / "new.db")
    try:
        assert [(s.name, s.captures) for s in new.streams()] == [
            ("orders", (DST,)), ("orders.1-500", ())
        ]  # fmt: skip
        older = new.read("orders.1-500", 1, 1000)
        assert [m.payload[:6] for m in older] == [b"%05d:" % i for i in range(500)]
        assert new.info("orders").first_seq == 551
        assert new.info("orders").bytes == 450 * 106
        info = new.consumer_info("orders", "audit")
        assert (info.next_seq, info.pending) == (551, 0)  # 101..120: in orders.1-500
        assert [m.seq for m in new.read("orders", 551, 2)] == [551, 552]
    finally:
        new.close()
    assert path.read_bytes().find(b"00520:") > 0  # the source is as it was


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: flip(p, 0, 100), "its first bytes are not an SQLite header"),
        (lambda p: os.truncate(p, os.path.getsize(p) // 2), "it was cut short"),
    ],
    ids=["header", "half"],
)
def test_salvage_of_a_store_sqlite_cannot_open(
    tmp_path: Path, damage: Callable[[Path], None], problem: str
) -> None:
    path = tmp_path / "streams.db"
    make(path, window=0).close()
    damage(path)
    report = salvage(str(path), str(tmp_path / "new.db"))
    assert problem in report.problem
    (sv,) = report.streams
    new = SqliteStreamStore(tmp_path / "new.db")
    try:
        kept = [m for name, _, _ in sv.saved for m in new.read(name, 1, 2000)]
        assert len(kept) + sv.messages_lost == 1000
        assert kept  # something was saved
        assert all(m.payload.startswith(b"%05d:" % (m.seq - 1)) for m in kept)
    finally:
        new.close()


def older_store(path: Path, version: int) -> sqlite3.Connection:
    """An empty store of schema ``version``: 4 had no owners, 3 no checksums either."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    schema = re.sub(r",\s*owner TEXT NOT NULL DEFAULT ''", "", store_blocks.SCHEMA)
    if version == 3:
        schema = schema.replace(" AUTOINCREMENT", "").replace("crc INTEGER NOT NULL, ", "")
    for statement in filter(None, (part.strip() for part in schema.split(";"))):
        db.execute(statement)
    db.execute(f"PRAGMA user_version={version}")
    return db


def test_a_version_4_store_is_upgraded_in_place_its_streams_and_consumers_nobodys(
    tmp_path: Path,
) -> None:
    path = tmp_path / "streams.db"
    db = older_store(path, 4)
    db.execute("INSERT INTO streams VALUES (1, 'old', ?, 0, 0, 0.0, 120.0, 1, 0, 0)", (DST,))
    db.execute("INSERT INTO consumers VALUES (1, 1, 'audit', 30.0, 5, 0, 1, 0)")
    db.close()
    store = SqliteStreamStore(path)
    try:
        (config,) = store.streams()
        assert (config.name, config.captures, config.owner) == ("old", (DST,), "")
        assert store.consumer_info("old", "audit").config.owner == ""
        store.add_consumer("old", ConsumerConfig("mine", owner="alice"))
    finally:
        store.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (5,)
    again = SqliteStreamStore(path)  # the owner made after the upgrade is kept
    try:
        assert again.consumer_info("old", "mine").config.owner == "alice"
    finally:
        again.close()
    report = salvage(str(path), str(tmp_path / "new.db"))  # salvage keeps owners too
    assert not report.problem
    new = SqliteStreamStore(tmp_path / "new.db")
    try:
        assert new.consumer_info("old", "mine").config.owner == "alice"
    finally:
        new.close()


def test_salvage_brings_a_version_3_store_to_version_5(tmp_path: Path) -> None:
    path = tmp_path / "streams.db"
    db = older_store(path, 3)
    db.execute("INSERT INTO streams VALUES (1, 'old', ?, 0, 0, 0.0, 120.0, 1, 3, 3)", (DST,))
    block = encode_block([SRC] * 3, [DST] * 3, [b"a", b"b", b"c"], [b""] * 3, [0] * 3, [b""] * 3)
    db.execute("INSERT INTO blocks VALUES (?, 3, 7.0, ?)", (1 << 40 | 1, block))
    db.close()
    with pytest.raises(StoreError, match="schema version 3 is not 5"):
        SqliteStreamStore(path)
    report = salvage(str(path), str(tmp_path / "new.db"))
    assert report.problem.startswith("it is of schema version 3")
    assert report.streams[0].saved == [("old", 1, 3)]
    new = SqliteStreamStore(tmp_path / "new.db")
    try:
        assert [m.payload for m in new.read("old", 1, 10)] == [b"a", b"b", b"c"]
    finally:
        new.close()


def test_retention_removes_a_damaged_block_instead_of_refusing_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "streams.db"
    make(path, window=0).close()  # 20 blocks of 50
    flip(path, path.read_bytes().find(b"00060:") + 10)  # the block of seqs 51..100
    monkeypatch.setattr(sqlite_store, "VERIFY_BYTES", 1)
    store = SqliteStreamStore(path)
    try:
        store._streams["orders"].config = StreamConfig("orders", (DST,), max_msgs=920)
        store.append_batch("orders", [NewMessage(SRC, DST, b"new")], 50.0)
        info = store.info("orders")
        assert (info.first_seq, info.last_seq) == (82, 1001)
        assert "retention meets a damaged block" in caplog.text
        with pytest.raises(StoreError, match=r"messages 51\.\.100 of stream 'orders' is damaged"):
            store.read("orders", 82, 5)
        store.append_batch("orders", [NewMessage(SRC, DST, b"x")] * 30, 51.0)
        assert store.info("orders").first_seq == 112  # the damaged block is gone
        assert store.read("orders", 1, 1)[0].seq == 112
    finally:
        store.close()
