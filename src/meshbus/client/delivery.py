"""Bookkeeping for reliable (exactly-once) sends and ordered message groups.

Plain data structures with no I/O and no clock: the caller passes ``now``
(monotonic seconds) and does the sending, so every rule here is unit-testable.

``SeenWindow`` is the receiver's duplicate check. It is a set for O(1)
membership plus a ring of the same keys in insertion order, so the oldest key is
always the one the ring's cursor points at. It is deliberately not a dict
drained with ``del d[next(iter(d))]``: CPython leaves a dummy slot behind for
each deleted entry and ``next(iter(d))`` walks over all of them, so at 100k
keys each eviction costs ~17 us instead of ~0.2 us (measured on 3.11). Nor is it
a linked list, whose per-node overhead a thesis measured at 10% CPU.

``AckTable`` is the sender's table of unacknowledged messages, each with the
addresses whose ack counts: the one it was sent to, or each member of a multicast
(docs/guarantees.md, "Who may acknowledge"). Deadlines live in
a heap with lazy deletion (an ack leaves a stale item that is skipped later),
so ``due`` and ``next_deadline`` cost O(log n) per due entry rather than a scan
of 100k entries on every timer tick. The heap is rebuilt when stale items
outnumber live ones, which keeps its size bounded even if the timer never fires.

``GroupOrder`` releases group messages in sequence order; ``Suspicion`` counts
failed sends per address to declare a client dead.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshbus.errors import InvalidArgument

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# Stale heap items tolerated on top of 2x the live entries before a rebuild; the slack
# keeps a small outbox (a few sends in flight) from rebuilding on every ack.
COMPACT_SLACK = 1024


class SeenWindow(Generic[K]):
    """The last ``capacity`` distinct keys; the oldest inserted is evicted first."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise InvalidArgument(f"SeenWindow capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._seen: set[K] = set()
        # Grows to capacity, then is overwritten in place: _ring[_pos] is the oldest key.
        self._ring: list[K] = []
        self._pos = 0

    def add(self, key: K) -> bool:
        """Remember ``key``; False if it was already in the window (a duplicate)."""
        if key in self._seen:
            return False  # not re-inserted: a duplicate must not extend its own lifetime
        if len(self._ring) < self.capacity:
            self._ring.append(key)
        else:
            self._seen.remove(self._ring[self._pos])
            self._ring[self._pos] = key
            self._pos = (self._pos + 1) % self.capacity
        self._seen.add(key)
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)


@dataclass(frozen=True)
class RetryPolicy:
    """When to resend an unacknowledged message, and when to give up on it: after
    ``ack_timeout`` seconds without an ack, then each wait ``backoff`` times the last, at
    most ``max_interval``; given up after ``max_attempts`` sends."""

    ack_timeout: float = 0.2
    backoff: float = 2.0
    max_interval: float = 2.0
    max_attempts: int = 10

    def __post_init__(self) -> None:
        # `not x > 0` rather than `x <= 0` so that NaN is rejected too.
        if not self.ack_timeout > 0:
            raise InvalidArgument(f"ack_timeout must be positive, got {self.ack_timeout}")
        if not self.backoff >= 1:
            raise InvalidArgument(f"backoff must be at least 1, got {self.backoff}")
        if not self.max_interval > 0:
            raise InvalidArgument(f"max_interval must be positive, got {self.max_interval}")
        if self.max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be at least 1, got {self.max_attempts}")

    def interval(self, attempt: int) -> float:
        """How long to wait for an ack after attempt number ``attempt`` (1-based)."""
        if attempt < 1:
            raise InvalidArgument(f"attempt numbers start at 1, got {attempt}")
        try:
            raw = self.ack_timeout * self.backoff ** (attempt - 1)
        except OverflowError:  # a large attempt with backoff > 1: far past the cap
            return self.max_interval
        return min(raw, self.max_interval)

    def give_up_after(self) -> float:
        """Time from the first send until the sender is told the message failed."""
        return math.fsum(self.interval(a) for a in range(1, self.max_attempts + 1))


class Ack(enum.Enum):
    """What an ack did (``AckTable.ack``)."""

    DONE = "done"  # the message is acknowledged, and forgotten
    COUNTED = "counted"  # a multicast member's: other members still owe theirs
    UNKNOWN = "unknown"  # no such message waits: a late or repeated ack
    STRANGER = "stranger"  # from an address the message was not sent to: ignored


@dataclass(slots=True)
class _Sent:
    ackers: frozenset[bytes]  # whose ack counts
    waiting: set[bytes] | None  # the members still to ack; None: any one acker's will do
    attempts: int
    deadline: float


