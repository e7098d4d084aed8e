"""The pending-request table: reverse routes for responses (docs/protocol.md, requests).

A request is keyed by (requester address, message id): message ids are chosen
by the requester's connector, so they are unique only per requester. The entry
remembers the link the request came in on, its deadline, and who may answer it.
A response names the request in ``response_for`` and is sent to the requester's
address, which gives the same key back; ``accept_response`` pops the entry and
returns the link, when the response came from whoever may answer.

Who may answer (docs/protocol.md, "Request / response"): the request's destination
address itself, for a unicast request; otherwise (anycast, multicast) a response
that came in over one of the links the request went out on -- the one member's
connector the broker picked, the multicast members' connectors, or the peer broker it
went to (which keeps an entry of its own for the members it delivered to, the
requester's link being that peer's). A response from anyone
else leaves the entry where it was, so a forger cannot answer first; the check is
a comparison with what the entry holds, no lookup.

Deadlines live in a heap with lazy deletion: resolving an entry leaves a stale
heap item behind, which ``expire`` skips. To keep that garbage bounded the heap
is rebuilt when stale items outnumber live ones by more than two to one (plus
``COMPACT_SLACK``); an item
is live only if its sequence number is the one its entry was added with, so an
entry replaced under the same key leaves nothing behind either.

Each link has the set of keys of its requests (``_by_link``), and each peer link the
set of keys of the requests that went out on it alone (``_by_via``): closing a link
costs what that link had in the table, never a scan of the whole table, and
``count`` (the broker's cap on a connector's requests in flight) is one lookup.
The sets are kept in step with the entries on add, resolve, expire and drop, and
a link's sets go when the link is dropped.

A request may also count in a ``Tally`` shared by several links -- its user's
(meshbus.broker.core.usage, the user's ``requests`` quota): the entry holds it, and
every removal of the entry takes one off, so the user's count is one int to read.
"""

from __future__ import annotations

import enum
import heapq
import sys
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

L = TypeVar("L", bound=Hashable)

Key = tuple[bytes, int]
# An entry: (link, deadline, dst, seq, via, the link's key set, responders, tally).
_Entry = tuple[L, float, bytes, int, "L | None", set[Key], tuple[L, ...], "Tally | None"]
# Stale heap items tolerated on top of 3x the live entries before a rebuild; the slack
# keeps a small table (a few requests in flight) from rebuilding every few adds.
COMPACT_SLACK = 1024


class Refusal(enum.Enum):
    """Why ``accept_response`` did not take a response although its request waits."""

    WRONG_RESPONDER = "wrong responder"


WRONG_RESPONDER: Literal[Refusal.WRONG_RESPONDER] = Refusal.WRONG_RESPONDER


