"""Storage for durable streams: the interface, its records, and the in-memory store.

A stream captures messages sent to some addresses and numbers them 1, 2, 3, ...;
consumers read it with acknowledgements and redelivery. The broker owns the clock
and the batching: it passes ``now`` into every call (so tests never sleep) and
gathers the publishes of one event-loop turn into one ``append_batch`` call, which
a durable store commits as one transaction (group commit: one WAL write, and with
``fsync="always"`` one fsync, for the whole batch instead of one per message).

Both stores keep the same small mirror in memory, built from the classes below:
per stream its counters (first/last seq, payload bytes, the oldest message's time)
and the publish ids still inside the dedupe window; per consumer its next seq, its
drop count and its pending deliveries. Every decision (which seq, duplicate or not,
what retention removes, what to redeliver or give up) is made on the mirror by the
shared code here, so the two stores cannot drift apart in behaviour; they differ
only in where message bodies live and whether changes are written through to disk
(``sqlite_store``, where the database stays the truth and the mirror is rebuilt
from it at open and after a failed transaction).

Messages are only ever removed from the front (retention is oldest-first and there
is no single-message delete), so a stream always holds exactly ``first_seq ..
last_seq`` with no gaps: counts are arithmetic and a consumer's pending map, filled
in seq order, stays sorted by seq.
"""

from __future__ import annotations

import abc
import heapq
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from itertools import groupby, repeat, takewhile
from operator import itemgetter
from typing import NamedTuple

from meshbus.protocol.blocks import BlockSlice, slices_of
from meshbus.storage.errors import (
    ConsumerExists,
    ConsumerNotFound,
    StreamExists,
    StreamNotFound,
)

ADDRESS_LEN = 16
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(
            f"invalid {kind} name {name!r}: use 1 to 64 characters from A-Z a-z 0-9 _ . -"
        )


def _check_limits(what: str, **values: float) -> None:
    for key, value in values.items():
        if not value >= 0:  # also refuses NaN
            raise ValueError(f"{what}: {key} must be 0 or more, not {value}")


@dataclass(frozen=True)
class StreamConfig:
    name: str
    captures: tuple[bytes, ...]
    max_msgs: int = 0
    max_bytes: int = 0
    max_age: float = 0.0
    dedupe_window: float = 120.0
    # The user that added it, whose right to join each captured group is checked again at
    # every reload (docs/security.md, "Streams and consumers have owners"); "": nobody's
    # (a broker without users, the broker's own, or a store older than owners). Not part
    # of what an add compares: adding a stream that exists is adding the same stream.
    owner: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_name("stream", self.name)
        if not isinstance(self.captures, tuple):  # a list would break hashing and equality
            raise ValueError(f"stream {self.name!r}: captures must be a tuple of addresses")
        for address in self.captures:
            if not isinstance(address, bytes) or len(address) != ADDRESS_LEN:
                raise ValueError(
                    f"stream {self.name!r}: capture {address!r} is not a 16-byte address"
                )
        _check_limits(
            f"stream {self.name!r}",
            max_msgs=self.max_msgs,
            max_bytes=self.max_bytes,
            max_age=self.max_age,
            dedupe_window=self.dedupe_window,
        )


class NewMessage(NamedTuple):
    """Not validated here: it is built per publish from a frame the broker has checked.
    A tuple, not a dataclass: the broker builds one per captured frame, and the SQLite
    store transposes a batch of them into a block's columns in C."""

    src: bytes
    dst: bytes
    payload: bytes
    group: bytes = b""
    priority: int = 0
    publish_id: bytes = b""
    headers: bytes = b""  # a header block (meshbus.protocol.headers); b"": none


class StoredMessage(NamedTuple):
    stream: str
    seq: int
    stored_at: float
    src: bytes
    dst: bytes
    group: bytes
    priority: int
    payload: bytes
    headers: bytes = b""


class Appended(NamedTuple):
    seq: int
    duplicate: bool


# Per message on the append path: a NamedTuple's own __new__ is Python code, the
# tuple's is not (the fields are the same).
_new_tuple = tuple.__new__
_payload_of = itemgetter(2)  # NewMessage.payload
_publish_id_of = itemgetter(5)  # NewMessage.publish_id


