"""The brokers this broker should be linked to and is not: whom to dial, and when.

A mesh heals only if someone dials. A broker keeps as a *candidate*:

* every broker it was linked to and lost without a goodbye (a crash, a pause
  past the heartbeat budget, a cut link): its peers dropped it, but it may come
  back at the same address, or already be back;
* every ready broker it hears of in a peer's broker list (gossip, sent with
  every heartbeat) and is not linked to: a link between two brokers that both
  still reach a third is repaired this way;
* its seeds, dialled only while it is linked to no broker at all (an island of
  one finds its way back).

A candidate is dialled again after a jittered, capped backoff -- the first time
at once, then after ``base``, ``2 * base``, ... up to ``cap``, each scaled by a
random factor in [0.5, 1] so two brokers do not dial each other in lockstep.
It stops being one when the link is up, when the broker is known to have left
(it said goodbye, or announced its drain), or after ``forget_after`` seconds of
failed attempts (it comes back as a candidate the moment a peer lists it again
or it dials in). A broker replaced under its name (restarted elsewhere) is
dialled at the address it was last heard at.

A plain table: no I/O, no timers; the mesh asks it once per heartbeat.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Candidate:
    name: str  # "" for a seed, known only by its address
    address: str
    since: float  # when it became a candidate (for ``forget_after``)
    attempts: int = 0  # failed dials in a row
    due: float = 0.0  # when to dial next


class RedialTable:
    def __init__(
        self, *, base: float, cap: float, forget_after: float, rng: random.Random | None = None
    ) -> None:
        self._base = base
        self._cap = cap
        self._forget_after = forget_after
        self._rng = rng or random.Random()
        self._named: dict[str, Candidate] = {}
        self._seeds: dict[str, Candidate] = {}

    def __len__(self) -> int:
        return len(self._named)

    def names(self) -> list[str]:
        return sorted(self._named)

    def add_seeds(self, addresses: list[str], now: float) -> None:
        for address in addresses:
            self._seeds.setdefault(address, Candidate("", address, now))

    def want(self, name: str, address: str, now: float) -> None:
        """Be linked to broker ``name`` at ``address``: a new candidate is due at once;
        a known one takes the newer address and keeps its backoff."""
        candidate = self._named.get(name)
        if candidate is None:
            self._named[name] = Candidate(name, address, now, due=now)
        else:
            candidate.address = address

    def linked(self, name: str, address: str) -> None:
        """The link to ``name`` is up: no longer a candidate; a seed at its address has
        done its job too (its backoff starts afresh)."""
        self._named.pop(name, None)
        seed = self._seeds.get(address)
        if seed is not None:
            seed.attempts = 0
            seed.due = 0.0

    def left(self, name: str) -> None:
        """``name`` left the mesh (said goodbye, or drained): never dial it again."""
        self._named.pop(name, None)

    def failed(self, name: str, address: str, now: float) -> None:
        """A dial of ``name`` (or of seed ``address``, for name "") failed."""
        candidate = self._named.get(name) if name else self._seeds.get(address)
        if candidate is None:
            return
        if name and now - candidate.since >= self._forget_after:
            del self._named[name]
            return
        delay = min(self._cap, self._base * 2**candidate.attempts)
        candidate.attempts += 1
        candidate.due = now + delay * self._rng.uniform(0.5, 1.0)

    def due(self, now: float, *, isolated: bool) -> list[Candidate]:
        """The candidates to dial now; seeds only when ``isolated`` (no peer at all).
        Each is pushed back by one backoff step, so a dial that never answers (a host
        that stopped) is not dialled again before its step is up."""
        pool = list(self._named.values())
        if isolated:
            pool.extend(self._seeds.values())
        ready = [c for c in pool if c.due <= now]
        for candidate in ready:
            delay = min(self._cap, self._base * 2**candidate.attempts)
            candidate.due = now + delay * self._rng.uniform(0.5, 1.0)
        return ready