class Tally:
    """How many requests of several links wait (a user's links: ``add``'s ``tally``)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


@dataclass(slots=True)
class PendingEntry(Generic[L]):
    requester: bytes
    msg_id: int
    link: L
    deadline: float
    dst: bytes
    seq: int = field(default=0, compare=False)  # the heap item this entry was added with


class PendingTable(Generic[L]):
    def __init__(self, max_per_link: int = sys.maxsize) -> None:
        """``max_per_link``: how many requests of one link may wait (``add`` refuses more)."""
        self.max_per_link = max_per_link
        # key -> (link, deadline, dst, seq, via, the link's key set, responders): a plain tuple, the
        # cheapest thing to build on every request; PendingEntry objects are made only for
        # the few that fail. The key set in the entry spares resolve a lookup.
        self._entries: dict[Key, _Entry[L]] = {}
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = 0
        self._by_link: dict[L, set[Key]] = {}  # the keys of each link's requests
        self._by_via: dict[L, set[Key]] = {}  # the keys of requests out on one peer alone

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self,
        requester: bytes,
        msg_id: int,
        link: L,
        deadline: float,
        dst: bytes,
        via: L | None = None,
        *,
        responders: tuple[L, ...] = (),
        capped: bool = True,
        tally: Tally | None = None,
    ) -> bool:
        """Record a request that came in on ``link``; ``via`` is the one link it went out
        on when that is all that can answer it (a peer broker: see ``drop_via``). A second
        request with the same key replaces the first.

        ``responders``: the links a response must come in over; empty, the response must
        come from the address ``dst`` (a unicast request). Returns False, and records
        nothing, when ``link`` already has ``max_per_link`` requests waiting, unless not
        ``capped``: a request a peer broker forwarded, capped at its requester's broker.
        ``tally`` counts the request while it waits (the caller checks its cap)."""
        keys = self._by_link.get(link)
        if keys is None:
            keys = self._by_link[link] = set()
        elif capped and len(keys) >= self.max_per_link:
            return False
        key = (requester, msg_id)
        seq = self._seq = self._seq + 1
        entry = (link, deadline, dst, seq, via, keys, responders, tally)
        entries = self._entries
        old = entries.setdefault(key, entry)
        if old is not entry:  # a replacement: rare, so one lookup on the common path
            self._unindex(key, old)
            entries[key] = entry
        keys.add(key)
        if tally is not None:
            tally.count += 1
        if via is not None:
            vias = self._by_via.get(via)
            if vias is None:
                vias = self._by_via[via] = set()
            vias.add(key)
        heap = self._heap
        heapq.heappush(heap, (deadline, seq, key))
        if len(heap) > COMPACT_SLACK + 3 * len(entries):
            self._compact()
        return True

    def count(self, link: L) -> int:
        """How many requests made over ``link`` are waiting."""
        keys = self._by_link.get(link)
        return 0 if keys is None else len(keys)

    def resolve(self, requester: bytes, msg_id: int) -> L | None:
        """Pop the entry of request (requester, msg_id), whoever tells of it (a NO_ROUTE
        from the peer it went to); None if there is none."""
        key = (requester, msg_id)
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._unindex(key, entry)
        return entry[0]

    def accept_response(
        self, requester: bytes, msg_id: int, src: bytes, came_in_on: L
    ) -> L | Literal[Refusal.WRONG_RESPONDER] | None:
        """Pop the entry a response from ``src``, read on link ``came_in_on``, answers and
        return the requester's link; None if no request waits (late, or answered already);
        ``WRONG_RESPONDER``, and the entry kept, if ``src`` may not answer it."""
        key = (requester, msg_id)
        entries = self._entries
        entry = entries.pop(key, None)
        if entry is None:
            return None
        responders = entry[6]
        if (came_in_on not in responders) if responders else (src != entry[2]):
            # Put back as it was: its heap item and key sets never left. Popped first
            # because a match is the common case: one dict operation on it.
            entries[key] = entry
            return WRONG_RESPONDER
        entry[5].discard(key)  # _unindex, inline: this is every response's path
        if entry[4] is not None:
            self._unindex_via(key, entry[4])
        if entry[7] is not None:
            entry[7].count -= 1
        return entry[0]

    def _unindex(self, key: Key, entry: _Entry[L]) -> None:
        entry[5].discard(key)
        if entry[4] is not None:
            self._unindex_via(key, entry[4])
        if entry[7] is not None:
            entry[7].count -= 1

    def _unindex_via(self, key: Key, via: L) -> None:
        vias = self._by_via.get(via)
        if vias is not None:
            vias.discard(key)

    def expire(self, now: float) -> list[PendingEntry[L]]:
        """Remove and return every entry whose deadline is at or before ``now``."""
        expired: list[PendingEntry[L]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if entry is not None and entry[3] == seq:
                del self._entries[key]
                self._unindex(key, entry)
                link, deadline, dst = entry[:3]
                expired.append(PendingEntry(key[0], key[1], link, deadline, dst, seq))
        return expired

    def drop_via(self, via: L) -> list[PendingEntry[L]]:
        """Remove and return the requests that went out on ``via`` alone: the peer broker
        behind it is gone, so no response can come, and the requesters can be told now
        rather than at their deadlines."""
        entries = self._entries
        gone: list[PendingEntry[L]] = []
        for key in self._by_via.pop(via, ()):
            entry = entries.pop(key, None)
            if entry is None:  # never: the sets follow the entries
                continue
            entry[5].discard(key)
            if entry[7] is not None:
                entry[7].count -= 1
            gone.append(PendingEntry(key[0], key[1], entry[0], entry[1], entry[2], entry[3]))
        return gone

    def next_deadline(self) -> float | None:
        """The earliest deadline in the heap (possibly of a resolved entry), or None."""
        return self._heap[0][0] if self._heap else None

    def drop_link(self, link: L) -> int:
        """Forget the requests made over ``link`` (its requester is gone); returns how many."""
        entries = self._entries
        keys = self._by_link.pop(link, ())
        for key in keys:
            entry = entries.pop(key, None)
            if entry is None:
                continue
            if entry[4] is not None:
                self._unindex_via(key, entry[4])
            if entry[7] is not None:
                entry[7].count -= 1
        return len(keys)

    def _compact(self) -> None:
        entries = self._entries
        self._heap = [
            item
            for item in self._heap
            if (entry := entries.get(item[2])) is not None and entry[3] == item[1]
        ]
        heapq.heapify(self._heap)