@dataclass(frozen=True)
class StreamStatus:
    """What a store holds of one stream now (the client's view is ``meshbus.StreamInfo``)."""

    config: StreamConfig
    first_seq: int
    last_seq: int
    messages: int
    bytes: int
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class ConsumerConfig:
    name: str
    ack_wait: float = 30.0
    max_deliver: int = 5  # 0 = redeliver forever
    start_seq: int = 0
    # The user that made it, the only one that may use or delete it (besides one with the
    # operator right "consumers"); "": nobody's, any user that may consume the stream.
    owner: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_name("consumer", self.name)
        if not self.ack_wait > 0:  # also catches NaN
            raise ValueError(f"consumer {self.name!r}: ack_wait must be more than 0")
        _check_limits(
            f"consumer {self.name!r}", max_deliver=self.max_deliver, start_seq=self.start_seq
        )


@dataclass(frozen=True, slots=True)
class Delivery:
    message: StoredMessage
    delivery: int


@dataclass(frozen=True)
class ConsumerInfo:
    stream: str
    config: ConsumerConfig
    next_seq: int
    ack_floor: int
    pending: int
    dropped: int


class StreamStore(abc.ABC):
    """What the broker needs from durable-stream storage. Not thread-safe: one caller.

    Contract points the signatures do not show: seqs start at 1 and are never reused;
    a duplicate publish id (within the window, also within one batch) gets the first
    message's seq back even if retention has removed that message; retention runs in
    the append's own transaction, so ``info`` never shows a stream over its limits;
    ``consumer_next`` returns due redeliveries (oldest seq first) before new messages,
    and a message due for delivery ``max_deliver + 1`` is given up instead (0 = never);
    deliveries whose message retention removed stop being pending (not counted as
    dropped), and acking them, like acking anything not pending, counts 0.
    """

    @abc.abstractmethod
    def add_stream(self, config: StreamConfig) -> StreamStatus: ...
    @abc.abstractmethod
    def delete_stream(self, name: str) -> None: ...
    @abc.abstractmethod
    def streams(self) -> list[StreamConfig]: ...
    @abc.abstractmethod
    def info(self, name: str) -> StreamStatus: ...
    @abc.abstractmethod
    def append_batch(
        self, name: str, messages: Sequence[NewMessage], now: float
    ) -> list[Appended]: ...
    @abc.abstractmethod
    def raft_entry(self, name: str, index: int) -> AbstractContextManager[None]:
        """What the store is asked inside is one transaction with Raft entry ``index``
        of replicated stream ``name`` recorded as applied (``applied``): a restart
        applies each entry once. A call refused inside (a StoreError raised before it
        changed anything) leaves the others in; a failure of the store undoes them all."""

    def append_entry(
        self, name: str, messages: Sequence[NewMessage], now: float, index: int
    ) -> list[Appended]:
        """``append_batch`` of a replicated stream's Raft entry ``index``."""
        with self.raft_entry(name, index):
            return self.append_batch(name, messages, now)

    @abc.abstractmethod
    def applied(self, name: str) -> int:
        """The last Raft entry ``raft_entry`` applied to ``name`` (0: none)."""

    @abc.abstractmethod
    def read(
        self, name: str, from_seq: int, max_count: int, max_bytes: int = 0
    ) -> list[StoredMessage]: ...
    def read_blocks(
        self, name: str, from_seq: int, max_count: int, max_bytes: int = 0
    ) -> list[BlockSlice]:
        """What ``read`` returns, as columnar blocks (``meshbus.protocol.blocks``); a
        store that keeps blocks hands them out as they are, and may then stop short of
        ``max_bytes`` (at least one message still)."""
        return slices_of(m[1:] for m in self.read(name, from_seq, max_count, max_bytes))

    @abc.abstractmethod
    def expire(self, now: float, streams: Iterable[str] | None = None) -> int:
        """Apply every stream's limits at ``now`` (or only those of ``streams``); the
        messages removed."""

    @abc.abstractmethod
    def add_consumer(self, stream: str, config: ConsumerConfig) -> ConsumerInfo: ...
    @abc.abstractmethod
    def delete_consumer(self, stream: str, name: str) -> None: ...
    @abc.abstractmethod
    def consumer_info(self, stream: str, name: str) -> ConsumerInfo: ...
    @abc.abstractmethod
    def consumer_next(
        self, stream: str, name: str, max_count: int, now: float, *, read: bool = True
    ) -> list[Delivery]:
        """The consumer's next deliveries, recorded as pending; with ``read`` False they
        are recorded alike and not read (a replica applying a leader's delivery)."""

    @abc.abstractmethod
    def consumer_ack(self, stream: str, name: str, seqs: Sequence[int]) -> int: ...
    @abc.abstractmethod
    def close(self) -> None: ...


