"""Durable consumers of replicated streams: every change of their state is a command in
the stream's own Raft log.

A consumer's state is the R=1 store's -- its configuration, its position (``next_seq``),
its pending deliveries with their counts and deadlines, its drop count -- and every
change of it goes through the log: adding and deleting a consumer, each ``next`` (the
deliveries it records: the position moves, the seqs become pending) and each ``ack``.
The leader gathers the commands of one loop turn into one entry per stream (a few, when
they pass the entry limit) and answers each once its entry is committed and applied
here. Every replica applies the entry in log order with the store's own consumer calls,
in one transaction that also records the entry's index (``StreamStore.raft_entry``),
with the entry's clock as ``now``: the same calls on the same state, so the same state
on every replica, and a restart applies each entry once.

Why ``next`` is a command too, not only the acks: a delivery is answered only once it is
committed, so whatever a consumer was given is pending in the committed state of every
replica. After a leader change the new leader redelivers it once its ack wait is over --
unless its ack was committed -- and counts the delivery toward ``max_deliver``: the R=1
consumer's rules across a failover, not only across a restart.

A command refused at apply (no such consumer, another configuration) is refused alike on
every replica and changes nothing; the requester gets the error.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec

from meshbus.broker.replication.driver import ReplicationError
from meshbus.protocol.control import MAX_USER_NAME, Count, Seconds, Seq
from meshbus.storage.errors import StoreError
from meshbus.storage.store import ConsumerConfig, ConsumerInfo, Delivery, StreamStore

ADD, DELETE, NEXT, ACK = range(4)
# What a command's weight in an entry is counted as, besides its seqs (9 bytes each at
# most in msgpack).
_COMMAND_OVERHEAD = 128
_SEQ_BYTES = 9


class ConsumerCommand(msgspec.Struct, array_like=True, frozen=True):
    """One change of a consumer: ``op`` (ADD, DELETE, NEXT, ACK) and what it uses. The
    bounds are the STREAM request's it comes from, checked again when an entry is read."""

    op: Count
    consumer: str
    max_count: Count = 0  # NEXT
    seqs: list[Seq] = msgspec.field(default_factory=list)  # ACK
    ack_wait: Seconds = 30.0  # ADD: the consumer's configuration
    max_deliver: Count = 5
    start_seq: Seq = 0
    owner: Annotated[str, msgspec.Meta(max_length=MAX_USER_NAME)] = ""

    @classmethod
    def add(cls, config: ConsumerConfig) -> ConsumerCommand:
        return cls(
            ADD,
            config.name,
            ack_wait=config.ack_wait,
            max_deliver=config.max_deliver,
            start_seq=config.start_seq,
            owner=config.owner,
        )

    @classmethod
    def delete(cls, consumer: str) -> ConsumerCommand:
        return cls(DELETE, consumer)

    @classmethod
    def next(cls, consumer: str, max_count: int) -> ConsumerCommand:
        return cls(NEXT, consumer, max_count=max_count)

    @classmethod
    def ack(cls, consumer: str, seqs: list[int]) -> ConsumerCommand:
        return cls(ACK, consumer, seqs=seqs)

    def config(self) -> ConsumerConfig:
        """ADD's configuration; ValueError if it is not one (checked again at apply,
        alike on every replica)."""
        return ConsumerConfig(
            self.consumer, self.ack_wait, self.max_deliver, self.start_seq, self.owner
        )

    @property
    def weight(self) -> int:
        return (
            _COMMAND_OVERHEAD + len(self.consumer) + len(self.owner) + _SEQ_BYTES * len(self.seqs)
        )


class CommandBatch(msgspec.Struct, array_like=True, frozen=True):
    """An entry's commands, with who proposed them: ``proposer`` (drawn by each broker's
    ``ConsumerCommands`` when it starts) and its ``serial``, so that the broker that
    waits for their outcomes knows the entry when it applies it -- whichever leader
    committed it."""

    proposer: int
    serial: int
    commands: list[ConsumerCommand]


# What a command gives: ADD the consumer's info, DELETE None, NEXT the deliveries (read
# only by the broker that answers them), ACK how many were pending; or why it was refused.
Outcome = ConsumerInfo | list[Delivery] | int | None | StoreError | ValueError


def apply_commands(
    store: StreamStore,
    stream: str,
    commands: Sequence[ConsumerCommand],
    now: float,
    index: int,
    *,
    read: bool,
) -> list[Outcome]:
    """Apply Raft entry ``index`` of ``stream``, ``commands``, to ``store`` in one
    transaction recorded with the index; ``now`` is the entry's clock. ``read``: the
    deliveries of NEXT are read (this broker answers them), else only recorded. A
    StoreError of the store itself (a full disk) undoes the entry and is raised."""
    with store.raft_entry(stream, index):
        return [_apply(store, stream, command, now, read) for command in commands]


