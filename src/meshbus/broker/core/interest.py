"""NATS interest between brokers: what this broker tells its peers of its NATS clients'
subscriptions, and what it holds of theirs (docs/nats.md, "Across the mesh").

Two plain tables, no I/O:

* ``LocalInterest`` counts this broker's subscriptions by (subject pattern, queue
  group) and says when a change is one its peers must hear: many local SUBs of one
  subject are one entry to them. A plain subscription is present or not (0 or 1 to the
  peers); a queue group's count goes with every change, since the origin of a message
  picks a broker weighted by that count.
* ``PeerInterest`` holds each peer's entries as ``PeerSubscription`` rows of the
  broker's ``SubjectTable``, beside the local subscriptions: one lookup of a published
  subject then gives its local subscribers and the peers to send it to. Every value a
  peer sends is checked (a valid pattern, a queue group without whitespace, at most
  ``max_per_peer`` entries) before it touches the table.

Each operation a peer sends states the whole count of its entry, so a snapshot and the
changes made while it was written need no order between them: the later one is right.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

from meshbus.broker.core.subjects import is_valid_queue, is_valid_subject
from meshbus.errors import InvalidArgument

__all__ = ["InterestError", "LocalInterest", "PeerInterest", "PeerSubscription"]

P = TypeVar("P", bound=Hashable)

Key = tuple[bytes, bytes]  # (subject pattern, queue group: b"" for none)


class InterestError(InvalidArgument):
    """An interest operation from a peer that this broker does not take: an invalid
    subject or queue group, a count out of range, or one entry too many."""


class LocalInterest:
    """This broker's subscriptions counted by (subject, queue): what its peers are told."""

    def __init__(self) -> None:
        self._counts: dict[Key, int] = {}

    def __len__(self) -> int:
        """Entries the peers hold of this broker."""
        return len(self._counts)

    def add(self, subject: bytes, queue: bytes) -> int | None:
        """One more subscription; the count to tell the peers, or None when they need
        not hear of it (a plain subject that had one already)."""
        key = (subject, queue)
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        return count if queue or count == 1 else None

    def remove(self, subject: bytes, queue: bytes) -> int | None:
        """One subscription less; the count to tell the peers (0: none left), or None when
        they need not hear of it. Removing what was never added is a None."""
        key = (subject, queue)
        count = self._counts.get(key, 0)
        if not count:
            return None
        if count == 1:
            del self._counts[key]
            return 0
        self._counts[key] = count - 1
        return count - 1 if queue else None

    def snapshot(self) -> list[tuple[bytes, bytes, int]]:
        """Every entry as the peers hold it: (subject, queue, count)."""
        return [
            (subject, queue, count if queue else 1)
            for (subject, queue), count in self._counts.items()
        ]


class PeerSubscription(Generic[P]):
    """A peer's interest in a subject, as a row of the subject table: ``peer`` gets the
    messages; ``weight`` is its members of ``queue`` (1 for a plain interest). Compared
    by identity; the weight changes in place, so a cached match stays right."""

    __slots__ = ("peer", "queue", "subject", "weight")

    def __init__(self, peer: P, subject: bytes, queue: bytes, weight: int) -> None:
        self.peer = peer
        self.subject = subject
        self.queue = queue
        self.weight = weight


class _Rows(Protocol[P]):
    """The part of the subject table this one writes to."""

    def insert(self, subject: bytes, queue: bytes, sub: PeerSubscription[P]) -> None: ...

    def remove(self, subject: bytes, queue: bytes, sub: PeerSubscription[P]) -> bool: ...


class PeerInterest(Generic[P]):
    """Every peer's entries, kept in the subject table.

    ``changed(subject)`` hears of each row added or removed (the NATS bridge's routing
    decisions depend on them, meshbus.broker.nats.bridge)."""

    def __init__(
        self,
        table: _Rows[P],
        max_per_peer: int,
        max_weight: int,
        changed: Callable[[bytes], None],
    ) -> None:
        self._table = table
        self._max_per_peer = max_per_peer
        self._max_weight = max_weight
        self._changed = changed
        self._by_peer: dict[P, dict[Key, PeerSubscription[P]]] = {}

    def count(self, peer: P) -> int:
        """Entries held for ``peer``."""
        return len(self._by_peer.get(peer, ()))

    def apply(self, peer: P, subject: bytes, queue: bytes, count: int) -> None:
        """``peer`` has ``count`` subscriptions to ``subject`` in ``queue`` now (0: none).
        InterestError, the table unchanged, for what no broker would send."""
        if not is_valid_subject(subject):
            raise InterestError(f"interest in an invalid subject {subject[:64]!r}")
        if queue and not is_valid_queue(queue):
            raise InterestError(f"interest in an invalid queue group {queue[:64]!r}")
        if not 0 <= count <= self._max_weight:
            raise InterestError(f"an interest count of {count} (at most {self._max_weight})")
        entries = self._by_peer.setdefault(peer, {})
        key = (subject, queue)
        row = entries.get(key)
        if row is not None:
            if count:
                row.weight = count if queue else 1
                return
            del entries[key]
            if not entries:
                del self._by_peer[peer]
            self._table.remove(subject, queue, row)
            self._changed(subject)
            return
        if not count:
            if not entries:
                del self._by_peer[peer]
            return
        if len(entries) >= self._max_per_peer:
            raise InterestError(
                f"more than {self._max_per_peer} NATS interests from one broker "
                "(its --max-connectors times --max-services)"
            )
        row = PeerSubscription(peer, subject, queue, count if queue else 1)
        entries[key] = row
        self._table.insert(subject, queue, row)
        self._changed(subject)

    def drop(self, peer: P, limit: int | None = None) -> int:
        """A peer is gone: its entries leave the table, at most ``limit`` of them (the
        caller takes the rest later, ``count`` says how many are left). How many left
        now."""
        entries = self._by_peer.get(peer)
        if entries is None:
            return 0
        keys = list(entries) if limit is None else list(itertools.islice(entries, limit))
        for key in keys:
            subject, queue = key
            self._table.remove(subject, queue, entries.pop(key))
            self._changed(subject)
        if not entries:
            del self._by_peer[peer]
        return len(keys)