# -- the mirror shared by both stores -------------------------------------------------


class PublishIds:
    """Publish ids of one stream: a dict id -> seq to look up, and a queue of the batches
    in arrival order to forget them by.

    ``seen`` forgets what is older than the window first, so answers never depend on
    how often the broker calls ``expire``. Forgetting costs only what is forgotten, and
    remembering a batch is one ``dict.update``; a clock stepping backwards merely
    delays forgetting.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.ids: dict[bytes, int] = {}
        self._order: deque[tuple[float, dict[bytes, int]]] = deque()

    def seen(self, now: float) -> Callable[[bytes], int | None]:
        """The lookup for a batch arriving at ``now``: the seq an id was stored as."""
        self.expire(now)
        return self.ids.get

    def remember(self, fresh: dict[bytes, int], at: float) -> None:
        """Remember a batch's publish id -> seq, all stored at ``at``."""
        self.ids.update(fresh)
        self._order.append((at, fresh))

    def older_than(self, seq: int) -> list[tuple[float, bytes, int]]:
        """(time, id, seq) of the ids remembered for seqs below ``seq``: those of the
        messages retention removed, which their blocks no longer tell."""
        ids = self.ids
        return [
            (at, publish_id, stored)
            for at, batch in self._order
            for publish_id, stored in batch.items()
            if stored < seq and ids.get(publish_id) == stored
        ]

    def restore(self, rows: Iterable[tuple[float, bytes, int]]) -> None:
        """Remember (time, id, seq) rows besides what is remembered, in time order (the
        order they are forgotten in: as on the replica they were copied from). Costs
        the rows and a merge of the batches, not the ids already remembered."""
        extra = [
            (at, {publish_id: seq for _, publish_id, seq in same})
            for at, same in groupby(sorted(rows, key=itemgetter(0)), key=itemgetter(0))
        ]
        self._order = deque(heapq.merge(self._order, extra, key=itemgetter(0)))
        for _, batch in extra:
            self.ids.update(batch)

    def expire(self, now: float) -> int:
        gone = 0
        order, ids = self._order, self.ids
        while order and now - order[0][0] >= self.window:
            _, batch = order.popleft()
            for publish_id, seq in batch.items():
                if ids.get(publish_id) == seq:  # else remembered again since
                    del ids[publish_id]
                    gone += 1
        return gone


@dataclass(eq=False)
class ConsumerState:
    config: ConsumerConfig
    next_seq: int
    dropped: int = 0
    # seq -> (deliveries so far, redelivery deadline); in seq order (see module docstring)
    pending: dict[int, tuple[int, float]] = field(default_factory=dict)
    earliest: float = math.inf  # lower bound on the pending deadlines: skips idle scans
    key: int = 0  # the backend's row id


@dataclass(eq=False)
class StreamState:
    config: StreamConfig
    first_seq: int = 1
    last_seq: int = 0
    bytes: int = 0
    first_at: float = 0.0  # stored_at of message first_seq, when there is one
    ids: PublishIds = field(init=False)
    consumers: dict[str, ConsumerState] = field(default_factory=dict)
    key: int = 0
    applied: int = 0  # a replicated stream's last Raft entry applied (append_entry)

    def __post_init__(self) -> None:
        self.ids = PublishIds(self.config.dedupe_window)

    @property
    def count(self) -> int:
        return self.last_seq - self.first_seq + 1


@dataclass(slots=True)
class NextPlan:
    redeliver: list[tuple[int, int]]  # (seq, delivery number), seq order
    given_up: list[int]
    new: range
    deadline: float


