"""Snapshots of a replicated stream: what a snapshot holds (``SnapshotMark``), and how
a replica that is sent one gets the stream's state (``StoreCopies``) -- docs/raft.md,
"Snapshots of a stream". When the log is compacted is meshbus.broker.replication.compaction.

A snapshot's data is not the stream's messages: those are in every replica's store
already, at the index it applied. It is a mark -- the index the store had applied and
the seqs it held when the log was compacted, which may be past the snapshot's own
index (the store applies each entry once, so entries between the two are skipped when
they come again). A replica sent a snapshot it cannot take from its own store (its
store is behind the snapshot's index: it was far behind, or it is new) *copies* the
store from the replica that sent it, over the same peer link: the blocks past the last
one it holds, a bounded chunk per answer and one request in flight (the flow control:
it asks for the next chunk once it wrote the last), then, once it has them all, the
stream's image -- counters, consumers, the index it is at -- installed at once
(meshbus.storage.images). Only then does the driver step the snapshot into the Raft
node, so the replica acknowledges nothing it does not hold. What the copied replica
holds is what its store holds (``first_seq..last_seq``): retention may have removed
older messages, as it did on every replica.

A copy is resumable: the blocks copied stay staged, and a snapshot from another leader
goes on from them (the request is sent to whoever sent the latest snapshot, again
after ``retry_ticks`` without an answer). A replica that catches up by ordinary
entries after all (a new leader that still held them) drops what it staged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from meshbus.errors import FrameTooLarge
from meshbus.protocol.control import (
    RaftBlockBody,
    RaftChunkBody,
    RaftConsumerImageBody,
    RaftFetchBody,
    RaftImageBody,
)
from meshbus.storage.errors import StoreError
from meshbus.storage.images import ConsumerImage, CopyMismatch, StreamImage
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import ConsumerConfig

log = logging.getLogger("meshbus.broker")


class SnapshotMark(msgspec.Struct, array_like=True, frozen=True):
    """A replicated stream's snapshot data: its store when the log was compacted -- the
    Raft index it had applied (at or past the snapshot's) and the seqs it held."""

    applied: int
    first_seq: int
    last_seq: int


_encode = msgspec.msgpack.Encoder().encode


def encode_mark(applied: int, first_seq: int, last_seq: int) -> bytes:
    return _encode(SnapshotMark(applied, first_seq, last_seq))


@dataclass
class _Copy:
    source: str  # the broker asked: the sender of the latest snapshot
    floor: int  # the snapshot's index: the image installed must be at or past it
    next_seq: int  # the first seq not held yet: what was asked for
    asked_at: int  # the driver's tick of the request


class StoreCopies:
    """The stores being copied here, and the answers to the replicas copying from here.

    ``fetch(broker, group, body)`` and ``chunk(broker, group, body)`` send the two frames
    (``chunk`` raises FrameTooLarge past the frame limit); ``installed(group)`` is told
    when a copy is in place (the driver steps the snapshot it held)."""

    def __init__(
        self,
        *,
        store: SqliteStreamStore,
        fetch: Callable[[str, str, RaftFetchBody], None],
        chunk: Callable[[str, str, RaftChunkBody], None],
        installed: Callable[[str], None],
        chunk_bytes: int,
        retry_ticks: int,
    ) -> None:
        self._store = store
        self._fetch = fetch
        self._chunk = chunk
        self._installed = installed
        self._chunk_bytes = chunk_bytes
        self._retry_ticks = retry_ticks
        self._copies: dict[str, _Copy] = {}
        self.copied_blocks = 0
        self.served_blocks = 0

    def copying(self, group: str) -> bool:
        return group in self._copies

    # -- the replica that copies ----------------------------------------------------------

    def want(self, group: str, source: str, floor: int, now: int) -> None:
        """A snapshot at ``floor`` came from ``source`` and this store is behind it: copy
        the store from ``source`` (or go on copying; ask again if the last request went
        elsewhere or unanswered for ``retry_ticks``)."""
        copy = self._copies.get(group)
        if copy is None:
            start = self._store.held_last(group) + 1
            copy = self._copies[group] = _Copy(source, floor, start, now)
            log.warning(
                "a replicated stream's log was compacted past this replica: it copies the "
                "stream from the leader",
                extra={"stream": group, "from": source, "seq": start, "index": floor},
            )
            self._ask(group, copy, now)
            return
        copy.floor = floor
        if source != copy.source or now - copy.asked_at >= self._retry_ticks:
            copy.source = source
            self._ask(group, copy, now)

    def abort(self, group: str) -> None:
        """The replica catches up by entries after all: what was staged goes."""
        if self._copies.pop(group, None) is not None and group in self._store:
            self._store.discard_staged(group)

    def received(self, sender: str, group: str, chunk: RaftChunkBody, now: int) -> None:
        copy = self._copies.get(group)
        if copy is None or sender != copy.source or chunk.from_seq != copy.next_seq:
            return  # late, repeated, or from a broker no longer asked
        if chunk.missing:
            log.warning(
                "the replica a stream was to be copied from holds no such stream",
                extra={"stream": group, "from": sender},
            )
            return  # asked again once a snapshot comes from another
        rows = [(b.first, b.last, b.stored_at, b.crc, b.data) for b in chunk.blocks]
        try:
            held = self._store.stage(group, rows)
            self.copied_blocks += len(rows)
            copy.next_seq = held + 1
            image = chunk.image
            if image is None:
                self._ask(group, copy, now)
            elif image.applied >= copy.floor:
                self._store.install(group, image_from(image))
                del self._copies[group]
                log.warning(
                    "a replicated stream was copied from the leader",
                    extra={"stream": group, "from": sender, "index": image.applied},
                )
                self._installed(group)
            # else: the source is behind the snapshot wanted; asked again at the retry
        except CopyMismatch as exc:
            log.error(
                "a copy of a replicated stream did not fit; it starts again",
                extra={"stream": group, "from": sender, "error": str(exc)},
            )
            self._store.discard_staged(group)
            copy.next_seq = self._store.held_last(group) + 1
        except StoreError as exc:
            log.error(
                "a copy of a replicated stream could not be stored",
                extra={"stream": group, "error": str(exc)},
            )

    def _ask(self, group: str, copy: _Copy, now: int) -> None:
        copy.asked_at = now
        self._fetch(copy.source, group, RaftFetchBody(copy.next_seq))

    # -- the replica copied from ----------------------------------------------------------

    def serve(self, sender: str, group: str, fetch: RaftFetchBody) -> None:
        """Answer a replica's request: blocks from ``fetch.from_seq`` on, at most
        ``chunk_bytes`` of them, and the stream's image once they reach its end."""
        store = self._store
        if group not in store:
            self._chunk(sender, group, RaftChunkBody(fetch.from_seq, missing=True))
            return
        try:
            rows = store.copy_out(group, fetch.from_seq, self._chunk_bytes)
        except StoreError as exc:
            log.error(
                "a replica's copy of a stream cannot be served",
                extra={"stream": group, "to": sender, "error": str(exc)},
            )
            return
        blocks = [RaftBlockBody(*row) for row in rows]
        self.served_blocks += len(blocks)
        # Blocks alone: the image alone follows in the next answer (never an empty one).
        answers = [RaftChunkBody(fetch.from_seq, blocks)] if blocks else []
        if not rows or rows[-1][1] >= store.info(group).last_seq:
            image = image_body(store.image(group))
            answers.insert(0, RaftChunkBody(fetch.from_seq, blocks, image))
        for answer in answers:
            try:
                self._chunk(sender, group, answer)
                return
            except FrameTooLarge:
                continue
        log.error(
            "a replica's copy of a stream does not fit in a frame (its consumers hold too "
            "many pending deliveries, or it has publish ids of too many messages retention "
            "removed); raise --max-frame on every broker",
            extra={"stream": group, "to": sender},
        )


def image_body(image: StreamImage) -> RaftImageBody:
    return RaftImageBody(
        image.applied,
        image.first_seq,
        image.last_seq,
        image.payload_bytes,
        [
            RaftConsumerImageBody(
                c.config.name,
                c.config.ack_wait,
                c.config.max_deliver,
                c.config.start_seq,
                c.next_seq,
                c.dropped,
                c.config.owner,
                c.pending,
            )
            for c in image.consumers
        ],
        image.publish_ids,
    )


def image_from(body: RaftImageBody) -> StreamImage:
    """The image a replica was sent; CopyMismatch if it cannot be one (its consumers'
    names and settings are checked as any consumer's)."""
    try:
        consumers = [
            ConsumerImage(
                ConsumerConfig(c.name, c.ack_wait, c.max_deliver, c.start_seq, c.owner),
                c.next_seq,
                c.dropped,
                [(seq, count, due) for seq, count, due in c.pending],
            )
            for c in body.consumers
        ]
    except ValueError as exc:
        raise CopyMismatch(f"a copied consumer is not one: {exc}") from exc
    if body.first_seq > body.last_seq + 1:
        raise CopyMismatch(f"a copied stream of seqs {body.first_seq}..{body.last_seq}")
    return StreamImage(
        body.applied,
        body.first_seq,
        body.last_seq,
        body.payload_bytes,
        consumers,
        [(at, publish_id, seq) for at, publish_id, seq in body.publish_ids],
    )
