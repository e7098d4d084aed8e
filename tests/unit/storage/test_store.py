"""The stream store: the same tests run against the memory and the SQLite store."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshbus.protocol.blocks import BlockSlice
from meshbus.storage import blocks as store_blocks
from meshbus.storage.errors import (
    ConsumerExists,
    ConsumerNotFound,
    StoreError,
    StreamExists,
    StreamNotFound,
)
from meshbus.storage.sqlite import SqliteStreamReader, SqliteStreamStore
from meshbus.storage.store import (
    Appended,
    ConsumerConfig,
    MemoryStreamStore,
    MirroredStore,
    NewMessage,
    StreamConfig,
    StreamStore,
)

SRC = bytes(range(16))
DST = bytes(range(16, 32))
OTHER = bytes(range(32, 48))


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StreamStore]:
    s: StreamStore = (
        MemoryStreamStore() if request.param == "memory" else SqliteStreamStore(tmp_path / "s.db")
    )
    yield s
    s.close()


def cfg(name: str = "orders", **kw: object) -> StreamConfig:
    return StreamConfig(name, (DST,), **kw)  # type: ignore[arg-type]


def msg(payload: bytes = b"x", publish_id: bytes = b"", **kw: object) -> NewMessage:
    return NewMessage(SRC, DST, payload, publish_id=publish_id, **kw)  # type: ignore[arg-type]


def fill(s: StreamStore, n: int, now: float = 0.0, name: str = "orders", size: int = 1) -> None:
    s.append_batch(name, [msg(bytes([i % 256]) * size) for i in range(n)], now)


def seqs(s: StreamStore, from_seq: int = 0, name: str = "orders") -> list[int]:
    return [m.seq for m in s.read(name, from_seq, 1000)]


Row = tuple[int, float, bytes, bytes, bytes, int, bytes, bytes]


def rows_of(pieces: list[BlockSlice]) -> list[Row]:
    """What ``read`` gives, (seq, stored_at, src, dst, group, priority, payload, headers)
    per message, from what ``read_blocks`` gives."""
    out: list[Row] = []
    for piece in pieces:
        src, dst, payload, group, priority, _, headers = piece.columns()
        fields = zip(piece.seqs, src, dst, group, priority, payload, headers, strict=True)
        out += [(seq, piece.stored_at, *rest) for seq, *rest in fields]  # type: ignore[misc]
    return out


def rows(s: StreamStore, from_seq: int, count: int, max_bytes: int = 0) -> list[Row]:
    return [m[1:] for m in s.read("orders", from_seq, count, max_bytes)]


# -- streams ----------------------------------------------------------------------------


def test_add_stream_is_idempotent_and_refuses_a_different_config(store: StreamStore) -> None:
    info = store.add_stream(cfg(max_msgs=10))
    assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (1, 0, 0, 0)
    assert info.consumers == ()
    fill(store, 3)
    again = store.add_stream(cfg(max_msgs=10))
    assert again.last_seq == 3  # the same stream, not a new one
    with pytest.raises(StreamExists, match="different configuration"):
        store.add_stream(cfg(max_msgs=11))
    store.add_stream(cfg("alpha"))
    assert [c.name for c in store.streams()] == ["alpha", "orders"]
    assert store.streams()[1] == cfg(max_msgs=10)


@pytest.mark.parametrize("name", ["", "a" * 65, "has space", "slash/", "ümlaut", "a\n"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="invalid stream name"):
        cfg(name)
    with pytest.raises(ValueError, match="invalid consumer name"):
        ConsumerConfig(name)


def test_config_validation() -> None:
    assert cfg("A-z_0.9" + "x" * 57).name.startswith("A-z")  # 64 characters are allowed
    with pytest.raises(ValueError, match="16-byte address"):
        StreamConfig("s", (b"short",))
    with pytest.raises(ValueError, match="max_msgs must be 0 or more"):
        cfg(max_msgs=-1)
    with pytest.raises(ValueError, match="ack_wait"):
        ConsumerConfig("c", ack_wait=0)
    with pytest.raises(ValueError, match="max_deliver"):
        ConsumerConfig("c", max_deliver=-1)


def test_unknown_stream(store: StreamStore) -> None:
    with pytest.raises(StreamNotFound, match=r"meshbus stream add nope --capture"):
        store.info("nope")
    for call in (
        lambda: store.append_batch("nope", [msg()], 0.0),
        lambda: store.read("nope", 1, 1),
        lambda: store.delete_stream("nope"),
        lambda: store.add_consumer("nope", ConsumerConfig("c")),
        lambda: store.consumer_next("nope", "c", 1, 0.0),
    ):
        with pytest.raises(StreamNotFound):
            call()


def test_append_numbers_from_one(store: StreamStore) -> None:
    store.add_stream(cfg())
    store.add_stream(cfg("other"))
    assert store.append_batch("orders", [msg(b"a"), msg(b"b")], 1.0) == [
        Appended(1, False),
        Appended(2, False),
    ]
    assert store.append_batch("orders", [], 2.0) == []
    assert store.append_batch("orders", [msg(b"c")], 3.0) == [Appended(3, False)]
    assert store.append_batch("other", [msg(b"z")], 3.0) == [Appended(1, False)]
    got = store.read("orders", 1, 10)
    assert [(m.stream, m.seq, m.payload, m.stored_at) for m in got] == [
        ("orders", 1, b"a", 1.0),
        ("orders", 2, b"b", 1.0),
        ("orders", 3, b"c", 3.0),
    ]
    m = store.append_batch("other", [NewMessage(OTHER, DST, b"p", b"grp", 7)], 4.0)[0]
    (stored,) = store.read("other", m.seq, 1)
    assert (stored.src, stored.dst, stored.group, stored.priority) == (OTHER, DST, b"grp", 7)


def test_read_ranges(store: StreamStore) -> None:
    store.add_stream(cfg())
    fill(store, 10, size=10)
    assert seqs(store, 4)[:3] == [4, 5, 6]
    assert [m.seq for m in store.read("orders", 4, 2)] == [4, 5]
    assert store.read("orders", 11, 5) == []
    assert store.read("orders", 1, 0) == []
    assert [m.seq for m in store.read("orders", 1, 10, max_bytes=35)] == [1, 2, 3]
    assert [m.seq for m in store.read("orders", 1, 10, max_bytes=30)] == [1, 2, 3]
    assert [m.seq for m in store.read("orders", 1, 10, max_bytes=5)] == [1]  # at least one
    store.add_stream(cfg("small", max_msgs=3))
    fill(store, 10, name="small")
    assert seqs(store, 0, "small") == [8, 9, 10]  # below first_seq starts at first_seq
    assert [m.seq for m in store.read("small", 2, 2)] == [8, 9]


def test_info_counts_messages_and_payload_bytes(store: StreamStore) -> None:
    store.add_stream(cfg())
    store.append_batch("orders", [msg(b"abc"), msg(b""), msg(b"hello")], 0.0)
    info = store.info("orders")
    assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (1, 3, 3, 8)
    assert info.config == cfg()


def test_delete_stream(store: StreamStore) -> None:
    store.add_stream(cfg())
    fill(store, 3)
    store.add_consumer("orders", ConsumerConfig("c"))
    store.delete_stream("orders")
    with pytest.raises(StreamNotFound):
        store.info("orders")
    assert store.streams() == []
    store.add_stream(cfg())  # a new stream of the same name starts afresh
    assert store.info("orders").last_seq == 0
    assert store.read("orders", 0, 10) == []
    assert store.info("orders").consumers == ()


# -- retention --------------------------------------------------------------------------


def test_max_msgs_removes_oldest(store: StreamStore) -> None:
    store.add_stream(cfg(max_msgs=3))
    fill(store, 2, size=2)
    fill(store, 3, size=2)
    info = store.info("orders")
    assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (3, 5, 3, 6)
    assert seqs(store) == [3, 4, 5]


def test_max_bytes_removes_oldest(store: StreamStore) -> None:
    store.add_stream(cfg(max_bytes=25))
    fill(store, 4, size=10)
    info = store.info("orders")
    assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (3, 4, 2, 20)
    store.append_batch("orders", [msg(b"y" * 30)], 1.0)  # too big to keep at all
    info = store.info("orders")
    assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (6, 5, 0, 0)
    assert store.read("orders", 0, 10) == []


def test_max_age_on_expire_and_on_append(store: StreamStore) -> None:
    store.add_stream(cfg(max_age=10.0))
    store.add_stream(cfg("forever"))
    fill(store, 2, now=100.0)
    fill(store, 3, now=105.0)
    fill(store, 1, now=100.0, name="forever")
    assert store.expire(109.9) == 0
    assert store.expire(110.0) == 2
    assert seqs(store) == [3, 4, 5]
    assert store.info("forever").messages == 1
    fill(store, 1, now=115.0)  # the append itself drops what has aged out
    info = store.info("orders")
    assert (info.first_seq, info.last_seq, info.messages) == (6, 6, 1)
    assert store.expire(200.0) == 1
    info = store.info("orders")
    assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (7, 6, 0, 0)
    assert store.append_batch("orders", [msg()], 201.0) == [Appended(7, False)]


def test_expire_of_some_streams_leaves_the_others(store: MirroredStore) -> None:
    store.add_stream(cfg(max_age=10.0))
    store.add_stream(cfg("replicated", max_age=10.0))
    fill(store, 2, now=100.0)
    fill(store, 2, now=100.0, name="replicated")
    assert not store.aged("orders", 109.9)
    assert store.aged("orders", 110.0)
    assert store.aged("replicated", 110.0)
    assert store.expire(110.0, ["orders"]) == 2
    assert (store.info("orders").messages, store.info("replicated").messages) == (0, 2)
    assert not store.aged("orders", 500.0)  # nothing left to age
    assert store.aged("replicated", 110.0)
    with pytest.raises(StreamNotFound):
        store.expire(110.0, ["nowhere"])


# -- dedupe -----------------------------------------------------------------------------


def test_dedupe_within_window(store: StreamStore) -> None:
    store.add_stream(cfg(dedupe_window=60.0))
    assert store.append_batch("orders", [msg(b"a", b"id1"), msg(b"b", b"id2")], 0.0) == [
        Appended(1, False),
        Appended(2, False),
    ]
    assert store.append_batch("orders", [msg(b"c", b"id2"), msg(b"d"), msg(b"e")], 59.0) == [
        Appended(2, True),
        Appended(3, False),
        Appended(4, False),  # messages without an id are never duplicates
    ]
    assert [m.payload for m in store.read("orders", 0, 10)] == [b"a", b"b", b"d", b"e"]
    assert store.info("orders").bytes == 4


def test_dedupe_within_one_batch(store: StreamStore) -> None:
    store.add_stream(cfg())
    got = store.append_batch("orders", [msg(b"a", b"k"), msg(b"b"), msg(b"c", b"k")], 0.0)
    assert got == [Appended(1, False), Appended(2, False), Appended(1, True)]
    assert store.info("orders").last_seq == 2


def test_dedupe_forgotten_after_window(store: StreamStore) -> None:
    store.add_stream(cfg(dedupe_window=60.0))
    store.add_stream(cfg("none", dedupe_window=0.0))
    store.append_batch("orders", [msg(b"a", b"k1"), msg(b"b", b"k2")], 0.0)
    # past the window an id is new again, whether or not expire() ran in between
    assert store.append_batch("orders", [msg(b"c", b"k1")], 60.0) == [Appended(3, False)]
    assert store.append_batch("orders", [msg(b"c", b"k1")], 61.0) == [Appended(3, True)]
    store.expire(60.0)
    assert store.append_batch("orders", [msg(b"d", b"k2")], 61.0) == [Appended(4, False)]
    got = store.append_batch("none", [msg(b"a", b"k"), msg(b"a", b"k")], 0.0)
    assert got == [Appended(1, False), Appended(2, False)]


def test_dedupe_outlives_the_message(store: StreamStore) -> None:
    store.add_stream(cfg(max_msgs=1))
    store.append_batch("orders", [msg(b"a", b"k"), msg(b"b")], 0.0)
    assert store.append_batch("orders", [msg(b"a", b"k")], 1.0) == [Appended(1, True)]


# -- consumers --------------------------------------------------------------------------


def test_consumer_delivers_and_acks(store: StreamStore) -> None:
    store.add_stream(cfg())
    fill(store, 5)
    info = store.add_consumer("orders", ConsumerConfig("c"))
    assert (info.next_seq, info.ack_floor, info.pending, info.dropped) == (1, 0, 0, 0)
    got = store.consumer_next("orders", "c", 3, 0.0)
    assert [(d.message.seq, d.delivery) for d in got] == [(1, 1), (2, 1), (3, 1)]
    assert got[0].message.payload == bytes([0])
    info = store.consumer_info("orders", "c")
    assert (info.next_seq, info.ack_floor, info.pending) == (4, 0, 3)
    assert store.consumer_ack("orders", "c", [2, 2, 99, 4]) == 1  # only 2 was pending
    assert store.consumer_info("orders", "c").ack_floor == 0
    assert store.consumer_ack("orders", "c", [1]) == 1
    assert store.consumer_ack("orders", "c", [1]) == 0
    info = store.consumer_info("orders", "c")
    assert (info.ack_floor, info.pending) == (2, 1)
    got = store.consumer_next("orders", "c", 10, 1.0)
    assert [(d.message.seq, d.delivery) for d in got] == [(4, 1), (5, 1)]
    assert store.consumer_next("orders", "c", 10, 2.0) == []
    assert store.consumer_ack("orders", "c", [3, 4, 5]) == 3
    info = store.consumer_info("orders", "c")
    assert (info.next_seq, info.ack_floor, info.pending) == (6, 5, 0)
    assert store.info("orders").consumers == ("c",)


def test_add_consumer_is_idempotent(store: StreamStore) -> None:
    store.add_stream(cfg())
    store.add_consumer("orders", ConsumerConfig("c", ack_wait=5.0))
    fill(store, 2)
    store.consumer_next("orders", "c", 1, 0.0)
    info = store.add_consumer("orders", ConsumerConfig("c", ack_wait=5.0))
    assert (info.next_seq, info.pending) == (2, 1)  # the existing consumer, position kept
    with pytest.raises(ConsumerExists, match="different configuration"):
        store.add_consumer("orders", ConsumerConfig("c", ack_wait=6.0))
    assert isinstance(ConsumerExists("s", "c"), StoreError)


def test_redelivery_after_ack_wait(store: StreamStore) -> None:
    store.add_stream(cfg())
    store.add_consumer("orders", ConsumerConfig("c", ack_wait=10.0))
    fill(store, 3)
    store.consumer_next("orders", "c", 3, 0.0)
    store.consumer_ack("orders", "c", [2])
    assert store.consumer_next("orders", "c", 10, 9.9) == []
    fill(store, 1, now=10.0)
    got = store.consumer_next("orders", "c", 10, 10.0)
    assert [(d.message.seq, d.delivery) for d in got] == [(1, 2), (3, 2), (4, 1)]
    assert store.consumer_next("orders", "c", 10, 19.9) == []
    got = store.consumer_next("orders", "c", 1, 20.0)  # max_count holds back the rest
    assert [(d.message.seq, d.delivery) for d in got] == [(1, 3)]
    got = store.consumer_next("orders", "c", 10, 20.0)
    assert [(d.message.seq, d.delivery) for d in got] == [(3, 3), (4, 2)]
    assert store.consumer_info("orders", "c").pending == 3


def test_max_deliver_gives_up(store: StreamStore) -> None:
    store.add_stream(cfg())
    store.add_consumer("orders", ConsumerConfig("c", ack_wait=1.0, max_deliver=2))
    fill(store, 2)
    assert len(store.consumer_next("orders", "c", 10, 0.0)) == 2
    store.consumer_ack("orders", "c", [2])
    got = store.consumer_next("orders", "c", 10, 1.0)
    assert [(d.message.seq, d.delivery) for d in got] == [(1, 2)]
    assert store.consumer_next("orders", "c", 10, 2.0) == []
    info = store.consumer_info("orders", "c")
    assert (info.pending, info.dropped, info.ack_floor, info.next_seq) == (0, 1, 2, 3)
    assert store.consumer_ack("orders", "c", [1]) == 0  # given up: no longer pending


def test_start_seq(store: StreamStore) -> None:
    store.add_stream(cfg())
    fill(store, 5)
    store.add_consumer("orders", ConsumerConfig("late", start_seq=4))
    store.add_consumer("orders", ConsumerConfig("ahead", start_seq=8))
    info = store.consumer_info("orders", "late")
    assert (info.next_seq, info.ack_floor) == (4, 3)
    got = store.consumer_next("orders", "late", 10, 0.0)
    assert [d.message.seq for d in got] == [4, 5]
    assert store.consumer_next("orders", "ahead", 10, 0.0) == []
    fill(store, 3)
    assert [d.message.seq for d in store.consumer_next("orders", "ahead", 10, 0.0)] == [8]


def test_retention_skips_for_consumers(store: StreamStore) -> None:
    store.add_stream(cfg(max_msgs=3))
    store.add_consumer("orders", ConsumerConfig("c", ack_wait=1.0))
    fill(store, 2)
    assert len(store.consumer_next("orders", "c", 2, 0.0)) == 2
    fill(store, 5)  # holds 5..7 now; the pending 1 and 2 are gone
    info = store.consumer_info("orders", "c")
    assert (info.next_seq, info.ack_floor, info.pending) == (5, 4, 0)
    got = store.consumer_next("orders", "c", 10, 5.0)
    assert [(d.message.seq, d.delivery) for d in got] == [(5, 1), (6, 1), (7, 1)]
    assert store.consumer_ack("orders", "c", [1, 2]) == 0


def test_unknown_consumer(store: StreamStore) -> None:
    store.add_stream(cfg())
    store.add_consumer("orders", ConsumerConfig("c"))
    with pytest.raises(ConsumerNotFound, match="no consumer named 'x' on stream 'orders'"):
        store.consumer_info("orders", "x")
    for call in (
        lambda: store.consumer_next("orders", "x", 1, 0.0),
        lambda: store.consumer_ack("orders", "x", [1]),
        lambda: store.delete_consumer("orders", "x"),
    ):
        with pytest.raises(ConsumerNotFound):
            call()
    store.delete_consumer("orders", "c")
    with pytest.raises(ConsumerNotFound):
        store.consumer_info("orders", "c")
    assert store.info("orders").consumers == ()


# -- SQLite only ------------------------------------------------------------------------


def test_sqlite_reopen_after_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"
    dead = SqliteStreamStore(path)
    dead.add_stream(cfg(max_msgs=100))
    dead.add_stream(cfg("other", max_age=5.0))
    dead.append_batch("orders", [msg(b"a", b"id-a"), msg(b"b"), msg(b"c")], 10.0)
    dead.append_batch("other", [msg(b"o")], 10.0)
    dead.add_consumer("orders", ConsumerConfig("c", ack_wait=30.0, max_deliver=3))
    dead.consumer_next("orders", "c", 2, 10.0)
    dead.consumer_ack("orders", "c", [2])
    dead.consumer_next("orders", "c", 2, 40.0)  # seq 1 redelivered, then 3 delivered
    # no close(): the second store sees only what the first committed
    alive = SqliteStreamStore(path)
    try:
        assert [c.name for c in alive.streams()] == ["orders", "other"]
        assert alive.streams()[0] == cfg(max_msgs=100)
        info = alive.info("orders")
        assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (1, 3, 3, 3)
        assert alive.append_batch("orders", [msg(b"a", b"id-a"), msg(b"d")], 20.0) == [
            Appended(1, True),
            Appended(4, False),
        ]
        c = alive.consumer_info("orders", "c")
        assert (c.next_seq, c.ack_floor, c.pending, c.dropped) == (4, 0, 2, 0)
        got = alive.consumer_next("orders", "c", 10, 70.0)
        assert [(d.message.seq, d.delivery, d.message.payload) for d in got] == [
            (1, 3, b"a"),
            (3, 2, b"c"),
            (4, 1, b"d"),
        ]
        assert alive.expire(15.0) == 1  # other's max_age counts from the stored time
        assert alive.info("other").first_seq == 2
    finally:
        alive.close()
        dead.close()


def test_sqlite_pragmas(tmp_path: Path) -> None:
    for fsync, synchronous in (("normal", 1), ("always", 2)):
        s = SqliteStreamStore(tmp_path / f"{fsync}.db", fsync=fsync)
        s.close()
        db = sqlite3.connect(tmp_path / f"{fsync}.db")
        try:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            db.close()
        s = SqliteStreamStore(tmp_path / f"{fsync}.db", fsync=fsync)
        try:
            assert s._db.execute("PRAGMA synchronous").fetchone()[0] == synchronous
            assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            s.close()
    with pytest.raises(ValueError, match="fsync must be 'normal' or 'always'"):
        SqliteStreamStore(tmp_path / "x.db", fsync="sometimes")


def test_a_replicated_entry_commits_without_an_fsync_an_r1_append_with_one(
    tmp_path: Path,
) -> None:
    """With fsync="always" an R=1 append is fsynced (synchronous=FULL), but a replicated
    stream's entry is not: its Raft log was fsynced before any ack, and the entry is
    applied again from that log after a power loss (the store's ``applied``)."""
    s = SqliteStreamStore(tmp_path / "always.db", fsync="always")
    try:
        s.add_stream(cfg("r3"))

        def synchronous() -> int:
            return int(s._db.execute("PRAGMA synchronous").fetchone()[0])

        with s.raft_entry("r3", 7):
            assert synchronous() == 1  # NORMAL: no fsync at this commit
            s.append_batch("r3", [msg(b"a")], 1.0)
        assert synchronous() == 2  # FULL again, for what is not replicated
        assert s.applied("r3") == 7
        with pytest.raises(RuntimeError), s.raft_entry("r3", 8):
            raise RuntimeError("an apply that fails")
        assert synchronous() == 2
        assert s.applied("r3") == 7
    finally:
        s.close()


def test_a_checkpoint_from_another_thread_copies_the_wal_while_the_store_writes(
    tmp_path: Path,
) -> None:
    """SqliteStreamStore.checkpoint, run in a worker thread beside the store's writer:
    what the WAL held is in the database file after it, and the store goes on."""
    s = SqliteStreamStore(tmp_path / "s.db", fsync="always")
    try:
        s.add_stream(cfg("big"))
        for _ in range(20):
            s.append_batch("big", [msg(bytes(4000)) for _ in range(10)], 1.0)
        database = tmp_path / "s.db"
        assert s.wal_bytes() > 800_000
        assert database.stat().st_size < 100_000  # the appends are in the WAL only
        worker = threading.Thread(target=s.checkpoint)
        worker.start()
        s.append_batch("big", [msg(b"during")], 1.0)
        worker.join()
        assert database.stat().st_size > 800_000  # copied into the database file
        assert s.info("big").last_seq == 201
    finally:
        s.close()
    assert SqliteStreamStore(tmp_path / "s.db").info("big").last_seq == 201


def test_sqlite_refuses_another_schema_version(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(StoreError, match="schema version 99"):
        SqliteStreamStore(tmp_path / "old.db")


def test_sqlite_failed_batch_leaves_no_trace(tmp_path: Path) -> None:
    s = SqliteStreamStore(tmp_path / "s.db")
    try:
        s.add_stream(cfg())
        s.append_batch("orders", [msg(b"a", b"k")], 0.0)
        # The disk refuses the write (a trigger stands in for a full disk): the batch
        # rolls back, and the mirror, which had already counted it, is reloaded.
        other = sqlite3.connect(tmp_path / "s.db")
        other.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON blocks"
            " BEGIN SELECT RAISE(ABORT, 'no room'); END"
        )
        other.commit()
        with pytest.raises(StoreError, match="no room"):
            s.append_batch("orders", [msg(b"b", b"j"), msg(b"c")], 1.0)
        other.execute("DROP TRIGGER refuse")
        other.commit()
        other.close()
        assert s.info("orders").last_seq == 1  # the mirror was reloaded from the database
        assert s.append_batch("orders", [msg(b"b", b"j")], 2.0) == [Appended(2, False)]
    finally:
        s.close()


def test_read_blocks_holds_what_read_does(store: StreamStore) -> None:
    store.add_stream(cfg())
    headers = b"NATS/1.0\r\nTrace: 7\r\n\r\n"
    with_headers = NewMessage(OTHER, DST, b"bb", b"g", 4, b"", headers)
    store.append_batch("orders", [msg(b"a" * 3), with_headers], 5.0)
    fill(store, 3, 6.0, size=2)
    assert rows_of(store.read_blocks("orders", 2, 3)) == [
        (2, 5.0, OTHER, DST, b"g", 4, b"bb", headers),
        (3, 6.0, SRC, DST, b"", 0, b"\x00\x00", b""),
        (4, 6.0, SRC, DST, b"", 0, b"\x01\x01", b""),
    ]
    assert rows_of(store.read_blocks("orders", 1, 3)) == rows(store, 1, 3)
    assert rows_of(store.read_blocks("orders", 1, 10, max_bytes=1)) == rows(store, 1, 1)
    assert store.read_blocks("orders", 9, 10) == []


# -- the SQLite store's blocks ------------------------------------------------------------


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=12),
        min_size=1,
        max_size=8,
    ),
    max_msgs=st.integers(0, 25),
    reads=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 30)), max_size=6),
)
def test_sqlite_blocks_read_trim_and_reopen_like_the_memory_store(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    batches: list[list[tuple[int, int]]],
    max_msgs: int,
    reads: list[tuple[int, int]],
) -> None:
    """Batches split into blocks of at most 3 messages / 50 bytes; retention cuts blocks in
    the middle; reads start and end anywhere; publish ids repeat across batches. After
    every batch and after a reopen, the SQLite store answers what the memory store does --
    but for publish ids: after a reopen it knows those of the messages it still holds."""
    monkeypatch.setattr(store_blocks, "BLOCK_MESSAGES", 3)
    monkeypatch.setattr(store_blocks, "BLOCK_BYTES", 50)
    path = tmp_path_factory.mktemp("blocks") / "s.db"
    oracle, disk = MemoryStreamStore(), SqliteStreamStore(path)
    stored_as: dict[bytes, int] = {}
    try:
        for s in (oracle, disk):
            s.add_stream(cfg(max_msgs=max_msgs))
        for now, batch in enumerate(batches):
            messages = [msg(b"p" * size, b"id%d" % pid if pid else b"") for size, pid in batch]
            appended = disk.append_batch("orders", messages, now)
            assert appended == oracle.append_batch("orders", messages, now)
            for m, result in zip(messages, appended, strict=True):
                if m.publish_id and not result.duplicate:
                    stored_as[m.publish_id] = result.seq
            assert disk.info("orders") == oracle.info("orders")
        disk.close()
        disk = SqliteStreamStore(path)
        info = disk.info("orders")
        assert info == oracle.info("orders")
        for from_seq, count in reads:
            assert disk.read("orders", from_seq, count) == oracle.read("orders", from_seq, count)
            assert rows_of(disk.read_blocks("orders", from_seq, count)) == rows(
                oracle, from_seq, count
            )
            for max_bytes in (1, 7, 60):
                # Whole blocks, or a first one cut down to fit: a prefix of read's rows.
                got = rows_of(disk.read_blocks("orders", from_seq, count, max_bytes))
                assert got == rows(oracle, from_seq, count)[: len(got)]
                assert len(got) == 1 or sum(len(r[-1]) for r in got) <= max_bytes
                assert bool(got) == bool(rows(oracle, from_seq, count))
        expected, next_seq = [], info.last_seq + 1
        for pid in range(1, 7):
            seq = stored_as.get(b"id%d" % pid, 0)
            if seq >= info.first_seq:
                expected.append(Appended(seq, True))
            else:
                expected.append(Appended(next_seq, False))
                next_seq += 1
        again = [msg(b"again", b"id%d" % pid) for pid in range(1, 7)]
        assert disk.append_batch("orders", again, len(batches)) == expected
    finally:
        disk.close()