class MirroredStore(StreamStore):
    """The decisions both stores share; subclasses store bodies and persist changes."""

    def __init__(self) -> None:
        self._streams: dict[str, StreamState] = {}

    def _stream(self, name: str) -> StreamState:
        try:
            return self._streams[name]
        except KeyError:
            raise StreamNotFound(name) from None

    def applied(self, name: str) -> int:
        return self._stream(name).applied

    def _consumer(self, stream: str, name: str) -> tuple[StreamState, ConsumerState]:
        st = self._stream(stream)
        try:
            return st, st.consumers[name]
        except KeyError:
            raise ConsumerNotFound(stream, name) from None

    def streams(self) -> list[StreamConfig]:
        return [self._streams[name].config for name in sorted(self._streams)]

    def _selected(self, streams: Iterable[str] | None) -> list[StreamState]:
        if streams is None:
            return list(self._streams.values())
        return [self._stream(name) for name in streams]

    def aged(self, name: str, now: float) -> bool:
        """Stream ``name`` holds a message older than its ``max_age`` at ``now``."""
        st = self._stream(name)
        max_age = st.config.max_age
        return bool(max_age and st.count and st.first_at <= now - max_age)

    def __contains__(self, name: object) -> bool:
        return name in self._streams

    def total_bytes(self) -> int:
        """Payload bytes of every stream."""
        return sum(st.bytes for st in self._streams.values())

    def growth(self, name: str, payload_bytes: int) -> int:
        """How much appending ``payload_bytes`` to stream ``name`` would add to
        ``total_bytes`` at most (retention keeps a stream under its max_bytes)."""
        st = self._stream(name)
        cap = st.config.max_bytes
        if not cap:
            return payload_bytes
        return max(0, min(st.bytes + payload_bytes, cap) - st.bytes)

    def info(self, name: str) -> StreamStatus:
        st = self._stream(name)
        return StreamStatus(
            st.config, st.first_seq, st.last_seq, st.count, st.bytes, tuple(sorted(st.consumers))
        )

    def consumer_info(self, stream: str, name: str) -> ConsumerInfo:
        st, cs = self._consumer(stream, name)
        next_seq = max(cs.next_seq, st.first_seq)
        floor = next(iter(cs.pending)) - 1 if cs.pending else next_seq - 1
        return ConsumerInfo(stream, cs.config, next_seq, floor, len(cs.pending), cs.dropped)

    def consumer_owner(self, stream: str, name: str) -> str | None:
        """The user that made consumer ``name`` of ``stream`` ("": nobody); None when
        there is no such consumer."""
        st = self._streams.get(stream)
        cs = None if st is None else st.consumers.get(name)
        return None if cs is None else cs.config.owner

    def _existing_stream(self, config: StreamConfig) -> StreamStatus | None:
        st = self._streams.get(config.name)
        if st is None:
            return None
        if st.config != config:
            raise StreamExists(config.name)
        return self.info(config.name)

    def _existing_consumer(self, stream: str, config: ConsumerConfig) -> ConsumerInfo | None:
        cs = self._stream(stream).consumers.get(config.name)
        if cs is None:
            return None
        if cs.config != config:
            raise ConsumerExists(stream, config.name)
        return self.consumer_info(stream, config.name)

    @staticmethod
    def _new_consumer(st: StreamState, config: ConsumerConfig) -> ConsumerState:
        return ConsumerState(config, config.start_seq or st.first_seq)

    @staticmethod
    def _append(
        st: StreamState, messages: Sequence[NewMessage], now: float
    ) -> tuple[list[Appended], list[NewMessage]]:
        """Number the batch; return the results and what to store, which gets the seqs
        from the old ``last_seq + 1`` on, in order. Once per captured message: kept tight."""
        window = st.config.dedupe_window
        seq = st.last_seq
        seen = st.ids.seen(now)
        if window > 0:
            ids = list(map(_publish_id_of, messages))
            if all(ids) and len(set(ids)) == len(ids) and st.ids.ids.keys().isdisjoint(ids):
                # Every message has a publish id never seen: the usual batch from a bulk
                # writer (a Spark task's rows), stored whole with no step per message here.
                return MirroredStore._append_all(st, messages, ids, now)
        results: list[Appended] = []
        stored: list[NewMessage] = []
        fresh: dict[bytes, int] = {}
        for msg in messages:
            publish_id = msg.publish_id
            if publish_id and window > 0:
                original = fresh.get(publish_id)
                if original is None:
                    original = seen(publish_id)
                if original is not None:
                    results.append(_new_tuple(Appended, (original, True)))
                    continue
                fresh[publish_id] = seq + 1
            seq += 1
            stored.append(msg)
            results.append(_new_tuple(Appended, (seq, False)))
        if stored:
            if st.count == 0:
                st.first_at = now
            st.last_seq = seq
            st.bytes += sum(map(len, map(_payload_of, stored)))
            if fresh:
                st.ids.remember(fresh, now)
        return results, stored

    @staticmethod
    def _append_all(
        st: StreamState, messages: Sequence[NewMessage], ids: list[bytes], now: float
    ) -> tuple[list[Appended], list[NewMessage]]:
        """``_append`` of a batch stored whole, in C loops."""
        seqs = range(st.last_seq + 1, st.last_seq + 1 + len(messages))
        results = list(map(_new_tuple, repeat(Appended), zip(seqs, repeat(False))))
        stored = list(messages)
        if stored:
            if st.count == 0:
                st.first_at = now
            st.last_seq = seqs[-1]
            st.bytes += sum(map(len, map(_payload_of, stored)))
            st.ids.remember(dict(zip(ids, seqs, strict=True)), now)
        return results, stored

    @staticmethod
    def _needs_cut(st: StreamState, now: float) -> bool:
        cfg = st.config
        return st.count > 0 and (
            (cfg.max_msgs > 0 and st.count > cfg.max_msgs)
            or (cfg.max_bytes > 0 and st.bytes > cfg.max_bytes)
            or (cfg.max_age > 0 and st.first_at <= now - cfg.max_age)
        )

    @staticmethod
    def _cut(st: StreamState, now: float, rows: Iterable[tuple[int, float, int]]) -> int:
        """Apply the limits to the front; ``rows`` yields (seq, stored_at, payload size)
        from first_seq on. A message larger than max_bytes goes too: the limit is a
        promise about disk use, so the broker should refuse such publishes up front.
        Returns the old first_seq: the store removes [old, st.first_seq)."""
        cfg = st.config
        old_first = st.first_seq
        keep_from = st.last_seq - cfg.max_msgs + 1 if cfg.max_msgs else old_first
        cutoff = now - cfg.max_age if cfg.max_age else -math.inf
        first, held = st.last_seq + 1, st.bytes
        for seq, at, size in rows:
            if seq < keep_from or at <= cutoff or (cfg.max_bytes and held > cfg.max_bytes):
                held -= size
                continue
            first = seq
            st.first_at = at
            break
        st.first_seq, st.bytes = first, held
        for cs in st.consumers.values():  # one pass: repeated next(iter()) is quadratic
            for seq in list(takewhile(lambda seq: seq < first, cs.pending)):
                del cs.pending[seq]
        return old_first

    @staticmethod
    def _plan_next(st: StreamState, cs: ConsumerState, max_count: int, now: float) -> NextPlan:
        """Decide a consumer_next call and apply it to the mirror."""
        max_deliver = cs.config.max_deliver
        deadline = now + cs.config.ack_wait
        redeliver: list[tuple[int, int]] = []
        given_up: list[int] = []
        if cs.pending and now >= cs.earliest:
            earliest = math.inf
            for seq, (count, due) in cs.pending.items():
                if due > now:
                    earliest = min(earliest, due)
                elif len(redeliver) >= max_count:
                    earliest = due  # still due: the next call must scan again
                    break
                elif max_deliver and count >= max_deliver:
                    given_up.append(seq)
                else:
                    redeliver.append((seq, count + 1))
            cs.earliest = earliest
            for seq in given_up:
                del cs.pending[seq]
            cs.dropped += len(given_up)
            for seq, count in redeliver:
                cs.pending[seq] = (count, deadline)  # in place: the order stays seq order
        start = max(cs.next_seq, st.first_seq)
        new = range(start, min(st.last_seq + 1, start + max(0, max_count - len(redeliver))))
        for seq in new:
            cs.pending[seq] = (1, deadline)
        cs.next_seq = new.stop if new else start
        if redeliver or new:
            cs.earliest = min(cs.earliest, deadline)
        return NextPlan(redeliver, given_up, new, deadline)

    @staticmethod
    def _ack(cs: ConsumerState, seqs: Sequence[int]) -> list[int]:
        pending = cs.pending
        return [seq for seq in dict.fromkeys(seqs) if pending.pop(seq, None) is not None]


