"""A stream's store copied from one SQLite store to another (meshbus.storage.images):
blocks staged past the stream, then its image installed; the copy equals the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshbus.storage.images import CopyMismatch
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import ConsumerConfig, NewMessage, StreamConfig

GROUP = bytes([2]) + bytes(15)


def cfg(**kw: object) -> StreamConfig:
    return StreamConfig("orders", (GROUP,), **kw)  # type: ignore[arg-type]


def batch(first: int, count: int, size: int = 100) -> list[NewMessage]:
    return [
        NewMessage(bytes(16), GROUP, b"%d" % n + bytes(size), publish_id=b"id%d" % n)
        for n in range(first, first + count)
    ]


def applied(store: SqliteStreamStore, batches: range, at: float = 1000.0) -> None:
    """Batch ``i`` as Raft entry ``i + 1``, each of 10 messages, as a replica applies."""
    for i in batches:
        store.append_entry("orders", batch(10 * i, 10), at + i, i + 1)


def everything(store: SqliteStreamStore) -> tuple[object, ...]:
    info = store.info("orders")
    return (
        info,
        store.read("orders", 1, 10_000),
        store.consumer_info("orders", "work"),
        store.applied("orders"),
        store.read_blocks("orders", 1, 10_000),
    )


def copy(source: SqliteStreamStore, target: SqliteStreamStore, chunk: int = 3000) -> int:
    """Copy ``source`` into ``target`` a chunk at a time; the chunks it took."""
    chunks = 0
    while True:
        rows = source.copy_out("orders", target.held_last("orders") + 1, chunk)
        target.stage("orders", rows)
        chunks += 1
        if not rows or rows[-1][1] >= source.info("orders").last_seq:
            target.install("orders", source.image("orders"))
            return chunks


@pytest.fixture
def pair(tmp_path: Path) -> tuple[SqliteStreamStore, SqliteStreamStore]:
    source = SqliteStreamStore(tmp_path / "source.db")
    target = SqliteStreamStore(tmp_path / "target.db")
    for store in (source, target):
        store.add_stream(cfg(max_msgs=150))
        store.add_consumer("orders", ConsumerConfig("work", ack_wait=30.0))
    return source, target


def test_a_store_behind_is_copied_from_where_it_is(pair) -> None:
    source, target = pair
    applied(source, range(30))
    source.consumer_next("orders", "work", 20, 2000.0)
    source.consumer_ack("orders", "work", [160, 161])
    applied(target, range(3))  # behind: what it holds is a prefix of the source's
    assert source.info("orders").first_seq == 151  # retention removed the rest
    assert copy(source, target) > 3  # the chunks are bounded
    assert everything(target) == everything(source)
    # The publish ids came too -- of the blocks copied, and of the messages retention
    # removed (in the image) --: a resend of either is a duplicate there as here.
    for entry, resent in ((31, batch(290, 1)), (32, batch(5, 1))):
        assert source.append_entry("orders", resent, 1100.0, entry)[0].duplicate
        assert target.append_entry("orders", resent, 1100.0, entry)[0].duplicate
    assert everything(target) == everything(source)


def test_blocks_staged_stay_out_of_the_stream_until_installed(pair) -> None:
    source, target = pair
    applied(source, range(10))
    rows = source.copy_out("orders", 1, 1 << 20)
    assert target.stage("orders", rows[:4]) == 40
    assert target.info("orders").last_seq == 0  # still the stream it was
    assert target.read("orders", 1, 100) == []
    assert target.held_last("orders") == 40
    assert target.stage("orders", rows) == 100  # a chunk sent again: no block twice
    target.discard_staged("orders")  # caught up by entries after all
    assert target.held_last("orders") == 0
    applied(target, range(2))
    assert target.read("orders", 1, 100) == source.read("orders", 1, 20)


def test_a_copy_a_restart_cut_short_is_dropped_at_open(pair, tmp_path: Path) -> None:
    source, target = pair
    applied(source, range(10))
    target.stage("orders", source.copy_out("orders", 1, 1 << 20))
    target.close()
    again = SqliteStreamStore(tmp_path / "target.db")
    assert again.held_last("orders") == 0
    applied(again, range(1))  # the next entry's blocks take their place
    assert again.info("orders").last_seq == 10


def test_what_does_not_fit_is_refused(pair) -> None:
    source, target = pair
    applied(source, range(10))
    rows = source.copy_out("orders", 1, 1 << 20)
    first, last, at, crc, data = rows[1]
    with pytest.raises(CopyMismatch, match="damaged"):
        target.stage("orders", [(first, last, at, crc ^ 1, data)])
    with pytest.raises(CopyMismatch, match="holds 10 messages"):
        target.stage("orders", [(first, last + 1, at, crc, data)])
    target.stage("orders", rows[:1])
    with pytest.raises(CopyMismatch, match="does not follow on"):  # inside one held
        target.stage("orders", [(5, 14, at, crc, data)])
    with pytest.raises(CopyMismatch, match="does not follow on"):  # a gap
        target.stage("orders", rows[2:3])
    with pytest.raises(CopyMismatch, match="do not cover"):  # seqs 11..100 are missing
        target.install("orders", source.image("orders"))
    assert target.info("orders").last_seq == 0  # nothing changed
