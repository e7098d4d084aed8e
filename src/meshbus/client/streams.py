"""Durable streams from the client: create, inspect, fetch, and durable consumers.

Every call is a STREAM request to the connector's broker, which answers it when
it hosts the stream and relays it to the broker that does otherwise. Publishing
to a stream is sending to an address it captures: ``send(..., reliable=True)``
returns its acknowledgement once the message is stored (``send_reliable`` waits
for it), and ``publish_id`` makes a retried publish stored once.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from meshbus.address import Address
from meshbus.client.addressing import AddressLike, as_address
from meshbus.client.message import Message
from meshbus.client.requester import Requester
from meshbus.protocol.blocks import BlockSlice, slices_of
from meshbus.protocol.control import StoredRow, StreamReply, StreamRequest
from meshbus.protocol.ext import Ext
from meshbus.protocol.layout import ControlType

AskStream = Callable[[StreamRequest], Awaitable[StreamReply]]


class StreamMessage(Message):
    """A stored message: ``seq`` in its ``stream``, ``stored_at`` (Unix time), and for a
    durable consumer ``delivery`` (1 the first time, more on redelivery)."""

    __slots__ = ("delivery", "seq", "stored_at", "stream")

    def __init__(self, stream: str, row: StoredRow) -> None:
        seq, stored_at, src, dst, group, priority, payload, delivery, headers = row
        ext = Ext(group=group, priority=priority, headers=headers)
        super().__init__(src, dst, payload, 0, 0, None, ext)
        self.stream = stream
        self.seq = seq
        self.stored_at = stored_at
        self.delivery = delivery

    def __repr__(self) -> str:
        return (
            f"<stream {self.stream} #{self.seq} {self.src} -> {self.dst} {len(self.payload)} bytes>"
        )


@dataclass(frozen=True)
class StreamInfo:
    """A durable stream as its host broker describes it (``conn.streams.info``):
    ``name``, the ``broker`` that hosts it and what it ``captures``; its ``messages``
    (seqs ``first_seq``..``last_seq``) and their payload ``bytes``; its durable
    ``consumers``; its limits ``max_msgs``, ``max_bytes`` (0: none), ``max_age``
    (seconds, 0: none) and ``dedupe_window`` (seconds a publish id is remembered);
    ``store``, the host's SQLite file ("" in memory) on ``host``, the machine's name
    (for the Spark source's local reads); its ``owner``, the user that added it
    ("" on a broker without users); and for a replicated stream its ``replicas``
    (voters) and ``learners``, their ``leader`` and, from the leader, their
    ``replica_states``
    (docs/guarantees.md)."""

    name: str
    broker: str  # the broker that hosts it
    captures: list[str]
    first_seq: int
    last_seq: int
    messages: int
    bytes: int
    consumers: list[str]
    max_msgs: int
    max_bytes: int
    max_age: float
    dedupe_window: float
    # Where the host keeps it: its SQLite file ("" in memory) and the host's name, for
    # readers on the same machine (the Spark source's local reads).
    store: str = ""
    host: str = ""
    # The user that added it, whose rights its captures follow (docs/security.md,
    # "Streams and consumers have owners"); "" for nobody's: a broker without users.
    owner: str = ""
    # A replicated stream (added with replicas=3 or 5): the brokers that hold it (its
    # voters) and the one that leads it now ("" while none does); ``broker`` is the one
    # that answered. ``learners``: brokers being added in place of a lost replica, which
    # copy the log and count toward nothing until promoted (docs/guarantees.md).
    replicas: list[str] = field(default_factory=list)
    leader: str = ""
    # What the leader knows of each replica, in the info it answers (``current=True``):
    # ``{"broker", "state" (leader, follower, repairing, silent), "lag" (entries),
    # "voter" (false: a learner)}``.
    replica_states: list[dict[str, Any]] = field(default_factory=list)
    learners: list[str] = field(default_factory=list)

    @classmethod
    def from_reply(cls, info: dict[str, Any]) -> StreamInfo:
        """The info of a STREAM reply. Keys this client does not know are left out, so
        a broker newer than the client (one more key) does not break it."""
        return cls(**{key: value for key, value in info.items() if key in _INFO_FIELDS})


_INFO_FIELDS = frozenset(field.name for field in fields(StreamInfo))


class StreamClient:
    """``conn.streams``: the stream requests of one connector."""

    def __init__(self, requester: Requester) -> None:
        self._requester = requester

    async def _ask(self, request: StreamRequest) -> StreamReply:
        return await self._requester.ask(ControlType.STREAM, request, StreamReply, request.stream)

    async def add(
        self,
        name: str,
        capture: AddressLike | Iterable[AddressLike],
        *,
        max_msgs: int = 0,
        max_bytes: int = 0,
        max_age: float = 0.0,
        dedupe_window: float = 120.0,
        replicas: int = 1,
    ) -> StreamInfo:
        """Create stream ``name`` on this connector's broker, capturing every message sent to
        the multicast address(es) ``capture``; adding it again with the same settings is a
        no-op. Limits of 0 mean none; the oldest messages go first.

        ``replicas=3`` or ``5``: the stream is held by that many brokers of the mesh (each
        with --data-dir), placed by the mesh's meta group over the brokers' zones; a
        reliable send to it is acknowledged once a majority has it on disk
        (docs/guarantees.md). Its leader is elected just after: ``info`` shows it. A
        name the mesh has a replicated stream of raises ``StreamExists``, also for the
        second of two adds made at once through different brokers."""
        captures = [capture] if isinstance(capture, (Address, str)) else list(capture)
        reply = await self._ask(
            StreamRequest(
                op="add",
                stream=name,
                captures=[as_address(c).to_bytes() for c in captures],
                max_msgs=max_msgs,
                max_bytes=max_bytes,
                max_age=max_age,
                dedupe_window=dedupe_window,
                replicas=replicas,
            )
        )
        return StreamInfo.from_reply(reply.info)

    async def info(self, name: str, *, current: bool = False) -> StreamInfo:
        """The stream's settings and counts. A replicated stream's info comes from the
        replica asked; ``current``: from its leader, with ``replica_states`` (each
        replica's state and lag) -- a ``StreamError`` (code UNAVAILABLE) while it has
        none."""
        request = StreamRequest(op="info", stream=name, current=current)
        return StreamInfo.from_reply((await self._ask(request)).info)

    async def list(self) -> builtins.list[dict[str, Any]]:
        """Every stream of the mesh: ``{"name": ..., "broker": ...}``."""
        return (await self._ask(StreamRequest(op="list"))).streams

    async def delete(self, name: str) -> None:
        await self._ask(StreamRequest(op="delete", stream=name))

    async def fetch(
        self, name: str, from_seq: int = 1, max_count: int = 100, *, current: bool = False
    ) -> builtins.list[StreamMessage]:
        """Up to ``max_count`` messages from ``from_seq`` on, in order (fewer when they
        would not fit in one frame); an empty list past the end.

        A replicated stream is read from the replica asked, if it is one: its committed
        prefix, which may miss the last acknowledged messages for a moment. ``current``:
        read through its leader, which has applied every acknowledged message
        (docs/guarantees.md, "Replicated streams")."""
        reply = await self._ask(
            StreamRequest(
                op="fetch", stream=name, from_seq=from_seq, max_count=max_count, current=current
            )
        )
        return [StreamMessage(name, row) for row in reply.messages]

    async def fetch_blocks(
        self, name: str, from_seq: int = 1, max_count: int = 1000
    ) -> builtins.list[BlockSlice]:
        """``fetch`` for bulk readers (the Spark source): the same messages as the
        columnar blocks the broker stores them in (``meshbus.protocol.blocks``), with no
        object per message on either end. Addresses are 16-byte wire forms
        (``Address.from_bytes``), a group is b"" when there is none."""
        reply = await self._ask(
            StreamRequest(
                op="fetch", stream=name, from_seq=from_seq, max_count=max_count, columns=True
            )
        )
        if reply.blocks or not reply.messages:
            return reply.blocks
        # A broker from before columnar fetches answers with rows: the same, encoded here.
        return slices_of((*row[:7], row[8]) for row in reply.messages)

    async def consumer(
        self,
        stream: str,
        name: str,
        *,
        ack_wait: float = 30.0,
        max_deliver: int = 5,
        start_seq: int = 0,
    ) -> Consumer:
        """A durable consumer (created, or the existing one of that name): a cursor the
        stream's broker keeps, with acks and redelivery, so it resumes where it stopped.

        Of a replicated stream the cursor is in the stream's Raft log: its leader answers
        ``next`` and ``ack`` once they are committed, and a new leader goes on from there
        -- a message delivered whose ack was not committed comes again after its
        ``ack_wait``, one acknowledged does not (docs/guarantees.md, "Durable
        consumers"). A call that fails with ``StreamError`` (code UNAVAILABLE) while
        the leadership moves may be asked again."""
        await self._ask(
            StreamRequest(
                op="consumer_add",
                stream=stream,
                consumer=name,
                ack_wait=ack_wait,
                max_deliver=max_deliver,
                start_seq=start_seq,
            )
        )
        return Consumer(self._ask, stream, name)

    def bind_consumer(self, stream: str, name: str) -> Consumer:
        """The existing consumer ``name`` of ``stream``, neither created nor changed: no
        request until a call, which raises StreamError when there is no such consumer."""
        return Consumer(self._ask, stream, name)


class Consumer:
    """Take messages with ``next``, acknowledge them with ``ack``; one not acknowledged
    within ``ack_wait`` comes again, up to ``max_deliver`` times."""

    def __init__(self, ask: AskStream, stream: str, name: str) -> None:
        self._ask = ask
        self.stream = stream
        """The stream it reads."""
        self.name = name
        """Its name, unique in its stream."""

    async def next(self, max_count: int = 100) -> list[StreamMessage]:
        """Up to ``max_count`` messages: those due again first (not acknowledged within
        ``ack_wait``), then new ones; an empty list when there is nothing."""
        reply = await self._ask(
            StreamRequest(op="next", stream=self.stream, consumer=self.name, max_count=max_count)
        )
        return [StreamMessage(self.stream, row) for row in reply.messages]

    async def ack(self, messages: Sequence[StreamMessage | int]) -> int:
        """Acknowledge messages (or their seqs); returns how many were waiting for it."""
        seqs = [m if isinstance(m, int) else m.seq for m in messages]
        reply = await self._ask(
            StreamRequest(op="ack", stream=self.stream, consumer=self.name, seqs=seqs)
        )
        return reply.acked

    async def info(self, *, current: bool = False) -> dict[str, Any]:
        """Its state: ``next_seq``, ``ack_floor``, ``pending`` and its settings. Of a
        replicated stream, from the replica asked (its committed state); ``current``:
        from the leader."""
        reply = await self._ask(
            StreamRequest(
                op="consumer_info", stream=self.stream, consumer=self.name, current=current
            )
        )
        return reply.info

    async def delete(self) -> None:
        """Delete the consumer, its position and its pending deliveries: only the user
        that made it may, or one with the operator right "consumers"."""
        await self._ask(StreamRequest(op="consumer_delete", stream=self.stream, consumer=self.name))