def _apply(
    store: StreamStore, stream: str, command: ConsumerCommand, now: float, read: bool
) -> Outcome:
    name = command.consumer
    try:
        if command.op == ADD:
            return store.add_consumer(stream, command.config())
        if command.op == DELETE:
            store.delete_consumer(stream, name)
            return None
        if command.op == NEXT:
            return store.consumer_next(stream, name, command.max_count, now, read=read)
        if command.op == ACK:
            return store.consumer_ack(stream, name, command.seqs)
        raise ValueError(f"unknown consumer command {command.op}")
    except (StoreError, ValueError) as exc:
        # Raised before the store changed anything: refused alike on every replica.
        return exc


class ConsumerCommands:
    """The leader's side: commands waiting for this turn's entries, and requests waiting
    for their outcomes."""

    def __init__(
        self,
        propose: Callable[[str, CommandBatch], asyncio.Future[int]],
        entry_limit: int,
        proposer: int | None = None,
    ) -> None:
        """``propose(stream, batch)`` proposes an entry of ``batch``; its future is done
        once the entry is applied here (or failed: not committed here)."""
        self._propose = propose
        self._entry_limit = entry_limit
        self.proposer = secrets.randbits(63) if proposer is None else proposer
        self._serial = 0
        self._queued: dict[str, list[tuple[ConsumerCommand, asyncio.Future[Outcome]]]] = (
            defaultdict(list)
        )
        self._waiting: dict[int, list[asyncio.Future[Outcome]]] = {}  # serial -> requests

    def submit(self, stream: str, command: ConsumerCommand) -> asyncio.Future[Outcome]:
        """Queue ``command`` for this turn's entry of ``stream``; its outcome once that is
        committed and applied here. An ACK of more seqs than an entry holds goes as a
        few commands, its outcome their sum."""
        loop = asyncio.get_running_loop()
        most = max(1, (self._entry_limit - _COMMAND_OVERHEAD) // _SEQ_BYTES // 2)
        if command.op == ACK and len(command.seqs) > most:
            seqs = command.seqs
            parts = [
                self.submit(stream, msgspec.structs.replace(command, seqs=seqs[i : i + most]))
                for i in range(0, len(seqs), most)
            ]
            return _summed(parts, loop)
        if not self._queued:
            loop.call_soon(self._flush)
        future: asyncio.Future[Outcome] = loop.create_future()
        self._queued[stream].append((command, future))
        return future

    def _flush(self) -> None:
        queued, self._queued = self._queued, defaultdict(list)
        for stream, waiting in queued.items():
            batch: list[tuple[ConsumerCommand, asyncio.Future[Outcome]]] = []
            size = 0
            for item in waiting:
                weight = item[0].weight
                if batch and size + weight > self._entry_limit:
                    self._send(stream, batch)
                    batch, size = [], 0
                batch.append(item)
                size += weight
            self._send(stream, batch)

    def _send(
        self, stream: str, batch: list[tuple[ConsumerCommand, asyncio.Future[Outcome]]]
    ) -> None:
        self._serial += 1
        serial = self._serial
        futures = [future for _, future in batch]
        self._waiting[serial] = futures
        entry = CommandBatch(self.proposer, serial, [command for command, _ in batch])
        proposed = self._propose(stream, entry)

        def not_committed(done: asyncio.Future[int]) -> None:
            error = done.exception() if not done.cancelled() else None
            left = self._waiting.pop(serial, None)
            if left is None:
                return  # applied here: every request has its outcome
            why = str(error) if error is not None else "its entry was not applied here"
            for future in left:
                if not future.done():
                    future.set_exception(
                        ReplicationError(
                            f"stream {stream!r}: not committed ({why}); ask again -- a "
                            "delivery given meanwhile comes again once its ack wait is over"
                        )
                    )

        proposed.add_done_callback(not_committed)

    def waits_for(self, batch: CommandBatch) -> bool:
        """A request here waits for the outcomes of ``batch``: its deliveries are read."""
        return batch.proposer == self.proposer and batch.serial in self._waiting

    def settle(self, batch: CommandBatch, outcomes: Sequence[Outcome]) -> None:
        """``batch`` was applied with ``outcomes``: its requests have them now."""
        for future, outcome in zip(self._waiting.pop(batch.serial, ()), outcomes, strict=False):
            if future.done():
                continue
            if isinstance(outcome, (StoreError, ValueError)):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


def _summed(
    parts: list[asyncio.Future[Outcome]], loop: asyncio.AbstractEventLoop
) -> asyncio.Future[Outcome]:
    """The sum of the ACK counts of ``parts``, or the first of their errors."""
    total: asyncio.Future[Outcome] = loop.create_future()
    left = [len(parts)]

    def one_done(_: asyncio.Future[Outcome]) -> None:
        left[0] -= 1
        if left[0] or total.done():
            return
        for part in parts:
            error = part.exception() if not part.cancelled() else None
            if error is not None:
                total.set_exception(error)
                return
        total.set_result(sum(part.result() for part in parts))  # type: ignore[misc]

    for part in parts:
        part.add_done_callback(one_done)
    return total
