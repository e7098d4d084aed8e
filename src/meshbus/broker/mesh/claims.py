"""Mesh-wide reservations: how two brokers never hand out the same address or slot.

A broker that wants a key -- a fixed unicast address a connector registers, an
address a connector brings along after failover or a move, or the dynamic-id
slot of a joining broker -- first reserves it in its own table, then asks every
peer (CLAIM) and takes the key only if every one of them grants it. Each broker
arbitrates with the same rule, ``ClaimTable.reserve``:

* a key owned by another session, or reserved for one, is refused;
* except that when the reservation is this broker's *own* pending claim and the
  claimant's name is smaller, the claimant wins: the reservation passes to it, and
  our own claim fails when its answers are counted (``held_by``).

So of two brokers claiming one key at the same moment the smaller name wins in
the first round. Of three or more, never two win, but in some orders of the
messages none does (each arbiter granted another first); the claimants then try
again after a random pause (meshbus.broker.handlers.services), and one gets there. A loser
finds out from the refusal it gets. A connector's own session never conflicts
with itself, which is what lets it take its addresses along when it moves.

Reservations end when the claimant announces the key (its ADD), gives it back
(RELEASE), or its link breaks; a slot reservation lasts as long as the link to
the broker that holds the slot.

A plain data structure: no I/O, no timers.
"""

from __future__ import annotations

from dataclasses import dataclass

# Claim keys are 16 bytes like addresses; a slot key has cast byte 0, which no address has.
_SLOT_PREFIX = b"\x00slot"


def slot_key(slot: int) -> bytes:
    return _SLOT_PREFIX + slot.to_bytes(2, "big") + bytes(16 - len(_SLOT_PREFIX) - 2)


def is_slot_key(key: bytes) -> bool:
    return key.startswith(_SLOT_PREFIX)


@dataclass(frozen=True, slots=True)
class Reservation:
    holder: str  # the name of the broker that holds it
    session: bytes


class ClaimTable:
    def __init__(self, me: str) -> None:
        self.me = me
        self._held: dict[bytes, Reservation] = {}

    def __len__(self) -> int:
        return len(self._held)

    def reserve(self, key: bytes, holder: str, session: bytes, owner_session: bytes | None) -> bool:
        """Grant ``key`` to ``holder`` for ``session``, or refuse it (False).

        ``owner_session`` is the session of the key's current owner in the routing
        table, None if nobody owns it. An empty session never matches another, so a
        key in use that may not be taken over is passed as ``b""``.
        """
        if owner_session is not None and not _same(owner_session, session):
            return False
        held = self._held.get(key)
        if (
            held is not None
            and not _same(held.session, session)
            and not (held.holder == self.me and holder < self.me)
        ):
            return False
        self._held[key] = Reservation(holder, session)
        return True

    def held_by(self, key: bytes, holder: str, session: bytes) -> bool:
        """True if ``key`` is still reserved for ``holder`` and ``session``."""
        return self._held.get(key) == Reservation(holder, session)

    def release(self, key: bytes, holder: str) -> None:
        """End ``holder``'s reservation of ``key``, if it has one."""
        held = self._held.get(key)
        if held is not None and held.holder == holder:
            del self._held[key]

    def drop_holder(self, holder: str) -> int:
        """End every reservation of ``holder`` (its link broke); returns how many."""
        gone = [key for key, held in self._held.items() if held.holder == holder]
        for key in gone:
            del self._held[key]
        return len(gone)

    def reserved_slots(self) -> set[int]:
        return {int.from_bytes(key[5:7], "big") for key in self._held if is_slot_key(key)}


def _same(a: bytes, b: bytes) -> bool:
    return bool(a) and a == b
