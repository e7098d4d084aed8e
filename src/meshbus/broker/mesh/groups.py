"""Message groups mesh-wide: which member of an anycast group holds each group.

The table is the ordered-group-transfer seed's transmission management table:
group id -> member, last update time, idle expiry; an entry goes after the
group's final message (GROUP_END) or when it has been idle past its expiry.

Who decides (docs/groups.md has the reasoning). Each group has a *home* broker,
chosen by rendezvous hashing of the group id over the brokers of the mesh, so
every broker names the same home without asking anyone and the decisions are
spread over all brokers -- there is no single deciding node. Only the home binds
a group; it sends each binding (and each refresh and drop) to every peer, so
every broker holds the same table. When the home dies the next broker in the
group's rendezvous order becomes its home and already has the binding.

A member that cannot be reached is reported by the sender (GROUP_BIND with
``failed``). The home moves the group only when that member has been missing
from the anycast group for ``grace`` seconds: a member whose connector fails over
comes back with the same address within that time, and its group stays.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from meshbus.protocol.control import GroupOp

GroupKey = tuple[bytes, bytes]  # (anycast address, group id)


@dataclass
class Binding:
    member: bytes
    updated: float
    expiry: float
    missing_since: float = 0.0  # when the home first found the member gone (0: present)
    moved: bool = False  # bound to another member before
    # The services sending to the group, known at its home: the group ends when the last
    # of them sent its final message. A replica does not know them.
    senders: set[bytes] = field(default_factory=set)


def home_of(key: bytes, brokers: Iterable[str]) -> str:
    """The broker that decides for group ``key``: highest rendezvous hash wins."""
    return max(
        brokers, key=lambda name: hashlib.blake2b(key + name.encode(), digest_size=8).digest()
    )


class GroupTable:
    """Bindings of message groups to members; the same on every broker."""

    def __init__(
        self, default_expiry: float = 300.0, grace: float = 4.0, rng: random.Random | None = None
    ) -> None:
        self.default_expiry = default_expiry
        self.grace = grace
        self._bindings: dict[GroupKey, Binding] = {}
        self._held: Counter[bytes] = Counter()  # member -> groups it holds
        self._rng = rng or random.Random()
        self.reassigned = 0

    def __len__(self) -> int:
        return len(self._bindings)

    def get(self, key: GroupKey) -> Binding | None:
        return self._bindings.get(key)

    def holds(self, member: bytes) -> int:
        return self._held[member]

    def bind(
        self,
        key: GroupKey,
        members: list[bytes],
        failed: bytes,
        expiry: float,
        now: float,
        hold: bool = False,
    ) -> Binding | None:
        """The binding of ``key`` for a sender at the home: kept (and refreshed) while its
        member is in ``members``, missing for less than the grace, or ``hold`` (a broker
        the member may be on is out of reach, not gone); otherwise a new member, one that
        holds no group when there is one. None: no member at all."""
        binding = self._bindings.get(key)
        if binding is not None:
            if binding.member in members:
                binding.missing_since = 0.0
                binding.updated = now
                binding.expiry = expiry or self.default_expiry  # also revives an ended one
                return binding
            if binding.missing_since == 0.0:
                binding.missing_since = now
            if now - binding.missing_since < self.grace or hold or not members:
                binding.updated = now
                return binding
        if not members:
            return None
        candidates = [m for m in members if m != failed] or members
        fewest = min(self._held[m] for m in candidates)
        member = self._rng.choice([m for m in candidates if self._held[m] == fewest])
        moved = binding is not None
        if moved:
            self.reassigned += 1
        senders = binding.senders if binding is not None else set()
        bound = self.put(key, member, expiry or self.default_expiry, now, moved=moved)
        bound.senders = senders
        return bound

    def put(
        self, key: GroupKey, member: bytes, expiry: float, now: float, *, moved: bool = False
    ) -> Binding:
        """Record a binding (made here, or replicated from the group's home)."""
        old = self._bindings.get(key)
        if old is not None:
            self._release(old.member)
            moved = moved or old.member != member
        binding = Binding(member, now, expiry, moved=moved)
        self._bindings[key] = binding
        self._held[member] += 1
        return binding

    def end(self, key: GroupKey, sender: bytes, now: float) -> None:
        """``sender`` ended the group. After its last sender, the binding lingers for the
        grace and then expires: a sender whose first message of the group comes a moment
        after another's final (it bound the group later) still finds the same member. A
        sender the home does not know (the home changed since it bound) leaves the binding
        to its idle expiry, rather than cut off senders the home does not know either."""
        binding = self._bindings.get(key)
        if binding is None or sender not in binding.senders:
            return
        binding.senders.discard(sender)
        if not binding.senders:
            binding.updated = now
            binding.expiry = self.grace

    def drop(self, key: GroupKey) -> bool:
        binding = self._bindings.pop(key, None)
        if binding is None:
            return False
        self._release(binding.member)
        return True

    def _release(self, member: bytes) -> None:
        self._held[member] -= 1
        if self._held[member] <= 0:
            del self._held[member]

    def expire(self, now: float) -> list[GroupKey]:
        """Drop the bindings idle past their expiry (the seed's deletion process)."""
        idle = [k for k, b in self._bindings.items() if now - b.updated > b.expiry]
        for key in idle:
            self.drop(key)
        return idle

    def ops(self) -> Iterator[GroupOp]:
        for (anycast, group), binding in self._bindings.items():
            yield (anycast, group, binding.member, binding.expiry)
