"""StoreCopies on its own: the answers a replica copied from sends (bounded chunks, the
image with the last of them or alone after them), and what the copying replica takes
(only the answer it asked for, from the broker it asked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshbus.broker.replication.copies import StoreCopies
from meshbus.errors import FrameTooLarge
from meshbus.protocol.control import RaftChunkBody, RaftFetchBody
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import NewMessage, StreamConfig

GROUP = bytes([2]) + bytes(15)


class Sent:
    """The frames a StoreCopies sends; without ``image_fits``, an answer with an image
    is too large for a frame."""

    def __init__(self, image_fits: bool = True) -> None:
        self.image_fits = image_fits
        self.fetches: list[tuple[str, str, RaftFetchBody]] = []
        self.chunks: list[tuple[str, str, RaftChunkBody]] = []
        self.installed: list[str] = []

    def fetch(self, broker: str, group: str, body: RaftFetchBody) -> None:
        self.fetches.append((broker, group, body))

    def chunk(self, broker: str, group: str, body: RaftChunkBody) -> None:
        if body.image is not None and not self.image_fits:
            raise FrameTooLarge(1 << 30, 1 << 20)
        self.chunks.append((broker, group, body))


def copies_of(store: SqliteStreamStore, sent: Sent) -> StoreCopies:
    return StoreCopies(
        store=store,
        fetch=sent.fetch,
        chunk=sent.chunk,
        installed=sent.installed.append,
        chunk_bytes=3000,
        retry_ticks=10,
    )


@pytest.fixture
def source(tmp_path: Path) -> SqliteStreamStore:
    store = SqliteStreamStore(tmp_path / "source.db")
    store.add_stream(StreamConfig("orders", (GROUP,)))
    for i in range(10):  # blocks of 10 messages of 100 bytes: two a chunk
        messages = [NewMessage(bytes(16), GROUP, bytes(100)) for _ in range(10)]
        store.append_entry("orders", messages, 1000.0 + i, i + 1)
    return store


def test_chunks_are_bounded_and_the_image_comes_with_the_last(source) -> None:
    sent = Sent()
    copies = copies_of(source, sent)
    copies.serve("b2", "orders", RaftFetchBody(1))
    ((_, _, first),) = sent.chunks
    assert [b.first for b in first.blocks] == [1, 11]
    assert first.image is None
    copies.serve("b2", "orders", RaftFetchBody(91))
    last = sent.chunks[-1][2]
    assert [b.first for b in last.blocks] == [91]
    assert last.image is not None
    assert last.image.applied == 10
    copies.serve("b2", "gone", RaftFetchBody(1))
    assert sent.chunks[-1][2].missing


def test_an_image_too_large_to_go_with_blocks_goes_alone_next(source) -> None:
    sent = Sent(image_fits=False)
    copies = copies_of(source, sent)
    copies.serve("b2", "orders", RaftFetchBody(91))
    assert [b.first for b in sent.chunks[-1][2].blocks] == [91]
    assert sent.chunks[-1][2].image is None
    copies.serve("b2", "orders", RaftFetchBody(101))  # the image alone: too large too
    assert len(sent.chunks) == 1  # nothing sent (logged), never an empty answer


def test_a_copy_takes_only_what_it_asked_for(source, tmp_path: Path) -> None:
    target = SqliteStreamStore(tmp_path / "target.db")
    target.add_stream(StreamConfig("orders", (GROUP,)))
    sent, answers = Sent(), Sent()
    copying, serving = copies_of(target, sent), copies_of(source, answers)
    copying.want("orders", "b1", 10, now=0)
    assert [(b, f.from_seq) for b, _, f in sent.fetches] == [("b1", 1)]
    serving.serve("b3", "orders", RaftFetchBody(1))
    stray = answers.chunks[-1][2]
    copying.received("b3", "orders", stray, now=1)  # not the broker asked
    assert target.held_last("orders") == 0
    copying.want("orders", "b1", 10, now=5)  # asked 5 ticks ago: not again yet
    assert len(sent.fetches) == 1
    serving.serve("b1", "orders", RaftFetchBody(1))
    copying.received("b1", "orders", answers.chunks[-1][2], now=6)
    copying.received("b1", "orders", answers.chunks[-1][2], now=6)  # repeated: ignored
    assert target.held_last("orders") == 20
    while copying.copying("orders"):
        _, _, fetch = sent.fetches[-1]
        serving.serve("b1", "orders", fetch)
        copying.received("b1", "orders", answers.chunks[-1][2], now=7)
    assert sent.installed == ["orders"]
    assert target.read("orders", 1, 1000) == source.read("orders", 1, 1000)
    assert target.applied("orders") == 10