def fit_bytes(messages: Iterator[StoredMessage], max_bytes: int) -> list[StoredMessage]:
    """Take messages until the next would pass max_bytes, but at least one."""
    out: list[StoredMessage] = []
    total = 0
    for msg in messages:
        total += len(msg.payload)
        if max_bytes and total > max_bytes and out:
            break
        out.append(msg)
    return out


class MemoryStreamStore(MirroredStore):
    """For tests and for brokers that want streams without disk: lost on restart."""

    def __init__(self) -> None:
        super().__init__()
        self._bodies: dict[str, dict[int, StoredMessage]] = {}

    def add_stream(self, config: StreamConfig) -> StreamStatus:
        existing = self._existing_stream(config)
        if existing is not None:
            return existing
        self._streams[config.name] = StreamState(config)
        self._bodies[config.name] = {}
        return self.info(config.name)

    def delete_stream(self, name: str) -> None:
        self._stream(name)
        del self._streams[name], self._bodies[name]

    @contextmanager
    def raft_entry(self, name: str, index: int) -> Iterator[None]:
        st = self._stream(name)
        yield
        st.applied = index

    def append_batch(self, name: str, messages: Sequence[NewMessage], now: float) -> list[Appended]:
        st = self._stream(name)
        first = st.last_seq + 1
        results, stored = self._append(st, messages, now)
        bodies = self._bodies[name]
        for seq, m in enumerate(stored, first):
            bodies[seq] = StoredMessage(
                name, seq, now, m.src, m.dst, m.group, m.priority, m.payload, m.headers
            )
        self._trim(st, now)
        return results

    def _trim(self, st: StreamState, now: float) -> int:
        if not self._needs_cut(st, now):
            return 0
        bodies = self._bodies[st.config.name]
        rows = (
            (seq, bodies[seq].stored_at, len(bodies[seq].payload))
            for seq in range(st.first_seq, st.last_seq + 1)
        )
        old_first = self._cut(st, now, rows)
        for seq in range(old_first, st.first_seq):
            del bodies[seq]
        return st.first_seq - old_first

    def read(
        self, name: str, from_seq: int, max_count: int, max_bytes: int = 0
    ) -> list[StoredMessage]:
        st = self._stream(name)
        bodies = self._bodies[name]
        start = max(from_seq, st.first_seq)
        stop = min(st.last_seq + 1, start + max(0, max_count))
        return fit_bytes((bodies[seq] for seq in range(start, stop)), max_bytes)

    def expire(self, now: float, streams: Iterable[str] | None = None) -> int:
        removed = 0
        for st in self._selected(streams):
            st.ids.expire(now)
            removed += self._trim(st, now)
        return removed

    def add_consumer(self, stream: str, config: ConsumerConfig) -> ConsumerInfo:
        existing = self._existing_consumer(stream, config)
        if existing is not None:
            return existing
        st = self._stream(stream)
        st.consumers[config.name] = self._new_consumer(st, config)
        return self.consumer_info(stream, config.name)

    def delete_consumer(self, stream: str, name: str) -> None:
        st, _ = self._consumer(stream, name)
        del st.consumers[name]

    def consumer_next(
        self, stream: str, name: str, max_count: int, now: float, *, read: bool = True
    ) -> list[Delivery]:
        st, cs = self._consumer(stream, name)
        plan = self._plan_next(st, cs, max_count, now)
        if not read:
            return []
        bodies = self._bodies[stream]
        out = [Delivery(bodies[seq], count) for seq, count in plan.redeliver]
        out += [Delivery(bodies[seq], 1) for seq in plan.new]
        return out

    def consumer_ack(self, stream: str, name: str, seqs: Sequence[int]) -> int:
        _, cs = self._consumer(stream, name)
        return len(self._ack(cs, seqs))

    def close(self) -> None:
        pass