def test_a_read_only_reader_sees_what_the_store_committed(tmp_path: Path) -> None:
    """Another process's view of the broker's file (the Spark source's local reads)."""
    store = SqliteStreamStore(tmp_path / "s.db")
    reader = SqliteStreamReader(tmp_path / "s.db")
    try:
        store.add_stream(cfg(max_msgs=6))
        fill(store, 4, 1.0, size=3)
        assert reader.read_blocks("orders", 1, 10) == store.read_blocks("orders", 1, 10)
        fill(store, 4, 2.0, size=2)  # 8 in all; max_msgs trims seqs 1-2
        assert [r[0] for r in rows_of(reader.read_blocks("orders", 1, 10))] == [3, 4, 5, 6, 7, 8]
        assert reader.read_blocks("orders", 4, 2) == store.read_blocks("orders", 4, 2)
        assert reader.read_blocks("orders", 9, 10) == []
        with pytest.raises(StreamNotFound):
            reader.read_blocks("nope", 1, 10)
    finally:
        reader.close()
        store.close()


def test_a_batch_of_new_publish_ids_and_one_with_a_repeat_number_alike(store: StreamStore) -> None:
    """The whole-batch path (every id new) and the per-message one (a repeat, an id twice
    in one batch, a message without an id) give the seqs and duplicates of the rule."""
    store.add_stream(cfg())
    fresh = [msg(b"r%d" % i, b"job/%d" % i) for i in range(5)]
    assert store.append_batch("orders", fresh, 1.0) == [Appended(i, False) for i in range(1, 6)]
    mixed = [msg(b"a", b"job/9"), msg(b"b", b"job/2"), msg(b"c"), msg(b"d", b"job/9")]
    assert store.append_batch("orders", mixed, 2.0) == [
        Appended(6, False),
        Appended(3, True),
        Appended(7, False),
        Appended(6, True),
    ]
    info = store.info("orders")
    assert (info.first_seq, info.last_seq, info.messages, info.bytes) == (1, 7, 7, 12)
    assert [m.payload for m in store.read("orders", 1, 10)] == [
        b"r0", b"r1", b"r2", b"r3", b"r4", b"a", b"c",
    ]  # fmt: skip


# -- a replicated stream's applied index --------------------------------------------------------


def test_append_entry_records_the_raft_index_with_the_messages(
    store: StreamStore, tmp_path: Path
) -> None:
    store.add_stream(cfg())
    assert store.applied("orders") == 0
    store.append_entry("orders", [msg(b"a", b"p1"), msg(b"b")], 5.0, 7)
    store.append_entry("orders", [msg(b"a", b"p1")], 6.0, 9)  # a resend: deduped at apply
    assert store.applied("orders") == 9
    assert [(m.seq, m.payload, m.stored_at) for m in store.read("orders", 1, 10)] == [
        (1, b"a", 5.0),
        (2, b"b", 5.0),
    ]
    if isinstance(store, SqliteStreamStore):
        store.close()
        again = SqliteStreamStore(tmp_path / "s.db")
        assert again.applied("orders") == 9  # a restart applies each entry once
        again.delete_stream("orders")
        again.add_stream(cfg())
        assert again.applied("orders") == 0  # a new stream of the name starts over
        again.close()