class AckTable:
    """The sender's unacknowledged reliable messages, keyed by message id."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._entries: dict[int, _Sent] = {}
        # (deadline, msg_id). An item is live only while its entry still has that
        # deadline; a re-added id with an equal deadline leaves a duplicate that is
        # harmless, since handling the first one changes or removes the entry.
        self._heap: list[tuple[float, int]] = []

    def add(
        self, msg_id: int, ackers: frozenset[bytes], now: float, *, every: bool = False
    ) -> None:
        """Track a message just sent (attempt 1) to ``ackers``: the first ack of one of
        them completes it, or, with ``every`` (a multicast's members), an ack of each."""
        if msg_id in self._entries:
            raise ValueError(f"message id {msg_id} is already in the outbox")
        if not ackers:
            raise ValueError("an empty acker set would never be acknowledged")
        deadline = now + self.policy.interval(1)
        self._entries[msg_id] = _Sent(ackers, set(ackers) if every else None, 1, deadline)
        heapq.heappush(self._heap, (deadline, msg_id))

    def allow(self, msg_id: int, acker: bytes) -> None:
        """``acker``'s ack counts too: the message goes to it now (a message group moved
        to another member; the first member may still ack what it got). No-op if unknown."""
        entry = self._entries.get(msg_id)
        if entry is not None:
            entry.ackers |= {acker}

    def ack(self, msg_id: int, acker: bytes) -> Ack:
        """Record an ack from ``acker``."""
        entry = self._entries.get(msg_id)
        if entry is None:
            return Ack.UNKNOWN  # late or duplicate ack, or one for a message given up on
        if acker not in entry.ackers:
            return Ack.STRANGER
        waiting = entry.waiting
        if waiting is not None:
            waiting.discard(acker)
            if waiting:
                return Ack.COUNTED
        self.remove(msg_id)
        return Ack.DONE

    def due(self, now: float) -> tuple[list[int], list[int]]:
        """(to_resend, given_up) for entries whose deadline has passed, each ascending."""
        resend: list[int] = []
        given_up: list[int] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, msg_id = heapq.heappop(heap)
            entry = self._entries.get(msg_id)
            if entry is None or entry.deadline != deadline:
                continue
            if entry.attempts >= self.policy.max_attempts:
                del self._entries[msg_id]
                given_up.append(msg_id)
            else:
                entry.attempts += 1
                # From now, not from the old deadline: a late timer must not shorten the wait.
                entry.deadline = now + self.policy.interval(entry.attempts)
                heapq.heappush(heap, (entry.deadline, msg_id))
                resend.append(msg_id)
        # Ids are assigned in send order; the heap yields them in deadline order.
        resend.sort()
        given_up.sort()
        return resend, given_up

    def pending(self, msg_id: int) -> frozenset[bytes] | None:
        """The members still to ack (None: any one acker's ack completes); KeyError if
        unknown."""
        waiting = self._entries[msg_id].waiting
        return None if waiting is None else frozenset(waiting)

    def attempts(self, msg_id: int) -> int:
        """How many times the message has been sent so far; KeyError if unknown."""
        return self._entries[msg_id].attempts

    def ids(self) -> list[int]:
        """All tracked ids in ascending (send) order, e.g. to resend after a failover."""
        return sorted(self._entries)

    def remove(self, msg_id: int) -> None:
        """Stop tracking ``msg_id``; a no-op if it is not tracked."""
        if self._entries.pop(msg_id, None) is not None and (
            len(self._heap) > 2 * len(self._entries) + COMPACT_SLACK
        ):
            self._heap = [(e.deadline, i) for i, e in self._entries.items()]
            heapq.heapify(self._heap)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a tracked entry, for arming the timer."""
        heap = self._heap
        while heap:
            deadline, msg_id = heap[0]
            entry = self._entries.get(msg_id)
            if entry is not None and entry.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def __contains__(self, msg_id: object) -> bool:
        return msg_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class _Group(Generic[T]):
    expected: int  # the next seq to deliver
    last_push: float
    held: dict[int, tuple[T, float]]  # seq -> (item, arrival time), waiting for a gap
    delivered: bool = False


class GroupOrder(Generic[T]):
    """Per-(source, group) in-order delivery of sequence-numbered messages."""

    def __init__(self, hold_timeout: float = 30.0, idle_timeout: float = 300.0) -> None:
        if not hold_timeout > 0 or not idle_timeout > 0:
            raise InvalidArgument("hold_timeout and idle_timeout must be positive")
        self.hold_timeout = hold_timeout
        self.idle_timeout = idle_timeout
        self.gaps = 0  # seqs skipped by expire(): never delivered here
        self._groups: dict[tuple[bytes, bytes], _Group[T]] = {}
        # Keys with held items: only these can time out, and they are few, so expire()
        # need not visit every key on each call.
        self._holding: set[tuple[bytes, bytes]] = set()
        self._next_sweep = -math.inf

    def push(
        self, src: bytes, group: bytes, seq: int, floor: int, item: T, now: float
    ) -> list[tuple[T, bool]]:
        """Accept one message; return the items now deliverable, with ``reassigned`` flags."""
        key = (src, group)
        g = self._groups.get(key)
        if g is None:
            # Start at floor, not seq: after a failover a resent later message can
            # overtake an earlier one, and the earlier one must still come first.
            g = self._groups[key] = _Group(floor, now, {})
        g.last_push = now
        # Nothing below floor will be sent again (acked, or given up), so a raised floor
        # closes the gap at once. Held items below it are delivered, not dropped: they
        # were given up by the sender, and arrived here all the same.
        out = self._release(g, floor)
        if seq >= g.expected and seq not in g.held:
            g.held[seq] = (item, now)
            out += self._release(g)
        if g.held:
            self._holding.add(key)
        else:
            self._holding.discard(key)
        return out

    def holds(self, src: bytes, group: bytes, seq: int) -> bool:
        """True while message ``seq`` waits here for an earlier one."""
        g = self._groups.get((src, group))
        return g is not None and seq in g.held

    def end(self, src: bytes, group: bytes) -> None:
        """Forget a finished group."""
        self._groups.pop((src, group), None)
        self._holding.discard((src, group))

    def expire(self, now: float) -> list[tuple[T, bool]]:
        """Give up on gaps older than hold_timeout; return what that releases."""
        out: list[tuple[T, bool]] = []
        for key in list(self._holding):
            g = self._groups[key]
            while g.held and now - min(t for _, t in g.held.values()) > self.hold_timeout:
                first = min(g.held)
                self.gaps += first - g.expected
                # Only the first gap is skipped per round: later gaps get their own full
                # hold_timeout unless their items too have waited that long.
                out += self._release(g, first)
            if not g.held:
                self._holding.discard(key)
        if now >= self._next_sweep:
            # A full scan, so it runs a few times per idle_timeout rather than on every
            # call; an idle key is forgotten at most idle_timeout / 8 late.
            self._next_sweep = now + self.idle_timeout / 8
            for key in [
                k
                for k, g in self._groups.items()
                if not g.held and now - g.last_push > self.idle_timeout
            ]:
                del self._groups[key]
        return out

    def _release(self, g: _Group[T], skip_to: int = 0) -> list[tuple[T, bool]]:
        """Advance to ``skip_to`` delivering held items on the way, then what is contiguous."""
        out: list[tuple[T, bool]] = []
        if skip_to > g.expected:
            out += [self._pop(g, s) for s in sorted(s for s in g.held if s < skip_to)]
            g.expected = skip_to
        while g.expected in g.held:
            out.append(self._pop(g, g.expected))
            g.expected += 1
        return out

    @staticmethod
    def _pop(g: _Group[T], seq: int) -> tuple[T, bool]:
        item, _ = g.held.pop(seq)
        # The first item delivered for a key is flagged when its predecessors will never
        # arrive here (they went to another member or were given up): the application has
        # to recover the group's state before handling it.
        reassigned = not g.delivered and seq > 1
        g.delivered = True
        return item, reassigned

    def __len__(self) -> int:
        return len(self._groups)


class Suspicion:
    """Declares an address dead after ``threshold`` failed reliable sends in a row."""

    def __init__(self, threshold: int = 3) -> None:
        if threshold < 1:
            raise InvalidArgument(f"Suspicion threshold must be at least 1, got {threshold}")
        self.threshold = threshold
        self._counts: dict[bytes, int] = {}

    def failed(self, address: bytes) -> bool:
        """Count one given-up send; True exactly when this makes the address dead."""
        count = self._counts.get(address, 0) + 1
        self._counts[address] = count
        return count == self.threshold

    def heard(self, address: bytes) -> None:
        """Any message from the address proves it alive: clear its suspicion."""
        self._counts.pop(address, None)

    def count(self, address: bytes) -> int:
        return self._counts.get(address, 0)

    def dead(self, address: bytes) -> bool:
        return self._counts.get(address, 0) >= self.threshold
